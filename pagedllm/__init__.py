"""pagedllm: a high-throughput LLM inference engine with PagedAttention, CPU first."""

from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedllm.entrypoints.llm import LLM
from pagedllm.inputs import TextPrompt, TokensPrompt
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.version import __version__

__all__ = ["LLM", "TextPrompt", "TokensPrompt", "LoRARequest", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "__version__"]
