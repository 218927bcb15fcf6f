import argparse

from pagedllm.bench.common import add_workload_args, request_params, sampling_from_args, workload_from_args
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


def test_a_prompt_seed_applies_to_a_standard_workload_too():
    """`bench latency --prompt-seed 7` (W2 by default) ran W2's seed-1 prompts (found by a review)."""
    w = workload_from_args(_parse(["--prompt-seed", "7"], "W2"))
    assert (w.name, w.seed, w.input_len) == ("custom", 7, WORKLOADS["W2"].input_len)
    assert w.prompts() != WORKLOADS["W2"].prompts()
    assert workload_from_args(_parse([], None)).seed == 0


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


def _throughput_args(argv: list[str]) -> argparse.Namespace:
    from pagedllm.bench import throughput

    p = argparse.ArgumentParser()
    throughput.add_args(p)
    return p.parse_args(argv)


def test_sampled_throughput_runs_seed_each_request_and_compare_with_no_peer(monkeypatch):
    import pytest

    from pagedllm.bench import throughput

    assert sampling_from_args(_throughput_args([])) == {}  # greedy by default
    greedy = request_params({}, 8, 3)
    assert (greedy.temperature, greedy.seed, greedy.max_tokens, greedy.ignore_eos) == (0.0, None, 8, True)
    args = _throughput_args(["--num-prompts", "2", "--temperature", "0.8", "--top-p", "0.95", "--presence-penalty", "0.5"])
    sampling = sampling_from_args(args)
    assert sampling == {"temperature": 0.8, "top_p": 0.95, "presence_penalty": 0.5}
    p = request_params(sampling, 16, 5)
    assert (p.temperature, p.top_p, p.presence_penalty, p.seed, p.max_tokens) == (0.8, 0.95, 0.5, 5, 16)
    assert p.logprobs is None
    logprobs = sampling_from_args(_throughput_args(["--logprobs", "5"]))
    assert logprobs == {"logprobs": 5} and request_params(logprobs, 4, 0).logprobs == 5  # greedy, with logprobs
    seen = {}
    monkeypatch.setattr(throughput, "run_pagedllm", lambda w, kw, sampling=None: seen.update(sampling=sampling)
                        or {"engine": "pagedllm", **throughput._rates(w, elapsed=1.0)})  # fmt: skip
    result = throughput.run(args, {"dtype": "float32"})
    assert seen["sampling"] == sampling and result["sampling"] == sampling
    with pytest.raises(ValueError, match="greedy only"):
        throughput.run(_throughput_args(["--temperature", "0.8", "--compare", "transformers"]), {"dtype": "float32"})


def test_sampled_latency_seeds_each_request_alike_in_the_plain_and_the_speculative_pass(tiny_llama_tok, monkeypatch):
    from pagedllm.bench import latency

    seen = []
    real = latency.request_params
    monkeypatch.setattr(latency, "request_params", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    p = argparse.ArgumentParser()
    latency.add_args(p)
    args = p.parse_args(["--input-len", "8", "--output-len", "6", "--num-iters", "2", "--temperature", "0.8",
                         "--top-p", "0.9"])  # fmt: skip
    engine = {"model": str(tiny_llama_tok), "dtype": "float32", "num_kv_blocks": 64,
              "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}  # fmt: skip
    result = latency.run(args, engine)
    assert result["sampling"] == {"temperature": 0.8, "top_p": 0.9}
    timed = [q for q in seen if q.max_tokens == 6]
    assert [q.seed for q in timed] == [0, 1, 0, 1]  # plain pass, then the speculative one
    assert all((q.temperature, q.top_p, q.ignore_eos) == (0.8, 0.9, True) for q in timed)
    assert result["output_tokens"] == result["plain"]["output_tokens"] == 12


def test_throughput_bench_runs_a_single_prompt_workload(tiny_llama_tok):
    """W2 has one prompt: the warm-up used to send four sampling params with it (found by an
    adversarial session: `bench throughput --workload W2` always failed)."""
    from pagedllm.bench import throughput

    args = _throughput_args(["--num-prompts", "1", "--input-len", "8", "--output-len", "4"])
    result = throughput.run(args, {"model": str(tiny_llama_tok), "num_kv_blocks": 64, "log_stats_interval": 1e9})
    assert result["num_prompts"] == 1 and result["pagedllm"]["output_tokens_per_s"] > 0


def test_bad_peer_flags_are_refused_before_any_engine_runs(monkeypatch, tmp_path):
    import pytest

    from pagedllm.bench import throughput

    monkeypatch.setattr(throughput, "run_pagedllm", lambda *a, **k: pytest.fail("pagedllm ran before the peer flags were checked"))
    cases = [
        (["--compare", "vllm"], "needs --peer-model"),
        (["--compare", "transformers", "--peer-env", "FOO"], "--peer-env for transformers: expected KEY=VALUE"),
        (["--compare", "transformers", "--peer-python", str(tmp_path / "none")], "--peer-python for transformers"),
        (["--compare", "vllm", "--peer-model", str(tmp_path / "none")], "--peer-model for vllm"),
    ]
    for argv, message in cases:
        with pytest.raises(ValueError, match=message):
            throughput.run(_throughput_args(["--num-prompts", "2", *argv]), {"dtype": "float32"})


def test_bench_serve_without_a_server_is_a_clear_error(capsys):
    from pagedllm.bench.common import free_port
    from pagedllm.entrypoints.cli import main

    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1"]) == 2
    assert "no server answered" in capsys.readouterr().err
