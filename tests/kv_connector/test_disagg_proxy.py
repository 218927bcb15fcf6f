"""``pagedllm disagg-proxy`` against stand-in instances (no model): a client that leaves is
never served for nothing, bad input gets the decode instance's answer or an OpenAI-style error,
and the client's request id reaches the instances. Found by an adversarial review."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.disagg_proxy import ProxyConfig, build_proxy_app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """An ASGI app on a uvicorn thread of this process."""

    def __init__(self, app: FastAPI):
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1]), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server.started

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class Instance:
    """A stand-in server: answers after ``delay`` s unless its client leaves first; records both."""

    def __init__(self, delay: float = 0.0, status: int = 200):
        self.delay, self.status, self.seen, self.left = delay, status, [], []
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.body()
            self.seen.append((dict(request.headers), body))
            if b'"stream":true' in body.replace(b" ", b""):  # a chunk every 20 ms for `delay` s; one that leaves is noted
                async def chunks():
                    try:
                        deadline = time.monotonic() + self.delay
                        while time.monotonic() < deadline:
                            yield b'data: {"choices": [{"text": "x"}]}\n\n'
                            await asyncio.sleep(0.02)
                        yield b"data: [DONE]\n\n"
                    except BaseException:
                        self.left.append(body)
                        raise

                return StreamingResponse(chunks(), media_type="text/event-stream")
            deadline = time.monotonic() + self.delay
            while time.monotonic() < deadline:
                if await request.is_disconnected():
                    self.left.append(body)
                    return Response(status_code=499)
                await asyncio.sleep(0.02)
            if self.status != 200:
                return JSONResponse({"error": {"message": "refused", "code": self.status}}, status_code=self.status)
            return JSONResponse({"choices": [{"text": "ok"}]})

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Response:
            return JSONResponse({"tokens": [len(await request.body())]}, headers={"x-request-id": "from-instance"})

        @app.get("/v1/models/{model_id}")
        async def model(model_id: str) -> Response:
            return JSONResponse({"id": model_id, "object": "model"})

        self.served = Served(app)
        self.url = self.served.url


@pytest.fixture
def setup():
    made: list = []

    def make(prefill_delay: float = 0.0, decode_delay: float = 0.0, decode_down: bool = False, prefill_status: int = 200,
             prefill_timeout: float = 30):  # fmt: skip
        prefill, decode = Instance(prefill_delay, prefill_status), Instance(decode_delay)
        decode_url = f"http://127.0.0.1:{_free_port()}" if decode_down else decode.url
        proxy = Served(build_proxy_app(ProxyConfig(prefill.url, decode_url, prefill_timeout=prefill_timeout)))
        made.extend([prefill.served, decode.served, proxy])
        return prefill, decode, proxy.url

    yield make
    for s in made:
        s.stop()


def _wait(cond, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def test_a_client_that_leaves_a_non_streamed_request_aborts_it_on_the_decode_instance(setup):
    prefill, decode, url = setup(decode_delay=30)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 500}, timeout=1.0)
    assert _wait(lambda: decode.left), "the decode instance kept computing for a client that had gone"


def test_a_client_that_leaves_a_stream_closes_it_on_the_decode_instance(setup):
    prefill, decode, url = setup(decode_delay=30)
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "x", "stream": True}, timeout=10) as r:
        assert r.status_code == 200
        next(r.iter_raw())  # the first chunk came through; then the client goes
    assert _wait(lambda: decode.left), "the decode instance kept streaming to a client that had gone"


def test_a_client_that_leaves_during_the_prefill_is_never_sent_to_the_decode_instance(setup):
    prefill, decode, url = setup(prefill_delay=30)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 500}, timeout=1.0)
    assert _wait(lambda: prefill.left)
    time.sleep(0.5)
    assert decode.seen == []


def test_bad_bodies_get_the_decode_instances_answer_or_a_400_never_a_500(setup):
    prefill, decode, url = setup()
    nan = b'{"prompt": "x", "temperature": NaN, "max_tokens": 1e400}'
    r = httpx.post(f"{url}/v1/completions", content=nan, headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 200 and decode.seen[-1][1] == nan  # the client's bytes, for the instance to judge
    assert prefill.seen == [] and httpx.get(f"{url}/proxy_stats", timeout=10).json()["prefill_failed"] == 1  # (not sendable)
    deep = httpx.post(f"{url}/v1/completions", content=b"[" * 100_000, timeout=10)
    assert deep.status_code == 400 and deep.json()["error"]["code"] == 400
    for method, path, status in (("GET", "/nowhere", 404), ("GET", "/v1/completions", 405)):
        r = httpx.request(method, f"{url}{path}", timeout=10)
        assert r.status_code == status and r.json()["error"]["code"] == status, r.text
    assert r.headers["allow"] == "POST"  # the 405 says what is allowed, as the instance's own does


def test_the_request_id_reaches_the_instances_and_a_down_decode_is_a_503(setup):
    prefill, decode, url = setup()
    headers = {"X-Request-Id": "trace-42", "Authorization": "Bearer k"}
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, headers=headers, timeout=10)
    assert r.status_code == 200 and r.headers.get_list("date").__len__() == 1
    assert [h.get("x-request-id") for h, _ in prefill.seen + decode.seen] == ["trace-42", "trace-42"]
    assert [h.get("authorization") for h, _ in prefill.seen + decode.seen] == ["Bearer k", "Bearer k"]  # API keys
    _, _, down = setup(decode_down=True)
    r = httpx.get(f"{down}/v1/models", timeout=20)
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    assert httpx.get(f"{down}/health", timeout=20).status_code == 503  # a load balancer must skip it


@pytest.mark.parametrize("trouble", ["refuses", "hangs"])
def test_a_prefill_instance_that_refuses_or_hangs_counts_as_failed_and_decode_answers(setup, trouble):
    """A 4xx from the prefill instance is a failed prefill (the stats must say so), and one that
    takes longer than --prefill-timeout is given up: the decode instance computes the prompt."""
    prefill, decode, url = (setup(prefill_status=400) if trouble == "refuses" else setup(prefill_delay=30, prefill_timeout=0.5))
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok" and len(decode.seen) == 1
    stats = httpx.get(f"{url}/proxy_stats", timeout=10).json()
    assert (stats["prefill_ok"], stats["prefill_failed"]) == (0, 1), stats


def test_model_and_tokenizer_routes_reach_the_decode_instance(setup):
    _, decode, url = setup()
    body = b'{"prompt": "abc"}'  # passed on byte for byte (the fake answers with its length)
    r = httpx.post(f"{url}/tokenize", content=body, timeout=10)
    assert r.json() == {"tokens": [len(body)]} and r.headers["x-request-id"] == "from-instance"  # its headers too
    assert httpx.get(f"{url}/v1/models/m", timeout=10).json()["id"] == "m"
    assert httpx.post(f"{url}/detokenize", json={"tokens": [1]}, timeout=10).status_code == 404  # the instance's answer


def test_the_command_line_flags_reach_the_proxy(monkeypatch):
    """`pagedllm disagg-proxy ... --prefill-timeout 5` configures the proxy it runs."""
    import uvicorn

    from pagedllm.entrypoints import cli, disagg_proxy

    built, ran = [], []
    monkeypatch.setattr(disagg_proxy, "build_proxy_app", lambda config: built.append(config) or "app")
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: ran.append((app, kw)))
    assert cli.main(["disagg-proxy", "--prefill", "http://p:1", "--decode", "http://d:2", "--prefill-timeout", "5",
                     "--port", "8123"]) == 0  # fmt: skip
    assert built == [ProxyConfig("http://p:1", "http://d:2", prefill_timeout=5.0)]
    assert ran == [("app", {"host": "127.0.0.1", "port": 8123, "log_level": "warning"})]


def test_the_prefill_leg_asks_for_one_token_of_one_sample():
    from pagedllm.entrypoints.disagg_proxy import prefill_body

    body = {"prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}, "n": 3,
            "best_of": 4, "min_tokens": 5, "max_completion_tokens": 40, "temperature": 0.5}  # fmt: skip
    assert prefill_body(body) == {"prompt": "x", "max_tokens": 1, "stream": False, "n": 1, "temperature": 0.5,
                                  "min_tokens": 0, "max_completion_tokens": 1}  # fmt: skip
