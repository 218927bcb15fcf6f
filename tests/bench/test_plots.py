"""bench plots: result JSONs written by the real ``run`` functions (engines and HTTP faked) render to PNGs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pagedllm.bench import latency, plots, serve, throughput

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _args(add_args, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(argv)


def _write_throughput(monkeypatch, path: Path, num_prompts: int, compare: bool) -> None:
    """``bench throughput --num-prompts N [--compare transformers] --save-result path`` with fake engines."""
    monkeypatch.setattr(
        throughput,
        "run_pagedllm",
        lambda w, kw, sampling=None: {
            "engine": "pagedllm",
            "num_preemptions": 0,
            **throughput._rates(w, elapsed=0.01 * w.num_prompts + 1),
        },
    )
    monkeypatch.setattr(
        throughput,
        "run_peer",
        lambda engine, w, dtype, plan: {
            "engine": engine,
            "version": "x",
            **throughput._rates(w, elapsed=0.02 * w.num_prompts + 1),
        },
    )
    argv = [
        "--num-prompts",
        str(num_prompts),
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--save-result",
        str(path),
    ]
    throughput.run(
        _args(throughput.add_args, argv + (["--compare", "transformers"] if compare else [])),
        {"dtype": "float32"},
    )


def _write_serve(monkeypatch, path: Path, rate: str) -> None:
    """``bench serve --request-rate R --save-result path`` with every request answered by a fake."""

    async def fake_one(client, url, body, headers):
        n = body["max_tokens"]
        return serve._Result(
            ok=True, ttft=0.2, e2e=0.2 + 0.05 * (n - 1), output_tokens=n, itl=[0.05] * (n - 1)
        )

    monkeypatch.setattr(serve, "_one", fake_one)
    argv = [
        "--num-prompts",
        "2",
        "--output-len",
        "4",
        "--model",
        "m",
        "--request-rate",
        rate,
        "--save-result",
        str(path),
    ]
    serve.run(_args(serve.add_args, argv))


def _assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 0
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_throughput_and_serve_results_render(monkeypatch, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for n in (2, 4, 8):
        _write_throughput(monkeypatch, results / f"tp{n}.json", n, compare=True)
    for rate in ("8", "inf"):
        _write_serve(monkeypatch, results / f"serve_{rate}.json", rate)
    kinds = [plots.classify(json.loads(p.read_text())) for p in sorted(results.glob("*.json"))]
    assert sorted(kinds) == ["serve"] * 2 + ["throughput"] * 3
    # Strict JSON (no Infinity for --request-rate inf), which the plots read back as a float.
    strict = json.loads((results / "serve_inf.json").read_text(), parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert strict["request_rate"] == "inf"
    assert sorted(r["request_rate"] for r in plots.load_results(results)["serve"]) == [8.0, float("inf")]

    out = tmp_path / "out"
    assert plots.main(["--results-dir", str(results), "--out-dir", str(out)]) == 0
    _assert_png(out / "throughput_vs_prompts.png")
    _assert_png(out / "serve_latency_vs_rate.png")


def test_only_throughput_results_skip_the_serve_plot(monkeypatch, tmp_path, capsys):
    for n, compare in ((1, False), (4, True), (16, False)):
        _write_throughput(monkeypatch, tmp_path / f"tp{n}.json", n, compare)
    (tmp_path / "notes.json").write_text('{"unrelated": 1}')
    out = tmp_path / "out"
    assert plots.main(["--results-dir", str(tmp_path), "--out-dir", str(out)]) == 0
    _assert_png(out / "throughput_vs_prompts.png")
    assert not (out / "serve_latency_vs_rate.png").exists()
    assert "no serve results" in capsys.readouterr().out


def test_each_engine_is_labelled_with_its_own_dtype():
    from pagedllm.bench.plots import _engine_label

    r = {"dtype": "float32", "activation_dtype": "int8", "pagedllm": {}, "vllm": {"dtype": "bfloat16"}, "transformers": {}}
    assert _engine_label("pagedllm", r) == "pagedllm (float32, int8 activations)"
    assert _engine_label("vllm", r) == "vllm (bfloat16)"
    assert _engine_label("transformers", r) == "transformers (float32)"  # an older result: the run's dtype
    assert _engine_label("pagedllm", {**r, "kv_cache_dtype": "int8"}) == "pagedllm (float32, int8 activations, int8 KV)"
    assert _engine_label("pagedllm", {**r, "kv_cache_dtype": "auto"}) == "pagedllm (float32, int8 activations)"


def test_one_batch_size_renders_as_bars(monkeypatch, tmp_path):
    """Results at a single batch size (e.g. W1 against the peers) draw one bar per engine."""
    _write_throughput(monkeypatch, tmp_path / "w1.json", 64, compare=True)
    out = tmp_path / "out"
    assert plots.main(["--results-dir", str(tmp_path), "--out-dir", str(out)]) == 0
    _assert_png(out / "throughput_vs_prompts.png")


def _write_spec_latency(monkeypatch, path: Path, workload: str, method: str, speedup: float, sampled: bool = False) -> None:
    """``bench latency --speculative-config ... --save-result path`` with a fake engine whose
    plain pass decodes 100 tok/s and whose speculative pass ``speedup`` times that."""

    def fake_measure(args, workload, kw):
        spec = kw.get("speculative_config")
        rate = 100.0 * (speedup if spec else 1.0)
        return {
            "dtype": "float32", "ttft_ms": {"mean": 1, "median": 1, "p99": 1},
            "ms_per_output_token": {"mean": 1e3 / rate, "median": 1e3 / rate, "p99": 1e3 / rate},
            "output_tokens": 64, "decode_tokens_per_s": rate, "cpu_ms_per_output_token": 1e3 / rate,
            "spec_decode": {"acceptance_rate": 0.5, "mean_acceptance_length": 1 + speedup / 2} if spec and speedup > 1 else None,
        }  # fmt: skip

    monkeypatch.setattr(latency, "_measure", fake_measure)
    argv = ["--save-result", str(path)] + (["--text-prompts", workload] if workload != "W2" else ["--workload", "W2"])
    latency.run(_args(latency.add_args, argv + (["--temperature", "0.7"] if sampled else [])),
                {"speculative_config": {"method": method, "num_speculative_tokens": 3}})  # fmt: skip


def test_speculative_latency_results_render_one_bar_per_workload_and_method(monkeypatch, tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    for i, (workload, method, speedup) in enumerate([("W2", "ngram", 2.3), ("edit", "ngram", 1.5), ("edit", "ngram", 1.6),
                                                      ("chat", "eagle", 0.97), ("chat", "medusa", 1.04)]):  # fmt: skip
        _write_spec_latency(monkeypatch, results / f"spec{i}.json", workload, method, speedup)
    _write_spec_latency(monkeypatch, results / "sampled.json", "edit", "ngram", 1.47, sampled=True)
    saved = json.loads((results / "spec1.json").read_text())
    assert plots.classify(saved) == "latency" and saved["decode_tokens_per_s_speedup"] == pytest.approx(1.5)
    drawn = []
    real_bar = __import__("matplotlib.axes", fromlist=["Axes"]).Axes.bar
    monkeypatch.setattr("matplotlib.axes.Axes.bar", lambda ax, x, h, *a, **k: drawn.append((round(h, 3), k.get("label")))
                        or real_bar(ax, x, h, *a, **k))  # fmt: skip
    out = tmp_path / "out"
    assert plots.main(["--results-dir", str(results), "--out-dir", str(out)]) == 0
    _assert_png(out / "speculative_speedup.png")
    # The two edit runs of ngram k=3 are averaged; the sampled run is a method of its own.
    assert sorted(h for h, _ in drawn) == [0.97, 1.04, 1.47, 1.55, 2.3]
    labels = {label for _, label in drawn if label}
    assert labels == {"eagle, k=3", "medusa, k=3", "ngram, k=3", "ngram, k=3, temperature 0.7"}
    assert "no throughput results" in capsys.readouterr().out


def _plotted_lines(monkeypatch) -> list[tuple[str, list[float]]]:
    """(label, y values) of every line the plots draw from here on."""
    import matplotlib.axes

    drawn: list[tuple[str, list[float]]] = []
    real_plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, xs, ys, *a, **k: drawn.append((k.get("label"), list(ys)))
                        or real_plot(ax, xs, ys, *a, **k))  # fmt: skip
    return drawn


def test_unlike_runs_are_never_averaged_into_one_point(monkeypatch, tmp_path):
    """Found by an adversarial review: throughput runs of another model, another DP size or with
    sampling were averaged with the plain runs (a 135M model's 100 tok/s and an 8B's 10 drawn as
    55), and serve runs of different shapes made one line."""

    def throughput_run(model: str, n: int, value: float, **extra) -> dict:
        return {"workload": "custom", "model": model, "num_prompts": n, "input_len": 8, "output_len": 4,
                "dtype": "float32", "pagedllm": {"output_tokens_per_s": value}, **extra}  # fmt: skip

    runs = [throughput_run("small", 16, 100.0), throughput_run("big", 16, 10.0), throughput_run("small", 64, 200.0),
            throughput_run("small", 64, 400.0, data_parallel_size=2),
            throughput_run("small", 64, 50.0, sampling={"temperature": 0.8})]  # fmt: skip

    def serve_run(rate: float, input_len: int, ttft: float) -> dict:
        stats = {"mean": ttft, "median": ttft, "p99": ttft}
        return {"workload": "custom", "num_prompts": 8, "input_len": input_len, "output_len": 16, "model": "m",
                "request_rate": rate, "max_concurrency": None, "successful_requests": 8, "ttft_ms": stats,
                "tpot_ms": stats}  # fmt: skip

    runs += [serve_run(1, 256, 100.0), serve_run(2, 256, 110.0), serve_run(1, 4000, 9000.0), serve_run(2, 4000, 9500.0)]
    for i, r in enumerate(runs):
        (tmp_path / f"r{i}.json").write_text(json.dumps(r))
    drawn = _plotted_lines(monkeypatch)
    assert plots.main(["--results-dir", str(tmp_path), "--out-dir", str(tmp_path / "out")]) == 0
    lines = {label: ys for label, ys in drawn}
    assert lines["pagedllm (float32, 8 -> 4 tokens, small)"] == [100.0, 200.0]
    assert lines["pagedllm (float32, 8 -> 4 tokens, big)"] == [10.0]
    assert lines["pagedllm (float32, DP=2, 8 -> 4 tokens, small)"] == [400.0]
    assert lines["pagedllm (float32, temperature 0.8, 8 -> 4 tokens, small)"] == [50.0]
    assert lines["median (custom, 256 -> 16 tokens, concurrency None)"] == [100.0, 110.0]
    assert lines["median (custom, 4000 -> 16 tokens, concurrency None)"] == [9000.0, 9500.0]


def test_engine_labels_name_parallelism_and_sampling():
    from pagedllm.bench.plots import _engine_label

    r = {"dtype": "float32", "pagedllm": {"parallel": {"tensor_parallel_size": 2, "pipeline_parallel_size": 1}}}
    assert _engine_label("pagedllm", r) == "pagedllm (float32, TP=2 PP=1)"
    assert _engine_label("pagedllm", {**r, "pagedllm": {}, "data_parallel_size": 2, "sampling": {"top_p": 0.9}}) == \
        "pagedllm (float32, DP=2, top_p 0.9)"
