"""The tool-call parsers for tool_choice auto: whole replies and streamed ones."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.tool_parsers import StreamingToolCalls, get_tool_parser

CASES = {
    "hermes": (
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"tz_offset": 1}}</tool_call>',
        "Let me check.",
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
    assert rest == "" and "<tool" not in sent and (sent.strip() or None) == content
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
