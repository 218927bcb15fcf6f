"""Render ``pagedllm bench ... --save-result`` JSON files as PNGs for docs/benchmarks.md.

Why: the tables in docs/benchmarks.md give single points; a plot of output tokens/s against
the number of prompts (pagedllm next to transformers ``generate`` and vLLM, when run) and of serving latency
against request rate shows the trends and where the engine saturates at a glance; speculative
decoding's speed-ups (``bench latency --speculative-config``) show per workload and method.

    python -m pagedllm.bench.plots --results-dir results/ --out-dir docs/benchmarks

Every ``*.json`` under ``--results-dir`` is read and sorted by its keys (throughput, serve or
latency result; anything else is skipped with a note), so file names don't matter. Fields the
bench modules don't always write (``model``, ``transformers``, ``dtype``) are optional.
Needs matplotlib: ``pip install 'pagedllm[plots]'``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any

Result = dict[str, Any]


def classify(d: Any) -> str | None:
    """``throughput``, ``serve``, ``latency`` or None, from the keys each bench module writes."""
    if not isinstance(d, dict):
        return None
    if isinstance(d.get("pagedllm"), dict) and "output_tokens_per_s" in d["pagedllm"]:
        return "throughput"
    if "request_rate" in d and isinstance(d.get("ttft_ms"), dict) and isinstance(d.get("tpot_ms"), dict):
        return "serve"
    if isinstance(d.get("ttft_ms"), dict) and isinstance(d.get("ms_per_output_token"), dict):
        return "latency"
    return None


def load_results(results_dir: Path) -> dict[str, list[Result]]:
    found: dict[str, list[Result]] = defaultdict(list)
    for path in sorted(results_dir.rglob("*.json")):
        try:
            d = json.loads(path.read_text())  # the stdlib reads the ``Infinity`` older results hold
            if isinstance(d, dict) and isinstance(d.get("request_rate"), str):  # "inf" (bench.common.json_safe)
                d["request_rate"] = float(d["request_rate"])
        except (OSError, ValueError) as e:
            print(f"note: skipping {path}: {e}")
            continue
        kind = classify(d)
        if kind is None:
            print(f"note: skipping {path}: not a bench throughput/serve/latency result")
            continue
        found[kind].append({**d, "_path": str(path)})
    return found


def _common(results: list[Result], key: str) -> Any:
    """The value of ``key`` if every result has the same one, else None."""
    values = {str(r.get(key)) for r in results}
    return results[0].get(key) if len(values) == 1 else None


def _title(prefix: str, results: list[Result]) -> str:
    parts = [str(v) for v in (_common(results, "model"), _common(results, "dtype")) if v is not None]
    return prefix + (f" ({', '.join(parts)})" if parts else "")


def _engine_label(engine: str, r: Result) -> str:
    """``engine (its dtype[, int8/int16 activations][, KV cache dtype][, DP/TP/PP][, sampling])``
    of one throughput result: runs that differ in any of these are separate series, never averaged."""
    dtype = (r.get(engine) or {}).get("dtype") or r.get("dtype")
    if engine == "pagedllm" and r.get("activation_dtype") in ("int8", "int16"):
        dtype = f"{dtype}, {r['activation_dtype']} activations"
    if engine == "pagedllm" and r.get("kv_cache_dtype") not in (None, "auto", dtype):
        dtype = f"{dtype}, {r['kv_cache_dtype']} KV"
    if engine == "pagedllm" and (r.get("data_parallel_size") or 1) > 1:
        dtype = f"{dtype}, DP={r['data_parallel_size']}"
    if engine == "pagedllm" and (parallel := (r.get("pagedllm") or {}).get("parallel")):
        dtype = f"{dtype}, TP={parallel.get('tensor_parallel_size')} PP={parallel.get('pipeline_parallel_size')}"
    if r.get("sampling"):
        dtype = f"{dtype}, " + " ".join(f"{k} {v}" for k, v in sorted(r["sampling"].items()))
    return f"{engine} ({dtype})"


def _throughput_bars(fig: Any, ax: Any, series: dict, num_prompts: int, results: list[Result]) -> None:
    """One bar per engine (its mean output tok/s), fastest on top."""
    (shape, engines), = series.items()
    bars = sorted((mean(points[num_prompts]), label) for label, points in engines.items())
    ax.barh([label for _, label in bars], [v for v, _ in bars],
            color=["tab:blue" if label.startswith("pagedllm") else "tab:gray" for _, label in bars])  # fmt: skip
    for i, (v, _) in enumerate(bars):
        ax.text(v, i, f" {v:.0f}", va="center")
    ax.set_xlabel("output tokens/s")
    ax.set_xlim(right=max(v for v, _ in bars) * 1.12)
    fig.suptitle(_title("Offline throughput", results) + f", {num_prompts} prompts, {shape[0]} -> {shape[1]} tokens")
    ax.grid(True, axis="x", alpha=0.4)


def _throughput_lines(ax: Any, series: dict, results: list[Result]) -> None:
    """Output tok/s against the number of prompts, a line per engine (and shape)."""
    from matplotlib.ticker import NullLocator

    ticks: set[int] = set()
    models = {shape[2] for shape in series}
    for shape, engines in sorted(series.items(), key=lambda kv: str(kv[0])):
        suffix = f", {shape[0]} -> {shape[1]} tokens" if len(series) > 1 else ""
        suffix += f", {shape[2]}" if len(models) > 1 else ""
        for label, points in sorted(engines.items()):
            ns = sorted(points)
            ticks.update(ns)
            ours = label.startswith("pagedllm")
            ax.plot(ns, [mean(points[n]) for n in ns], marker="o" if ours else "s",
                    linestyle="-" if ours else "--", label=label.replace(")", suffix + ")"))  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ticks), labels=[str(n) for n in sorted(ticks)])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("number of prompts (batch)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    lens = {(s[0], s[1]) for s in series}
    in_len, out_len = lens.pop() if len(lens) == 1 else (None, None)
    lens_note = f", {in_len} -> {out_len} tokens" if in_len is not None and out_len is not None else ""
    ax.set_title(_title("Offline throughput", results) + lens_note)
    ax.grid(True, which="major", alpha=0.4)
    ax.legend()


def plot_throughput(results: list[Result], out: Path) -> Path | None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # (input_len, output_len, model) -> engine and its setup -> num_prompts -> output tok/s of each
    # run (only repeats of the same run are averaged). Each engine is labelled with its own dtype:
    # a peer may run in another one (--peer-dtype), and pagedllm's int8 fast mode, its DP / TP /
    # PP runs and sampled runs are series of their own.
    series: dict[tuple, dict[str, dict[int, list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for r in results:
        n = r.get("num_prompts")
        if not isinstance(n, int) or n <= 0:
            print(f"note: {r['_path']} has no usable 'num_prompts'; left out of the throughput plot")
            continue
        shape = (r.get("input_len"), r.get("output_len"), r.get("model"))
        for engine in ("pagedllm", "transformers", "vllm"):
            value = (r.get(engine) or {}).get("output_tokens_per_s")
            if isinstance(value, (int, float)):
                series[shape][_engine_label(engine, r)][n].append(float(value))
    if not series:
        print("note: no throughput result with 'num_prompts'; throughput plot skipped")
        return None

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    sizes = {n for engines in series.values() for points in engines.values() for n in points}
    if len(series) == 1 and len(sizes) == 1:  # one workload at one batch size: bars read better than dots
        _throughput_bars(fig, ax, series, sizes.pop(), results)
    else:
        _throughput_lines(ax, series, results)
    path = out / "throughput_vs_prompts.png"
    fig.savefig(path, dpi=120)
    return path


def plot_serve(results: list[Result], out: Path) -> Path | None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    usable = []
    for r in results:
        rate = r.get("request_rate")
        if not isinstance(rate, (int, float)) or rate <= 0:
            print(f"note: {r['_path']} has no usable 'request_rate'; left out of the serve plot")
        elif not r.get("successful_requests", 1):
            print(f"note: {r['_path']} has no successful requests (latencies are all 0); left out")
        else:
            usable.append(r)
    if not usable:
        print("note: no serve results; serve latency plot skipped")
        return None

    finite = [r["request_rate"] for r in usable if math.isfinite(r["request_rate"])]
    inf_x = 2 * max(finite) if finite else 1.0  # --request-rate inf (all at once) goes right of the rest

    def x_of(rate: float) -> float:
        return rate if math.isfinite(rate) else inf_x

    groups: dict[tuple, list[Result]] = defaultdict(list)  # runs that differ only in request rate
    for r in usable:
        shape = (r.get("num_prompts"), r.get("input_len"), r.get("output_len"))  # (a "custom" workload is any shape)
        groups[(r.get("workload"), r.get("max_concurrency"), r.get("model"), shape)].append(r)
    models = {key[2] for key in groups}

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    colors = [f"C{i}" for i in range(10)]
    for i, ((workload, conc, model, shape), runs) in enumerate(sorted(groups.items(), key=lambda kv: str(kv[0]))):
        runs = sorted(runs, key=lambda r: x_of(r["request_rate"]))
        xs = [x_of(r["request_rate"]) for r in runs]
        what = [str(workload)] + ([f"{shape[1]} -> {shape[2]} tokens"] if shape[1] is not None else [])
        what += [f"concurrency {conc}"] + ([str(model)] if len(models) > 1 else [])
        suffix = f" ({', '.join(what)})" if len(groups) > 1 else ""
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms")):
            for stat, style, marker, own_color in (("median", "-", "o", "C0"), ("p99", "--", "^", "C3")):
                ys = [float(r[key].get(stat, math.nan)) for r in runs]
                color = colors[i % 10] if len(groups) > 1 else own_color  # one group: a colour per statistic
                ax.plot(xs, ys, marker=marker, linestyle=style, color=color, label=stat + suffix)
    has_inf = len(finite) < len(usable)
    ticks = sorted({x_of(r["request_rate"]) for r in usable})
    labels = ["inf" if has_inf and x == inf_x else f"{x:g}" for x in ticks]
    for ax, name in zip(axes, ("TTFT", "TPOT (time per output token after the first)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, labels=labels)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("request rate (req/s, Poisson arrivals)")
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        ax.set_title(name)
        ax.grid(True, which="major", alpha=0.4)
        ax.legend()
    fig.suptitle(_title("Online serving latency", usable))
    path = out / "serve_latency_vs_rate.png"
    fig.savefig(path, dpi=120)
    return path


def _spec_label(r: Result) -> str:
    """The method of a speculative latency result, with k and the sampling if not greedy."""
    spec = r["speculative_config"]
    label = f"{spec.get('method')}, k={spec.get('num_speculative_tokens', '?')}"
    sampling = r.get("sampling") or {}
    if sampling:
        label += ", " + ", ".join(f"{k} {v:g}" for k, v in sampling.items())
    return label


def plot_speculative(results: list[Result], out: Path) -> Path | None:
    """Decode tokens/s over plain decoding's per workload and method (``bench latency
    --speculative-config``, which measures both in one run), each bar marked with the mean
    acceptance length; the repeats of a (workload, method) pair are averaged."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = [r for r in results if r.get("speculative_config") and "decode_tokens_per_s_speedup" in r]
    if not runs:
        print("note: no speculative latency results (with their plain pass); speculative plot skipped")
        return None
    cells: dict[tuple[str, str], list[Result]] = defaultdict(list)
    for r in runs:
        cells[(str(r.get("workload")), _spec_label(r))].append(r)
    workloads = sorted({w for w, _ in cells})
    methods = sorted({m for _, m in cells})
    fig = Figure(figsize=(max(7.0, 1.5 + 0.8 * len(workloads) * len(methods)), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    width = 0.8 / len(methods)
    labelled: set[str] = set()
    for j, method in enumerate(methods):
        for i, workload in enumerate(workloads):
            got = cells.get((workload, method))
            if not got:
                continue
            speedup = mean(r["decode_tokens_per_s_speedup"] for r in got)
            lengths = [r["spec_decode"]["mean_acceptance_length"] for r in got if r.get("spec_decode")]
            x = i - 0.4 + width * (j + 0.5)
            ax.bar(x, speedup, width, color=f"C{j}", label=None if method in labelled else method)
            labelled.add(method)
            note = f"{speedup:.2f}x" + (f"\nlen {mean(lengths):.2f}" if lengths else "\nno drafts")
            ax.text(x, speedup, note, ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(workloads)), labels=workloads)
    ax.set_ylabel("decode tokens/s, speculative / plain")
    ax.set_ylim(0, max(mean(r["decode_tokens_per_s_speedup"] for r in got) for got in cells.values()) * 1.25)
    ax.grid(True, axis="y", alpha=0.4)
    ax.legend(title="method (len: mean acceptance length)", fontsize=8)
    fig.suptitle(_title("Speculative decoding, one request at a time", runs))
    path = out / "speculative_speedup.png"
    fig.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedllm.bench.plots", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--results-dir", type=Path, required=True, help="folder searched (recursively) for result JSONs"
    )
    p.add_argument(
        "--out-dir",
        type=Path,
        default=Path("docs/benchmarks"),
        help="where the PNGs go (default: %(default)s)",
    )
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        p.error("matplotlib is needed: pip install 'pagedllm[plots]'")
    if not args.results_dir.is_dir():
        p.error(f"--results-dir {args.results_dir} is not a directory")

    found = load_results(args.results_dir)
    print(
        ", ".join(f"{len(found[k])} {k}" for k in ("throughput", "serve", "latency"))
        + f" result(s) in {args.results_dir}"
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if found["throughput"]:
        written.append(plot_throughput(found["throughput"], args.out_dir))
    else:
        print("note: no throughput results; throughput plot skipped")
    written.append(plot_serve(found["serve"], args.out_dir))
    written.append(plot_speculative(found["latency"], args.out_dir))
    written = [path for path in written if path is not None]
    for path in written:
        print(f"wrote {path}")
    return 0 if written else 1


if __name__ == "__main__":
    raise SystemExit(main())
