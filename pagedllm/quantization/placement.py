"""Whether quantized weights also get an fp32 copy: decided once at load, against memory.

Packed blocks serve every batch size (``kernels/gguf_ops.py``), but a big step computes
faster from fp32 panels kept in memory (the on-the-fly panels cost 2-15% at 32-128 rows,
~40% at 8 rows here), and Q4_1/Q8_0 have a tuned small-batch kernel with its own layout. So
a model whose fp32 copy fits comfortably keeps one; a big model (a 7B Q4_K_M file is 4.4 GB,
28 GB as fp32) keeps only its blocks. ``dense_weights``: "auto" (the copy when it takes at
most a third of the memory available now), "yes" or "no".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pagedllm.kernels.gguf_ops import SMALL_ROWS
from pagedllm.quantization.weights import QuantizedWeight

logger = logging.getLogger("pagedllm.quantization")

DENSE_WEIGHTS_CHOICES = ("auto", "yes", "no")
# "auto" keeps the fp32 copy when it takes at most this share of the available memory.
DENSE_SHARE = 1 / 3


def available_memory() -> int:
    """Bytes the kernel says a new allocation can take (MemAvailable), 0 if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class Placement:
    dense: bool
    packed_bytes: int  # the quantized matrices as stored
    dense_bytes: int  # the same as fp32
    reason: str


def choose(mode: str, state: dict[str, Any], available: int | None = None) -> Placement:
    """Keep an fp32 copy of the state's quantized matrices?"""
    if mode not in DENSE_WEIGHTS_CHOICES:
        raise ValueError(f"dense_weights must be one of {', '.join(DENSE_WEIGHTS_CHOICES)}, got {mode!r}")
    qws = [w for w in state.values() if isinstance(w, QuantizedWeight)]
    packed = sum(w.nbytes for w in qws)
    dense = sum(4 * w.out_features * w.in_features for w in qws)
    return decide(mode, packed, dense, bool(qws), available)


def decide(mode: str, packed: int, dense: int, any_quantized: bool, available: int | None = None) -> Placement:
    """``choose`` from the byte counts alone (capacity planning reads them off file headers)."""
    if mode not in DENSE_WEIGHTS_CHOICES:
        raise ValueError(f"dense_weights must be one of {', '.join(DENSE_WEIGHTS_CHOICES)}, got {mode!r}")
    if not any_quantized:
        return Placement(True, 0, 0, "no quantized weights")
    if mode != "auto":
        return Placement(mode == "yes", packed, dense, f"dense_weights={mode}")
    available = available_memory() if available is None else available
    fits = dense <= DENSE_SHARE * available
    relation = "<=" if fits else ">"
    reason = f"fp32 copy {dense / 2**30:.2f} GiB {relation} 1/3 of {available / 2**30:.1f} GiB available"
    return Placement(fits, packed, dense, reason)


def log_placement(p: Placement) -> None:
    if not p.packed_bytes:
        return
    if p.dense:
        logger.info("weights: GGUF blocks (%.2f GiB) plus an fp32 copy for big steps (%s)",
                    p.packed_bytes / 2**30, p.reason)  # fmt: skip
    else:
        logger.info("weights: GGUF blocks only, %.2f GiB, run natively at every batch size (%s); steps of up to "
                    "%d rows then sum in another order than bigger ones (docs/determinism.md)",
                    p.packed_bytes / 2**30, p.reason, SMALL_ROWS)  # fmt: skip
