"""Completions and chat completions: turn requests into engine calls and outputs into OpenAI JSON."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.chat import render_chat
from pagedllm.engine.errors import EngineDeadError
from pagedllm.engine.input_processor import encode_prompt
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, param_of
from pagedllm.entrypoints.openai.tool_parsers import StreamingToolCalls, ToolCall, get_tool_parser
from pagedllm.entrypoints.openai.tools import ToolChoice, resolve_tool_choice
from pagedllm.lora.request import LoRARequest
from pagedllm.model.generation_config import read_generation_config
from pagedllm.outputs import PositionLogprobs, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler.policy import check_priority

logger = logging.getLogger("pagedllm.server")

# Most prompts one completions request may carry (each is one engine request).
MAX_PROMPTS_PER_REQUEST = 1024
# Keys a request's chat_template_kwargs may not set: render_chat passes them itself.
_RESERVED_TEMPLATE_KWARGS = {"messages", "conversation", "chat_template", "tokenize", "add_generation_prompt",
                             "continue_final_message", "return_dict", "tools", "documents"}  # fmt: skip


@dataclass
class _Choice:
    """What one choice accumulated from delta outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


MAX_REQUEST_ID_CHARS = 256


def response_and_engine_ids(prefix: str, client_id: str | None) -> tuple[str, str]:
    """The response's ``id`` and the engine's base request id. A client's id (X-Request-Id, else
    the body's request_id, as vLLM) names the response; the engine's id gets a random suffix,
    so two requests with the same client id never collide in the engine."""
    if client_id is None:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        return rid, rid
    if not client_id or len(client_id) > MAX_REQUEST_ID_CHARS or not client_id.isprintable():
        raise ValueError(f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} printable characters (the body's field or X-Request-Id)")
    rid = f"{prefix}-{client_id}"
    return rid, f"{rid}-{uuid.uuid4().hex[:8]}"


def _request_ids(base_id: str, n_prompts: int) -> list[str]:
    return [base_id if n_prompts == 1 else f"{base_id}-{i}" for i in range(n_prompts)]


class RequestFailedError(RuntimeError):
    """The engine failed this request (and only it); the cause is in the server log."""

    def __init__(self, request_id: str):
        super().__init__(f"request {request_id} failed inside the engine")
        self.request_id = request_id


class RequestRejectedError(ValueError):
    """The engine found the request invalid after accepting it (e.g. a constraint that admits
    no output, known only once compiled): a 400 like any ValueError, naming the field."""


def _named(message: str, constraint_field: str | None) -> str:
    """An error about the output constraint, naming the request field it came from (the engine
    knows it as structured_outputs, vLLM's name)."""
    if constraint_field not in (None, "structured_outputs") and message.startswith("structured_outputs."):
        return f"{constraint_field}: {message}"
    return message


async def _checked(request_id: str, stream: AsyncIterator[RequestOutput], constraint_field: str | None = None) -> AsyncIterator[RequestOutput]:
    """Pass outputs through; an output the engine ended with an error raises RequestRejectedError
    (the request's own fault) or RequestFailedError (the engine's)."""
    try:
        async for out in stream:
            if any(c.finish_reason == "error" for c in out.outputs):
                if out.rejected and out.error:
                    raise RequestRejectedError(_named(out.error, constraint_field))
                raise RequestFailedError(request_id)
            yield out
    finally:
        await stream.aclose()  # its own cleanup (abort) runs now, not at garbage collection


async def _start(
    llm: AsyncLLM, prompts: list[Any], params: SamplingParams, base_id: str, priority: int = 0,
    lora_request: LoRARequest | None = None, cache_salt: str | None = None, constraint_field: str | None = None,
) -> list[AsyncIterator[RequestOutput]]:
    """Queue every prompt in one engine command: all are accepted or none. ``constraint_field``:
    the request field the output constraint came from, named by an error about it."""
    if cache_salt is not None:
        prompts = [{**(p if isinstance(p, dict) else {"prompt": p}), "cache_salt": cache_salt} for p in prompts]
    ids = _request_ids(base_id, len(prompts))
    try:
        streams = await llm.add_requests(prompts, params, ids, priority, lora_request=lora_request)
    except ValueError as e:
        named = _named(str(e), constraint_field)
        if named != str(e):
            raise ValueError(named) from e
        raise
    return [_checked(base_id, s, constraint_field) for s in streams]


def stream_error_event(error: BaseException, request_id: str) -> str:
    """The last SSE event of a stream the engine could not finish (then ``[DONE]``)."""
    param = None
    if isinstance(error, EngineDeadError):
        body = {"message": "the engine is unavailable; retry later", "type": "ServiceUnavailableError", "code": 503}
    elif isinstance(error, RequestRejectedError):
        body, param = {"message": str(error), "type": "BadRequestError", "code": 400}, param_of(str(error))
    else:
        body = {"message": f"internal error (request id {request_id})", "type": "InternalServerError", "code": 500}
    return _sse({"error": {**body, "param": param}})


async def _aborting_on_exit(llm: AsyncLLM, ids: list[str], body: AsyncIterator[str]) -> AsyncIterator[str]:
    """Stream ``body``; if the client leaves early (even before the first engine output was
    awaited, when no output stream has started yet), abort the requests. If the engine fails
    the request mid-stream, the client gets an error event and ``[DONE]``."""
    try:
        async for chunk in body:
            yield chunk
    except (RequestFailedError, RequestRejectedError, EngineDeadError) as e:
        logger.warning("stream %s ended by an engine error: %s", ids[0], e)
        yield stream_error_event(e, ids[0])
        yield "data: [DONE]\n\n"
    except Exception as e:  # a bug in the server's own part of the stream: the client still hears of it
        logger.error("stream %s failed: %s: %s", ids[0], type(e).__name__, e, exc_info=e)
        yield stream_error_event(e, ids[0])
        yield "data: [DONE]\n\n"
    finally:
        for rid in ids:
            llm.abort(rid)


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as (prompt index, output)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        # Let the pumps unwind first: closing a stream a pump still iterates would raise.
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:  # runs their cleanup (abort) now, not at garbage collection
            await s.aclose()


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, served_model_name: str, trust_request_chat_template: bool = False,
                 tool_call_parser: str | None = None):  # fmt: skip
        self.llm = llm
        # Set only with --enable-auto-tool-choice: tool_choice "auto" needs it.
        self.tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.model_name = served_model_name
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.engine.max_model_len
        self.trust_request_chat_template = trust_request_chat_template
        self.scheduling_policy = llm.engine.config.scheduling_policy
        # The model's generation_config.json: defaults of the sampling fields a request leaves out.
        self.sampling_defaults = read_generation_config(llm.engine.config.generation_config, llm.engine.source.path).sampling
        # LoRA adapters served by name (--lora-modules, /v1/load_lora_adapter): the request's
        # ``model`` picks one; the base model is ``served_model_name``.
        self.loras: dict[str, LoRARequest] = {}
        self._next_lora_id = 1

    def response_model(self, req: Any) -> str:
        """The ``model`` an answer names: the one the request asked for (an adapter, or any of
        the base model's names: the server checked it), else the base model's first name (vLLM's)."""
        return req.model or self.model_name

    def new_lora_request(self, name: str, path: str) -> LoRARequest:
        """A LoRARequest with a fresh id: an adapter loaded again under the same name (maybe
        other files) never shares prefix-cache blocks with its earlier self."""
        req = LoRARequest(name, self._next_lora_id, path)
        self._next_lora_id += 1
        return req

    async def render_chat(self, messages: Any, chat_template: str | None = None,
                          chat_template_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> list[int]:
        """Render and tokenize a conversation in the worker pool (never on the event loop).

        A request's own chat_template runs only on a server started with
        --trust-request-chat-template: a template is code, and code can loop forever.
        """
        if chat_template is not None and not self.trust_request_chat_template:
            raise ValueError("chat_template from a request is refused; start the server with "
                             "--trust-request-chat-template to allow it")
        reserved = sorted(set(chat_template_kwargs or {}) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        return await self.llm.run_in_worker(
            render_chat, self.tokenizer, messages, chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs, **kwargs,
        )  # fmt: skip

    async def _without_special_tokens(self, prompts: list[str | dict[str, Any]]) -> list[str | dict[str, Any]]:
        """Text prompts tokenized without the tokenizer's BOS/EOS (their text kept for echo),
        all in one trip to the worker pool; token-id prompts as they are."""
        if self.tokenizer is None:
            raise ValueError("add_special_tokens needs a tokenizer; this model has none")

        def encode(text: str) -> dict[str, Any]:  # (an empty list of ids: the input processor refuses it)
            ids = encode_prompt(self.tokenizer, text, self.max_model_len, add_special_tokens=False)
            return {"prompt": text, "prompt_token_ids": ids}

        return await self.llm.run_in_worker(lambda: [encode(p) if isinstance(p, str) else p for p in prompts])

    def _decode(self, token_id: int) -> str:
        return self.llm.engine.output_processor._decode_one(token_id) if self.tokenizer is not None else ""

    # ------------------------------------------------------------------ completions
    async def completion(self, req: CompletionRequest, client_id: str | None = None,
                         lora_request: LoRARequest | None = None) -> dict | AsyncIterator[str]:
        """``client_id``: the X-Request-Id header (else the body's request_id names the response);
        ``lora_request``: the adapter ``req.model`` named when the request arrived (None: the base)."""
        req.check_supported()
        check_priority(req.priority, self.scheduling_policy)
        params = req.to_sampling_params(self.sampling_defaults)
        prompts = req.prompts()
        if len(prompts) > MAX_PROMPTS_PER_REQUEST:
            raise ValueError(f"prompt has {len(prompts)} prompts; the limit is {MAX_PROMPTS_PER_REQUEST} per request")
        if not req.add_special_tokens:
            prompts = await self._without_special_tokens(prompts)
        rid, engine_id = response_and_engine_ids("cmpl", client_id or req.request_id)
        created = int(time.time())
        streams = await _start(self.llm, prompts, params, engine_id, req.priority, lora_request, req.cache_salt,
                               req.constraint_field())  # fmt: skip
        if req.stream:
            ids = _request_ids(engine_id, len(prompts))
            return _aborting_on_exit(self.llm, ids, self._completion_stream(req, params, streams, rid, created))
        n = params.n
        choices = [_Choice() for _ in range(len(prompts) * n)]
        finals: dict[int, RequestOutput] = {}
        prompt_lps: dict[int, list] = {}  # delta outputs carry prompt logprobs once, early
        async for i, out in _merge(streams):
            self._accumulate(choices, i * n, out)
            if out.prompt_logprobs is not None:
                prompt_lps[i] = out.prompt_logprobs
            if out.finished:
                finals[i] = out
        prompt_tokens = sum(len(finals[i].prompt_token_ids) for i in finals)
        cached_tokens = sum(finals[i].num_cached_tokens for i in finals)
        data = []
        if req.echo_only:  # the prompt alone: what was drawn to run the request is dropped
            for ch in choices:
                ch.text, ch.token_ids, ch.logprobs, ch.finish_reason, ch.stop_reason = "", [], [], "length", None
        for idx, ch in enumerate(choices):
            final = finals[idx // n]
            text = ch.text
            logprobs = None
            if req.echo:
                text = self._prompt_text(final) + text
            if params.logprobs is not None:
                entries: list[tuple[int, PositionLogprobs | None]] = []
                if req.echo:
                    entries += list(zip(final.prompt_token_ids, prompt_lps[idx // n]))
                entries += list(zip(ch.token_ids, ch.logprobs))
                logprobs = self._completion_logprobs(entries, params.logprobs)
            data.append(
                {"index": idx, "text": text, "logprobs": logprobs, "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason}
            )
        completion_tokens = sum(len(ch.token_ids) for ch in choices)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.response_model(req),
            "system_fingerprint": None,
            "choices": data,
            "usage": _usage(prompt_tokens, completion_tokens, cached_tokens),
        }

    async def _completion_stream(self, req, params, streams, rid, created) -> AsyncIterator[str]:
        n = params.n
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        prompt_tokens: dict[int, int] = {}
        cached_tokens: dict[int, int] = {}
        completion_tokens = 0
        echoed: set[int] = set()
        text_offsets: dict[int, int] = {}  # per choice: the text_offset its next chunk starts at
        prompt_lps: dict[int, list] = {}  # delta outputs carry prompt logprobs once, early
        async for i, out in _merge(streams):
            prompt_tokens[i], cached_tokens[i] = len(out.prompt_token_ids), out.num_cached_tokens
            if out.prompt_logprobs is not None:
                prompt_lps[i] = out.prompt_logprobs
            for c in out.outputs:
                idx = i * n + c.index
                text, token_ids, token_lps = c.text, c.token_ids, c.logprobs or []
                finish_reason, stop_reason = c.finish_reason, c.stop_reason
                if req.echo_only:  # the prompt alone: what was drawn to run the request is dropped
                    text, token_ids, token_lps = "", [], []
                    finish_reason, stop_reason = ("length" if finish_reason else None), None
                    if idx in echoed and finish_reason is None:
                        continue
                entries: list[tuple[int, PositionLogprobs | None]] = []
                if req.echo and idx not in echoed:  # the prompt (and its logprobs) before a sample's first text
                    echoed.add(idx)
                    text = self._prompt_text(out) + text
                    if params.logprobs is not None:
                        entries += list(zip(out.prompt_token_ids, prompt_lps.get(i) or [None] * len(out.prompt_token_ids)))
                completion_tokens += len(token_ids)
                logprobs = None
                if params.logprobs is not None:
                    logprobs = self._completion_logprobs(
                        entries + list(zip(token_ids, token_lps)), params.logprobs, text_offsets.get(idx, 0)
                    )
                    if logprobs["tokens"]:
                        text_offsets[idx] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                chunk = {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": self.response_model(req),
                    "choices": [
                        {"index": idx, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}
                    ],
                }
                if include_usage:
                    chunk["usage"] = None
                yield _sse(chunk)
        if include_usage:
            yield _sse(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": self.response_model(req),
                    "choices": [],
                    "usage": _usage(sum(prompt_tokens.values()), completion_tokens, sum(cached_tokens.values())),
                }
            )
        yield "data: [DONE]\n\n"

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer is not None else ""

    def _completion_logprobs(self, entries: list[tuple[int, PositionLogprobs | None]], k: int, offset: int = 0) -> dict:
        """The legacy logprobs object; ``text_offset`` counts from ``offset`` (a stream's chunks
        continue the offsets of the chunks before them, so they agree with the whole answer)."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for tid, entry in entries:
            tok = self._decode(tid)
            tokens.append(tok)
            offsets.append(offset)
            offset += len(tok)
            if entry is None:
                token_logprobs.append(None)
                top.append(None)
                continue
            token_logprobs.append(entry[tid].logprob)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
            # The k likeliest and the token itself (as vLLM: k = 0 gives just the token).
            top.append({self._decode(t): lp.logprob for t, lp in ranked if t == tid or (lp.rank is not None and lp.rank <= k)})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    # ------------------------------------------------------------------ chat
    async def chat(self, req: ChatCompletionRequest, client_id: str | None = None,
                   lora_request: LoRARequest | None = None) -> dict | AsyncIterator[str]:
        """As ``completion``."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot chat")
        req.check_supported()
        check_priority(req.priority, self.scheduling_policy)
        tools = resolve_tool_choice(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_parser is not None)
        prompt_ids = await self.render_chat(
            req.messages,
            chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tools=tools.tools if tools is not None else None,
            max_model_len=self.max_model_len,
            add_special_tokens=req.add_special_tokens,
        )
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"messages take {len(prompt_ids)} tokens; the context is {self.max_model_len}")
        params = req.to_sampling_params(self.sampling_defaults)
        constraint = tools.constraint() if tools is not None else None
        if constraint is not None:
            if params.structured_outputs is not None:
                raise ValueError(f"tool_choice {tools.mode} cannot be combined with another output constraint "
                                 "(response_format, structured_outputs, guided_*)")  # fmt: skip
            try:
                await self.llm.run_in_worker(self.llm.engine.structured.validate, constraint)
            except ValueError as e:
                raise ValueError(f"tools: a function's parameters are not a usable JSON schema ({e})") from e
            params = replace(params, structured_outputs=constraint)
        if tools is not None and tools.mode == "none":
            tools = None
        rid, engine_id = response_and_engine_ids("chatcmpl", client_id or req.request_id)
        created = int(time.time())
        streams = await _start(self.llm, [{"prompt_token_ids": prompt_ids}], params, engine_id, req.priority,
                               lora_request, req.cache_salt, req.constraint_field() if constraint is None else "tools")  # fmt: skip
        if req.stream:
            return _aborting_on_exit(
                self.llm, [engine_id], self._chat_stream(req, params, streams[0], rid, created, len(prompt_ids), tools)
            )
        choices = [_Choice() for _ in range(params.n)]
        cached_tokens = 0
        async for _, out in _merge(streams):
            self._accumulate(choices, 0, out)
            cached_tokens = out.num_cached_tokens
        data = []
        echo = req.echo_text()
        for idx, ch in enumerate(choices):
            message: dict[str, Any] = {"role": "assistant", "content": echo + ch.text, "tool_calls": []}
            finish_reason = ch.finish_reason
            content, calls = self._tool_calls(tools, ch.text) if ch.finish_reason != "length" else (None, None)
            if not calls and tools is not None and tools.mode == "named":
                # Cut short (max_tokens, a stop string): the call with its arguments as written, as
                # streamed (and as vLLM and OpenAI answer); finish_reason says it is incomplete.
                content, calls = None, [ToolCall(tools.name or "", ch.text)]
            if calls:
                content = echo + (content or "") if echo else content
                message = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}
                finish_reason = _calls_finish_reason(tools, finish_reason)
            data.append(
                {
                    "index": idx,
                    "message": message,
                    "logprobs": self._chat_logprobs(ch.token_ids, ch.logprobs, params.logprobs) if params.logprobs is not None else None,
                    "finish_reason": finish_reason,
                    "stop_reason": ch.stop_reason,
                }
            )
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": self.response_model(req),
            "system_fingerprint": None,
            "choices": data,
            "usage": _usage(len(prompt_ids), sum(len(ch.token_ids) for ch in choices), cached_tokens),
        }

    def _tool_calls(self, tools: ToolChoice | None, text: str) -> tuple[str | None, list[ToolCall] | None]:
        """The content outside the calls and the tool calls in a choice's complete text
        (calls None when it made none)."""
        if tools is None:
            return text, None
        if tools.mode == "auto":
            content, calls = self.tool_parser.extract(text)
            return (content, calls) if calls and tools.declares(calls) else (text, None)
        return None, tools.calls(text) or None

    async def _chat_stream(self, req, params, stream, rid, created, num_prompt_tokens, tools=None) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[dict], usage: dict | None = None, with_usage: bool = False) -> str:
            body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.response_model(req), "choices": choices}
            if with_usage:
                body["usage"] = usage
            return _sse(body)

        echo = req.echo_text()
        for i in range(params.n):
            yield chunk(
                [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
                with_usage=include_usage,
            )
            if echo:
                yield chunk([{"index": i, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}],
                            with_usage=include_usage)  # fmt: skip
        completion_tokens = cached_tokens = 0
        calls = [_ToolStream(tools, self.tool_parser) for _ in range(params.n)] if tools is not None else None
        async for out in stream:
            cached_tokens = out.num_cached_tokens
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                logprobs = self._chat_logprobs(c.token_ids, c.logprobs or [], params.logprobs) if params.logprobs is not None else None
                finish_reason = c.finish_reason
                if calls is None:
                    delta = {"content": c.text} if (c.text or c.finish_reason is None) else {}
                else:
                    delta, made_calls = calls[c.index].delta(c.text, c.finish_reason)
                    if made_calls:
                        finish_reason = _calls_finish_reason(tools, finish_reason)
                    if not delta and finish_reason is None and logprobs is None:
                        continue
                yield chunk(
                    [{"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": c.stop_reason}],
                    with_usage=include_usage,
                )
        if include_usage:
            yield chunk([], _usage(num_prompt_tokens, completion_tokens, cached_tokens), with_usage=True)
        yield "data: [DONE]\n\n"

    def _chat_logprobs(self, token_ids: list[int], entries: list[PositionLogprobs], k: int) -> dict:
        content = []
        for tid, entry in zip(token_ids, entries):
            tok = self._decode(tid)
            top = [
                {"token": self._decode(t), "logprob": lp.logprob, "bytes": list(self._decode(t).encode())}
                for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
                if lp.rank is not None and lp.rank <= k
            ]
            content.append({"token": tok, "logprob": entry[tid].logprob, "bytes": list(tok.encode()), "top_logprobs": top})
        return {"content": content}

    @staticmethod
    def _accumulate(choices: list[_Choice], base: int, out: RequestOutput) -> None:
        for c in out.outputs:
            ch = choices[base + c.index]
            ch.text += c.text
            ch.token_ids += c.token_ids
            ch.logprobs += c.logprobs or []
            if c.finish_reason is not None:
                ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason


class _ToolStream:
    """One streamed choice of a request with tools: text deltas in, OpenAI deltas out.

    A named function streams its arguments as they come; "required" sends its calls when the
    reply is complete; "auto" sends text as content until the parser sees a call start, then
    the calls at the end.
    """

    def __init__(self, tools: ToolChoice, parser: Any):
        self.tools = tools
        self.auto = StreamingToolCalls(parser) if tools.mode == "auto" else None
        self.text = ""
        self.call: ToolCall | None = None  # the named call being streamed

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], bool]:
        """(delta, whether the choice made tool calls)."""
        self.text += text
        done = finish_reason is not None
        if self.tools.mode == "named":
            # A complete call only if its arguments parse: a stop string may cut them short (the
            # call is still sent, with its arguments as written, as the non-streamed answer).
            made = done and finish_reason != "length" and self.tools.calls(self.text) is not None
            if self.call is None:
                self.call = ToolCall(self.tools.name or "", "")
                first = {**self.call.to_openai(0)}
                first["function"] = {"name": self.call.name, "arguments": text}
                return {"tool_calls": [first]}, made
            return ({"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}), made
        if self.auto is not None:
            content = self.auto.feed(text)
            if not done:
                return ({"content": content} if content else {}), False
            rest, calls = self.auto.finish(lambda calls: finish_reason != "length" and self.tools.declares(calls))
            delta: dict[str, Any] = {"content": content + rest} if content + rest else {}
            if calls:
                delta["tool_calls"] = [c.to_openai(i) for i, c in enumerate(calls)]
            return delta, bool(calls)
        if not done:  # required: the calls are sent whole at the end
            return {}, False
        calls = self.tools.calls(self.text) if finish_reason != "length" else None
        if not calls:
            return {"content": self.text}, False
        return {"tool_calls": [c.to_openai(i) for i, c in enumerate(calls)]}, True


def _calls_finish_reason(tools: ToolChoice, finish_reason: str | None) -> str | None:
    """A reply that called tools ends with "tool_calls", unless the request named the function
    (then the call was not the model's choice: "stop", as OpenAI and vLLM answer)."""
    return finish_reason if tools.mode == "named" else "tool_calls"


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage
