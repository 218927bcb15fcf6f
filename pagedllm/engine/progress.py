"""The offline progress bar: prompts finished, with vLLM's estimate of input and output speed."""

from __future__ import annotations

import time
from typing import Any

from tqdm.auto import tqdm

from pagedllm.outputs import RequestOutput


class ProgressBar:
    """One bar for ``LLM.generate``, whether one engine steps here or replicas run elsewhere."""

    def __init__(self, total: int, enabled: Any):
        """``enabled``: a bool, or (as vLLM's use_tqdm) a tqdm-like callable that makes the bar."""
        if callable(enabled):
            self.bar = enabled(total=total, desc="Processed prompts", dynamic_ncols=True)
        else:
            self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, disable=not enabled)
        self.start = time.perf_counter()
        self.input_tokens = self.output_tokens = 0

    def finished(self, out: RequestOutput) -> None:
        self.input_tokens += len(out.prompt_token_ids)
        self.output_tokens += sum(len(o.token_ids) for o in out.outputs)
        elapsed = time.perf_counter() - self.start
        self.bar.set_postfix_str(
            f"est. speed input: {self.input_tokens / elapsed:.1f} toks/s, output: {self.output_tokens / elapsed:.1f} toks/s",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
