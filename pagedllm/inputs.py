"""The prompt forms ``LLM.generate`` takes, as vLLM names them (``from vllm.inputs import
TokensPrompt`` becomes ``from pagedllm.inputs import TokensPrompt``): plain dicts, typed."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]  # only prompts with the same salt share prefix-cache blocks


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt
