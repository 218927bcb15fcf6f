"""Soft-capped attention scores (Gemma 2): cap * tanh(s / cap) before the mask and softmax."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.attention.backend import get_attention_backend
from pagedllm.kernels.ops import native_available
from tests.attention.test_backends import make_batch


def dense_softcapped(q, dense, meta, num_heads, scale, cap, window):
    """Plain attention on each sequence's contiguous K/V, scores capped then masked."""
    outs, start = [], 0
    for (k, v), q_len in zip(dense, meta.query_lens_list):
        ctx = k.shape[0]
        group = num_heads // k.shape[1]
        qi = q[start : start + q_len].float().transpose(0, 1)
        ki = k.float().repeat_interleave(group, 1).transpose(0, 1)
        vi = v.float().repeat_interleave(group, 1).transpose(0, 1)
        scores = cap * torch.tanh(qi @ ki.transpose(1, 2) * scale / cap)
        q_pos, k_pos = torch.arange(ctx - q_len, ctx)[:, None], torch.arange(ctx)[None, :]
        allowed = (k_pos <= q_pos) & (k_pos > q_pos - (window or ctx + 1))
        outs.append((scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ vi).transpose(0, 1))
        start += q_len
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 6])
def test_every_backend_soft_caps_the_scores(window):
    q, k, v, kc, vc, meta, dense = make_batch(0, 16, 6, 2, torch.float32)
    q = q * 4  # scores well past the cap, so capping changes the answer
    scale, cap = 1 / math.sqrt(q.shape[-1]), 2.0
    expected = dense_softcapped(q, dense, meta, 6, scale, cap, window)
    uncapped = get_attention_backend("reference", torch.float32, torch.device("cpu")).forward(
        q, k, v, kc.clone(), vc.clone(), meta, scale, window
    )
    assert (uncapped - expected).abs().max() > 0.1
    names = ["reference", "torch_sdpa"] + (["cpu_native"] if native_available() else [])
    for name in names:
        backend = get_attention_backend(name, torch.float32, torch.device("cpu"))
        kc2, vc2 = kc.clone(), vc.clone()
        out = backend.forward(q, k, v, kc2, vc2, meta, scale, window, softcap=cap)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(kc2.flatten(0, 1)[meta.slot_mapping], k)  # this step's K/V were written
