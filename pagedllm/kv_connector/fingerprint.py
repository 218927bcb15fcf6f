"""The model fingerprint: what a KV block's bytes depend on besides its tokens.

A stored block may only be loaded into an engine that would have computed the very same
bytes: same weights (by content), dtype, KV-cache dtype, block size and byte layout,
activation mode, attention backend (its summation order feeds the next layer's K/V) and
adapter. The fingerprint is a SHA-256 over all of these; the store files blocks under it and
checks it in every file's header.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

_CHUNK = 1 << 20


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def weights_digest(path: str | Path, cache_file: Path | None = None) -> str:
    """SHA-256 of a weights file (or of a model directory's config and weight files), by
    content, so replicas with their own copies agree. Hashing a big file takes a while, so
    the answer is remembered in ``cache_file`` under (path, size, mtime): a restart with the
    same file reads it back instead."""
    path = Path(path).resolve()
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".json", ".safetensors", ".gguf", ".bin") and p.is_file()
    )
    stamp = json.dumps([[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files])
    cache: dict[str, str] = {}
    if cache_file is not None:
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
        if isinstance(cache, dict) and isinstance(cache.get(stamp), str):
            return cache[stamp]
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{_file_digest(p)}\0".encode())
    digest = h.hexdigest()
    if cache_file is not None and isinstance(cache, dict):
        cache[stamp] = digest
        try:  # best effort: a cache we cannot write only costs the hash next time
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache))
            os.replace(tmp, cache_file)
        except OSError:
            pass
    return digest


@dataclass(frozen=True)
class ModelFingerprint:
    weights: str  # weights_digest
    dtype: str
    kv_cache_dtype: str  # resolved
    block_size: int
    block_layout: str  # the payload's parts: per block-indexed tensor, its dtype and shape
    activation_dtype: str = "float32"
    attention_backend: str = ""
    kernels: str = ""  # "native" or "torch": the torch fallbacks sum in other orders (other bytes)
    adapter_id: str | None = None  # a LoRA adapter, when there is one
    version: int = 1  # of the payload format

    @property
    def digest(self) -> bytes:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).digest()

    @property
    def id(self) -> str:
        """Short hex name (the store's directory for this fingerprint)."""
        return self.digest.hex()[:24]
