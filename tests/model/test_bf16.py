"""bf16 models: the fast path (fp32 matmuls on bf16 values, native attention on a bf16 cache)
against the pure-torch bf16 path (torch's bf16 matmuls, the reference attention): same greedy
tokens. (torch's SDPA is not the oracle: in bf16 it rounds the softmax weights to bf16.)"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm import config
from pagedllm.config import matmul_dtype, resolve_dtype
from pagedllm.kernels import ops
from pagedllm.model.linear import Linear
from tests.conftest import save_tiny_model
from tests.parity import assert_engines_agree


def test_matmul_dtype_follows_the_cpu_and_the_override(monkeypatch):
    assert matmul_dtype(torch.float32) == torch.float32
    monkeypatch.setenv("PAGEDLLM_BF16_MATMUL", "fp32")
    assert matmul_dtype(torch.bfloat16) == torch.float32
    monkeypatch.setenv("PAGEDLLM_BF16_MATMUL", "bf16")
    assert matmul_dtype(torch.bfloat16) == torch.bfloat16
    monkeypatch.setenv("PAGEDLLM_BF16_MATMUL", "fp16")
    with pytest.raises(ValueError, match="PAGEDLLM_BF16_MATMUL"):
        matmul_dtype(torch.bfloat16)


@pytest.mark.parametrize("native_bf16", [False, True])
def test_auto_dtype_is_the_exact_float32_on_every_cpu(monkeypatch, native_bf16):
    """The exact mode is the default even where bf16 is native (it would change answers)."""
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: native_bf16)
    assert resolve_dtype("auto") == torch.float32
    assert resolve_dtype("bf16") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float16")


def test_widened_linear_equals_the_bf16_matmul():
    """fp32 weights holding bf16 values: same result as torch's bf16 linear up to one rounding."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 160, generator=g) * 0.1).bfloat16()
    x = torch.randn(37, 160, generator=g).bfloat16()
    lin = Linear(160, 96)
    lin.weight = torch.nn.Parameter(w.float(), requires_grad=False)
    y = lin.forward(x)
    ref = torch.nn.functional.linear(x, w)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.float(), atol=1e-6, rtol=2**-7)  # at most one bf16 ulp
    assert (y != ref).float().mean() < 0.01  # one-ulp differences from summation order are rare


@pytest.fixture(scope="module")
def tiny_llama_d64(tmp_path_factory):
    """head_dim 64, so the native attention takes its AVX2 path."""
    return save_tiny_model(
        tmp_path_factory.mktemp("tiny-llama-d64"), hidden_size=256, num_attention_heads=4, num_key_value_heads=2, seed=5
    )


def _generate(path, prompts, **kwargs):
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=96, log_stats_interval=1e9, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=5, ignore_eos=True)
    return llm, [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def test_bf16_fast_path_gives_the_pure_torch_bf16_tokens(tiny_llama_d64, monkeypatch):
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([1, 5, 17, 40, 90, 130])]
    monkeypatch.setenv("PAGEDLLM_BF16_MATMUL", "fp32")
    fast_llm, fast = _generate(tiny_llama_d64, prompts, max_num_batched_tokens=64)
    runner = fast_llm.llm_engine.runner
    assert runner.backend.name == "cpu_native" and runner.kv_caches[0][0].dtype == torch.bfloat16
    down = fast_llm.llm_engine.runner.model.layers[0].mlp.down_proj
    assert down.compute_dtype == torch.float32 and down.panels is not None
    monkeypatch.setenv("PAGEDLLM_BF16_MATMUL", "bf16")
    with ops.torch_only():
        ref_llm, ref = _generate(tiny_llama_d64, prompts, attention_backend="reference")
        assert ref_llm.llm_engine.runner.model.layers[0].mlp.down_proj.compute_dtype == torch.bfloat16
    exact = [assert_engines_agree(f"prompt {i}", a, b) for i, (a, b) in enumerate(zip(fast, ref))]
    assert sum(exact) >= len(exact) - 1, exact  # a rounding tie may flip one
