"""GGUF loading: llama.cpp's Q/K permutation is undone, names map, bad files fail clearly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model.gguf_loader import unpermute_qk
from pagedllm.model.linear import PACKED_MAX_ROWS
from tests.conftest import save_tiny_model
from tests.kernels.test_gguf_kernels import random_gguf
from tests.model.test_hf_models import oracle_greedy


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row permutation llama.cpp's converter applies to Q and K (its RoPE layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(0).standard_normal((3 * 64, 10)).astype(np.float32)
    back = unpermute_qk(torch.from_numpy(llama_cpp_permute(w, 3)), 3)
    assert torch.equal(back, torch.from_numpy(w))
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


def write_llama_gguf(hf_dir: Path, out: Path, arch: str = "llama", quant: str | None = None) -> Path:
    """Convert a tiny HF Llama to GGUF the way llama.cpp does (permuted Q/K): F32 tensors, or
    with ``quant`` (a GGML type name) the 2-D weights in that type: quantized by the gguf
    package after the permutation where it can, else (K-quants) random blocks of the type -
    a different random model, but one whose weights are exactly such blocks."""
    import json

    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    state = {k: v.numpy() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_eos_token_id(2)
    names = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    def add(name: str, t: np.ndarray) -> None:
        if quant is None or t.ndim != 2:
            w.add_tensor(name, np.ascontiguousarray(t))
            return
        qtype = getattr(gguf.GGMLQuantizationType, quant)
        if quant.endswith("_K"):
            blocks = random_gguf(quant, t.shape[0], t.shape[1], seed=t.shape[0] + len(name)).numpy()
            w.add_tensor(name, blocks, raw_dtype=qtype)
            return
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(t), qtype), raw_dtype=qtype)

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    add("output.weight", state["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, gg_name in names.items():
            t = state[f"model.layers.{i}.{hf_name}.weight"]
            if gg_name == "attn_q":
                t = llama_cpp_permute(t, heads)
            elif gg_name == "attn_k":
                t = llama_cpp_permute(t, kv_heads)
            add(f"blk.{i}.{gg_name}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_tiny_gguf_matches_transformers(tmp_path):
    import transformers

    hf_dir = save_tiny_model(tmp_path / "hf", seed=2)
    gguf_file = write_llama_gguf(hf_dir, tmp_path / "tiny.gguf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    prompts = [[5, 6, 7], list(range(3, 40))]
    llm = LLM(str(gguf_file), dtype="float32", num_kv_blocks=32, log_stats_interval=1e9)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == oracle_greedy(hf, p, 10)


@pytest.mark.parametrize("quant", ["Q4_1", "Q8_0"])
def test_quantized_gguf_runs_the_same_from_blocks_and_from_dense_weights(tmp_path, quant):
    """Single-sequence decode steps use the packed blocks, prefill the dequantized copy: the
    tokens and log-probabilities must not depend on which path ran."""
    hf_dir = save_tiny_model(tmp_path / "hf", seed=3)
    gguf_file = write_llama_gguf(hf_dir, tmp_path / "tiny.gguf", quant=quant)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(3, 40))}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    runs = {}
    for packed in (True, False):
        llm = LLM(str(gguf_file), dtype="float32", num_kv_blocks=32, packed_weights=packed, log_stats_interval=1e9)
        model = llm.llm_engine.runner.model
        assert (model.layers[0].mlp.down_proj.packed is not None) == packed
        assert (model.lm_head.packed is not None) == packed
        runs[packed] = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    for a, b in zip(runs[True], runs[False]):
        assert a.token_ids == b.token_ids
        for lp_a, lp_b, tok in zip(a.logprobs, b.logprobs, a.token_ids):
            assert abs(lp_a[tok].logprob - lp_b[tok].logprob) < 1e-4


@pytest.mark.parametrize(
    "quant", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"]
)
def test_every_gguf_type_runs_from_its_blocks_like_its_dequantized_twin(tmp_path, quant):
    """``dense_weights="no"``: every step (prefill chunks, a batch of decodes, single decodes)
    and the embedding lookup read the GGUF blocks; the twin is the same file dequantized to
    fp32 once (the gguf package) and run dense. Same greedy tokens, log-probs within 1e-4."""
    from pagedllm.quantization.weights import QuantizedEmbedding

    wide = quant.endswith("_K")  # K-quant rows hold whole 256-weight super-blocks
    hf_dir = save_tiny_model(
        tmp_path / "hf", seed=4, **(dict(hidden_size=256, intermediate_size=512, head_dim=64) if wide else {})
    )
    gguf_file = write_llama_gguf(hf_dir, tmp_path / "tiny.gguf", quant=quant)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(3, 60))}, {"prompt_token_ids": [9] * 20}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    runs = {}
    for dense in ("no", "yes"):
        llm = LLM(str(gguf_file), dtype="float32", num_kv_blocks=32, dense_weights=dense, packed_weights=False,
                  max_num_batched_tokens=32, log_stats_interval=1e9)  # fmt: skip
        model = llm.llm_engine.runner.model
        linear = model.layers[1].self_attn.qkv_proj
        assert (linear.weight is None and linear.panels is None and linear.quant[0].qtype == quant) == (dense == "no")
        assert isinstance(model.embed_tokens, QuantizedEmbedding) == (dense == "no")
        runs[dense] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]  # batched
        runs[dense].append(llm.generate([prompts[1]], params, use_tqdm=False)[0].outputs[0])  # alone
    for a, b in zip(runs["no"], runs["yes"]):
        assert a.token_ids == b.token_ids
        for lp_a, lp_b, tok in zip(a.logprobs, b.logprobs, a.token_ids):
            assert abs(lp_a[tok].logprob - lp_b[tok].logprob) < 3e-4  # (sums in another order)


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ValueError, match="could not read GGUF file"):
        LLM(str(bad))


def test_truncated_gguf_is_a_clear_error(tmp_path):
    good = write_llama_gguf(save_tiny_model(tmp_path / "hf"), tmp_path / "t.gguf")
    data = good.read_bytes()
    good.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="GGUF"):
        LLM(str(good))


def test_gguf_of_unsupported_architecture_is_a_clear_error(tmp_path):
    import gguf

    out = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(out), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        LLM(str(out))


def test_not_a_gguf_file_is_a_clear_error(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"hello")
    with pytest.raises(ValueError, match="not a .gguf file"):
        LLM(str(f))


@pytest.mark.parametrize("activation_dtype, kv_cache_dtype", [("float32", "auto"), ("int8", "float16"),
                                                             ("int16", "bfloat16")])  # fmt: skip
def test_one_call_decoder_stack_matches_the_layer_by_layer_path(tmp_path, monkeypatch, activation_dtype,
                                                                kv_cache_dtype):  # fmt: skip
    """Steps of a packed fp32 model run all layers in one native call (GGUF blocks up to
    PACKED_MAX_ROWS tokens, fp32 panels above; the fast modes' int8 panels at every size; fp32,
    fp16 or bf16 KV caches); the per-layer path (the same kernels called from Python) must give
    the same tokens and logprobs, and the same prompt logprobs bit for bit from a big prefill
    step."""
    from pagedllm.model import fused_stack

    hf_dir = save_tiny_model(tmp_path / "hf", seed=4)
    gguf_file = write_llama_gguf(hf_dir, tmp_path / "tiny.gguf", quant="Q4_1")
    llm = LLM(str(gguf_file), dtype="float32", num_kv_blocks=64, log_stats_interval=1e9,
              activation_dtype=activation_dtype, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    runner = llm.llm_engine.runner
    model = runner.model
    assert fused_stack.why_not(model, runner.kv_caches) is None
    assert model.fused_stack.get(model, runner.backend, runner.kv_caches, 1) is not None
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(3, 21))},
               {"prompt_token_ids": [(7 * i) % 250 + 3 for i in range(45)]}]  # a 45-token prefill: a big step
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    steps = []  # tokens of each step the stack ran
    run = fused_stack._NativePlan.run
    monkeypatch.setattr(fused_stack._NativePlan, "run", lambda self, res, *a: steps.append(res.shape[0]) or run(self, res, *a))
    fused_out = llm.generate(prompts, params, use_tqdm=False)
    assert steps and max(steps) > PACKED_MAX_ROWS and min(steps) <= PACKED_MAX_ROWS, steps  # both plans ran
    monkeypatch.setattr(fused_stack.FusedDecoderStack, "get", lambda *a: None)
    llm.reset_prefix_cache()
    layered_out = llm.generate(prompts, params, use_tqdm=False)
    fused, layered = [o.outputs[0] for o in fused_out], [o.outputs[0] for o in layered_out]
    fused_prompt, layered_prompt = [o.prompt_logprobs for o in fused_out], [o.prompt_logprobs for o in layered_out]
    for a, b in zip(fused, layered):
        assert a.token_ids == b.token_ids
        for lp_a, lp_b, tok in zip(a.logprobs, b.logprobs, a.token_ids):
            assert abs(lp_a[tok].logprob - lp_b[tok].logprob) < 1e-5
    assert fused_prompt == layered_prompt  # bit for bit: the same kernels in the same order


def test_the_decoder_stack_rule_says_why_it_is_off(tmp_path):
    """One rule decides; each condition it names turns the stack off, and a changed weight or
    cache makes it rebuild its captured pointers."""
    from pagedllm.attention.torch_sdpa import TorchSDPAAttention
    from pagedllm.kernels import ops
    from pagedllm.model import fused_stack

    hf_dir = save_tiny_model(tmp_path / "hf", seed=4)
    llm = LLM(str(write_llama_gguf(hf_dir, tmp_path / "tiny.gguf", quant="Q4_1")), dtype="float32",
              num_kv_blocks=64, log_stats_interval=1e9)  # fmt: skip
    runner = llm.llm_engine.runner
    model, kv, stack = runner.model, runner.kv_caches, runner.model.fused_stack
    plan = stack.get(model, runner.backend, kv, 4)
    assert plan is not None
    big = stack.get(model, runner.backend, kv, PACKED_MAX_ROWS + 1)  # past the packed-weight regime: panels
    assert big is not None and big is not plan and int(big.qtypes.unique().item()) == fused_stack._PANELS
    assert stack.get(model, TorchSDPAAttention(), kv, 1) is None  # backend without the capability
    with ops.torch_only():
        assert stack.get(model, runner.backend, kv, 1) is None
    f64_kv = [(k.to(torch.float64), v.to(torch.float64)) for k, v in kv]
    assert "KV cache" in fused_stack.why_not(model, f64_kv)
    assert stack.get(model, runner.backend, f64_kv, 1) is None
    lin = model.layers[1].mlp.down_proj
    saved = lin.packed
    lin.packed = saved.clone()  # new weights: the plan is rebuilt on them
    assert stack.get(model, runner.backend, kv, 1) is not plan
    lin.packed = None
    assert "layer 1" in fused_stack.why_not(model, kv) and stack.get(model, runner.backend, kv, 1) is None
    lin.packed = saved
    panels = lin.panels
    lin.panels = None  # big steps then run layer by layer; small ones still in one call
    assert "panels" in fused_stack.why_not(model, kv, big_steps=True)
    assert stack.get(model, runner.backend, kv, PACKED_MAX_ROWS + 1) is None
    assert stack.get(model, runner.backend, kv, 1) is not None
    lin.panels = panels
