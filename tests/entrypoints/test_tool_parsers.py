"""The tool-call parsers for tool_choice auto: whole replies and streamed ones."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.tool_parsers import StreamingToolCalls, get_tool_parser

CASES = {
    "hermes": (
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"tz_offset": 1}}</tool_call>',
        "Let me check. ",  # as written, and as streamed (vLLM's hermes parser does not strip it)
    ),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"tz_offset": 1}}', None),
    "pythonic": ('[get_weather(city="Paris"), get_time(tz_offset=1)]', None),
}
EXPECTED = [("get_weather", {"city": "Paris"}), ("get_time", {"tz_offset": 1})]


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_reply(name):
    text, content = CASES[name]
    got_content, calls = get_tool_parser(name).extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_reply_sends_content_then_calls(name, step):
    text, content = CASES[name]
    stream = StreamingToolCalls(get_tool_parser(name))
    sent = "".join(stream.feed(text[i : i + step]) for i in range(0, len(text), step))
    rest, calls = stream.finish()
    assert rest == "" and "<tool" not in sent and (sent or None) == content  # the content of the whole reply
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("text", ["The answer is 42 <tool", "[not a call", "{broken json", "  plain words, no calls"])
def test_text_that_is_no_call_stays_content(name, text):
    assert get_tool_parser(name).extract(text) == (text, [])
    stream = StreamingToolCalls(get_tool_parser(name))
    sent = "".join(stream.feed(ch) for ch in text)
    rest, calls = stream.finish()
    assert sent + rest == text and calls == []


def test_unknown_parser_is_a_clear_error():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


# What a model may write that looks like calls but is none (found by an adversarial session:
# each was a 500, or a stream cut off without an error event).
MALFORMED = {
    "pythonic": ["[f(a={1, 2})]", "[f(a={[1]})]", "[f(a=b'x')]", "[f(a=1e999)]", "[f(a=" + "[" * 1100 + "]" * 1100 + ")]"],
    "hermes": ["<tool_call>" + "[" * 1100, '<tool_call>{"name": "f", "arguments": "oops"}</tool_call>',
               '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
               '<tool_call>{"name": "f", "arguments": "{\\"x\\": NaN}"}</tool_call>'],
    "llama3_json": ['{"name": "f", "parameters": ' + "[" * 1100 + "]" * 1100 + "}", '{"name": "f", "parameters": "[1]"}'],
}  # fmt: skip


@pytest.mark.parametrize("name,text", [(n, t) for n, texts in MALFORMED.items() for t in texts])
def test_malformed_calls_are_content_never_an_error(name, text):
    assert get_tool_parser(name).extract(text) == (text, [])
    stream = StreamingToolCalls(get_tool_parser(name))
    sent = stream.feed(text)
    rest, calls = stream.finish()
    assert sent + rest == text and calls == []


def test_hermes_arguments_written_as_json_text_are_taken():
    _, calls = get_tool_parser("hermes").extract('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1})]


def _streamed(tools, parser, text: str, finish_reason: str):
    """A choice's deltas through the server's tool stream, the text fed in 3-character pieces."""
    from pagedllm.entrypoints.openai.serving import _ToolStream

    stream, deltas = _ToolStream(tools, parser), []
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    for k, piece in enumerate(pieces):
        deltas.append(stream.delta(piece, finish_reason if k == len(pieces) - 1 else None))
    content = "".join(d.get("content", "") for d, _ in deltas)
    calls = [c for d, _ in deltas for c in d.get("tool_calls", [])]
    return content, calls, deltas[-1][1]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_stream_cut_by_max_tokens_sends_the_call_text_as_content():
    from pagedllm.entrypoints.openai.tools import ToolChoice

    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
    content, calls, made = _streamed(ToolChoice("auto", TOOLS), get_tool_parser("hermes"), text, "length")
    assert content == text and calls == [] and not made  # the call text was lost


def test_a_call_to_an_undeclared_function_is_content():
    from pagedllm.entrypoints.openai.tools import ToolChoice

    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    content, calls, made = _streamed(ToolChoice("auto", TOOLS), get_tool_parser("hermes"), text, "stop")
    assert content == text and calls == [] and not made
    content, calls, made = _streamed(ToolChoice("auto", TOOLS), get_tool_parser("hermes"), text.replace("rm_rf", "get_weather"), "stop")
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather"] and made


def test_named_call_cut_by_a_stop_string_is_not_a_tool_call():
    from pagedllm.entrypoints.openai.tools import ToolChoice

    named = ToolChoice("named", TOOLS, "get_weather")
    _, _, made = _streamed(named, None, '{\n  "city": "Paris",\n  ', "stop")
    assert not made  # finish_reason stays "stop", not "tool_calls" with arguments that do not parse
    _, calls, made = _streamed(named, None, '{"city": "Paris"}', "stop")
    assert made and "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'


class _AbortRecorder:
    """The engine as ``_aborting_on_exit`` sees it: the request ids it was asked to abort."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


def test_a_failure_in_the_servers_own_stream_code_ends_with_an_error_event():
    """Not only engine errors: any exception while a stream is written gives the client an
    error event and [DONE] (a parser bug cut streams off mid-body), and aborts the request."""
    import asyncio

    from pagedllm.entrypoints.openai.serving import _aborting_on_exit

    async def body():
        yield "data: {}\n\n"
        raise RuntimeError("a bug")

    async def collect(engine):
        return [chunk async for chunk in _aborting_on_exit(engine, ["r1"], body())]

    engine = _AbortRecorder()
    chunks = asyncio.run(collect(engine))
    assert chunks[0] == "data: {}\n\n" and chunks[-1] == "data: [DONE]\n\n"
    error = json.loads(chunks[1].removeprefix("data: "))["error"]
    assert error["code"] == 500 and "r1" in error["message"] and engine.aborted == ["r1"]


def test_a_client_leaving_after_the_first_chunk_aborts_requests_no_stream_has_started():
    """A chat stream sends its role chunk before it awaits the engine: a client that leaves
    then has started none of the output streams (whose own cleanup also aborts), so closing
    the response must abort every request of it."""
    import asyncio

    from pagedllm.entrypoints.openai.serving import _aborting_on_exit

    started = []

    async def outputs():  # an engine output stream: never reached
        started.append(True)
        yield "token"

    async def body():
        yield 'data: {"role": "assistant"}\n\n'
        async for out in outputs():
            yield out

    async def leave_after_first(engine):
        stream = _aborting_on_exit(engine, ["r1-0", "r1-1"], body())
        first = await stream.__anext__()
        await stream.aclose()  # what the server does when the client disconnects
        return first

    engine = _AbortRecorder()
    assert asyncio.run(leave_after_first(engine)).startswith("data: ")
    assert engine.aborted == ["r1-0", "r1-1"] and not started


def test_earlier_calls_are_shown_with_their_arguments_as_an_object():
    """For templates that ignore tools, earlier calls are written into the text: with the
    arguments object the system note asks the model for, not OpenAI's JSON string of it."""
    from pagedllm.engine.chat import describe_tools

    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    shown = describe_tools(messages, TOOLS)[2]["content"]
    assert shown == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_forced_calls_with_numbers_json_cannot_hold_are_no_calls():
    from pagedllm.entrypoints.openai.tools import ToolChoice

    required = ToolChoice("required", TOOLS)
    assert required.calls('[{"name": "get_weather", "parameters": {"x": 1e999}}]') is None  # (would be sent as Infinity)
    assert [c.name for c in required.calls('[{"name": "get_weather", "parameters": {"x": 1}}]')] == ["get_weather"]


def test_required_keeps_each_tools_own_references():
    """Found by an adversarial session: under tool_choice "required" a tool's parameters were
    nested in the wrapper schema with their $refs unchanged, so "#/$defs/Addr" (pydantic's
    nested models) was a 400 and "#" (a recursive tree) pointed at the wrapper itself."""
    import jsonschema
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from pagedllm.entrypoints.openai.tools import ToolChoice
    from pagedllm.structured_output.backend import parse

    tree = {"$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
            "type": "object", "properties": {"addr": {"$ref": "#/$defs/Addr"}, "child": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}},
            "required": ["addr", "child"]}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "tree", "parameters": tree}}, *TOOLS]
    constraint = ToolChoice("required", tools).constraint()
    parse(constraint)  # (a 400 before)
    grammar = xgr.Grammar.from_json_schema(constraint.spec, any_whitespace=False)
    good = {"addr": {"city": "x"}, "child": {"addr": {"city": "y"}, "child": None}}
    jsonschema.validate(good, tree)
    assert _is_grammar_accept_string(grammar, json.dumps([{"name": "tree", "parameters": good}]))
    wrapper_shaped = {"addr": {"city": "x"}, "child": [{"name": "tree"}]}
    assert not _is_grammar_accept_string(grammar, json.dumps([{"name": "tree", "parameters": wrapper_shaped}]))
    # A "$ref" inside a value (const, enum, default) is data, left as it is.
    # ... but a property named "default" (or enum, const) is a schema like any other (the review).
    valued = {"type": "object", "properties": {"k": {"const": {"$ref": "#"}}, "a": {"$ref": "#/properties/k"},
                                               "default": {"$ref": "#/$defs/Inner"}}, "$defs": {"Inner": {"type": "integer"}}}  # fmt: skip
    constraint = ToolChoice("required", [{"type": "function", "function": {"name": "v", "parameters": valued}}]).constraint()
    moved = json.loads(constraint.spec)
    assert moved["$defs"]["tool0"]["properties"] == {"k": {"const": {"$ref": "#"}}, "a": {"$ref": "#/$defs/tool0/properties/k"},
                                                     "default": {"$ref": "#/$defs/tool0/$defs/Inner"}}  # fmt: skip
    assert _is_grammar_accept_string(grammar, json.dumps([{"name": "get_weather", "parameters": {}}]))
