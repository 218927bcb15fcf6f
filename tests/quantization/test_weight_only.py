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
