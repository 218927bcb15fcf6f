"""Weight loading and quantization, pinned against independent computations: the gguf package's
dequantization, numpy's block quantization of activations, hand-built blocks and files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pagedllm.kernels import gguf_ops, ops, reference
from pagedllm.model.linear import Linear
from pagedllm.quantization.int8_activations import convert_model
from pagedllm.quantization.weight_only import quantize_state
from pagedllm.quantization.weights import (
    QuantizedEmbedding,
    QuantizedWeight,
    cat_rows,
    dequantize,
    weight_shape,
)
from tests.kernels.test_gguf_kernels import random_gguf


def _int8_product(x: torch.Tensor, w: torch.Tensor, levels: int = 127) -> torch.Tensor:
    """x quantized in 32-wide blocks (round half even of x * levels / amax), times w, in fp64."""
    xb = x.double().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    xq = np.round(xb * (levels / amax)) * (amax / levels)
    return torch.from_numpy(xq.reshape(x.shape) @ w.double().numpy().T)


def test_rows_that_are_not_whole_blocks_are_refused():
    """A row length that is not whole blocks is an error, even where truncating it to whole
    blocks would give the data's byte width."""
    with pytest.raises(ValueError, match="multiple"):
        gguf_ops.row_bytes("Q4_0", 80)
    with pytest.raises(ValueError, match="Q4_K"):
        QuantizedWeight("Q4_K", torch.zeros(2, 144, dtype=torch.uint8), 300)
    with pytest.raises(ValueError, match="Q8_0"):
        QuantizedWeight("Q8_0", torch.zeros(2, 34, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="Q8_0"):
        QuantizedWeight("Q8_0", torch.zeros(68, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="IQ4_NL"):
        QuantizedWeight("IQ4_NL", torch.zeros(2, 18, dtype=torch.uint8), 32)
    data = random_gguf("Q4_0", 4, 64)
    with pytest.raises(ValueError, match="Q4_0"):
        gguf_ops.get_rows(data, "Q4_0", torch.tensor([0, 3]), 80)


def test_row_lookups_refuse_ids_outside_the_table(native_or_torch):
    """The native lookup and its torch twin refuse the same ids: no row counted from the end."""
    data = random_gguf("Q8_0", 4, 64)
    for ids in ([-1], [0, -1], [2, -3], [4]):
        with pytest.raises(IndexError):
            gguf_ops.get_rows(data, "Q8_0", torch.tensor(ids), 64)


def test_int8_panels_refuse_scales_that_are_not_fp16_values():
    """The panels store fp16 scales: a scale fp16 cannot hold exactly is refused, not rounded."""
    q, d, m = reference.block_fields(random_gguf("Q4_1", 16, 64), "Q4_1", 64)
    with pytest.raises(ValueError, match="fp16"):
        reference.pack_int8_panels((q, d + 1e-6, m), "Q4_1")
    with pytest.raises(ValueError, match="fp16"):
        reference.pack_int8_panels((q, d, m + 1e-6), "Q4_1")


class _Block(nn.Module):
    def __init__(self, proj: Linear):
        super().__init__()
        self.proj = proj


@pytest.mark.parametrize("native", [True, False])
def test_int8_layer_of_mixed_segments_with_a_bias(native):
    """A fused layer whose rows mix Q4_0 / Q4_1 / Q8_0 segments, with a bias, in int8 mode: each
    segment's columns are its own rows times the int8-quantized x, plus the bias."""
    k = 64
    types = [("Q4_0", 20), ("Q8_0", 7), ("Q4_1", 5)]
    parts = [QuantizedWeight(t, random_gguf(t, n, k, seed=i), k) for i, (t, n) in enumerate(types)]
    lin = Linear(k, 32, bias=True)
    lin.set_quant(parts, drop_dense=True)
    lin.bias.copy_(torch.linspace(-3, 3, 32))
    report = convert_model(_Block(lin))
    assert report.converted == {"proj": "Q4_0+Q8_0+Q4_1"} and lin.int8 is not None
    w = torch.cat([gguf_ops.dequantize(p.data, p.qtype, k) for p in parts])
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0))
    want = (_int8_product(x, w) + lin.bias.double()).float()
    if native:
        y = lin(x)
    else:
        with ops.torch_only():
            y = lin(x)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_converting_again_switches_the_activation_bits():
    """A second ``convert_model`` with other bits makes the converted layers quantize x to those."""
    k = 64
    lin = Linear(k, 16)
    lin.set_quant([QuantizedWeight("Q8_0", random_gguf("Q8_0", 16, k, seed=4), k)], drop_dense=True)
    w = gguf_ops.dequantize(lin.quant[0].data, "Q8_0", k)
    model = _Block(lin)
    assert convert_model(model, bits=8).bits == 8
    report = convert_model(model, bits=16)
    assert report.converted == {"proj": "Q8_0"} and lin.int8.bits == 16
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(lin(x), _int8_product(x, w, levels=32258).float(), rtol=1e-5, atol=1e-5)


def test_int8_layers_return_the_activations_dtype():
    k = 64
    lin = Linear(k, 16)
    lin.set_quant([QuantizedWeight("Q4_0", random_gguf("Q4_0", 16, k, seed=5), k)], drop_dense=True)
    convert_model(_Block(lin))
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(2))
    y = lin(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (2, 16)
    torch.testing.assert_close(y.float(), lin(x), rtol=2e-2, atol=2e-2)


def test_layers_with_k_quant_segments_stay_exact_in_int8_mode():
    """Only Q4_0 / Q4_1 / Q8_0 have an integer kernel: a layer holding any other block type (even
    beside one of those) keeps its GGUF blocks and says which type kept it."""
    k = 256
    only_k = Linear(k, 8)
    only_k.set_quant([QuantizedWeight("Q4_K", random_gguf("Q4_K", 8, k, seed=6), k)], drop_dense=True)
    mixed = Linear(k, 12)
    mixed.set_quant([QuantizedWeight("Q4_0", random_gguf("Q4_0", 4, k, seed=7), k),
                     QuantizedWeight("Q6_K", random_gguf("Q6_K", 8, k, seed=8), k)], drop_dense=True)  # fmt: skip
    model = nn.Module()
    model.a, model.b = _Block(only_k), _Block(mixed)
    report = convert_model(model)
    assert report.converted == {}
    assert report.kept == {"a.proj": "Q4_K has no integer kernel", "b.proj": "Q6_K has no integer kernel"}
    assert only_k.int8 is None and mixed.int8 is None and mixed.quant is not None


def test_keep_exact_names_layers_by_a_dotted_suffix():
    """``keep_exact`` entries match a layer's whole name or its last dotted parts, not any text
    the name ends with."""
    k = 64

    def layer(seed: int) -> _Block:
        lin = Linear(k, 16)
        lin.set_quant([QuantizedWeight("Q4_1", random_gguf("Q4_1", 16, k, seed=seed), k)], drop_dense=True)
        return _Block(lin)

    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.down, model.mlp.xdown, model.up = layer(1), layer(2), layer(3)
    report = convert_model(model, keep_exact=("down.proj", "up"))
    assert report.kept == {"mlp.down.proj": "kept exact (keep_exact)"}
    assert sorted(report.converted) == ["mlp.xdown.proj", "up.proj"]
    assert model.mlp.down.proj.int8 is None and model.mlp.xdown.proj.int8 is not None


def test_a_quantized_embedding_returns_its_dtype():
    """A lookup gives the gguf package's rows, in the embedding's dtype."""
    data = random_gguf("Q4_1", 10, 64, seed=9)
    emb = QuantizedEmbedding(QuantizedWeight("Q4_1", data, 64), torch.bfloat16)
    ids = torch.tensor([[9, 0, 4]])
    rows = emb(ids)
    assert rows.dtype == torch.bfloat16 and rows.shape == (1, 3, 64)
    assert torch.equal(rows, gguf_ops.dequantize(data, "Q4_1", 64)[ids].to(torch.bfloat16))


def test_row_segments_of_types_with_the_same_row_width_are_not_merged():
    """F16 and BF16 rows take the same bytes: concatenated, each part keeps its own type."""
    rng = np.random.default_rng(10)
    a, b = (torch.from_numpy(rng.standard_normal((3, 40)).astype(np.float32)) for _ in range(2))
    f16 = QuantizedWeight("F16", a.half().view(torch.uint8), 40)
    bf16 = QuantizedWeight("BF16", b.bfloat16().view(torch.uint8), 40)
    fused = cat_rows([f16, bf16, f16])
    assert [s.qtype for s in fused] == ["F16", "BF16", "F16"]
    want = torch.cat([a.half().float(), b.bfloat16().float(), a.half().float()])
    assert torch.equal(dequantize(fused), want) and weight_shape(fused) == (9, 40)
    merged = cat_rows([f16, f16, bf16])
    assert [(s.qtype, s.out_features) for s in merged] == [("F16", 6), ("BF16", 3)]


@pytest.mark.parametrize("method,qtype", [("int8", "Q8_0"), ("int4", "Q4_1")])
def test_fused_checkpoint_linears_are_quantized(method, qtype):
    """Phi-3 style fused ``qkv_proj`` / ``gate_up_proj`` and MoE experts' weights are quantized
    (to the gguf package's blocks); embeddings, the LM head, norms and the router are not."""
    import gguf

    rng = np.random.default_rng(11)
    names = ["model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
             "model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight"]  # fmt: skip
    kept = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
            "model.layers.0.input_layernorm.weight"]  # fmt: skip
    state = {n: torch.from_numpy(rng.standard_normal((48, 64)).astype(np.float32)) for n in names + kept}
    state["model.layers.0.input_layernorm.weight"] = torch.ones(64)
    dense = dict(state)
    assert quantize_state(state, method) == len(names)
    for n in names:
        assert isinstance(state[n], QuantizedWeight) and state[n].qtype == qtype, n
        gtype = getattr(gguf.GGMLQuantizationType, qtype)
        want = gguf.quants.dequantize(gguf.quants.quantize(dense[n].numpy(), gtype), gtype)
        assert torch.equal(state[n].dequantize(), torch.from_numpy(want)), n
    assert all(state[n] is dense[n] for n in kept)


def test_a_linear_of_partial_blocks_is_a_clear_error():
    state = {"model.layers.0.mlp.up_proj.weight": torch.randn(8, 40)}
    for method in ("int8", "int4"):
        with pytest.raises(ValueError, match="up_proj.weight has 40 inputs, not a multiple of 32"):
            quantize_state(dict(state), method)


def test_available_memory_is_meminfos_figure_in_bytes():
    """/proc/meminfo gives MemAvailable in kB; the placement compares bytes. (The figure moves
    as other processes allocate: a factor of 2 either way still tells bytes from kB.)"""
    from pagedllm.quantization.placement import available_memory

    kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemAvailable:"))
    got = available_memory()
    assert kib * 512 <= got <= kib * 2048 and got % 1024 == 0


@pytest.mark.parametrize("native", [True, False])
def test_block_linear_takes_half_precision_activations(native):
    """``gguf_ops.linear`` computes in fp32 whatever x's dtype, on the native kernel and its twin."""
    data = random_gguf("Q4_K", 6, 256, seed=12)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    want = (x.double() @ gguf_ops.dequantize(data, "Q4_K", 256).double().T).float()
    if native:
        y = gguf_ops.linear(x, data, "Q4_K", 6)
    else:
        with ops.torch_only():
            y = gguf_ops.linear(x, data, "Q4_K", 6)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_a_dense_part_of_a_fused_layer_keeps_its_fp32_values():
    """A fused layer of a packed part and an fp32 part: the fp32 rows are kept exactly."""
    k = 64
    packed = QuantizedWeight("Q8_0", random_gguf("Q8_0", 4, k, seed=13), k)
    dense_part = torch.randn(3, k, generator=torch.Generator().manual_seed(4)) * 1e-3 + 1
    fused = cat_rows([packed, dense_part])
    assert [s.qtype for s in fused] == ["Q8_0", "F32"]
    want = torch.cat([gguf_ops.dequantize(packed.data, "Q8_0", k), dense_part])
    assert torch.equal(dequantize(fused), want)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(fused[1].linear(x), x @ dense_part.T, rtol=1e-5, atol=1e-5)
