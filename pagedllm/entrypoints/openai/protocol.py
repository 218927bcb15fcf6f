"""Request bodies of the OpenAI-compatible API (OpenAI's fields plus vLLM's extras).

Pydantic checks types; value ranges are checked by SamplingParams, so the API and the
Python interface reject the same things with the same messages.
"""

from __future__ import annotations

import logging
import types
import typing
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from pagedllm.engine.chat import TEXT_PART_SEPARATOR
from pagedllm.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

logger = logging.getLogger("pagedllm.server")

# Fields of OpenAI's or vLLM's API whose feature pagedllm does not have (yet), each with the
# test of a value that would ask for it. Such a request is refused (400 naming the field)
# rather than answered as if it had been honoured: no client should believe it got
# constrained or tool output when it did not.
UNSUPPORTED_FIELDS: dict[str, Callable[[Any], bool]] = {
    "functions": bool,
    "function_call": lambda v: v not in (None, "none"),
    "use_beam_search": bool,
    "length_penalty": lambda v: v not in (None, 1, 1.0),
    "guided_decoding_backend": lambda v: v not in (None, "auto", "xgrammar"),
    "guided_whitespace_pattern": lambda v: v is not None,
    "prompt_logprobs": lambda v: v is not None,
    "logits_processors": bool,
    "truncate_prompt_tokens": lambda v: v is not None,
    "audio": lambda v: v is not None,
    "modalities": lambda v: v not in (None, ["text"]),
    "prediction": lambda v: v is not None,
    "return_tokens_as_token_ids": bool,
    "return_token_ids": bool,
    "mm_processor_kwargs": bool,
    "documents": bool,
}
# OpenAI fields that change nothing here, accepted silently.
_HARMLESS = {"user", "store", "metadata", "service_tier", "reasoning_effort"}
_logged_unknown: set[str] = set()


def _reject_lone_surrogates(value: Any, where: str) -> None:
    """JSON can carry a lone UTF-16 surrogate ("\\ud800") in a string, but it is no text: the
    tokenizer would fail on it later, as an internal error. Refuse it where it is found."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where}: a lone UTF-16 surrogate is not text (invalid Unicode)") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _reject_lone_surrogates(key, where)
            _reject_lone_surrogates(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _reject_lone_surrogates(item, f"{where}[{i}]")


class _TextBody(BaseModel):
    """A request body whose strings must all be valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                _reject_lone_surrogates(value, str(key))
        return data


def _takes_none(field: Any) -> bool:
    """Whether a field is required or declares None as a value of its own (where null is not the default)."""
    if field.is_required():
        return True
    ann = field.annotation
    return ann is type(None) or (typing.get_origin(ann) in (typing.Union, types.UnionType) and type(None) in typing.get_args(ann))


class StreamOptions(BaseModel):
    include_usage: bool = True  # vLLM's default once stream_options is given
    continuous_usage_stats: bool = False


class _SamplingFields(_TextBody):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI's API types most optional fields "X or null", and clients send the null
        ("n": null, "stream": null): it means the default, as in vLLM."""
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or k not in fields or _takes_none(fields[k])}
        return data

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int = 0
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share prefix-cache blocks
    request_id: str | None = None  # vLLM's: the response's id is "cmpl-"/"chatcmpl-" + this (X-Request-Id wins)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* names (aliases; at most one of them per request).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None  # vLLM's top-level field (JSON text): as response_format's
    guided_decoding_backend: str | None = None

    # Fields of UNSUPPORTED_FIELDS this endpoint does support (completions: beam search, best_of).
    _supported: frozenset[str] = frozenset()

    def check_supported(self) -> None:
        """Refuse fields that ask for a feature we lack; log harmless unknown ones once."""
        given = {**(self.model_extra or {}), **{k: getattr(self, k) for k in self.model_fields_set}}
        for name, asks_for_it in UNSUPPORTED_FIELDS.items():
            if name in given and name not in self._supported and asks_for_it(given[name]):
                raise ValueError(f"{name} is not supported by this server")
        best_of = given.get("best_of")
        if best_of is not None and best_of != self.n and "best_of" not in self._supported:
            raise ValueError("best_of is not supported by this server (only best_of == n)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given with stream=true")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise ValueError("stream_options.continuous_usage_stats is not supported by this server")
        for name in self.model_extra or {}:
            if name not in UNSUPPORTED_FIELDS and name not in _HARMLESS and name != "best_of" and name not in _logged_unknown:
                _logged_unknown.add(name)
                logger.info("ignoring unknown request field %r (logged once)", name)

    def structured(self) -> StructuredOutputsParams | None:
        """The request's one output constraint, from whichever field gave it."""
        return next(iter(self._constraints().values()), None)

    def constraint_field(self) -> str | None:
        """The request field its output constraint came from (for the error's ``param``)."""
        return next(iter(self._constraints()), None)

    def _constraints(self) -> dict[str, StructuredOutputsParams]:
        """The output constraint by the field that gave it (at most one)."""
        given: dict[str, StructuredOutputsParams] = {}
        if self.structured_outputs is not None:
            try:
                given["structured_outputs"] = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from e
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar"), ("structural_tag", "structural_tag")):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                given[name] = StructuredOutputsParams(**{key: value})
        fmt = response_format_constraint(self.response_format)
        if fmt is not None:
            given["response_format"] = fmt
        if len(given) > 1:
            raise ValueError(f"structured_outputs: give at most one output constraint; got {', '.join(sorted(given))}")
        return given

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                         defaults: dict[str, Any] | None = None, **extra: Any) -> SamplingParams:  # fmt: skip
        """``defaults``: the model's generation_config.json values (model/generation_config.py)
        for the fields the request left out, as vLLM; its max_tokens caps the request's."""
        defaults = defaults or {}
        logit_bias = None
        if self.logit_bias is not None:
            try:
                logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError as e:
                raise ValueError(f"logit_bias keys must be token ids: {e}") from e

        def given(name: str, default: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, default)

        if "max_tokens" in defaults:
            max_tokens = defaults["max_tokens"] if max_tokens is None else min(max_tokens, defaults["max_tokens"])
        return SamplingParams(
            n=self.n,
            temperature=given("temperature", 1.0),
            top_p=given("top_p", 1.0),
            top_k=given("top_k", 0),
            min_p=given("min_p", 0.0),
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=given("repetition_penalty", 1.0),
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            structured_outputs=self.structured(),
            **extra,
        )


def response_format_constraint(fmt: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format``: text (no constraint), json_object, json_schema, or
    vLLM's structural_tag."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ValueError("response_format must be an object with a 'type'")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema must be an object with a 'schema'")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:  # OpenAI allows it; any JSON object then
            return StructuredOutputsParams(json_object=True)
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        return StructuredOutputsParams(json=schema)
    if kind == "structural_tag":
        return StructuredOutputsParams(structural_tag={k: v for k, v in fmt.items() if k != "type"})
    raise ValueError(f"response_format.type must be text, json_object, json_schema or structural_tag, got {kind!r}")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    # best_of > n: the n best of best_of samples by cumulative logprob; use_beam_search: the n
    # best of a beam search of width best_of (or n), as vLLM's completions API.
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (a BOS) around a text prompt

    _supported = frozenset({"use_beam_search", "length_penalty", "best_of"})

    def prompts(self) -> list[str | dict[str, Any]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, list) for x in p):
            return [{"prompt_token_ids": list(x)} for x in p]
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of such lists")

    @property
    def echo_only(self) -> bool:
        """vLLM's echo without generation (``echo`` and ``max_tokens: 0``): the prompt and its
        logprobs, nothing generated - how evaluation harnesses score a text."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        prompt_logprobs = self.logprobs if (self.echo and self.logprobs is not None) else None
        if self.stream and self.best_of is not None and self.best_of > self.n and not self.use_beam_search:
            raise ValueError("best_of > n is not supported with stream (the best samples are known only at the end)")
        if self.use_beam_search:
            if self.temperature is None:
                self.temperature = 0.0  # beam search is deterministic; OpenAI clients send no temperature
            # Of the model's defaults only the max_tokens cap applies (as vLLM's beam search):
            # a sampling default such as repetition_penalty would refuse every search.
            defaults = {k: v for k, v in (defaults or {}).items() if k == "max_tokens"}
        max_tokens = 1 if self.echo_only else self.max_tokens  # (the one token drawn is dropped: serving.py)
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs, defaults, best_of=self.best_of,
                                     use_beam_search=self.use_beam_search, length_penalty=self.length_penalty,
                                     early_stopping=self.early_stopping)  # fmt: skip


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens on top of the template's
    # vLLM's: the reply starts with the last message's content when that message has the
    # reply's role (an assistant message being continued).
    echo: bool = False

    def echo_text(self) -> str:
        """What ``echo`` puts before each reply's content ("" when nothing)."""
        if not self.echo or not self.messages:
            return ""
        last = self.messages[-1]
        role = "assistant" if self.add_generation_prompt else last.get("role")
        if last.get("role") != role:
            return ""
        content = last.get("content")
        if isinstance(content, list):  # (joined as the prompt joins them: normalize_messages)
            return TEXT_PART_SEPARATOR.join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        return content if isinstance(content, str) else ""

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Without max_tokens, the engine lets the reply run to the longest context it can hold."""
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:  # (named as sent)
            raise ValueError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:  # (0 asks for nothing: accepted, as vLLM)
            raise ValueError("top_logprobs needs logprobs to be true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, defaults=defaults)


class TokenizeRequest(_TextBody):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # None: as the route it counts for (completions True, chat False)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None  # as chat renders them (checked as chat checks them)
    chat_template: str | None = None  # ... and these two as well (the same trust rule)
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


ErrorType = Literal["BadRequestError", "NotFoundError", "AuthenticationError", "InternalServerError"]


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's shape)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's shape; the id, if given, is not needed)."""

    lora_name: str
    lora_int_id: int | None = None


# Request fields a ValueError's message may start with.
_FIELDS = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) | set(UNSUPPORTED_FIELDS) | {
    "stop_token_ids", "allowed_token_ids", "logit_bias", "max_tokens", "n", "temperature", "top_p", "top_k",
    "best_of", "stream_options.continuous_usage_stats", "response_format", "bad_words", "priority", "seed",
    "tokens",  # (/detokenize)
}  # fmt: skip

# Engine-side names of request fields (the input processor sees a prompt as its token ids).
_FIELD_ALIASES = {"prompt_token_ids": "prompt"}


def param_of(message: str) -> str | None:
    """The request field a ValueError's message names (ours start with it), for the error
    body's ``param``; None when it names none."""
    word = message.split(" ", 1)[0].strip("'\":,")
    word = _FIELD_ALIASES.get(word, word)
    if word in _FIELDS:
        return word
    head = word.split(".", 1)[0].split("[", 1)[0]  # "tools[0].function.name" -> "tools"
    return head if head in _FIELDS else None
