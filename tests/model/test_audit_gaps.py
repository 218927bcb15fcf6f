"""GGUF files: the header's alignment and tensor table as the gguf package reads them, and
llama.cpp's Q/K row order undone for every family its converter permutes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model.gguf_file import GGUFFile
from pagedllm.model.gguf_loader import _open
from tests.conftest import save_tiny_model
from tests.model.test_gguf import write_llama_gguf
from tests.model.test_gguf_file import _assert_same_as_gguf_reader
from tests.model.test_hf_models import oracle_greedy


def _write(path, alignment: int | None = None, names: tuple[str, ...] = ("aaa", "bbb")) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_string("t.str", "x" * 5)
    rng = np.random.default_rng(0)
    for i, name in enumerate(names):
        w.add_tensor(name, rng.standard_normal((2, 32 + 32 * i)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _assert_greedy_as_transformers(llm: LLM, hf) -> None:
    """Eight greedy tokens after a short and a longer prompt, as transformers gives them."""
    prompts = [[5, 6, 7], list(range(3, 30))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == oracle_greedy(hf, p, 8)


@pytest.mark.parametrize("alignment", [64, 256])
def test_tensor_data_starts_at_the_files_own_alignment(tmp_path, alignment):
    path = tmp_path / "aligned.gguf"
    _write(path, alignment)
    _assert_same_as_gguf_reader(path)
    f = GGUFFile(path)
    assert f.fields["general.alignment"] == alignment
    assert [t.data.shape for t in f.tensors] == [(2, 32), (2, 64)]


def test_duplicated_tensor_names_are_a_clear_error(tmp_path):
    path = tmp_path / "dup.gguf"
    _write(path)
    raw = path.read_bytes()
    assert raw.count(b"bbb") == 1
    path.write_bytes(raw.replace(b"bbb", b"aaa"))
    with pytest.raises(ValueError, match="duplicated tensor names"):
        _open(path)


def test_a_mistral_gguf_has_its_qk_rows_put_back(tmp_path):
    """llama.cpp's converter permutes Q/K rows for "mistral" files as for "llama" ones."""
    import transformers

    hf_dir = save_tiny_model(tmp_path / "hf", "mistral", seed=7, sliding_window=None)
    path = write_llama_gguf(hf_dir, tmp_path / "tiny.gguf", arch="mistral")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32, log_stats_interval=1e9)
    assert llm.llm_engine.runner.model.arch.architecture == "mistral"
    _assert_greedy_as_transformers(llm, hf)


def test_a_header_one_byte_short_in_its_last_string_is_a_clear_error(tmp_path):
    path = tmp_path / "strs.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("t.strs", ["abc", "defg"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    raw = path.read_bytes()
    end = raw.rfind(b"defg") + 4
    assert GGUFFile(path).fields["t.strs"] == ["abc", "defg"]
    path.write_bytes(raw[: end - 1])
    with pytest.raises(ValueError, match="truncated"):
        GGUFFile(path)


def test_unpermuting_refuses_odd_head_sizes():
    """Rotary pairs need an even head size: a file whose shapes give an odd one is refused by name."""
    from pagedllm.model.gguf_loader import unpermute_qk

    with pytest.raises(ValueError, match="even size"):
        unpermute_qk(torch.zeros(2 * 5, 8), 2)
    with pytest.raises(ValueError, match="even size"):
        unpermute_qk(torch.zeros(10, 8), 4)


def test_a_directory_of_several_gguf_files_is_ambiguous(tmp_path):
    from pagedllm.model.loader import resolve_model

    _write(tmp_path / "a.gguf")
    assert resolve_model(str(tmp_path)).path == tmp_path / "a.gguf"
    _write(tmp_path / "b.gguf")
    with pytest.raises(ValueError, match="exactly one .gguf"):
        resolve_model(str(tmp_path))


def test_quantized_expert_stacks_load_as_per_expert_blocks(tmp_path):
    """A qwen3moe file's Q8_0 expert stacks stay blocks: one ``QuantizedWeight`` per expert, a
    view of its rows of the stack, holding that expert's gguf-quantized matrix."""
    from pagedllm.model.gguf_loader import load_gguf
    from pagedllm.quantization.weights import QuantizedWeight
    from tests.model.gguf_writing import finish_gguf, start_gguf

    hf_dir = save_tiny_model(tmp_path / "hf", "qwen3_moe", seed=9, head_dim=16, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, num_hidden_layers=1)  # fmt: skip
    w, cfg, state = start_gguf(hf_dir, tmp_path / "moe.gguf", "qwen3moe")
    w.add_key_length(16)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(32)
    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", state["model.norm.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}  # fmt: skip
    for hf_name, gg in names.items():
        w.add_tensor(f"blk.0.{gg}.weight", state[f"model.layers.0.{hf_name}.weight"])
    for proj in ("gate", "up", "down"):
        stack = np.stack([state[f"model.layers.0.mlp.experts.{e}.{proj}_proj.weight"] for e in range(4)])
        w.add_tensor(f"blk.0.ffn_{proj}_exps.weight", gguf.quants.quantize(stack, q8), raw_dtype=q8)
    finish_gguf(w)

    _, loaded = load_gguf(tmp_path / "moe.gguf")
    for e in range(4):
        for proj in ("gate", "up", "down"):
            name = f"model.layers.0.mlp.experts.{e}.{proj}_proj.weight"
            got = loaded[name]
            assert isinstance(got, QuantizedWeight) and got.qtype == "Q8_0", name
            assert got.shape == state[name].shape, name
            assert np.array_equal(got.data.numpy(), gguf.quants.quantize(state[name], q8)), name


def test_a_qwen2_gguf_with_qkv_biases_matches_transformers(tmp_path):
    """llama.cpp's qwen2 files carry attn_q/k/v biases (rows in the checkpoint's order): they load
    into the fused projection and the greedy tokens are transformers'."""
    import transformers

    from tests.model.gguf_writing import finish_gguf, start_gguf

    hf_dir = save_tiny_model(tmp_path / "hf", "qwen2", seed=10)
    w, cfg, state = start_gguf(hf_dir, tmp_path / "qwen2.gguf", "qwen2")
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    rng = np.random.default_rng(10)
    biases = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in state.items() if ".bias" in k}
    state.update(biases)
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", state["model.norm.weight"])
    w.add_tensor("output.weight", state["lm_head.weight"])
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}  # fmt: skip
    for p in "qkv":
        names[f"self_attn.{p}_proj.weight"] = f"attn_{p}.weight"
        names[f"self_attn.{p}_proj.bias"] = f"attn_{p}.bias"
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, gg in names.items():
            w.add_tensor(f"blk.{i}.{gg}", state[f"model.layers.{i}.{hf_name}"])
    finish_gguf(w)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    assert len(biases) == 3 * cfg["num_hidden_layers"]
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in biases:
                p.copy_(torch.from_numpy(biases[name]))
    llm = LLM(str(tmp_path / "qwen2.gguf"), dtype="float32", num_kv_blocks=32, log_stats_interval=1e9)
    assert llm.llm_engine.runner.model.arch.qkv_bias
    _assert_greedy_as_transformers(llm, hf)


def test_gemma2_soft_caps_of_zero_mean_none(tmp_path):
    """A file that stores a soft-cap of 0 asks for no cap (llama.cpp's reading), not a cap of 0."""
    from tests.model.test_gguf_archs import _arch_of, write_meta_only

    def caps(w) -> None:
        w.add_key_length(32)
        w.add_attn_logit_softcapping(0.0)
        w.add_final_logit_softcapping(0.0)

    arch = _arch_of(write_meta_only(tmp_path / "g2.gguf", "gemma2", caps))
    assert arch.attn_logit_softcapping is None and arch.final_logit_softcapping is None
