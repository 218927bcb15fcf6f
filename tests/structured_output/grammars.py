"""Constraints the structured-output tests share, each with an independent checker."""

from __future__ import annotations

import json
import re

from pagedllm.bench import structured as bench
from pagedllm.bench.structured import ARITH_EBNF, DATE_REGEX, EMAIL_REGEX, valid_arith, valid_json

__all__ = ["ARITH_EBNF", "BOUNDED_ARITH_EBNF", "CHOICES", "DATE_REGEX", "EMAIL_REGEX", "PERSON_SCHEMA", "fullmatch",
           "valid_arith", "valid_json", "valid_json_object"]  # fmt: skip

def _shorter_strings(node, limit: int = 12):
    """The schema with every string capped at ``limit`` characters (a random model fills them)."""
    if isinstance(node, dict):
        out = {k: _shorter_strings(v, limit) for k, v in node.items()}
        if "maxLength" in out:
            out["maxLength"] = min(out["maxLength"], limit)
        return out
    if isinstance(node, list):
        return [_shorter_strings(v, limit) for v in node]
    return node


PERSON_SCHEMA = _shorter_strings(bench.PERSON_SCHEMA)
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
