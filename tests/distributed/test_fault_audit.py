"""Fault audit of the multi-process executor and the engine's pipelined step: each case must
end (guarded by a thread and a deadline, so a hang fails instead of blocking the run)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.errors import EngineDeadError
from pagedllm.engine.faults import FaultInjector
from tests.conftest import within
from tests.distributed.test_tiny_parallel import ENGINE, _greedy, _prompts, uneven_gqa  # noqa: F401 (fixture)

MARK = 77


def _run_to_end(engine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    return done


def test_pipeline_abort_of_a_request_in_a_failed_batch_awaiting_isolation(uneven_gqa):  # noqa: F811
    """PP=2: a batch that failed waits in ``_drained`` (result None) for the next step to
    isolate it. A request of that batch aborted meanwhile (a client disconnect, between two
    steps of AsyncLLM's loop) made the re-run look it up in the scheduler: KeyError out of
    step(), which ends an AsyncLLM for every request."""
    ref = _greedy(LLM(str(uneven_gqa), **ENGINE), _prompts((4,)), max_tokens=4)
    llm = LLM(str(uneven_gqa), pipeline_parallel_size=2, **ENGINE)
    engine = llm.llm_engine
    try:
        engine.faults = FaultInjector(f"request_token={MARK}")
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        good = engine.add_request(_prompts((4,))[0], sp)
        bad = engine.add_request({"prompt_token_ids": [10, MARK, 11]}, sp)
        done = {}
        for _ in range(10):  # until the failed batch waits to be isolated
            for out in engine.step():
                done[out.request_id] = out
            if any(result is None for _, result in engine._drained):
                break
        waiting = [s.req_id for out, result in engine._drained if result is None for s in out.scheduled]
        assert waiting == [bad]
        for out in engine.abort_request(bad):
            done[out.request_id] = out
        done.update(within(60, _run_to_end, engine))
        assert done[bad].outputs[0].finish_reason == "abort"
        assert done[good].outputs[0].token_ids == ref[0]
        assert within(60, _greedy, llm, _prompts((4,)), 4) == ref  # and the engine carries on
    finally:
        engine.close()


def test_pipeline_after_an_unattributable_step_failure_the_next_request_runs(uneven_gqa, monkeypatch):  # noqa: F811
    """PP=2, every rank fails every step of a marked prompt (PAGEDLLM_WORKER_FAULT with a rank
    list: a test hook of this audit). Every request failing on its own raises EngineDeadError
    while a later failed batch still waited in ``_drained``; LLM aborted the requests, and the
    next, unrelated generate() died of KeyError on that stale batch."""
    monkeypatch.setenv("PAGEDLLM_WORKER_FAULT", f"0,1:{MARK}")
    llm = LLM(str(uneven_gqa), pipeline_parallel_size=2, **ENGINE)
    try:
        ref = _greedy(llm, _prompts((4, 9)), max_tokens=4)
        with pytest.raises(EngineDeadError, match="every request on its own"):
            within(60, _greedy, llm, [{"prompt_token_ids": [10, MARK, 11 + i]} for i in range(4)], 4)
        assert within(60, _greedy, llm, _prompts((4, 9)), 4) == ref
        assert not llm.llm_engine._drained and not llm.llm_engine._batch_queue
    finally:
        llm.llm_engine.close()


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_an_interrupted_step_leaves_no_stale_answers_for_the_next(uneven_gqa, monkeypatch, tp, pp):  # noqa: F811
    """Ctrl-C while the engine waits for the workers' answers (LLM._run aborts the requests and
    the LLM stays usable, e.g. in a notebook): the interrupted step's answers stayed in the
    control pipes, and the next generate() read them as its own - other requests' tokens, and
    every later step one behind."""
    import pagedllm.executor.multiproc as multiproc

    prompts = _prompts((5, 17))
    ref = _greedy(LLM(str(uneven_gqa), **ENGINE), prompts, max_tokens=6)
    llm = LLM(str(uneven_gqa), tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
    try:
        real_collect, real_wait, calls = multiproc.MultiprocExecutor.collect, multiproc.wait, []

        def ctrl_c(*args, **kwargs):
            raise KeyboardInterrupt

        def interrupted_collect(self):
            calls.append(1)
            if len(calls) == 3:  # Ctrl-C while waiting for the step's answers, none read yet
                monkeypatch.setattr(multiproc, "wait", ctrl_c)
            return real_collect(self)

        monkeypatch.setattr(multiproc.MultiprocExecutor, "collect", interrupted_collect)
        with pytest.raises(KeyboardInterrupt):
            _greedy(llm, _prompts((3, 9, 30)), max_tokens=40)
        monkeypatch.setattr(multiproc.MultiprocExecutor, "collect", real_collect)
        monkeypatch.setattr(multiproc, "wait", real_wait)
        assert within(60, _greedy, llm, prompts, 6) == ref
        assert within(60, _greedy, llm, prompts, 6) == ref
    finally:
        llm.llm_engine.close()


_ENGINE_SCRIPT = """
import os, sys
from pagedllm import LLM, SamplingParams
from tests.conftest import within
from tests.distributed.test_tiny_parallel import ENGINE
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, **ENGINE)
    print("PIDS", *llm.llm_engine.executor.worker_pids, flush=True)
    llm.generate([{"prompt_token_ids": [10, 77, 11]}], SamplingParams(max_tokens=2), use_tqdm=False)
"""


def test_workers_end_when_the_engine_process_is_killed(uneven_gqa, tmp_path):  # noqa: F811
    """The engine's process SIGKILLed (OOM killer, kill -9) while one rank hangs mid-step (test
    hook: it sleeps) and its peer waits for it in an all-reduce: both stayed behind, orphans,
    one until the collective's 600 s timeout, the hung one for ever."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "engine.py"
    script.write_text(_ENGINE_SCRIPT)
    env = dict(os.environ, PAGEDLLM_WORKER_FAULT=f"1:{MARK}:sleep", PYTHONPATH=os.getcwd())
    proc = subprocess.Popen([sys.executable, str(script), str(uneven_gqa)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)  # fmt: skip
    pids: list[int] = []
    try:
        line = within(120, proc.stdout.readline)
        pids = [int(p) for p in line.split()[1:]]
        assert line.startswith("PIDS") and len(pids) == 2
        time.sleep(3)  # rank 1 hangs in the step, rank 0 waits for it
        proc.kill()
        proc.wait()

        def alive():
            return [p for p in pids if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]

        deadline = time.monotonic() + 15
        while alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert alive() == []
    finally:
        proc.kill()
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
