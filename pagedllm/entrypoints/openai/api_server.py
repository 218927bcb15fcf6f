"""The HTTP server: routes, OpenAI-style errors, API key, metrics, graceful shutdown."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import logging
import operator
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.envs import env_flag
from pagedllm.version import __version__
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.threads import single_thread
from pagedllm.engine.errors import EngineDeadError, EngineOverloadedError
from pagedllm.engine.input_processor import encode_within
from pagedllm.entrypoints.openai.dashboard import DASHBOARD_PATHS, add_dashboard_routes
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.entrypoints.arg_types import non_negative_float, non_negative_float_or_inf, positive_int, tcp_port
from pagedllm.entrypoints.openai.tools import check_tools
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    param_of,
)
from pagedllm.entrypoints.openai.serving import OpenAIServing, RequestFailedError

logger = logging.getLogger("pagedllm.server")

# Routes anyone may call even when an API key is set: they do no work and reveal nothing.
_OPEN_PATHS = {"/health", "/version"} | DASHBOARD_PATHS
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20
ENGINE_DEATH_EXIT_DELAY = 2.0  # seconds of 503s between the engine's death and the exit


@dataclass
class ServerConfig:
    """The HTTP layer's settings (the engine's are EngineConfig)."""

    served_model_name: str
    model_root: str
    model_aliases: tuple[str, ...] = ()  # more names requests may give the base model (--served-model-name A B ...)
    api_key: str | None = None
    guard_metrics: bool = False  # with an API key, /metrics needs it too
    trust_request_chat_template: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # a name in tool_parsers.TOOL_PARSERS
    # LoRA adapters served from the start, (name, path) (--lora-modules), and whether
    # /v1/load_lora_adapter and /v1/unload_lora_adapter exist (PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING).
    lora_modules: tuple[tuple[str, str], ...] = ()
    allow_runtime_lora_updating: bool = False


RUNTIME_LORA_ENV = "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING"


def parse_lora_modules(values: list[str]) -> list[tuple[str, str]]:
    """--lora-modules entries: ``name=path``, or vLLM's JSON ``{"name": ..., "path": ...}``."""
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                obj = json.loads(value)
                name, path = obj["name"], obj["path"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--lora-modules: {value!r} is not {{\"name\": ..., \"path\": ...}}") from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {value!r} is not name=path")
        modules.append((str(name), str(path)))
    names = [n for n, _ in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: a name is given twice in {', '.join(names)}")
    return modules


def error_response(
    status: int, message: str, type_: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _send_error(send: Any, status: int, message: str, type_: str) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """API key and request-size checks before any route runs (plain ASGI: streaming and
    disconnect detection pass through untouched).

    The key is compared in constant time on digests; the scheme 'Bearer' in any case. The
    body is read up to the limit before the app sees it (413 past it), whether or not the
    client sent a Content-Length.
    """

    def __init__(self, app: Any, config: ServerConfig):
        self.app = app
        self.config = config
        self._key_digest = hashlib.sha256(config.api_key.encode()).digest() if config.api_key else None

    def _authorized(self, scope: dict) -> bool:
        path = scope["path"]
        if self._key_digest is None or path in _OPEN_PATHS or (path == "/metrics" and not self.config.guard_metrics):
            return True
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.strip().partition(" ")
        given = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        return hmac.compare_digest(given, self._key_digest) and scheme.lower() == "bearer"

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self._authorized(scope):
            return await _send_error(send, 401, "missing or wrong API key", "AuthenticationError")
        limit = self.config.max_request_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        too_big = f"request body exceeds the limit of {limit} bytes (--max-request-body-bytes)"
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await _send_error(send, 413, too_big, "RequestTooLargeError")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await _send_error(send, 413, too_big, "RequestTooLargeError")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then: disconnects

        await self.app(scope, replay, send)


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; if the client disconnects first, cancel it (its requests are aborted and
    their KV blocks freed at once) instead of computing an answer nobody reads."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.2)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return Response(status_code=499)  # nobody is listening; the status is for the log


# /tokenize counts texts of up to this many times max_model_len tokens.
TOKENIZE_LIMIT = 4


def build_app(llm: AsyncLLM, config: ServerConfig) -> FastAPI:
    served_model_name, model_root = config.served_model_name, config.model_root
    base_names = {served_model_name, model_root, *config.model_aliases}  # what a request's model may say
    app = FastAPI(title="pagedllm", version=__version__)
    serving = OpenAIServing(llm, served_model_name, config.trust_request_chat_template,
                            tool_call_parser=config.tool_call_parser if config.enable_auto_tool_choice else None)  # fmt: skip
    metrics = ServerMetrics(llm, served_model_name)
    app.state.llm = llm
    app.state.metrics = metrics
    app.add_middleware(GuardMiddleware, config=config)
    add_dashboard_routes(app, llm)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"request body is not valid JSON: {first.get('msg')}", "BadRequestError")
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        msg = str(first.get("msg", "invalid value"))
        if not loc:  # the whole body: not an object, or a check across fields (ours name their field)
            if first.get("type") in ("dict_type", "model_type", "model_attributes_type"):
                return error_response(400, "the request body must be a JSON object", "BadRequestError")
            msg = msg.removeprefix("Value error, ")
            return error_response(400, msg, "BadRequestError", param_of(msg))
        named = [x for x in loc if x not in ("query", "path", "header")]  # "query.engine": param "engine"
        return error_response(400, f"{'.'.join(loc)}: {msg}", "BadRequestError", (named or loc)[0])

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "BadRequestError")
        return error_response(exc.status_code, str(exc.detail), type_)

    @app.exception_handler(ValueError)
    async def _bad_value(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc), "BadRequestError", param_of(str(exc)))

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(_: Request, exc: EngineOverloadedError) -> JSONResponse:
        metrics.rejected.labels(reason="overloaded", **metrics.labels).inc()
        return error_response(503, str(exc), "ServiceUnavailableError", headers={"Retry-After": "1"})

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        metrics.rejected.labels(reason="engine_dead", **metrics.labels).inc()
        return error_response(503, "the engine is unavailable; retry later", "ServiceUnavailableError")

    @app.exception_handler(RequestFailedError)
    async def _failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        return error_response(500, f"internal error (request id {exc.request_id})", "InternalServerError")

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        error_id = f"err-{uuid.uuid4().hex[:16]}"
        logger.error("internal error %s: %s: %s", error_id, type(exc).__name__, exc, exc_info=exc)
        return error_response(500, f"internal error (error id {error_id})", "InternalServerError")

    def check_model(name: str | None) -> JSONResponse | None:
        if name is not None and name not in base_names and name not in serving.loras:
            return error_response(404, f"The model `{name}` does not exist.", "NotFoundError", "model")
        return None

    for name, path in config.lora_modules:  # loaded (and checked) before the server answers anyone
        if name in base_names:
            raise ValueError(f"--lora-modules: {name!r} is the base model's name")
        lora = serving.new_lora_request(name, path)
        llm.engine.add_lora(lora)
        serving.loras[name] = lora

    def respond(result: Any) -> Response:
        if isinstance(result, Response):
            return result
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not llm.healthy():
            return error_response(503, "the engine is dead", "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    def model_cards() -> list[dict]:
        created = int(time.time())
        base = {"object": "model", "created": created, "owned_by": "pagedllm", "max_model_len": serving.max_model_len}
        data = [{"id": name, **base, "root": model_root, "parent": None} for name in (served_model_name, *config.model_aliases)]
        data += [{"id": name, **base, "root": lora.lora_path, "parent": served_model_name} for name, lora in serving.loras.items()]
        return data

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": model_cards()}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        """OpenAI's retrieve-model: one card (ids may hold slashes, like a path)."""
        card = next((c for c in model_cards() if c["id"] == model_id), None)
        if card is None:
            return error_response(404, f"The model `{model_id}` does not exist.", "NotFoundError", "model")
        return JSONResponse(card)

    if config.allow_runtime_lora_updating:
        loading: set[str] = set()  # names whose load is in flight

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
            if not llm.engine.config.enable_lora:
                raise ValueError("LoRA is not enabled; start the server with --enable-lora")
            name = req.lora_name
            if name in serving.loras or name in base_names:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            if name in loading:  # two loads of one name at once: the first one's
                raise ValueError(f"The lora adapter '{name}' is being loaded.")
            lora = serving.new_lora_request(name, req.lora_path)
            loading.add(name)
            try:
                # In every replica; ValueError -> 400, nothing changed. (A method call, not a
                # lambda: it may have to be pickled to replica processes.)
                await llm.call_in_all_engines(operator.methodcaller("add_lora", lora))
            finally:
                loading.discard(name)
            serving.loras[name] = lora
            logger.info("LoRA adapter %r loaded from %s", name, req.lora_path)
            return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
            lora = serving.loras.pop(req.lora_name, None)
            if lora is None:
                return error_response(404, f"The lora adapter '{req.lora_name}' cannot be found.", "NotFoundError", "lora_name")
            # Requests already running with it finish with it; new ones can no longer name it.
            await llm.call_in_all_engines(operator.methodcaller("remove_lora", lora.lora_int_id))
            logger.info("LoRA adapter %r unloaded", req.lora_name)
            return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")

    # A request's adapter is looked up as it arrives, with its model checked: an unload while the
    # request is rendered must not leave it to run on the base model under the adapter's name.
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return check_model(req.model) or respond(await _unless_disconnected(request, serving.completion(req, request.headers.get("x-request-id"), serving.loras.get(req.model or ""))))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return check_model(req.model) or respond(await _unless_disconnected(request, serving.chat(req, request.headers.get("x-request-id"), serving.loras.get(req.model or ""))))

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Response:
        if (bad := check_model(req.model)) is not None:
            return bad
        tok = llm.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer")
        # Counts past max_model_len too (as vLLM: a client counts to decide what to cut), up to
        # TOKENIZE_LIMIT x max_model_len, refused from the text's head beyond that: the tokenizer
        # workers are shared with every completion and chat request (15 MB texts held them ~50 s).
        limit = TOKENIZE_LIMIT * serving.max_model_len
        limit_name = f"{TOKENIZE_LIMIT} x max_model_len"
        if req.messages is not None:
            what = "messages"
            tools = check_tools(req.tools) if req.tools is not None else None
            ids = await serving.render_chat(req.messages, add_generation_prompt=req.add_generation_prompt,
                                            continue_final_message=req.continue_final_message, tools=tools,
                                            chat_template=req.chat_template, chat_template_kwargs=req.chat_template_kwargs,
                                            max_model_len=limit, add_special_tokens=bool(req.add_special_tokens),
                                            limit_name=limit_name)  # fmt: skip
        elif req.prompt is not None:
            what = "prompt"
            add = req.add_special_tokens is not False
            ids = await llm.run_in_worker(encode_within, tok, req.prompt, limit, what, limit_name, add_special_tokens=add)
        else:
            raise ValueError("prompt or messages is required")
        if len(ids) > limit:  # (the head check above refuses only texts far over the limit)
            raise ValueError(f"{what} is longer than {limit_name} ({limit} tokens): {len(ids)} tokens")
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
        return JSONResponse({"prompt": await llm.run_in_worker(llm.tokenizer.decode, req.tokens)})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    g.add_argument("--port", type=tcp_port, default=8000, help="port to listen on (default: %(default)s)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME", help="model name in the API; as vLLM, several names are all accepted in a request's model field, and an answer names the one asked for (the first when a request names none) (default: SmolLM2-135M-Instruct for the embedded model, else --model as given)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health, /version and /metrics (or set PAGEDLLM_API_KEY)")
    g.add_argument("--guard-metrics", action="store_true", help="with an API key, /metrics needs it too")
    g.add_argument("--max-waiting-requests", type=int, default=None, help="refuse new requests with 503 + Retry-After while this many wait to be scheduled (default: max(1024, 8 x --max-num-seqs); 0 = no limit)")
    g.add_argument("--max-request-body-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES, help="larger request bodies get 413 (default: %(default)s = 16 MiB)")
    g.add_argument("--trust-request-chat-template", action="store_true", help="let requests bring their own chat_template (it is code run by the server; off by default)")
    g.add_argument("--graceful-shutdown-timeout", type=non_negative_float, default=10.0, help="seconds in-flight requests may finish after SIGTERM/SIGINT before they are aborted; a second signal exits at once (default: %(default)s)")
    g.add_argument("--enable-auto-tool-choice", action="store_true", help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None, help="how to find tool calls in the model's text for tool_choice auto")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH", help="LoRA adapters (PEFT directories) served under these names, selected by a request's model field; also vLLM's JSON form '{\"name\": ..., \"path\": ...}'; needs --enable-lora. With PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=1, POST /v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time")
    g.add_argument("--headless", action="store_true", help="multi-node: run only this node's workers (ranks node_rank x world/nnodes onwards), which connect to the engine on --master-addr; no HTTP server (docs/parallelism.md)")
    g.add_argument("--log-stats-interval", type=non_negative_float_or_inf, default=5.0, help="seconds between stats log lines (default: %(default)s)")


def default_max_waiting_requests(max_num_seqs: int) -> int:
    """A waiting request costs only its prompt in memory, and every refusal is a failed
    request, so the default cap is generous: it is there to bound queueing delay and memory
    under a flood, not to shed ordinary bursts."""
    return max(1024, 8 * max_num_seqs)


def make_async_llm(engine_config: Any, **kwargs: Any) -> AsyncLLM:
    """The engine in this process (AsyncLLM), or ``data_parallel_size`` replica processes behind
    a load balancer (DPAsyncLLM, the same interface)."""
    if engine_config.data_parallel_size > 1:
        from pagedllm.data_parallel.client import DPAsyncLLM

        return DPAsyncLLM(engine_config, **kwargs)  # type: ignore[return-value]
    return AsyncLLM(engine_config, **kwargs)


def check_listen(host: str, port: int) -> None:
    """ValueError naming --host/--port when the server could not listen there: checked before the
    model loads, not after (uvicorn binds only when it starts)."""
    import socket

    from pagedllm.executor.multiproc import bind_error

    error = bind_error(host, port)
    if isinstance(error, socket.gaierror):
        raise ValueError(f"--host {host!r}: {error.strerror}")
    if error is not None:
        raise ValueError(f"cannot listen on {host}:{port} (--host, --port): {error.strerror}")


def run_server(args: argparse.Namespace, engine_config: Any) -> int:
    """Serve until SIGTERM/SIGINT (exit 0) or until the engine dies (exit 1)."""
    import uvicorn

    from pagedllm.model.loader import DEFAULT_MODEL_NAME

    max_waiting = args.max_waiting_requests
    if max_waiting is None:
        max_waiting = default_max_waiting_requests(engine_config.max_num_seqs)
    if max_waiting < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {max_waiting}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    lora_modules = parse_lora_modules(args.lora_modules)
    if lora_modules and not engine_config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if args.api_key == "":  # (an unset $KEY in --api-key "$KEY": serving without a key was not asked for)
        raise ValueError("--api-key is empty; leave it out to serve without a key")
    check_listen(args.host, args.port)
    llm = make_async_llm(engine_config, log_stats_interval=args.log_stats_interval, max_waiting_requests=max_waiting or None)
    single_thread()  # the event loop's thread: torch ops without an OpenMP team (pagedllm/threads.py)
    config = ServerConfig(
        served_model_name=args.served_model_name[0] if args.served_model_name else (args.model or DEFAULT_MODEL_NAME),
        model_aliases=tuple(dict.fromkeys(n for n in args.served_model_name[1:] if n != args.served_model_name[0]))
        if args.served_model_name else (),
        model_root=str(llm.engine.source.path),
        api_key=args.api_key or os.environ.get("PAGEDLLM_API_KEY") or None,
        guard_metrics=args.guard_metrics,
        trust_request_chat_template=args.trust_request_chat_template,
        max_request_body_bytes=args.max_request_body_bytes,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        lora_modules=tuple(lora_modules),
        allow_runtime_lora_updating=env_flag(RUNTIME_LORA_ENV, False),
    )
    try:
        app = build_app(llm, config)
    except BaseException:
        llm.shutdown()
        raise
    grace = args.graceful_shutdown_timeout
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=grace + 5)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Stop accepting now; let in-flight requests finish for `grace` seconds, then end
            # the rest with an 'abort' finish so every stream closes cleanly. A second signal
            # (SIGTERM or SIGINT) stops waiting.
            # Not calling super(): uvicorn would re-raise the signal after shutdown, and the
            # process would die by SIGTERM instead of exiting 0.
            if self.should_exit:
                logger.warning("second signal: exiting now")
                self.force_exit = True
                llm.abort_all()
                return
            logger.info("shutting down: %d request(s) in flight get %.0f s to finish", llm.num_in_flight(), grace)
            timer = threading.Timer(grace, llm.abort_all)
            timer.daemon = True
            timer.start()
            self.should_exit = True

    server = Server(uv_config)

    def on_engine_death(error: BaseException) -> None:
        # Every pending request already got its 503. Keep answering 503 (and /health 503) for
        # a moment so load balancers see it, then stop so a supervisor restarts us.
        logger.critical("engine dead (%s): the server exits non-zero in %.0f s", error, ENGINE_DEATH_EXIT_DELAY)
        timer = threading.Timer(ENGINE_DEATH_EXIT_DELAY, lambda: setattr(server, "should_exit", True))
        timer.daemon = True
        timer.start()

    llm.on_dead.append(on_engine_death)
    logger.info("serving %s on http://%s:%d (OpenAI-compatible API under /v1; max %s waiting requests)",
                config.served_model_name, args.host, args.port, max_waiting or "unlimited")
    server.run()
    llm.shutdown()
    return 1 if llm.dead is not None else 0
