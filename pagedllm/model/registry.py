"""Which model class serves an architecture (one module per family that differs)."""

from __future__ import annotations

from pagedllm.model.arch import ModelArch
from pagedllm.model.gemma2 import Gemma2ForCausalLM
from pagedllm.model.gemma3 import Gemma3ForCausalLM
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.moe import Qwen3MoeForCausalLM

_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "gemma2": Gemma2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


def model_class(arch: ModelArch) -> type[LlamaForCausalLM]:
    """Llama, Mistral, Qwen2 and Qwen3 share model/llama.py; the others have their own module."""
    return _CLASSES.get(arch.architecture, LlamaForCausalLM)
