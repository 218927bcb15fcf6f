"""Constraints the structured-output tests share, each with an independent checker."""

from __future__ import annotations

import json
import re

import jsonschema

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
DATE_REGEX = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
EMAIL_REGEX = r"[a-z]{1,12}\.?[a-z]{0,8}@[a-z]{2,10}\.(com|org|net)"
CHOICES = ["positive", "negative", "neutral", 'it "depends"']
# Arithmetic over small integers; a sentence may nest parentheses but is finite.
ARITH_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num ::= [1-9] [0-9]? | "0"
"""
# The same language cut to sentences of at most three terms (a random model never stops the
# unbounded one); every sentence of it is one of ARITH_EBNF's.
BOUNDED_ARITH_EBNF = r"""
root ::= term | term op term | term op term op term
term ::= num | "(" num op num ")"
op ::= "+" | "-" | "*" | "/"
num ::= [1-9] [0-9]? | "0"
"""


def valid_json(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def valid_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def valid_arith(text: str) -> bool:
    """A recursive-descent recogniser for ARITH_EBNF, written apart from the grammar engine."""
    pos = 0

    def peek() -> str:
        return text[pos] if pos < len(text) else ""

    def num() -> bool:
        nonlocal pos
        if peek() == "0":
            pos += 1
            return True
        if peek() and peek() in "123456789":
            pos += 1
            if peek().isdigit():
                pos += 1
            return True
        return False

    def factor() -> bool:
        nonlocal pos
        if peek() == "(":
            pos += 1
            if not expr() or peek() != ")":
                return False
            pos += 1
            return True
        return num()

    def term() -> bool:
        nonlocal pos
        if not factor():
            return False
        while peek() in ("*", "/") and peek():
            pos += 1
            if not factor():
                return False
        return True

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while peek() in ("+", "-") and peek():
            pos += 1
            if not term():
                return False
        return True

    return expr() and pos == len(text)


def fullmatch(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text) is not None
