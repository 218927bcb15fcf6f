"""Helpers shared by the benchmarks: pick a workload, print and save results."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pagedllm.bench.workloads import WORKLOADS, Workload


def add_workload_args(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument("--workload", choices=sorted(WORKLOADS), default=default, help="a standard workload (WORKLOADS.md)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--save-result", default=None, help="write the result as JSON to this file")


def workload_from_args(args: argparse.Namespace) -> Workload:
    if args.workload:
        return WORKLOADS[args.workload]
    return Workload("custom", args.prompt_seed, args.num_prompts, args.input_len, args.output_len)


def report(result: dict[str, Any], line: str, path: str | None) -> dict[str, Any]:
    print(line)
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return result
