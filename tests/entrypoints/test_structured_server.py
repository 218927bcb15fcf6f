"""Structured outputs and tool calling through a real server and the official openai client.

The tiny random model knows nothing: every valid JSON, tool call and argument here is the
grammar's doing (the real model's run is in tests/structured_output/test_real_model.py).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.entrypoints.server_utils import ServerProcess
from tests.structured_output.grammars import DATE_REGEX, PERSON_SCHEMA, fullmatch, valid_json

ENGINE_ARGS = ["--dtype", "float32", "--num-kv-blocks", "400", "--max-model-len", "512"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
                       "required": ["tz_offset"]},  # fmt: skip
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_llama_tok):
    srv = ServerProcess(["--model", str(tiny_llama_tok), *ENGINE_ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    yield srv
    assert srv.stop() == 0


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(tiny_llama_tok) -> str:
    return str(tiny_llama_tok)


def _compact(schema: dict) -> dict:
    # vLLM's extra field: compact JSON keeps a random model from wandering into whitespace.
    return {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}


def test_response_format_json_schema_and_json_object(client, model):
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=200, temperature=0.8, seed=1, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}},
        extra_body={"structured_outputs": None},
    )  # fmt: skip
    for choice in r.choices:  # (unconstrained, both samples run to the 200 tokens)
        assert choice.finish_reason == "stop" and valid_json(choice.message.content, PERSON_SCHEMA), choice.message.content
    # json_object: closing tokens pushed up, so strings and the object close as soon as the
    # grammar allows (a random model would otherwise write to max_tokens); unconstrained, the
    # text would be those tokens in any order.
    url = str(client.base_url).removesuffix("/v1/")
    bias = {}
    for text in ('"', ":", "}"):
        (token,) = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False}).json()["tokens"]
        bias[str(token)] = 50
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=50, temperature=0,
                                       response_format={"type": "json_object"}, logit_bias=bias)  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0]
    # A json_schema format without a schema (OpenAI allows it) asks for any JSON object.
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=50, temperature=0, logit_bias=bias,
                                       response_format={"type": "json_schema", "json_schema": {"name": "anything"}})  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0]
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=200, temperature=0, extra_body=_compact(PERSON_SCHEMA))
    assert r.choices[0].finish_reason == "stop" and valid_json(r.choices[0].message.content, PERSON_SCHEMA)
    r = client.completions.create(model=model, prompt="Date:", max_tokens=20, temperature=0, extra_body={"guided_regex": DATE_REGEX})
    assert fullmatch(DATE_REGEX, r.choices[0].text)
    r = client.completions.create(model=model, prompt="Pick:", max_tokens=20, extra_body={"guided_choice": ["left", "right"]})
    assert r.choices[0].text in ("left", "right")


def test_beta_parse_gives_a_pydantic_object(client, model):
    class City(BaseModel):
        name: str = Field(max_length=10)
        population: int = Field(ge=0, le=99999)
        capital: bool

    r = client.beta.chat.completions.parse(model=model, messages=MESSAGES, max_tokens=120, temperature=0, response_format=City)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and 0 <= parsed.population <= 99999


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_validate_against_their_schema(client, model, stream, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=300, temperature=0.7, seed=5)
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for ch in chunk.choices:
                for d in ch.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                    call["id"] = d.id or call["id"]
                    if d.function is not None:
                        call["name"] = d.function.name or call["name"]
                        call["arguments"] += d.function.arguments or ""
                finish = ch.finish_reason or finish
        got = [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    else:
        r = client.chat.completions.create(**kwargs)
        finish = r.choices[0].finish_reason
        assert r.choices[0].message.content is None
        got = [(c.id, c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
    # A named function's call is not the model's choice: "stop", as OpenAI and vLLM answer.
    assert finish == ("tool_calls" if choice == "required" else "stop") and got
    for call_id, name, arguments in got:
        assert call_id and call_id.startswith("call_")
        if choice == "named":
            assert name == "get_time"
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_forced_calls_cut_short_or_echoed_answer_as_they_stream(server, model):
    """Found by an adversarial session: echo with a forced call was a 500 (None content joined
    to the echo), and a named call cut short by max_tokens was a tool call when streamed but
    plain content when not. Both forms now give the same call and content."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [dict(tool_choice=named, max_tokens=5, temperature=0),  # cut short: finish_reason "length"
             dict(tool_choice="required", max_tokens=250, temperature=0.7, seed=5, echo=True,
                  messages=MESSAGES + [{"role": "assistant", "content": "Let me look."}])]  # fmt: skip
    for case in cases:
        body = {"model": model, "messages": MESSAGES, "tools": TOOLS, **case}
        whole = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        assert whole.status_code == 200, whole.text
        choice = whole.json()["choices"][0]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
        assert calls and choice["message"]["content"] == ("Let me look." if case.get("echo") else None)
        content, streamed, finish = "", {}, None
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for ch in json.loads(line[6:])["choices"]:
                        content += ch["delta"].get("content") or ""
                        for d in ch["delta"].get("tool_calls") or []:
                            call = streamed.setdefault(d["index"], ["", ""])
                            call[0] = d["function"].get("name") or call[0]
                            call[1] += d["function"].get("arguments") or ""
                        finish = ch["finish_reason"] or finish
        assert finish == choice["finish_reason"] == ("length" if "seed" not in case else "tool_calls")
        assert [tuple(c) for _, c in sorted(streamed.items())] == calls and (content or None) == choice["message"]["content"]


def test_a_tool_result_turn_round_trips(client, model):
    first = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    follow = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=10, temperature=0)
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls
    # tool_choice "none" constrains nothing: the reply is the plain greedy continuation of the
    # same rendered prompt (it once got the "required" grammar's JSON array).
    url = str(client.base_url).removesuffix("/v1/")
    ids = httpx.post(f"{url}/tokenize", json={"model": model, "messages": messages, "tools": TOOLS}).json()["tokens"]
    plain = client.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0)
    assert follow.choices[0].message.content == plain.choices[0].text
    # The template saw the call and its result: the prompt grew by both.
    assert follow.usage.prompt_tokens > first.usage.prompt_tokens + 10


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_hermes_calls(client, model, stream):
    """A grammar makes the model write a hermes-format call; tool_choice auto must find it."""
    call = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "c"\}\}</tool_call>'
    kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0,
                  extra_body={"guided_regex": r"Sure\. " + call})  # fmt: skip
    if stream:
        content, calls, finish = "", [], None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for ch in chunk.choices:
                content += ch.delta.content or ""
                calls += ch.delta.tool_calls or []
                finish = ch.finish_reason or finish
        assert "<tool_call>" not in content and content == "Sure. "  # as written, streamed or not
        names = [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    else:
        r = client.chat.completions.create(**kwargs)
        finish = r.choices[0].finish_reason
        assert r.choices[0].message.content == "Sure. "
        names = [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]
    assert finish == "tool_calls" and names == [("get_weather", {"city": "Paris", "unit": "c"})]


def test_bad_constraints_get_400_and_the_server_keeps_serving(server, model):
    chat = {"model": model, "messages": MESSAGES, "max_tokens": 5}
    bad = [  # (the error's param names the field the request used: an adversarial session saw structured_outputs)
        ({**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, "bogus", "response_format"),
        ({**chat, "guided_regex": "(unclosed"}, "regex", "guided_regex"),
        ({**chat, "structured_outputs": {"regex": "(unclosed"}}, "regex", "structured_outputs"),
        ({**chat, "guided_grammar": 'root ::= "a" | undefined'}, "undefined", "guided_grammar"),
        ({**chat, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch_rockets"}}}, "launch_rockets"),
        ({**chat, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
          "tool_choice": "required"}, "parameters"),  # fmt: skip
        ({**chat, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ]
    for body, problem, *param in bad:
        resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 400, resp.text
        assert problem in resp.json()["error"]["message"], resp.text
        if param:
            assert resp.json()["error"]["param"] == param[0], resp.text
    ok = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None


def test_a_constraint_rejected_after_admission_moves_no_request_metric(server, model):
    """A schema that admits no output is found out when its grammar compiles, after the request
    was accepted; the client gets a 400 like any invalid request, and like theirs, it is not a
    finished request in /metrics (nor are its sampling parameters observed)."""
    names = ["pagedllm:request_success_total", "pagedllm:request_params_n_count", "pagedllm:e2e_request_latency_seconds_count"]
    before = [server.metric(n) for n in names]
    bad = {"model": model, "prompt": "x", "max_tokens": 4, "guided_json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}
    r = httpx.post(f"{server.url}/v1/completions", json=bad, timeout=60)
    assert r.status_code == 400 and "admits no output" in r.json()["error"]["message"], r.text
    assert [server.metric(n) for n in names] == before
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
    assert [server.metric(n) for n in names] == [b + 1 for b in before]
