"""``best_of > n``: draw best_of samples, return the n with the highest cumulative logprob.

The samples are an ordinary ``n = best_of`` request (engine/parallel_sampling.py: they share the
prompt's KV blocks through the prefix cache), with logprobs switched on so each sample's
cumulative logprob is summed as it is drawn. Its one final output (never deltas: which samples
win is known only at the end) is cut to the best n, re-indexed 0..n-1 in that order; the
logprobs (and the cumulative logprob) are dropped again when the request did not ask for them. As vLLM, streaming is not
available with best_of > n.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


def wants_best_of(params: SamplingParams) -> bool:
    return not params.use_beam_search and params.best_of is not None and params.best_of > params.n


def expand(params: SamplingParams) -> SamplingParams:
    """The params the samples run with: n = best_of, logprobs on (at least the sampled token's)."""
    return replace(params, n=params.best_of, logprobs=params.logprobs if params.logprobs is not None else 0)


@dataclass
class _Pick:
    n: int
    keep_logprobs: bool


class BestOf:
    def __init__(self) -> None:
        self._picks: dict[str, _Pick] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        self._picks[request_id] = _Pick(params.n, params.logprobs is not None)

    def select(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Cut every finished best_of output to its n best samples (others pass through)."""
        for out in outputs:
            pick = self._picks.get(out.request_id)
            if pick is None or not out.finished:
                continue
            del self._picks[out.request_id]
            best = sorted(out.outputs, key=lambda o: -(o.cumulative_logprob or 0.0))[: pick.n]
            for i, o in enumerate(best):
                o.index = i
                if not pick.keep_logprobs:  # as any request without logprobs: neither is reported
                    o.logprobs = None
                    o.cumulative_logprob = None
            out.outputs = best
        return outputs
