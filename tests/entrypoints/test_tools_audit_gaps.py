"""Gaps a mutation audit of tool calling and chat-template handling found: behaviour no other
test pinned down (each test names what it guards)."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.tool_parsers import StreamingToolCalls, get_tool_parser
from pagedllm.entrypoints.openai.tools import ToolChoice, check_tools, resolve_tool_choice

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters at all
TOOLS = [WEATHER, PING]


def _accepts(constraint, text: str) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgr.Grammar.from_json_schema(constraint.spec, any_whitespace=False), text)


def _calls(*calls) -> str:
    return json.dumps([{"name": n, "parameters": p} for n, p in calls])


# ------------------------------------------------------------------ forced choices' grammars
def test_required_allows_one_call_only_when_parallel_calls_are_off():
    two = _calls(("get_weather", {"city": "Paris"}), ("ping", {}))
    one = _calls(("ping", {}))
    parallel, single = ToolChoice("required", TOOLS, parallel=True), ToolChoice("required", TOOLS, parallel=False)
    assert _accepts(parallel.constraint(), two) and _accepts(parallel.constraint(), one)
    assert _accepts(single.constraint(), one) and not _accepts(single.constraint(), two)


def test_required_needs_at_least_one_call():
    assert not _accepts(ToolChoice("required", TOOLS).constraint(), "[]")


def test_a_tool_without_parameters_takes_an_object_of_arguments():
    """OpenAI's arguments are always a JSON object: a function without ``parameters`` gets {}."""
    named = ToolChoice("named", TOOLS, "ping").constraint()
    assert _accepts(named, "{}")
    for not_an_object in ('"x"', "[1]", "3", "null"):
        assert not _accepts(named, not_an_object)
    assert not _accepts(ToolChoice("required", TOOLS).constraint(), _calls(("ping", "x")))


def test_named_call_arguments_are_the_json_without_surrounding_whitespace():
    calls = ToolChoice("named", TOOLS, "get_weather").calls('\n  {"city": "Paris"}\n')
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]


def test_a_reply_is_declared_only_if_every_call_is():
    choice = ToolChoice("auto", TOOLS)
    _, calls = get_tool_parser("hermes").extract(
        '<tool_call>{"name": "ping", "arguments": {}}</tool_call><tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>')
    assert [c.name for c in calls] == ["ping", "rm_rf"]
    assert choice.declares(calls[:1]) and not choice.declares(calls)


# ------------------------------------------------------------------ checking tools and tool_choice
def test_tools_are_checked():
    assert check_tools([{"function": {"name": "f"}}])  # "type" defaults to "function" (as vLLM's)
    for tools, message in [([], "non-empty list"), ([WEATHER, WEATHER], "given twice"),
                           ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "parameters must be a JSON schema"),
                           ([{"type": "retrieval", "function": {"name": "f"}}], r"tools\[0\] must be")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            check_tools(tools)


def test_tool_choice_is_resolved_as_openai_does():
    assert resolve_tool_choice(None, "none", True, False) is None  # "none" needs no tools
    assert resolve_tool_choice(None, None, True, False) is None
    with pytest.raises(ValueError, match="needs tools"):
        resolve_tool_choice(None, "required", True, False)
    with pytest.raises(ValueError, match="tool_choice must be"):
        resolve_tool_choice(TOOLS, {"type": "retrieval", "function": {"name": "ping"}}, True, True)
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        resolve_tool_choice(TOOLS, None, True, False)  # auto is the default with tools
    auto = resolve_tool_choice(TOOLS, None, False, True)
    assert (auto.mode, auto.parallel) == ("auto", False)
    named = resolve_tool_choice(TOOLS, {"type": "function", "function": {"name": "ping"}}, True, False)
    assert (named.mode, named.name) == ("named", "ping")


# ------------------------------------------------------------------ parsers
def test_a_call_without_arguments_has_an_empty_object():
    for name, text in [("hermes", '<tool_call>{"name": "ping"}</tool_call>'), ("llama3_json", '{"name": "ping"}')]:
        content, calls = get_tool_parser(name).extract(text)
        assert content is None and [(c.name, c.arguments) for c in calls] == [("ping", "{}")]


def test_a_name_that_is_not_a_string_is_no_call():
    text = '<tool_call>{"name": 1, "arguments": {}}</tool_call>'
    assert get_tool_parser("hermes").extract(text) == (text, [])


def test_hermes_prefers_arguments_to_parameters():
    _, calls = get_tool_parser("hermes").extract('<tool_call>{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}</tool_call>')
    assert [json.loads(c.arguments) for c in calls] == [{"a": 1}]


def test_llama3_json_takes_the_python_tag_and_newline_separated_calls():
    parser = get_tool_parser("llama3_json")
    assert parser.extract('<|python_tag|>{"name": "ping", "parameters": {}}')[1][0].name == "ping"
    content, calls = parser.extract('{"name": "ping", "parameters": {}}\n{"name": "f", "parameters": {}}')
    assert content is None and [c.name for c in calls] == ["ping", "f"]


def test_pythonic_edge_cases():
    parser = get_tool_parser("pythonic")
    content, calls = parser.extract('<|python_start|>[ping(), f(a=1)]<|python_end|>')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("ping", {}), ("f", {"a": 1})]
    for text in ["[f(1)]", "[]", "[f(a=1), 2]"]:  # positional arguments cannot be named: no call
        assert parser.extract(text) == (text, [])


# ------------------------------------------------------------------ streaming
def test_hermes_holds_back_a_whole_unfinished_start_tag():
    stream = StreamingToolCalls(get_tool_parser("hermes"))
    assert stream.feed("Hi <tool_call") == "Hi "
    assert stream.feed('>{"name": "ping"}</tool_call>') == ""
    assert [c.name for c in stream.finish()[1]] == ["ping"]


def test_hermes_reply_that_is_only_calls_has_no_content():
    assert get_tool_parser("hermes").extract('<tool_call>{"name": "ping"}</tool_call>')[0] is None


@pytest.mark.parametrize("name,call", [("llama3_json", '{"name": "ping", "parameters": {}}'), ("pythonic", "[ping()]")])
def test_whole_reply_parsers_hold_back_leading_whitespace_until_the_first_visible_character(name, call):
    stream = StreamingToolCalls(get_tool_parser(name))
    assert stream.feed("\n ") == ""  # it may still be followed by a call
    stream.feed(call)
    rest, calls = stream.finish()
    assert rest == "" and [c.name for c in calls] == ["ping"]
    text_stream = StreamingToolCalls(get_tool_parser(name))
    assert text_stream.feed("\n ") == "" and text_stream.feed("Hello") == "\n Hello"


# ------------------------------------------------------------------ chat templates
def _render(tok, messages, **kwargs) -> str:
    from pagedllm.engine.chat import render_chat

    return tok.decode(render_chat(tok, messages, **kwargs))


USER = {"role": "user", "content": "Weather?"}


def test_chat_message_shapes_as_templates_see_them(default_tokenizer):
    text = _render(default_tokenizer, [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                       {"role": "assistant", "content": None}], add_generation_prompt=False)  # fmt: skip
    assert "user\na\nb<|im_end|>" in text  # text parts joined by a newline (as vLLM)
    assert "<|im_start|>assistant\n<|im_end|>" in text  # content None is ""
    with pytest.raises(ValueError, match=r"content\[0\] must be a text part"):
        _render(default_tokenizer, [{"role": "user", "content": [{"type": "image_url", "text": "a"}]}])


def test_continue_final_message_is_checked(default_tokenizer):
    with pytest.raises(ValueError, match="cannot both be set"):
        _render(default_tokenizer, [USER, {"role": "assistant", "content": "It is"}], continue_final_message=True)
    with pytest.raises(ValueError, match="last message to be from the assistant"):
        _render(default_tokenizer, [USER], continue_final_message=True, add_generation_prompt=False)
    text = _render(default_tokenizer, [USER, {"role": "assistant", "content": "It is"}], continue_final_message=True,
                   add_generation_prompt=False)  # fmt: skip
    assert text.endswith("assistant\nIt is")


def test_an_empty_rendering_is_refused(default_tokenizer):
    with pytest.raises(ValueError, match="rendered the messages as empty text"):
        _render(default_tokenizer, [USER], chat_template="{% if false %}x{% endif %}")


def test_tools_described_in_the_one_system_message_for_a_template_that_ignores_them(default_tokenizer):
    earlier = [{"role": "system", "content": "Be brief."}, USER,
               {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    text = _render(default_tokenizer, earlier, tools=[WEATHER])
    assert text.count("<|im_start|>system") == 1
    assert "system\nBe brief.\n\nYou can call functions." in text and '"name": "get_weather"' in text
    assert "tool\n<tool_response>sunny</tool_response><|im_end|>" in text


def test_a_template_that_reads_tools_gets_them_and_the_arguments_as_objects(default_tokenizer):
    template = ("{{ tools | map(attribute='function.name') | join(',') }}|{% for m in messages %}{{ m.content }}"
                "{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %};{% endfor %}")  # fmt: skip
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]  # fmt: skip
    text = _render(default_tokenizer, messages, chat_template=template, tools=TOOLS, add_generation_prompt=False)
    assert text == "get_weather,ping|Weather?;Paris;"  # no system note: the template shows the tools itself


# ------------------------------------------------------------------ bugs the audit found (fixed with these tests)
@pytest.mark.parametrize("name,text", [("llama3_json", '<|python_tag|>{"name": "ping", "parameters": {}}'),
                                       ("pythonic", "<|python_start|>[ping()]<|python_end|>"),
                                       ("llama3_json", '\n {"name": "ping", "parameters": {}}'),
                                       ("pythonic", " \n[ping()]")])  # fmt: skip
@pytest.mark.parametrize("step", [1, 5, 1000])
def test_a_streamed_reply_finds_the_same_calls_as_the_whole_reply(name, text, step):
    """extract() takes the model's call prefix (<|python_tag|>, <|python_start|>), but the
    stream decided "no call" from the first visible character "<", sent the call as content
    and returned no calls: the same reply was tool_calls unstreamed and content streamed. And
    whitespace before the calls was streamed as content, where the whole reply has none."""
    content, calls = get_tool_parser(name).extract(text)
    assert content is None and [c.name for c in calls] == ["ping"]
    stream = StreamingToolCalls(get_tool_parser(name))
    sent = "".join(stream.feed(text[i : i + step]) for i in range(0, len(text), step))
    rest, calls = stream.finish()
    assert sent == rest == "" and [c.name for c in calls] == ["ping"]
