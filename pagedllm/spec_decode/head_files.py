"""Reading a trained drafting head: ``config.json`` + one safetensors file, checked for its method."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def read_head(path: Path, weights: str, method: str, what: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, state dict) of the ``method`` head at ``path``; a ValueError naming
    speculative_config.model if it is missing, unreadable or of another method."""
    from safetensors.torch import load_file

    try:
        config = json.loads((path / "config.json").read_text())
        state = load_file(str(path / weights))
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config.model: no {what} at {path} ({e})") from None
    if config.get("method") != method:
        raise ValueError(f"speculative_config.model: {path} holds {config.get('method')!r} heads, not {method}")
    return config, state
