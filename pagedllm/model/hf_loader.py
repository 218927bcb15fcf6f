"""Read a Hugging Face model directory (config.json + *.safetensors) into a ModelArch and state dict."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pagedllm.model.arch import ModelArch


def load_hf_dir(path: Path) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    config_file = path / "config.json"
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"could not read {config_file}: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{config_file} must hold a JSON object, got {type(cfg).__name__}")
    try:
        arch = ModelArch.from_hf_config(cfg)
    except KeyError as e:
        raise ValueError(f"{config_file} lacks the field {e.args[0]!r}") from e
    except (TypeError, ValueError, AttributeError) as e:  # a field of the wrong type or value (null, "four", ...)
        raise ValueError(f"{config_file}: {e}") from e
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error types on bad bytes
            raise ValueError(f"could not read weights file {f}: {e}") from e
    return arch, state
