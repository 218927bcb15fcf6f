"""The server with worker processes: ``--tensor-parallel-size 2`` / ``--pipeline-parallel-size 2``
answer as the one-process engine does, two ``pagedllm serve`` processes (node 0 and a headless
node 1) serve TP=2 together, and a killed worker ends the server cleanly (503, exit 1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from tests.entrypoints.server_utils import ServerProcess, free_port

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,"]
MAX_TOKENS = 16
ENGINE_ARGS = ["--max-num-batched-tokens", "64", "--num-kv-blocks", "64"]


@pytest.fixture(scope="module")
def reference() -> list[str]:
    llm = LLM(max_num_batched_tokens=64, num_kv_blocks=64, log_stats_interval=1e9)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def _completions(srv: ServerProcess) -> list[str]:
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": PROMPTS,
                   "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


@pytest.mark.slow  # the real default model
@pytest.mark.parametrize("flags", [["--tensor-parallel-size", "2"], ["--pipeline-parallel-size", "2"]], ids=["tp2", "pp2"])
def test_server_answers_as_one_process(reference, flags):
    srv = ServerProcess([*ENGINE_ARGS, *flags])
    try:
        assert _completions(srv) == reference
    finally:
        assert srv.stop() == 0


def _free_port_pair() -> int:
    """A port P with P + 1 free too (rendezvous and control channel)."""
    for _ in range(50):
        port = free_port()
        try:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


@pytest.mark.slow  # the real default model
def test_two_nodes_serve_tp2(reference):
    port = _free_port_pair()
    node = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    secret = {"PAGEDLLM_DIST_AUTHKEY": os.urandom(8).hex()}  # the nodes' shared control-channel key
    env = {**os.environ, "PAGEDLLM_LOGGING_LEVEL": "WARNING", **secret}
    worker_node = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--headless", "--node-rank", "1", *ENGINE_ARGS, *node],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        srv = ServerProcess([*ENGINE_ARGS, *node, "--node-rank", "0"], env=secret)
        try:
            assert _completions(srv) == reference
        finally:
            assert srv.stop() == 0
        assert worker_node.wait(timeout=60) == 0  # the engine's shutdown ends the remote workers too
    finally:
        if worker_node.poll() is None:
            worker_node.kill()
            worker_node.wait()


def _worker_pids(parent: int) -> list[int]:
    """The spawned worker processes of ``parent`` (not multiprocessing's resource tracker)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            pids.append(int(entry))
    return pids


@pytest.mark.parametrize("when", ["streaming", "idle"])
def test_killed_worker_ends_the_server_cleanly(tiny_llama_tok, when):
    """Mid-stream, or with nothing running: an idle server used to notice the death only when
    the next request came (found by an adversarial session); it now exits within seconds."""
    model = str(tiny_llama_tok)
    srv = ServerProcess(["--model", model, "--tensor-parallel-size", "2", *ENGINE_ARGS])
    try:
        workers = _worker_pids(srv.proc.pid)
        assert len(workers) == 2
        if when == "idle":
            os.kill(workers[1], signal.SIGKILL)
            assert srv.proc.wait(timeout=15) == 1  # no request needed
            time.sleep(1)
            assert not any(os.path.exists(f"/proc/{pid}") and _is_running(pid) for pid in workers)
            return
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={"model": model, "prompt": "Pending",
                          "max_tokens": 400, "ignore_eos": True, "stream": True}, timeout=60) as stream:  # fmt: skip
            events = []
            for line in stream.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 2:
                    os.kill(workers[1], signal.SIGKILL)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 503
        for path, method in (("/health", "GET"), ("/v1/completions", "POST")):
            try:
                r = httpx.request(method, f"{srv.url}{path}", json={"model": model, "prompt": "x"}, timeout=5)
                assert r.status_code == 503
            except httpx.TransportError:  # already exited
                pass
        assert srv.proc.wait(timeout=60) == 1
        time.sleep(1)
        assert not any(os.path.exists(f"/proc/{pid}") and _is_running(pid) for pid in workers)
    finally:
        srv.stop()


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
