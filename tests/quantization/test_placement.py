"""The fp32-copy decision (``dense_weights``) is made against the memory available, and logged."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedllm.quantization.placement import choose, log_placement
from pagedllm.quantization.weights import QuantizedWeight


def _state() -> dict:
    # 64 rows of 256 Q8_0 weights: 64 x 272 bytes packed, 64 x 256 x 4 as fp32
    return {"a.weight": QuantizedWeight("Q8_0", torch.zeros(64, 272, dtype=torch.uint8), 256), "norm": torch.ones(4)}


def test_auto_keeps_the_copy_only_when_it_fits_comfortably(caplog):
    fp32 = 64 * 256 * 4
    roomy = choose("auto", _state(), available=3 * fp32)
    tight = choose("auto", _state(), available=3 * fp32 - 1)
    assert roomy.dense and not tight.dense
    assert (roomy.packed_bytes, roomy.dense_bytes) == (64 * 272, fp32)
    with caplog.at_level(logging.INFO, logger="pagedllm.quantization"):
        log_placement(tight)
    assert "GGUF blocks only" in caplog.text and "available" in caplog.text


def test_forced_choices_and_bad_values():
    assert choose("yes", _state(), available=0).dense
    assert not choose("no", _state(), available=10**12).dense
    assert choose("no", {"w": torch.ones(2, 2)}).dense  # nothing quantized: nothing to decide
    with pytest.raises(ValueError, match="dense_weights"):
        choose("maybe", _state())
