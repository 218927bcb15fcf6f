"""Gaps a mutation audit of the structured-output backend and manager found: behaviour no
other test pinned down (each test names what it guards)."""

from __future__ import annotations

import json
import re

import pytest

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import MAX_JSON_WHITESPACE, parse, unenforced_keywords


def _grammar_accepts(schema: dict, text: str) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False), text)


# ------------------------------------------------------------------ parse (no tokenizer)
def test_keywords_under_property_names_are_found():
    schema = {"type": "object", "propertyNames": {"type": "string", "not": {"const": "x"}}}
    assert unenforced_keywords(schema) == ["#/propertyNames: not"]
    with pytest.raises(ValueError, match="#/propertyNames: not"):
        parse(StructuredOutputsParams(json=schema))


def test_required_without_any_properties_is_refused():
    """A schema with ``required`` but no ``properties`` at all (not only an empty one)."""
    import jsonschema

    schema = {"type": "object", "required": ["a"]}
    assert not jsonschema.Draft202012Validator(schema).is_valid({})
    assert _grammar_accepts(schema, "{}")  # the converter drops the requirement
    with pytest.raises(ValueError, match="required 'a' is not among its properties"):
        parse(StructuredOutputsParams(json=schema))


@pytest.mark.parametrize("pattern", [r"^a\x20b$", r"^a\u0020b$", r"^a\x7fb$"])
def test_escapes_of_printable_characters_are_not_control_characters(pattern):
    """Space (0x20) is the first character that is not a control character."""
    parse(StructuredOutputsParams(json={"type": "string", "pattern": pattern}))


@pytest.mark.parametrize("pattern", [r"^a\ab$", r"^a\fb$", r"^a\vb$", r"^a\0b$"])
def test_every_control_escape_is_refused(pattern):
    with pytest.raises(ValueError, match="can match the control character"):
        parse(StructuredOutputsParams(json={"type": "string", "pattern": pattern}))


def test_a_pattern_ending_in_a_bare_control_escape_is_a_clear_refusal():
    """``\\c`` with nothing after it: the scan must not run past the pattern's end."""
    with pytest.raises(ValueError, match="regex feature the grammar lacks") as e:
        parse(StructuredOutputsParams(json={"type": "string", "pattern": "^a\\c"}))
    assert "index" not in str(e.value)


# ------------------------------------------------------------------ structural tags
def test_a_legacy_structural_tag_without_triggers_is_refused():
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}]}
    with pytest.raises(ValueError, match="triggers are required"):
        parse(StructuredOutputsParams(structural_tag=json.dumps(tag)))


@pytest.mark.parametrize("tag", ["[1]", '"text"', "17"])
def test_a_structural_tag_that_is_not_an_object_is_refused_by_name(tag):
    with pytest.raises(ValueError, match="structural_tag is invalid: it must be a JSON object"):
        parse(StructuredOutputsParams(structural_tag=tag))


def test_schemas_in_xgrammars_own_structural_tag_format_are_checked_too():
    """xgrammar's format holds a schema under "json_schema" (vLLM's legacy one under "schema")."""
    bad = {"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]}}
    tag = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": bad}}
    with pytest.raises(ValueError, match="structural_tag is invalid: the schema uses keywords .*#: if"):
        parse(StructuredOutputsParams(structural_tag=json.dumps(tag)))
    good = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {"type": "object"}}}
    parse(StructuredOutputsParams(structural_tag=json.dumps(good)))


def test_a_choice_the_grammar_cannot_hold_is_refused_before_queueing():
    """parse checks a choice list's grammar as well (a lone surrogate cannot be UTF-8)."""
    with pytest.raises(ValueError, match="structured_outputs.choice is invalid"):
        parse(StructuredOutputsParams(choice=["ok", "a\udc00"]))


# ------------------------------------------------------------------ masks (the default model's tokenizer)
VOCAB = 49152


@pytest.fixture(scope="module")
def manager(default_tokenizer):
    from pagedllm.structured_output.manager import StructuredOutputManager

    m = StructuredOutputManager(default_tokenizer, VOCAB, frozenset({default_tokenizer.eos_token_id}))
    yield m
    m.shutdown()


def _allowed(row) -> "torch.Tensor":
    import torch

    return ((row.unsqueeze(1).to(torch.int64) >> torch.arange(32)) & 1).flatten().bool()[:VOCAB]


def _tokens(backend, test) -> list[int]:
    return [t for t, text in enumerate(backend.info.decoded_vocab[:VOCAB]) if test(text)]


_next_id = iter(range(10**6))


def _ready(manager, params: StructuredOutputsParams, text: str = ""):
    """A request whose matcher has taken ``text`` (its tokens also as the request's output)."""
    from pagedllm.request import Request
    from pagedllm.sampling_params import SamplingParams

    req = Request(request_id=f"r{next(_next_id)}", prompt=None, prompt_token_ids=[1, 2],
                  sampling_params=SamplingParams(max_tokens=50, structured_outputs=params))  # fmt: skip
    manager.add([req])
    ready = []
    while not ready:
        manager.wait_for_any(30)
        ready = manager.take_ready()
    assert ready == [([req], None)]
    ids = manager.tokenizer.encode(text, add_special_tokens=False)
    assert not manager.accept(req.request_id, ids)
    req.output_token_ids.extend(ids)
    return req


def _row(manager, req):
    from pagedllm.scheduler.output import ScheduledRequest

    mask = manager.bitmask([ScheduledRequest(req.request_id, 1, 2, [], samples=True)])
    return _allowed(mask.bitmask[mask.rows[req.request_id]])


def _raw_row(manager, req):
    import torch

    backend = manager.backend()
    mask = torch.zeros(1, backend.bitmask_width, dtype=torch.int32)
    backend.fill_bitmask([manager._matchers[req.request_id]], mask)
    return _allowed(mask[0])


TAG = json.dumps({"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]})


def test_json_object_rows_lose_tabs_and_control_characters_like_json_rows(manager):
    backend = manager.backend()
    tabs = _tokens(backend, lambda t: b"\t" in t)
    for params, text in [(StructuredOutputsParams(json_object=True), "{"),
                         (StructuredOutputsParams(json={"type": "object", "properties": {"s": {"type": "string", "maxLength": 20}}}), '{"s": "')]:  # fmt: skip
        req = _ready(manager, params, text)
        assert _raw_row(manager, req)[tabs].any()  # the grammar alone would take a tab here
        assert not _row(manager, req)[tabs].any()
        manager.forget([req.request_id])


def test_structural_tag_free_text_keeps_tabs_and_newlines_but_no_other_control_character(manager):
    backend = manager.backend()
    req = _ready(manager, StructuredOutputsParams(structural_tag=TAG), "Hi")
    row, raw = _row(manager, req), _raw_row(manager, req)
    for byte in (9, 10, 13):
        ts = _tokens(backend, lambda t: bytes([byte]) in t)
        assert raw[ts].all() and row[ts].all()
    controls = _tokens(backend, lambda t: any(b < 32 and b not in (9, 10, 13) for b in t))
    assert raw[controls].any() and not row[controls].any()
    manager.forget([req.request_id])


def test_after_a_lead_byte_ed_only_surrogate_tails_are_banned(manager):
    """ED A0-BF would be a UTF-16 surrogate (not UTF-8); ED 80-9F is a valid character (Hangul)."""
    backend = manager.backend()
    ed_end = _tokens(backend, lambda t: t[-1:] == b"\xed")
    ed_start_only = _tokens(backend, lambda t: t[:1] == b"\xed" and t[-1:] != b"\xed")
    assert ed_end and ed_start_only
    assert backend.ends_in_ed([5, ed_end[0]]) and not backend.ends_in_ed([ed_start_only[0]]) and not backend.ends_in_ed([])
    surrogate_tails = _tokens(backend, lambda t: t[:1] and 0xA0 <= t[0] <= 0xBF)
    other_tails = _tokens(backend, lambda t: t[:1] and 0x80 <= t[0] <= 0x9F)
    req = _ready(manager, StructuredOutputsParams(structural_tag=TAG), "Hi")
    assert manager.accept(req.request_id, [ed_end[0]]) is False
    before = _row(manager, req)  # (the output does not end in ED yet: tails allowed)
    assert before[surrogate_tails].any()
    req.output_token_ids.append(ed_end[0])
    row, raw = _row(manager, req), _raw_row(manager, req)
    assert raw[surrogate_tails].any() and not row[surrogate_tails].any()
    assert raw[other_tails].any() and torch_equal(row[other_tails], raw[other_tails])
    manager.forget([req.request_id])


def torch_equal(a, b) -> bool:
    return bool((a == b).all())


def test_rows_that_do_not_sample_get_no_mask_and_live_matchers_are_kept(manager):
    from pagedllm.request import RequestStatus
    from pagedllm.scheduler.output import ScheduledRequest

    req = _ready(manager, StructuredOutputsParams(choice=["yes", "no"]))
    assert manager.bitmask([ScheduledRequest(req.request_id, 1, 0, [], samples=False)]) is None  # a prefill chunk
    manager.forget([req.request_id])  # an ended request's id, reused by this live one: kept
    assert manager.tracks(req.request_id)
    req.status = RequestStatus.FINISHED_ABORTED
    manager.forget([req.request_id])
    assert not manager.tracks(req.request_id)


def test_accept_reports_the_end_and_refuses_a_token_the_grammar_does_not_take(manager):
    from pagedllm.request import RequestStatus

    tok = manager.tokenizer
    req = _ready(manager, StructuredOutputsParams(choice=["yes", "no"]), "ye")
    with pytest.raises(ValueError, match="does not fit"):
        manager.accept(req.request_id, tok.encode("x", add_special_tokens=False))
    assert manager.accept(req.request_id, tok.encode("s", add_special_tokens=False) + [tok.eos_token_id]) is True
    req.status = RequestStatus.FINISHED_STOPPED
    manager.forget([req.request_id])


def test_a_constraint_that_fails_to_compile_comes_back_with_its_error(manager):
    from pagedllm.request import Request
    from pagedllm.sampling_params import SamplingParams

    req = Request(request_id="fails", prompt=None, prompt_token_ids=[1],
                  sampling_params=SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(json={"$ref": "#"})))  # fmt: skip
    manager.add([req])
    ready = []
    while not ready:
        manager.wait_for_any(30)
        ready = manager.take_ready()
    [(samples, error)] = ready
    assert samples == [req] and isinstance(error, ValueError) and "admits no output" in str(error)
    assert not manager.tracks("fails")


def test_validate_needs_a_tokenizer():
    from pagedllm.structured_output.manager import StructuredOutputManager

    with pytest.raises(ValueError, match="need a tokenizer"):
        StructuredOutputManager(None, 10, frozenset()).validate(StructuredOutputsParams(regex="a"))


def test_free_whitespace_in_json_is_capped(manager):
    """Between JSON tokens at most MAX_JSON_WHITESPACE blanks (a small model loops on them)."""
    backend = manager.backend()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    compiled = backend.compile(StructuredOutputsParams(json=schema))
    assert backend.matcher(compiled).accept_string("{\n" + " " * (MAX_JSON_WHITESPACE - 1) + '"a": 1}')
    assert not backend.matcher(compiled).accept_string("{" + " " * (MAX_JSON_WHITESPACE + 1) + '"a": 1}')
    tight = backend.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert backend.matcher(tight).accept_string('{"a": 1}') or backend.matcher(tight).accept_string('{"a":1}')
    assert not backend.matcher(tight).accept_string('{ "a":1}')


@pytest.mark.parametrize("params, said", [(StructuredOutputsParams(regex="("), "The parenthesis is not closed"),
                                          (StructuredOutputsParams(grammar="root ::= x"), 'Rule "x" is not defined')])  # fmt: skip
def test_grammar_errors_reach_the_user_without_xgrammars_source_location(params, said):
    with pytest.raises(ValueError) as e:
        parse(params)
    message = str(e.value)
    assert message.startswith(f"structured_outputs.{params.kind} is invalid: ") and said in message
    assert ".cc:" not in message and not re.search(r"\[\d+:\d+:\d+\]", message)


# ------------------------------------------------------------------ bugs the audit found (fixed with these tests)
def test_a_backspace_in_a_character_class_is_a_control_character():
    """Inside [...] a regex's \\b is a backspace (U+0008), not a word boundary: the grammar takes
    it raw inside a JSON string (invalid JSON), and the JSON rows of the mask ban it, so a
    pattern that needs one leaves a row with no token at all (as a tab did)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": r"^a[\b]b$"}}, "required": ["s"]}
    assert _grammar_accepts(schema, '{"s": "a\bb"}')
    with pytest.raises(ValueError, match="can match the control character"):
        parse(StructuredOutputsParams(json=schema))
