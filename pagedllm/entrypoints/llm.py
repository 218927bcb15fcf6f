"""The offline API: ``LLM(...).generate(prompts, sampling_params)``, in vLLM's shapes."""

from __future__ import annotations

import math
import threading
from dataclasses import fields
from functools import partial
from typing import Any, Callable, Sequence

from pagedllm.config import EngineConfig
from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchParams
from pagedllm.engine.chat import render_chat
from pagedllm.entrypoints.openai.tools import check_tools
from pagedllm.entrypoints.vllm_args import check_llm_args
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.engine.progress import ProgressBar
from pagedllm.logger import configure_logging
from pagedllm.model.generation_config import default_sampling_params, read_generation_config
from pagedllm.model.loader import resolve_model
from pagedllm.lora.request import LoRARequest
from pagedllm.threads import configure_threads
from pagedllm.outputs import RequestOutput
from pagedllm.scheduler.policy import check_priority
from pagedllm.sampling_params import SamplingParams


class LLM:
    """Generate text for many prompts at once with continuous batching over a paged KV cache.

    ``model`` is a GGUF file, a Hugging Face model directory, or None for the embedded
    SmolLM2-135M-Instruct. ``dtype="auto"`` (default) is float32, the exact mode (greedy tokens
    equal transformers' fp32); ``bfloat16`` is opt-in.
    """

    def __init__(self, model: str | None = None, *, log_stats_interval: float = 5.0, **engine_args: Any):
        """``engine_args`` are ``EngineConfig``'s fields with vLLM's names (``dtype``,
        ``block_size``, ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``,
        ``kv_cache_space``, ``enable_prefix_caching``, ...; see ``pagedllm/config.py``)."""
        known = {f.name for f in fields(EngineConfig)}
        engine_args = check_llm_args(engine_args)  # vLLM's arguments without meaning here (vllm_args.py)
        disable_log_stats = engine_args.pop("disable_log_stats", False)
        if not isinstance(disable_log_stats, bool):
            raise ValueError(f"disable_log_stats must be a bool, got {disable_log_stats!r}")
        if isinstance(log_stats_interval, bool) or not isinstance(log_stats_interval, (int, float)) or not log_stats_interval >= 0:
            raise ValueError(f"log_stats_interval must be a number of seconds >= 0 (0: every step, inf: never), got {log_stats_interval!r}")
        if disable_log_stats:
            log_stats_interval = math.inf
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        config = EngineConfig(model=model, **engine_args)
        self.scheduling_policy = config.scheduling_policy
        # The model's generation_config.json: the default of sampling_params=None (as vLLM).
        self._generation = read_generation_config(config.generation_config, resolve_model(config.model).path)
        # Process-wide settings belong to the entry point, not to the engine.
        configure_logging()
        # The engine is stepped by the calling thread: calls from several threads take turns
        # (``_add_and_run``).
        self._lock = threading.RLock()
        self.data_parallel = None
        if config.data_parallel_size > 1:  # N replica processes (pagedllm/data_parallel/); no engine here
            from pagedllm.data_parallel.client import DPAsyncLLM

            self.data_parallel = DPAsyncLLM(config, log_stats_interval=log_stats_interval)
            self.llm_engine = None
            return
        configure_threads()
        self.llm_engine = LLMEngine(config, log_stats_interval=log_stats_interval)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate``/``chat`` use when given no sampling_params: SamplingParams() with
        the values of the model's generation_config.json (``generation_config="vllm"``: none)."""
        return default_sampling_params(self._generation)

    def get_tokenizer(self) -> Any:
        if self.data_parallel is not None:
            return self.data_parallel.tokenizer
        return self.llm_engine.get_tokenizer()

    def reset_prefix_cache(self) -> bool:
        if self.data_parallel is not None:
            from pagedllm.data_parallel import offline

            offline.reset_prefix_cache(self.data_parallel)
            return True
        self.llm_engine.reset_prefix_cache()
        return True  # (as vLLM's: whether it was reset; running requests keep their blocks)

    def shutdown(self) -> None:
        """Stop the engine's background work now: the KV connector's saver (after writing its
        queue), grammar compiles, tensor/pipeline workers, or the data-parallel replicas (all
        also stopped at exit)."""
        if self.data_parallel is not None:
            self.data_parallel.shutdown()
        else:
            self.llm_engine.close()

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        *,  # (vLLM's chat_template_content_format comes next there: the rest by name only)
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or to a list of them.

        The prompt is rendered with the tokenizer's chat template (the GGUF's for the
        default model) unless ``chat_template`` is given. ``tools`` (OpenAI function tools)
        are passed to the template; to force a call, constrain the output with
        ``SamplingParams(structured_outputs=...)``.
        """
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of messages (dicts), or a list of such conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        if tools:
            tools = check_tools(tools)
        prompts = [
            {
                "prompt_token_ids": render_chat(
                    self.get_tokenizer(),
                    conv,
                    chat_template=chat_template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template_kwargs=chat_template_kwargs,
                    tools=tools,
                )
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order (vLLM's argument
        order). ``use_tqdm``: a bar, or a tqdm-like callable to make it with.

        ``priority`` (one int per prompt, lower first) matters with scheduling_policy="priority".
        ``lora_request``: a LoRA adapter for every prompt, or one per prompt (None: the base
        model); needs ``enable_lora=True``.

        All prompts are validated before any is queued, so one bad prompt raises a
        ValueError and leaves the engine as it was.
        """
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        loras = _per_prompt_loras(lora_request, len(prompts))
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        elif not isinstance(sampling_params, (list, tuple)):
            raise ValueError("sampling_params must be a SamplingParams or a list of them, one per prompt; got "
                             f"{type(sampling_params).__name__}")  # fmt: skip
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts; pass one or one per prompt"
                )
        if priority is not None and not isinstance(priority, (list, tuple)):
            raise ValueError(f"priority must be a list of integers, one per prompt; got {type(priority).__name__}")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        for p in priorities:
            check_priority(p, self.scheduling_policy)
        if self.data_parallel is not None:
            from pagedllm.data_parallel import offline

            return offline.generate(self.data_parallel, prompts, params_list, priorities, loras, use_tqdm)
        add = self.llm_engine.add_request
        return self._add_and_run([partial(add, p, sp, priority=prio, lora_request=lora)
                                  for p, sp, prio, lora in zip(prompts, params_list, priorities, loras)], use_tqdm)  # fmt: skip

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
    ) -> list[BeamSearchOutput]:
        """Beam search (vLLM's API and argument order; transformers' semantics, see
        engine/beam_search.py): per prompt, ``params.beam_width`` sequences best first, sharing
        their prefixes' KV blocks; ``lora_request`` as in ``generate``."""
        from pagedllm.engine.beam_search import to_beam_search_output

        prompts = _prompt_list(prompts)
        loras = _per_prompt_loras(lora_request, len(prompts))
        if self.data_parallel is not None:
            raise ValueError("beam_search runs on one engine; data_parallel_size > 1 is not supported here")
        adds = [partial(self.llm_engine.add_beam_search, p, params, lora_request=lora) for p, lora in zip(prompts, loras)]
        return [to_beam_search_output(out) for out in self._add_and_run(adds, use_tqdm)]

    def _add_and_run(self, adds: list[Callable[[], str]], use_tqdm: bool) -> list[RequestOutput]:
        """Queue every request (each ``add`` returns its id; if one raises, those queued are
        aborted and nothing is left behind), then step the engine until all have finished.
        Callers on several threads take turns: each step's outputs go to one caller."""
        with self._lock:
            added: list[str] = []
            try:
                for add in adds:
                    added.append(add())
            except Exception:
                for request_id in added:
                    self.llm_engine.abort_request(request_id)
                raise
            return self._run(added, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = ProgressBar(len(request_ids), use_tqdm)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    results[out.request_id] = out
                    bar.finished(out)
        except BaseException:
            # Leave no request behind holding blocks (e.g. on KeyboardInterrupt).
            for request_id in request_ids:
                if request_id not in results:
                    engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [results[r] for r in request_ids]


def _per_prompt_loras(lora_request: Any, num_prompts: int) -> list[LoRARequest | None]:
    """One adapter (or None) for every prompt, or one per prompt; ValueError otherwise."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, (list, tuple)):
        raise ValueError("lora_request must be a LoRARequest or a list of them (None for the base model), one per "
                         f"prompt; got {type(lora_request).__name__}")  # fmt: skip
    if len(lora_request) != num_prompts:
        raise ValueError(f"got {len(lora_request)} lora_requests for {num_prompts} prompts; pass one or one per prompt")
    return list(lora_request)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt_list(prompts: Any) -> list:
    """One prompt (a string, a dict, or token ids) or a list of them, as a list; ValueError
    otherwise. Token ids as a list of ints are one prompt, a list of such lists several (as
    vLLM reads them)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if _is_token_ids(prompts):
        return [{"prompt_token_ids": list(prompts)}]
    if isinstance(prompts, (list, tuple)):
        return [{"prompt_token_ids": list(p)} if _is_token_ids(p) else p for p in prompts]
    raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
