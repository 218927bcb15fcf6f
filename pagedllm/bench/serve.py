"""Online serving benchmark: ``pagedllm bench serve`` drives any OpenAI-compatible server.

Random token-id prompts (a standard workload or --input-len/--output-len/--num-prompts) are
sent to ``/v1/completions`` with streaming, greedy, EOS ignored; arrivals are Poisson at
``--request-rate`` (inf = all at once), optionally capped by ``--max-concurrency``. Reports
successes/failures, throughput, TTFT, TPOT (time per output token after the first), ITL
(gaps between streamed chunks) and end-to-end latency (mean/median/p99), and goodput under
``--goodput ttft:MS tpot:MS`` (requests/s meeting every bound).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

from pagedllm.bench.common import add_workload_args, percentile, report, workload_from_args
from pagedllm.entrypoints.arg_types import positive_float, positive_float_or_inf, positive_int


def _slo(value: str) -> tuple[str, float]:
    """One --goodput bound, ``ttft|tpot|e2el:MILLISECONDS``."""
    name, _, ms = value.partition(":")
    try:
        bound = float(ms)
    except ValueError:
        bound = float("nan")
    if name not in ("ttft", "tpot", "e2el") or not bound > 0:
        raise argparse.ArgumentTypeError(f"expected ttft:MS, tpot:MS or e2el:MS with MS > 0, got {value!r}")
    return name, bound


def add_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)  # without --workload: --input-len/--output-len/--num-prompts (W1-like defaults)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address (default: %(default)s)")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first model)")
    p.add_argument("--request-rate", type=positive_float_or_inf, default=float("inf"), help="Poisson arrival rate, req/s (default: inf)")
    p.add_argument("--max-concurrency", type=positive_int, default=None, help="most requests in flight at once")
    p.add_argument("--goodput", nargs="*", type=_slo, default=[], help="SLOs like ttft:500 tpot:100 (milliseconds)")
    p.add_argument("--api-key", default=None, help="bearer token for the server")
    p.add_argument("--arrival-seed", type=int, default=0, help="seed of the arrival times")


@dataclass
class _Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


async def _one(client, url: str, body: dict, headers: dict) -> _Result:
    r = _Result()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    r.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    if r.ttft == 0.0:
                        r.ttft = now - start
                    else:
                        r.itl.append(now - last)
                    last = now
        r.e2e = time.perf_counter() - start
        r.ok = r.output_tokens == body["max_tokens"]
        if not r.ok:
            r.error = f"got {r.output_tokens} tokens, expected {body['max_tokens']}"
    except Exception as e:  # a failed request is counted, not fatal
        r.error = f"{type(e).__name__}: {e}"
    return r


def _stats(values: list[float]) -> dict[str, float]:
    """ms figures of ``values`` (seconds); zeros with a count of 0 when there are none (a TPOT
    of one-token answers), which the summary line prints as n/a."""
    if not values:
        return {"count": 0, "mean": 0.0, "median": 0.0, "p99": 0.0}
    return {"count": len(values), "mean": 1e3 * statistics.mean(values), "median": 1e3 * statistics.median(values),
            "p99": 1e3 * percentile(values, 99)}


def _median_p99(name: str, stats: dict, digits: int) -> str:
    if not stats.get("count", 1):
        return f"{name} n/a"
    return f"{name} median {stats['median']:.{digits}f} / p99 {stats['p99']:.{digits}f} ms"


async def _served_model(client, base_url: str, headers: dict) -> str:
    """The server's model (GET /v1/models): a clear error, not a traceback, when none answers."""
    import httpx

    try:
        models = await client.get("/v1/models", headers=headers)
    except httpx.HTTPError as e:
        raise ValueError(f"--base-url {base_url}: no server answered ({type(e).__name__}: {e})") from None
    if models.status_code != 200:
        raise ValueError(f"--base-url {base_url}: GET /v1/models gave HTTP {models.status_code}: {models.text[:200]}")
    return models.json()["data"][0]["id"]


async def _run(args: argparse.Namespace) -> dict:
    import httpx

    w = workload_from_args(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url, timeout=httpx.Timeout(600.0)) as client:
        model = args.model or await _served_model(client, args.base_url, headers)
        bodies = [
            {"model": model, "prompt": p, "max_tokens": w.output_len, "temperature": 0, "ignore_eos": True,
             "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            for p in w.prompts()
        ]
        rng = random.Random(args.arrival_seed)
        limit = asyncio.Semaphore(args.max_concurrency or len(bodies))

        async def limited(body: dict) -> _Result:
            async with limit:
                return await _one(client, "/v1/completions", body, headers)

        start = time.perf_counter()
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(limited(body)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    slo = dict(args.goodput)
    good = [
        r for r in ok
        if r.ttft * 1e3 <= float(slo.get("ttft", "inf")) and r.tpot * 1e3 <= float(slo.get("tpot", "inf"))
        and r.e2e * 1e3 <= float(slo.get("e2el", "inf"))
    ]  # fmt: skip
    return {
        "workload": w.name,
        "num_prompts": w.num_prompts,
        "input_len": w.input_len,
        "output_len": w.output_len,
        "model": model,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": sum(r.output_tokens for r in ok) / duration,
        "goodput": len(good) / duration if slo else None,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats([r.tpot for r in ok if r.output_tokens > 1]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2el_ms": _stats([r.e2e for r in ok]),
    }


def run(args: argparse.Namespace) -> dict:
    res = asyncio.run(_run(args))
    line = (
        f"Serving ({res['workload']}, rate {res['request_rate']}, concurrency {res['max_concurrency']}): "
        f"{res['successful_requests']} ok, {res['failed_requests']} failed in {res['duration_s']:.1f} s; "
        f"{res['request_throughput']:.2f} req/s, {res['output_token_throughput']:.1f} output tok/s; "
        f"{_median_p99('TTFT', res['ttft_ms'], 0)}; {_median_p99('TPOT', res['tpot_ms'], 1)}"
        + (f"; goodput {res['goodput']:.2f} req/s" if res["goodput"] is not None else "")
    )
    report(res, line, args.save_result)
    if not res["successful_requests"]:  # nothing was measured: an error, not a result
        raise ValueError(f"every request failed, e.g.: {res['errors'][0] if res['errors'] else 'no answer'}")
    return res
