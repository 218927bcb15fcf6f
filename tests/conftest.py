"""Shared fixtures: tiny random Llama-family models saved as Hugging Face directories."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch


def pytest_sessionstart(session):
    """With pytest-xdist workers (`make test`), build the native kernels once in the controller
    before they start, so two workers never compile the same library side by side on a fresh
    machine (it is cached on disk for every later process)."""
    if getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput"):
        from pagedllm.kernels.build import load_kernels

        load_kernels()  # (honours PAGEDLLM_NATIVE_KERNELS=0; no compiler: the kernel tests say so themselves)


def pytest_collection_modifyitems(session, config, items):
    """Modules with tests marked slow run first (each keeps its own order): with two xdist
    workers taking whole files, the long files start early and the short ones fill in at the
    end, instead of one worker finishing the Gemma 3 oracle alone."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


def within(seconds: float, fn, *args):
    """fn(*args) on a daemon thread: its result, its exception, or a failure after ``seconds``
    (a hang fails the test instead of blocking the run)."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # handed back to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("result")


def save_tiny_model(path: Path, model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """Build a small random transformers model of ``model_type`` and save it to ``path``."""
    import transformers

    config_cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "phi3": transformers.Phi3Config,
        "gemma2": transformers.Gemma2Config,
        "gemma3_text": transformers.Gemma3TextConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
    }[model_type]
    kwargs = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "phi3": transformers.Phi3ForCausalLM,
        "gemma2": transformers.Gemma2ForCausalLM,
        "gemma3_text": transformers.Gemma3ForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    }[model_type]
    model = model_cls(config).eval()
    # Random init gives near-uniform logits; sharpen them so greedy decoding has clear winners.
    # Norm weights start all equal (1, or 0 for Gemma's 1 + w): perturb them, or a norm applied
    # with another's weights (q_norm for k_norm) would go unnoticed (found by a mutation audit).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # 3-D: a mixture of experts' stacked expert weights
                p.mul_(4.0)
            elif "norm" in name:
                p.add_(torch.randn(p.shape) * 0.1)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_tokenizer():
    """The default model's tokenizer (built from its GGUF once, then cached on disk)."""
    from pagedllm.model.loader import resolve_model
    from pagedllm.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="session")
def _hf_default_model_once():
    """transformers' own load of the default model's GGUF (the oracle), once per session: it
    takes seconds (reading the file's metadata), and four modules compare against it."""
    from pagedllm.model.loader import default_model_path
    from tests.parity import load_gguf_oracle

    return load_gguf_oracle(default_model_path())


@pytest.fixture(scope="module")
def hf_default_model(_hf_default_model_once):
    """The oracle model, a private copy per module (a test may wrap or patch it, as PEFT does)."""
    import copy

    return copy.deepcopy(_hf_default_model_once)


@pytest.fixture(scope="session")
def tiny_llama_tok(tmp_path_factory, default_tokenizer) -> Path:
    """A tiny random Llama with the real SmolLM2 tokenizer (49,152 tokens): fast, with text."""
    path = save_tiny_model(tmp_path_factory.mktemp("tiny-llama-tok"), vocab_size=49152, seed=3)
    default_tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(params=["native", "torch"])
def native_or_torch(request):
    """Runs a test on the native row kernels (sampling, draft verification) and on their torch
    rules alike."""
    from pagedllm.kernels import ops

    if request.param == "torch":
        with ops.torch_only():
            yield request.param
    else:
        if not ops.native_available():
            pytest.skip("no native kernels here (no C++ compiler): the torch rule is tested")
        yield request.param
