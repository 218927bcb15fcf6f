"""Constraints the structured-output tests share, each with an independent checker."""

from __future__ import annotations

import json
import re

from pagedllm.bench.structured import ARITH_EBNF, DATE_REGEX, EMAIL_REGEX, valid_arith, valid_json

__all__ = ["ARITH_EBNF", "BOUNDED_ARITH_EBNF", "CHOICES", "DATE_REGEX", "EMAIL_REGEX", "PERSON_SCHEMA", "fullmatch",
           "valid_arith", "valid_json", "valid_json_object"]  # fmt: skip

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -10, "maximum": 10},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
}
CHOICES = ["positive", "negative", "neutral", 'it "depends"']
# The same language cut to sentences of at most three terms (a random model never stops the
# unbounded one); every sentence of it is one of ARITH_EBNF's.
BOUNDED_ARITH_EBNF = r"""
root ::= term | term op term | term op term op term
term ::= num | "(" num op num ")"
op ::= "+" | "-" | "*" | "/"
num ::= [1-9] [0-9]? | "0"
"""


def valid_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def fullmatch(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text) is not None
