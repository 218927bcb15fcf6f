"""OpenAI tool calling: check ``tools`` and ``tool_choice``, and turn a forced choice into a
grammar.

``tool_choice``:
- ``"none"``: the model answers in text (the template still sees the tools);
- ``"auto"`` (the default when tools are given): the model may call tools in its own format,
  found by the server's ``--tool-call-parser`` (needs ``--enable-auto-tool-choice``);
- ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}``
  objects, one schema per tool (one call when ``parallel_tool_calls`` is false);
- ``{"type": "function", "function": {"name": N}}``: the output is constrained to N's
  parameter schema and is N's arguments.
So a forced call is valid against its tool's schema whatever the model's size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers import ToolCall, arguments_json
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import SUBSCHEMA_MAPS

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolChoice:
    mode: str  # none | auto | required | named
    tools: list[dict[str, Any]]  # each {"type": "function", "function": {name, description?, parameters?}}
    name: str | None = None  # the named function
    parallel: bool = True

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar a forced choice needs (None for none/auto)."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self._parameters(self.name))
        if self.mode != "required":
            return None
        items, defs = [], {}
        for i, t in enumerate(self.tools):
            parameters = self._parameters(t["function"]["name"])
            if _has_ref(parameters):
                # Its references point into its own root: it moves to the wrapper's $defs, with
                # them rewritten to point there ("#/$defs/Addr" -> "#/$defs/tool0/$defs/Addr").
                defs[f"tool{i}"] = _refs_under(parameters, f"#/$defs/tool{i}")
                parameters = {"$ref": f"#/$defs/tool{i}"}
            items.append({
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]}, "parameters": parameters},
                "required": ["name", "parameters"],
            })  # fmt: skip
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items} if len(items) > 1 else items[0]}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return StructuredOutputsParams(json=schema)

    def _parameters(self, name: str | None) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or _EMPTY_PARAMETERS
        raise KeyError(name)

    def declares(self, calls: list[ToolCall]) -> bool:
        """Whether every call names a function of ``tools`` (a model may invent one: its reply
        is then text, as OpenAI never returns a call to a function it was not given)."""
        names = {t["function"]["name"] for t in self.tools}
        return all(c.name in names for c in calls)

    def calls(self, text: str) -> list[ToolCall] | None:
        """The calls in a forced choice's (grammar-shaped) output; None if it is incomplete."""
        try:  # (a stop string or max_tokens may cut the grammar's output short; nesting may be deep)
            if self.mode == "named":
                args = arguments_json(text.strip())
                return None if args is None else [ToolCall(self.name or "", args)]
            items = json.loads(text)
            return [ToolCall(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False, allow_nan=False)) for i in items]
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return None


_VALUES = ("const", "enum", "default", "examples")  # JSON values in a schema, never rewritten


def _has_ref(schema: Any) -> bool:
    """Whether ``schema`` holds a local reference (rebasing it changes something)."""
    return _refs_under(schema, "#/$defs/x") != schema


def _refs_under(schema: Any, root: str, is_map: bool = False) -> Any:
    """``schema`` with each local ``$ref`` ("#...") rebased onto ``root`` (where it now lives).
    In a name -> schema map (``is_map``) the keys are names, so a property called "default" is
    a schema like any other."""
    if isinstance(schema, list):
        return [_refs_under(v, root) for v in schema]
    if not isinstance(schema, dict):
        return schema
    if is_map:
        return {k: _refs_under(v, root) for k, v in schema.items()}
    return {k: root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
            else v if k in _VALUES else _refs_under(v, root, k in SUBSCHEMA_MAPS) for k, v in schema.items()}  # fmt: skip


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """ValueError naming the problem unless ``tools`` is a list of OpenAI function tools."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        if name in names:
            raise ValueError(f"tools[{i}].function.name {name!r} is given twice")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        try:
            json.dumps(fn)  # (Python callers can put sets or objects in; the prompt shows it as JSON)
        except (TypeError, ValueError, RecursionError) as e:
            raise ValueError(f"tools[{i}].function cannot be written as JSON: {e}") from None
    return tools


def resolve_tool_choice(tools: Any, tool_choice: Any, parallel: bool, auto_enabled: bool) -> ToolChoice | None:
    """The request's ToolChoice (None without tools); ValueError for what cannot be honoured."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return None
    tools = check_tools(tools)
    choice = tool_choice if tool_choice is not None else "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError("tool_choice must be none, auto, required or {'type': 'function', 'function': {'name': ...}}")
        if name not in {t["function"]["name"] for t in tools}:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        return ToolChoice("named", tools, name, parallel)
    if choice not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice must be none, auto, required or a named function, got {choice!r}")
    if choice == "auto" and not auto_enabled:
        raise ValueError('tool_choice "auto" (the default with tools) needs a server started with '
                         "--enable-auto-tool-choice and --tool-call-parser; or pass tool_choice \"required\", "
                         "\"none\" or a named function")  # fmt: skip
    return ToolChoice(choice, tools, None, parallel)
