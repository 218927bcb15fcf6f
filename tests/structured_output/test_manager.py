"""The structured-output manager alone: where constraints compile."""

from __future__ import annotations

import threading

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
