"""A server with the disk connector keeps its prefix cache across a SIGTERM restart."""

from __future__ import annotations

import json

import httpx

from tests.entrypoints.server_utils import ServerProcess

PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)


def test_sigterm_restart_keeps_the_blocks(tiny_llama_tok, tmp_path):
    kv = json.dumps({"kv_connector": "disk", "path": str(tmp_path / "store")})
    args = ["--model", str(tiny_llama_tok), "--num-kv-blocks", "128", "--kv-transfer-config", kv]
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    first = ServerProcess(args)
    try:
        a = httpx.post(f"{first.url}/v1/completions", json=body, timeout=60).json()
    finally:
        assert first.stop() == 0  # SIGTERM: the queued saves are written before the exit
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = ServerProcess(args)
    try:
        b = httpx.post(f"{second.url}/v1/completions", json=body, timeout=60).json()
        loaded = second.metric("pagedllm:kv_connector_loaded_blocks_total")
        hit_rate = second.metric("pagedllm:kv_connector_hit_rate")
    finally:
        second.stop()
    n = a["usage"]["prompt_tokens"]
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert loaded == (n - 1) // 16 and hit_rate == 1.0
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == loaded * 16
