"""Gaps a mutation audit of the model runner's input preparation found."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from tests.conftest import save_tiny_model
from tests.model.gguf_writing import assert_greedy_matches_oracle

ENGINE = dict(num_kv_blocks=64, block_size=16, log_stats_interval=1e9, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny GQA Llama whose context is only 64 positions, and transformers' copy of it."""
    import transformers

    path = save_tiny_model(tmp_path_factory.mktemp("runner"), max_position_embeddings=64, seed=7)
    return path, transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()


def _prompts(lengths):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def test_torch_sdpa_steps_mixing_decodes_and_prefill_chunks_match_transformers(tiny):
    """torch_sdpa batches the step's first ``num_decodes`` sequences as decodes, so the runner
    must put the one-token rows first. Chunks of 16 tokens make a long prompt's prefill share
    steps with the short prompts' decodes (the native kernel does not care about the order)."""
    path, hf = tiny
    llm = LLM(str(path), attention_backend="torch_sdpa", max_num_batched_tokens=16, **ENGINE)
    engine = llm.llm_engine
    mixed = []
    real_execute = engine.executor.execute

    def spy(out):  # the steps really mix one-token rows with longer chunks
        lens = [s.num_new_tokens for s in out.scheduled]
        mixed.append(1 in lens and any(n > 1 for n in lens))
        return real_execute(out)

    engine.executor.execute = spy
    assert_greedy_matches_oracle(llm, hf, _prompts((3, 2, 45)), max_tokens=10)
    assert any(mixed)


def test_a_request_runs_to_the_models_last_position(tiny):
    """Positions run 0..max_model_len - 1: a prompt and its tokens filling the whole context
    match transformers (a position off by one reads past the RoPE table at the end)."""
    path, hf = tiny
    llm = LLM(str(path), max_num_batched_tokens=64, **ENGINE)
    assert_greedy_matches_oracle(llm, hf, _prompts((54,)), max_tokens=10)


def test_prompt_logprobs_of_a_chunk_listed_after_the_decodes(tiny):
    """The runner runs one-token rows first; a prompt-logprobs chunk the scheduler listed before a
    decode (its prefill capped per step, a later short request already decoding) must still
    read its own rows of the hidden states."""
    path, hf = tiny
    from pagedllm import SamplingParams

    llm = LLM(str(path), max_num_batched_tokens=32, long_prefill_token_threshold=8, **ENGINE)
    engine = llm.llm_engine
    reordered = []
    real_execute = engine.executor.execute

    def spy(out):
        lens = [s.num_new_tokens for s in out.scheduled]
        reordered.append(lens[0] > 1 and 1 in lens[1:])
        return real_execute(out)

    engine.executor.execute = spy
    long, short = _prompts((40, 3))
    outs = llm.generate([{"prompt_token_ids": long}, {"prompt_token_ids": short}],
                        [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                         SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)], use_tqdm=False)  # fmt: skip
    assert any(reordered)
    from tests.model.test_hf_models import oracle_greedy

    assert outs[1].outputs[0].token_ids == oracle_greedy(hf, short, 6)  # its tokens, not the chunk's
    with torch.no_grad():
        ref = hf(torch.tensor([long])).logits[0].float().log_softmax(-1)
    got = [outs[0].prompt_logprobs[p][long[p]].logprob for p in range(1, len(long))]
    torch.testing.assert_close(torch.tensor(got), ref[torch.arange(len(long) - 1), long[1:]], atol=1e-4, rtol=0)


def test_the_runner_refuses_the_first_block_and_position_past_the_end(tiny):
    """Block id num_blocks and a sequence one past the RoPE table are outside (the kernels
    trust indices); the last block id and the last position are inside."""
    from pagedllm import SamplingParams
    from pagedllm.scheduler.output import NewRequestData, ScheduledRequest, SchedulerOutput

    from tests.model.test_hf_models import oracle_greedy

    path, hf = tiny
    runner = LLM(str(path), **ENGINE).llm_engine.runner
    last = runner.model.rope.cos.shape[0]
    new = NewRequestData("r", list(range(3, 3 + last + 1)), [], SamplingParams(temperature=0, max_tokens=1), frozenset(), [])
    nb = -(-last // 16)
    for num_new, block_ids, error in ((3, [runner.num_blocks], "outside the pool"),
                                      (last + 1, list(range(nb + 1)), "positions outside"),
                                      (3, [runner.num_blocks - 1], None),
                                      (last, list(range(nb)), None)):  # fmt: skip
        out = SchedulerOutput(scheduled=[ScheduledRequest("r", num_new, 0, block_ids, True, new)])
        runner.update_states(out)
        if error is None:  # the token transformers picks after those positions
            assert runner.execute(out).sampled[0] == oracle_greedy(hf, new.prompt_token_ids[:num_new], 1)
        else:
            with pytest.raises(ValueError, match=error):
                runner.execute(out)
        runner.update_states(SchedulerOutput(finished_req_ids={"r"}))
