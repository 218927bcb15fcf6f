"""The architecture description every supported model is reduced to.

GGUF metadata and Hugging Face ``config.json`` files name the same facts differently;
both loaders translate into this one dataclass so the model code reads a single shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Architectures pagedllm serves. The Llama implementation (model/llama.py) serves the first
# five: Mistral is Llama with a sliding window, Qwen2 adds a bias to the q/k/v projections,
# Qwen3 RMS-normalises each head's q and k, Phi-3 ships q/k/v and gate/up already fused.
# Gemma 3 (model/gemma3.py) differs more, Gemma 2 (model/gemma2.py) is Gemma 3 without q/k norms
# and with soft-capped logits; Qwen3-MoE (model/moe.py) is Qwen3 with a sparse
# mixture-of-experts MLP.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3_moe")
# Other names of the same architectures (Hugging Face model_type, GGUF general.architecture).
_ALIASES = {"gemma3_text": "gemma3", "qwen3moe": "qwen3_moe"}
SLIDING, FULL = "sliding_attention", "full_attention"
# Every n-th layer is global, the others slide, when a config predates ``layer_types``.
_SLIDING_PATTERNS = {"gemma2": 2, "gemma3": 6}


@dataclass
class ModelArch:
    """Shapes and constants of a decoder-only Llama-family transformer."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    # The Hugging Face ``rope_scaling`` dict (None, or {"rope_type": "llama3", ...}).
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # the gated MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    # Sliding-window attention: layer i attends only its last ``sliding_window`` positions when
    # ``layer_types[i]`` is "sliding_attention" (None: every layer is full attention).
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3), else rope_theta
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma), else head_dim
    # Mixture of experts (Qwen3-MoE): 0 experts means every MLP is dense. A sparse layer routes
    # each token to ``num_experts_per_tok`` of ``num_experts`` gated MLPs of width
    # ``moe_intermediate_size``; layers in ``mlp_only_layers``, and all but every
    # ``decoder_sparse_step``-th, keep a dense MLP of ``intermediate_size``.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # Soft-capping (Gemma 2): x -> cap * tanh(x / cap) on the attention scores (before the mask
    # and softmax) and on the final logits. None: no cap.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window is not None and self.layer_types is not None and self.layer_types[layer] == SLIDING

    def is_moe_layer(self, layer: int) -> bool:
        """Transformers' rule: sparse unless listed dense or off the ``decoder_sparse_step`` beat."""
        sparse_beat = (layer + 1) % self.decoder_sparse_step == 0
        return self.num_experts > 0 and layer not in self.mlp_only_layers and sparse_beat

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def __post_init__(self) -> None:
        self.architecture = _ALIASES.get(self.architecture, self.architecture)
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"pagedllm supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        sizes = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings")
        for name in sizes + (() if self.num_experts else ("intermediate_size",)):
            if getattr(self, name) < 1:  # (zero heads divided by zero, zero layers had no KV group)
                raise ValueError(f"the model's {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                    f"num_experts ({self.num_experts})"
                )
            if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
                raise ValueError(
                    f"moe_intermediate_size ({self.moe_intermediate_size}) and decoder_sparse_step "
                    f"({self.decoder_sparse_step}) must be positive"
                )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArch":
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout)."""
        archs = cfg.get("architectures") or []
        model_type = str(cfg.get("model_type", "")).lower()
        if not model_type and archs:
            model_type = archs[0].lower().removesuffix("forcausallm")
        model_type = _ALIASES.get(model_type, model_type)
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {model_type or archs!r}; "
                f"pagedllm supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        # transformers 5 writes ``rope_parameters`` (with rope_theta inside); 4.x writes
        # ``rope_theta`` and ``rope_scaling`` at the top level.
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_local_theta = None
        if FULL in rope_params:  # one RoPE per layer type (Gemma 3)
            local = rope_params.get(SLIDING) or {}
            local_type = local.get("rope_type", local.get("type", "default"))
            if local_type != "default":  # the sliding layers' RoPE is always plain here
                raise ValueError(f"unsupported rope_parameters.{SLIDING}.rope_type {local_type!r} "
                                 "(scaling is supported on the full-attention layers only)")  # fmt: skip
            rope_local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
            rope_params = dict(rope_params[FULL])
        elif cfg.get("rope_local_base_freq") is not None:
            rope_local_theta = float(cfg["rope_local_base_freq"])
        rope_theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        partial = float(rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported (RoPE over the whole head only)")
        scaling = cfg.get("rope_scaling") or rope_params or None
        if scaling is not None:
            scaling = dict(scaling)
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            scaling["rope_type"] = rope_type
            if rope_type == "default":
                scaling = None
            elif rope_type != "llama3":
                raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: llama3)")
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        num_layers = int(cfg["num_hidden_layers"])
        window = cfg.get("sliding_window")
        layer_types = cfg.get("layer_types")
        if not window or (model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window")):
            window, layer_types = None, None  # Qwen configs name a window they do not use
        elif layer_types is None and model_type in _SLIDING_PATTERNS:  # configs before transformers 4.5x
            pattern = int(cfg.get("sliding_window_pattern") or _SLIDING_PATTERNS[model_type])
            layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
        elif layer_types is None and model_type in ("qwen2", "qwen3"):  # configs before transformers 4.53
            first = int(cfg.get("max_window_layers", 28))  # transformers' rule: layers from this one slide
            layer_types = [SLIDING if i >= first else FULL for i in range(num_layers)]
            if SLIDING not in layer_types:
                window, layer_types = None, None
        elif layer_types is None:  # Mistral: every layer slides
            layer_types = [SLIDING] * num_layers
        if layer_types is not None and len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        moe: dict[str, Any] = {}
        if model_type == "qwen3_moe":
            # transformers 5 writes num_local_experts (num_experts is its attribute alias).
            num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
            moe = dict(
                num_experts=num_experts,
                num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0)) if num_experts else 0,
                moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0)) if num_experts else 0,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                mlp_only_layers=[int(i) for i in cfg.get("mlp_only_layers") or []],
            )
        gemma = model_type in ("gemma2", "gemma3")
        if gemma and cfg.get("use_bidirectional_attention"):
            raise ValueError(f"{model_type} with use_bidirectional_attention is not supported (causal only)")
        hidden_act = _activation(model_type, cfg)
        if cfg.get("attention_bias") and model_type != "qwen2":  # (Qwen2's biases are on q/k/v only, always)
            raise ValueError(f"attention_bias is not supported for {model_type} (biases on the q/k/v/o projections)")
        if cfg.get("mlp_bias"):
            raise ValueError(f"mlp_bias is not supported for {model_type} (biases on the MLP projections)")
        # Gemma 3 configs may still carry attn_logit_softcapping, but transformers' Gemma 3
        # attention never applies it (llama.cpp's converter asserts it is unset): nor do we.
        softcap = {
            k: float(cfg[k]) if gemma and cfg.get(k) is not None and (model_type, k) != ("gemma3", "attn_logit_softcapping") else None
            for k in ("attn_logit_softcapping", "final_logit_softcapping")
        }
        if model_type == "gemma3" and softcap["final_logit_softcapping"] is not None:
            raise ValueError("final_logit_softcapping is supported for gemma2 only")
        return cls(
            architecture=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // max(num_heads, 1)),  # (0 heads: refused below)
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=model_type in ("qwen3", "gemma3", "qwen3_moe"),
            hidden_act=hidden_act,
            sliding_window=int(window) if window else None,
            layer_types=list(layer_types) if layer_types is not None else None,
            rope_local_theta=rope_local_theta,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
            **softcap,
            **moe,
        )


# The gated MLP's activation by the names transformers' configs use (ACT2FN): ours are SiLU
# (SwiGLU) and GELU's tanh form (GeGLU; "gelu_new" is the same formula). Anything else, e.g.
# exact "gelu" or "relu", would run the wrong function: refused.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def _activation(model_type: str, cfg: dict[str, Any]) -> str:
    gemma = model_type in ("gemma2", "gemma3")
    # Gemma's configs name it hidden_activation (hidden_act is a legacy field they ignore).
    name = (cfg.get("hidden_activation") or "gelu_pytorch_tanh") if gemma else (cfg.get("hidden_act") or "silu")
    if name not in _ACTIVATIONS:
        field = "hidden_activation" if gemma else "hidden_act"
        raise ValueError(f"{field} {name!r} is not supported (supported: {', '.join(sorted(_ACTIVATIONS))})")
    return _ACTIVATIONS[name]
