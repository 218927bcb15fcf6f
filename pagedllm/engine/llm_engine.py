"""The engine: requests in, one scheduler step and one model step at a time, outputs out.

    add_request -> Scheduler.schedule -> ModelRunner.execute -> Scheduler.update_from_output
                -> RequestOutput for each finished request
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import replace
import logging
import time
from typing import Any

import torch

from pagedllm.config import EngineConfig, matmul_dtype
from pagedllm.engine.errors import EngineDeadError
from pagedllm.engine.faults import FaultInjector
from pagedllm.engine.input_processor import InputProcessor, ProcessedRequest, PromptType
from pagedllm.engine.kv_transfer import attach_kv_connector
from pagedllm.engine.output_processor import OutputProcessor, RequestOutputKind
from pagedllm.engine.parallel_sampling import ParallelSampling, sample_params
from pagedllm.engine.beam_search import BeamSearch, BeamSearchParams, beam_params_from
from pagedllm.engine.best_of import BestOf, expand as expand_best_of, wants_best_of
from pagedllm.engine.capacity import startup_report
from pagedllm.model.generation_config import log_defaults as log_generation_defaults
from pagedllm.engine.startup import (
    KVCacheSizes, LoadedModel, ModelInfo, StartupTimes, kv_cache_sizes, load_draft_model, load_model, load_model_info,
)  # fmt: skip
from pagedllm.executor.base import Executor, WorkerDeadError
from pagedllm.executor.uniproc import UniProcExecutor
from pagedllm.attention.kv_cache_dtype import resolve_kv_cache_dtype
from pagedllm.request import Request, RequestStatus
from pagedllm.engine.stats import StatsLogger, StepStats, spec_stats
from pagedllm.kernels.ops import native_available
from pagedllm.kv_cache.kv_cache_manager import KVCacheManager
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.runner.model_runner import ModelRunner
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagedllm.scheduler.scheduler import Scheduler, SchedulerConfig
from pagedllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("pagedllm.engine")

__all__ = ["LLMEngine", "PromptType"]


class LLMEngine:
    def __init__(self, config: EngineConfig, log_stats_interval: float = 5.0):
        t0 = time.perf_counter()
        self.config = config
        if config.world_size == 1:  # the model runs here (UniProcExecutor)
            loaded = load_model(config)
            info: LoadedModel | ModelInfo = loaded
        else:  # worker processes hold the shards; this process needs only shapes and tokenizer
            info = load_model_info(config)
        self.source, self.arch, self.tokenizer = info.source, info.arch, info.tokenizer
        self.eos_token_ids, self.max_model_len = info.eos_token_ids, info.max_model_len
        # generation_config.json: its eos ids beyond the model's stop every request as stop ids
        # (vLLM's update_from_generation_config: stop_reason is the id); the entry points apply
        # its sampling defaults.
        self.extra_stop_ids = frozenset(info.generation.eos_token_ids) - self.eos_token_ids
        log_generation_defaults(info.generation, self.eos_token_ids)
        sizes = kv_cache_sizes(config, info.arch)
        self.kv_cache_manager = KVCacheManager(
            sizes.num_blocks, config.block_size, config.enable_prefix_caching, num_swap_blocks=sizes.num_swap_blocks,
            windows=sizes.layout.windows,
        )  # fmt: skip
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                self.max_model_len,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                scheduling_policy=config.scheduling_policy,
                preemption_mode=config.preemption_mode,
                max_loras=config.max_loras if config.enable_lora else 0,
                num_speculative_tokens=config.num_speculative_tokens,
            ),
            self.kv_cache_manager,
        )
        times = info.times
        if config.world_size > 1:
            from pagedllm.distributed.sharding import check_supported
            from pagedllm.executor.multiproc import MultiprocExecutor

            check_supported(info.arch, config.tensor_parallel_size, config.pipeline_parallel_size)
            if config.node_rank != 0:  # (the engine waits for every rank: it would wait for itself)
                raise ValueError(f"node_rank {config.node_rank}: only node 0 runs the engine; the other nodes run "
                                 f"workers only (pagedllm serve --headless)")  # fmt: skip
            with times.phase("workers"):
                self.executor: Executor = MultiprocExecutor(config, sizes.num_blocks, sizes.num_swap_blocks, self.max_model_len,
                                                            load_model)  # fmt: skip
            dense_copy = bool(self.executor.worker_reports[0]["dense_copy"])
        else:
            draft = None
            if config.speculative_config is not None and config.speculative_config.method == "draft_model":
                with times.phase("draft model"):
                    draft = load_draft_model(config, self.max_model_len, self.arch.vocab_size)
            with times.phase("runner and KV pool"):
                runner = ModelRunner(
                    loaded.model,
                    num_blocks=sizes.num_blocks,
                    block_size=config.block_size,
                    max_num_seqs=config.max_num_seqs,
                    max_model_len=self.max_model_len,
                    dtype=config.torch_dtype,
                    attention_backend=config.attention_backend,
                    seed=config.seed,
                    num_swap_blocks=sizes.num_swap_blocks,
                    swap_path=config.swap_path,
                    kv_cache_dtype=config.kv_cache_dtype,
                    speculative_config=config.speculative_config,
                    draft_model=draft,
                    lora=(config.max_loras, config.max_lora_rank, config.lora_cpu_capacity) if config.enable_lora else None,
                )
            self.executor = UniProcExecutor(runner)
            dense_copy = loaded.dense_copy
        # The in-process runner (None with worker processes); tools and benchmarks reach the model through it.
        self.runner: ModelRunner | None = self.executor.runner
        self.kv_connector = attach_kv_connector(config, self.source.path, self.scheduler, self.runner)
        self.stats = StatsLogger(log_stats_interval)
        # Consumers of per-step stats (the periodic log line; Prometheus metrics in the server).
        self.stat_loggers: list[Any] = [self.stats]
        self._stats_time = time.monotonic()  # when stats were last taken (for steps that run nothing)
        self.structured = StructuredOutputManager(self.tokenizer, self.arch.vocab_size, self.eos_token_ids)
        self.processor = InputProcessor(self.tokenizer, self.arch.vocab_size, self.max_model_len, config.max_num_seqs,
                                        validate_structured=self.structured.validate)  # fmt: skip
        self.output_processor = OutputProcessor(self.tokenizer)
        self.output_processor.on_fault = self._fail_request
        self.parallel = ParallelSampling(self.scheduler, share_prompt=config.enable_prefix_caching)
        detok = (lambda ids: self.tokenizer.decode(ids)) if self.tokenizer is not None else None
        self.beams = BeamSearch(self.scheduler, self.kv_cache_manager, detok, id_in_use=self._id_in_use)
        self.best_of = BestOf()
        self.faults = FaultInjector()
        self._samples_of: dict[str, list[str]] = {}  # request id -> its samples' ids
        # Adapters removed (remove_lora) and not loaded again (add_lora): dropped as soon as no
        # live request uses them, also when a request that named one before its removal loads it.
        self._removed_loras: set[int] = set()
        self._loras_to_drop: set[int] = set()
        # Pipeline parallel: batches in flight, oldest first, and results collected early.
        self._batch_queue: deque[SchedulerOutput] = deque()
        self._drained: deque[tuple[SchedulerOutput, ModelRunnerOutput | None]] = deque()
        self._request_counter = itertools.count()
        self._log_startup(sizes, time.perf_counter() - t0, times, dense_copy)

    def _log_startup(self, sizes: KVCacheSizes, seconds: float, times: StartupTimes, loaded_dense: bool) -> None:
        config, dtype = self.config, self.config.torch_dtype
        logger.info("model: %s (%s, %s)", self.source.path, self.source.format, self.arch.architecture)
        wide = matmul_dtype(dtype)
        if wide != dtype:
            logger.info("%s model: this CPU has no %s arithmetic, so its linears multiply the %s values in %s "
                        "(PAGEDLLM_BF16_MATMUL overrides)", dtype, dtype, dtype, wide)  # fmt: skip
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype).name
        resolved = {**config.to_dict(), "dtype": f"{config.dtype} -> {str(dtype).removeprefix('torch.')}",
                    "kv_cache_dtype": f"{config.kv_cache_dtype} -> {kv_dtype}",
                    "max_model_len": self.max_model_len}  # fmt: skip
        logger.info("config: %s", ", ".join(f"{k}={v}" for k, v in resolved.items()))
        layout = sizes.layout
        # The same report as `pagedllm estimate` (engine/capacity.py), with this engine's choices.
        capacity = startup_report(config, self.source, self.max_model_len, loaded_dense, native_available())
        for line in capacity.lines()[1:]:
            logger.info("%s", line)
        self.processor.longest_context = capacity.kv.longest_context
        for report in self.executor.worker_reports if config.world_size > 1 else ():
            logger.info("worker %d (tp rank %d, pp rank %d): %d query / %d KV heads, %d layers, weights %.1f MiB, "
                        "RSS %.1f MiB, %d threads on cpus %s", report["rank"], report["tp_rank"], report["pp_rank"],
                        report["num_heads"], report["num_kv_heads"], report["num_layers"], report["weight_bytes"] / 2**20,
                        report["rss_bytes"] / 2**20, report["threads"], report["cpus"])  # fmt: skip
        if config.world_size == 1:
            report = self.executor.worker_reports[0]
            logger.info("resident weights %.1f MiB, RSS %.1f MiB", report["weight_bytes"] / 2**20, report["rss_bytes"] / 2**20)
        lora = self._lora
        if lora is not None:
            lora.in_use = self._loras_in_use
            logger.info("LoRA: %d slots of rank <= %d (%.1f MiB preallocated), up to %d adapters loaded",
                        lora.max_loras, lora.max_lora_rank, lora.table.nbytes / (1 << 20), lora.max_cpu_loras)  # fmt: skip
        if len(layout.groups) > 1 or layout.groups[0].window is not None:
            logger.info("KV cache groups (sliding layers free the blocks behind their window): %s", layout.describe())
        logger.info("engine ready in %.1f s (%s; threads: %d intra-op, %d inter-op; PAGEDLLM_NUM_THREADS overrides)",
                    seconds, times.describe(), torch.get_num_threads(), torch.get_num_interop_threads())  # fmt: skip

    # ------------------------------------------------------------------ requests
    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def add_request(
        self,
        prompt: PromptType | ProcessedRequest,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Validate and queue a request; raises ValueError (and changes nothing) on bad input.

        ``prompt`` may come already validated from ``self.processor.process`` (a server does
        that off the engine thread; ``sampling_params`` and ``priority`` are then ignored).
        With ``n > 1`` the request runs as n requests ("{i}_{request_id}") that share the
        prompt's full KV blocks through the prefix cache (engine/parallel_sampling.py); their
        outputs come back together under ``request_id``. A request with ``structured_outputs``
        waits (outside the scheduler, without holding anyone up) until its grammar is compiled.
        ``lora_request`` (or the ProcessedRequest's) names a LoRA adapter: it is loaded and
        checked against the model now, so a bad adapter is a ValueError here.
        """
        req = prompt if isinstance(prompt, ProcessedRequest) else self.processor.process(prompt, sampling_params, priority)
        lora_request = lora_request if lora_request is not None else req.lora_request
        if lora_request is not None:
            self._use_lora(lora_request)
        params = req.sampling_params
        if self.extra_stop_ids and not params.ignore_eos and not params.use_beam_search:
            params = replace(params, stop_token_ids=sorted(set(params.stop_token_ids or ()) | self.extra_stop_ids))
        request_id = request_id if request_id is not None else self.next_request_id()
        if params.use_beam_search:  # engine/beam_search.py; one final output with the n best beams
            beam = beam_params_from(params)
            if not req.max_tokens_given:  # W beams share the pool: the longest search that fits
                beam = replace(beam, max_tokens=self.beams.longest_fit(len(req.prompt_token_ids), beam.beam_width,
                                                                       beam.max_tokens))  # fmt: skip
            if self._id_in_use(request_id):
                raise ValueError(f"request_id {request_id!r} is already in use")
            self.beams.add(request_id, req.prompt, req.prompt_token_ids, beam, self.eos_token_ids, self.max_model_len,
                           req.priority, num_return=params.n, cache_salt=req.cache_salt,
                           lora_request=lora_request)  # fmt: skip
            return request_id
        best_of = wants_best_of(params)  # engine/best_of.py: best_of samples, the n best returned at the end
        sampled = expand_best_of(params) if best_of else params
        ids = [request_id] if sampled.n == 1 else [f"{i}_{request_id}" for i in range(sampled.n)]
        # Checked first: a refused id must change nothing.
        taken = next((i for i in dict.fromkeys([request_id, *ids]) if self._id_in_use(i)), None)
        if taken is not None:
            raise ValueError(f"request_id {request_id!r} is already in use" + ("" if taken == request_id else f" (by {taken!r})"))
        asked = params
        if best_of:
            params, output_kind = sampled, RequestOutputKind.FINAL_ONLY
        samples = [
            Request(
                request_id=ids[i],
                prompt=req.prompt,
                prompt_token_ids=req.prompt_token_ids,
                sampling_params=sample_params(params, i),
                eos_token_ids=self.eos_token_ids,
                parent_id=request_id,
                index=i,
                priority=req.priority,
                bad_words_token_ids=req.bad_words_token_ids,
                lora_request=lora_request,
                cache_salt=req.cache_salt,
            )
            for i in range(params.n)
        ]
        if params.structured_outputs is not None:
            self.scheduler.check_request(samples[0])  # what could never run is refused now
            self.structured.add(samples)
        else:
            self.parallel.add(samples)
        if best_of:  # (after the checks above: a refused request leaves no pick behind)
            self.best_of.add(request_id, asked)
        self.output_processor.add(samples, output_kind)
        self._samples_of[request_id] = [r.request_id for r in samples]
        return request_id

    def add_beam_search(
        self, prompt: PromptType, params: BeamSearchParams, request_id: str | None = None, priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> str:  # fmt: skip
        """Queue a beam search (engine/beam_search.py); its one output (the beams, best first)
        comes back from ``step()`` under ``request_id`` when the search ends."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        req = self.processor.process(prompt, SamplingParams(max_tokens=params.max_tokens), priority)
        request_id = request_id if request_id is not None else self.next_request_id()
        if self._id_in_use(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        if lora_request is not None:
            self._use_lora(lora_request)
        self.beams.add(request_id, req.prompt, req.prompt_token_ids, params, self.eos_token_ids, self.max_model_len, req.priority,
                       cache_salt=req.cache_salt, lora_request=lora_request)
        return request_id

    def _id_in_use(self, request_id: str) -> bool:
        """Whether ``request_id`` names a live request of any kind: a caller's (and its samples'
        parent), a sample ("{i}_{parent}", queued or still held back), a beam search, or a step
        request of one."""
        index, sep, parent = request_id.partition("_")
        return (request_id in self.output_processor.parents or request_id in self._samples_of
                or request_id in self.beams.groups or request_id in self.scheduler.requests
                or bool(sep and index.isdigit() and request_id in self._samples_of.get(parent, ())))  # fmt: skip

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and validate an adapter (kept in the LRU of max_cpu_loras); ValueError if it
        cannot serve (LoRA off, bad path or files, rank above max_lora_rank, wrong shapes)."""
        self._use_lora(lora_request)
        self._removed_loras.discard(lora_request.lora_int_id)  # loaded again on purpose
        self._loras_to_drop.discard(lora_request.lora_int_id)

    def _use_lora(self, lora_request: LoRARequest) -> None:
        """A request's adapter, loaded if needed; an adapter removed while in use stays marked to
        drop (a request that named it just before the unload must not keep it loaded for good)."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self._lora is None:
            raise ValueError("lora_request needs an engine started with enable_lora=True (--enable-lora)")
        self._lora.add(lora_request)
        if lora_request.lora_int_id in self._removed_loras:
            self._loras_to_drop.add(lora_request.lora_int_id)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop a loaded adapter now, unless live requests still use it (scheduled, held back
        for a grammar or sample 0, a beam search waiting for room): then it stays loaded for
        them and is dropped after the step where the last of them ends. True if dropped now."""
        if self._lora is None:
            return False
        self._removed_loras.add(lora_int_id)
        if lora_int_id in self._loras_in_use():
            self._loras_to_drop.add(lora_int_id)
            return False
        return self._lora.remove(lora_int_id)

    def _drop_unused_loras(self) -> None:
        """The removals ``remove_lora`` deferred, once no live request uses the adapter."""
        if self._loras_to_drop:
            for lora_int_id in self._loras_to_drop - self._loras_in_use():
                self._loras_to_drop.discard(lora_int_id)
                self._lora.remove(lora_int_id)

    def _loras_in_use(self) -> set[int]:
        """Adapter ids of every live request: scheduled, held back (n > 1, grammars) or a beam search."""
        ids = {r.lora_int_id for r in self.scheduler.requests.values()}
        ids |= {s.request.lora_int_id for p in self.output_processor.parents.values() for s in p.samples}
        ids |= {g.lora_request.lora_int_id for g in self.beams.groups.values() if g.lora_request is not None}
        ids.discard(0)
        return ids

    def list_loras(self) -> list[int]:
        return self._lora.loaded_ids() if self._lora is not None else []

    def lora_requests_info(self) -> tuple[dict[str, int], dict[str, int]]:
        """Requests per adapter name: (running, waiting)."""
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        between = set(self.beams.between_steps())  # a running search's beams, re-queued between its steps
        queued = list(self.scheduler.waiting)
        now = [*self.scheduler.running, *(r for r in queued if r.request_id in between)]
        later = [*(r for r in queued if r.request_id not in between), *self.held_requests()]
        for reqs, counts in ((now, running), (later, waiting)):
            for r in reqs:
                if r.lora_request is not None:
                    counts[r.lora_request.lora_name] = counts.get(r.lora_request.lora_name, 0) + 1
        return running, waiting

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Abort a request (all its samples): blocks are freed at once."""
        self._end_request(request_id, RequestStatus.FINISHED_ABORTED)
        outputs = self.best_of.select(self.output_processor.make_outputs()) + self.beams.take_outputs()
        self._drop_unused_loras()
        self.record_state()  # no step may follow (the engine may now be idle)
        return outputs

    def _end_request(self, request_id: str, status: RequestStatus, error: str | None = None) -> None:
        self.beams.abort(request_id, error)  # a beam search: its beams' requests and blocks
        for sample_id in self._samples_of.pop(request_id, []):
            req = self.scheduler.end(sample_id, status)
            if req is not None:
                req.error = error
                self.output_processor.mark(req)
        held = self.parallel.drop(request_id) + self.structured.drop(request_id)  # samples still held back
        for req in held:
            req.status, req.error, req.finished_time = status, error, time.monotonic()
            self.output_processor.mark(req)
        self.structured.forget([req.request_id for req in held])  # (never scheduled: no step reports them)

    def _fail_request(self, req: Request, error: BaseException) -> None:
        """A fault pinned on one request ends that request (all its samples) and nothing else."""
        logger.error("request %s failed: %s: %s", req.parent_id, type(error).__name__, error, exc_info=error)
        message = f"{type(error).__name__}: {error}"
        self._end_request(req.parent_id, RequestStatus.FINISHED_ERROR, message)
        if req.status is not RequestStatus.FINISHED_ERROR:  # it had just finished (its last token failed)
            req.status, req.error = RequestStatus.FINISHED_ERROR, message
            self.output_processor.mark(req)

    def held_requests(self) -> list[Request]:
        """Requests accepted but outside the scheduler's queues: samples waiting for their grammar
        or for sample 0's prompt, beam searches waiting for room in the pool. They count as
        waiting (as vLLM counts its requests waiting for a grammar)."""
        return self.structured.held() + self.parallel.held() + self.beams.held()

    def num_running(self) -> int:
        """Requests in the running batch, with the beams of running searches between steps."""
        return len(self.scheduler.running) + len(self.beams.between_steps())

    def num_waiting(self) -> int:
        # (max: read from the metrics thread, the queue and the beams may be seen a step apart)
        return max(0, len(self.scheduler.waiting) - len(self.beams.between_steps())) + len(self.held_requests())

    def record_state(self) -> None:
        """Report the engine's state without a step (after an abort, or while idle): the
        gauges and LoRA labels follow, saves the KV connector finished between steps are
        counted, and the periodic log line comes on time."""
        self._record_stats()

    def report_idle(self) -> None:
        """No step ran (the engine is idle, or its only requests wait for their grammar): the
        state still reaches the stat loggers, about once a second."""
        if time.monotonic() - self._stats_time >= 1.0:
            self.record_state()

    def _record_stats(self, **step: Any) -> None:
        """Hand the stat loggers a step's counts (``step``; none: a report between steps) and
        the state after it."""
        self._stats_time = time.monotonic()
        stats = StepStats(
            num_prompt_tokens=step.pop("num_prompt_tokens", 0),
            num_generation_tokens=step.pop("num_generation_tokens", 0),
            num_running=self.num_running(),
            num_waiting=self.num_waiting(),
            kv_cache_usage=self.kv_cache_manager.usage(),
            num_preemptions=step.pop("num_preemptions", 0),
            kv_connector=self.kv_connector.take_stats() if self.kv_connector is not None else None,
            lora=self.lora_requests_info() if self._lora is not None else None,
            **step,
        )
        for stat_logger in self.stat_loggers:
            stat_logger.record(stats)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self.structured.has_held or self.beams.has_unfinished()
                or bool(self._batch_queue) or bool(self._drained))  # fmt: skip

    def reset_prefix_cache(self) -> None:
        """Forget all cached prefixes (running requests keep their blocks)."""
        self.kv_cache_manager.reset_prefix_cache()

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run one scheduler + model step; return outputs per the requests' output kinds."""
        if self.executor.max_concurrent_batches > 1:
            return self._step_pipelined()
        self._admit_compiled()
        sched_out = self.scheduler.schedule()
        self.structured.forget(sched_out.finished_req_ids)
        if sched_out.is_empty:
            self._update_states(sched_out)  # forget ended requests, apply pending moves
            self.report_idle()
            outputs = self.output_processor.make_outputs()
            self._drop_unused_loras()
            return outputs
        self.faults.after_schedule(self._prompts(sched_out))
        self._update_states(sched_out)
        sched_out.grammar = self.structured.bitmask(sched_out.scheduled)
        result = self._execute(sched_out)
        return self._finish_step(sched_out, result)

    def _step_pipelined(self) -> list[RequestOutput]:
        """Pipeline parallel: keep up to one batch per stage in flight, so stage 1 runs batch A
        while stage 0 runs batch B. A call submits one more batch when there is room and
        something to run; otherwise it waits for the oldest batch and finishes it as ``step``
        does. The running requests form one cohort per batch (``max_batch_seqs``); a request
        in flight is neither scheduled again nor preempted until its result is back. A batch
        that fails on every rank drains the later ones, then is re-run alone to isolate the
        faulty request (``_execute``)."""
        if self._drained:  # results collected while a failed batch was isolated: in order
            sched_out, result = self._drained.popleft()
            if result is None:  # re-run only what did not end meanwhile (aborted; EngineDeadError's caller)
                sched_out.scheduled = [s for s in sched_out.scheduled if s.req_id in self.scheduler.requests]
                if not sched_out.scheduled:
                    return self.output_processor.make_outputs()
                result = self._execute(sched_out)
            return self._finish_step(*self._still_live(sched_out, result))
        queue, depth = self._batch_queue, self.executor.max_concurrent_batches
        if len(queue) < depth:
            self._admit_compiled()
            in_flight = {s.req_id for batch in queue for s in batch.scheduled}
            unfinished = len(self.scheduler.running) + len(self.scheduler.waiting)
            sched_out = self.scheduler.schedule(in_flight, max(1, -(-unfinished // depth)))
            self.structured.forget(sched_out.finished_req_ids)
            self._update_states(sched_out)
            if not sched_out.is_empty:
                self.faults.after_schedule(self._prompts(sched_out))
                sched_out.grammar = self.structured.bitmask(sched_out.scheduled)
                try:
                    self.faults.before_model_step(self._prompts(sched_out))
                    self.executor.submit(sched_out)
                except WorkerDeadError as e:
                    raise EngineDeadError(str(e)) from e
                except Exception:  # (an injected fault) isolate it with nothing else in flight
                    self._drain()
                    self._drained.append((sched_out, None))
                    return self.output_processor.make_outputs()
                queue.append(sched_out)
                if len(queue) < depth:
                    return self.output_processor.make_outputs()
        if not queue:
            self.report_idle()
            outputs = self.output_processor.make_outputs()
            self._drop_unused_loras()
            return outputs
        sched_out = queue.popleft()
        try:
            result = self.executor.collect()
        except WorkerDeadError as e:
            raise EngineDeadError(str(e)) from e
        except Exception:  # every rank failed it: isolate it once nothing else is in flight
            self._drain()
            result = self._execute(sched_out)
        return self._finish_step(*self._still_live(sched_out, result))

    def _drain(self) -> None:
        """Collect every batch in flight into ``_drained`` (None for one that failed)."""
        while self._batch_queue:
            later = self._batch_queue.popleft()
            try:
                self._drained.append((later, self.executor.collect()))
            except WorkerDeadError as e:
                raise EngineDeadError(str(e)) from e
            except Exception:
                self._drained.append((later, None))

    def _still_live(self, out: SchedulerOutput, result: ModelRunnerOutput) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """Drop the requests that ended (aborted) while their batch was in flight."""
        keep = [i for i, s in enumerate(out.scheduled) if s.req_id in self.scheduler.requests]
        if len(keep) == len(out.scheduled):
            return out, result
        out.scheduled = [out.scheduled[i] for i in keep]
        drafts = result.spec_token_ids
        return out, ModelRunnerOutput(
            req_ids=[result.req_ids[i] for i in keep], sampled=[result.sampled[i] for i in keep],
            logprobs=[result.logprobs[i] for i in keep], prompt_logprobs=result.prompt_logprobs,
            spec_token_ids=[drafts[i] for i in keep] if drafts else drafts,
        )  # fmt: skip

    def _finish_step(self, sched_out: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        """Everything after the model step: the scheduler, stop checks, outputs and stats."""
        # The scheduled requests, looked up before update_from_output retires finished ones.
        scheduled = [self.scheduler.requests[s.req_id] for s in sched_out.scheduled]
        # Prompt tokens reached for the first time, once per parent request (as its usage
        # counts them, and vLLM's prompt_tokens_total): prefix-cache hits included; recomputation
        # after a preemption and the samples n > 1 adds excluded.
        prompt_tokens = 0
        for s, req in zip(sched_out.scheduled, scheduled):
            if req.index != 0:
                continue
            end = min(s.num_computed_tokens + s.num_new_tokens, req.num_prompt_tokens)
            if end > req.num_prompt_tokens_run:
                prompt_tokens += end - req.num_prompt_tokens_run
                req.num_prompt_tokens_run = end
        spec = spec_stats(sched_out, result.sampled)  # what verification accepted, before stops trim it
        finished = self.scheduler.update_from_output(sched_out, result.sampled, result.spec_token_ids)
        # A stop inside accepted drafts dropped the tokens after it (update_from_output): their
        # logprobs go too, so a request's logprobs stay one per output token.
        for tokens, lps in zip(result.sampled, result.logprobs):
            del lps[len(tokens) :]
        self.output_processor.record_logprobs(scheduled, result)
        for req, tokens, lps in zip(scheduled, result.sampled, result.logprobs):
            if not tokens or req.status is RequestStatus.FINISHED_ERROR:  # a sibling's fault ended it
                continue
            if self.structured.tracks(req.request_id):
                try:
                    grammar_done = self.structured.accept(req.request_id, tokens)
                except ValueError as e:
                    self._fail_request(req, e)
                    continue
                if grammar_done and not req.status.finished:  # e.g. with ignore_eos
                    self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
                    finished.append(req)
            try:
                hit = self.output_processor.on_new_tokens(req, len(tokens))
            except Exception as e:  # e.g. a detokenizer fault: this request's alone
                self._fail_request(req, e)
                continue
            if hit is not None:
                stop, after = hit  # tokens drawn after the stop string's one (accepted drafts) go
                req.drop_output_tail(after)
                del tokens[len(tokens) - after :], lps[len(lps) - after :]
                if req.status.finished:  # also hit max_tokens: the stop string wins
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
                else:
                    self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, stop_reason=stop)
                    finished.append(req)
        self.beams.after_step(scheduled, result.logprobs)
        self.parallel.release_ready()
        for req in finished:
            if all(self.scheduler.requests.get(r) is None for r in self._samples_of.get(req.parent_id, [])):
                self._samples_of.pop(req.parent_id, None)
        self._record_stats(
            num_prompt_tokens=prompt_tokens,
            num_generation_tokens=sum(len(t) for t in result.sampled),
            num_preemptions=len(sched_out.preempted_ids),
            num_scheduled_tokens=sched_out.num_scheduled_tokens,
            num_prefix_queries=sched_out.num_prefix_queries,
            num_prefix_hits=sched_out.num_prefix_hits,
            num_uncacheable_tokens=sched_out.num_uncacheable_tokens,
            spec=spec,
        )
        outputs = self.best_of.select(self.output_processor.make_outputs()) + self.beams.take_outputs()
        self._drop_unused_loras()  # (after the outputs: finished requests are gone from the queues)
        return outputs

    def _update_states(self, out: SchedulerOutput) -> None:
        try:
            self.executor.update_states(out)
        except WorkerDeadError as e:
            raise EngineDeadError(str(e)) from e

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar is now compiled (or end them if it failed); when
        nothing else can run, wait briefly for one instead of spinning."""
        if not self.structured.has_held:
            return
        if not self.scheduler.has_unfinished_requests():
            self.structured.wait_for_any(timeout=0.02)
        for samples, error in self.structured.take_ready():
            if error is None:
                self.parallel.add(samples)
                continue
            now = time.monotonic()
            for req in samples:
                req.status, req.error, req.finished_time = RequestStatus.FINISHED_ERROR, str(error), now
                req.rejected = isinstance(error, ValueError)  # the constraint's fault, not the engine's
                self.output_processor.mark(req)
            self._samples_of.pop(samples[0].parent_id, None)

    def _prompts(self, out: SchedulerOutput) -> list[list[int]]:
        """Prompt token ids of the scheduled requests (for the fault injector)."""
        return [self.scheduler.requests[s.req_id].prompt_token_ids for s in out.scheduled]

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step; if it fails, find the request(s) it fails for and fail only them.

        A failing step is run again over halves of its requests (recursively) until every
        failure is pinned on a single request; the runner only writes the scheduled tokens'
        own K/V slots, so re-running is safe. Failed requests leave ``out.scheduled`` (and
        the result) before the scheduler sees them. When every request of a step of two or
        more fails on its own, the fault is the engine's, not theirs: EngineDeadError.
        """
        try:
            self.faults.before_model_step(self._prompts(out))
            return self.executor.execute(out)
        except WorkerDeadError as e:  # nothing to isolate: no step can run any more
            raise EngineDeadError(str(e)) from e
        except Exception as first_error:
            logger.warning("engine step failed (%s: %s); isolating the request(s) it fails for",
                           type(first_error).__name__, first_error)
            cause = first_error
        results: dict[int, tuple[list[int], list, list[int]]] = {}  # scheduled index -> (sampled, logprobs, drafts)
        prompt_lps: dict[str, list] = {}
        failed: dict[int, BaseException] = {}

        def run(indices: list[int]) -> None:
            part = SchedulerOutput(scheduled=[out.scheduled[i] for i in indices], grammar=out.grammar,
                                   kv_connector_metadata=out.kv_connector_metadata)  # fmt: skip
            try:
                self.faults.before_model_step(self._prompts(part))
                res = self.executor.execute(part)
            except WorkerDeadError as e:
                raise EngineDeadError(str(e)) from e
            except Exception as e:
                if len(indices) == 1:
                    failed[indices[0]] = e
                    return
                mid = len(indices) // 2
                run(indices[:mid])
                run(indices[mid:])
                return
            drafts = res.spec_token_ids or [[] for _ in indices]
            for i, sampled, lps, d in zip(indices, res.sampled, res.logprobs, drafts):
                results[i] = (sampled, lps, d)
            prompt_lps.update(res.prompt_logprobs)

        run(list(range(len(out.scheduled))))
        # Attribution is per parent request: the samples of one n > 1 request share its data.
        parent_of = {i: self.scheduler.requests[s.req_id].parent_id for i, s in enumerate(out.scheduled)}
        failed_parents = {parent_of[i] for i in failed}
        if len(set(parent_of.values())) > 1 and failed_parents == set(parent_of.values()):
            raise EngineDeadError(f"engine step failed for every request on its own: {cause}") from cause
        for i, error in failed.items():
            req = self.scheduler.requests.get(out.scheduled[i].req_id)
            if req is not None:  # else already ended with a sibling that failed first
                self._fail_request(req, error)
        # Samples of a failed request may sit elsewhere in the step: drop every ended one.
        keep = [i for i in range(len(out.scheduled)) if i in results and out.scheduled[i].req_id in self.scheduler.requests]
        out.scheduled = [out.scheduled[i] for i in keep]
        return ModelRunnerOutput(
            req_ids=[s.req_id for s in out.scheduled],
            sampled=[results[i][0] for i in keep],
            logprobs=[results[i][1] for i in keep],
            prompt_logprobs=prompt_lps,
            spec_token_ids=[results[i][2] for i in keep],
        )

    @property
    def _lora(self):
        """The in-process runner's LoRA manager (LoRA is refused with worker processes)."""
        return self.runner.lora if self.runner is not None else None

    def close(self) -> None:
        """Finish background work (the KV connector's queued saves), stop the workers and
        cancel the grammar compiles nobody waits for any more."""
        if self.kv_connector is not None:
            self.kv_connector.close()
        self.structured.shutdown()
        self.executor.shutdown()

    @property
    def num_preemptions_total(self) -> int:
        return self.scheduler.num_preemptions_total

    def get_tokenizer(self) -> Any:
        return self.tokenizer
