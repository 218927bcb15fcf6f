"""Schema keywords xgrammar passes over are refused (an adversarial session found outputs with
finish_reason "stop" that broke uniqueItems, if/then and dependentRequired)."""

from __future__ import annotations

import json

import pytest

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import UNENFORCED_KEYWORDS, parse, unenforced_keywords

PAIR = {"a": {"type": "integer"}, "b": {"type": "integer"}}
ARRAY = {"type": "array", "items": {"type": "integer"}}
# Each keyword in a schema, and an output that breaks the schema through that keyword alone.
USES = {
    "contains": ({**ARRAY, "contains": {"const": 1}}, "[2]"),
    "minContains": ({**ARRAY, "contains": {"const": 1}, "minContains": 2}, "[2, 3]"),
    "maxContains": ({**ARRAY, "contains": {"const": 1}, "maxContains": 1}, "[1, 1]"),
    "if": ({"type": "object", "properties": PAIR, "if": {"properties": {"a": {"const": 1}}, "required": ["a"]},
            "then": {"required": ["b"]}}, '{"a": 1}'),  # fmt: skip
    "else": ({"type": "object", "properties": PAIR, "if": {"required": ["a"]}, "else": {"required": ["b"]}}, "{}"),
    "dependentRequired": ({"type": "object", "properties": PAIR, "dependentRequired": {"a": ["b"]}}, '{"a": 17}'),
    "dependentSchemas": ({"type": "object", "properties": PAIR, "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 17}'),
    "dependencies": ({"type": "object", "properties": PAIR, "dependencies": {"a": ["b"]}}, '{"a": 17}'),
    "not": ({"type": "string", "not": {"enum": ["x"]}}, '"x"'),
}


@pytest.mark.parametrize("keyword", sorted(USES))
def test_the_grammar_lets_each_listed_keyword_be_broken_and_parse_refuses_it(keyword):
    import jsonschema
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    assert keyword in UNENFORCED_KEYWORDS
    schema, breaking = USES[keyword]
    # The list is honest: xgrammar's grammar takes an output the schema forbids.
    draft = jsonschema.Draft7Validator if keyword == "dependencies" else jsonschema.Draft202012Validator  # (draft 7's word)
    assert not draft(schema).is_valid(json.loads(breaking))
    assert _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False), breaking)
    with pytest.raises(ValueError, match=f"structured_outputs.json is invalid: the schema uses keywords .*{keyword}"):
        parse(StructuredOutputsParams(json=schema))


def test_keywords_are_found_where_subschemas_are_and_only_there():
    schema = {"type": "object", "properties": {"contains": {"type": "string"},  # a property's name, not a keyword
                                               "tags": {**ARRAY, "not": {"const": []}}},
              "$defs": {"x": {"anyOf": [{"if": {}}]}}, "items": [{"dependentRequired": {}}]}  # fmt: skip
    assert unenforced_keywords(schema) == ["#/items/0: dependentRequired", "#/properties/tags: not", "#/$defs/x/anyOf/0: if"]
    assert unenforced_keywords({"type": []}) == ["#: type [] (no value can match)"]
    parse(StructuredOutputsParams(json={"type": "object", "properties": {"contains": {"type": "string"}}}))  # accepted


def test_pydantic_sets_and_discriminated_unions_stay_accepted():
    """Two gaps left on purpose (as vLLM leaves them): pydantic writes uniqueItems for every
    set field (and folds duplicates when it reads one), and oneOf for discriminated unions."""
    from typing import Literal, Union

    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        kind: Literal["cat"]

    class Dog(BaseModel):
        kind: Literal["dog"]

    class Pets(BaseModel):
        tags: set[str]
        pet: Union[Cat, Dog] = Field(discriminator="kind")

    schema = Pets.model_json_schema()
    assert "uniqueItems" in json.dumps(schema) and "oneOf" in json.dumps(schema)
    parse(StructuredOutputsParams(json=schema))


def test_schemas_inside_structural_tags_are_checked_too():
    bad = {"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]}}
    legacy = {"structures": [{"begin": "<f>", "schema": bad, "end": "</f>"}], "triggers": ["<f>"]}
    with pytest.raises(ValueError, match="structured_outputs.structural_tag is invalid: the schema uses keywords .*#: if"):
        parse(StructuredOutputsParams(structural_tag=json.dumps(legacy)))


# What xgrammar's converter drops with only a warning (an adversarial session's outputs ended
# with "stop" and broke each): a schema, an output the grammar takes that breaks it, the refusal.
DROPPED = {
    "multipleOf with a range": ({"type": "integer", "multipleOf": 7, "minimum": 1}, "5", "multipleOf"),
    "allOf": ({"allOf": [{"type": "integer", "minimum": 50}, {"maximum": 60}]}, '{"target": 1}', "allOf of more than one"),
    "required, no properties": ({"type": "object", "properties": {}, "required": ["a"]}, "{}", "required 'a'"),
    "lookahead": ({"type": "string", "pattern": "^(?=a)b$"}, '"b"', "pattern"),
}


@pytest.mark.parametrize("case", sorted(DROPPED))
def test_what_the_converter_drops_is_refused(case):
    import jsonschema
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    schema, breaking, refusal = DROPPED[case]
    assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(breaking))
    assert _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False), breaking)
    with pytest.raises(ValueError, match=f"the schema uses keywords .*{refusal}"):
        parse(StructuredOutputsParams(json=schema))


def test_enforced_uses_of_those_keywords_stay_accepted():
    for schema in ({"type": "integer", "multipleOf": 7}, {"allOf": [{"type": "integer"}]}, {"type": "string", "pattern": "^[a-z]+$"},
                   {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"], "$defs": {"x": {"type": "string"}}}):  # fmt: skip
        parse(StructuredOutputsParams(json=schema))
    with pytest.raises(ValueError, match="only references inside the schema"):
        parse(StructuredOutputsParams(json={"$ref": "http://example.com/s.json"}))


@pytest.mark.parametrize("pattern, value", [(r"^a\tb$", "a\tb"), (r"^a\nb$", "a\nb"), (r"^a\r\nb$", "a\r\nb"),
                                            (r"^a\u000ab$", "a\nb"), (r"^[\t-\r]+$", "\n"), (r"^a\cIb$", "a\tb"),
                                            ("^a\x01b$", None), ("^a\x1fb$", None), (r"^a\x1fb$", None),
                                            (r"^a\u001Fb$", None)])  # fmt: skip
def test_a_pattern_that_writes_a_control_character_raw_is_refused(pattern, value):
    """Found by an adversarial session: xgrammar matches a string's pattern against the JSON text,
    so a pattern's newline came out raw (invalid JSON, finish_reason "stop") and a tab, which the
    JSON rows of the mask ban, left no token to sample (HTTP 500)."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}
    if value is not None:  # the grammar takes the raw character, and the text is not JSON
        text = '{"s": "' + value + '"}'
        assert _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False), text)
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)
    with pytest.raises(ValueError, match="structured_outputs.json is invalid: .*can match the control character"):
        parse(StructuredOutputsParams(json=schema))
    in_names = {"type": "object", "patternProperties": {pattern: {"type": "integer"}}}
    with pytest.raises(ValueError, match="can match the control character"):
        parse(StructuredOutputsParams(json=in_names))


def test_patterns_without_control_characters_stay_accepted():
    for pattern in (r"^a\sb$", r"^[^,]+$", r"^.+$", r"^a\\tb$", r"^[ -~]*$", r"^\d{3}-\u00e9$", r"^\x41$"):
        parse(StructuredOutputsParams(json={"type": "string", "pattern": pattern}))
