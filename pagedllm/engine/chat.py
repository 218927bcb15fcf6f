"""Chat prompts: validate a message list and render it with the tokenizer's chat template."""

from __future__ import annotations

import json
from typing import Any

from pagedllm.engine.input_processor import encode_within, require_text

_ROLES = {"system", "user", "assistant", "tool", "developer"}
TEXT_PART_SEPARATOR = "\n"  # how a message's text parts are joined (as vLLM)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the OpenAI message shape; text content parts are joined into one string."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}] must be a text part {{'type': 'text', 'text': ...}}")
                texts.append(part["text"])
            content = TEXT_PART_SEPARATOR.join(texts)
        elif content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        if m.get("tool_calls") is not None:
            _check_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        out.append({**m, "content": content})
    return out


def _check_tool_calls(calls: Any, where: str) -> None:
    """An assistant's earlier tool calls, OpenAI's shape: [{"function": {"name", "arguments"}}, ...]."""
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list of tool calls")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}[{j}] must be a tool call {{'type': 'function', 'function': {{'name': ..., "
                             "'arguments': ...}}")  # fmt: skip
        if not isinstance(fn.get("arguments"), (str, dict)):
            raise ValueError(f"{where}[{j}].function.arguments must be a JSON string (or an object)")


def render_chat(
    tokenizer: Any,
    messages: Any,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    max_model_len: int | None = None,
    add_special_tokens: bool = False,
    limit_name: str = "max_model_len",
) -> list[int]:
    """Token ids of the rendered conversation (special tokens come from the template only,
    unless ``add_special_tokens``: then the tokenizer's too, as vLLM's request field); a
    ValueError when the text's head alone has more than ``max_model_len`` tokens
    (``encode_within``: the caller checks the whole count).

    ``tools`` (OpenAI function tools) go to the template; a template that never mentions
    tools (the default model's) gets them described in the system message instead.
    """
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; this model has none")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"tools must be a list of tool objects, got {type(tools).__name__}")
    messages = normalize_messages(messages)
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if tools and isinstance(template, str) and "tools" not in template:
        messages = describe_tools(messages, tools)
    else:
        messages = template_messages(messages)
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
    if continue_final_message and messages[-1]["role"] != "assistant":
        raise ValueError("continue_final_message needs the last message to be from the assistant")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template; pass chat_template (a server accepts one only "
                         "when started with --trust-request-chat-template)")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **({"tools": tools} if tools else {}),
            **(chat_template_kwargs or {}),
        )
    except Exception as e:  # template errors (jinja) are the caller's input problem
        raise ValueError(f"could not apply the chat template: {e}") from e
    text = require_text(text, "messages")
    if not text:
        raise ValueError("the chat template rendered the messages as empty text")
    if max_model_len is None:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return encode_within(tokenizer, text, max_model_len, "messages", limit_name, add_special_tokens=add_special_tokens)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: an assistant's tool-call arguments as objects
    (OpenAI sends JSON text), content None as ""."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list):
            fixed = []
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        fn = {**fn, "arguments": json.loads(fn["arguments"])}
                    except json.JSONDecodeError:
                        pass
                    call = {**call, "function": fn}
                fixed.append(call)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def describe_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a chat template that ignores ``tools``: tell the model about them in the system
    message (hermes style), and show earlier tool calls as text."""
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    note = ("You can call functions. Their signatures:\n<tools>\n" + listing + "\n</tools>\n"
            "To call one, reply with <tool_call>{\"name\": <function name>, \"arguments\": <arguments object>}</tool_call>.")  # fmt: skip
    out = []
    for m in template_messages(messages):  # arguments as objects, as the note asks the model for
        if m.get("role") == "assistant" and m.get("tool_calls"):
            text = "".join(
                "<tool_call>" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                           ensure_ascii=False) + "</tool_call>"  # fmt: skip
                for c in m["tool_calls"]
            )
            m = {"role": "assistant", "content": (m.get("content") or "") + text}
        elif m.get("role") == "tool":
            m = {"role": "tool", "content": f"<tool_response>{m.get('content') or ''}</tool_response>"}
        out.append(m)
    if out and out[0].get("role") == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{note}"}] + out[1:]
    return [{"role": "system", "content": note}] + out
