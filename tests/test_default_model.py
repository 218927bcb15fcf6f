"""The embedded default model end to end: LLM() with no arguments gives sensible text."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_space=0.25, log_stats_interval=1e9)  # default dtype (bfloat16)


def test_default_model_answers_a_chat_question(llm):
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    (out,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=32))
    c = out.outputs[0]
    assert "Paris" in c.text
    assert c.finish_reason == "stop" and c.token_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert "<|im_end|>" not in c.text  # special tokens are skipped in the text
    assert out.prompt == prompt and out.prompt_token_ids == tok.encode(prompt)


def test_string_prompts_and_max_tokens(llm):
    outs = llm.generate(["The capital of Germany is", "1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=8))
    assert all(len(o.outputs[0].token_ids) <= 8 for o in outs)
    assert "5" in outs[1].outputs[0].text
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
