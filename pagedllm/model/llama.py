"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3) over a flattened token batch.

Every step runs all scheduled tokens of all requests as one [num_tokens, hidden] matrix with
per-token positions; attention goes through the backend, which reads and writes the paged
KV cache. q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.config import matmul_dtype
from pagedllm.kernels import ops
from pagedllm.model.arch import ModelArch
from pagedllm.model.fused_stack import FusedDecoderStack
from pagedllm.model.linear import Linear
from pagedllm.model.rope import RotaryEmbedding
from pagedllm.quantization.weights import QuantizedEmbedding, QuantizedWeight, cat_rows, is_quantized, segments, weight_shape


# Block types with the tuned grouped small-batch kernel (kernels/reference.py: group_blocks).
GROUPED_TYPES = ("Q4_1", "Q8_0")


def per_layer(meta: AttentionMetadata | list[AttentionMetadata], num_layers: int) -> list[AttentionMetadata] | None:
    """The per-layer metadata list, or None when one metadata serves every layer."""
    if isinstance(meta, AttentionMetadata):
        return None
    if len(meta) != num_layers:
        raise ValueError(f"{len(meta)} attention metadata for {num_layers} layers")
    return meta


class RMSNorm(nn.Module):
    """RMS norm computed in fp32, cast back before the weight (as transformers does).

    With ``residual`` it first adds x into the residual stream (in place) and normalises
    that: the add and the norm of every layer boundary are one fused op.
    """

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch, layer: int = 0):
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=False)
        self.scale = arch.attention_scale
        self.window = arch.sliding_window if arch.is_sliding(layer) else None
        # Gemma 2 soft-caps the scores; passed only when set, so a backend without the option
        # still serves every other model.
        self.backend_kwargs = {"softcap": arch.attn_logit_softcapping} if arch.attn_logit_softcapping else {}
        # Qwen3 / Gemma 3: each head's q and k are RMS-normalised before RoPE.
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj.forward(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm.forward(q.reshape(-1, self.head_dim)).view(n, self.num_heads, self.head_dim)
            k = self.k_norm.forward(k.reshape(-1, self.head_dim)).view(n, self.num_kv_heads, self.head_dim)
        rope.forward(positions, q, k)
        kc, vc = kv_cache
        out = backend.forward(q, k, v, kc, vc, meta, self.scale, self.window, **self.backend_kwargs)
        return self.o_proj.forward(out.view(n, self.q_size))


class LlamaMLP(nn.Module):
    """Gated MLP: SwiGLU (silu), or GeGLU (tanh-approximated gelu) for Gemma.

    ``intermediate_size`` overrides the model's (a mixture-of-experts expert is narrower).
    """

    def __init__(self, arch: ModelArch, intermediate_size: int | None = None):
        super().__init__()
        self.intermediate_size = intermediate_size or arch.intermediate_size
        self.gelu = arch.hidden_act == "gelu_tanh"
        self.gate_up_proj = Linear(arch.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = Linear(self.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        if self.gelu:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj.forward(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj.forward(ops.silu_and_mul(gate_up))

    def packed_targets(self, prefix: str) -> list[tuple[Linear, list[str]]]:
        """This MLP's linears and the Hugging Face weight names each is the concatenation of
        (gate/up either stored fused, as Phi-3's, or apart)."""
        return [
            (self.gate_up_proj, [f"{prefix}gate_up_proj.weight"]),
            (self.gate_up_proj, [f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight"]),
            (self.down_proj, [f"{prefix}down_proj.weight"]),
        ]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch, layer)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = LlamaMLP(arch)


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head; ``forward`` returns hidden states, ``compute_logits`` fp32 logits."""

    layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, arch: ModelArch, max_positions: int, rope_freqs: torch.Tensor | None = None):
        super().__init__()
        self.arch = arch
        # Given a weight, nn.Embedding skips its random init (whose first call imports torch._dynamo:
        # 2.7 s of startup); the checkpoint's weight replaces it.
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, _weight=torch.empty(arch.vocab_size, arch.hidden_size))
        self.layers = nn.ModuleList(self.layer_cls(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        with torch.device("cpu"):  # real tables even when the weights are built on "meta"
            self.rope = RotaryEmbedding(arch, max_positions, rope_freqs)
            # Gemma 3's sliding layers use another RoPE base (and no scaling).
            self.rope_local = None
            if arch.rope_local_theta is not None:
                self.rope_local = RotaryEmbedding(replace(arch, rope_theta=arch.rope_local_theta, rope_scaling=None), max_positions)
        self.layer_ropes = [self.rope_local if self.rope_local is not None and arch.is_sliding(i) else self.rope
                            for i in range(arch.num_layers)]  # fmt: skip
        self.requires_grad_(False)
        self.fused_stack = FusedDecoderStack()  # the one-call decoder for small steps, when eligible
        # LoRA-enabled engines: the step's adapter row mapping, read by the adapted linears
        # (pagedllm/lora/slots.py: LoRAContext, set by the runner each step).
        self.lora_context = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        meta: AttentionMetadata | list[AttentionMetadata],
    ) -> torch.Tensor:
        """``meta``: the step's metadata, or one per layer (its KV-cache group's block tables,
        when sliding layers have groups of their own: kv_cache/groups.py)."""
        # The residual stream; each norm adds the previous sublayer's output into it first.
        # (forward() directly, as for every submodule below: see the comment there.)
        residual = self.embed_tokens.forward(input_ids)
        metas = per_layer(meta, len(self.layers))
        if metas is None:
            stack = self.fused_stack.get(self, backend, kv_caches, input_ids.shape[0], self.lora_context)
            if stack is not None:
                return stack.run(residual.contiguous(), positions, meta)
        # Submodules' forward() is called directly: at one token per step nn.Module's call
        # machinery was a tenth of the step.
        x = self.layers[0].input_layernorm.forward(residual)
        num_layers = len(self.layers)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            m = meta if metas is None else metas[i]
            x = layer.self_attn.forward(x, positions, self.layer_ropes[i], kv_cache, backend, m)
            x = layer.post_attention_layernorm.forward(x, residual)
            x = layer.mlp.forward(x)
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < num_layers else self.norm
            x = next_norm.forward(x, residual)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits: a bf16 model's LM head keeps fp32 weights (see ``from_hf_state_dict``)."""
        return self.lm_head.forward(hidden.to(self.lm_head.compute_dtype)).float()

    def pack_dense(self) -> int:
        """Give every fp32 linear its panels for the native dense GEMM; returns how many."""
        tied = self.lm_head.weight is not None and self.lm_head.weight is getattr(self.embed_tokens, "weight", None)
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        return sum(m.pack_dense(keep_weight=tied and m is self.lm_head) for m in linears)

    @classmethod
    def from_hf_state_dict(
        cls, arch: ModelArch, state: dict[str, torch.Tensor], dtype: torch.dtype, max_positions: int
    ) -> "LlamaForCausalLM":
        """Build the model from Hugging Face-named weights, fusing q/k/v and gate/up.

        Parameters are created on the meta device and replaced by the loaded tensors, so no
        time goes into random initialisation. A weight may come as a ``QuantizedWeight``
        (GGUF blocks kept packed): its linear layer then keeps the blocks, a fused layer
        their row segments (not copied), and the embedding table looks rows up in them.
        """
        state = dict(state)
        cat = lambda parts: cat_rows(parts, merge=False)  # noqa: E731 (segments keep the file's pages)
        rope_freqs = state.pop("rope_freqs", None)
        own: dict[str, torch.Tensor] = {}
        try:
            for i in range(arch.num_layers):
                p = f"model.layers.{i}."
                for kind in ("weight", "bias"):
                    names = [f"{p}self_attn.{x}_proj.{kind}" for x in "qkv"]
                    if all(n in state for n in names):
                        own[f"layers.{i}.self_attn.qkv_proj.{kind}"] = cat([state.pop(n) for n in names])
                cls.take_mlp_weights(arch, i, state, own)
        except KeyError as e:
            raise ValueError(f"model weights are missing {e.args[0]}") from e
        except RuntimeError as e:  # q/k/v or gate/up whose shapes cannot be fused: not this config's
            raise ValueError(f"layer {i}'s weights do not have the shapes the config gives ({e})") from e
        for name, tensor in state.items():
            if name.startswith("model.") and "rotary_emb" not in name:
                own[name.removeprefix("model.")] = tensor
            elif name == "lm_head.weight" and not arch.tie_word_embeddings:
                own[name] = tensor
        with torch.device("meta"):
            model = cls(arch, max_positions, rope_freqs)
        params = dict(model.named_parameters())
        if "lm_head.weight" not in own:
            own["lm_head.weight"] = own.get("embed_tokens.weight")  # tied embeddings
        missing = sorted(k for k in params if own.get(k) is None)
        if missing:
            raise ValueError(f"model weights are missing {missing[:5]}")
        unexpected = sorted(own.keys() - params.keys())
        if unexpected:
            raise ValueError(f"unexpected model weights {unexpected[:5]}")
        for name, tensor in own.items():
            if params[name].shape != weight_shape(tensor):
                raise ValueError(
                    f"weight {name} has shape {tuple(weight_shape(tensor))}, expected {tuple(params[name].shape)}"
                )
        quantized = {k: v for k, v in own.items() if is_quantized(v)}
        dense = {k: v.to(dtype).contiguous() for k, v in own.items() if k not in quantized}
        model.load_state_dict(dense, strict=False, assign=True)
        modules = dict(model.named_modules())
        for name, weight in quantized.items():
            owner = modules[name.removesuffix(".weight")]
            if owner is model.embed_tokens:
                model.embed_tokens = QuantizedEmbedding(weight, dtype)
            else:
                owner.set_quant(segments(weight), drop_dense=True)
        if arch.tie_word_embeddings:
            if isinstance(model.embed_tokens, QuantizedEmbedding):
                model.lm_head.set_quant([model.embed_tokens.qweight], drop_dense=True)
            else:
                model.lm_head.weight = model.embed_tokens.weight
        if dtype != torch.float32:
            # Logits in fp32 (bf16 keeps ~3 digits: near-ties would flip on rounding), and the
            # linears in the matmul dtype; both hold the same bf16 values.
            if model.lm_head.weight is not None:
                model.lm_head.weight = nn.Parameter(model.lm_head.weight.float(), requires_grad=False)
            wide = matmul_dtype(dtype)
            for module in model.layers.modules():
                if isinstance(module, Linear) and module.weight is not None:
                    module.weight = nn.Parameter(module.weight.to(wide), requires_grad=False)
        return model

    @classmethod
    def take_mlp_weights(
        cls, arch: ModelArch, layer: int, state: dict[str, torch.Tensor], own: dict[str, torch.Tensor]
    ) -> None:
        """Move layer ``layer``'s MLP weights that need fusing from ``state`` (Hugging Face
        names) into ``own`` (our names); what is left is renamed by dropping ``model.``."""
        p = f"model.layers.{layer}.mlp."
        if f"{p}gate_up_proj.weight" in state:  # Phi-3 ships it fused ([gate; up], as ours)
            return
        own[f"layers.{layer}.mlp.gate_up_proj.weight"] = cat_rows(
            [state.pop(f"{p}gate_proj.weight"), state.pop(f"{p}up_proj.weight")], merge=False
        )

    def attach_packed(self, packed: dict[str, tuple[str, torch.Tensor]]) -> int:
        """Give the linear layers their GGUF blocks (Hugging Face names -> (type, [rows, bytes]))
        for small batches, beside their dense weights.

        Q4_1 / Q8_0 layers (fused parts all of that type) get the grouped layout of the tuned
        kernel; any other mix becomes row segments for ``kernels/gguf_ops.py``. A layer may be
        listed under several namings (Phi-3 stores q/k/v and gate/up fused): the first found
        serves. Returns how many layers got blocks.
        """
        def parts(names: list[str], in_features: int) -> list[QuantizedWeight] | None:
            found = [packed.get(n) for n in names]
            if any(f is None for f in found):
                return None
            return segments(cat_rows([QuantizedWeight(q, blocks, in_features) for q, blocks in found]))

        targets: list[tuple[Linear, list[str]]] = []
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp  # a dense MLP or a mixture of experts
            if attn.qkv_proj.bias is None:
                targets.append((attn.qkv_proj, [f"{p}self_attn.qkv_proj.weight"]))
                targets.append((attn.qkv_proj, [f"{p}self_attn.{x}_proj.weight" for x in "qkv"]))
            targets.append((attn.o_proj, [f"{p}self_attn.o_proj.weight"]))
            targets += mlp.packed_targets(f"{p}mlp.")
        head = "model.embed_tokens.weight" if self.arch.tie_word_embeddings else "lm_head.weight"
        targets.append((self.lm_head, [head]))
        done: set[int] = set()
        for linear, names in targets:
            found = None if id(linear) in done else parts(names, linear.in_features)
            if found is None:
                continue
            done.add(id(linear))
            if len(found) == 1 and found[0].qtype in GROUPED_TYPES:  # the tuned grouped kernel
                linear.set_packed(found[0].data, found[0].qtype)
            else:
                linear.set_quant(found)
        # The embedding looks its rows up in the blocks (the same values): its fp32 table was
        # only kept for them, and a tied LM head's panels then stand alone (~113 MB for SmolLM2).
        table = packed.get("model.embed_tokens.weight")
        if table is not None and isinstance(self.embed_tokens, nn.Embedding):
            qweight = QuantizedWeight(table[0], table[1], self.embed_tokens.embedding_dim)
            self.embed_tokens = QuantizedEmbedding(qweight, self.embed_tokens.weight.dtype)
        return len(done)
