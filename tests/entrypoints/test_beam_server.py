"""use_beam_search / best_of / length_penalty on /v1/completions (a real server, tiny model)."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.server_utils import ServerProcess


@pytest.fixture(scope="module")
def server(tiny_llama_tok):
    srv = ServerProcess(["--model", str(tiny_llama_tok), "--num-kv-blocks", "300", "--max-model-len", "512"])
    yield srv
    assert srv.stop() == 0


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_beam_search_completion(server):
    body = dict(prompt="Once upon a time", max_tokens=8, ignore_eos=True, use_beam_search=True, n=2, best_of=3, length_penalty=0.5)
    r = post(server, "/v1/completions", **body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and all(c["finish_reason"] == "length" for c in choices)
    assert choices[0]["text"] != choices[1]["text"]
    assert r.json()["usage"]["completion_tokens"] == 16
    again = post(server, "/v1/completions", **body).json()["choices"]  # deterministic
    assert [c["text"] for c in again] == [c["text"] for c in choices]


def test_best_of_completion_and_errors(server):
    r = post(server, "/v1/completions", prompt="Hello", max_tokens=5, n=2, best_of=4, seed=3, temperature=1.0)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    bad = [
        dict(n=3, best_of=2),  # best_of < n
        dict(n=1, best_of=3, stream=True),  # best_of > n cannot stream
        dict(use_beam_search=True, temperature=0.7),
        dict(use_beam_search=True, n=1, best_of=11),  # wider than the logprobs the engine gives
        dict(use_beam_search=True, stop=["."]),
        dict(use_beam_search=True, n=2, best_of=2, logprobs=1),
    ]
    for extra in bad:
        r = post(server, "/v1/completions", prompt="Hello", max_tokens=5, **extra)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["type"] == "BadRequestError"
    r = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], use_beam_search=True)
    assert r.status_code == 400 and "use_beam_search" in r.json()["error"]["message"]
