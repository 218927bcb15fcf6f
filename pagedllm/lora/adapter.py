"""Read a PEFT LoRA adapter and check it against the base model, before anything uses it.

A PEFT adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, ...) and ``adapter_model.safetensors`` with, per adapted module,
``...layers.{i}.{self_attn|mlp}.{module}.lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r].
The module computes ``base(x) + (x @ A.T) @ B.T * scaling``, ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with rsLoRA).

Every problem is a ValueError naming the adapter and what is wrong: a missing directory or
file, an unsupported PEFT option (DoRA, biases, ``modules_to_save``, per-module rank or alpha
patterns), a rank above ``max_lora_rank``, a target the base model has no place for, a layer
it does not have, or a shape that does not fit the base's linear.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The decoder linears an adapter may target (Hugging Face names; Phi-3 ships q/k/v and gate/up
# fused, and PEFT adapters for it target the fused names).
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
SUPPORTED_TARGETS = ATTENTION_TARGETS + MLP_TARGETS

_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+?)"
    r"\.lora_([AB])(?:\.default)?\.weight$"
)


@dataclass(frozen=True)
class TargetShapes:
    """What the base model offers adapters: per module name its (in_features, out_features),
    and the number of layers. Modules missing here (e.g. the MLP of a mixture-of-experts
    layer) cannot be adapted."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]
    reason_missing: dict[str, str]  # module -> why the model cannot take it (for the error)


@dataclass
class LoRAAdapter:
    """A loaded, validated adapter: per (layer, module) its A [r, in] and B [out, r] in fp32,
    and the scaling of its delta."""

    request: LoRARequest
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * 4 + b.numel() * 4 for a, b in self.weights.values())


def _fail(req: LoRARequest, message: str) -> ValueError:
    return ValueError(f"LoRA adapter {req.lora_name!r} ({req.lora_path}): {message}")


def read_config(req: LoRARequest) -> dict:
    path = Path(req.lora_path)
    try:
        is_dir = path.is_dir()
        cfg_path = path / CONFIG_FILE
        has_config = is_dir and cfg_path.is_file()
    except (OSError, ValueError) as e:  # a path too long for the OS, a NUL byte, ...
        raise _fail(req, f"cannot open the adapter directory: {e}") from None
    if not is_dir:
        raise _fail(req, "no such adapter directory")
    if not has_config:
        raise _fail(req, f"no {CONFIG_FILE} (a PEFT LoRA adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(req, f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise _fail(req, f"{CONFIG_FILE} is not a JSON object")
    return config


def _check_config(req: LoRARequest, config: dict, max_rank: int) -> tuple[int, float, tuple[str, ...] | None]:
    """(rank, scaling, listed target modules or None for a regex) from a PEFT config."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _fail(req, f"peft_type is {peft_type!r}; only LORA adapters are supported")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _fail(req, f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _fail(req, f"rank {rank} exceeds max_lora_rank {max_rank} (raise --max-lora-rank)")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _fail(req, f"lora_alpha must be a finite number, got {alpha!r}")
    unsupported = {
        "use_dora": "DoRA (use_dora)",
        "fan_in_fan_out": "fan_in_fan_out weights",
        "lora_bias": "LoRA biases (lora_bias)",
        "modules_to_save": "fully trained extra modules (modules_to_save)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "layer_replication": "layer_replication",
        "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    }
    for key, what in unsupported.items():
        if config.get(key):
            raise _fail(req, f"{what} is not supported")
    if config.get("bias", "none") != "none":
        raise _fail(req, f"bias={config['bias']!r} is not supported (only 'none')")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        names = tuple(str(t).rsplit(".", 1)[-1] for t in targets)
        unknown = sorted(set(names) - set(SUPPORTED_TARGETS))
        if unknown:
            raise _fail(req, f"unknown target module(s) {', '.join(unknown)}; supported: {', '.join(SUPPORTED_TARGETS)}")
        return rank, scaling, names
    if targets is None or isinstance(targets, str):  # a regex (or absent): the tensors tell
        return rank, scaling, None
    raise _fail(req, f"target_modules must be a list or a string, got {type(targets).__name__}")


def load_adapter(req: LoRARequest, base: TargetShapes, max_rank: int) -> LoRAAdapter:
    """Read and validate the adapter at ``req.lora_path`` (ValueError on any problem)."""
    config = read_config(req)
    rank, scaling, listed = _check_config(req, config, max_rank)
    weights_path = Path(req.lora_path) / WEIGHTS_FILE
    if not weights_path.is_file():
        raise _fail(req, f"no {WEIGHTS_FILE}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as e:
        raise _fail(req, f"{WEIGHTS_FILE} cannot be read: {e}") from None
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise _fail(req, f"unexpected tensor {key!r}: only lora_A/lora_B of the decoder's linears are supported")
        layer, module, which = int(m.group(1)), m.group(3), m.group(4)
        if module not in SUPPORTED_TARGETS:
            raise _fail(req, f"unknown target module {module!r} ({key}); supported: {', '.join(SUPPORTED_TARGETS)}")
        if module not in base.shapes:
            raise _fail(req, f"target module {module!r}: {base.reason_missing.get(module, 'the base model has no such linear')}")
        if layer >= base.num_layers:
            raise _fail(req, f"{key} is for layer {layer}; the base model has {base.num_layers} layers")
        parts.setdefault((layer, module), {})[which] = tensor
    if not parts:
        raise _fail(req, f"{WEIGHTS_FILE} holds no LoRA weights")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise _fail(req, f"layer {layer} {module} has lora_{''.join(ab)} but not both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        in_features, out_features = base.shapes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise _fail(
                req,
                f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base's "
                f"{in_features} -> {out_features} linear at rank {rank} (expected ({rank}, {in_features}) and "
                f"({out_features}, {rank})): an adapter for another model?",
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise _fail(req, f"layer {layer} {module}: lora_A/lora_B must be floating point, got {a.dtype} and {b.dtype}")
        a, b = a.to(torch.float32).contiguous(), b.to(torch.float32).contiguous()
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            raise _fail(req, f"layer {layer} {module}: lora_A/lora_B hold NaN or infinite values")
        weights[(layer, module)] = (a, b)
    modules = {m for _, m in weights}
    for fused, alone in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if fused in modules and modules & set(alone):
            raise _fail(req, f"targets both {fused} and {', '.join(sorted(modules & set(alone)))}, which overlap")
    if listed is not None and not modules <= set(listed):
        raise _fail(req, f"weights for {', '.join(sorted(modules - set(listed)))} not listed in target_modules")
    return LoRAAdapter(req, rank, float(scaling), tuple(sorted(modules)), weights)
