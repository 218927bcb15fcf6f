"""Step stats from several replicas: LoRA request counts are summed over the replicas' latest."""

from __future__ import annotations

from types import SimpleNamespace

from pagedllm.data_parallel.client import DPAsyncLLM
from pagedllm.engine.stats import StepStats


def _stats(lora=None) -> StepStats:
    return StepStats(1, 1, 1, 0, 0.1, 0, lora=lora)


def test_lora_counts_are_summed_over_replicas():
    fake = SimpleNamespace(_lora_counts={})
    merge = DPAsyncLLM._merge_lora
    assert merge(fake, 0, _stats()).lora is None
    assert merge(fake, 0, _stats(({"a": 2}, {}))).lora == ({"a": 2}, {})
    assert merge(fake, 1, _stats(({"a": 1, "b": 1}, {"b": 3}))).lora == ({"a": 3, "b": 1}, {"b": 3})
    assert merge(fake, 0, _stats(({}, {}))).lora == ({"a": 1, "b": 1}, {"b": 3})  # replica 0 is idle now


def test_replicas_report_connector_saves_and_aborts_between_steps(tiny_llama, tmp_path):
    """A replica's KV connector saves in the background, after the request's last step: the
    replica reports them while idle (they used to wait for its next request), and an abort's
    state comes with the abort."""
    import asyncio
    import os
    import time

    from pagedllm.config import EngineConfig
    from pagedllm.sampling_params import SamplingParams

    store = tmp_path / "store"
    config = EngineConfig(model=str(tiny_llama), data_parallel_size=2, num_kv_blocks=64, max_model_len=256,
                          kv_transfer_config={"kv_connector": "disk", "path": str(store)})  # fmt: skip
    seen: list[StepStats] = []

    async def run() -> None:
        llm = DPAsyncLLM(config, log_stats_interval=1e9)
        llm.add_stat_logger(type("Seen", (), {"record": staticmethod(seen.append)})())
        try:
            stream = await llm.add_request({"prompt_token_ids": list(range(3, 3 + 40))}, SamplingParams(max_tokens=2), "r")
            async for _ in stream:
                pass
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                saved = sum(s.kv_connector.num_saved_blocks for s in seen if s.kv_connector is not None)
                if saved == 2:
                    break
                await asyncio.sleep(0.2)
            files = sum(len(f) for _, _, f in os.walk(store))
            assert (saved, files) == (2, 2)  # the prompt's two full blocks, on disk and counted
            stream = await llm.add_request({"prompt_token_ids": list(range(50, 90))},
                                           SamplingParams(max_tokens=200, ignore_eos=True), "long")  # fmt: skip
            async for _ in stream:  # it runs: abort it after its first output
                break
            (rank,) = [r for r, (n, _) in enumerate(llm.replica_loads()) if n]
            its: list[StepStats] = []  # what the replica running it reports from now on
            llm.add_stat_logger(type("Its", (), {"record": staticmethod(its.append)})(), replica=rank)
            llm.abort("long")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (its and its[-1].num_running == 0 == its[-1].num_waiting):
                await asyncio.sleep(0.1)
            assert its and its[-1].num_running == 0 and its[-1].num_waiting == 0
        finally:
            llm.shutdown()

    asyncio.run(run())
