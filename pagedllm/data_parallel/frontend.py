"""The engine as the API process sees it when the replicas run elsewhere.

The server validates and tokenizes requests before they reach an engine (a bad input is a 400
before any routing), and reads a few fixed facts of the model (context length, vocabulary).
With data parallelism those live in the replica processes; this object rebuilds the same
pieces from the facts replica 0 reports - the tokenizer, the InputProcessor, the structured
output validator, the detokenizer - without loading weights or a KV pool.
"""

from __future__ import annotations

from typing import Any, Callable

from pagedllm.config import EngineConfig
from pagedllm.data_parallel.core_proc import EngineFacts
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.lora.request import LoRARequest
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.tokenizer import load_tokenizer


class EngineFrontend:
    """The read-only face of an LLMEngine: config, model facts, input processing."""

    def __init__(self, config: EngineConfig, facts: EngineFacts, add_lora: Callable[[LoRARequest], None],
                 tokenizer: Any | None = None):  # fmt: skip
        """``tokenizer``: already loaded (while the replicas loaded theirs), else loaded here."""
        self.config = config
        self.source, self.arch = facts.source, facts.arch
        self.eos_token_ids, self.max_model_len = facts.eos_token_ids, facts.max_model_len
        self.tokenizer: Any | None = tokenizer if tokenizer is not None else load_tokenizer(facts.source)
        self.structured = StructuredOutputManager(self.tokenizer, self.arch.vocab_size, self.eos_token_ids)
        self.processor = InputProcessor(self.tokenizer, self.arch.vocab_size, self.max_model_len, config.max_num_seqs,
                                        validate_structured=self.structured.validate)  # fmt: skip
        self.processor.longest_context = facts.longest_context
        self.output_processor = OutputProcessor(self.tokenizer)
        self.kv_connector = None  # each replica has its own; their stats arrive with the steps
        self._add_lora = add_lora

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter in every replica (blocking; ValueError if any refuses it)."""
        self._add_lora(lora_request)
