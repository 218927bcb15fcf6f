"""``quantization="int8"|"int4"``: a Hugging Face checkpoint quantized at load, on the GGUF kernels.

The oracle is transformers with the same quantized values written into its weights
(dequantized by the gguf package): pagedllm's greedy tokens must be its tokens.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.quantization.weight_only import QUANTIZATION_TYPES, quantize_weight
from tests.conftest import save_tiny_model
from tests.model.test_hf_models import oracle_greedy_logprobs


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_checkpoint_matches_transformers_on_the_same_values(tmp_path, method):
    import transformers

    hf_dir = save_tiny_model(tmp_path / "hf", seed=6)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    qtype = QUANTIZATION_TYPES[method]
    changed = 0
    with torch.no_grad():
        for name, module in hf.model.layers.named_modules():
            if isinstance(module, torch.nn.Linear):
                q = quantize_weight(module.weight, qtype).dequantize()
                changed += int(not torch.equal(q, module.weight))
                module.weight.copy_(q)
    assert changed == 2 * 7  # every linear of both layers really changed
    prompts = [[5, 6, 7], list(range(3, 40))]
    for dense in ("yes", "no"):
        llm = LLM(str(hf_dir), dtype="float32", quantization=method, dense_weights=dense, num_kv_blocks=32,
                  log_stats_interval=1e9)  # fmt: skip
        down = llm.llm_engine.runner.model.layers[0].mlp.down_proj
        assert (down.quant is not None or down.packed is not None) and down.qtype in (None, qtype)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1), use_tqdm=False)  # fmt: skip
        for p, out in zip(prompts, outs):
            want, want_lps = oracle_greedy_logprobs(hf, p, 10)
            got = out.outputs[0]
            assert got.token_ids == want
            for lp, tok, ref in zip(got.logprobs, got.token_ids, want_lps):
                assert abs(lp[tok].logprob - ref) < 1e-4


def test_quantization_of_a_gguf_file_is_a_clear_error():
    with pytest.raises(ValueError, match="already quantized"):
        LLM(quantization="int8")


def test_unknown_quantization_names_the_field():
    with pytest.raises(ValueError, match="quantization"):
        LLM(quantization="int3")


def test_a_mixture_of_experts_quantizes_its_experts(tmp_path):
    """The experts are most of an MoE's bytes; they were left in fp32 (found by an adversarial
    session: the name pattern missed ``mlp.experts.N.*_proj``). The router stays exact."""
    import transformers

    hf_dir = save_tiny_model(tmp_path / "moe", "qwen3_moe", seed=1, head_dim=16, num_hidden_layers=2, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32)  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():  # the oracle's experts are fused [E, out, in] stacks: each matrix on its own
        for layer in hf.model.layers:
            for param in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                for e in range(param.shape[0]):
                    param[e].copy_(quantize_weight(param[e], "Q8_0").dequantize())
            attn = layer.self_attn
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                lin.weight.copy_(quantize_weight(lin.weight, "Q8_0").dequantize())
    llm = LLM(str(hf_dir), dtype="float32", quantization="int8", num_kv_blocks=32, log_stats_interval=1e9)
    mlp = llm.llm_engine.runner.model.layers[0].mlp
    assert all(e.down_proj.packed is not None and e.gate_up_proj.packed is not None for e in mlp.experts)
    assert mlp.gate.packed is None
    prompts = [[5, 6, 7], list(range(3, 40))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1), use_tqdm=False)  # fmt: skip
    for p, out in zip(prompts, outs):
        want, want_lps = oracle_greedy_logprobs(hf, p, 10)
        assert out.outputs[0].token_ids == want
        assert all(abs(lp[t].logprob - ref) < 1e-4 for lp, t, ref in zip(out.outputs[0].logprobs, want, want_lps))


@pytest.mark.parametrize("method,factor", [("int8", 1e9), ("int4", 1e6)])
def test_weights_beyond_the_fp16_scales_are_a_clear_error(tmp_path, method, factor):
    """Finite weights of ~1e5 overflow Q4_1's fp16 minimum to inf (Q8_0's scale, max / 127,
    from ~1e7): the model then emitted NaN, silently (found by an adversarial session)."""
    from safetensors.torch import load_file, save_file

    hf_dir = save_tiny_model(tmp_path / "hf", seed=6)
    state = load_file(str(hf_dir / "model.safetensors"))
    state["model.layers.0.mlp.up_proj.weight"] *= factor
    save_file(state, str(hf_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=f"quantization='{method}': model.layers.0.mlp.up_proj.weight: .*fp16"):
        LLM(str(hf_dir), dtype="float32", quantization=method, num_kv_blocks=32)
