"""A checkpoint's ``generation_config.json``: the sampling its authors recommend, and the
extra tokens that end a reply.

vLLM reads it by default (``--generation-config auto``): a request that leaves out
temperature, top_p, top_k, min_p or repetition_penalty gets the file's value, its
``max_new_tokens`` caps max_tokens, and its ``eos_token_id`` (one id or a list) also ends
generation: the ids the model does not already end on become stop ids of every request
(``LLMEngine.add_request``). Instruct checkpoints often list their end-of-turn token only
there, so without it replies run to max_tokens. ``vllm`` keeps only those eos ids (vLLM reads
them in both modes); a directory reads that directory's file.
A GGUF file carries no such file (its EOS ids are in its metadata).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.model")

FILE_NAME = "generation_config.json"
# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}  # fmt: skip


@dataclass
class GenerationDefaults:
    """What the file asks for: sampling defaults (SamplingParams field -> value) and EOS ids."""

    sampling: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: list[int] = field(default_factory=list)
    path: Path | None = None  # the file read, if any


def read_generation_config(setting: str, model_path: Path) -> GenerationDefaults:
    """The defaults of ``setting``: ``auto`` (the model directory's file, if it has one),
    ``vllm`` (its eos ids only: no sampling defaults, as vLLM), or a directory that must hold
    the file."""
    if setting in ("auto", "vllm"):
        path = model_path / FILE_NAME if model_path.is_dir() else None
        if path is None or not path.is_file():
            return GenerationDefaults()
    else:
        path = Path(setting) / FILE_NAME
        if not path.is_file():
            raise ValueError(f"generation_config: no {FILE_NAME} in {setting!r}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: could not read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"generation_config: {path} must hold a JSON object")
    sampling = {} if setting == "vllm" else {name: raw[key] for key, name in SAMPLING_KEYS.items() if raw.get(key) is not None}
    try:
        SamplingParams(**sampling)  # the values must make sense as a request's
    except (ValueError, TypeError) as e:
        raise ValueError(f"generation_config: {path}: {e}") from None
    eos = raw.get("eos_token_id")
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(eos_ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos_ids):
        raise ValueError(f"generation_config: eos_token_id in {path} must be a token id or a list of them, got {eos!r}")
    return GenerationDefaults(sampling, eos_ids, path)


def default_sampling_params(defaults: GenerationDefaults) -> SamplingParams:
    """vLLM's ``LLM.get_default_sampling_params()``: SamplingParams() with the file's values."""
    return SamplingParams(**defaults.sampling)


def log_defaults(defaults: GenerationDefaults, known_eos: frozenset[int] | set[int] = frozenset()) -> None:
    """The startup line, when the file changes something (``known_eos``: the model's own)."""
    if defaults.sampling or set(defaults.eos_token_ids) - set(known_eos):
        logger.info("generation config %s: request defaults %s, end-of-reply ids %s (the model authors' choice; "
                    "--generation-config vllm keeps only its eos ids)", defaults.path, defaults.sampling or "unchanged",
                    defaults.eos_token_ids or "unchanged")  # fmt: skip
