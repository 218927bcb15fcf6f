"""AsyncLLM: the engine stepping in a background thread, one async stream per request.

The model step blocks for tens of milliseconds or more, so it never runs on the event
loop: a dedicated thread owns the LLMEngine and loops ``step()`` while there is work.
Tokenizing and validating a request runs in a small worker pool first, so neither the event
loop nor the engine thread stalls on one big input. Requests, aborts and shutdown reach the
engine thread through a command queue; outputs go back to each request's ``asyncio.Queue``
with ``call_soon_threadsafe``. A request whose consumer stops listening (a client
disconnect cancels the generator) is aborted and its blocks freed.

Faults: a fault the engine pins on one request ends that request with finish reason
"error" and nothing else. A fault it cannot attribute (or the engine thread dying) makes the
engine dead: every pending and later request fails with EngineDeadError and ``on_dead``
callbacks run (the server then answers 503 and exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from pagedllm.config import EngineConfig
from pagedllm.engine.errors import EngineDeadError, EngineOverloadedError, check_queue_room
from pagedllm.engine.input_processor import ProcessedRequest, PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.output_processor import RequestOutputKind
from pagedllm.logger import configure_logging
from pagedllm.lora.request import LoRARequest
from pagedllm.memory import trim_heap
from pagedllm.outputs import RequestOutput
from pagedllm.threads import configure_threads, single_thread
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.engine")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            pass

    def put_call(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass


class RequestStreams:
    """What every async front of the engine shares (this in-process one, data parallel's):
    a request's delta outputs as an async iterator, aborted when its consumer goes away;
    request ids; work off the event loop; the liveness check. Subclasses provide
    ``add_requests`` and ``_abort_stream``, and set ``_lock``, ``_workers``, ``dead``,
    ``_stopped`` and ``request_hooks``."""

    def _run_request_hooks(self, request_ids: list[str], processed: list[ProcessedRequest]) -> None:
        """``hook(request_id, ProcessedRequest)`` of ``request_hooks`` for requests just accepted,
        on the thread that then delivers their outputs and before any of them: a request may
        finish before its caller's task resumes (a test's metrics missed one's parameters)."""
        for hook in self.request_hooks:
            for rid, p in zip(request_ids, processed):
                try:
                    hook(rid, p)
                except Exception:  # (a metrics bug must not leave accepted requests without their streams)
                    logger.exception("request hook %r failed", hook)

    def new_request_id(self, prefix: str = "req") -> str:
        """A fresh id (random, as vLLM's: a counter's "req-1" could be an id a caller chose)."""
        return f"{prefix}-{uuid.uuid4().hex}"

    async def run_in_worker(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run CPU-heavy request work (chat templates, tokenizing) off the loop and the engine."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._workers, lambda: fn(*args, **kwargs))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._stopped and task is not None and not task.cancelling():
                # shutdown() cancelled the queued work, not the caller: what it gets is the engine's end
                raise EngineDeadError("the engine is shut down") from None
            raise

    def abort(self, request_id: str) -> None:
        """End ``request_id`` now, whichever stream holds it (its stream gets a final 'abort')."""
        self._abort_stream(request_id, None)

    def _abort_stream(self, request_id: str, stream: _Stream | None) -> None:
        """Abort ``request_id`` only while it is still the request behind ``stream`` (None: any):
        a stream left behind (or an add refused as a duplicate) must not abort a later request
        that holds the same id."""
        raise NotImplementedError

    def healthy(self) -> bool:
        """Whether the engine can serve: not dead, not shut down, and whatever runs its steps
        still running (checked directly, so /health never waits for the death to be noticed)."""
        return self.dead is None and not self._stopped and self._steppers_alive()

    def _steppers_alive(self) -> bool:
        raise NotImplementedError

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead}")
        if self._stopped:
            raise EngineDeadError("the engine is shut down")

    async def add_request(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str | None = None, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Queue one request; once the engine accepted it, return its stream of delta outputs."""
        rid = request_id if request_id is not None else self.new_request_id()
        (stream,) = await self.add_requests([prompt], sampling_params, [rid], priority)
        return stream

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the consumer went away (client disconnect): free the blocks now
                self._abort_stream(request_id, stream)

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """``async for out in llm.generate(...)``: delta outputs until the request finishes."""
        async for out in await self.add_request(prompt, sampling_params, request_id):
            yield out


class AsyncLLM(RequestStreams):
    def __init__(
        self,
        config: EngineConfig,
        log_stats_interval: float = 5.0,
        max_waiting_requests: int | None = None,
        num_input_workers: int = 2,
    ):
        configure_logging()  # process-wide settings: set by the entry point, not by the engine
        configure_threads()
        self.engine: LLMEngine | None = None  # built on the engine thread (_run)
        # Beyond this many waiting requests new ones are refused (EngineOverloadedError).
        self.max_waiting_requests = max_waiting_requests
        self.data_parallel_size = 1  # the in-process engine; pagedllm/data_parallel/ runs replicas
        self._workers = ThreadPoolExecutor(max_workers=num_input_workers, thread_name_prefix="pagedllm-input",
                                           initializer=single_thread)  # fmt: skip
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self.dead: BaseException | None = None  # the cause, once the engine is dead
        self.on_dead: list[Callable[[BaseException], None]] = []
        self._lock = threading.Lock()  # orders commands against the engine's death
        # Callbacks run in the engine thread for every output (e.g. per-token metrics).
        self.output_hooks: list[Any] = []
        # ``hook(request_id, ProcessedRequest)`` for every accepted request (the metrics' params).
        self.request_hooks: list[Any] = []
        # The engine thread builds the engine and then runs every step, so one thread alone
        # runs OpenMP teams. OpenMP (torch's runtime, which the native kernels share) keeps
        # its workers spinning between parallel regions only while it manages no more threads
        # than there are cores; a team made on the main thread by loading the model there, plus
        # the engine thread's own, put every worker to sleep and woke it at every region: a W2
        # step took 2.3x as long as offline (13 against 5.7 ms per token).
        built: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(config, log_stats_interval, built),
                                        name="pagedllm-engine", daemon=True)  # fmt: skip
        self._thread.start()
        error = built.get()
        if error is not None:
            self._workers.shutdown(wait=False)
            raise error

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    async def add_requests(
        self,
        prompts: list[PromptType],
        sampling_params: SamplingParams,
        request_ids: list[str],
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> list[AsyncIterator[RequestOutput]]:
        """Queue several prompts in one engine command (all or none); return their streams.
        ``lora_request``: the LoRA adapter they all run with (None: the base model).

        Raises ValueError for bad input, EngineOverloadedError when the waiting queue is
        full, EngineDeadError when the engine is gone - before anything is streamed.
        """
        self._check_alive()
        processor = self.engine.processor
        processed = await self.run_in_worker(lambda: [processor.process(p, sampling_params, priority) for p in prompts])
        for p in processed:
            p.lora_request = lora_request
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        streams = [_Stream(loop) for _ in prompts]
        with self._lock:
            self._check_alive()
            self._commands.put(("add", list(zip(request_ids, processed, streams)), accepted))
        self._wakeup.set()
        try:
            await accepted
        except asyncio.CancelledError:  # the caller left while the engine was adding them
            for rid, stream in zip(request_ids, streams):
                self._abort_stream(rid, stream)
            raise
        return [self._outputs(rid, stream) for rid, stream in zip(request_ids, streams)]

    async def call_in_engine(self, fn: Callable[[LLMEngine], Any], replica: int = 0) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps (loading a LoRA adapter, a
        consistent lock-free read of its state for the dashboard: the engine's state is only
        ever touched there); its result or exception comes back. ``replica``: always 0 here
        (DPAsyncLLM's interface)."""
        if replica != 0:
            raise ValueError(f"replica {replica} does not exist (data_parallel_size 1)")
        self._check_alive()
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._check_alive()
            self._commands.put(("call", fn, done))
        self._wakeup.set()
        return await done

    async def call_in_all_engines(self, fn: Callable[[LLMEngine], Any]) -> list[Any]:
        """``[fn(engine)]``: the one-replica case of DPAsyncLLM's broadcast (LoRA loading)."""
        return [await self.call_in_engine(fn)]

    def add_stat_logger(self, stat_logger: Any, replica: int | None = None) -> None:
        """``stat_logger.record(StepStats)`` after every step (on the engine thread)."""
        self.engine.stat_loggers.append(stat_logger)

    def num_running(self) -> int:
        return self.engine.num_running()

    def kv_cache_usage(self) -> float:
        return self.engine.kv_cache_manager.usage()

    def num_in_flight(self) -> int:
        """Requests added and not finished (streams still open)."""
        return len(self._streams)

    def _command(self, cmd: tuple) -> None:
        with self._lock:
            if self.dead is not None:
                return  # nothing left to act on
            self._commands.put(cmd)
        self._wakeup.set()

    def _abort_stream(self, request_id: str, stream: _Stream | None) -> None:
        self._command(("abort", request_id, stream))

    def abort_all(self) -> None:
        """End every request now (shutdown): each stream gets a final 'abort' output."""
        self._command(("abort_all",))

    def num_waiting(self) -> int:
        return self.engine.num_waiting()

    def _steppers_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._stopped = True
        self._command(("stop",))
        self._thread.join(timeout=10)
        self._workers.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    # ------------------------------------------------------------------ engine thread
    def _run(self, config: EngineConfig, log_stats_interval: float, built: queue.SimpleQueue) -> None:
        try:
            configure_threads()  # this thread's own OpenMP settings (they are per thread)
            self.engine = LLMEngine(config, log_stats_interval=log_stats_interval)
        except BaseException as e:  # a bad config or model: the constructor raises it
            built.put(e)
            return
        built.put(None)
        try:
            self._loop()
        except BaseException as e:  # an unattributable fault, or a bug in this loop
            logger.critical("the engine died: %s: %s", type(e).__name__, e, exc_info=e)
            self._die(e)

    def _loop(self) -> None:
        engine = self.engine
        trimmed = True  # the heap was trimmed since the last step (the loader trimmed it)
        while True:
            try:
                while True:
                    cmd = self._commands.get_nowait()
                    if cmd[0] == "stop":
                        self._fail_all(EngineDeadError("the engine shut down"))
                        return
                    self._handle(cmd)
            except queue.Empty:
                pass
            if not engine.has_unfinished_requests():
                if not trimmed:  # idle again (the last step ended, or aborts did): freed buffers go back
                    trim_heap()
                    trimmed = True
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                engine.executor.check_alive()  # idle: a dead worker is found now, not by the next request
                engine.report_idle()  # the stats line and the metrics go on while idle
                continue
            trimmed = False
            self._deliver(engine.step())

    def _die(self, cause: BaseException) -> None:
        error = cause if isinstance(cause, EngineDeadError) else EngineDeadError(f"{type(cause).__name__}: {cause}")
        with self._lock:
            self.dead = error
        self._fail_all(error)
        while True:  # commands queued before the death was known: answer them too
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] in ("add", "call"):
                accepted = cmd[2]
                _Stream(accepted.get_loop()).put_call(_set_exception, accepted, error)
        for callback in self.on_dead:
            try:
                callback(error)
            except Exception:
                logger.exception("on_dead callback failed")

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, items, accepted = cmd
            reply = _Stream(accepted.get_loop())
            try:
                self._add_all(items)
            except Exception as e:
                reply.put_call(_set_exception, accepted, e)
                return
            self._run_request_hooks([rid for rid, _, _ in items], [p for _, p, _ in items])
            reply.put_call(_set_result, accepted, time.monotonic())
        elif kind == "call":
            _, fn, done = cmd
            reply = _Stream(done.get_loop())
            try:
                result = fn(self.engine)
            except Exception as e:
                reply.put_call(_set_exception, done, e)
                return
            reply.put_call(_set_result, done, result)
        elif kind == "abort":
            _, request_id, stream = cmd
            held = self._streams.get(request_id)
            if held is not None and (stream is None or held is stream):
                self._deliver(self.engine.abort_request(request_id))
        elif kind == "abort_all":
            for request_id in list(self._streams):
                self._deliver(self.engine.abort_request(request_id))

    def _add_all(self, items: list[tuple[str, ProcessedRequest, _Stream]]) -> None:
        """Add every item or none (a failure withdraws the ones already added)."""
        adding = sum(processed.queue_entries for _, processed, _ in items)
        check_queue_room(self.num_waiting(), adding, self.max_waiting_requests)
        added: list[str] = []
        try:
            for request_id, processed, stream in items:
                if request_id in self._streams:
                    raise ValueError(f"request_id {request_id!r} is already in use")
                self.engine.add_request(processed, request_id=request_id, output_kind=RequestOutputKind.DELTA)
                self._streams[request_id] = stream
                added.append(request_id)
        except Exception:
            for request_id in added:
                self._streams.pop(request_id, None)
                self.engine.abort_request(request_id)
            raise

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            for hook in self.output_hooks:
                hook(out)
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            connector = self.engine.kv_connector
            if out.finished and connector is not None and connector.config.holds_outputs:
                # A producer answers once the request's blocks are in the store (a consumer asked
                # next then finds them); the step itself never waits.
                connector.when_saved(lambda s=stream, o=out: s.put(o))
            else:
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
