"""What the bench tools report is what happened in the timed part (found by an adversarial review
of the bench arithmetic): no prefill served from a cache the warm-up or an earlier phase filled,
no warm-up drafts in the acceptance figures, numpy's percentiles, one request's hit rate."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from pagedllm.bench.common import percentile


def _args(add_args, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(argv)


@pytest.mark.parametrize("values", [[0.1] * 63 + [10.0], [0.1] * 30 + [10.0] * 2, [3.0], [1.0, 2.0], list(range(17))])
def test_percentiles_interpolate_as_numpy_does(values):
    """A nearest rank gave p99 = 100 ms for 63 requests of 100 ms and one of 10 s (numpy: 3.76 s)."""
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def _hits_per_generate(monkeypatch) -> list[int]:
    """The prefix-cache hits of each ``LLM.generate`` call from here on."""
    from pagedllm import LLM

    hits: list[int] = []
    real = LLM.generate

    def spy(self, *a, **k):
        before = self.llm_engine.stats.prefix_hits_total
        out = real(self, *a, **k)
        hits.append(self.llm_engine.stats.prefix_hits_total - before)
        return out

    monkeypatch.setattr(LLM, "generate", spy)
    return hits


def test_throughput_timed_run_prefills_what_the_warm_up_cached(tiny_llama_tok, monkeypatch):
    """The warm-up ran the timed run's first four prompts: with the engine's default caching on,
    those prompts' prefill was served from the cache (94% of it with four prompts)."""
    from pagedllm.bench import throughput

    hits = _hits_per_generate(monkeypatch)
    args = _args(throughput.add_args, ["--num-prompts", "4", "--input-len", "64", "--output-len", "2"])
    result = throughput.run(args, {"model": str(tiny_llama_tok), "num_kv_blocks": 128, "block_size": 16,
                                   "log_stats_interval": 1e9})  # fmt: skip
    assert result["pagedllm"]["enable_prefix_caching"] is True
    assert len(hits) == 2 and hits[1] == 0, hits  # warm-up, timed run


def test_lora_phases_each_start_from_a_cold_prefix_cache(tiny_llama_tok, monkeypatch):
    """Every phase of ``bench lora`` runs the same prompts: a cache kept across them gave the later
    phases (and repeats) their prefill for free."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.bench.lora import _timed

    llm = LLM(str(tiny_llama_tok), num_kv_blocks=64, log_stats_interval=1e9)
    hits = _hits_per_generate(monkeypatch)
    prompts = [{"prompt_token_ids": list(range(100, 164))}, {"prompt_token_ids": list(range(200, 264))}]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for _ in range(3):
        _timed(llm, prompts, params, None)
    assert hits == [0, 0, 0]


def test_latency_acceptance_figures_leave_the_warm_up_out(tiny_llama_tok, monkeypatch):
    """The engine's counters run from its start; the warm-up's drafts (here made certain by
    adding some to the counters during it) are not part of what the run measured."""
    from pagedllm.bench import latency
    from pagedllm.engine.stats import SpecDecodeStats

    totals = []  # the engine's own counters after each request
    real_one = latency._one

    def spy(engine, prompt, params, request_id):
        out = real_one(engine, prompt, params, request_id)
        if request_id == "warmup":
            engine.stats.spec_total.add(SpecDecodeStats(5, 15, 7, [4, 2, 1]))
        elif len(totals) == 1:  # the first timed request: drafts of 4 tokens, so drafts != draft tokens
            engine.stats.spec_total.add(SpecDecodeStats(2, 8, 3, [2, 1]))
        s = engine.stats.spec_total
        totals.append((s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens))
        return out

    monkeypatch.setattr(latency, "_one", spy)
    args = _args(latency.add_args, ["--input-len", "16", "--output-len", "64", "--num-iters", "2", "--no-compare-plain"])
    engine = {"model": str(tiny_llama_tok), "dtype": "float32", "num_kv_blocks": 64, "log_stats_interval": 1e9,
              "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}}  # fmt: skip
    spec = latency.run(args, engine)["spec_decode"]
    warm, end = totals[0], totals[-1]
    timed = tuple(e - w for e, w in zip(end, warm))
    assert timed[0] > 0, "the timed part drafted nothing: this test would not tell"
    assert (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]) == timed
    assert spec["mean_acceptance_length"] == pytest.approx(1 + timed[2] / timed[0])
    assert spec["acceptance_rate"] == pytest.approx(timed[2] / timed[1])


def test_latency_figures_from_known_requests(tiny_llama_tok, monkeypatch):
    """TTFT and per-token statistics are those of the timed requests (a mutation audit took TTFT's
    90th percentile for its 99th and no test failed)."""
    from pagedllm.bench import latency

    ttfts = iter([0.05] + [0.01 * (i + 1) for i in range(10)])  # the warm-up's, then 10, 20, ..., 100 ms
    monkeypatch.setattr(latency, "_one", lambda engine, prompt, params, request_id: (next(ttfts), [0.002, 0.004], 0.01))
    args = _args(latency.add_args, ["--input-len", "16", "--output-len", "8", "--num-iters", "10"])
    engine = {"model": str(tiny_llama_tok), "dtype": "float32", "num_kv_blocks": 64, "log_stats_interval": 1e9}
    res = latency.run(args, engine)
    want = np.percentile([10.0 * (i + 1) for i in range(10)], [50, 99])
    assert res["ttft_ms"]["median"] == pytest.approx(want[0]) and res["ttft_ms"]["p99"] == pytest.approx(want[1])
    assert res["ttft_ms"]["mean"] == pytest.approx(55.0)
    assert res["ms_per_output_token"]["median"] == pytest.approx(3.0) and res["output_tokens"] == 30
    assert res["decode_tokens_per_s"] == pytest.approx(20 / 0.06)


def test_latency_says_so_when_every_answer_is_one_token(tiny_llama_tok, monkeypatch):
    """Text prompts answered by EOS at once leave no gap between tokens: a clear error, not a
    StatisticsError from the mean of nothing."""
    from pagedllm.bench import latency

    monkeypatch.setattr(latency, "_one", lambda engine, prompt, params, request_id: (0.1, [], 0.0))
    args = _args(latency.add_args, ["--input-len", "16", "--output-len", "8", "--num-iters", "1"])
    engine = {"model": str(tiny_llama_tok), "dtype": "float32", "num_kv_blocks": 64, "log_stats_interval": 1e9}
    with pytest.raises(ValueError, match="every answer ended at its first token"):
        latency.run(args, engine)


def test_prefix_cache_bench_reports_the_second_requests_own_hit_rate(tiny_llama_tok):
    """It was the rate over the warm-up, the cold first request and the second: 48.5% where the
    second request found 97% of its prompt."""
    from pagedllm.bench import prefix_cache

    args = _args(prefix_cache.add_args, ["--system-tokens", "256"])
    result = prefix_cache.run(args, {"model": str(tiny_llama_tok), "num_kv_blocks": 128, "log_stats_interval": 1e9})
    second = result["prompt_tokens"][1]
    hits = round(result["prefix_cache_hit_rate"] * second)
    assert hits % 16 == 0 and second - 64 < hits < second  # whole blocks of the shared system prompt


def test_kv_dtype_bench_runs_the_dtype_it_names(tiny_llama_tok):
    """`bench kv-cache-dtype` swaps the KV pools of one engine: the steps must then run the new
    runner. They ran the old one (the engine steps through its executor), so every dtype's
    accuracy row measured fp32 against itself."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.bench.kv_cache_dtype import use_kv_dtype

    kw = dict(dtype="float32", num_kv_blocks=64, max_model_len=256, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(5, 45))}

    def logprobs(llm):
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        return [sorted(step.items()) for step in out.outputs[0].logprobs]

    want = logprobs(LLM(str(tiny_llama_tok), kv_cache_dtype="int8", **kw))
    llm = LLM(str(tiny_llama_tok), **kw)
    fp32 = logprobs(llm)
    use_kv_dtype(llm, "int8")
    assert llm.llm_engine.executor.runner is llm.llm_engine.runner
    got = logprobs(llm)
    assert got == want and got != fp32


def test_latency_refuses_one_output_token_before_loading_a_model(capsys):
    """ms per output token needs a second token: `--output-len 1` ran the whole benchmark, then
    failed on an empty mean."""
    from pagedllm.entrypoints.cli import main

    assert main(["bench", "latency", "--output-len", "1", "--input-len", "8", "--model", "/nonexistent"]) == 2
    assert "--output-len must be at least 2" in capsys.readouterr().err


def test_kv_connector_bench_checks_its_flags_and_stops_its_servers_after_an_error(monkeypatch, tmp_path):
    """`bench kv-connector pd --request-rate 0` crashed in the middle and left its first server
    running (found by a review): the flags are checked when read, and every server started is
    stopped however the run ends."""
    from pagedllm.bench import kv_connector

    for bad in (["pd", "--request-rate", "0"], ["pd", "--num-prompts", "-1"], ["transport", "--input-len", "0"]):
        with pytest.raises(SystemExit):
            _args(kv_connector.add_args, bad)
    stopped = []

    class FakeServer:
        def __init__(self, argv, env=None, timeout=None):
            self.url = "http://127.0.0.1:9"

        def stop(self):
            stopped.append(self)

    def fail(url, args):
        raise RuntimeError("the benchmark client failed")

    monkeypatch.setattr(kv_connector, "CliProcess", FakeServer)
    monkeypatch.setattr(kv_connector, "_drive", fail)
    with pytest.raises(RuntimeError):
        kv_connector.run(_args(kv_connector.add_args, ["pd", "--store", str(tmp_path / "store")]))
    assert len(stopped) == 1 and not kv_connector._started  # the single-instance server, started before the failure


@pytest.mark.parametrize("module, argv", [
    ("kv_cache_dtype", ["--parts", "atention"]),  # a typo ran nothing and exited 0
    ("kv_cache_dtype", ["--rounds", "0"]),
    ("kv_cache_dtype", ["--attention-threads", "2,0"]),
    ("activation_dtype", ["--parts", "acuracy"]),
    ("structured", ["--tasks", "bogus"]),
    ("structured", ["--num-seqs", "0"]),
    ("lora", ["--repeats", "0"]),
    ("lora", ["--adapter-dir", "/nonexistent"]),
])  # fmt: skip
def test_bench_flags_are_checked_when_read(module, argv):
    """Found by a review: each of these crashed after the model loaded, or did nothing at all."""
    import importlib

    with pytest.raises(SystemExit):
        _args(importlib.import_module(f"pagedllm.bench.{module}").add_args, argv)


def test_lora_bench_warms_more_adapters_than_prompts(tiny_llama_tok):
    """--num-adapters above --num-prompts: the warm-up paired n adapters with fewer prompts."""
    from pagedllm.bench import lora

    args = _args(lora.add_args, ["--num-prompts", "2", "--input-len", "8", "--output-len", "2", "--num-adapters", "3",
                                 "--lora-rank", "4"])  # fmt: skip
    result = lora.run(args, {"model": str(tiny_llama_tok), "dtype": "float32", "num_kv_blocks": 64})
    assert result["num_adapters"] == 3 and result["3_adapters"]["output_tokens_per_s"] > 0


def test_bench_serve_says_n_a_for_no_values_and_fails_when_every_request_did(monkeypatch, capsys):
    """Found by a review: one-token answers printed a TPOT of 0.0 ms, and a run whose every
    request failed exited 0 with the reason only in the JSON."""
    from pagedllm.bench import serve

    async def one_token(client, url, body, headers):
        return serve._Result(ok=True, ttft=0.1, e2e=0.1, output_tokens=1)

    async def refused(client, url, body, headers):
        return serve._Result(ok=False, error="HTTP 404: no such model")

    argv = ["--num-prompts", "2", "--input-len", "8", "--output-len", "1", "--model", "m", "--base-url", "http://127.0.0.1:9"]
    monkeypatch.setattr(serve, "_one", one_token)
    res = serve.run(_args(serve.add_args, argv))
    assert res["tpot_ms"]["count"] == 0 and "TPOT n/a" in capsys.readouterr().out
    monkeypatch.setattr(serve, "_one", refused)
    with pytest.raises(ValueError, match="every request failed, e.g.: HTTP 404"):
        serve.run(_args(serve.add_args, argv))


def test_bench_serve_figures_from_known_requests(monkeypatch, tmp_path):
    """Throughput counts successful requests only, TPOT spreads the time after the first token
    over the tokens after the first, and goodput compares milliseconds with milliseconds (a
    mutation audit changed each without a test failing)."""
    from pagedllm.bench import serve

    results = iter([
        serve._Result(ok=True, ttft=0.1, e2e=1.1, output_tokens=11),   # TPOT 100 ms: meets both bounds
        serve._Result(ok=True, ttft=0.3, e2e=0.8, output_tokens=6),    # TPOT 100 ms, TTFT 300 ms: too slow to start
        serve._Result(ok=True, ttft=0.05, e2e=2.05, output_tokens=5),  # TPOT 500 ms
        serve._Result(ok=False, error="HTTP 500: boom"),
    ])  # fmt: skip

    async def known(client, url, body, headers):
        return next(results)

    monkeypatch.setattr(serve, "_one", known)
    argv = ["--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--model", "m",
            "--base-url", "http://127.0.0.1:9", "--goodput", "ttft:200", "tpot:200",
            "--save-result", str(tmp_path / "serve.json")]  # fmt: skip
    res = serve.run(_args(serve.add_args, argv))
    saved = json.loads((tmp_path / "serve.json").read_text())  # strict JSON: the default rate inf as a string
    assert saved["request_rate"] == "inf" and saved["successful_requests"] == 3
    assert res["successful_requests"] == 3 and res["failed_requests"] == 1
    assert res["request_throughput"] * res["duration_s"] == pytest.approx(3)
    assert res["output_token_throughput"] * res["duration_s"] == pytest.approx(22)
    assert res["goodput"] * res["duration_s"] == pytest.approx(1)
    assert res["tpot_ms"]["median"] == pytest.approx(100) and res["tpot_ms"]["mean"] == pytest.approx(700 / 3)
    assert res["ttft_ms"]["median"] == pytest.approx(100) and res["e2el_ms"]["median"] == pytest.approx(1100)
