"""Tiny random Llama-family models: pagedllm (fp32) must match transformers token for token."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pagedllm import LLM
from tests.model.gguf_writing import assert_greedy_matches_oracle
from tests.conftest import save_tiny_model

VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "mistral": ("mistral", {"sliding_window": None}),
    "mistral-window": ("mistral", {"sliding_window": 24}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 16}),
    # Fused qkv_proj / gate_up_proj in the checkpoint, and (as Phi-3-mini-4k) a sliding window.
    "phi3": ("phi3", {"sliding_window": 40, "pad_token_id": 0}),
    # 6 layers: 5 sliding (window 24) and 1 global, two RoPE bases, Gemma's norms and scale; an
    # attention soft-cap in the config, which Gemma 3 never applies (transformers ignores it).
    "gemma3": ("gemma3_text", {"head_dim": 16, "num_hidden_layers": 6, "sliding_window": 24, "query_pre_attn_scalar": 24,
                               "tie_word_embeddings": True, "max_position_embeddings": 512, "attn_logit_softcapping": 3.0}),
    # 4 layers alternating sliding (window 24) and global, soft-capped attention scores and logits.
    "gemma2": ("gemma2", {"head_dim": 16, "num_hidden_layers": 4, "sliding_window": 24, "query_pre_attn_scalar": 24,
                          "attn_logit_softcapping": 4.0, "final_logit_softcapping": 8.0, "tie_word_embeddings": True}),
    # 3 layers: sparse (8 experts, top 2, renormalised), dense (mlp_only_layers), sparse.
    "qwen3-moe": ("qwen3_moe", {"head_dim": 16, "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1]}),
    # Every other layer sparse (decoder_sparse_step), top 3 weights as the softmax gave them.
    "qwen3-moe-step": ("qwen3_moe", {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 3,
                                     "moe_intermediate_size": 32, "decoder_sparse_step": 2}),
}
# Where the native dense GEMM keeps no fp32 weight copy (the tied LM head shares the embedding).
TIED = {"llama-tied", "gemma2", "gemma3"}
# Engine settings of a variant: these also prefill in chunks of 32 tokens.
ENGINE_ARGS = {name: {"max_num_batched_tokens": 32} for name in ("gemma2", "qwen3-moe", "qwen3-moe-step")}


def oracle_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    """Greedy decoding by full recompute each token: slow and obviously right."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def oracle_greedy_logprobs(model, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities, by full recompute each token."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            lp = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            ids.append(int(lp.argmax()))
            logprobs.append(float(lp[ids[-1]]))
    return ids[len(prompt) :], logprobs


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_model_greedy_matches_transformers(tmp_path, variant):
    import transformers

    model_type, overrides = VARIANTS[variant]
    path = save_tiny_model(tmp_path / variant, model_type, seed=1, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    # Lengths around and across block boundaries (block_size 16), in one batch.
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (1, 5, 16, 17, 40, 100)]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, log_stats_interval=1e9, **ENGINE_ARGS.get(variant, {}))
    model = llm.llm_engine.runner.model  # the native dense GEMM's panels replace the weights...
    mlp = model.layers[-1].mlp
    mlp = mlp.experts[0] if hasattr(mlp, "experts") else mlp
    assert mlp.down_proj.panels is not None and mlp.down_proj.weight is None
    assert model.lm_head.panels is not None  # ...except the one a tied LM head shares with the embedding
    assert (model.lm_head.weight is model.embed_tokens.weight) == (variant in TIED)
    outs = assert_greedy_matches_oracle(llm, hf, prompts)
    assert all(out.outputs[0].text == "" for out in outs)  # no tokenizer files in the directory
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == 64


def test_config_reading_handles_both_transformers_layouts():
    from pagedllm.model.arch import ModelArch

    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    old = ModelArch.from_hf_config({**base, "model_type": "llama", "rope_theta": 5e5, "rope_scaling": scaling})
    new = ModelArch.from_hf_config({**base, "model_type": "llama", "rope_parameters": {**scaling, "rope_theta": 5e5}})
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling["factor"] == new.rope_scaling["factor"] == 8.0
    assert new.num_kv_heads == 2 and new.head_dim == 4


def test_gemma_configs_without_layer_types_and_soft_caps():
    """Configs from before ``layer_types`` slide on all but every n-th layer (Gemma 2: every
    2nd is global, Gemma 3: every 6th); Gemma 2 reads its soft-caps, Gemma 3 refuses a final one."""
    from pagedllm.model.arch import FULL, SLIDING, ModelArch

    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=6, num_attention_heads=2,
                sliding_window=4, query_pre_attn_scalar=4)  # fmt: skip
    g2 = ModelArch.from_hf_config({**base, "model_type": "gemma2", "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
    assert g2.layer_types == [SLIDING, FULL] * 3 and g2.hidden_act == "gelu_tanh" and not g2.qk_norm
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.attention_scale) == (50.0, 30.0, 0.5)
    g3 = ModelArch.from_hf_config({**base, "model_type": "gemma3_text", "sliding_window_pattern": 3})
    assert g3.layer_types == [SLIDING, SLIDING, FULL] * 2 and g3.attn_logit_softcapping is None
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        ModelArch.from_hf_config({**base, "model_type": "gemma3_text", "final_logit_softcapping": 30.0})
    with pytest.raises(ValueError, match="bidirectional"):
        ModelArch.from_hf_config({**base, "model_type": "gemma2", "use_bidirectional_attention": True})


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_configs_without_layer_types_slide_from_max_window_layers(tmp_path, model_type):
    """Found by an adversarial session: a Qwen2/Qwen3 config.json with use_sliding_window but no
    layer_types (transformers before 4.53 wrote them so) slid every layer, as Mistral's do;
    transformers slides the layers from max_window_layers on. Greedy tokens differed at once."""
    import json

    import transformers

    from pagedllm.model.arch import FULL, SLIDING, ModelArch

    base = dict(model_type=model_type, vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=4,
                num_attention_heads=2, use_sliding_window=True, sliding_window=4)  # fmt: skip
    assert ModelArch.from_hf_config({**base, "max_window_layers": 1}).layer_types == [FULL] + [SLIDING] * 3
    none = ModelArch.from_hf_config(base)  # the default 28: no layer of 4 slides
    assert none.layer_types is None and none.sliding_window is None
    path = save_tiny_model(tmp_path / model_type, model_type, seed=1, use_sliding_window=True, sliding_window=6,
                           max_window_layers=1)  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    del config["layer_types"]  # as an older transformers wrote it
    (path / "config.json").write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert hf.config.layer_types[0] == "full_attention" and hf.config.layer_types[1] == "sliding_attention"
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, log_stats_interval=1e9)
    g = torch.Generator().manual_seed(0)
    assert_greedy_matches_oracle(llm, hf, [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 30)])


def test_config_fields_pagedllm_cannot_honour_are_refused():
    """Found by an adversarial session: hidden_act was never read (a gelu Llama ran SiLU), and
    Llama's attention_bias put biases on o_proj that the loader then called unexpected."""
    from pagedllm.model.arch import ModelArch

    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2)
    for model_type, field, value in [("llama", "hidden_act", "gelu"), ("qwen2", "hidden_act", "relu"),
                                     ("gemma2", "hidden_activation", "gelu"), ("llama", "attention_bias", True),
                                     ("qwen3", "mlp_bias", True)]:  # fmt: skip
        with pytest.raises(ValueError, match=f"{field} .*not supported"):
            ModelArch.from_hf_config({**base, "model_type": model_type, field: value})
    assert ModelArch.from_hf_config({**base, "model_type": "llama", "hidden_act": "silu"}).hidden_act == "silu"
    gemma = ModelArch.from_hf_config({**base, "model_type": "gemma2", "hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"})
    assert gemma.hidden_act == "gelu_tanh"  # (Gemma reads hidden_activation; its hidden_act is legacy)


@pytest.mark.parametrize("field,value", [("hidden_size", None), ("rms_norm_eps", None), ("num_attention_heads", "four"),
                                         ("rope_scaling", "llama3"), (None, [1, 2])])  # fmt: skip
def test_a_config_field_of_the_wrong_type_names_the_file(tmp_path, field, value):
    path = save_tiny_model(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    if field is None:
        cfg = value
    else:
        cfg[field] = value
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(path), dtype="float32", num_kv_blocks=8)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    path = save_tiny_model(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        LLM(str(path), dtype="float32", num_kv_blocks=8)


def test_unsupported_rope_scaling_is_a_clear_error(tmp_path):
    path = save_tiny_model(tmp_path / "m", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        LLM(str(path), dtype="float32", num_kv_blocks=8)


def test_rope_scaling_on_gemma3_sliding_layers_is_refused_not_ignored():
    """transformers 5 gives Gemma 3 one RoPE per layer type; its sliding layers run plain RoPE
    here, so a scaled sliding entry must be an error naming it (it was silently dropped)."""
    from pagedllm.model.arch import ModelArch

    base = dict(model_type="gemma3_text", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=6,
                num_attention_heads=2, sliding_window=4, query_pre_attn_scalar=4)  # fmt: skip
    plain = {"full_attention": {"rope_type": "default", "rope_theta": 1e6}, "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    assert ModelArch.from_hf_config({**base, "rope_parameters": plain}).rope_local_theta == 1e4
    scaled = {**plain, "sliding_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e4}}
    with pytest.raises(ValueError, match="sliding_attention.rope_type 'linear'"):
        ModelArch.from_hf_config({**base, "rope_parameters": scaled})


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))


def test_corrupt_safetensors_is_a_clear_error(tmp_path):
    path = save_tiny_model(tmp_path / "m")
    (path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="could not read weights file"):
        LLM(str(path), dtype="float32", num_kv_blocks=8)


def test_missing_weight_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_tiny_model(tmp_path / "m")
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        LLM(str(path), dtype="float32", num_kv_blocks=8)


def test_a_damaged_tokenizer_file_names_the_directory(tmp_path):
    path = save_tiny_model(tmp_path / "m")
    (path / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ValueError, match=r"could not load the tokenizer in .*\(tokenizer.json\)"):
        LLM(str(path), dtype="float32", num_kv_blocks=8)


# Checkpoints an adversarial session made that loaded wrong or failed deep in torch.
def _edit_weights(path, edit) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(path / "model.safetensors"))
    edit(state)
    save_file(state, str(path / "model.safetensors"))


def test_untied_config_without_lm_head_is_refused_not_tied(tmp_path):
    """It ran with the embedding as its LM head: transformers leaves that head untrained."""
    path = save_tiny_model(tmp_path / "m", tie_word_embeddings=False)
    _edit_weights(path, lambda state: state.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="tie_word_embeddings is false, but the weights have no lm_head.weight"):
        LLM(str(path), dtype="float32", num_kv_blocks=8)


def test_the_shard_index_decides_which_files_load(tmp_path):
    """Every *.safetensors was read and a later file's tensor silently replaced an earlier one's
    (a stale file of zeros beside the checkpoint turned every answer into token 0)."""
    from safetensors.torch import load_file, save_file

    path = save_tiny_model(tmp_path / "m")
    state = load_file(str(path / "model.safetensors"))
    save_file({"model.norm.weight": state["model.norm.weight"] * 0}, str(path / "zz-stale.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight is in both model.safetensors and zz-stale.safetensors"):
        LLM(str(path), dtype="float32", num_kv_blocks=8)
    # With an index, only the files it names load (the stale one is ignored); a missing one is named.
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "model.safetensors" for k in state}}))
    LLM(str(path), dtype="float32", num_kv_blocks=8, log_stats_interval=1e9)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "model-00002.safetensors"}}))
    with pytest.raises(ValueError, match="names model-00002.safetensors, which is not in"):
        LLM(str(path), dtype="float32", num_kv_blocks=8)


@pytest.mark.parametrize("field", ["num_attention_heads", "num_hidden_layers", "max_position_embeddings"])
def test_zero_sizes_are_refused_by_name(tmp_path, field):
    path = save_tiny_model(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg[field] = 0
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="must be positive"):
        LLM(str(path), dtype="float32", num_kv_blocks=8)


def test_weights_of_other_shapes_are_a_value_error_naming_the_layer(tmp_path):
    path = save_tiny_model(tmp_path / "m")
    _edit_weights(path, lambda state: state.update({"model.layers.0.self_attn.q_proj.weight": state["model.layers.0.self_attn.q_proj.weight"].T.contiguous()[:, :8].clone()}))
    with pytest.raises(ValueError, match="layer 0's weights do not have the shapes the config gives|weight .* has shape"):
        LLM(str(path), dtype="float32", num_kv_blocks=8)


def test_a_tokenizer_bigger_than_the_vocabulary_is_a_value_error(tmp_path, default_tokenizer):
    """A 49,152-token tokenizer beside a 256-token model: text prompts failed inside the embedding
    (finish_reason "error", no message for the user)."""
    path = save_tiny_model(tmp_path / "m")
    default_tokenizer.save_pretrained(str(path))
    llm = LLM(str(path), dtype="float32", num_kv_blocks=8, log_stats_interval=1e9)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        llm.generate(["The capital of France is"], use_tqdm=False)


def test_a_context_whose_rope_tables_exceed_memory_is_refused_before_loading(tmp_path):
    """A config declaring 10^9 positions built 32 GB of RoPE tables (15 GiB RSS, then a raw
    allocator error) when no max_model_len was given; a smaller max_model_len runs."""
    path = save_tiny_model(tmp_path / "m", max_position_embeddings=10**9)
    with pytest.raises(ValueError, match="of RoPE tables.*pass a smaller max_model_len"):
        LLM(str(path), dtype="float32", num_kv_blocks=8)
    LLM(str(path), dtype="float32", num_kv_blocks=8, max_model_len=64, log_stats_interval=1e9)


@pytest.mark.parametrize("kwargs", [dict(kv_cache_space=10**6), dict(num_kv_blocks=10**12),
                                    dict(num_kv_blocks=8, preemption_mode="swap", swap_space=10**6)])  # fmt: skip
def test_pools_beyond_the_machines_memory_are_refused_at_once(tmp_path, kwargs):
    """They were built block by block (a Python object each) until memory ran out."""
    from pagedllm.config import EngineConfig
    from pagedllm.engine.startup import kv_cache_sizes
    from pagedllm.model.arch import ModelArch

    path = save_tiny_model(tmp_path / "m")
    arch = ModelArch.from_hf_config(json.loads((path / "config.json").read_text()))
    with pytest.raises(ValueError, match="over 2x this machine's"):
        kv_cache_sizes(EngineConfig(model=str(path), **kwargs), arch)
    with pytest.raises(ValueError, match="over 2x this machine's"):
        LLM(str(path), dtype="float32", **kwargs)
    # Legitimate: a swap pool in a file on disk, and a pool a little over the memory (committed
    # only as blocks are written; a default 4 GiB pool on a "4 GB" machine ran before).
    ram_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    kv_cache_sizes(EngineConfig(model=str(path), preemption_mode="swap", swap_space=4 * ram_gib, swap_path=str(tmp_path / "s")), arch)
    kv_cache_sizes(EngineConfig(model=str(path), kv_cache_space=1.5 * ram_gib), arch)
