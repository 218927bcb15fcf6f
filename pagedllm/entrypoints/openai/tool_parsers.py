"""Tool-call parsers for ``tool_choice="auto"``: find the calls a model wrote in its own format.

``--tool-call-parser`` picks one (vLLM's names):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text around them;
- ``llama3_json``: the reply is ``{"name": ..., "parameters": {...}}`` objects separated by ``;``;
- ``pythonic``: the reply is a Python list of calls, ``[get_weather(city="Paris"), ...]``.

A reply that does not parse as calls is plain content (never an error: whatever a model writes,
e.g. a Python set, a number JSON cannot hold, or 1,000 nested brackets). Streaming holds back
only what may be the start of a call; once a call starts, the rest is buffered and the calls
are sent when the reply ends.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def arguments_json(args: Any) -> str | None:
    """A call's arguments as OpenAI's JSON text of an object (None if they are not one)."""
    if isinstance(args, str):  # already JSON text (some models write it so): a standard JSON object
        return args if isinstance(json.loads(args, parse_constant=_not_json), dict) else None
    return json.dumps(args, ensure_ascii=False, allow_nan=False) if isinstance(args, dict) else None


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # (Python's json reads NaN and Infinity; clients' parsers do not)


def _call_from_object(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_keys:
        if key in obj:
            args = arguments_json(obj[key])
            return None if args is None else ToolCall(obj["name"], args)
    return ToolCall(obj["name"], "{}")


class ToolParser:
    """Finds tool calls in a complete reply; the streaming hooks say where calls may start."""

    name = ""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content outside the calls or None, calls); no calls -> (text, [])."""
        try:
            return self._extract(text)
        except (ValueError, TypeError, RecursionError):  # JSON/literal errors, unencodable values, deep nesting
            return text, []

    def _extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def call_start(self, text: str) -> int | None:
        """Index in ``text`` (the reply so far) where a tool call begins, if one has."""
        raise NotImplementedError

    def holdback(self, text: str) -> int:
        """How many trailing characters of ``text`` might still turn into a call start."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def _extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for body in self._CALL.findall(text[start:]):
            call = _call_from_object(json.loads(body), ("arguments", "parameters"))
            if call is None:
                return text, []  # not well-formed: leave it to the client as text
            calls.append(call)
        content = text[:start]  # as written (and as streamed): vLLM's hermes parser does not strip it
        return (content or None), calls

    def call_start(self, text: str) -> int | None:
        i = text.find(self.START)
        return None if i < 0 else i

    def holdback(self, text: str) -> int:
        for n in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-n:]):
                return n
        return 0


class _WholeReplyParser(ToolParser):
    """Formats where the whole reply is the calls: decided by its first visible character, or
    by the special token a model may write before its calls (``tag``, which extract takes too)."""

    first_char = ""
    tag = ""

    def call_start(self, text: str) -> int | None:
        # At 0: the whitespace before the calls is theirs (the whole reply is the calls, so an
        # unstreamed reply has no content), and holdback kept it back until now.
        stripped = text.lstrip()
        starts = stripped.startswith(self.first_char) or bool(self.tag) and stripped.startswith(self.tag)
        return 0 if starts else None

    def holdback(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if not stripped or (self.tag and self.tag.startswith(stripped)) else 0


class Llama3JsonToolParser(_WholeReplyParser):
    name = "llama3_json"
    first_char = "{"
    tag = "<|python_tag|>"

    def _extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self.tag).strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            obj, i = decoder.raw_decode(body, i)
            call = _call_from_object(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            while i < len(body) and body[i] in " \t\r\n;":
                i += 1
        return None, calls


class PythonicToolParser(_WholeReplyParser):
    name = "pythonic"
    first_char = "["
    tag = "<|python_start|>"

    def _extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self.tag).removesuffix("<|python_end|>").strip()
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:  # (not a ValueError)
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return text, []
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False)))
        return None, calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, PythonicToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


class StreamingToolCalls:
    """One choice's stream: text deltas in, content deltas out; the calls when it ends."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of ``text`` already sent as content
        self.in_call = False

    def feed(self, delta: str) -> str:
        """The content that can be sent now."""
        self.text += delta
        if self.in_call:
            return ""
        start = self.parser.call_start(self.text)
        if start is not None and start >= self.sent:
            self.in_call = True
            out, self.sent = self.text[self.sent : start], start
            return out
        safe = max(self.sent, len(self.text) - self.parser.holdback(self.text))
        out, self.sent = self.text[self.sent : safe], safe
        return out

    def finish(self, accept: Callable[[list[ToolCall]], bool] = lambda calls: True) -> tuple[str, list[ToolCall]]:
        """(content still unsent, calls) once the reply is complete; calls that ``accept``
        refuses (a reply cut by max_tokens, an undeclared function) are sent as content."""
        _, calls = self.parser.extract(self.text)
        if calls and self.in_call and accept(calls):
            return "", calls
        return self.text[self.sent :], []
