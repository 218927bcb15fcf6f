import argparse

from pagedllm.bench.common import add_workload_args, workload_from_args
from pagedllm.bench.workloads import WORKLOADS


def _parse(argv: list[str], default: str | None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_workload_args(p, default=default)
    return p.parse_args(argv)


def test_standard_workload_is_used_as_is():
    assert workload_from_args(_parse([], "W2")) == WORKLOADS["W2"]


def test_explicit_lengths_override_the_default_workload():
    w = workload_from_args(_parse(["--input-len", "16", "--output-len", "4"], "W2"))
    assert (w.name, w.input_len, w.output_len) == ("custom", 16, 4)
    assert (w.num_prompts, w.seed) == (WORKLOADS["W2"].num_prompts, WORKLOADS["W2"].seed)
    assert len(w.prompts()[0]) == 16


def test_no_workload_gives_custom_defaults():
    w = workload_from_args(_parse(["--num-prompts", "3", "--prompt-seed", "7"], None))
    assert (w.name, w.num_prompts, w.input_len, w.output_len, w.seed) == ("custom", 3, 256, 128, 7)


def test_peer_settings_apply_to_every_peer_or_to_the_one_named():
    from pagedllm.bench.throughput import peer_setting

    pythons = ["/usr/bin/python3", "vllm=/tmp/vllm/bin/python"]
    assert peer_setting("transformers", pythons) == ["/usr/bin/python3"]
    assert peer_setting("vllm", pythons) == ["/usr/bin/python3", "/tmp/vllm/bin/python"]
    env = ["OMP_NUM_THREADS=2", "vllm:LD_PRELOAD=libtcmalloc_minimal.so.4", "transformers:X=1"]
    assert peer_setting("vllm", env, sep=":") == ["OMP_NUM_THREADS=2", "LD_PRELOAD=libtcmalloc_minimal.so.4"]
    assert peer_setting("transformers", env, sep=":") == ["OMP_NUM_THREADS=2", "X=1"]
