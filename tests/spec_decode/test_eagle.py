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


@pytest.fixture(scope="module")
def tiny_eagle(tiny_llama_tok, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle")
    args = ["train-draft-head", "--method", "eagle", "--model", str(tiny_llama_tok), "--output", str(out),
            "--num-prompts", "6", "--max-tokens", "24", "--epochs", "2", "--batch-size", "64", "--lr", "3e-3",
            "--eagle-intermediate-size", "32"]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_draft_head, "cache_dir", lambda: out / "cache")
        assert main(args) == 0
    return out


def test_trained_eagle_head_loads_and_keeps_greedy_tokens(tiny_llama_tok, tiny_eagle, default_tokenizer):
    config = json.loads((tiny_eagle / "config.json").read_text())
    assert config["method"] == "eagle" and config["hidden_size"] == 64 and config["intermediate_size"] == 32
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
