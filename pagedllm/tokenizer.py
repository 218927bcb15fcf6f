"""Tokenizer loading: from a Hugging Face directory, or built from a GGUF file and cached.

transformers can build a fast tokenizer (and chat template) from GGUF metadata, but that
takes seconds; the result is saved under ``$PAGEDLLM_CACHE_DIR`` (default ~/.cache/pagedllm),
keyed by the file's content, and reloaded from there in well under a second.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from pagedllm.config import cache_dir
from pagedllm.model.loader import ModelSource

logger = logging.getLogger(__name__)

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _file_key(path: Path) -> str:
    """A content key: size plus a hash of the first and last MiB (the metadata lives up front)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def load_tokenizer(source: ModelSource) -> Any | None:
    """The model's tokenizer, or None when the model ships none (token-id prompts only)."""
    from transformers import AutoTokenizer

    if source.format == "hf":
        if not any((source.path / f).exists() for f in _HF_TOKENIZER_FILES):
            logger.warning("no tokenizer files in %s: only token-id prompts work and outputs have no text", source.path)
            return None
        try:
            return AutoTokenizer.from_pretrained(str(source.path))
        except Exception as e:  # damaged tokenizer files fail in many ways (JSON, protobuf, ...)
            present = ", ".join(f for f in _HF_TOKENIZER_FILES if (source.path / f).exists())
            raise ValueError(f"could not load the tokenizer in {source.path} ({present}): {type(e).__name__}: {e}") from e

    cached = cache_dir() / "tokenizers" / f"{source.path.stem}-{_file_key(source.path)}"
    if (cached / "tokenizer.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as e:  # a damaged cache entry is rebuilt, not fatal
            logger.warning("ignoring unreadable tokenizer cache %s: %s", cached, e)
    logger.info("building the tokenizer from %s (cached for next time)", source.path.name)
    try:
        tok = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    except Exception as e:  # e.g. a GGUF without tokenizer metadata
        logger.warning(
            "no usable tokenizer in %s (%s): only token-id prompts work and outputs have no text", source.path, e
        )
        return None
    # Save to a private folder, then rename: concurrent processes never see half a cache.
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    try:
        tok.save_pretrained(str(tmp))
        os.rename(tmp, cached)
    except OSError as e:
        logger.warning("could not cache the tokenizer in %s: %s", cached, e)
        shutil.rmtree(tmp, ignore_errors=True)
    return tok
