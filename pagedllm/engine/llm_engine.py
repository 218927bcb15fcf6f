"""The engine: requests in, one scheduler step and one model step at a time, outputs out.

    add_request -> Scheduler.schedule -> ModelRunner.execute -> Scheduler.update_from_output
                -> RequestOutput for each finished request
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from typing import Any, Mapping

import torch

from pagedllm.config import DEFAULT_KV_CACHE_SPACE_GIB, EngineConfig, matmul_dtype
from pagedllm.engine.output_processor import OutputProcessor, RequestOutputKind
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.stats import StatsLogger, StepStats
from pagedllm.kv_cache.kv_cache_manager import KVCacheManager
from pagedllm.logger import configure_logging
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.kernels.ops import native_available
from pagedllm.model.loader import load_weights, resolve_model
from pagedllm.outputs import RequestOutput
from pagedllm.runner.model_runner import ModelRunner, kv_block_bytes
from pagedllm.runner.threads import configure_threads
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler.scheduler import Scheduler, SchedulerConfig
from pagedllm.tokenizer import load_tokenizer

logger = logging.getLogger("pagedllm.engine")

# A prompt: text, or {"prompt_token_ids": [...]} (optionally with "prompt" text alongside).
PromptType = str | Mapping[str, Any]


class LLMEngine:
    def __init__(self, config: EngineConfig, log_stats_interval: float = 5.0):
        configure_logging()
        configure_threads()
        self.config = config
        t0 = time.perf_counter()
        self.source = resolve_model(config.model)
        arch, state, packed = load_weights(self.source)
        self.arch = arch
        max_model_len = config.max_model_len or arch.max_position_embeddings
        if max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's context ({arch.max_position_embeddings})"
            )
        self.max_model_len = max_model_len
        dtype = config.torch_dtype
        model = LlamaForCausalLM.from_hf_state_dict(arch, state, dtype, max_model_len)
        del state
        if config.packed_weights and packed and native_available():
            if dtype == torch.float32:
                n = model.attach_packed(packed)
                logger.info("%d linear layers also keep their GGUF blocks for small batches", n)
            else:  # the blocks' values are not rounded to bf16: they would change answers
                logger.info("packed GGUF weights serve float32 models only; %s uses dense weights", dtype)
        del packed
        n = model.pack_dense()  # each layer checks it can (fp32 on CPU, kernels built)
        if n:
            logger.info("%d fp32 linear layers run the native dense GEMM for bigger steps", n)
        self.tokenizer = load_tokenizer(self.source)
        eos = set(arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)

        block_bytes = kv_block_bytes(arch, config.block_size, dtype)
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            space = config.kv_cache_space or DEFAULT_KV_CACHE_SPACE_GIB
            num_blocks = int(space * (1 << 30) // block_bytes)
            if num_blocks < 1:
                raise ValueError(f"kv_cache_space {space} GiB holds no block of {block_bytes} bytes")
        num_swap_blocks = int(config.swap_space * (1 << 30) // block_bytes) if config.preemption_mode == "swap" else 0
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, num_swap_blocks=num_swap_blocks
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                max_model_len,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                scheduling_policy=config.scheduling_policy,
                preemption_mode=config.preemption_mode,
            ),
            self.kv_cache_manager,
        )
        self.runner = ModelRunner(
            model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_model_len,
            dtype=dtype,
            attention_backend=config.attention_backend,
            seed=config.seed,
            num_swap_blocks=num_swap_blocks,
            swap_path=config.swap_path,
        )
        self.stats = StatsLogger(log_stats_interval)
        # Consumers of per-step stats (the periodic log line; Prometheus metrics in the server).
        self.stat_loggers: list[Any] = [self.stats]
        self.output_processor = OutputProcessor(self.tokenizer)
        self._samples_of: dict[str, list[str]] = {}  # request id -> its samples' ids
        self._request_counter = itertools.count()
        num_tokens = num_blocks * config.block_size
        logger.info("model: %s (%s, %s)", self.source.path, self.source.format, arch.architecture)
        wide = matmul_dtype(dtype)
        if wide != dtype:
            logger.info("%s model: this CPU has no %s arithmetic, so its linears multiply the %s values in %s "
                        "(PAGEDLLM_BF16_MATMUL overrides)", dtype, dtype, dtype, wide)
        logger.info(
            "config: %s",
            ", ".join(
                f"{k}={v}"
                for k, v in {
                    **config.to_dict(),
                    "dtype": f"{config.dtype} -> {str(dtype).removeprefix('torch.')}",
                    "max_model_len": max_model_len,
                }.items()
            ),
        )
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s); max concurrency at %d tokens/request: %.2fx",
            num_blocks,
            config.block_size,
            num_tokens,
            num_blocks * block_bytes / (1 << 30),
            str(dtype).removeprefix("torch."),
            max_model_len,
            num_tokens / max_model_len,
        )
        logger.info(
            "engine ready in %.1f s (threads: %d intra-op, %d inter-op; PAGEDLLM_NUM_THREADS overrides)",
            time.perf_counter() - t0,
            torch.get_num_threads(),
            torch.get_num_interop_threads(),
        )

    # ------------------------------------------------------------------ requests
    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def _prompt_tokens(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            if not ids:
                raise ValueError("prompt_token_ids is empty")
            bad = [t for t in ids if not 0 <= t < self.arch.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids contains {bad[0]}, outside the vocabulary [0, {self.arch.vocab_size})")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, Mapping) and "prompt" in prompt:
            return self._prompt_tokens(prompt["prompt"])
        raise ValueError(f"prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def add_request(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
        priority: int = 0,
    ) -> str:
        """Validate and queue a request; raises ValueError (and changes nothing) on bad input.

        With ``n > 1`` the request runs as n sequences ("{i}_{request_id}") that share the
        prompt's KV blocks; their outputs come back together under ``request_id``.
        """
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.check_vocab(self.arch.vocab_size)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if params.stop and (self.tokenizer is None or not params.detokenize):
            raise ValueError("stop strings need detokenize=True and a tokenizer")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer")
        text, ids = self._prompt_tokens(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        if params.max_tokens is None:
            params = replace(params, max_tokens=self.max_model_len - len(ids))
        request_id = request_id if request_id is not None else self.next_request_id()
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        bad_words = self._bad_words_ids(params.bad_words or [])
        samples = [
            Request(
                request_id=request_id if params.n == 1 else f"{i}_{request_id}",
                prompt=text,
                prompt_token_ids=ids,
                sampling_params=params,
                eos_token_ids=self.eos_token_ids,
                parent_id=request_id,
                index=i,
                priority=priority,
                bad_words_token_ids=bad_words,
            )
            for i in range(params.n)
        ]
        samples[0].pending_forks = samples[1:]
        self.scheduler.add_request(samples[0])
        self.output_processor.add(samples, output_kind)
        self._samples_of[request_id] = [r.request_id for r in samples]
        return request_id

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Token ids of each bad word, with and without a leading space (as vLLM)."""
        out: list[list[int]] = []
        for word in words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Abort a request (all its samples): blocks are freed at once."""
        for sample_id in self._samples_of.pop(request_id, []):
            req = self.scheduler.abort(sample_id)
            if req is not None:
                self.runner.free_request(sample_id)
                self.output_processor.mark(req)
        return self.output_processor.make_outputs()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> None:
        """Forget all cached prefixes (running requests keep their blocks)."""
        self.kv_cache_manager.reset_prefix_cache()

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run one scheduler + model step; return outputs per the requests' output kinds."""
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return self.output_processor.make_outputs()
        result = self.runner.execute(sched_out)
        # Who each drawn token belongs to, before update_from_output forks pending samples.
        targets = [[s.request, *s.request.pending_forks] if tokens else [] for s, tokens in zip(sched_out.scheduled, result.sampled)]
        for owners, lps in zip(targets, result.logprobs):
            for req, lp in zip(owners, lps):
                if lp is not None:
                    req.logprobs.append(lp)
                    req.cumulative_logprob += lp.token_logprob
        for s in sched_out.scheduled:
            entries = result.prompt_logprobs.get(s.request.request_id)
            if entries:
                s.request.prompt_logprobs.extend(entries)
        prompt_tokens = 0  # prompt tokens run for the first time (recomputation excluded)
        for s in sched_out.scheduled:
            req = s.request
            end = min(s.num_computed_tokens + s.num_new_tokens, req.num_prompt_tokens)
            if end > req.num_prompt_tokens_run:
                prompt_tokens += end - max(s.num_computed_tokens, req.num_prompt_tokens_run)
                req.num_prompt_tokens_run = end
        finished = self.scheduler.update_from_output(sched_out, result.sampled)
        for owners in targets:
            for req in owners:
                stop = self.output_processor.on_new_tokens(req, 1)
                if stop is not None:
                    if req.status.finished:  # also hit max_tokens: the stop string wins
                        req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
                    else:
                        self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, stop_reason=stop)
                        finished.append(req)
        for req in finished:
            self.runner.free_request(req.request_id)
            if all(self.scheduler.requests.get(r) is None for r in self._samples_of.get(req.parent_id, [])):
                self._samples_of.pop(req.parent_id, None)
        stats = StepStats(
            num_prompt_tokens=prompt_tokens,
            num_generation_tokens=sum(len(t) for t in result.sampled),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_cache_manager.usage(),
            num_preemptions=len(sched_out.preempted_ids),
            num_scheduled_tokens=sched_out.num_scheduled_tokens,
            num_prefix_queries=sched_out.num_prefix_queries,
            num_prefix_hits=sched_out.num_prefix_hits,
            num_uncacheable_tokens=sched_out.num_uncacheable_tokens,
        )
        for stat_logger in self.stat_loggers:
            stat_logger.record(stats)
        return self.output_processor.make_outputs()

    @property
    def num_preemptions_total(self) -> int:
        return self.scheduler.num_preemptions_total

    def get_tokenizer(self) -> Any:
        return self.tokenizer
