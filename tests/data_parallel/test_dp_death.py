"""A replica that dies - a fault it cannot pin on a request, or a kill - ends the whole DP
engine cleanly: pending requests fail with EngineDeadError, on_dead runs, new requests are
refused, nothing hangs. (The server's side of it: test_dp_server.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.data_parallel.client import DPAsyncLLM
from pagedllm.engine.errors import EngineDeadError

FAULT_TOKEN = 4321


async def _run(llm: DPAsyncLLM, prompt: list[int]) -> str:
    try:
        async for _ in llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=400, ignore_eos=True)):
            pass
        return "finished"
    except EngineDeadError as e:
        return str(e)


# The engine fault path (the replica reports its death, then exits); test_dp_server.py kills one.
@pytest.mark.parametrize("how", ["engine-fault"])
def test_a_dying_replica_fails_every_request(tiny_llama_tok, monkeypatch, how):
    monkeypatch.setenv("PAGEDLLM_FAULT_INJECTION", f"engine_token={FAULT_TOKEN}")
    llm = DPAsyncLLM(EngineConfig(model=str(tiny_llama_tok), data_parallel_size=2, num_kv_blocks=64), log_stats_interval=1e9)
    died = threading.Event()
    llm.on_dead.append(lambda e: died.set())

    async def main() -> list[str]:
        normal = [asyncio.ensure_future(_run(llm, [10 + i] * 20)) for i in range(3)]
        await asyncio.sleep(0.3)
        if how == "engine-fault":
            victim = asyncio.ensure_future(_run(llm, [FAULT_TOKEN, 5]))
        else:
            os.kill(llm.replica_pids()[1], signal.SIGKILL)
            victim = asyncio.ensure_future(asyncio.sleep(0, "n/a"))
        return await asyncio.wait_for(asyncio.gather(victim, *normal), timeout=60)

    try:
        assert llm.healthy()
        with monkeypatch.context() as m:  # a replica gone but not yet noticed: /health already says so
            m.setattr(llm.replicas[1].process, "is_alive", lambda: False)
            assert not llm.healthy() and llm.dead is None
        results = asyncio.run(main())
        assert died.wait(10)
        assert not llm.healthy()
        assert all("died" in r for r in results[1:] if r != "finished"), results
        assert any("died" in r for r in results), results
        with pytest.raises(EngineDeadError):
            asyncio.run(llm.add_request("x", SamplingParams(max_tokens=2)))
    finally:
        llm.shutdown()
    assert not any(r.process.is_alive() for r in llm.replicas)
