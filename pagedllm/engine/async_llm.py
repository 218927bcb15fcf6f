"""AsyncLLM: the engine stepping in a background thread, one async stream per request.

The model step blocks for tens of milliseconds or more, so it never runs on the event
loop: a dedicated thread owns the LLMEngine and loops ``step()`` while there is work.
Requests, aborts and shutdown reach it through a command queue; outputs go back to each
request's ``asyncio.Queue`` with ``call_soon_threadsafe``. A request whose consumer stops
listening (a client disconnect cancels the generator) is aborted and its blocks freed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.engine.output_processor import RequestOutputKind
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.engine")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLM:
    def __init__(self, config: EngineConfig, log_stats_interval: float = 5.0):
        self.engine = LLMEngine(config, log_stats_interval=log_stats_interval)
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._counter = 0
        self._lock = threading.Lock()
        # Callbacks run in the engine thread for every output (e.g. per-token metrics).
        self.output_hooks: list[Any] = []
        self._thread = threading.Thread(target=self._loop, name="pagedllm-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def new_request_id(self, prefix: str = "req") -> str:
        with self._lock:
            self._counter += 1
            return f"{prefix}-{self._counter}"

    async def add_request(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str | None = None, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request; once the engine accepted it, return its stream of delta outputs.

        Raises ValueError for bad input before anything is streamed.
        """
        request_id = request_id or self.new_request_id()
        if self._stopped:
            raise RuntimeError("the engine is shut down")
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        stream = _Stream(loop)
        self._commands.put(("add", request_id, prompt, sampling_params, stream, accepted, priority))
        self._wakeup.set()
        try:
            await accepted
        except asyncio.CancelledError:  # the caller left while the engine was adding it
            self.abort(request_id)
            raise
        return self._outputs(request_id, stream)

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the consumer went away (client disconnect): free the blocks now
                self.abort(request_id)

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """``async for out in llm.generate(...)``: delta outputs until the request finishes."""
        async for out in await self.add_request(prompt, sampling_params, request_id):
            yield out

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    def abort_all(self) -> None:
        """End every request now (shutdown): each stream gets a final 'abort' output."""
        self._commands.put(("abort_all",))
        self._wakeup.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._commands.put(("stop",))
        self._wakeup.set()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        engine = self.engine
        while True:
            try:
                while True:
                    cmd = self._commands.get_nowait()
                    if cmd[0] == "stop":
                        self._fail_all(RuntimeError("the engine shut down"))
                        return
                    self._handle(cmd)
            except queue.Empty:
                pass
            if not engine.has_unfinished_requests():
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a bug in a step must not kill the server
                logger.exception("engine step failed; aborting the running requests")
                for request_id in list(self._streams):
                    engine.abort_request(request_id)
                self._fail_all(RuntimeError(f"engine step failed: {e}"))
                continue
            self._deliver(outputs)

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, request_id, prompt, params, stream, accepted, priority = cmd
            try:
                if request_id in self._streams:
                    raise ValueError(f"request_id {request_id!r} is already in use")
                self.engine.add_request(prompt, params, request_id, output_kind=RequestOutputKind.DELTA, priority=priority)
            except Exception as e:
                stream.loop.call_soon_threadsafe(_set_exception, accepted, e)
                return
            self._streams[request_id] = stream
            stream.loop.call_soon_threadsafe(_set_result, accepted, time.monotonic())
        elif kind == "abort":
            if cmd[1] in self._streams:
                self._deliver(self.engine.abort_request(cmd[1]))
        elif kind == "abort_all":
            for request_id in list(self._streams):
                self._deliver(self.engine.abort_request(request_id))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            for hook in self.output_hooks:
                hook(out)
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
