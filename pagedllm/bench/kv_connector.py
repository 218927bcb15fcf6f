"""KV connector benchmarks with real server processes: ``pagedllm bench kv-connector``.

``restart``: serve with the disk connector, send a ~2,000-token system prompt + a question,
stop the server (SIGTERM), start it again, send the same system prompt + another question;
then a server without a connector answers that second prompt cold. Prints both TTFTs, their
ratio, and whether the answers are identical (greedy).

``pd``: random long prompts (``--input-len``, default 4,000 tokens) with short outputs at a
fixed Poisson rate, against one instance, then against a prefill + decode pair behind
``pagedllm disagg-proxy`` (the store on ``--store``, default under /dev/shm). Every server
runs with ``PAGEDLLM_NUM_THREADS=--threads`` (default 1). Prints TTFT and TPOT percentiles.

``transport``: the P/D design choice, measured without a model: moving one ``--input-len``
prompt's blocks of the default model (737,280 bytes per 16-token block) through the disk store
on /dev/shm and on ``--store`` (a disk; fsync on), against a TCP transfer over loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import tempfile
import time

from pagedllm.bench.common import CliProcess, cpu_name, report
from pagedllm.entrypoints.arg_types import output_dir, positive_float_or_inf, positive_int, result_path

FACT = ("Policy {i}: support agents answer politely, cite the knowledge base article number, never promise "
        "refunds without a ticket, and escalate outages to the on-call engineer within ten minutes.")  # fmt: skip


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("mode", choices=["restart", "pd", "transport"])
    p.add_argument("--model", default=None, help="model for every server (default: the embedded one)")
    p.add_argument("--store", type=output_dir, default=None,
                   help="store directory (default: a fresh temporary one; pd: under /dev/shm)")
    p.add_argument("--threads", type=positive_int, default=None, help="PAGEDLLM_NUM_THREADS of each server (pd default: 1)")
    p.add_argument("--system-facts", type=positive_int, default=60,
                   help="restart: sentences in the system prompt (60: ~2,200 tokens)")
    p.add_argument("--input-len", type=positive_int, default=4000, help="pd: prompt tokens; transport: tokens to move")
    p.add_argument("--output-len", type=positive_int, default=32, help="pd: output tokens")
    p.add_argument("--num-prompts", type=positive_int, default=8, help="pd: requests")
    p.add_argument("--request-rate", type=positive_float_or_inf, default=0.05, help="pd: Poisson arrivals, req/s")
    p.add_argument("--save-result", type=result_path, default=None, help="write the result as JSON to this file")


_started: list[CliProcess] = []  # every server of this run: stopped at the end, even after an error


def _start(argv: list[str], threads: int | None) -> CliProcess:
    proc = CliProcess(argv, {"PAGEDLLM_NUM_THREADS": str(threads)} if threads else None, timeout=300)
    _started.append(proc)
    return proc


def _stop(proc: CliProcess) -> float:
    """Stop it; the seconds that took."""
    start = time.perf_counter()
    proc.stop()
    return time.perf_counter() - start


def _serve_args(args: argparse.Namespace, kv: dict | None) -> list[str]:
    argv = ["serve"] + (["--model", args.model] if args.model else [])
    return argv + (["--kv-transfer-config", json.dumps(kv)] if kv else [])


def _chat_ttft(url: str, messages: list[dict], max_tokens: int = 32) -> tuple[float, str]:
    import httpx

    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start, ttft, text = time.perf_counter(), None, ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                if delta and ttft is None:
                    ttft = time.perf_counter() - start
                text += delta
    assert ttft is not None
    return ttft, text


def _restart(args: argparse.Namespace) -> dict:
    store = args.store or tempfile.mkdtemp(prefix="pagedllm-kv-")
    kv = {"kv_connector": "disk", "kv_role": "kv_both", "path": store}
    system = " ".join(FACT.format(i=i) for i in range(args.system_facts))

    def chat(q: str) -> list[dict]:
        return [{"role": "system", "content": system}, {"role": "user", "content": q}]

    warm = [{"role": "user", "content": "Say hello."}]
    q1, q2 = chat("How fast must outages be escalated?"), chat("Can I promise a refund?")
    first = _start(_serve_args(args, kv), args.threads)
    _chat_ttft(first.url, warm, 4)
    ttft_first, _ = _chat_ttft(first.url, q1)
    stop_s = _stop(first)
    restarted = _start(_serve_args(args, kv), args.threads)
    _chat_ttft(restarted.url, warm, 4)
    ttft_restart, text_restart = _chat_ttft(restarted.url, q2)
    restarted.stop()
    cold = _start(_serve_args(args, None), args.threads)
    _chat_ttft(cold.url, warm, 4)
    ttft_cold, text_cold = _chat_ttft(cold.url, q2)
    cold.stop()
    if not args.store:
        shutil.rmtree(store, ignore_errors=True)
    result = {"cpu": cpu_name(), "ttft_first_cold_s": ttft_first, "ttft_after_restart_s": ttft_restart,
              "ttft_cold_same_prompt_s": ttft_cold, "ratio": ttft_cold / ttft_restart,
              "identical": text_restart == text_cold, "first_server_stop_s": stop_s}  # fmt: skip
    line = (f"restart: TTFT cold {ttft_cold * 1e3:.0f} ms (first server's first prompt {ttft_first * 1e3:.0f} ms), "
            f"after a restart {ttft_restart * 1e3:.0f} ms: {result['ratio']:.1f}x lower; answers identical: "
            f"{result['identical']}; SIGTERM to exit {stop_s:.1f} s")  # fmt: skip
    return report(result, line, args.save_result)


def _drive(url: str, args: argparse.Namespace) -> dict:
    from pagedllm.bench import serve

    ns = argparse.Namespace(workload=None, input_len=args.input_len, output_len=args.output_len, num_prompts=args.num_prompts,
                            prompt_seed=0, base_url=url, model=None, request_rate=args.request_rate, max_concurrency=None,
                            goodput=[], api_key=None, arrival_seed=0)  # fmt: skip
    return asyncio.run(serve._run(ns))


def _pd(args: argparse.Namespace) -> dict:
    threads = args.threads or 1
    store = args.store or tempfile.mkdtemp(prefix="pagedllm-kv-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    single = _start(_serve_args(args, None), threads)
    res_single = _drive(single.url, args)
    single.stop()
    prefill = _start(_serve_args(args, {"kv_role": "kv_producer", "path": store}), threads)
    decode = _start(_serve_args(args, {"kv_role": "kv_consumer", "path": store}), threads)
    proxy = _start(["disagg-proxy", "--prefill", prefill.url, "--decode", decode.url], None)
    res_pd = _drive(proxy.url, args)
    for p in (proxy, prefill, decode):
        p.stop()
    if not args.store:
        shutil.rmtree(store, ignore_errors=True)
    result = {"cpu": cpu_name(), "threads_per_server": threads, "input_len": args.input_len, "output_len": args.output_len,
              "num_prompts": args.num_prompts, "request_rate": args.request_rate, "single": res_single, "pd": res_pd}  # fmt: skip
    lines = []
    for name, r in (("single", res_single), ("P/D pair", res_pd)):
        t, p = r["ttft_ms"], r["tpot_ms"]
        lines.append(f"{name:>8}: {r['successful_requests']} ok / {r['failed_requests']} failed; TTFT median {t['median']:.0f} "
                     f"p99 {t['p99']:.0f} ms; TPOT median {p['median']:.1f} p99 {p['p99']:.1f} ms; e2e median "
                     f"{r['e2el_ms']['median']:.0f} ms")  # fmt: skip
    return report(result, "\n".join(lines), args.save_result)


def _transport(args: argparse.Namespace) -> dict:
    import threading

    import numpy as np

    from pagedllm.kv_connector.disk_store import DiskKVStore

    block_bytes, n = 737_280, args.input_len // 16
    payloads = [np.random.default_rng(i).integers(0, 255, block_bytes, dtype=np.uint8) for i in range(n)]
    hashes = [i.to_bytes(32, "big") for i in range(n)]
    result: dict = {"cpu": cpu_name(), "blocks": n, "mib": n * block_bytes / (1 << 20)}
    for name, parent in (("store_dev_shm", "/dev/shm"), ("store_disk_fsync", args.store or tempfile.gettempdir())):
        root = tempfile.mkdtemp(prefix="pagedllm-kv-transport-", dir=parent)
        store = DiskKVStore(root, b"\0" * 32, "bench", 1 << 40)
        t0 = time.perf_counter()
        for h, p in zip(hashes, payloads):
            store.put(h, memoryview(p))
        t1 = time.perf_counter()
        got = [store.get(h) for h in hashes]
        t2 = time.perf_counter()
        assert all(g is not None for g in got)
        for g in got:  # as a consumer does once the blocks are in its KV cache: buffers reused
            store.release(g)
        t3 = time.perf_counter()
        got = [store.get(h) for h in hashes]
        t4 = time.perf_counter()
        result[name] = {"write_s": t1 - t0, "read_verify_first_s": t2 - t1, "read_verify_s": t4 - t3}
        shutil.rmtree(root, ignore_errors=True)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)

        def send() -> None:
            with socket.create_connection(server.getsockname()) as c:
                for p in payloads:
                    c.sendall(len(p).to_bytes(8, "little"))
                    c.sendall(memoryview(p))

        t0 = time.perf_counter()
        sender = threading.Thread(target=send)
        sender.start()
        conn, _ = server.accept()
        with conn:
            for _ in range(n):
                size = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
                buf = bytearray(size)
                view, got = memoryview(buf), 0
                while got < size:
                    got += conn.recv_into(view[got:])
        sender.join()
        result["tcp_loopback_s"] = time.perf_counter() - t0
    shm, disk = result["store_dev_shm"], result["store_disk_fsync"]
    line = (f"{n} blocks ({result['mib']:.0f} MiB): store on /dev/shm write {shm['write_s'] * 1e3:.0f} ms + read/verify "
            f"{shm['read_verify_s'] * 1e3:.0f} ms (first, into fresh buffers: {shm['read_verify_first_s'] * 1e3:.0f} ms); on disk with fsync write {disk['write_s'] * 1e3:.0f} ms + read/verify "
            f"{disk['read_verify_s'] * 1e3:.0f} ms; TCP loopback {result['tcp_loopback_s'] * 1e3:.0f} ms")  # fmt: skip
    return report(result, line, args.save_result)


def run(args: argparse.Namespace) -> dict:
    if args.store:
        os.makedirs(args.store, exist_ok=True)
    try:
        return {"restart": _restart, "pd": _pd, "transport": _transport}[args.mode](args)
    finally:  # a failed run must not leave servers behind (stop() is a no-op for stopped ones)
        while _started:
            _started.pop().stop()
