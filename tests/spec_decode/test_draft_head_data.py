"""Self-distillation data for drafting heads: self-written instructions, batched recording."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pagedllm import LLM
from pagedllm.entrypoints.train_draft_head import data


def test_the_user_turn_opening_is_the_template_up_to_the_message(default_tokenizer):
    ids = data._user_turn_opening(default_tokenizer)
    text = default_tokenizer.decode(ids)
    assert text.endswith("<|im_start|>user\n") and text.startswith("<|im_start|>system\n")


def test_self_written_instructions_keep_distinct_finished_messages(default_tokenizer):
    def out(text, reason, n):
        return SimpleNamespace(outputs=[SimpleNamespace(text=text, finish_reason=reason, token_ids=list(range(n)))])

    canned = [out("How do bees fly?", "stop", 6), out(" How do bees fly? ", "stop", 7), out("cut off", "length", 96),
              out("Hi", "stop", 2), out("Write a poem about rain.", "stop", 8)]  # fmt: skip
    seen = {}

    class FakeLLM:
        def get_tokenizer(self):
            return default_tokenizer

        def generate(self, prompts, params):
            seen["prompts"], seen["seeds"] = prompts, [p.seed for p in params]
            return canned

    got = data.self_written_instructions(FakeLLM(), 5, seed=1)
    assert got == ["How do bees fly?", "Write a poem about rain."]
    assert len(set(seen["seeds"])) == 5  # one seed per request: the same messages on every run
    assert seen["prompts"][0]["prompt_token_ids"] == data._user_turn_opening(default_tokenizer)


def test_recording_in_batches_gives_each_sequence_its_own_features(tiny_llama_tok):
    llm = LLM(str(tiny_llama_tok), dtype="float32", log_stats_interval=1e9)
    g = torch.Generator().manual_seed(0)
    sequences = [(torch.randint(10, 49000, (n,), generator=g).tolist(), 3) for n in (7, 30, 12, 45)]
    alone = data.record(llm, sequences, token_budget=1)  # one sequence per forward
    batched = data.record(llm, sequences, token_budget=100)
    model = llm.llm_engine.runner.model
    for j, (ids, _) in enumerate(sequences):
        assert torch.equal(alone.features[j], batched.features[j]) and alone.features[j].shape == (len(ids), 64)
        assert torch.equal(alone.greedy[j], batched.greedy[j])
        with torch.inference_mode():
            want = model.compute_logits(batched.features[j].float()).argmax(-1)
        # bf16 features can flip a near tie; the labels come from the fp32 states
        assert (want == batched.greedy[j]).float().mean() > 0.9
    assert batched.num_positions == sum(len(ids) for ids, _ in sequences)
