"""Medusa heads: trained by `pagedllm train-draft-head`, loaded by speculative_config, exact."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints import train_draft_head
from pagedllm.entrypoints.cli import main
from pagedllm.spec_decode.medusa import DEFAULT_MEDUSA, MedusaHeads, MedusaProposer


@pytest.fixture(scope="module")
def tiny_heads(tiny_llama_tok, tmp_path_factory):
    out = tmp_path_factory.mktemp("heads")
    with pytest.MonkeyPatch.context() as mp:  # the answers' cache goes to a temporary directory
        mp.setattr(train_draft_head, "cache_dir", lambda: out / "cache")
        assert main(_train_args(tiny_llama_tok, out)) == 0
        assert len(list((out / "cache" / "draft-head-data").glob("*.json"))) == 1
    return out


def _train_args(model, out):
    return ["train-draft-head", "--model", str(model), "--output", str(out), "--num-heads", "3",
            "--num-prompts", "6", "--num-self-prompts", "2", "--max-tokens", "24", "--epochs", "2",
            "--batch-size", "16", "--lr", "1e-2", "--draft-vocab-size", "128"]  # fmt: skip


def test_training_writes_loadable_heads_that_learn(tiny_heads):
    config = json.loads((tiny_heads / "config.json").read_text())
    assert config["method"] == "medusa" and config["num_heads"] == 3 and config["hidden_size"] == 64
    assert config["trained_on"]["positions"] > 5 * 10 and config["draft_vocab_size"] == 128
    assert len(config["held_out"]["top1_per_head"]) == 3
    heads = MedusaHeads.load(tiny_heads, 64, 49152)
    assert heads.d2t.shape == (128,)
    assert any(h.weight.abs().sum() > 0 for h in heads.heads)  # moved away from the zero init
    with pytest.raises(ValueError, match="hidden size"):
        MedusaHeads.load(tiny_heads, 128, 49152)
    with pytest.raises(ValueError, match="no Medusa heads"):
        MedusaHeads.load(tiny_heads / "missing", 64, 49152)


def test_proposer_chains_each_heads_argmax_within_limits():
    heads = MedusaHeads(2, 4)
    for i, h in enumerate(heads.heads):  # head i: h + SiLU(W h + b), W = 0, b = 3 e_i -> argmax i on an identity LM head
        torch.nn.init.zeros_(h.weight)
        h.bias.data = torch.zeros(4).index_fill_(0, torch.tensor([i]), 3.0)
    p = MedusaProposer(heads, 2, lambda x: x)
    hidden = torch.zeros(3, 4)
    assert p.propose(["a", "b", "c"], [[1], [1], [1]], [2, 1, 0], hidden) == [[0, 1], [0], []]
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        MedusaProposer(heads, 3, lambda x: x)
    # With a draft vocabulary, the argmax is a draft id, mapped back to the target's token.
    reduced = MedusaHeads(2, 4, draft_vocab_size=4)
    reduced.load_state_dict(heads.state_dict() | {"d2t": torch.tensor([10, 20, 30, 40])})
    p = MedusaProposer(reduced, 2, lambda x: x)
    assert p.propose(["a"], [[1]], [2], torch.zeros(1, 4)) == [[10, 20]]


def test_medusa_drafts_keep_greedy_tokens(tiny_llama_tok, tiny_heads, default_tokenizer):
    prompts = [default_tokenizer.encode(t) for t in ["Hello, my name is", "one two three one two three", "The cat"]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kwargs = dict(dtype="float32", num_kv_blocks=64, log_stats_interval=1e9)
    plain = LLM(str(tiny_llama_tok), **kwargs).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm = LLM(str(tiny_llama_tok), speculative_config={"method": "medusa", "model": str(tiny_heads), "auto_length": False}, **kwargs)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert llm.llm_engine.stats.spec_total.num_draft_tokens > 0


def test_medusa_reads_the_hidden_state_that_sampled_the_newest_token(tiny_llama_tok, tiny_heads, monkeypatch):
    """The tiny heads' drafts are never accepted, so a wrong hidden row kept the tokens exact.
    Here the proposer's drafts are the plain run's own next tokens (all accepted): each
    verifying step has several rows, and the heads must have read the one that sampled the
    newest token - the dense forward's hidden state at the position before it."""
    from pagedllm.entrypoints.train_draft_head.data import record

    prompt = [(5 * j) % 200 + 3 for j in range(20)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kwargs = dict(dtype="float32", num_kv_blocks=64, log_stats_interval=1e9)
    plain = LLM(str(tiny_llama_tok), **kwargs).generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    full = prompt + list(plain[0].outputs[0].token_ids)
    seen = []
    propose = MedusaProposer.propose

    def oracle(self, req_ids, token_ids, limits, hidden):
        propose(self, req_ids, token_ids, limits, hidden)
        seen.extend((len(t), row.clone()) for t, row in zip(token_ids, hidden))
        return [full[len(t) : len(t) + limit] for t, limit in zip(token_ids, limits)]

    monkeypatch.setattr(MedusaProposer, "propose", oracle)
    spec = {"method": "medusa", "model": str(tiny_heads), "num_speculative_tokens": 3, "auto_length": False}
    llm = LLM(str(tiny_llama_tok), speculative_config=spec, **kwargs)
    got = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert list(got[0].outputs[0].token_ids) == full[len(prompt) :]
    stats = llm.llm_engine.stats.spec_total
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    dense = record(llm, [(full, 0)]).features[0].float()  # (bf16)
    assert len(seen) >= 3
    for n, row in seen:
        torch.testing.assert_close(row.float(), dense[n - 2], rtol=2e-2, atol=2e-2)


def test_shipped_heads_fit_the_default_model():
    config = json.loads((DEFAULT_MEDUSA / "config.json").read_text())
    assert (config["method"], config["hidden_size"], config["vocab_size"]) == ("medusa", 576, 49152)
    assert (DEFAULT_MEDUSA / "heads.safetensors").stat().st_size < 8 << 20  # a few MB


def test_draft_vocab_size_zero_means_all_as_its_help_says():
    """`--draft-vocab-size 0` ("0: all", in the help) was refused by a positive-int check."""
    import argparse

    from pagedllm.entrypoints import train_draft_head

    p = argparse.ArgumentParser()
    train_draft_head.add_args(p)
    assert p.parse_args(["--output", "x", "--draft-vocab-size", "0"]).draft_vocab_size == 0
    with pytest.raises(SystemExit):
        p.parse_args(["--output", "x", "--draft-vocab-size", "-1"])
