"""Gaps a mutation audit of the tensor / pipeline sharding found (single process: the cuts)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from pagedllm.distributed.sharding import check_supported, shard_state
from pagedllm.model.loader import load_weights, resolve_model
from pagedllm.quantization.weights import QuantizedWeight, dequantize
from tests.conftest import save_tiny_model


def test_a_gguf_row_parallel_cut_ending_inside_a_block_falls_back_to_dense(tmp_path):
    """6 query heads of 16 in 6 KV groups over 2 ranks: rank 0's o_proj columns are [0, 48),
    starting on a Q8_0 block boundary but ending inside a block. It must keep the dequantized
    columns (as a cut starting inside a block does), never a truncated block run."""
    import gguf

    path = save_tiny_model(tmp_path / "heads", hidden_size=96, num_attention_heads=6, num_key_value_heads=6,
                           intermediate_size=128)  # fmt: skip
    arch, state = load_weights(resolve_model(str(path)))
    key = "model.layers.0.self_attn.o_proj.weight"
    dense = state[key].float().numpy()
    blocks = gguf.quants.quantize(dense, gguf.GGMLQuantizationType.Q8_0)
    state[key] = QuantizedWeight("Q8_0", torch.from_numpy(np.ascontiguousarray(blocks)), dense.shape[1])
    full = dequantize(state[key])
    parts = [shard_state(arch, dict(state), r, 2, 0, 1)[1][key] for r in range(2)]
    assert [dequantize(p).shape[1] for p in parts] == [48, 48]
    assert torch.equal(torch.cat([dequantize(p) for p in parts], dim=1), full)


def test_pipeline_parallel_refuses_sliding_windows(tmp_path):
    """The stages run the plain Llama layer loop (one KV-cache group): a sliding-window Mistral
    is refused by name, while tensor parallel takes it."""
    path = save_tiny_model(tmp_path / "mistral", "mistral", sliding_window=24)
    arch, _ = load_weights(resolve_model(str(path)))
    assert arch.sliding_window == 24
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1 supports Llama-family models without sliding"):
        check_supported(arch, 1, 2)
    check_supported(arch, 2, 1)
    check_supported(replace(arch, sliding_window=None), 1, 2)


def test_tensor_parallel_logprobs_over_an_uneven_vocabulary(tmp_path):
    """Vocabulary 257 over 2 ranks (129 + 128 rows, the second padded to 129 for the gather):
    the padding column must be cut off the gathered logits, or it joins the softmax and every
    logprob shifts (greedy tokens alone do not show it, test_tensor_parallel_architectures)."""
    from pagedllm import SamplingParams
    from tests.distributed.test_tiny_parallel import _prompts, one_process_and_tp2

    path = save_tiny_model(tmp_path / "v257", vocab_size=257, seed=5)
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)
    ref, got = one_process_and_tp2(path, _prompts((3, 20)), sp)
    for mine, want in zip(got, ref):
        assert mine.token_ids == want.token_ids
        for a, b in zip(mine.logprobs, want.logprobs):
            assert sorted(a) == sorted(b) and max(a) < 257
            for t in a:
                assert abs(a[t].logprob - b[t].logprob) < 2e-4, (t, a[t].logprob, b[t].logprob)
