"""Disaggregated prefill/decode on loopback: a prefill server (kv_producer), a decode server
(kv_consumer) on one store, and ``pagedllm disagg-proxy`` in front (tiny random model)."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.common import CliProcess
from tests.entrypoints.server_utils import ServerProcess

MAX_TOKENS = 12
WORDS = "apple river stone cloud garden mirror candle forest window silver thunder paper ocean lantern".split()
# 20 prompts of 40-90 tokens: whole blocks to move, and a tail the decode side computes.
PROMPTS = [" ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(25 + 3 * i)) for i in range(20)]


def proxy_process(prefill: str, decode: str) -> CliProcess:
    return CliProcess(["disagg-proxy", "--prefill", prefill, "--decode", decode, "--prefill-timeout", "60"], timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_llama_tok) -> list[str]:
    """A single instance's greedy answers."""
    llm = LLM(str(tiny_llama_tok), num_kv_blocks=256, log_stats_interval=1e9)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def pd(tiny_llama_tok, tmp_path_factory):
    store = str(tmp_path_factory.mktemp("pd-store"))

    def server(role: str) -> ServerProcess:
        kv = json.dumps({"kv_connector": "disk", "kv_role": role, "path": store})
        return ServerProcess(["--model", str(tiny_llama_tok), "--num-kv-blocks", "256", "--kv-transfer-config", kv],
                             env={"PAGEDLLM_NUM_THREADS": "1"})  # fmt: skip

    with ThreadPoolExecutor(2) as pool:  # start both at once
        prefill_f, decode_f = pool.submit(server, "kv_producer"), pool.submit(server, "kv_consumer")
        prefill, decode = prefill_f.result(), decode_f.result()
    proxy = proxy_process(prefill.url, decode.url)
    yield prefill, decode, proxy
    proxy.stop()
    prefill.stop()
    decode.stop()


def complete(url: str, prompt: str, stream: bool) -> str:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_pd_outputs_equal_a_single_instance(pd, reference):
    prefill, decode, proxy = pd
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda ip: complete(proxy.url, ip[1], stream=ip[0] % 2 == 0), enumerate(PROMPTS[:10])))
    assert texts == reference[:10]
    assert decode.metric("pagedllm:kv_connector_loaded_blocks_total") >= 10  # every prompt has >= 2 whole blocks
    assert decode.metric("pagedllm:kv_connector_rejected_blocks_total") == 0
    assert prefill.metric("pagedllm:kv_connector_saved_blocks_total") > 0
    assert httpx.get(f"{proxy.url}/proxy_stats").json()["prefill_failed"] == 0


def test_killing_the_prefill_instance_loses_no_request(pd, reference):
    prefill, decode, proxy = pd
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete, proxy.url, p, i % 2 == 0) for i, p in enumerate(PROMPTS[10:])]
        futures[1].result()
        prefill.proc.send_signal(signal.SIGKILL)  # mid-run: later prompts' prefills fail
        texts = [f.result() for f in futures]
    assert texts == reference[10:]
    stats = httpx.get(f"{proxy.url}/proxy_stats").json()
    assert stats["prefill_failed"] > 0 and stats["requests"] == 20


def test_prefill_body():
    from pagedllm.entrypoints.disagg_proxy import prefill_body

    body = {"messages": [], "max_completion_tokens": 50, "min_tokens": 5, "n": 3, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.7}  # fmt: skip
    assert prefill_body(body) == {"messages": [], "max_completion_tokens": 1, "min_tokens": 0, "n": 1, "stream": False,
                                  "max_tokens": 1, "temperature": 0.7}  # fmt: skip
