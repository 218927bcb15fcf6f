"""``best_of > n``: draw best_of samples, return the n with the highest cumulative logprob.

The samples are an ordinary ``n = best_of`` request (engine/parallel_sampling.py: they share the
prompt's KV blocks through the prefix cache), with logprobs switched on so each sample's
cumulative logprob is summed as it is drawn. Its one final output (never deltas: which samples
win is known only at the end) is cut to the best n, re-indexed 0..n-1 in that order; the
logprobs (and the cumulative logprob) are dropped again when the request did not ask for them. An aborted or
failed request's picks all end with that reason. As vLLM, streaming is not available with best_of > n.
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
            # A sample without tokens has no logprob to rank by (0.0 would rank it first).
            ranked = sorted(out.outputs, key=lambda o: (not o.token_ids, -(o.cumulative_logprob or 0.0)))
            best = ranked[: pick.n]
            # Aborted or failed, the request's picks say so: they were chosen among unfinished
            # samples, and a caller must not read a completed request from them.
            reasons = {o.finish_reason for o in out.outputs}
            cut = "error" if "error" in reasons else "abort" if "abort" in reasons else None
            for i, o in enumerate(best):
                o.index = i
                if cut is not None and o.finish_reason != cut:
                    o.finish_reason, o.stop_reason = cut, None
                if not pick.keep_logprobs:  # as any request without logprobs: neither is reported
                    o.logprobs = None
                    o.cumulative_logprob = None
            out.outputs = best
        return outputs
