"""The acceptance check with the real default model: a ~2,000-token system prompt survives a
restart through the disk store, and the answers equal a cold engine's, token for token."""

from __future__ import annotations

import gc

import pytest

from pagedllm import LLM, SamplingParams

FACT = ("Policy {i}: support agents answer politely, cite the knowledge base article number, never promise "
        "refunds without a ticket, and escalate outages to the on-call engineer within ten minutes.")  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=32)


@pytest.mark.slow
def test_system_prompt_survives_a_restart(tmp_path):
    kv = {"kv_connector": "disk", "path": str(tmp_path / "store")}

    def engine(**kw) -> LLM:
        return LLM(kv_cache_space=0.25, log_stats_interval=1e9, **kw)

    first = engine(kv_transfer_config=kv)
    tok = first.get_tokenizer()
    system = " ".join(FACT.format(i=i) for i in range(60))

    def chat(question: str) -> dict:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return {"prompt_token_ids": tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)}

    q1, q2 = chat("How fast must outages be escalated?"), chat("Can I promise a refund?")
    assert 1900 <= len(q1["prompt_token_ids"]) <= 2300
    (a1,) = first.generate([q1], GREEDY, use_tqdm=False)
    first.llm_engine.close()  # the server's SIGTERM path: queued saves are written
    del first
    gc.collect()

    restarted = engine(kv_transfer_config=kv)
    (b2,) = restarted.generate([q2], GREEDY, use_tqdm=False)
    t = restarted.llm_engine.kv_connector.stats.total
    assert t.num_hit_blocks >= 1800 // 16 and t.num_rejected_blocks == 0
    restarted.llm_engine.close()
    del restarted
    gc.collect()

    cold = engine(enable_prefix_caching=False)
    c1, c2 = cold.generate([q1, q2], GREEDY, use_tqdm=False)
    assert list(a1.outputs[0].token_ids) == list(c1.outputs[0].token_ids)
    assert list(b2.outputs[0].token_ids) == list(c2.outputs[0].token_ids)
    assert len(c2.outputs[0].token_ids) > 5
