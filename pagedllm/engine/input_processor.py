"""Validate and tokenize a request before it reaches the engine.

Everything here is a pure function of the request and the model's fixed facts (tokenizer,
vocabulary, context length), so a server runs it in a worker pool: neither the HTTP event
loop nor the engine thread ever stalls on tokenizing one big input. Every size is checked
before anything is allocated for the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from pagedllm.engine.best_of import wants_best_of
from pagedllm.sampling_params import INT64_MAX, INT64_MIN, SamplingParams, StructuredOutputsParams

# A prompt: text, or {"prompt_token_ids": [...]} (optionally with "prompt" text alongside).
PromptType = str | Mapping[str, Any]
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


@dataclass
class ProcessedRequest:
    """A validated request: token ids, resolved sampling params, tokenized bad words."""

    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    lora_request: Any = None  # a LoRARequest (checked by the engine, which loads it)
    max_tokens_given: bool = True  # False: max_tokens is the default (the longest context the pool holds)
    # vLLM's cache_salt: only requests with the same salt share prefix-cache blocks (so one
    # tenant cannot learn another's prompts from cache-hit timing).
    cache_salt: str | None = None

    @property
    def queue_entries(self) -> int:
        """Waiting requests adding this one makes, as ``LLMEngine.num_waiting`` counts them: one
        per sample (n, or best_of), one per beam search."""
        params = self.sampling_params
        if params.use_beam_search:
            return 1
        return params.best_of if wants_best_of(params) else params.n


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any | None,
        vocab_size: int,
        max_model_len: int,
        max_num_seqs: int,
        validate_structured: Callable[[StructuredOutputsParams], None] | None = None,
    ):
        self.tokenizer = tokenizer
        self.validate_structured = validate_structured
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        # The longest prompt + output the KV pool lets one request reach (set by the engine):
        # a request without max_tokens generates up to it rather than being refused.
        self.longest_context = max_model_len

    def process(self, prompt: PromptType, params: SamplingParams | None = None, priority: int = 0) -> ProcessedRequest:
        """Raises ValueError naming the field on bad input."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(params.n, int) or isinstance(params.n, bool) or params.n < 1:  # (set after construction)
            raise ValueError(f"n must be at least 1, got {params.n!r}")
        params.check_vocab(self.vocab_size)
        if params.n > self.max_num_seqs:
            raise ValueError(f"n ({params.n}) exceeds max_num_seqs ({self.max_num_seqs})")
        if params.best_of is not None and params.best_of > self.max_num_seqs:  # best_of samples run at once, as n
            raise ValueError(f"best_of ({params.best_of}) exceeds max_num_seqs ({self.max_num_seqs})")
        if not isinstance(priority, int) or isinstance(priority, bool) or not INT64_MIN <= priority <= INT64_MAX:
            raise ValueError(f"priority must be a 64-bit integer, got {priority!r}")
        if params.stop and (self.tokenizer is None or not params.detokenize):
            raise ValueError("stop strings need detokenize=True and a tokenizer")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer")
        if params.structured_outputs is not None:
            if self.validate_structured is None:
                raise ValueError("structured_outputs are not supported by this engine")
            self.validate_structured(params.structured_outputs)
        text, ids = self._prompt_tokens(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        given = params.max_tokens is not None
        if not given:
            params = replace(params, max_tokens=max(1, min(self.max_model_len, self.longest_context) - len(ids)))
        elif len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {len(ids) + params.max_tokens} "
                f"exceeds max_model_len ({self.max_model_len})"
            )
        return ProcessedRequest(text, ids, params, priority, self._bad_words_ids(params.bad_words or []),
                                max_tokens_given=given, cache_salt=cache_salt(prompt))  # fmt: skip

    def _prompt_tokens(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping) and (unknown := sorted(map(repr, set(prompt) - PROMPT_KEYS))):
            # (a misspelt key would otherwise be dropped without a word)
            raise ValueError(f"prompt has unknown keys {', '.join(unknown)}: a prompt dict takes 'prompt' and/or "
                             "'prompt_token_ids' (and 'cache_salt')")  # fmt: skip
        if isinstance(prompt, str):
            if prompt and self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
            ids = encode_prompt(self.tokenizer, prompt, self.max_model_len)
            if ids and max(ids) >= self.vocab_size:  # a tokenizer bigger than the model's embedding
                raise ValueError(f"prompt: the tokenizer gave token id {max(ids)}, outside the model's vocabulary "
                                 f"[0, {self.vocab_size}): the tokenizer does not belong to this model")  # fmt: skip
            return prompt, ids
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            if not ids:
                raise ValueError("prompt_token_ids is empty")
            if len(ids) >= self.max_model_len:
                raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids contains {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, Mapping) and "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):  # (a dict in a dict ... would recurse without end)
                raise ValueError(f"prompt['prompt'] must be a string, got {type(prompt['prompt']).__name__}")
            return self._prompt_tokens(prompt["prompt"])
        raise ValueError(f"prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Token ids of each bad word, with and without a leading space (as vLLM)."""
        out: list[list[int]] = []
        for word in words:
            require_text(word, "bad_words")
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out


def cache_salt(prompt: PromptType) -> str | None:
    """A prompt dict's ``cache_salt`` (vLLM's key), checked: a non-empty string, or None."""
    salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return salt


# Ordinary text runs 3-5 characters a token; a text whose first 16 characters per allowed token
# already make too many tokens is refused without encoding the rest.
HEAD_CHARS_PER_TOKEN = 16


def encode_within(tokenizer: Any, text: str, limit: int, what: str, limit_name: str = "max_model_len",
                  **kwargs: Any) -> list[int]:
    """``tokenizer.encode(text, **kwargs)``, or a ValueError when the text's head alone (16
    characters per allowed token) already has more than ``limit`` tokens: a 15 MB prompt would
    otherwise hold a tokenizer thread for seconds just to be refused. A shorter text is encoded
    whole and may still have more than ``limit`` tokens: the caller checks the whole count."""
    cut = HEAD_CHARS_PER_TOKEN * limit
    if len(text) > cut:
        head = tokenizer.encode(text[:cut], **kwargs)
        if len(head) > limit:  # (a token or two at the cut may merge differently: hence > limit)
            raise ValueError(f"{what} is longer than {limit_name} ({limit} tokens): at least {len(head) - 1} tokens")
    return list(tokenizer.encode(text, **kwargs))


def encode_prompt(tokenizer: Any, text: str, limit: int, add_special_tokens: bool = True) -> list[int]:
    """A text prompt's token ids: not empty, text (no lone surrogate), refused from its head
    when far over ``limit`` tokens (``encode_within``)."""
    if not text:
        raise ValueError("prompt is empty")
    return encode_within(tokenizer, require_text(text, "prompt"), limit, "prompt", add_special_tokens=add_special_tokens)


def require_text(value: str, field: str) -> str:
    """``value`` if it is text; a lone UTF-16 surrogate (Python strings and JSON escapes can
    hold one) is not, and the tokenizer would fail on it with a TypeError."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field} contains a lone surrogate (U+{ord(value[e.start]):04X} at index {e.start}), which is not text") from None
    return value
