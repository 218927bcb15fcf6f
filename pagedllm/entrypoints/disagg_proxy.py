"""``pagedllm disagg-proxy``: disaggregated prefill/decode in front of two servers.

Each completion request goes first to the prefill instance (a ``kv_producer``) with
``max_tokens=1``: it computes the prompt's KV and answers once the blocks are in the shared
store. Then the unchanged request goes to the decode instance (a ``kv_consumer`` on the same
store), which loads the prompt's blocks instead of computing them, and its answer (streamed
or not) is passed back as it comes - the pattern of vLLM's disaggregated-serving examples.

The prefill leg is an optimisation, never a dependency: if the prefill instance is down,
slow or answers with an error, the request goes to the decode instance anyway, which then
computes the prompt itself. No request is lost to the producer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.entrypoints.arg_types import positive_float, tcp_port

logger = logging.getLogger("pagedllm.disagg_proxy")

# Hop-by-hop and length headers are the proxy's own business, not the upstream's (and its own
# server writes date and server).
_DROP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding", "date", "server"}
# Request headers the instances read: the API key and the client's request id.
_FORWARD_HEADERS = ("authorization", "x-request-id")
DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there


@dataclass
class ProxyConfig:
    prefill_url: str
    decode_url: str
    prefill_timeout: float = 600.0  # seconds for the whole prefill leg (a long prompt on a busy instance)
    decode_timeout: float | None = None  # None: as long as the decode takes


@dataclass
class ProxyStats:
    requests: int = 0
    prefill_ok: int = 0
    prefill_failed: int = 0  # the decode instance computed those prompts itself


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill instance gets it: one token, no stream, one sample."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "best_of")}
    out.update(max_tokens=1, stream=False, n=1)
    for key in ("max_completion_tokens", "min_tokens"):  # (min_tokens > max_tokens would be refused)
        if key in out:
            out[key] = 1 if key == "max_completion_tokens" else 0
    return out


def _error(status: int, message: str, type_: str, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _decode_unreachable(e: Exception) -> JSONResponse:
    return _error(503, f"the decode instance is unreachable: {type(e).__name__}", "ServiceUnavailableError")


async def unless_disconnected(request: Request, work: Any) -> tuple[bool, Any]:
    """(True, result) of awaiting ``work``, or (False, None) once the client has gone first:
    ``work`` is then cancelled, which closes its upstream connection, so the instance aborts the
    request and frees its blocks instead of computing it for nobody. (Starlette notices a
    disconnect by itself only while a response streams.)"""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return True, task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await task
            return False, None


def build_proxy_app(config: ProxyConfig) -> FastAPI:
    # No cap on connections (httpx's default of 100 made the 101st request wait for a slot):
    # the instances bound the work with their own queues.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    client = httpx.AsyncClient(timeout=httpx.Timeout(config.decode_timeout, connect=10.0), limits=limits)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="pagedllm disagg-proxy", lifespan=lifespan)
    stats = ProxyStats()
    app.state.stats = stats
    prefill_url, decode_url = config.prefill_url.rstrip("/"), config.decode_url.rstrip("/")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:  # 404, 405: OpenAI-style bodies
        type_ = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        return _error(exc.status_code, str(exc.detail), type_, exc.headers)  # (a 405's Allow)

    def forward_headers(request: Request) -> dict[str, str]:
        return {k: request.headers[k] for k in _FORWARD_HEADERS if k in request.headers}

    async def prefill(path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        try:
            r = await client.post(prefill_url + path, json=prefill_body(body), headers=headers, timeout=config.prefill_timeout)
        except ValueError as e:  # not encodable as JSON (NaN, 1e400): the decode instance says why
            stats.prefill_failed += 1
            logger.warning("request not sent to the prefill instance: %s", e)
            return
        except httpx.HTTPError as e:
            stats.prefill_failed += 1
            logger.warning("prefill instance unreachable (%s: %s); the decode instance computes the prompt", type(e).__name__, e)
            return
        if r.status_code != 200:
            stats.prefill_failed += 1
            logger.warning("prefill instance answered %d; the decode instance computes the prompt", r.status_code)
            return
        stats.prefill_ok += 1

    async def relay(path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except (ValueError, RecursionError) as e:  # (RecursionError: nesting deeper than the parser goes)
            return _error(400, f"request body is not valid JSON: {type(e).__name__}", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "BadRequestError")
        stats.requests += 1
        headers = forward_headers(request)
        if not (await unless_disconnected(request, prefill(path, body, headers)))[0]:
            return Response(status_code=499)  # the client has gone: nothing to send the decode instance
        # The client's own bytes, as it sent them: the decode instance validates them as a
        # single server would (re-encoding would fail on the NaN or 1e400 it refuses with a 400).
        raw = await request.body()
        send = client.send(client.build_request("POST", decode_url + path, content=raw,
                                                headers={**headers, "content-type": "application/json"}), stream=True)  # fmt: skip
        try:
            arrived, upstream = await unless_disconnected(request, send)
        except httpx.HTTPError as e:
            logger.error("decode instance unreachable: %s: %s", type(e).__name__, e)
            return _decode_unreachable(e)
        if not arrived:
            return Response(status_code=499)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        kept = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_HEADERS}
        return StreamingResponse(chunks(), status_code=upstream.status_code, headers=kept)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await relay("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await relay("/v1/chat/completions", request)

    async def passthrough(request: Request) -> Response:
        """Requests without a prefill leg (models, tokenizer) go to the decode instance as sent."""
        headers = forward_headers(request)
        if "content-type" in request.headers:
            headers["content-type"] = request.headers["content-type"]
        try:
            r = await client.request(request.method, decode_url + request.url.path, params=request.query_params,
                                     content=await request.body(), headers=headers, timeout=30.0)  # fmt: skip
        except httpx.HTTPError as e:
            return _decode_unreachable(e)
        kept = {k: v for k, v in r.headers.items() if k.lower() not in _DROP_HEADERS}  # (x-request-id, ...)
        return Response(r.content, status_code=r.status_code, headers=kept)

    app.add_api_route("/v1/models", passthrough, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", passthrough, methods=["GET"])
    app.add_api_route("/tokenize", passthrough, methods=["POST"])
    app.add_api_route("/detokenize", passthrough, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        try:
            r = await client.get(decode_url + "/health", timeout=5.0)
        except httpx.HTTPError:
            return Response(status_code=503)
        return Response(status_code=r.status_code)

    @app.get("/proxy_stats")
    async def proxy_stats() -> dict:
        return {"requests": stats.requests, "prefill_ok": stats.prefill_ok, "prefill_failed": stats.prefill_failed}

    return app


def add_proxy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", required=True, help="URL of the prefill instance (pagedllm serve with kv_role kv_producer)")
    parser.add_argument("--decode", required=True, help="URL of the decode instance (kv_role kv_consumer, the same store)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=tcp_port, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument("--prefill-timeout", type=positive_float, default=600.0, help="seconds the prefill leg may take before the decode instance computes the prompt itself (default: %(default)s)")


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedllm.logger import configure_logging

    configure_logging()
    for name, url in (("--prefill", args.prefill), ("--decode", args.decode)):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{name} must be an http(s) URL, got {url!r}")
    app = build_proxy_app(ProxyConfig(args.prefill, args.decode, args.prefill_timeout))
    logger.info("disagg-proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port, args.prefill, args.decode)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
