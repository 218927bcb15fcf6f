"""The DP load balancer: least loaded first, prefix affinity, affinity yields to overload."""

from __future__ import annotations

import pytest

from pagedllm.data_parallel.load_balancer import BalancerConfig, LoadBalancer

BS = 4


def _lb(n: int = 2, **kw) -> LoadBalancer:
    return LoadBalancer(n, BalancerConfig(block_size=BS, **kw))


def test_least_loaded_replica_wins():
    lb = _lb(3)
    lb.loads[0].num_requests = 5
    lb.loads[1].num_requests = 2
    lb.loads[2].num_requests = 3
    assert lb.choose([1, 2]) == 1  # shorter than a block: load only


def test_kv_usage_counts_as_load():
    lb = _lb(2, kv_usage_weight=8.0)
    lb.loads[0].num_requests = 1
    lb.loads[0].kv_cache_usage = 0.0
    lb.loads[1].num_requests = 0
    lb.loads[1].kv_cache_usage = 0.5  # weighs 4 requests
    assert lb.choose([9]) == 0


def test_ties_go_to_the_lowest_index():
    assert _lb(3).choose([]) == 0


def test_same_prefix_goes_to_the_same_replica():
    lb = _lb(2)
    prefix = list(range(100, 100 + 2 * BS))
    first = lb.choose(prefix + [1, 2, 3])
    lb.loads[first].num_requests += 1  # now the other replica is less loaded
    assert lb.choose(prefix + [7]) == first
    # A prompt without that prefix goes to the least loaded replica.
    assert lb.choose(list(range(500, 500 + 2 * BS))) == 1 - first


def test_longest_remembered_prefix_decides():
    lb = _lb(3, affinity_margin=10)
    a = list(range(BS))
    b = list(range(50, 50 + BS))
    lb.loads[0].num_requests = 0
    assert lb.choose(a + b) == 0  # remembers a -> 0 and a+b -> 0
    lb._owner[lb.prefix_hashes(a + b)[1]] = 2  # pretend a+b was served by 2 later
    assert lb.choose(a + b + [1]) == 2
    # Serving a+b on 2 made 2 the last server of prefix a too.
    assert lb.choose(a + [9] * BS) == 2


def test_affinity_yields_when_the_owner_is_overloaded():
    lb = _lb(2, affinity_margin=4)
    prefix = list(range(2 * BS))
    assert lb.choose(prefix) == 0
    lb.loads[0].num_requests = 4  # within the margin of replica 1's 0
    assert lb.choose(prefix) == 0
    lb.loads[0].num_requests = 5  # beyond it: spread
    assert lb.choose(prefix) == 1
    lb.loads[1].num_requests = 5  # the prefix now lives on 1 and it is the one remembered
    lb.loads[0].num_requests = 3
    assert lb.choose(prefix) == 1


def test_salt_separates_prefixes():
    lb = _lb(2)
    prefix = list(range(2 * BS))
    assert lb.prefix_hashes(prefix, salt=1) != lb.prefix_hashes(prefix, salt=0)


def test_dead_replicas_are_skipped():
    lb = _lb(2)
    prefix = list(range(2 * BS))
    assert lb.choose(prefix) == 0
    lb.loads[0].alive = False
    assert lb.choose(prefix) == 1
    lb.loads[1].alive = False
    with pytest.raises(RuntimeError):
        lb.choose(prefix)


def test_memory_is_bounded():
    lb = _lb(2, max_remembered=10)
    for i in range(50):
        lb.choose([i] * (3 * BS))
    assert len(lb._owner) <= 10


def test_bad_size():
    with pytest.raises(ValueError, match="num_replicas"):
        LoadBalancer(0)
