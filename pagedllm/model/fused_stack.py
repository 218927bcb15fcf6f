"""The whole decoder stack of a step in one native call, and when it may stand in.

At a few tokens per step each layer is ten short kernels whose Python dispatch was a third of
a single-stream step; ``decoder_stack_f32`` runs the same kernels in the same order from C++
(tests compare it with the layer-by-layer path). It bypasses the attention backend and
``Linear``, so it may stand in for them only under the rule below, stated here and nowhere
else (``why_not``):

- every layer's four linears hold the form ``Linear`` itself would use for the step: GGUF
  blocks of a type the stack knows (Q4_1, Q8_0) up to ``PACKED_MAX_ROWS`` tokens, fp32 panels
  above (``big_steps``); or, in the fast modes (``activation_dtype="int8"/"int16"``), one
  segment of int8 panels (Q4_0, Q4_1, Q8_0) at every step size, all on the same activation bits;
- the native kernels are built and on (not inside ``ops.torch_only()``);
- the attention backend declares ``fused_decoder_stack`` (its attention is what the stack computes);
- no linear has a bias;
- the model computes in fp32 and every layer's KV cache is contiguous fp32, fp16 or bf16 (not
  the int8 / fp8 caches with scales);
- every layer's MLP is dense (the stack has no mixture-of-experts routing);
- no row of the step has a LoRA adapter (the deltas are added by ``Linear``, which the stack
  bypasses; a LoRA-enabled engine's steps of base-model requests alone still take the stack).

A feature that changes what a layer computes (tensor-parallel shards, a quantized KV cache,
...) must add its condition to ``why_not`` (or, when it changes per step, to ``get``); the
stack never silently skips it.
"""

from __future__ import annotations

import logging

import torch

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.attention.kv_cache_dtype import QuantizedKV, cache_parts
from pagedllm.kernels import ops
from pagedllm.kernels.build import load_kernels
from pagedllm.model.linear import PACKED_MAX_ROWS, packed_generation

logger = logging.getLogger("pagedllm.model")

# decoder_stack_f32's codes for a linear's weight form: GGUF group-blocks, fp32 panels, int8 panels.
_QTYPES = {"Q4_1": 0, "Q8_0": 1}
_PANELS = 2
_INT8_QTYPES = {"Q4_0": 3, "Q4_1": 4, "Q8_0": 5}
_KV_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # its codes for the caches' element


def _linears(layer) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def why_not(model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], big_steps: bool = False) -> str | None:
    """Why this model and cache cannot run as one native call (None: they can), for steps of up
    to ``PACKED_MAX_ROWS`` tokens or (``big_steps``) more. The per-step conditions (backend,
    ``torch_only``, LoRA rows) are checked by ``FusedDecoderStack.get``."""
    arch = model.arch
    if getattr(model, "tp_size", 1) > 1:  # set by distributed/tensor_parallel.install
        return "tensor parallel: the native stack has no all-reduce between its layers"
    if arch.num_experts:
        return f"{arch.architecture} has mixture-of-experts layers; the native stack runs dense MLPs only"
    if load_kernels() is None:
        return "the native kernels are not built"
    if (arch.qk_norm or arch.sliding_window is not None or arch.hidden_act != "silu" or arch.query_pre_attn_scalar
            or arch.attn_logit_softcapping):
        return (f"{arch.architecture} layers (q/k norms, sliding windows, GeGLU, Gemma's scale, soft-capped "
                "attention) are not in the native stack")
    if model.norm.weight.dtype != torch.float32:
        return f"the model computes in {model.norm.weight.dtype}"
    bits = set()
    for i, (layer, (kc, vc)) in enumerate(zip(model.layers, kv_caches)):
        for lin in _linears(layer):
            if lin.bias is not None:
                return f"layer {i} has a linear with a bias"
            if lin.int8 is not None:
                segments = lin.int8.segments
                if len(segments) != 1 or segments[0].qtype not in _INT8_QTYPES:
                    return f"layer {i} has an int8 linear of mixed or unknown block types ({lin.int8.qtypes})"
                bits.add(lin.int8.bits)
            elif big_steps and lin.panels is None:
                return f"layer {i} has a linear without fp32 panels (big steps run on them)"
            elif not big_steps and (lin.packed is None or lin.qtype not in _QTYPES):
                held = "+".join(s.qtype for s in lin.quant) if lin.quant else (lin.qtype or "no blocks")
                return f"layer {i} has a linear without GGUF blocks of a supported type ({held})"
        if isinstance(kc, QuantizedKV) or isinstance(vc, QuantizedKV):
            return f"layer {i}'s KV cache is quantised ({kc.dtype}), not contiguous fp32 / fp16 / bf16"
        contiguous = kc.is_contiguous() and vc.is_contiguous()
        if kc.dtype not in _KV_DTYPES or vc.dtype != kc.dtype or not contiguous:
            return f"layer {i}'s KV cache is {kc.dtype}, not contiguous fp32 / fp16 / bf16"
        if kc.dtype != kv_caches[0][0].dtype:
            return f"layer {i}'s KV cache is {kc.dtype}, layer 0's {kv_caches[0][0].dtype}"
    if len(bits) > 1:
        return f"the linears take integer activations of different widths ({sorted(bits)} bits)"
    return None


def _form(lin, big_steps: bool) -> tuple[int, torch.Tensor]:
    """(decoder_stack_f32's code, weight tensor) of the form ``Linear`` runs this step size on."""
    if lin.int8 is not None:
        segment = lin.int8.segments[0]
        return _INT8_QTYPES[segment.qtype], segment.panels
    return (_PANELS, lin.panels) if big_steps else (_QTYPES[lin.qtype], lin.packed)


class FusedDecoderStack:
    """Decides per step whether the one-call stack runs, and keeps its two plans (small and big
    steps: the captured pointers), rebuilt when the weights or the KV caches they captured change."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._plans: dict[bool, _NativePlan | None] = {}  # big_steps -> plan

    @staticmethod
    def _key_of(kv_caches) -> tuple:
        """What the plans captured: the linears' GGUF blocks and panels (through their generation
        counter) and the KV caches. Cheap, since it runs every step."""
        first, last = cache_parts(kv_caches[0][0])[0], cache_parts(kv_caches[-1][1])[0]
        return packed_generation(), first.data_ptr(), last.data_ptr(), len(kv_caches)

    def get(self, model, backend: AttentionBackend, kv_caches, num_tokens: int, lora=None) -> "_NativePlan | None":
        """The plan to run this step with, or None. ``lora``: the model's LoRA context, if any
        (its ``mapping`` is set when some row of the step has an adapter)."""
        if not backend.fused_decoder_stack or not ops.enabled():
            return None
        if lora is not None and lora.mapping is not None:
            return None
        key = self._key_of(kv_caches)
        if key != self._key:
            for big in (False, True):
                reason = why_not(model, kv_caches, big)
                self._plans[big] = _NativePlan.build(model, kv_caches, big) if reason is None else None
                logger.debug("one-call decoder stack, %s steps: %s", "big" if big else "small",
                             "on" if reason is None else f"off ({reason})")  # fmt: skip
            self._key = key
        return self._plans[num_tokens > PACKED_MAX_ROWS]


class _NativePlan:
    """The pointers of one model's weights and KV caches, laid out for ``decoder_stack_f32``."""

    def __init__(self, model, ptrs: torch.Tensor, qtypes: torch.Tensor, keep: list, num_blocks: int,
                 kv_dtype: int, act_bits: int):  # fmt: skip
        self.model, self.ptrs, self.qtypes, self._keep, self.num_blocks = model, ptrs, qtypes, keep, num_blocks
        self.kv_dtype, self.act_bits = kv_dtype, act_bits

    @classmethod
    def build(cls, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], big_steps: bool) -> "_NativePlan":
        """Small steps' plan points at the GGUF blocks, big steps' at the fp32 panels (the forms
        ``Linear`` uses for such steps; both give a row the same bits); int8 linears at their
        panels in both."""
        rows, qtypes, keep, bits = [], [], [], 8
        for layer, (kc, vc) in zip(model.layers, kv_caches):
            linears = _linears(layer)
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            forms = [_form(lin, big_steps) for lin in linears]
            tensors = (*norms, *(w for _, w in forms), kc, vc)
            keep += tensors
            rows.append([t.data_ptr() for t in tensors])
            qtypes.append([code for code, _ in forms])
            bits = next((lin.int8.bits for lin in linears if lin.int8 is not None), bits)
        rows_t, qtypes_t = torch.tensor(rows, dtype=torch.int64), torch.tensor(qtypes, dtype=torch.int32)
        kv = kv_caches[0][0]
        return cls(model, rows_t, qtypes_t, keep, kv.shape[0], _KV_DTYPES[kv.dtype], bits)

    def run(self, residual: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        m, arch = self.model, self.model.arch
        out = torch.empty_like(residual)
        tables = meta.block_tables.contiguous()
        seq_lens, qsl = meta.seq_lens.contiguous(), meta.query_start_loc.contiguous()
        slots, positions = meta.slot_mapping.contiguous(), positions.contiguous()
        status = load_kernels().decoder_stack_f32(
            out.data_ptr(), residual.data_ptr(), self.ptrs.data_ptr(), self.qtypes.data_ptr(), arch.num_layers,
            m.norm.weight.data_ptr(), m.norm.eps, residual.shape[0], arch.hidden_size, arch.num_heads,
            arch.num_kv_heads, arch.head_dim, arch.intermediate_size, positions.data_ptr(), m.rope.cos.data_ptr(),
            m.rope.sin.data_ptr(), m.rope.cos.shape[0], slots.data_ptr(), tables.data_ptr(), tables.stride(0),
            seq_lens.data_ptr(), qsl.data_ptr(), meta.num_seqs, meta.block_size, self.num_blocks,
            m.layers[0].self_attn.scale, self.kv_dtype, self.act_bits, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            why = "an unknown block type or KV dtype" if status == 1 else "the int8 GEMM refused a weight"
            raise RuntimeError(f"decoder_stack_f32 refused its arguments (status {status}: {why})")
        return out
