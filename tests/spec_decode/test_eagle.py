"""EAGLE: the head's paged path equals its dense (training) path; trained heads keep tokens exact."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backend import get_attention_backend
from pagedllm.attention.kv_cache_dtype import resolve_kv_cache_dtype
from pagedllm.entrypoints import train_draft_head
from pagedllm.entrypoints.cli import main
from pagedllm.spec_decode.draft_cache import DraftKVCache
from pagedllm.spec_decode.eagle import DEFAULT_EAGLE, EagleConfig, EagleHead


def test_paged_path_equals_dense_path_across_chunks():
    torch.manual_seed(0)
    head = EagleHead(EagleConfig(32, 4, 2, 8, 48, 100)).eval()
    e, f = torch.randn(21, 32), torch.randn(21, 32)
    with torch.no_grad():
        dense = head.forward_dense(e, f)
    backend = get_attention_backend("auto", torch.float32, torch.device("cpu"))
    cache = DraftKVCache(1, 8, 4, 2, 8, resolve_kv_cache_dtype("auto", torch.float32), torch.device("cpu"))
    assert cache.reserve("r", 21)
    got = []
    for start, end in [(0, 13), (13, 14), (14, 21)]:  # a prompt chunk, a decode-shaped step, another chunk
        meta, pos = cache.metadata(["r"], np.array([start]), np.array([end - start]))
        with torch.no_grad():
            got.append(head.forward_paged(e[start:end], f[start:end], torch.from_numpy(pos), cache.layers[0], backend, meta))
    torch.testing.assert_close(torch.cat(got), dense, rtol=1e-4, atol=1e-5)


def test_training_passes_are_the_drafting_steps_of_the_paged_path():
    """Pass i of forward_train at index p is drafting step i of a chain that starts at p - i + 1:
    catch up over the true pairs, then feed each guess back (what EagleProposer does)."""
    torch.manual_seed(1)
    head = EagleHead(EagleConfig(32, 4, 2, 8, 48, 100)).eval()
    T = 12
    e, f = torch.randn(T, 32), torch.randn(T, 32)
    with torch.no_grad():
        g1, g2, g3 = (g[0] for g in head.forward_train(e[None], f[None], passes=3))
    backend = get_attention_backend("auto", torch.float32, torch.device("cpu"))
    for t in (0, 4, 9):  # chain starts: the true pairs 0..t are in the head's cache
        cache = DraftKVCache(1, 8, 4, 2, 8, resolve_kv_cache_dtype("auto", torch.float32), torch.device("cpu"))
        assert cache.reserve("r", t + 3)

        def step(start, embeds, feats):
            meta, pos = cache.metadata(["r"], np.array([start]), np.array([embeds.shape[0]]))
            with torch.no_grad():
                return head.forward_paged(embeds, feats, torch.from_numpy(pos), cache.layers[0], backend, meta)

        caught_up = step(0, e[: t + 1], f[: t + 1])
        torch.testing.assert_close(caught_up, g1[: t + 1], rtol=1e-4, atol=1e-5)
        second = step(t + 1, e[t + 1 : t + 2], caught_up[-1:])  # (token t + 2, the guess of f_{t+1})
        torch.testing.assert_close(second[0], g2[t + 1], rtol=1e-4, atol=1e-5)
        third = step(t + 2, e[t + 2 : t + 3], second)
        torch.testing.assert_close(third[0], g3[t + 2], rtol=1e-4, atol=1e-5)


def test_draft_lm_head_holds_the_target_rows_of_the_draft_vocabulary():
    from pagedllm.model.linear import Linear
    from pagedllm.spec_decode.packed_linear import PackedLinear, draft_lm_head

    torch.manual_seed(0)
    lm_head = Linear(64, 300)
    lm_head.weight.data = torch.randn(300, 64)
    d2t = torch.tensor([3, 7, 42, 299])
    draft = draft_lm_head(lm_head, d2t)
    assert isinstance(draft, PackedLinear) and draft.step_nbytes() < 4 * 64 * 16  # Q8_0 blocks, not fp32
    x = torch.randn(5, 64)
    want = x @ lm_head.weight[d2t].T
    torch.testing.assert_close(draft(x), want, rtol=0.02, atol=0.05)  # Q8_0 rounding of the rows


@pytest.fixture(scope="module")
def tiny_eagle(tiny_llama_tok, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle")
    args = ["train-draft-head", "--method", "eagle", "--model", str(tiny_llama_tok), "--output", str(out),
            "--num-prompts", "8", "--num-self-prompts", "4", "--max-tokens", "24", "--epochs", "2",
            "--tokens-per-step", "128", "--lr", "3e-3", "--eagle-intermediate-size", "32", "--eagle-passes", "2",
            "--draft-vocab-size", "256"]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_draft_head, "cache_dir", lambda: out / "cache")
        assert main(args) == 0
    return out


def test_trained_eagle_head_loads_and_keeps_greedy_tokens(tiny_llama_tok, tiny_eagle, default_tokenizer):
    config = json.loads((tiny_eagle / "config.json").read_text())
    assert config["method"] == "eagle" and config["hidden_size"] == 64 and config["intermediate_size"] == 32
    assert config["draft_vocab_size"] == 256 and len(config["held_out"]["accepted_in_a_row"]) == 3
    head = EagleHead.load(tiny_eagle, 64, 49152)
    assert head.d2t.shape == (256,) and bool((head.d2t[1:] > head.d2t[:-1]).all())  # distinct token ids
    with pytest.raises(ValueError, match="hidden size"):
        EagleHead.load(tiny_eagle, 128, 49152)
    prompts = [default_tokenizer.encode(t) for t in ["Hello, my name is", "one two three one two three", "The cat sat"]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for kwargs in (dict(num_kv_blocks=64), dict(num_kv_blocks=9, max_num_batched_tokens=8)):  # chunks, preemption
        kwargs |= dict(dtype="float32", log_stats_interval=1e9)
        plain = LLM(str(tiny_llama_tok), **kwargs).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm = LLM(str(tiny_llama_tok), speculative_config={"method": "eagle", "model": str(tiny_eagle), "auto_length": False}, **kwargs)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
        assert llm.llm_engine.stats.spec_total.num_draft_tokens > 0
        # A warm prefix cache: the head starts its context after the cached prefix; tokens unchanged.
        warm = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in plain]


def test_shipped_head_fits_the_default_model():
    config = json.loads((DEFAULT_EAGLE / "config.json").read_text())
    assert (config["method"], config["hidden_size"], config["vocab_size"]) == ("eagle", 576, 49152)
    assert (DEFAULT_EAGLE / "head.safetensors").stat().st_size < 8 << 20  # a few MB
    head = EagleHead.load(DEFAULT_EAGLE, 576, 49152)
    assert head.fc.weight.dtype == torch.float32
