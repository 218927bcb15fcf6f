"""The structured-output manager alone: where constraints compile."""

from __future__ import annotations

import threading
import time

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.manager import SMALL_CONSTRAINT_CHARS, StructuredOutputManager


def test_a_big_constraint_does_not_hold_up_small_ones():
    """A big constraint compiles on a thread of its own (found by an adversarial session: a
    1 MiB choice list compiled for 160 s while every JSON request waited behind it)."""
    release = threading.Event()

    class SlowOnBig:
        def compile(self, params: StructuredOutputsParams) -> str:
            if len(params.spec) > SMALL_CONSTRAINT_CHARS:
                assert release.wait(30)
            return params.kind

    manager = StructuredOutputManager(tokenizer=object(), vocab_size=10, stop_token_ids=frozenset())
    manager._backend = SlowOnBig()
    try:
        big = manager._compile(StructuredOutputsParams(choice=[f"{i:04d}" + "x" * 1000 for i in range(40)]))
        small = [manager._compile(StructuredOutputsParams(regex="a+")),
                 manager._compile(StructuredOutputsParams(json_object=True))]  # fmt: skip
        assert [f.result(timeout=10) for f in small] == ["regex", "json_object"]
        assert not big.done()
        release.set()
        assert big.result(timeout=10) == "choice"
    finally:
        release.set()
        manager.shutdown()


def _held_request(request_id: str, params: StructuredOutputsParams):
    from pagedllm.request import Request
    from pagedllm.sampling_params import SamplingParams

    return Request(request_id=request_id, prompt=None, prompt_token_ids=[1, 2],
                   sampling_params=SamplingParams(max_tokens=4, structured_outputs=params))  # fmt: skip


def test_an_aborted_requests_queued_compile_is_cancelled_unless_another_waits_for_it():
    """Found by an adversarial session: three big constraints aborted at once still compiled one
    after another (27 s of a core for nobody). A compile not yet started is cancelled when its
    last waiting request goes; one that has started finishes (it cannot be stopped); closing
    the engine cancels the rest."""
    release = threading.Event()
    compiled: list[str] = []

    class Slow:
        def compile(self, params: StructuredOutputsParams) -> str:
            assert release.wait(30)
            compiled.append(params.spec[:4])
            return params.kind

    def big(tag: str) -> StructuredOutputsParams:
        return StructuredOutputsParams(choice=[tag + f"{i:04d}" + "x" * 1000 for i in range(40)])

    manager = StructuredOutputManager(tokenizer=object(), vocab_size=10, stop_token_ids=frozenset())
    manager._backend = Slow()
    try:
        manager.add([_held_request("running", big("AAAA"))])
        manager.add([_held_request("queued", big("BBBB"))])
        manager.add([_held_request("shared-1", big("CCCC"))])
        manager.add([_held_request("shared-2", big("CCCC"))])  # the same constraint: one compile
        manager.add([_held_request("closed", big("DDDD"))])
        running, queued, shared, closed = (manager._held[i].future for i in ("running", "queued", "shared-1", "closed"))
        assert manager._held["shared-2"].future is shared
        deadline = time.monotonic() + 30
        while not running.running() and time.monotonic() < deadline:  # the compiler thread took it
            time.sleep(0.01)
        for rid in ("running", "queued", "shared-1"):
            assert [r.request_id for r in manager.drop(rid)] == [rid]
        assert queued.cancelled() and not shared.cancelled()
        manager.shutdown()  # the engine closes: what is queued is cancelled
        assert closed.cancelled() and shared.cancelled()
        release.set()
        assert running.result(timeout=10) == "choice"  # the one that had started finished
        assert len(compiled) == 1  # the cancelled ones never ran
    finally:
        release.set()
        manager.shutdown()
