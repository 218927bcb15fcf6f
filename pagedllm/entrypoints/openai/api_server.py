"""The HTTP server: routes, OpenAI-style errors, API key, metrics, graceful shutdown."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

import pagedllm
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.chat import render_chat
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.serving import OpenAIServing

logger = logging.getLogger("pagedllm.server")

_FIELDS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) | {
    "stop_token_ids", "allowed_token_ids", "logit_bias", "max_tokens", "n", "temperature", "top_p", "top_k",
}  # fmt: skip


def error_response(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}}, status_code=status)


def _param_of(message: str) -> str | None:
    """Our ValueErrors start with the offending field's name."""
    word = message.split(" ", 1)[0].strip("'\":,")
    return word if word in _FIELDS else None


def build_app(llm: AsyncLLM, served_model_name: str, model_root: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="pagedllm", version=pagedllm.__version__)
    serving = OpenAIServing(llm, served_model_name)
    metrics = ServerMetrics(llm, served_model_name)
    app.state.llm = llm
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"request body is not valid JSON: {first.get('msg')}", "BadRequestError")
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        return error_response(400, f"{where}: {first.get('msg', 'invalid value')}", "BadRequestError", param)

    @app.exception_handler(ValueError)
    async def _bad_value(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc), "BadRequestError", _param_of(str(exc)))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        return error_response(500, f"internal error: {exc}", "InternalServerError")

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Response:
        if api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return error_response(401, "missing or wrong API key", "AuthenticationError")
        return await call_next(request)

    def check_model(name: str | None) -> JSONResponse | None:
        if name is not None and name not in (served_model_name, model_root):
            return error_response(404, f"The model `{name}` does not exist.", "NotFoundError", "model")
        return None

    def respond(result: Any) -> Response:
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagedllm.__version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": served_model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "pagedllm",
                    "root": model_root,
                    "max_model_len": serving.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Response:
        return check_model(req.model) or respond(await serving.completion(req))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest) -> Response:
        return check_model(req.model) or respond(await serving.chat(req))

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Response:
        if (bad := check_model(req.model)) is not None:
            return bad
        tok = llm.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer")
        if req.messages is not None:
            ids = render_chat(tok, req.messages, add_generation_prompt=req.add_generation_prompt)
        elif req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise ValueError("prompt or messages is required")
        body: dict[str, Any] = {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = tok.convert_ids_to_tokens(ids)
        return JSONResponse(body)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Response:
        if (bad := check_model(req.model)) is not None:
            return bad
        vocab = llm.engine.arch.vocab_size
        bad_ids = [t for t in req.tokens if not 0 <= t < vocab]
        if bad_ids:
            raise ValueError(f"tokens contains {bad_ids[0]}, outside the vocabulary [0, {vocab})")
        if llm.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        return JSONResponse({"prompt": llm.tokenizer.decode(req.tokens)})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    g.add_argument("--served-model-name", default=None, help="model name in the API (default: SmolLM2-135M-Instruct for the embedded model, else --model as given)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes (or set PAGEDLLM_API_KEY)")
    g.add_argument("--graceful-shutdown-timeout", type=float, default=10.0, help="seconds in-flight requests may finish after SIGTERM/SIGINT before they are aborted (default: %(default)s)")
    g.add_argument("--log-stats-interval", type=float, default=5.0, help="seconds between stats log lines (default: %(default)s)")


def run_server(args: argparse.Namespace, engine_config: Any) -> int:
    import uvicorn

    from pagedllm.model.loader import DEFAULT_MODEL_NAME

    llm = AsyncLLM(engine_config, log_stats_interval=args.log_stats_interval)
    served = args.served_model_name or (args.model if args.model else DEFAULT_MODEL_NAME)
    api_key = args.api_key or os.environ.get("PAGEDLLM_API_KEY") or None
    app = build_app(llm, served, str(llm.engine.source.path), api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=None)
    grace = args.graceful_shutdown_timeout

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Stop accepting now; let in-flight requests finish for `grace` seconds, then end
            # the rest with an 'abort' finish so every stream closes cleanly.
            # Not calling super(): uvicorn would re-raise the signal after shutdown, and the
            # process would die by SIGTERM instead of exiting 0.
            if self.should_exit:
                self.force_exit = sig == signal.SIGINT  # a second Ctrl-C: stop waiting
                return
            logger.info("shutting down: %d request(s) in flight get %.0f s to finish", len(llm.engine.scheduler.requests), grace)
            timer = threading.Timer(grace, llm.abort_all)
            timer.daemon = True
            timer.start()
            self.should_exit = True

    logger.info("serving %s on http://%s:%d (OpenAI-compatible API under /v1)", served, args.host, args.port)
    Server(config).run()
    llm.shutdown()
    return 0
