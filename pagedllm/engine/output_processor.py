"""From per-sequence token updates to the RequestOutputs users see.

Owns everything textual: incremental detokenizers, stop strings, decoded log-probability
entries, and grouping the n samples of a request into one RequestOutput. The scheduler
never sees text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable

from pagedllm.engine.detokenizer import IncrementalDetokenizer, prime_tokens
from pagedllm.request import Request
from pagedllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from pagedllm.outputs import RowLogprobs
from pagedllm.scheduler.output import ModelRunnerOutput


class RequestOutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every output holds everything so far
    DELTA = "delta"  # every output holds what is new (streaming)
    FINAL_ONLY = "final_only"  # one output, when the request ends


@dataclass
class _Sample:
    request: Request
    detokenizer: IncrementalDetokenizer | None
    sent_tokens: int = 0
    done: bool = False


@dataclass
class _Parent:
    request_id: str
    kind: RequestOutputKind
    samples: list[_Sample]
    sent_prompt_logprobs: bool = False
    dirty: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: Any | None):
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        # Called when building one request's output fails (the engine ends that request there);
        # None: the exception propagates.
        self.on_fault: Callable[[Request, BaseException], None] | None = None
        self._decoded: dict[int, str] = {}  # token id -> text, for log-probability entries

    def _decode_one(self, token_id: int) -> str:
        text = self._decoded.get(token_id)
        if text is None:
            text = self._decoded[token_id] = self.tokenizer.decode([token_id])
        return text

    def add(self, samples: list[Request], kind: RequestOutputKind) -> None:
        first = samples[0]
        detok = self.tokenizer is not None and first.sampling_params.detokenize
        prime = prime_tokens(self.tokenizer, first.prompt_token_ids, first.sampling_params.skip_special_tokens) if detok else []
        self.parents[first.parent_id] = _Parent(
            request_id=first.parent_id,
            kind=kind,
            samples=[
                _Sample(r, IncrementalDetokenizer(self.tokenizer, r.sampling_params, r.eos_token_ids, prime) if detok else None)
                for r in samples
            ],
        )

    @staticmethod
    def record_logprobs(reqs: list[Request], result: ModelRunnerOutput) -> None:
        """Keep the step's raw log-probabilities on the requests (``reqs`` in step order).

        Prompt positions are kept once each: a chunk recomputed after a preemption reports
        positions the request already has.
        """
        for req, lps in zip(reqs, result.logprobs):
            for lp in lps:
                if lp is not None:
                    req.logprobs.append(lp)
                    req.cumulative_logprob += lp.token_logprob
            got = result.prompt_logprobs.get(req.request_id)
            if got is not None:
                first, entries = got
                req.prompt_logprobs.extend(entries[max(0, len(req.prompt_logprobs) - first) :])

    def on_new_tokens(self, req: Request, num_new: int) -> tuple[str, int] | None:
        """Detokenize a sequence's new tokens; if a stop string ended the text, (the string, how
        many of the new tokens came after the one it ended in)."""
        parent = self.parents.get(req.parent_id)
        if parent is None:
            return None
        parent.dirty = True
        sample = parent.samples[req.index]
        if sample.detokenizer is None:
            return None
        stop = sample.detokenizer.update(req.output_token_ids[-num_new:])
        return None if stop is None else (stop, sample.detokenizer.tokens_after_stop)

    def mark(self, req: Request) -> None:
        """Note that a sequence changed (e.g. was aborted) so its parent reports."""
        parent = self.parents.get(req.parent_id)
        if parent is not None:
            parent.dirty = True

    def make_outputs(self) -> list[RequestOutput]:
        outputs = []
        for parent_id in [p for p, st in self.parents.items() if st.dirty]:
            parent = self.parents[parent_id]
            parent.dirty = False
            finished = all(s.request.status.finished for s in parent.samples)
            if parent.kind is RequestOutputKind.FINAL_ONLY and not finished:
                continue
            try:
                outputs.append(self._output(parent, finished))
            except Exception as e:  # this request's alone: it ends with the error, the others go on
                if self.on_fault is None:
                    raise
                self.on_fault(parent.samples[0].request, e)
                outputs.append(self._error_output(parent))
                finished = True
            if finished:
                del self.parents[parent_id]
        return outputs

    @staticmethod
    def _error_output(parent: _Parent) -> RequestOutput:
        """The last output of a request whose output could not be built: its error, no tokens."""
        first = parent.samples[0].request
        return RequestOutput(
            request_id=parent.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[CompletionOutput(index=s.request.index, text="", token_ids=[], finish_reason="error")
                     for s in parent.samples],  # fmt: skip
            finished=True,
            error=next((s.request.error for s in parent.samples if s.request.error), "building the output failed"),
            rejected=any(s.request.rejected for s in parent.samples),
            lora_request=first.lora_request,
        )

    def _output(self, parent: _Parent, finished: bool) -> RequestOutput:
        delta = parent.kind is RequestOutputKind.DELTA
        completions = []
        for sample in parent.samples:
            req = sample.request
            if delta and sample.done:
                continue  # nothing new after a sample's last output
            start = sample.sent_tokens if delta else 0
            ended = req.status.finished
            if delta and not ended and len(req.output_token_ids) == start:
                continue  # this sample has nothing new (another one of the n moved, or it was preempted)
            text = ""
            if sample.detokenizer is not None:
                text = sample.detokenizer.take_delta(ended) if delta else sample.detokenizer.visible_text(ended)
            params = req.sampling_params
            completions.append(
                CompletionOutput(
                    index=req.index,
                    text=text,
                    token_ids=req.output_token_ids[start:],
                    cumulative_logprob=req.cumulative_logprob if params.logprobs is not None else None,
                    logprobs=[self._entry(req.output_token_ids[start + j], lp, params.detokenize) for j, lp in enumerate(req.logprobs[start:])]
                    if params.logprobs is not None
                    else None,
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                )
            )
            sample.sent_tokens = len(req.output_token_ids)
            sample.done = ended
        first = parent.samples[0].request
        prompt_logprobs = None
        if first.sampling_params.prompt_logprobs is not None and not (delta and parent.sent_prompt_logprobs):
            ids = first.prompt_token_ids
            detokenize = first.sampling_params.detokenize
            prompt_logprobs = [None] + [self._entry(ids[j + 1], lp, detokenize) for j, lp in enumerate(first.prompt_logprobs)]
            parent.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=parent.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=first.num_cached_tokens,
            num_preemptions=sum(s.request.num_preemptions for s in parent.samples),
            error=next((s.request.error for s in parent.samples if s.request.error), None),
            rejected=any(s.request.rejected for s in parent.samples),
            lora_request=first.lora_request,
            metrics=RequestMetrics(
                arrival_time=first.arrival_time,
                first_scheduled_time=first.first_scheduled_time,
                first_token_time=min((s.request.first_token_time for s in parent.samples if s.request.first_token_time), default=None),
                finished_time=max((s.request.finished_time or 0 for s in parent.samples), default=None) if finished else None,
            ),
        )

    def _entry(self, token_id: int, lp: RowLogprobs, detokenize: bool = True) -> PositionLogprobs:
        """``detokenize=False``: no text (decoded_token None), as vLLM."""
        decode = self._decode_one if self.tokenizer is not None and detokenize else (lambda _t: None)
        entry: PositionLogprobs = {token_id: Logprob(lp.token_logprob, lp.token_rank, decode(token_id))}
        for rank, (tid, value) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            if tid not in entry:
                entry[tid] = Logprob(value, rank, decode(tid))
        return entry
