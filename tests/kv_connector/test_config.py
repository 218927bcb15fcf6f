"""kv_transfer_config: vLLM's shape, validated up front with the field named."""

from __future__ import annotations

import pytest

from pagedllm.config import EngineConfig, KVTransferConfig
from pagedllm.entrypoints.cli import add_engine_args, engine_config_from_args


def test_parse_json_and_dict(tmp_path):
    cfg = KVTransferConfig.parse(f'{{"kv_connector": "disk", "kv_role": "kv_producer", "path": "{tmp_path}", "max_bytes": 1000}}')
    assert cfg == KVTransferConfig(kv_connector="disk", kv_role="kv_producer", path=str(tmp_path), max_bytes=1000)
    assert cfg.saves and not cfg.loads and cfg.holds_outputs
    both = KVTransferConfig.parse({"path": str(tmp_path)})
    assert both.saves and both.loads and not both.holds_outputs
    consumer = KVTransferConfig(kv_role="kv_consumer", path="x")
    assert consumer.loads and not consumer.saves and not consumer.holds_outputs
    assert KVTransferConfig.parse(None) is None


@pytest.mark.parametrize(
    "value, field",
    [
        ({"kv_connector": "nixl", "path": "x"}, "kv_transfer_config.kv_connector"),
        ({"kv_role": "kv_reader", "path": "x"}, "kv_transfer_config.kv_role"),
        ({}, "kv_transfer_config.path"),
        ({"path": "x", "max_bytes": 0}, "kv_transfer_config.max_bytes"),
        ({"path": "x", "max_bytes": "1G"}, "kv_transfer_config.max_bytes"),
        ({"path": "x", "wait_for_save": "yes"}, "kv_transfer_config.wait_for_save"),
        ({"path": "x", "bogus": 1}, "kv_transfer_config: unknown key(s) bogus"),
        ("{not json", "kv_transfer_config is not valid JSON"),
        ("[1]", "kv_transfer_config must be a JSON object"),
    ],
)
def test_bad_values_name_the_field(value, field):
    with pytest.raises(ValueError) as e:
        EngineConfig(kv_transfer_config=value)
    assert str(e.value).startswith(field)


def test_swap_preemption_is_refused():
    with pytest.raises(ValueError, match="kv_transfer_config needs preemption_mode='recompute'"):
        EngineConfig(kv_transfer_config={"path": "x"}, preemption_mode="swap")


def test_cli_flag(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-transfer-config", f'{{"kv_connector": "disk", "path": "{tmp_path}"}}'])
    assert engine_config_from_args(args).kv_transfer_config == KVTransferConfig(path=str(tmp_path))


@pytest.mark.parametrize("model_type, overrides", [
    ("mistral", dict(sliding_window=32)),  # every layer sliding
    ("gemma3_text", dict(head_dim=16, num_hidden_layers=6, sliding_window=6, query_pre_attn_scalar=24)),  # hybrid
])  # fmt: skip
def test_sliding_window_models_are_refused(tmp_path, model_type, overrides):
    """The connector loads and saves one table's blocks for every layer, and a request's first
    step would take blocks for every external token in a sliding group, past what admission
    allows (a probe left such a request waiting forever with the refusal bypassed): until both
    are per group, these models are refused when the engine is built."""
    from pagedllm.engine.llm_engine import LLMEngine
    from tests.conftest import save_tiny_model

    path = save_tiny_model(tmp_path / model_type, model_type, **overrides)
    config = EngineConfig(model=str(path), num_kv_blocks=32,
                          kv_transfer_config={"kv_connector": "disk", "kv_role": "kv_both", "path": str(tmp_path / "kv")})  # fmt: skip
    with pytest.raises(ValueError, match="kv_transfer_config: models with sliding-window layers are not supported"):
        LLMEngine(config, log_stats_interval=0)


def test_the_weights_digest_is_by_content_and_its_cache_notices_a_rewrite(tmp_path):
    """The digest names the weights' bytes (two copies agree), and the cache of digests is keyed
    by size and mtime too: weights rewritten in place at the same size must get a new digest,
    else the engine would load KV blocks another model computed."""
    import os

    from pagedllm.kv_connector.fingerprint import weights_digest

    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    a, b, cache = tmp_path / "one" / "m.gguf", tmp_path / "two" / "m.gguf", tmp_path / "digests.json"
    a.write_bytes(b"weights v1")
    b.write_bytes(b"weights v1")
    first = weights_digest(a, cache)
    assert weights_digest(b) == first and weights_digest(a, cache) == first  # (the second from the cache)
    stat = a.stat()
    a.write_bytes(b"weights v2")  # same size
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert weights_digest(a, cache) == weights_digest(a) != first
