"""A real ``pagedllm serve`` process driven by the official ``openai`` client (tiny model + real tokenizer)."""

from __future__ import annotations

import asyncio
import copy
import json
import signal
import time

import httpx
import openai
import pytest

from tests.entrypoints.server_utils import ServerProcess

ENGINE_ARGS = ["--dtype", "float32", "--num-kv-blocks", "400", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def server(tiny_llama_tok):
    srv = ServerProcess(["--model", str(tiny_llama_tok), *ENGINE_ARGS])
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def model(tiny_llama_tok) -> str:
    return str(tiny_llama_tok)  # served under the path as given, like vLLM


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_models_health_version(server, client, model):
    assert [m.id for m in client.models.list().data] == [model]
    assert client.models.retrieve(model).id == model  # GET /v1/models/{id}
    missing = httpx.get(f"{server.url}/v1/models/no-such/model")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    assert httpx.get(f"{server.url}/health").status_code == 200
    for path in ("/health", "/dashboard", "/dashboard/dashboard.js"):  # load balancers and link checkers probe with HEAD
        assert httpx.head(f"{server.url}{path}").status_code == 200, path
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_completion_stream_equals_non_stream(client, model):
    kw = dict(model=model, prompt="Once upon a time", max_tokens=20, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    reasons = [c.choices[0].finish_reason for c in text_chunks]
    assert reasons[-1] == full.choices[0].finish_reason and all(r is None for r in reasons[:-1])
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert full.usage.completion_tokens == 20 or full.choices[0].finish_reason == "stop"
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_equals_non_stream(client, model):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi!"}]}]
    kw = dict(model=model, messages=msgs, max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == full.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in with_choices]
    assert reasons[-1] is not None and all(r is None for r in reasons[:-1])
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_exact_usage(server, client, model):
    prompt = "The quick brown fox"
    out = client.completions.create(model=model, prompt=prompt, max_tokens=7, temperature=0, logprobs=1)
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(out.choices[0].logprobs.tokens)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    msgs = [{"role": "user", "content": "Count to three."}]
    chat = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=5, temperature=0)
    chat_ids = httpx.post(f"{server.url}/tokenize", json={"messages": msgs}).json()["tokens"]
    assert chat.usage.prompt_tokens == len(chat_ids)
    # /tokenize renders what chat would: continuing the last assistant message, and tools.
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    prefill = [*msgs, {"role": "assistant", "content": "One,"}]
    ids = {name: httpx.post(f"{server.url}/tokenize", json={"messages": m, **kw}).json()["tokens"] for name, m, kw in [
        ("cont", prefill, {"continue_final_message": True, "add_generation_prompt": False}),
        ("closed", prefill, {"add_generation_prompt": False}),
        ("tools", msgs, {"tools": tools})]}  # fmt: skip
    assert ids["cont"] != ids["closed"] and len(ids["tools"]) > len(chat_ids)
    chat = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=5, temperature=0,
                                          tools=tools, tool_choice="required")  # fmt: skip
    assert chat.usage.prompt_tokens == len(ids["tools"])
    bad = httpx.post(f"{server.url}/tokenize", json={"messages": msgs, "tools": [{"type": "function"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"


def test_n_stop_logprobs_seed(client, model):
    two = client.completions.create(model=model, prompt="Hello", max_tokens=8, n=2, temperature=1.0, seed=5)
    assert sorted(c.index for c in two.choices) == [0, 1]
    again = client.completions.create(model=model, prompt="Hello", max_tokens=8, n=2, temperature=1.0, seed=5)
    assert [c.text for c in two.choices] == [c.text for c in again.choices]
    assert two.usage.completion_tokens == 2 * 8 or any(c.finish_reason == "stop" for c in two.choices)

    ref = client.completions.create(model=model, prompt="Hello", max_tokens=12, temperature=0)
    stop = ref.choices[0].text[3:6]
    assert stop
    cut = client.completions.create(model=model, prompt="Hello", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == ref.choices[0].text[: ref.choices[0].text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"

    lp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob >= item.top_logprobs[2].logprob
        # Greedy: the top entry is the chosen token itself; each entry names its own token.
        assert (item.top_logprobs[0].token, item.top_logprobs[0].logprob) == (item.token, item.logprob)
        assert len({t.token for t in item.top_logprobs}) == 3
        assert all(t.bytes == list(t.token.encode()) for t in item.top_logprobs)
    # Chat streamed with n=2 and logprobs: each choice's deltas add up to its unstreamed reply.
    kw = dict(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, n=2, temperature=1.0, seed=3,
              logprobs=True, top_logprobs=2)  # fmt: skip
    whole = client.chat.completions.create(**kw)
    parts = list(client.chat.completions.create(stream=True, **kw))
    assert sorted(c.index for c in whole.choices) == [0, 1]
    for c in whole.choices:
        mine = [d for ch in parts for d in ch.choices if d.index == c.index]
        assert "".join(d.delta.content or "" for d in mine) == c.message.content
        streamed = [(t.token, t.logprob) for d in mine if d.logprobs for t in d.logprobs.content]
        assert streamed == [(t.token, t.logprob) for t in c.logprobs.content] and streamed


def test_token_prompts_and_batches(client, model):
    out = client.completions.create(model=model, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.prompt_tokens == 5


def test_concurrent_streams_equal_sequential(server, model):
    prompts = [f"Story number {i}: once" for i in range(32)]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    sequential = [client.completions.create(model=model, prompt=p, max_tokens=12, temperature=0).choices[0].text for p in prompts]

    async def one(ac: openai.AsyncOpenAI, p: str) -> str:
        stream = await ac.completions.create(model=model, prompt=p, max_tokens=12, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    concurrent = asyncio.run(all_of_them())
    matches = sum(a == b for a, b in zip(concurrent, sequential))
    assert matches == 32, f"{matches}/32 concurrent outputs equal the sequential ones"


def test_disconnect_mid_stream_frees_everything(server, model):
    idle_usage = server.metric("pagedllm:kv_cache_usage_perc")
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={"model": model, "prompt": "Tell me a long story", "max_tokens": 400, "ignore_eos": True, "stream": True},
        timeout=30,
    ) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert server.metric("pagedllm:num_requests_running") == 1
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if server.metric("pagedllm:num_requests_running") == 0 and server.metric("pagedllm:kv_cache_usage_perc") == idle_usage:
            break
        time.sleep(0.05)
    assert server.metric("pagedllm:num_requests_running") == 0
    assert server.metric("pagedllm:kv_cache_usage_perc") == idle_usage


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "lots"}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, None),
    ("/v1/completions", {"prompt": [1, 10**9]}, 400, None),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "word " * 600}, 400, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, None),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [-5]}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400, None),
    # (named "logprobs" before: the field a client sent is top_logprobs)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    ("/detokenize", {"tokens": [10**8]}, 400, None),
    # vLLM refuses stream_options without a stream; fields we cannot honour are refused, not ignored.
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "x", "return_token_ids": True}, 400, "return_token_ids"),
    ("/v1/completions", {"prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
    ("/v1/completions", {"prompt": None}, 400, "prompt"),  # null is the default only where there is one
]


@pytest.mark.parametrize("path, body, status, param", BAD_REQUESTS)
def test_malformed_requests_get_openai_errors(server, model, path, body, status, param):
    if status != 404 and "model" not in body:
        body = {"model": model, **body}
    resp = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"] and err["code"] == status
    if param is not None:
        assert err["param"] == param, err


def test_bad_json_and_server_survives(server, client, model):
    resp = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "error" in resp.json()
    ok = client.completions.create(model=model, prompt="Still alive?", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_token_counters_equal_usage_sums(tiny_llama_tok):
    srv = ServerProcess(["--model", str(tiny_llama_tok), *ENGINE_ARGS])
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        prompt_sum = completion_sum = gaps = 0
        eos = {"ignore_eos": True}  # every sample runs to max_tokens: max_tokens - 1 gaps a request
        for i in range(5):
            out = c.completions.create(model=str(tiny_llama_tok), prompt=f"Request {i}", max_tokens=3 + i, n=1 + i % 2,
                                       extra_body=eos)  # fmt: skip
            prompt_sum += out.usage.prompt_tokens
            completion_sum += out.usage.completion_tokens
            gaps += 2 + i + i % 2  # (sample 1 of n=2 starts a step late, once sample 0 has cached the prompt)
        chat = c.chat.completions.create(model=str(tiny_llama_tok), messages=[{"role": "user", "content": "hey"}], max_tokens=4,
                                         extra_body=eos)  # fmt: skip
        prompt_sum += chat.usage.prompt_tokens
        completion_sum += chat.usage.completion_tokens
        gaps += 3
        # Found by an adversarial session: a prompt served from the prefix cache counted only its
        # computed tokens, and best_of / beam search outputs (whole at the end) gave no latencies.
        long = "The same long prompt, sent twice so that the second finds it cached. " * 4
        extra = [dict(prompt=long, max_tokens=3), dict(prompt=long, max_tokens=3), dict(prompt="Best of", max_tokens=6, best_of=3),
                 dict(prompt="Beams", max_tokens=5, n=2, temperature=0, extra_body={"use_beam_search": True, **eos})]  # fmt: skip
        for i, kw in enumerate(extra):
            out = c.completions.create(model=str(tiny_llama_tok), **{"extra_body": eos, **kw})
            prompt_sum += out.usage.prompt_tokens
            completion_sum += out.usage.completion_tokens
            gaps += kw["max_tokens"] - 1
            if i == 1:  # (best_of and beams generate more tokens than they return: the counter has them all)
                assert srv.metric("pagedllm:generation_tokens_total") == completion_sum
        assert srv.metric("pagedllm:prompt_tokens_total") == prompt_sum
        assert srv.metric("pagedllm:generation_tokens_total") > completion_sum
        assert srv.metric("pagedllm:request_success_total") == 10
        for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
            assert srv.metric(f"pagedllm:{name}_count") == 10, name  # one per request, n=2, best_of, beams included
        # Each request's first token is its time to first token; each later step of its sequences
        # (n samples or beams advance together), one inter-token latency.
        assert srv.metric("pagedllm:inter_token_latency_seconds_count") == gaps
        # Time to first token = waiting in the queue + the prefill, request by request.
        queue_and_prefill = srv.metric("pagedllm:request_queue_time_seconds_sum") + srv.metric("pagedllm:request_prefill_time_seconds_sum")
        assert queue_and_prefill == pytest.approx(srv.metric("pagedllm:time_to_first_token_seconds_sum"), abs=1e-6)
        # Per finished request, vLLM's length histograms: the prompt and the outputs as usage counts them.
        assert srv.metric("pagedllm:request_prompt_tokens_count") == srv.metric("pagedllm:request_generation_tokens_count") == 10
        assert srv.metric("pagedllm:request_prompt_tokens_sum") == prompt_sum
        assert srv.metric("pagedllm:request_generation_tokens_sum") == completion_sum
        # vLLM's phase histograms, one per finished request; prefill + decode = inference (running).
        for name in ("prefill", "decode", "inference", "time_per_output_token"):
            assert srv.metric(f"pagedllm:request_{name}_time_seconds_count" if name != "time_per_output_token"
                              else "pagedllm:request_time_per_output_token_seconds_count") == 10, name  # fmt: skip
        phases = srv.metric("pagedllm:request_prefill_time_seconds_sum") + srv.metric("pagedllm:request_decode_time_seconds_sum")
        assert phases == pytest.approx(srv.metric("pagedllm:request_inference_time_seconds_sum"), abs=1e-6)
        # Every finish reason's series exists from the start (0 for abort here), as vLLM's.
        text = httpx.get(f"{srv.url}/metrics", timeout=5).text
        assert all(f'finished_reason="{r}"' in text for r in ("stop", "length", "abort", "error"))
        # vLLM's request-parameter histograms: n (1, 2, 1, 2, 1; chat 1; 1, 1; best_of's n 1;
        # beams 2) and max_tokens; every sample ran to max_tokens, so each request's longest
        # sequence is its max_tokens.
        assert srv.metric("pagedllm:request_params_n_count") == 10
        assert srv.metric("pagedllm:request_params_n_sum") == 13
        max_tokens_sum = (3 + 4 + 5 + 6 + 7) + 4 + sum(kw["max_tokens"] for kw in extra)
        assert srv.metric("pagedllm:request_params_max_tokens_sum") == max_tokens_sum
        assert srv.metric("pagedllm:request_max_num_generation_tokens_count") == 10
        assert srv.metric("pagedllm:request_max_num_generation_tokens_sum") == max_tokens_sum
        info = next(line for line in text.splitlines() if line.startswith("pagedllm:cache_config_info{"))
        for label in ('block_size="16"', 'num_gpu_blocks="400"', 'num_cpu_blocks="0"', 'enable_prefix_caching="True"'):
            assert label in info, info
        assert info.endswith(" 1.0")
    finally:
        assert srv.stop() == 0


def test_api_key_and_sigterm_during_streams(tiny_llama_tok):
    srv = ServerProcess(
        ["--model", str(tiny_llama_tok), *ENGINE_ARGS, "--graceful-shutdown-timeout", "1", "--guard-metrics"],
        env={"PAGEDLLM_API_KEY": "sekret"},
    )
    model = str(tiny_llama_tok)
    try:
        body = {"model": model, "prompt": "x", "max_tokens": 2}
        assert httpx.post(f"{srv.url}/v1/completions", json=body).status_code == 401
        assert httpx.post(f"{srv.url}/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.post(f"{srv.url}/v1/completions", json=body, headers={"Authorization": "sekret"}).status_code == 401
        ok = httpx.post(f"{srv.url}/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert httpx.post(f"{srv.url}/v1/completions", json=body, headers={"Authorization": "bearer sekret"}).status_code == 200
        # Every route that does work is guarded; /health and /version are open.
        for method, path in [("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/docs"), ("GET", "/openapi.json"),
                             ("GET", "/v1/models"), ("GET", "/metrics")]:  # fmt: skip
            resp = httpx.request(method, f"{srv.url}{path}", json={"prompt": "x", "tokens": [1]})
            assert resp.status_code == 401 and resp.json()["error"]["type"] == "AuthenticationError", path
        assert httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(f"{srv.url}/health").status_code == 200 and httpx.get(f"{srv.url}/version").status_code == 200

        async def stream_until_end() -> list[str]:
            headers = {"Authorization": "Bearer sekret"}
            req = {"model": model, "prompt": "A long one", "max_tokens": 500, "ignore_eos": True, "stream": True}
            async with httpx.AsyncClient(timeout=60) as ac:
                async with ac.stream("POST", f"{srv.url}/v1/completions", json=req, headers=headers) as resp:
                    return [line async for line in resp.aiter_lines() if line]

        async def scenario() -> list[list[str]]:
            tasks = [asyncio.create_task(stream_until_end()) for _ in range(3)]
            await asyncio.sleep(1.5)
            srv.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

        results = asyncio.run(scenario())
        for lines in results:
            assert lines[-1] == "data: [DONE]"
            last = json.loads(lines[-2][len("data: ") :])
            assert last["choices"][0]["finish_reason"] in ("abort", "length")
        assert srv.proc.wait(timeout=60) == 0
    finally:
        srv.stop()


def test_cached_tokens_in_usage_and_prefix_metrics(server, client, model):
    prompt = "The same long system prompt. " * 20
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    hits_before = server.metric("pagedllm:prefix_cache_hits_total")
    second = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert first.choices[0].text == second.choices[0].text
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= second.usage.prompt_tokens - 16 and cached % 16 == 0
    assert server.metric("pagedllm:prefix_cache_hits_total") - hits_before == cached
    assert server.metric("pagedllm:prefix_cache_queries_total") >= server.metric("pagedllm:prefix_cache_hits_total")


def test_echo_with_logprobs(client, model):
    prompt = "Echo this prompt"
    out = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    c = out.choices[0]
    assert c.text.startswith(prompt)
    lp = c.logprobs
    assert len(lp.tokens) == out.usage.prompt_tokens + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens[: out.usage.prompt_tokens]) == prompt
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # Streamed, the same tokens and logprobs (the prompt's came only unstreamed before);
    # logprobs=0 gives each position its own token's logprob (was {} for prompt tokens).
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                            logprobs=2, stream=True))  # fmt: skip
    streamed = [t for ch in chunks for t in ch.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    assert [x for ch in chunks for x in ch.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    # Each chunk's text_offset continues the one before (they restarted at 0 in every chunk).
    assert [x for ch in chunks for x in ch.choices[0].logprobs.text_offset] == lp.text_offset
    for echo in (False, True):
        kw = dict(model=model, prompt=prompt, max_tokens=5, temperature=0, echo=echo, logprobs=0, n=2)
        whole = client.completions.create(**kw).choices
        parts = list(client.completions.create(stream=True, **kw))
        for c in whole:
            got = [x for ch in parts for d in ch.choices if d.index == c.index for x in d.logprobs.text_offset]
            assert got == c.logprobs.text_offset and len(set(got)) == len(got) > 2
    # Several prompts and n=2: choice index = prompt * n + sample, streamed as not.
    kw = dict(model=model, prompt=["One prompt", "Another prompt"], max_tokens=4, n=2, temperature=1.0, seed=7)
    whole = {c.index: c.text for c in client.completions.create(**kw).choices}
    streamed: dict[int, str] = {}
    for ch in client.completions.create(stream=True, **kw):
        for d in ch.choices:
            streamed[d.index] = streamed.get(d.index, "") + d.text
    assert sorted(whole) == [0, 1, 2, 3] and streamed == whole
    zero = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=0)
    tops = zero.choices[0].logprobs.top_logprobs
    assert tops[0] is None and all(list(t) == [tok] for t, tok in zip(tops[1:], zero.choices[0].logprobs.tokens[1:]))


def test_bench_serve_drives_the_server(server, model, tmp_path):
    """`pagedllm bench serve` against our own server: every request succeeds, figures are sane."""
    from pagedllm.entrypoints.cli import main

    out = tmp_path / "serve.json"
    args = ["bench", "serve", "--base-url", server.url, "--input-len", "16", "--output-len", "6",
            "--num-prompts", "8", "--request-rate", "20", "--goodput", "ttft:60000", "--save-result", str(out)]  # fmt: skip
    assert main(args) == 0
    res = json.loads(out.read_text())
    assert res["model"] == model
    assert res["successful_requests"] == 8 and res["failed_requests"] == 0
    assert res["output_token_throughput"] > 0 and res["goodput"] > 0
    assert 0 < res["ttft_ms"]["median"] <= res["e2el_ms"]["median"]


def test_explicit_nulls_mean_the_defaults(server, model):
    """OpenAI types these fields "X or null" and clients send the null; it was a 400."""
    nulls = {"n": None, "stream": None, "presence_penalty": None, "frequency_penalty": None, "stream_options": None}
    body = {"model": model, "max_tokens": 3, "temperature": 0}
    plain = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": "Hi"}, timeout=30).json()
    resp = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": "Hi", "echo": None, **nulls}, timeout=30)
    assert resp.status_code == 200, resp.text
    assert [c["text"] for c in resp.json()["choices"]] == [c["text"] for c in plain["choices"]]
    chat = {**body, "messages": [{"role": "user", "content": "Hi"}], "logprobs": None, "parallel_tool_calls": None, **nulls}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=30)
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 1, resp.text


def test_chat_echo_puts_the_continued_message_first(client, model):
    """vLLM's chat ``echo``: a continued assistant message comes back before the reply (it
    was accepted and ignored)."""
    start = "My favourite colour is"
    messages = [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": start}]
    kw = dict(model=model, messages=messages, max_tokens=5, temperature=0)
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    bare = client.chat.completions.create(**kw, extra_body=extra).choices[0].message.content
    echoed = client.chat.completions.create(**kw, extra_body={**extra, "echo": True}).choices[0].message.content
    assert echoed == start + bare
    chunks = client.chat.completions.create(**kw, stream=True, extra_body={**extra, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed
    # A user message last (a new reply) is not echoed.
    plain = client.chat.completions.create(model=model, messages=messages[:1], max_tokens=3, temperature=0,
                                           extra_body={"echo": True}).choices[0].message.content  # fmt: skip
    assert not plain.startswith("Tell me.")


def test_cache_salt_keeps_prefix_caches_apart(server, client, model):
    """vLLM's ``cache_salt``: requests share prefix-cache blocks only under the same salt (it
    was accepted and ignored, so another tenant's prompt could be timed)."""
    prompt = "A long shared system prompt for salting. " * 12

    def cached(**extra) -> int:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens or 0

    cached()  # the unsalted blocks
    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") > 0  # its own salt hits
    assert cached(cache_salt="tenant-b") == 0
    chat = [{"role": "user", "content": prompt}]
    hit = [client.chat.completions.create(model=model, messages=chat, max_tokens=1, extra_body={"cache_salt": "c"})
           .usage.prompt_tokens_details for _ in range(2)]  # fmt: skip
    assert (hit[0].cached_tokens or 0) == 0 and hit[1].cached_tokens > 0


@pytest.fixture(scope="module")
def bos_server(tmp_path_factory, default_tokenizer):
    """A tiny model whose tokenizer adds a BOS to every text it encodes (as Llama's and Gemma's)."""
    from tokenizers import processors

    from tests.conftest import save_tiny_model

    path = save_tiny_model(tmp_path_factory.mktemp("tiny-llama-bos"), vocab_size=49152, seed=3)
    tok = copy.deepcopy(default_tokenizer)
    bos = tok.bos_token
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.bos_token_id)])  # fmt: skip
    tok.save_pretrained(str(path))
    srv = ServerProcess(["--model", str(path), *ENGINE_ARGS])
    yield srv, str(path)
    assert srv.stop() == 0


def test_add_special_tokens_is_honoured(bos_server):
    """vLLM's request field (it was ignored: a text prompt always got the tokenizer's BOS)."""
    srv, model = bos_server
    prompt = "Hello there, how are you"
    counted = {flag: httpx.post(f"{srv.url}/tokenize", json={"prompt": prompt, "add_special_tokens": flag}).json()["count"]
               for flag in (True, False)}  # fmt: skip
    assert counted[True] == counted[False] + 1

    def used(path: str, body: dict) -> int:
        resp = httpx.post(f"{srv.url}/v1/{path}", json={"model": model, "max_tokens": 1, **body}, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens"]

    assert used("completions", {"prompt": prompt}) == counted[True]  # the default: True
    assert used("completions", {"prompt": prompt, "add_special_tokens": False}) == counted[False]
    echoed = httpx.post(f"{srv.url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1, "echo": True,
                                                           "add_special_tokens": False}).json()["choices"][0]["text"]  # fmt: skip
    assert echoed.startswith(prompt)
    messages = [{"role": "user", "content": prompt}]
    assert used("chat/completions", {"messages": messages, "add_special_tokens": True}) == \
        used("chat/completions", {"messages": messages}) + 1  # the default for chat: False (the template has its own)


def test_chat_echo_joins_text_parts_as_the_prompt_does(client, model):
    parts = [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two"}]
    messages = [{"role": "user", "content": "Go on."}, {"role": "assistant", "content": parts}]
    extra = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0, extra_body=extra)
    assert out.choices[0].message.content.startswith("Part one.\nPart two")


def test_tokenize_counts_past_the_context_but_not_without_bound(server):
    """As vLLM, /tokenize counts a text longer than max_model_len (a client counts to decide
    what to cut); far beyond it (TOKENIZE_LIMIT x) it refuses from the text's head."""
    over = httpx.post(f"{server.url}/tokenize", json={"prompt": "word " * 600}, timeout=30).json()
    assert over["count"] > over["max_model_len"] == 512
    far = httpx.post(f"{server.url}/tokenize", json={"prompt": "word " * 100_000}, timeout=30)
    assert far.status_code == 400 and far.json()["error"]["param"] == "prompt"
    assert "longer than 4 x max_model_len (2048 tokens)" in far.json()["error"]["message"]
    # Found by an adversarial session: a text past the limit but short of the head check's 16
    # characters per token (here ~2,100 tokens in 10,500 characters) was counted, not refused.
    for body in [{"prompt": "word " * 2100}, {"messages": [{"role": "user", "content": "word " * 2100}]}]:
        past = httpx.post(f"{server.url}/tokenize", json=body, timeout=30)
        assert past.status_code == 400, past.text
        assert "longer than 4 x max_model_len (2048 tokens)" in past.json()["error"]["message"]


def test_tokenize_renders_messages_with_the_requests_template_arguments_as_chat_does(server, model):
    """Found by an adversarial session: /tokenize dropped chat_template and chat_template_kwargs,
    so it counted the model's own template (HTTP 200) where chat refused or rendered another."""
    messages = [{"role": "user", "content": "Hi"}]
    for extra, message in [({"chat_template": "{{ messages[0].content }}"}, "--trust-request-chat-template"),
                           ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs may not set tools")]:  # fmt: skip
        tokenized = httpx.post(f"{server.url}/tokenize", json={"model": model, "messages": messages, **extra}, timeout=30)
        chat = httpx.post(f"{server.url}/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 1, **extra}, timeout=30)
        assert tokenized.status_code == chat.status_code == 400, (tokenized.text, chat.text)
        assert message in tokenized.json()["error"]["message"] and message in chat.json()["error"]["message"]
    kwargs = {"chat_template_kwargs": {"unused_by_the_template": 1}}
    tokenized = httpx.post(f"{server.url}/tokenize", json={"model": model, "messages": messages, **kwargs}, timeout=30).json()
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 1, **kwargs}, timeout=30).json()
    assert tokenized["count"] == chat["usage"]["prompt_tokens"]


def test_preemption_and_step_size_metrics(tiny_llama_tok):
    """A pool too small for four requests at once: preemptions are counted, and the steps'
    token histogram holds every computed token (recomputed ones too)."""
    srv = ServerProcess(["--model", str(tiny_llama_tok), "--dtype", "float32", "--num-kv-blocks", "16",
                         "--max-model-len", "128", "--max-num-seqs", "4"])  # fmt: skip
    try:
        body = {"model": str(tiny_llama_tok), "prompt": [list(range(3, 23))], "max_tokens": 80, "ignore_eos": True}

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as ac:
                return await asyncio.gather(*[ac.post(f"{srv.url}/v1/completions", json=body) for _ in range(4)])

        responses = asyncio.run(burst())  # 4 x 100 tokens need 28 blocks of 16; the pool has 16
        assert [r.status_code for r in responses] == [200] * 4
        assert all(r.json()["usage"]["completion_tokens"] == 80 for r in responses)
        assert srv.metric("pagedllm:num_preemptions_total") > 0
        computed_once = 4 * (20 + 80 - 1)  # the last token is sampled, never fed back
        assert srv.metric("pagedllm:iteration_tokens_total_sum") > computed_once  # (and recomputation on top)
        assert srv.metric("pagedllm:iteration_tokens_total_count") > 80
    finally:
        assert srv.stop() == 0
