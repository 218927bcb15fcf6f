"""Request-shaping and validation of the OpenAI API that a mutation audit found unpinned, against
a real ``pagedllm serve`` (tiny model + real tokenizer, a short context and a small batch).

Each bad request gets HTTP 400 with an OpenAI error body whose ``param`` names the field the
client sent; the server keeps serving afterwards.
"""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.server_utils import ServerProcess

MAX_MODEL_LEN = 64
MAX_NUM_SEQS = 4
ENGINE_ARGS = ["--dtype", "float32", "--num-kv-blocks", "100", "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-seqs", str(MAX_NUM_SEQS)]  # fmt: skip
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama_tok):
    srv = ServerProcess(["--model", str(tiny_llama_tok), *ENGINE_ARGS])
    yield srv
    assert srv.stop() == 0


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


C, CH = "/v1/completions", "/v1/chat/completions"
BAD_REQUESTS = [
    # Fields we cannot honour are refused, not ignored (a client would believe it got them).
    (CH, {"messages": MSGS, "n": 1, "best_of": 3}, "best_of"),  # chat has no best_of > n
    (C, {"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
    (C, {"prompt": "x", "truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
    (C, {"prompt": "x", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    (C, {"prompt": "x", "suffix": "end"}, "suffix"),
    (C, {"prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
    (C, {"prompt": "x", "guided_regex": "a+", "guided_choice": ["a", "b"]}, "structured_outputs"),
    (C, {"prompt": [[1, 2]] * 1025}, "prompt"),  # more prompts than one request may carry
    # Errors about a token-id prompt name "prompt", the field the client sent.
    (C, {"prompt": [1, 10**9]}, "prompt"),
    (C, {"prompt": [5] * MAX_MODEL_LEN}, "prompt"),
    (C, {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    # SamplingParams' bounds, reached over HTTP.
    (C, {"prompt": "x", "top_p": 0}, "top_p"),
    (C, {"prompt": "x", "min_p": 1.5}, "min_p"),
    (C, {"prompt": "x", "top_k": -2}, "top_k"),
    (C, {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    (C, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    (C, {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    (C, {"prompt": "x", "stop": ["ok", ""]}, "stop"),
    (C, {"prompt": "x", "logprobs": 21}, "logprobs"),
    (C, {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    (C, {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    (C, {"prompt": "x", "n": MAX_NUM_SEQS + 1}, "n"),
    (C, {"prompt": "x", "priority": 1}, "priority"),  # fcfs: a priority would be ignored
]


@pytest.mark.parametrize("path, body, param", BAD_REQUESTS)
def test_bad_requests_get_400_naming_the_field(server, path, body, param):
    resp = post(server, path, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["message"]
    assert err["param"] == param, err


def test_max_completion_tokens_wins_over_max_tokens(server):
    """OpenAI deprecated max_tokens for max_completion_tokens: when a client sends both (as
    some SDKs do), the newer field sets the length, as in vLLM."""
    body = {"messages": MSGS, "temperature": 0, "ignore_eos": True, "max_tokens": 2, "max_completion_tokens": 5}
    resp = post(server, CH, body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 5


def test_the_edges_are_accepted_and_the_server_keeps_serving(server):
    """The last valid value of each bound is served (n == max_num_seqs, a prompt one token short
    of the context, logprobs 20, top_k -1) after all the refusals above."""
    for body in [
        {"prompt": "x", "max_tokens": 2, "n": MAX_NUM_SEQS, "temperature": 1.0, "seed": 1},
        {"prompt": [5] * (MAX_MODEL_LEN - 1), "max_tokens": 1},
        {"prompt": "x", "max_tokens": 2, "logprobs": 20, "top_k": -1, "top_p": 1, "min_p": 1},
    ]:
        resp = post(server, C, body)
        assert resp.status_code == 200, (body, resp.text)
        assert resp.json()["choices"][0]["finish_reason"] in ("length", "stop")
