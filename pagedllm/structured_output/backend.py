"""The constraint backend: xgrammar turns a constraint into a token-level automaton.

Two stages, as xgrammar has them. ``parse`` checks a constraint without a tokenizer (a
millisecond: the server calls it before a request is queued, so a bad schema, regex or
grammar is a 400). ``compile`` builds the token masks for this model's vocabulary (up to
about a second for a big schema, cached by xgrammar's compiler, run off the engine thread).
A ``GrammarMatcher`` per sequence then walks the automaton as tokens are accepted.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import torch

from pagedllm.sampling_params import StructuredOutputsParams

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; users need the rest.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
COMPILE_CACHE_BYTES = 256 << 20
# Free whitespace between JSON tokens is capped: enough for pretty-printed JSON nested ten
# deep, and no room for a small model to loop on blank space forever (as they do uncapped).
MAX_JSON_WHITESPACE = 24
_ANY_OBJECT = '{"type": "object"}'


def _message(error: BaseException) -> str:
    return _CPP_PREFIX.sub("", str(error).strip()).strip() or type(error).__name__


def _whitespace(params: StructuredOutputsParams) -> dict[str, Any]:
    if params.disable_any_whitespace:
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def choice_ebnf(choices: list[str]) -> str:
    """A grammar whose sentences are exactly ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _structural_tag_args(tag: dict | str) -> tuple[Any, ...]:
    """vLLM's legacy form ({"structures": [{begin, schema, end}], "triggers": [...]}) as
    xgrammar's (items, triggers); anything else is passed on as xgrammar's own JSON format.
    (Its errors are worded to follow the caller's "structured_outputs.structural_tag is invalid: ".)"""
    import xgrammar as xgr

    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from e
    if not isinstance(tag, dict):
        raise ValueError("it must be a JSON object")
    if "structures" in tag:
        try:
            items = [
                xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                for s in tag["structures"]
            ]
            return items, list(tag["triggers"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"each structure needs begin, schema, end; "
                             f"and triggers are required ({e})") from e  # fmt: skip
    return (json.dumps(tag),)


# JSON Schema keywords xgrammar's converter passes over without enforcing them (a test checks,
# for each, that the grammar accepts an output breaking it). A schema using one is refused, so
# an output that ends with finish_reason "stop" is valid against its schema. Two gaps are left
# on purpose, as vLLM leaves them: ``uniqueItems`` (pydantic writes it for every set field, and
# pydantic folds duplicates when it reads one) and overlapping ``oneOf`` branches (run as anyOf;
# pydantic's discriminated unions never overlap). unevaluatedProperties / unevaluatedItems are
# passed over too, but strict mode already forbids what they would: unlisted properties, items.
UNENFORCED_KEYWORDS = ("contains", "minContains", "maxContains", "if", "then", "else", "not", "dependentRequired",
                       "dependentSchemas", "dependencies")  # fmt: skip
# Where a schema holds subschemas: one, a list of them, or a name -> subschema map.
_SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "contains", "not", "if", "then", "else",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties")  # fmt: skip
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema


_RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


@functools.lru_cache(maxsize=1024)  # (every request's schema is checked; the same patterns come back)
def _regex_ok(pattern: str) -> bool:
    """Whether xgrammar's regex converter takes ``pattern`` (in a schema it drops what it cannot)."""
    import xgrammar as xgr

    try:
        xgr.Grammar.from_regex(pattern)
        return True
    except Exception:
        return False


_HEX_ESCAPE = {"x": re.compile(r"[0-9a-fA-F]{2}"), "u": re.compile(r"\{[0-9a-fA-F]+\}|[0-9a-fA-F]{4}")}


def control_character_in(pattern: str) -> str | None:
    """The first part of a regex that stands for a control character (U+0000-U+001F: a raw one,
    or an escape such as \\t, \\n, \\x09, \\u000a, \\cI), else None.

    Inside a JSON string xgrammar matches a schema's ``pattern`` against the raw text, so such a
    character would be written raw, which JSON forbids (an adversarial session saw a raw newline
    in an output ending with "stop", and a tab, which the JSON rows of the mask ban, leave a row
    with no token at all)."""
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if ord(c) < 0x20:
            return repr(c)
        if c == "[" or (c == "]" and in_class):
            in_class = c == "["
        if c == "\\" and i + 1 < len(pattern):
            e = pattern[i + 1]
            if e in "tnrfv0ae" or e == "b" and in_class:  # (\b: a backspace in a class, else a word boundary)
                return pattern[i : i + 2]
            if e == "c" and i + 2 < len(pattern) and pattern[i + 2].isalpha():
                return pattern[i : i + 3]
            if e in _HEX_ESCAPE and (m := _HEX_ESCAPE[e].match(pattern, i + 2)):
                if int(m.group().strip("{}"), 16) < 0x20:
                    return pattern[i : m.end()]
            i += 2
            continue
        i += 1
    return None


def unenforced_keywords(schema: Any, path: str = "#") -> list[str]:
    """Where ``schema`` uses a keyword the grammar cannot enforce: ["#/properties/a: contains", ...]."""
    if not isinstance(schema, dict):
        return []
    found = [f"{path}: {k}" for k in UNENFORCED_KEYWORDS if k in schema]
    if schema.get("type") == []:
        found.append(f"{path}: type [] (no value can match)")
    # What xgrammar's converter drops with at most a warning on stderr (an adversarial session
    # found outputs ending with "stop" that broke each):
    if "multipleOf" in schema and (schema.get("type") != "integer" or any(k in schema for k in _RANGE)):
        found.append(f"{path}: multipleOf (enforced only on integers without a range)")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        found.append(f"{path}: allOf of more than one schema")
    required, properties = schema.get("required"), schema.get("properties")
    if isinstance(required, list):
        missing = [r for r in required if not isinstance(properties, dict) or r not in properties]
        if missing:
            found.append(f"{path}: required {missing[0]!r} is not among its properties")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        found.append(f"{path}: $ref {ref!r} (only references inside the schema)")
    if isinstance(schema.get("pattern"), str) and not _regex_ok(schema["pattern"]):
        found.append(f"{path}: pattern {schema['pattern']!r} (a regex feature the grammar lacks, e.g. lookaround)")
    patterns = [schema["pattern"]] if isinstance(schema.get("pattern"), str) else []
    if isinstance(schema.get("patternProperties"), dict):
        patterns += [p for p in schema["patternProperties"] if isinstance(p, str)]
    for pattern in patterns:
        if (control := control_character_in(pattern)) is not None:
            found.append(f"{path}: pattern {pattern!r} (it can match the control character {control}, which the "
                         f"grammar would write raw into a JSON string)")  # fmt: skip
    for key in _SUBSCHEMA:
        found += unenforced_keywords(schema.get(key), f"{path}/{key}")
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                found += unenforced_keywords(sub, f"{path}/{key}/{i}")
    for key in SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                found += unenforced_keywords(sub, f"{path}/{key}/{name}")
    return found


def _tag_schemas(tag: Any) -> list[Any]:
    """The JSON schemas inside a structural tag, in either form (under "schema" or "json_schema")."""
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except json.JSONDecodeError:
            return []  # (_structural_tag_args says what is wrong with it)
    if isinstance(tag, list):
        return [s for item in tag for s in _tag_schemas(item)]
    if not isinstance(tag, dict):
        return []
    found = [v for k, v in tag.items() if k in ("schema", "json_schema") and isinstance(v, dict)]
    return found + [s for k, v in tag.items() if k not in ("schema", "json_schema") for s in _tag_schemas(v)]


def _refuse_unenforced(schemas: list[Any]) -> None:
    try:
        unenforced = [where for schema in schemas for where in unenforced_keywords(schema)]
    except RecursionError:
        raise ValueError("the schema is nested too deeply") from None
    if unenforced:
        raise ValueError(f"the schema uses keywords the grammar cannot enforce ({'; '.join(unenforced[:5])}); "
                         f"outputs could break them, so the schema is refused")  # fmt: skip


def parse(params: StructuredOutputsParams) -> None:
    """Raise ValueError naming the problem if the constraint is not valid (no tokenizer needed)."""
    import xgrammar as xgr

    kind = params.kind
    try:
        if kind == "json":
            schema = params.spec  # (the caller's string, or its dict or pydantic model written out)
            try:
                _refuse_unenforced([json.loads(schema)])
            except json.JSONDecodeError as e:
                raise ValueError(f"the schema is not valid JSON ({e})") from e
            xgr.Grammar.from_json_schema(schema, **_whitespace(params))
        elif kind == "regex":
            xgr.Grammar.from_regex(params.regex)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(params.grammar)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        elif kind == "structural_tag":
            _refuse_unenforced(_tag_schemas(params.structural_tag))
            xgr.Grammar.from_structural_tag(*_structural_tag_args(params.structural_tag))
    except ValueError as e:
        raise ValueError(f"structured_outputs.{kind} is invalid: {_message(e)}") from e
    except Exception as e:  # xgrammar reports parse errors as RuntimeError
        raise ValueError(f"structured_outputs.{kind} is invalid: {_message(e)}") from e


class XgrammarBackend:
    """Compiles constraints for one tokenizer and vocabulary, and makes matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_threads: int = 1):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_limit_bytes=COMPILE_CACHE_BYTES)
        self._batch = xgr.BatchGrammarMatcher(max_threads)
        # Rows AND-ed into JSON constraints' masks (json, json_object): no raw control character,
        # tab included; and into structural tags' (free text between their JSON parts): none but
        # tab, newline and carriage return.
        self.json_safe = self._mask_without(set(range(32)) - {10, 13})
        self.tag_safe = self._mask_without(set(range(32)) - {9, 10, 13})
        # After a token ending in the lead byte ED: no token starting with A0-BF (a surrogate).
        vocab = self.info.decoded_vocab[: self.vocab_size]
        self._ends_in_ed = {t for t, text in enumerate(vocab) if text[-1:] == b"\xed"}
        self.no_surrogate_tail = self._pack([not (text[:1] and 0xA0 <= text[0] <= 0xBF) for text in vocab])

    def ends_in_ed(self, output_token_ids: list[int]) -> bool:
        return bool(output_token_ids) and output_token_ids[-1] in self._ends_in_ed

    def _mask_without(self, bad_bytes: set[int]) -> Any:
        """One bitmask row allowing every token but those holding one of ``bad_bytes``.

        xgrammar's rule for a length-bounded JSON string is "any character but quote, backslash,
        newline and carriage return", which lets raw control characters into such strings (tests
        found "\x11", and an adversarial session a tab, which JSON forbids there). Outside strings
        JSON needs none but whitespace: newline and carriage return are enough, so tokens holding
        a tab go too (a tab-indented object is still JSON written with spaces).
        """
        bad = bytes(bad_bytes)
        return self._pack([not any(b in bad for b in text) for text in self.info.decoded_vocab[: self.vocab_size]])

    def _pack(self, allowed: list[bool]) -> Any:
        """A bitmask row from one flag per token (tokens past the list: allowed)."""
        mask = torch.ones(self.bitmask_width * 32, dtype=torch.bool)
        mask[: len(allowed)] = torch.tensor(allowed, dtype=torch.bool)
        bits = mask.view(-1, 32).to(torch.int64) << torch.arange(32)
        words = bits.sum(dim=1)
        return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

    @property
    def bitmask_width(self) -> int:
        """int32 words per row of a token bitmask (bit t % 32 of word t // 32 allows token t)."""
        return (self.vocab_size + 31) // 32

    def compile(self, params: StructuredOutputsParams) -> Any:
        """A CompiledGrammar (xgrammar's compiler caches them by constraint). A constraint that
        admits no output at all (e.g. a JSON schema whose only type refers to itself) is a
        ValueError here, not a refused token later."""
        compiled = self._compile(params)
        first = self.matcher(compiled)
        if not first.is_terminated():
            # The matcher's own fill: this runs on the compiler's thread, and the batch filler
            # (fill_bitmask) belongs to the engine's.
            mask = torch.zeros(1, self.bitmask_width, dtype=torch.int32)
            first.fill_next_token_bitmask(mask)
            if not bool(mask.any()):
                raise ValueError(f"structured_outputs.{params.kind} admits no output: no token can start it")
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> Any:
        c = self.compiler
        kind = params.kind
        try:
            if kind == "json":
                return c.compile_json_schema(params.spec, **_whitespace(params))
            if kind == "json_object":  # any object (xgrammar's builtin JSON grammar allows any value)
                return c.compile_json_schema(_ANY_OBJECT, **_whitespace(params))
            if kind == "regex":
                return c.compile_regex(params.regex)
            if kind == "grammar":
                return c.compile_grammar(params.grammar)
            if kind == "choice":
                return c.compile_grammar(choice_ebnf(params.choice))
            return c.compile_structural_tag(*_structural_tag_args(params.structural_tag))
        except Exception as e:
            raise ValueError(f"structured_outputs.{kind} is invalid: {_message(e)}") from e

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, matchers: list[Any], bitmask: Any, json_rows: list[int] | None = None,
                     tag_rows: list[int] | None = None) -> None:  # fmt: skip
        """Row i of ``bitmask`` (an int32 tensor) gets the tokens ``matchers[i]`` allows next;
        ``json_rows`` (rows under a JSON constraint) and ``tag_rows`` (structural tags) also lose
        the control characters JSON forbids (``json_safe``, ``tag_safe``)."""
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        if json_rows:
            bitmask[json_rows] &= self.json_safe
        if tag_rows:
            bitmask[tag_rows] &= self.tag_safe
