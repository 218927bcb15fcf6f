"""data_parallel_size in the config and the CLI; each replica's share of the cores."""

from __future__ import annotations

import pytest

from pagedllm.config import EngineConfig
from pagedllm.data_parallel.cpu_share import replica_cpu_share, share_from_env
from pagedllm.entrypoints.cli import add_engine_args, engine_config_from_args


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_data_parallel_size_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineConfig(data_parallel_size=bad)


def test_cli_flag():
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--data-parallel-size", "2"])).data_parallel_size == 2
    assert engine_config_from_args(p.parse_args([])).data_parallel_size == 1


def test_one_core_each_on_two_cores():
    cpus = [0, 1]
    assert replica_cpu_share(0, 2, cpus).num_threads == 1
    assert replica_cpu_share(1, 2, cpus, pin=True).cpus == (1,)
    assert replica_cpu_share(0, 2, cpus, pin=True).cpus == (0,)


def test_shares_of_more_cores_and_more_replicas_than_cores():
    cpus = list(range(8))
    assert replica_cpu_share(1, 2, cpus, pin=True) == replica_cpu_share(1, 2, cpus, num_threads=4, pin=True)
    assert replica_cpu_share(1, 2, cpus, pin=True).cpus == (4, 5, 6, 7)
    assert replica_cpu_share(2, 3, [0, 1], pin=True).cpus == (0,)  # wraps round, at least one thread
    assert replica_cpu_share(2, 3, [0, 1]).num_threads == 1


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_NUM_THREADS", "3")
    monkeypatch.setenv("PAGEDLLM_PIN_THREADS", "1")
    share = share_from_env(0, 2)
    assert share.num_threads == 3 and share.cpus is not None
    monkeypatch.setenv("PAGEDLLM_NUM_THREADS", "x")
    with pytest.raises(ValueError, match="PAGEDLLM_NUM_THREADS"):
        share_from_env(0, 2)
    with pytest.raises(ValueError, match="rank"):
        replica_cpu_share(2, 2, [0])
