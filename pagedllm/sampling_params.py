"""Per-request generation settings, with vLLM's names, defaults and validation."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

from pagedllm.checks import check_bools, is_int, is_number

_GREEDY_EPS = 1e-5
MIN_REPETITION_PENALTY = 0.01  # 1 = off; below 1 favours repeating
MAX_LOGPROBS = 20
# Bounds on what one request may bring, checked before anything is allocated for it. They are
# far above any real use and keep a hostile request from costing the engine memory or time.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
MAX_LOGIT_BIAS_ENTRIES = 4096
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # above any vocabulary we load; check_vocab bounds the ids


MAX_CONSTRAINT_CHARS = 1 << 20  # a schema, regex or grammar bigger than 1 MiB is refused
MAX_CHOICES = 4096


def _token_key(k: Any) -> int:
    """A logit_bias key: a token id, as an integer or a string of one (JSON's object keys are
    strings); 1.7 or True are refused rather than taken as token 1."""
    if is_int(k):
        return k
    if isinstance(k, str) and len(k) <= 24 and k.strip().lstrip("+-").isdecimal():
        return int(k)
    raise ValueError(f"logit_bias keys must be token ids (integers, or strings of them), got {k!r}")


def _check_len(name: str, value: Any, limit: int) -> None:
    if value is not None and hasattr(value, "__len__") and len(value) > limit:
        raise ValueError(f"{name} has {len(value)} entries; the limit is {limit}")


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, any JSON object, a regex, one of some strings,
    an EBNF/GBNF grammar or an xgrammar structural tag (exactly one; vLLM's names).

    ``json`` may be a dict, a JSON string or a pydantic model class. ``disable_any_whitespace``
    makes JSON compact (no free whitespace between tokens), which keeps small models from
    wandering into endless blank space. Whether a schema, regex or grammar is valid is checked
    when the request is added (the engine's structured-output backend parses it).
    """

    json: dict | str | type | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict | str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar, structural_tag; "
                f"got {given or 'none'}"
            )
        if isinstance(self.json, type):  # a pydantic model class
            schema = getattr(self.json, "model_json_schema", None)
            if schema is None:
                raise ValueError(f"structured_outputs.json must be a dict, a JSON string or a pydantic model, got {self.json!r}")
            self.json = schema()
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a dict, a JSON string or a pydantic model, got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            _check_len("structured_outputs.choice", self.choice, MAX_CHOICES)
            self.choice = list(self.choice)
        if self.structural_tag is not None and not isinstance(self.structural_tag, (dict, str)):
            raise ValueError("structured_outputs.structural_tag must be a dict or a JSON string")
        check_bools(self, ("json_object", "disable_any_whitespace"), prefix="structured_outputs.", optional=True)
        try:
            size = len(self.spec)
        except (RecursionError, ValueError, TypeError) as e:  # nested past the JSON encoder's depth, a cycle, a non-JSON value
            raise ValueError(f"structured_outputs.{self.kind} cannot be written as JSON: {type(e).__name__}") from None
        if size > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"structured_outputs.{self.kind} is larger than {MAX_CONSTRAINT_CHARS} characters")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice, grammar or structural_tag."""
        for name in ("json", "regex", "choice", "grammar", "structural_tag"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def spec(self) -> str:
        """The constraint as one string (with ``kind``, the grammar cache's key). Keys keep
        their order: a schema's property order is the order the output is written in."""
        value = getattr(self, self.kind) if self.kind != "json_object" else ""
        if isinstance(value, str):
            return value
        return _json.dumps(value, separators=(",", ":"))

    @property
    def key(self) -> tuple[str, str, bool]:
        return (self.kind, self.spec, self.disable_any_whitespace)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature=0`` is greedy decoding. ``seed`` gives the request its own random
    generator, so its samples do not depend on what else is in the batch, on preemption, or on
    speculative decoding (each output token takes one draw, drafted or not). torch's CPU
    generator keeps only the seed's low 32 bits, so seeds equal modulo 2**32 (e.g. -2 and
    2**32 - 2) draw alike; ``seed=-1`` means no seed, as in vLLM. ``top_k`` of 0
    or -1 turns top-k off. ``presence_penalty``/``frequency_penalty`` count generated tokens
    only (OpenAI semantics); ``repetition_penalty`` counts prompt and generated tokens
    (Hugging Face semantics). ``logprobs=k`` returns the top-k log-probabilities of the
    model's raw distribution for each generated token, plus the sampled token's.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    # Constrained decoding (JSON schema, regex, choice, grammar): structured_output/.
    structured_outputs: StructuredOutputsParams | None = None
    # best_of > n: draw best_of samples, return the n with the highest cumulative logprob
    # (engine/best_of.py). use_beam_search: a beam search of width best_of (or n) returning the
    # n best beams, ranked by cumulative logprob / generated length ** length_penalty
    # (engine/beam_search.py; early_stopping as transformers: True, False or "never").
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n!r}")
        if self.best_of is not None and (not is_int(self.best_of) or self.best_of < self.n):
            raise ValueError(f"best_of must be an integer at least n ({self.n}), got {self.best_of!r}")
        check_bools(self, ("use_beam_search", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                           "spaces_between_special_tokens", "detokenize"))  # fmt: skip
        if not is_number(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):  # (1.0 == True: not a bool)
            raise ValueError(f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}")
        if self.use_beam_search and self.temperature != 0:
            raise ValueError(f"temperature must be 0 with use_beam_search, got {self.temperature!r}")
        if not is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite non-negative number, got {self.temperature!r}")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1) or self.top_k > INT64_MAX:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k!r}")
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed == -1 and is_int(self.seed):  # vLLM's spelling of "unseeded"
            self.seed = None
        if self.seed is not None and (not is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise ValueError(f"seed must be a 64-bit integer in [{INT64_MIN}, {INT64_MAX}], got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not is_number(self.repetition_penalty) or self.repetition_penalty < MIN_REPETITION_PENALTY:
            # (dividing logits by a tinier one overflows them to infinity)
            raise ValueError(f"repetition_penalty must be a finite number of at least {MIN_REPETITION_PENALTY}, "
                             f"got {self.repetition_penalty!r}")  # fmt: skip
        if self.max_tokens is not None and (not is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX):
            raise ValueError(f"max_tokens must be an integer in [1, {INT64_MAX}], got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT64_MAX:
            raise ValueError(f"min_tokens must be an integer in [0, {INT64_MAX}], got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop must not contain empty strings")
        _check_len("stop", self.stop, MAX_STOP_STRINGS)
        if self.max_stop_len > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters, got {self.max_stop_len}")
        _check_len("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        _check_len("allowed_token_ids", self.allowed_token_ids, MAX_ALLOWED_TOKEN_IDS)
        _check_len("logit_bias", self.logit_bias, MAX_LOGIT_BIAS_ENTRIES)
        _check_len("bad_words", self.bad_words, MAX_BAD_WORDS)
        self.stop_token_ids = self._token_list("stop_token_ids", self.stop_token_ids) or []
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id to bias, got {self.logit_bias!r}")
            bias = {_token_key(k): v for k, v in self.logit_bias.items()}
            bad = [v for v in bias.values() if not (is_number(v) and -100 <= v <= 100)]
            if bad:  # (the first one: the whole dict may hold 4,096 entries)
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bad[0]!r}")
            self.logit_bias = {k: float(v) for k, v in bias.items()}
        if self.allowed_token_ids is not None:
            # (duplicates dropped: the set is what counts, and the sampler masks with it every step)
            self.allowed_token_ids = list(dict.fromkeys(self._token_list("allowed_token_ids", self.allowed_token_ids)))
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w for w in self.bad_words)
        ):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        if self.bad_words and max(len(w) for w in self.bad_words) > MAX_BAD_WORD_CHARS:
            raise ValueError(f"bad_words entries may have at most {MAX_BAD_WORD_CHARS} characters")
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:  # an unknown key
                raise ValueError(f"structured_outputs: {e}") from e
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")
        if self.greedy:
            self.temperature = 0.0
        if self.top_k == -1:
            self.top_k = 0

    @staticmethod
    def _token_list(name: str, value: Any) -> list[int] | None:
        if value is None:
            return None
        if not isinstance(value, (list, tuple)) or not all(is_int(t) and t >= 0 for t in value):
            raise ValueError(f"{name} must be a list of non-negative token ids, got {value!r}")
        return list(value)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids must exist in the model's vocabulary (checked when the request is added)."""
        if self.top_k > vocab_size:
            raise ValueError(f"top_k ({self.top_k}) exceeds the vocabulary size ({vocab_size})")
        for name in ("stop_token_ids", "allowed_token_ids"):
            bad = [t for t in getattr(self, name) or [] if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} contains {bad[0]}, outside the vocabulary [0, {vocab_size})")
        bad = [t for t in self.logit_bias or {} if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"logit_bias has token id {bad[0]}, outside the vocabulary [0, {vocab_size})")

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's ``clone``)."""
        import copy

        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)
