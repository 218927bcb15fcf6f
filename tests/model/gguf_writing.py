"""Helpers the GGUF tests share: a writer for a tiny saved Hugging Face model with the header
fields every architecture has, and the greedy + logprob comparison with the oracle."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch


def start_gguf(hf_dir: Path, out: Path, arch: str) -> tuple[Any, dict[str, Any], dict[str, np.ndarray]]:
    """A GGUFWriter for ``out`` holding the common header fields of the model in ``hf_dir``,
    with its config and fp32 weights (numpy) for the caller's own fields and tensors."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    state = {k: v.float().numpy() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    return w, cfg, state


def finish_gguf(w: Any) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_greedy_matches_oracle(llm: Any, hf: Any, prompts: list[list[int]], max_tokens: int = 12) -> list[Any]:
    """pagedllm's greedy tokens equal the transformers model's, logprobs within 1e-4."""
    from pagedllm import SamplingParams
    from tests.model.test_hf_models import oracle_greedy_logprobs

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        expected, logprobs = oracle_greedy_logprobs(hf, prompt, max_tokens)
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"
        got = [entry[t].logprob for t, entry in zip(expected, out.outputs[0].logprobs)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(logprobs), atol=1e-4, rtol=0)
    return outs
