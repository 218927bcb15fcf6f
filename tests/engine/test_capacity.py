"""``pagedllm estimate`` (engine/capacity.py) against what an engine really allocates."""

from __future__ import annotations

import json

import pytest

from pagedllm.attention.kv_cache_dtype import cache_parts
from pagedllm.config import EngineConfig
from pagedllm.engine.capacity import estimate
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.cli import main
from pagedllm.model.linear import Linear
from pagedllm.quantization.weights import QuantizedEmbedding
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


def held_weight_bytes(model) -> int:
    """Bytes of every distinct storage the model's weights live in (all forms a layer keeps)."""
    storages: dict[int, int] = {}

    def add(t) -> None:
        if t is not None:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()

    for t in [*model.parameters(), *model.buffers()]:
        add(t)
    for m in model.modules():
        if isinstance(m, Linear):
            add(m.panels)
            add(m.packed)
            for q in m.quant or ():
                add(q.data)
        elif isinstance(m, QuantizedEmbedding):
            add(m.qweight.data)
    return sum(storages.values())


def kv_pool_bytes(engine: LLMEngine) -> int:
    return sum(t.nbytes for k, v in engine.runner.slot_caches for pool in (k, v) for t in cache_parts(pool))


def check_against_engine(config: EngineConfig) -> None:
    report = estimate(config)
    engine = LLMEngine(config, log_stats_interval=0)
    kv = report.kv
    assert kv.num_blocks == engine.kv_cache_manager.num_blocks
    assert kv.pool_bytes == kv_pool_bytes(engine)
    assert kv.num_tokens == engine.kv_cache_manager.num_blocks * config.block_size
    assert kv.max_model_len == engine.max_model_len
    assert report.weights.total == held_weight_bytes(engine.runner.model)
    # The longest context is the scheduler's own limit: one token more is refused.
    sched = engine.scheduler
    longest = kv.longest_context
    ok = Request("ok", None, [1] * (longest - 1), SamplingParams(max_tokens=1), frozenset())
    sched.check_request(ok)
    if longest < engine.max_model_len:
        too_long = Request("no", None, [1] * longest, SamplingParams(max_tokens=1), frozenset())
        with pytest.raises(ValueError, match="KV blocks"):
            sched.check_request(too_long)
    # Concurrency: that many requests of context_len hold at most the pool.
    per_request = engine.kv_cache_manager.max_blocks_held(kv.context_len, engine.scheduler.config.max_request_tokens)
    assert kv.max_concurrency == engine.kv_cache_manager.num_blocks // per_request


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_kv_blocks=37, block_size=8, max_model_len=512),
        dict(kv_cache_space=0.001, kv_cache_dtype="int8", max_model_len=256),
        dict(kv_cache_space=0.002, quantization="int8", dense_weights="no"),
        dict(num_kv_blocks=64, dtype="bfloat16", quantization="int4"),
    ],
    ids=["blocks", "space-int8kv", "int8-no-dense", "bf16-int4"],
)
def test_estimate_equals_tiny_engine(tiny_llama, kwargs):
    check_against_engine(EngineConfig(model=str(tiny_llama), **kwargs))


def test_estimate_sliding_window_model(tmp_path):
    from tests.conftest import save_tiny_model

    path = save_tiny_model(tmp_path / "mistral", "mistral", sliding_window=32)
    check_against_engine(EngineConfig(model=str(path), num_kv_blocks=40, block_size=8, max_num_batched_tokens=64))


def test_estimate_gemma3_layers_in_groups(tmp_path):
    """Gemma 3's 5 sliding + 1 full layers form 6 KV groups of one layer: a token takes a slot in
    each, so the pool holds blocks x block size / 6 tokens at every layer's K and V per token,
    and the weights include the local-RoPE tables (the estimate was off by the group count)."""
    from tests.conftest import save_tiny_model

    path = save_tiny_model(tmp_path / "g3", "gemma3_text", num_hidden_layers=6, sliding_window=16)
    config = EngineConfig(model=str(path), num_kv_blocks=40, block_size=8)
    report = estimate(config)
    engine = LLMEngine(config, log_stats_interval=0)
    assert engine.kv_cache_manager.num_groups == 6
    assert report.kv.num_tokens == 40 * 8 // 6
    assert report.kv.bytes_per_token == 2 * 6 * 2 * 256 * 4  # K and V x layers x KV heads x head_dim x fp32
    assert report.kv.pool_bytes == kv_pool_bytes(engine)
    assert report.weights.total == held_weight_bytes(engine.runner.model)


def test_estimate_cli_json(tiny_llama, capsys):
    assert main(["estimate", "--model", str(tiny_llama), "--num-kv-blocks", "100", "--block-size", "16",
                 "--max-model-len", "512", "--context-len", "300", "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    kv = out["kv_cache"]
    # tiny llama: 2 layers x 2 KV heads x head_dim 16, K and V in fp32
    assert kv["bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert kv["num_blocks"] == 100 and kv["num_tokens"] == 1600
    assert kv["blocks_per_request"] == 19 and kv["max_concurrency"] == 100 // 19
    assert kv["longest_context"] == 512
    assert out["data_parallel_size"] == 1
    # Data parallel replicas each hold the weights and the pool (the flag was ignored).
    assert main(["estimate", "--model", str(tiny_llama), "--num-kv-blocks", "100", "--block-size", "16",
                 "--max-model-len", "512", "--context-len", "300", "--json", "--data-parallel-size", "3"]) == 0  # fmt: skip
    dp = json.loads(capsys.readouterr().out)
    assert dp["max_concurrency_all_replicas"] == 3 * kv["max_concurrency"]
    assert dp["total_bytes_all_replicas"] == 3 * (out["weights"]["total_bytes"] + kv["pool_bytes"])


def test_estimate_cli_text_and_bad_input(tiny_llama, capsys):
    assert main(["estimate", "--model", str(tiny_llama), "--num-kv-blocks", "10", "--block-size", "16"]) == 0
    text = capsys.readouterr().out
    assert "longest context: 160 tokens (limited by the KV pool)" in text
    assert "max concurrent requests at 512 tokens each: 0" in text
    assert main(["estimate", "--model", str(tiny_llama), "--context-len", "0"]) == 2
    assert "context_len" in capsys.readouterr().err
    assert main(["estimate", "--model", str(tiny_llama), "--max-model-len", "512", "--context-len", "513"]) == 2
    assert "context_len (513) must be at most max_model_len (512)" in capsys.readouterr().err
    assert main(["estimate", "--model", str(tiny_llama), "--max-model-len", "100000"]) == 2
    capsys.readouterr()
    # A split the engine refuses is refused here too (an adversarial session saw a report for it).
    assert main(["estimate", "--model", str(tiny_llama), "-tp", "3"]) == 2
    assert "tensor_parallel_size (3) must divide or be a multiple of the model's 2 KV heads" in capsys.readouterr().err
    # ... and so is a --generation-config directory without the file (it printed a report, exit 0)
    assert main(["estimate", "--model", str(tiny_llama), "--generation-config", str(tiny_llama / "nowhere")]) == 2
    assert "no generation_config.json" in capsys.readouterr().err
    # The engine's refusal of quantization= on a GGUF file (already quantized), the default model's.
    assert main(["estimate", "--quantization", "int8"]) == 2
    assert "already quantized" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["config a list", "heads null", "huge header", "pool beyond memory"])
def test_estimate_refuses_damaged_checkpoints_as_the_engine_does(tmp_path, capsys, damage):
    """An adversarial session got raw tracebacks (AttributeError, TypeError, MemoryError) from
    estimate where LLM() and serve give one-line errors."""
    import struct

    from tests.conftest import save_tiny_model

    path = save_tiny_model(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    args = ["estimate", "--model", str(path)]
    if damage == "config a list":
        (path / "config.json").write_text(json.dumps([cfg]))
    elif damage == "heads null":
        (path / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": None}))
    elif damage == "huge header":
        (path / "model.safetensors").write_bytes(struct.pack("<Q", 2**62) + b"{}")
    else:
        args += ["--kv-cache-space", "1000000"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip()


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [dict(kv_cache_space=0.5), dict(num_kv_blocks=300, dense_weights="no", max_model_len=2048)])
def test_estimate_equals_default_model_engine(kwargs):
    check_against_engine(EngineConfig(**kwargs))


# ------------------------------------------------------------------ beside the model
def test_estimate_counts_lora_slots_panels_and_adapters(tiny_llama):
    """LoRA's slot table, the panels a slot's first step packs, and the adapters kept loaded
    (worst case: every module at the largest rank) are in the report, as the engine holds them."""
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=32, enable_lora=True, max_loras=2, max_lora_rank=8,
                          max_cpu_loras=3)  # fmt: skip
    beside = estimate(config).beside
    engine = LLMEngine(config, log_stats_interval=0)
    table = engine.runner.lora.table
    assert beside["LoRA slots (2 x rank 8)"] == table.nbytes
    panels = 0
    for layer in table.layers:
        for s in layer.values():
            for slot in range(table.max_loras):
                s.width[slot] = s.a.shape[2]  # a full slot, as an adapter of every module at rank 8
                pa, pb = s._slot_panels(slot)
                panels += pa.nbytes + pb.nbytes
    assert beside["LoRA slot panels"] == panels
    targets = table.targets
    per_adapter = sum(8 * (cin + cout) * 4 for m, (cin, cout) in targets.shapes.items() if m not in ("qkv_proj", "gate_up_proj"))
    assert beside["LoRA adapters loaded (up to 3)"] == 3 * targets.num_layers * per_adapter
    # They count in the totals and are printed.
    report = estimate(config)
    assert report.to_dict()["total_bytes_all_replicas"] == report.weights.total + report.kv.pool_bytes + sum(beside.values())
    assert any(line.startswith("beside the model: ") and "LoRA slots" in line for line in report.lines())


def test_estimate_counts_the_draft_model_and_its_pool(tiny_llama):
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=24, block_size=8,
                          speculative_config={"method": "draft_model", "model": str(tiny_llama)})  # fmt: skip
    beside = estimate(config).beside
    engine = LLMEngine(config, log_stats_interval=0)
    drafter = engine.runner.proposer.drafter
    assert beside["draft model weights"] == held_weight_bytes(drafter.model)
    assert beside["draft model KV pool"] == sum(t.nbytes for k, v in drafter.cache.layers for p in (k, v) for t in cache_parts(p))
    # Prompt lookup and no speculation hold nothing beside the model.
    assert estimate(EngineConfig(model=str(tiny_llama), num_kv_blocks=24, speculative_config={"method": "ngram"})).beside == {}
    assert estimate(EngineConfig(model=str(tiny_llama), num_kv_blocks=24)).beside == {}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_estimate_counts_the_shipped_heads(method):
    from pagedllm.engine.capacity import _module_bytes

    config = EngineConfig(num_kv_blocks=64, speculative_config={"method": method})
    beside = estimate(config).beside
    engine = LLMEngine(config, log_stats_interval=0)
    drafter = engine.runner.proposer.drafter
    head = drafter.head if method == "eagle" else drafter.heads
    assert beside["EAGLE head" if method == "eagle" else "Medusa heads"] == _module_bytes(head)
    assert beside["draft LM-head rows"] == drafter.lm_head.grouped.nbytes
    if method == "eagle":
        assert beside["EAGLE KV pool"] == sum(t.nbytes for k, v in drafter.cache.layers for p in (k, v) for t in cache_parts(p))


def test_estimate_counts_the_swap_pool_in_memory(tiny_llama, tmp_path):
    """With preemption_mode="swap" the engine holds a second pool of swap_space GiB; the total
    left it out (found by a review), though the engine's memory check counts it."""
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=64, preemption_mode="swap", swap_space=0.001)
    report = estimate(config)
    engine = LLMEngine(config, log_stats_interval=0)
    held = sum(t.nbytes for k, v in engine.runner.swap_caches for pool in (k, v) for t in cache_parts(pool))
    assert held > 0 and sum(report.beside.values()) == held
    assert report.to_dict()["total_bytes_all_replicas"] == report.weights.total + report.kv.pool_bytes + held
    assert estimate(EngineConfig(model=str(tiny_llama), num_kv_blocks=64)).beside == {}
    # A file-backed swap pool (swap_path) is disk, not memory.
    on_disk = EngineConfig(model=str(tiny_llama), num_kv_blocks=64, preemption_mode="swap", swap_space=0.001,
                           swap_path=str(tmp_path / "swap"))  # fmt: skip
    assert estimate(on_disk).beside == {}
