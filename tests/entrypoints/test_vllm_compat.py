"""Request and response details a vLLM user relies on, through a real server (a
vLLM-compatibility sweep found each one different): the client's request id names the
response, usage in a stream carries cached tokens, ``stream_options: {}`` includes usage,
``top_logprobs: 0`` needs no ``logprobs``, a chat message always has ``tool_calls``."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.entrypoints.server_utils import ServerProcess

ENGINE_ARGS = ["--dtype", "float32", "--num-kv-blocks", "400", "--max-model-len", "512"]
MESSAGES = [{"role": "user", "content": "Tell me about the sea and the sky in a long answer, please, with details."}]


@pytest.fixture(scope="module")
def server(tiny_llama_tok):
    srv = ServerProcess(["--model", str(tiny_llama_tok), *ENGINE_ARGS])
    yield srv
    assert srv.stop() == 0


def post(server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers or {}, timeout=120)


def sse(response: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_the_clients_request_id_names_the_response(server):
    body = {"prompt": "Hello", "max_tokens": 3}
    assert post(server, "/v1/completions", {**body, "request_id": "abc-1"}).json()["id"] == "cmpl-abc-1"
    # The X-Request-Id header wins over the body's field, as in vLLM; chat too.
    r = post(server, "/v1/completions", {**body, "request_id": "abc-1"}, {"X-Request-Id": "hdr-7"})
    assert r.json()["id"] == "cmpl-hdr-7"
    r = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3}, {"X-Request-Id": "hdr-8"})
    assert r.json()["id"] == "chatcmpl-hdr-8"
    chunks = sse(post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "stream": True, "request_id": "s-1"}))
    assert {c["id"] for c in chunks} == {"chatcmpl-s-1"}
    # Two requests with one id at the same time both run (the engine's ids stay distinct).
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: results.append(post(server, "/v1/completions", {**body, "max_tokens": 20},
                                                                     {"X-Request-Id": "same"}))) for _ in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200, 200] and {r.json()["id"] for r in results} == {"cmpl-same"}
    bad = post(server, "/v1/completions", {**body, "request_id": "x" * 300})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"


def test_streamed_usage_counts_cached_tokens_and_stream_options_default_to_usage(server):
    body = {"messages": MESSAGES, "max_tokens": 4, "stream": True}
    post(server, "/v1/chat/completions", {**body, "stream": False})  # the prompt's blocks are cached now
    usage = sse(post(server, "/v1/chat/completions", {**body, "stream_options": {}}))[-1]["usage"]  # include_usage: vLLM's default
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 16
    usage = sse(post(server, "/v1/completions", {"prompt": MESSAGES[0]["content"], "max_tokens": 2, "stream": True,
                                                 "stream_options": {"include_usage": True}}))[-1]["usage"]  # fmt: skip
    assert "prompt_tokens_details" in usage
    chunks = sse(post(server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": False}}))
    assert all("usage" not in c or c["usage"] is None for c in chunks)


def test_chat_response_shape(server):
    r = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "top_logprobs": 0})
    assert r.status_code == 200, r.text  # top_logprobs 0 asks for nothing: no logprobs needed
    body = r.json()
    assert body["choices"][0]["message"]["tool_calls"] == [] and body["system_fingerprint"] is None
    assert post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "top_logprobs": 2}).status_code == 400


def test_echo_without_generation_scores_the_prompt(server):
    """``echo`` with ``max_tokens: 0`` (vLLM's, how evaluation harnesses score a text): the prompt,
    its logprobs, nothing generated; the same prompt logprobs as with a generated token."""
    prompt = "The sea is blue and the sky is wide"
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "temperature": 0}
    scored = post(server, "/v1/completions", {**body, "max_tokens": 0}).json()
    generated = post(server, "/v1/completions", {**body, "max_tokens": 1}).json()
    choice = scored["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert scored["usage"]["completion_tokens"] == 0
    n = scored["usage"]["prompt_tokens"]
    lp, ref = choice["logprobs"], generated["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == n and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"] == ref["token_logprobs"][:n] and lp["tokens"] == ref["tokens"][:n]
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0})  # without echo: nothing to return
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    # Streamed: the same text and logprobs in chunks, then usage without completion tokens.
    chunks = sse(post(server, "/v1/completions", {**body, "max_tokens": 0, "stream": True, "stream_options": {}}))
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["text"] for c in choices) == prompt and choices[-1]["finish_reason"] == "length"
    assert sum((c["logprobs"]["token_logprobs"] for c in choices), []) == lp["token_logprobs"]
    assert chunks[-1]["usage"]["completion_tokens"] == 0


def test_top_level_structural_tag_constrains_the_output(server):
    """vLLM's top-level ``structural_tag`` (JSON text) constrains as response_format's does (it
    was ignored: free text came back)."""
    import re

    tag = {"type": "structural_tag",
           "format": {"type": "tag", "begin": "<a>", "content": {"type": "regex", "pattern": "[0-9]{1,3}"}, "end": "</a>"}}  # fmt: skip
    r = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 40, "temperature": 0.8, "seed": 3,
                                              "structural_tag": json.dumps(tag)})  # fmt: skip
    assert r.status_code == 200, r.text
    assert re.fullmatch("<a>[0-9]{1,3}</a>", r.json()["choices"][0]["message"]["content"])
    both = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "structural_tag": json.dumps(tag),
                                                 "guided_regex": "[0-9]"})  # fmt: skip
    assert both.status_code == 400 and "at most one output constraint" in both.text


def test_several_served_model_names(tiny_llama_tok):
    """``--served-model-name A B``: requests may name either, answers name the one asked for
    (vLLM's); /v1/models lists them all."""
    srv = ServerProcess(["--model", str(tiny_llama_tok), *ENGINE_ARGS, "--served-model-name", "first", "second"])
    try:
        assert [m["id"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]] == ["first", "second"]
        for name in ("first", "second", str(tiny_llama_tok)):
            r = post(srv, "/v1/completions", {"model": name, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == name, (name, r.text)  # the name asked for, as vLLM
        assert post(srv, "/v1/completions", {"model": "third", "prompt": "Hi", "max_tokens": 2}).status_code == 404
    finally:
        assert srv.stop() == 0


def test_an_empty_tools_list_is_refused(server):
    """Current vLLM and OpenAI refuse ``tools: []`` (400 naming tools), and so do we."""
    r = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "tools": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_time_per_output_token_uses_the_longest_samples_tokens(tiny_llama):
    """n > 1 with samples ending at different steps: delta outputs hold only the samples still
    running, so the tokens per sequence behind TPOT are counted per sample (a review found the
    whole request's tokens divided by the last output's samples)."""
    import types

    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine.output_processor import RequestOutputKind
    from pagedllm.entrypoints.openai.metrics import ServerMetrics
    from pagedllm.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64), log_stats_interval=1e9)
    fake = types.SimpleNamespace(engine=engine, num_running=lambda: 0, num_waiting=lambda: 0, kv_cache_usage=lambda: 0.0,
                                 data_parallel_size=1, add_stat_logger=lambda s: None, output_hooks=[], request_hooks=[])  # fmt: skip
    metrics = ServerMetrics(fake, "m")
    seen: list[int] = []
    record = metrics._record_phases
    metrics._record_phases = lambda m, now, tokens: (seen.append(tokens), record(m, now, tokens))
    for seed in range(40):
        engine.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(n=2, seed=seed, max_tokens=20,
                           stop_token_ids=list(range(0, 256, 9))), f"r{seed}", output_kind=RequestOutputKind.DELTA)  # fmt: skip
        per: dict[int, int] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                for c in out.outputs:
                    per[c.index] = per.get(c.index, 0) + len(c.token_ids)
                metrics.on_output(out)
        assert seen[-1] == max(per.values()), (per, seen[-1])
        if len(set(per.values())) > 1:
            break
    assert len(set(per.values())) > 1, "no seed gave samples of different lengths"
