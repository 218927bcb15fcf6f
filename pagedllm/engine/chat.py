"""Chat prompts: validate a message list and render it with the tokenizer's chat template."""

from __future__ import annotations

from typing import Any

_ROLES = {"system", "user", "assistant", "tool", "developer"}


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
            content = "\n".join(texts)
        elif content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({**m, "content": content})
    return out


def render_chat(
    tokenizer: Any,
    messages: Any,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of the rendered conversation (special tokens come from the template only)."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; this model has none")
    messages = normalize_messages(messages)
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
    if continue_final_message and messages[-1]["role"] != "assistant":
        raise ValueError("continue_final_message needs the last message to be from the assistant")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template; pass chat_template")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )
    except Exception as e:  # template errors (jinja) are the caller's input problem
        raise ValueError(f"could not apply the chat template: {e}") from e
    return tokenizer.encode(text, add_special_tokens=False)
