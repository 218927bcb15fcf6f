"""Phi-3 and Gemma 2 GGUF files, written in llama.cpp's layout by the gguf package: pagedllm
decodes them as transformers decodes the same file, and refuses what it does not run.

transformers' GGUF reader maps neither Phi-3's ``attention.sliding_window`` nor Gemma 2's
soft-caps (it keeps its config defaults, 50 and 30, and query_pre_attn_scalar 256), so the
oracle loads the file's tensors and gets those few values as config overrides - the values
the file carries (and, for the query scale, the one llama.cpp derives from the file).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagedllm import LLM
from tests.conftest import save_tiny_model
from tests.model.gguf_writing import assert_greedy_matches_oracle, finish_gguf, start_gguf

# Hugging Face layer tensor (after "model.layers.N.", without ".weight") -> llama.cpp's name.
_PHI3_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
_GEMMA2_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip


def _phi3_meta(w: Any, cfg: dict[str, Any]) -> None:
    """The keys llama.cpp's Phi3MiniModel converter writes (plus vocab size and special ids)."""
    heads = cfg["num_attention_heads"]
    w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    w.add_pad_token_id(cfg["pad_token_id"])


def _gemma2_meta(w: Any, cfg: dict[str, Any]) -> None:
    """The keys llama.cpp's Gemma2Model converter writes: no RoPE base (10000 is the default)."""
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])


# arch -> (layer names, metadata writer, whether norm weights are stored as 1 + w)
_ARCHS: dict[str, tuple[dict[str, str], Callable[[Any, dict[str, Any]], None], bool]] = {
    "phi3": (_PHI3_NAMES, _phi3_meta, False),
    "gemma2": (_GEMMA2_NAMES, _gemma2_meta, True),
}


def write_gguf(hf_dir: Path, out: Path, arch: str, quant: str | None = None) -> Path:
    """Convert a tiny saved model to GGUF as llama.cpp's converter lays it out: F32 tensors, or
    every matrix quantized to ``quant`` by the gguf package."""
    import gguf

    names, write_meta, plus_one = _ARCHS[arch]
    w, cfg, state = start_gguf(hf_dir, out, arch)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    write_meta(w, cfg)

    def add(name: str, t: np.ndarray) -> None:
        if t.ndim == 1 and plus_one and name.endswith("norm.weight"):
            t = t + 1.0  # llama.cpp's Gemma converters store 1 + w
        if quant is None or t.ndim != 2:
            w.add_tensor(name, np.ascontiguousarray(t))
            return
        qtype = getattr(gguf.GGMLQuantizationType, quant)
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(t), qtype), raw_dtype=qtype)

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    if "lm_head.weight" in state:  # absent when tied (Gemma's converter never writes it)
        add("output.weight", state["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, gg_name in names.items():
            add(f"blk.{i}.{gg_name}.weight", state[f"model.layers.{i}.{hf_name}.weight"])
    finish_gguf(w)
    return out


# arch -> (model_type, tiny config overrides, the oracle's overrides of what transformers' GGUF
# reader leaves at its defaults). Phi-3 slides over 40 positions on every layer; Gemma 2
# alternates sliding (window 24) and global layers, with soft-caps away from the defaults, and
# ties its LM head to the embedding as every Gemma 2 (llama.cpp's converter writes no output.weight).
VARIANTS = {
    "phi3": ("phi3", {"sliding_window": 40, "pad_token_id": 0}, {"sliding_window": 40}),
    "gemma2": (
        "gemma2",
        {"head_dim": 16, "sliding_window": 24, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 4.0,
         "final_logit_softcapping": 8.0, "tie_word_embeddings": True},
        {"query_pre_attn_scalar": 16, "attn_logit_softcapping": 4.0, "final_logit_softcapping": 8.0},
    ),
}  # fmt: skip
# (GGUF type of the matrices, engine settings): F32; Q8_0 dense for big steps with the blocks
# kept for small ones; Q8_0 run from its blocks on every step.
MODES = {
    "f32": (None, {}),
    "q8_0": ("Q8_0", {}),
    "q8_0-blocks": ("Q8_0", {"dense_weights": "no"}),
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("arch", sorted(VARIANTS))
def test_gguf_greedy_matches_transformers_on_the_same_file(tmp_path, arch, mode):
    import transformers

    model_type, overrides, oracle_overrides = VARIANTS[arch]
    quant, engine_args = MODES[mode]
    hf_dir = save_tiny_model(tmp_path / "hf", model_type, seed=5, **overrides)
    (tmp_path / "gguf").mkdir()  # a directory of its own: transformers reads only the file
    gguf_file = write_gguf(hf_dir, tmp_path / "gguf" / f"{arch}.gguf", arch, quant)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32, **oracle_overrides
    ).eval()
    assert hf.config.model_type == model_type

    llm = LLM(str(gguf_file), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32, log_stats_interval=1e9,
              **engine_args)  # fmt: skip
    model = llm.llm_engine.runner.model
    window = overrides["sliding_window"]
    assert model.arch.sliding_window == window
    if arch == "phi3":  # every layer slides, as transformers runs Phi-3 (llama.cpp ignores the window)
        assert model.layers[0].self_attn.window == window and model.layers[1].self_attn.window == window
    else:  # sliding, global; caps and scale as the file (and llama.cpp) say
        assert [layer.self_attn.window for layer in model.layers] == [window, None]
        caps = (model.arch.attn_logit_softcapping, model.arch.final_logit_softcapping)
        assert caps == (4.0, 8.0) and model.arch.query_pre_attn_scalar == 16
    qkv, gate_up = model.layers[1].self_attn.qkv_proj, model.layers[1].mlp.gate_up_proj
    if mode == "q8_0":  # the small-step blocks reach the fused layers too
        assert qkv.packed is not None and gate_up.packed is not None
    if mode == "q8_0-blocks":
        assert qkv.weight is None and qkv.quant[0].qtype == "Q8_0" and gate_up.quant[0].qtype == "Q8_0"

    g = torch.Generator().manual_seed(0)
    # Lengths across block boundaries and past both windows; prefill in chunks of 32.
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (1, 5, 17, 30, 60, 100)]
    assert_greedy_matches_oracle(llm, hf, prompts)


def write_meta_only(
    out: Path, arch: str, fields: Callable[[Any], None], tensors: tuple[str, ...] = (), num_layers: int = 2
) -> Path:
    """A GGUF of one tiny model's metadata (``fields`` adds to it) and a few tensors: enough
    for ``read_gguf_arch``, which runs before any weight is read."""
    import gguf

    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(num_layers)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_vocab_size(256)
    fields(w)
    w.add_tensor("token_embd.weight", np.zeros((256, 64), dtype=np.float32))
    for name in tensors:
        w.add_tensor(name, np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _arch_of(path: Path):
    from pagedllm.model.gguf_file import GGUFFile
    from pagedllm.model.gguf_loader import read_gguf_arch

    return read_gguf_arch(GGUFFile(path), path)


def test_gguf_metadata_defaults_follow_llama_cpp(tmp_path):
    """Keys a file may lack take llama.cpp's values: Gemma 2's caps 50 / 30, window 4096,
    every 2nd layer global, query scale head_dim (hidden / heads for the 46-layer 27B); a
    sliding_window_pattern, given, decides; Phi-3's window 0 means none."""
    from pagedllm.model.arch import FULL, SLIDING

    g2 = _arch_of(write_meta_only(tmp_path / "g2.gguf", "gemma2", lambda w: w.add_key_length(32)))
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.sliding_window) == (50.0, 30.0, 4096)
    assert g2.layer_types == [SLIDING, FULL] and g2.query_pre_attn_scalar == 32
    assert g2.attention_scale == 32**-0.5
    assert g2.hidden_act == "gelu_tanh" and not g2.qk_norm and g2.tie_word_embeddings

    def big(w: Any) -> None:
        w.add_key_length(32)
        w.add_sliding_window_pattern([i % 3 != 2 for i in range(46)])

    g27 = _arch_of(write_meta_only(tmp_path / "g27.gguf", "gemma2", big, num_layers=46))
    assert g27.query_pre_attn_scalar == 64 // 4
    assert g27.layer_types[:6] == [SLIDING, SLIDING, FULL] * 2

    def gemma3(w: Any) -> None:
        w.add_key_length(32)
        w.add_sliding_window(8)

    # Gemma 3: head_dim, except 27B (62 layers; its query_pre_attn_scalar 168 is 5376 / 32).
    g3 = _arch_of(write_meta_only(tmp_path / "g3.gguf", "gemma3", gemma3))
    g3_27 = _arch_of(write_meta_only(tmp_path / "g3_27.gguf", "gemma3", gemma3, num_layers=62))
    assert (g3.query_pre_attn_scalar, g3_27.query_pre_attn_scalar) == (32, 64 // 4)
    # Its local layers' RoPE base (not in the file: llama.cpp's 10000), and five local layers
    # to one global, as transformers' Gemma3TextConfig.
    assert g3_27.rope_local_theta == 10000.0 and g3_27.sliding_window == 8
    assert g3_27.layer_types[:12] == [SLIDING] * 5 + [FULL] + [SLIDING] * 5 + [FULL]

    phi = _arch_of(write_meta_only(tmp_path / "phi.gguf", "phi3", lambda w: w.add_sliding_window(0)))
    assert phi.sliding_window is None and phi.layer_types is None and phi.head_dim == 16


def _yarn(w: Any) -> None:
    import gguf

    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)


def _linear8(w: Any) -> None:  # what llama.cpp writes for Gemma 3 4B-27B
    import gguf

    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(8.0)


@pytest.mark.parametrize(
    ("arch", "fields", "tensors", "message"),
    [
        ("phi3", lambda w: w.add_rope_dimension_count(12), (), r"partial rotary embedding \(12 of 16"),
        ("phi3", lambda w: None, ("rope_factors_long.weight", "rope_factors_short.weight"), "LongRoPE scaling"),
        ("phi3", _yarn, (), "rope scaling type 'yarn'"),
        ("gemma2", _yarn, (), "rope scaling type 'yarn'"),
        # Found by an adversarial session: these families ran such files with plain RoPE.
        ("llama", _linear8, (), "rope scaling type 'linear'"),
        ("qwen2", _yarn, (), "rope scaling type 'yarn'"),
        ("gemma3", lambda w: (_linear8(w), w.add_sliding_window(8)), (), "rope scaling type 'linear'"),
        ("llama", lambda w: w.add_rope_dimension_count(8), (), r"partial rotary embedding \(8 of 16"),
    ],
    ids=["phi3-partial-rotary", "phi3-longrope", "phi3-yarn", "gemma2-yarn", "llama-linear", "qwen2-yarn", "gemma3-linear",
         "llama-partial-rotary"],
)
def test_gguf_with_unsupported_rope_is_a_clear_error(tmp_path, arch, fields, tensors, message):
    path = write_meta_only(tmp_path / f"{arch}.gguf", arch, fields, tensors)
    with pytest.raises(ValueError, match=f"{arch}.*{message}.* is not supported"):
        LLM(str(path), dtype="float32", num_kv_blocks=8)
