"""Helpers shared by the benchmarks: pick a workload, print and save results, start a server."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import time
from typing import Any

from pagedllm.bench.workloads import WORKLOADS, Workload
from pagedllm.entrypoints.arg_types import positive_int, result_path


def add_workload_args(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument("--workload", choices=sorted(WORKLOADS), default=default, help="a standard workload (WORKLOADS.md)")
    # Given explicitly, these override the chosen workload's fields (the result is named "custom").
    p.add_argument("--input-len", type=positive_int, default=None, help="prompt tokens (default: the workload's, else 256)")
    p.add_argument("--output-len", type=positive_int, default=None, help="new tokens (default: the workload's, else 128)")
    p.add_argument("--num-prompts", type=positive_int, default=None, help="requests (default: the workload's, else 64)")
    p.add_argument("--prompt-seed", type=int, default=None,
                   help="seed of the random prompts (default: the workload's; 0 without one)")
    p.add_argument("--save-result", type=result_path, default=None, help="write the result as JSON to this file")



# The sampling flags and their values in a greedy run.
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
          "logprobs": None}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Sampled runs (and logprobs): the same parameters for every request, request i seeded with i."""
    p.add_argument("--temperature", type=float, default=GREEDY["temperature"],
                   help="every request's temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=GREEDY["top_p"], help="every request's top_p (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=GREEDY["top_k"], help="every request's top_k; 0 = off (default)")
    p.add_argument("--presence-penalty", type=float, default=GREEDY["presence_penalty"],
                   help="every request's presence penalty")
    p.add_argument("--frequency-penalty", type=float, default=GREEDY["frequency_penalty"],
                   help="every request's frequency penalty")
    p.add_argument("--logprobs", type=int, default=GREEDY["logprobs"],
                   help="every request asks for its tokens' log-probabilities and this many top ones")


def sampling_from_args(args: argparse.Namespace) -> dict:
    """The sampling flags that differ from plain greedy decoding's values (empty for such a run)."""
    return {k: getattr(args, k) for k, greedy in GREEDY.items() if getattr(args, k) != greedy}


def request_params(sampling: dict, max_tokens: int, i: int, ignore_eos: bool = True):
    """Request i's SamplingParams: greedy, or the run's sampling flags with seed i (so a sampled
    run draws the same tokens on every run of the same build)."""
    from pagedllm import SamplingParams

    seed = {"seed": i} if sampling.get("temperature", 0) > 0 else {}
    return SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **{"temperature": 0.0, **sampling, **seed})


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The chosen standard workload, with any of --input-len/--output-len/--num-prompts/--prompt-seed
    applied (then it is a custom one)."""
    base = WORKLOADS[args.workload] if args.workload else Workload("custom", 0, 64, 256, 128)
    fields = {"input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
              "seed": args.prompt_seed}  # fmt: skip
    changes = {k: v for k, v in fields.items() if v is not None}
    if not changes:
        return base
    return dataclasses.replace(base, name="custom", **changes)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between the two nearest ranks: numpy's
    default, which vLLM's benchmarks report (a nearest rank hides one slow request in 64 at p99)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = q / 100 * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float written as a string ("inf", "nan"): strict JSON
    has no Infinity (``--request-rate inf``), and other readers refuse Python's extension."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def report(result: dict[str, Any], line: str, path: str | None) -> dict[str, Any]:
    print(line)
    if path:
        with open(path, "w") as f:
            json.dump(json_safe(result), f, indent=2, allow_nan=False)
    return result


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), which every published figure names."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or platform.machine()


# A fixed English text for perplexity checks (~330 tokens with SmolLM2's tokenizer).
PERPLEXITY_TEXT = (
    "The lighthouse stood at the end of a narrow spit of land, where the sea met the estuary and the "
    "currents ran fast at every change of the tide. For more than a century its keepers had climbed the "
    "one hundred and twelve steps each evening to light the lamp, trim the wick and wind the clockwork "
    "that turned the great lens. The work was lonely but never idle: the brass had to be polished, the "
    "glass cleaned of salt, the log kept in a careful hand, and the weather observed and written down "
    "every four hours. In the winter storms the keepers slept in turns, listening for the sound of the "
    "fog signal and watching the horizon for ships in distress. When the lamp was finally automated in "
    "the nineteen eighties, the last keeper packed his books and his barometer, locked the door behind "
    "him and walked back along the causeway to the village. The lighthouse still shines every night, "
    "but no one climbs the stairs any more, and the log ends with a single line in faded ink: all well, "
    "light burning bright, wind from the south west. Today the building belongs to a small museum. "
    "Visitors can read the old logs, see the brass instruments and look out from the gallery over the "
    "water, where fishing boats still return at dusk, guided by the same light that their grandparents "
    "followed home."
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CliProcess:
    """A ``pagedllm`` subcommand (``serve``, ``disagg-proxy``) on a free loopback port, up once
    its /health answers; benchmarks and tests start their servers through it."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, timeout: float = 180):
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.entrypoints.cli", *argv, "--port", str(self.port)],
            env={**os.environ, "PAGEDLLM_LOGGING_LEVEL": "WARNING", **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited early:\n{self.proc.stderr.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{argv[0]} did not become healthy in {timeout:.0f} s")

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM, wait for the exit (SIGKILL after ``timeout``); the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
