"""Wire a KV connector (``kv_transfer_config``) into an engine's scheduler and runner."""

from __future__ import annotations

from pathlib import Path

from pagedllm.config import EngineConfig, cache_dir
from pagedllm.kernels import ops
from pagedllm.kv_connector.factory import KVConnector, make_kv_connector
from pagedllm.kv_connector.fingerprint import ModelFingerprint, weights_digest
from pagedllm.kv_connector.worker_side import block_layout
from pagedllm.runner.model_runner import ModelRunner
from pagedllm.scheduler.scheduler import Scheduler


def model_fingerprint(config: EngineConfig, weights_path: Path, runner: ModelRunner) -> ModelFingerprint:
    """Everything the bytes of a KV block depend on besides its tokens (fingerprint.py)."""
    weights = weights_digest(weights_path, cache_dir() / "weights_digests.json")
    return ModelFingerprint(
        weights=f"{weights}:{config.quantization or 'as-stored'}",
        dtype=str(config.torch_dtype).removeprefix("torch."),
        kv_cache_dtype=runner.kv_spec.name,
        block_size=config.block_size,
        block_layout=block_layout(runner.block_tensors()),
        activation_dtype=config.activation_dtype,
        attention_backend=runner.backend.name,
        kernels="native" if ops.native_available() else "torch",
    )


def attach_kv_connector(config: EngineConfig, weights_path: Path, scheduler: Scheduler, runner: ModelRunner) -> KVConnector | None:
    """The engine's connector, its two sides handed to the scheduler and the runner; None when
    ``kv_transfer_config`` is unset."""
    kv_config = config.kv_transfer_config
    if kv_config is None:
        return None
    groups = runner.layout.groups
    if len(groups) != 1 or groups[0].window is not None:
        raise ValueError("kv_transfer_config: models with sliding-window layers are not supported yet")
    block_bytes = sum(t[0].numel() * t.element_size() for t in runner.block_tensors())
    connector = make_kv_connector(kv_config, model_fingerprint(config, weights_path, runner), config.block_size, block_bytes)
    scheduler.kv_connector = connector.scheduler
    runner.kv_connector = connector.worker
    return connector
