"""Read a Hugging Face model directory (config.json + *.safetensors) into a ModelArch and state dict."""

from __future__ import annotations

import json
from typing import Any
from pathlib import Path

import torch

from pagedllm.model.arch import ModelArch


def read_hf_config(path: Path) -> tuple[dict[str, Any], ModelArch]:
    """config.json and the architecture it gives; a ValueError naming the file if either fails."""
    config_file = path / "config.json"
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"could not read {config_file}: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{config_file} must hold a JSON object, got {type(cfg).__name__}")
    try:
        return cfg, ModelArch.from_hf_config(cfg)
    except KeyError as e:
        raise ValueError(f"{config_file} lacks the field {e.args[0]!r}") from e
    except (TypeError, ValueError, AttributeError, OverflowError) as e:  # a field of the wrong type or value (null, "four", ...)
        raise ValueError(f"{config_file}: {e}") from e


def load_hf_dir(path: Path) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    cfg, arch = read_hf_config(path)
    config_file = path / "config.json"
    files = weight_files(path)
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for f in files:
        try:
            tensors = load_file(str(f))
        except Exception as e:  # safetensors raises its own error types on bad bytes
            raise ValueError(f"could not read weights file {f}: {e}") from e
        for name in tensors:
            if name in where:  # (a stale file beside the shards would silently win)
                raise ValueError(f"weight {name} is in both {where[name]} and {f.name}; keep one checkpoint in {path}")
            where[name] = f.name
        state.update(tensors)
    if cfg.get("tie_word_embeddings") is False and "lm_head.weight" not in state:
        raise ValueError(f"{config_file} says tie_word_embeddings is false, but the weights have no lm_head.weight")
    return arch, state


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: those model.safetensors.index.json names (a missing
    one is an error naming it), else every *.safetensors in the directory."""
    index = path / "model.safetensors.index.json"
    if not index.exists():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors weights in {path}")
        return files
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"could not read {index}: {e!r}") from e
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        raise ValueError(f"{index} names {missing[0]}, which is not in {path}")
    return [path / n for n in names]
