"""``pagedllm serve --data-parallel-size 2``: completions, streaming, metrics and the dashboard
per replica; then a replica is killed and the server fails cleanly (in-flight stream gets an
error event, /health 503, exit non-zero) instead of hanging.

One server for the module (two replica processes of the real default model); the death test
runs last and ends it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.server_utils import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "The river flows north through the valley before it reaches the old stone bridge, and then",
    "In 1887 the town council voted to build a library with money from the railway company, so",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen, which means that",
    "The recipe calls for two cups of flour, one egg, a pinch of salt and warm milk; first you",
]


def replica_pids(server_pid: int) -> list[int]:
    """The server's multiprocessing children that run replicas (not its resource tracker)."""
    pids = []
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmdline:
                pids.append(int(child))
    return sorted(pids)


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["--data-parallel-size", "2", "--num-kv-blocks", "256", "--max-num-seqs", "8"])
    yield srv
    srv.stop()


def _complete(url: str, prompt: str, **kw) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_two_replica_processes(server):
    assert len(replica_pids(server.proc.pid)) == 2


def test_completion_stream_equals_non_stream(server):
    text = _complete(server.url, PROMPTS[0])["choices"][0]["text"]
    pieces = []
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(pieces) == text and text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_work_spreads_and_metrics_add_up(server):
    import concurrent.futures

    before = server.metric("pagedllm:request_success_total")
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: _complete(server.url, p, max_tokens=16, ignore_eos=True), PROMPTS))
    assert all(r["usage"]["completion_tokens"] == 16 for r in results)
    assert server.metric("pagedllm:request_success_total") == before + len(PROMPTS)
    assert server.metric("pagedllm:prompt_tokens_total") >= sum(r["usage"]["prompt_tokens"] for r in results)
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    assert 'pagedllm:dp_replica_num_requests{engine="1"' in text
    # Each replica's own pool (dashboard state per replica) holds cached blocks of its prompts.
    for engine in (0, 1):
        state = httpx.get(f"{server.url}/v1/kv_cache/state", params={"engine": engine}, timeout=10).json()
        assert state["engine"] == engine and state["data_parallel_size"] == 2
        assert state["num_cached_blocks"] > 0, f"replica {engine} served nothing"
    assert httpx.get(f"{server.url}/v1/kv_cache/state", params={"engine": 2}, timeout=10).status_code == 400
    bad = httpx.get(f"{server.url}/v1/kv_cache/state", params={"engine": "abc"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "engine"  # (was "query")


def test_bad_input_is_a_400_before_routing(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 10**9}, timeout=30)
    assert r.status_code == 400


def test_disconnect_aborts_on_the_owning_replica(server):
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 4:
                break  # leave mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if server.metric("pagedllm:dp_replica_num_requests") == 0 and server.metric("pagedllm:num_requests_running") == 0:
            break
        time.sleep(0.2)
    assert server.metric("pagedllm:dp_replica_num_requests") == 0
    assert server.metric("pagedllm:num_requests_running") == 0


def test_a_dead_replica_fails_the_server_cleanly(server):
    """Last: kills a replica. The in-flight stream ends with an error event, /health is 503,
    and the server exits non-zero on its own."""
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 2:  # generating: kill one replica (whichever it is)
                os.kill(replica_pids(server.proc.pid)[0], signal.SIGKILL)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 503
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503
    deadline = time.monotonic() + 30
    while server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.proc.returncode not in (None, 0)
