"""Output-path behaviours a mutation audit found unpinned (each rule could be broken without a
test failing): cumulative and delta outputs over several steps, delta logprobs alignment, a
finished sample among n, prompt logprobs after a recomputed chunk and in every cumulative
output, the min_tokens boundary of stop strings, and the tokens after a stop string in one
update."""

from __future__ import annotations

from types import SimpleNamespace

from pagedllm import SamplingParams
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.output_processor import OutputProcessor, RequestOutputKind
from pagedllm.outputs import RowLogprobs
from pagedllm.request import Request, RequestStatus

WORDS = "one two three four five six"


def _req(tok, rid="r", index=0, **params) -> Request:
    prompt = tok.encode("Count:", add_special_tokens=False)
    return Request(rid, None, prompt, SamplingParams(temperature=0, max_tokens=50, **params), parent_id="p", index=index)


def _emit(proc: OutputProcessor, req: Request, token: int, logprob: bool = False) -> None:
    req.append_output_token(token)
    if logprob:
        req.logprobs.append(RowLogprobs(-0.5, 1, [token], [-0.5]))
    proc.on_new_tokens(req, 1)


def test_cumulative_outputs_hold_everything_and_deltas_only_what_is_new(default_tokenizer):
    """CUMULATIVE: every output repeats all tokens and text so far; DELTA: the pieces of the
    outputs concatenate to the whole, each token once."""
    ids = default_tokenizer.encode(WORDS, add_special_tokens=False)
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        proc = OutputProcessor(default_tokenizer)
        req = _req(default_tokenizer)
        proc.add([req], kind)
        got = []
        for i, t in enumerate(ids):
            _emit(proc, req, t)
            if i == len(ids) - 1:
                req.status = RequestStatus.FINISHED_LENGTH
            got += [o.outputs[0] for o in proc.make_outputs()]
        assert len(got) == len(ids)
        if kind is RequestOutputKind.CUMULATIVE:
            assert [c.token_ids for c in got] == [ids[: i + 1] for i in range(len(ids))]
            assert got[-1].text == " " + WORDS or got[-1].text == WORDS
        else:
            assert [c.token_ids for c in got] == [[t] for t in ids]
            assert "".join(c.text for c in got).strip() == WORDS
        assert got[-1].finish_reason == "length"


def test_delta_logprobs_are_keyed_by_the_delta_tokens(default_tokenizer):
    """Streaming with logprobs: each delta's entries belong to that delta's tokens, not to the
    first tokens of the output."""
    ids = default_tokenizer.encode(WORDS, add_special_tokens=False)
    proc = OutputProcessor(default_tokenizer)
    req = _req(default_tokenizer, logprobs=1)
    proc.add([req], RequestOutputKind.DELTA)
    for t in ids:
        _emit(proc, req, t, logprob=True)
        (out,) = proc.make_outputs()
        (c,) = out.outputs
        assert c.token_ids == [t] and [list(e)[0] for e in c.logprobs] == [t]


def test_a_finished_sample_is_not_streamed_again_while_another_goes_on(default_tokenizer):
    """n=2 streamed: once one sample ended (its last delta carried the finish reason), later
    outputs hold only the other sample; a sample with nothing new is left out."""
    ids = default_tokenizer.encode(WORDS, add_special_tokens=False)
    proc = OutputProcessor(default_tokenizer)
    a, b = _req(default_tokenizer, "a", 0), _req(default_tokenizer, "b", 1)
    proc.add([a, b], RequestOutputKind.DELTA)
    _emit(proc, a, ids[0])
    _emit(proc, b, ids[0])
    a.status = RequestStatus.FINISHED_STOPPED
    (out,) = proc.make_outputs()
    assert [(c.index, c.finish_reason) for c in out.outputs] == [(0, "stop"), (1, None)]
    proc.mark(a)  # e.g. another sample moved: a has nothing new
    assert [[c.index for c in o.outputs] for o in proc.make_outputs()] == [[]]
    _emit(proc, b, ids[1])
    (out,) = proc.make_outputs()
    assert [(c.index, c.token_ids) for c in out.outputs] == [(1, [ids[1]])]


def test_prompt_logprobs_of_a_recomputed_chunk_are_kept_once():
    """After a preemption the prompt is computed again and its chunks report positions the
    request already has: they are not appended twice (prompt_logprobs stays aligned with the
    prompt)."""
    req = Request("r", None, list(range(10, 20)), SamplingParams(max_tokens=3, prompt_logprobs=1))
    rows = [RowLogprobs(-float(i), 1, [], []) for i in range(9)]
    first = SimpleNamespace(logprobs=[[]], prompt_logprobs={"r": (0, rows[:5])})
    OutputProcessor.record_logprobs([req], first)
    again = SimpleNamespace(logprobs=[[]], prompt_logprobs={"r": (0, rows[:7])})  # recomputed from 0
    OutputProcessor.record_logprobs([req], again)
    rest = SimpleNamespace(logprobs=[[]], prompt_logprobs={"r": (7, rows[7:])})
    OutputProcessor.record_logprobs([req], rest)
    assert req.prompt_logprobs == rows


def test_stop_strings_count_only_after_min_tokens(default_tokenizer):
    """A stop string completed by the min_tokens-th token does not stop the request (as vLLM
    v1: stop strings are checked once more than min_tokens tokens are out); one token later it
    does."""
    ids = default_tokenizer.encode(WORDS, add_special_tokens=False)
    k = next(i for i in range(1, len(ids) + 1) if "two" in default_tokenizer.decode(ids[:i]))
    detok = IncrementalDetokenizer(default_tokenizer, SamplingParams(stop=["two"], min_tokens=k))
    assert [detok.update([t]) for t in ids[:k]] == [None] * k
    detok = IncrementalDetokenizer(default_tokenizer, SamplingParams(stop=["two"], min_tokens=k - 1))
    assert [detok.update([t]) for t in ids[:k]][-1] == "two"


def test_tokens_after_a_stop_string_in_one_update_are_counted(default_tokenizer):
    """Several tokens in one update (accepted drafts): the engine drops the ones after the token
    a stop string ended in, so their count must be exact."""
    ids = default_tokenizer.encode(WORDS, add_special_tokens=False)
    k = next(i for i in range(1, len(ids) + 1) if "three" in default_tokenizer.decode(ids[:i]))
    detok = IncrementalDetokenizer(default_tokenizer, SamplingParams(stop=["three"]))
    assert detok.update(ids) == "three"
    assert detok.tokens_after_stop == len(ids) - k
    assert detok.text.strip() == "one two"


def test_prompt_logprobs_come_with_every_cumulative_output_and_the_first_delta(default_tokenizer):
    """prompt_logprobs belong to the whole output: a CUMULATIVE output (each one is the request
    so far) carries them every time, a DELTA stream only in its first piece."""
    ids = default_tokenizer.encode(WORDS, add_special_tokens=False)
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        proc = OutputProcessor(default_tokenizer)
        req = _req(default_tokenizer, prompt_logprobs=0)
        rows = [RowLogprobs(-1.0, 1, [], []) for _ in range(len(req.prompt_token_ids) - 1)]
        OutputProcessor.record_logprobs([req], SimpleNamespace(logprobs=[[]], prompt_logprobs={"r": (0, rows)}))
        proc.add([req], kind)
        sent = []
        for t in ids[:3]:
            _emit(proc, req, t)
            (out,) = proc.make_outputs()
            sent.append(out.prompt_logprobs)
        assert sent[0] is not None and len(sent[0]) == len(req.prompt_token_ids) and sent[0][0] is None
        if kind is RequestOutputKind.CUMULATIVE:
            assert all(p == sent[0] for p in sent)
        else:
            assert sent[1:] == [None, None]
