"""Mixture of experts (Qwen3-MoE): grouped expert computation, weight layouts, GGUF names, refusals.

The end-to-end check against transformers is the ``qwen3-moe`` variants of test_hf_models.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.model.arch import ModelArch
from pagedllm.model.moe import Qwen3MoeForCausalLM, SparseMoeBlock, gguf_moe_arch_fields, gguf_moe_tensors


def tiny_arch(**overrides) -> ModelArch:
    fields = dict(
        architecture="qwen3_moe", vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64, qk_norm=True,
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=12, norm_topk_prob=True,
    )  # fmt: skip
    fields.update(overrides)
    return ModelArch(**fields)


def random_block(arch: ModelArch, seed: int = 0) -> SparseMoeBlock:
    g = torch.Generator().manual_seed(seed)
    block = SparseMoeBlock(arch)
    for p in block.parameters():
        p.copy_(torch.randn(p.shape, generator=g))
    return block


def naive_moe(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Per token, per chosen expert: obviously right and slow (the reference only)."""
    weights, experts = block.route(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            out[t] += weights[t, j] * block.experts[int(experts[t, j])].forward(x[t : t + 1])[0]
    return out


@pytest.mark.parametrize("num_tokens", [1, 3, 37])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_grouped_experts_equal_a_per_token_loop(num_tokens, norm_topk_prob):
    arch = tiny_arch(norm_topk_prob=norm_topk_prob)
    block = random_block(arch)
    x = torch.randn(num_tokens, arch.hidden_size, generator=torch.Generator().manual_seed(num_tokens))
    calls = []
    for e, expert in enumerate(block.experts):  # count expert runs: one per expert hit, not per token
        run = expert.forward
        expert.forward = lambda h, e=e, run=run: calls.append((e, h.shape[0])) or run(h)
    got = block.forward(x)
    _, experts = block.route(x)
    hit = torch.bincount(experts.reshape(-1), minlength=arch.num_experts)
    assert sorted(calls) == [(e, int(n)) for e, n in enumerate(hit) if n > 0]
    torch.testing.assert_close(got, naive_moe(block, x), atol=1e-5, rtol=1e-5)


def test_routing_weights_follow_transformers_order():
    """Softmax over all experts, then top-k, then (optionally) renormalise."""
    arch = tiny_arch(num_experts_per_tok=3)
    block = random_block(arch, seed=1)
    x = torch.randn(5, arch.hidden_size)
    probs = torch.softmax(x @ block.gate.weight.T, dim=-1)
    top, idx = probs.topk(3, dim=-1)
    weights, experts = block.route(x)
    assert torch.equal(experts, idx)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))
    block.norm_topk_prob = False
    torch.testing.assert_close(block.route(x)[0], top)


def hf_state(arch: ModelArch, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under transformers' per-expert names (what save_pretrained writes)."""
    g = torch.Generator().manual_seed(seed)
    h, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    inter, e_inter, vocab = arch.intermediate_size, arch.moe_intermediate_size, arch.vocab_size
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            f"{p}input_layernorm.weight": (h,), f"{p}post_attention_layernorm.weight": (h,),
            f"{p}self_attn.q_proj.weight": (q, h), f"{p}self_attn.k_proj.weight": (kv, h),
            f"{p}self_attn.v_proj.weight": (kv, h), f"{p}self_attn.o_proj.weight": (h, q),
        })  # fmt: skip
        if arch.qk_norm:
            shapes.update({f"{p}self_attn.q_norm.weight": (arch.head_dim,), f"{p}self_attn.k_norm.weight": (arch.head_dim,)})
        if not arch.is_moe_layer(i):
            shapes.update({f"{p}mlp.gate_proj.weight": (inter, h), f"{p}mlp.up_proj.weight": (inter, h),
                           f"{p}mlp.down_proj.weight": (h, inter)})  # fmt: skip
            continue
        shapes[f"{p}mlp.gate.weight"] = (arch.num_experts, h)
        for e in range(arch.num_experts):
            x = f"{p}mlp.experts.{e}."
            shapes.update({f"{x}gate_proj.weight": (e_inter, h), f"{x}up_proj.weight": (e_inter, h),
                           f"{x}down_proj.weight": (h, e_inter)})  # fmt: skip
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def fuse_experts(arch: ModelArch, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights in transformers 5's in-memory layout: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    state = dict(state)
    for i in range(arch.num_layers):
        if not arch.is_moe_layer(i):
            continue
        p = f"model.layers.{i}.mlp.experts."
        e_range = range(arch.num_experts)
        gate_up = [torch.cat([state.pop(f"{p}{e}.gate_proj.weight"), state.pop(f"{p}{e}.up_proj.weight")]) for e in e_range]
        state[f"{p}gate_up_proj"] = torch.stack(gate_up)
        state[f"{p}down_proj"] = torch.stack([state.pop(f"{p}{e}.down_proj.weight") for e in e_range])
    return state


def test_fused_and_per_expert_checkpoints_load_the_same_model():
    arch = tiny_arch(num_layers=3, mlp_only_layers=[1])
    state = hf_state(arch)
    a = Qwen3MoeForCausalLM.from_hf_state_dict(arch, state, torch.float32, 64)
    b = Qwen3MoeForCausalLM.from_hf_state_dict(arch, fuse_experts(arch, state), torch.float32, 64)
    assert isinstance(a.layers[0].mlp, SparseMoeBlock) and not isinstance(a.layers[1].mlp, SparseMoeBlock)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    gate_up = a.layers[2].mlp.experts[4].gate_up_proj.weight
    p = "model.layers.2.mlp.experts.4."
    assert torch.equal(gate_up, torch.cat([state[f"{p}gate_proj.weight"], state[f"{p}up_proj.weight"]]))


def test_bad_expert_weights_are_clear_errors():
    arch = tiny_arch()
    fused = fuse_experts(arch, hf_state(arch))
    fused["model.layers.0.mlp.experts.down_proj"] = fused["model.layers.0.mlp.experts.down_proj"].transpose(1, 2)
    with pytest.raises(ValueError, match="down_proj has shape"):
        Qwen3MoeForCausalLM.from_hf_state_dict(arch, fused, torch.float32, 64)
    state = hf_state(arch)
    del state["model.layers.1.mlp.experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match="missing.*experts.5.up_proj"):
        Qwen3MoeForCausalLM.from_hf_state_dict(arch, state, torch.float32, 64)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        tiny_arch(num_experts_per_tok=7)


def test_config_reads_qwen3_moe_fields():
    cfg = dict(model_type="qwen3_moe", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=4,
               num_attention_heads=2, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=6,
               norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3], sliding_window=4096,
               use_sliding_window=False)  # fmt: skip
    arch = ModelArch.from_hf_config(cfg)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (4, 2, 6)
    assert arch.norm_topk_prob and arch.qk_norm and arch.sliding_window is None
    assert [arch.is_moe_layer(i) for i in range(4)] == [False, True, False, False]


def test_the_native_stack_refuses_a_mixture_of_experts():
    from pagedllm.model import fused_stack

    arch = tiny_arch(qk_norm=False)  # not refused for its q/k norms
    model = Qwen3MoeForCausalLM.from_hf_state_dict(arch, hf_state(arch), torch.float32, 64)
    assert "mixture-of-experts" in fused_stack.why_not(model, [])


def test_gguf_expert_stacks_map_to_per_expert_weights(tmp_path):
    """llama.cpp's qwen3moe tensors, written and read back by the gguf package, renamed by
    ``gguf_moe_tensors``: the per-expert Hugging Face weights, in the same orientation."""
    import gguf
    from gguf.quants import dequantize

    arch = tiny_arch(hidden_size=32)  # Q8_0 blocks hold 32 values
    state = hf_state(arch)
    w = gguf.GGUFWriter(str(tmp_path / "moe.gguf"), "qwen3moe")
    w.add_expert_count(arch.num_experts)
    w.add_expert_used_count(arch.num_experts_per_tok)
    w.add_expert_feed_forward_length(arch.moe_intermediate_size)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}.mlp."
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", state[f"{p}gate.weight"].numpy())
        for proj in ("gate", "up", "down"):
            stack = torch.stack([state[f"{p}experts.{e}.{proj}_proj.weight"] for e in range(arch.num_experts)]).numpy()
            if proj == "down":  # rows of 12 values: stays F32
                w.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", stack)
            else:
                q8 = gguf.GGMLQuantizationType.Q8_0
                w.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", gguf.quants.quantize(stack, q8), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    reader = gguf.GGUFReader(str(tmp_path / "moe.gguf"))
    got: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        _, layer, suffix = t.name.split(".", 2)
        tensor = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        got.update(gguf_moe_tensors(int(layer), suffix, tensor))
    moe_names = {k for k in state if ".mlp." in k}
    assert got.keys() == moe_names
    for k in moe_names:  # Q8_0 keeps ~1/127 of each block's largest value
        atol = 0.0 if "down_proj" in k or "gate.weight" in k else 0.05
        torch.testing.assert_close(got[k], state[k], atol=atol, rtol=0)
    assert gguf_moe_tensors(0, "attn_q.weight", torch.zeros(1)) is None

    fields = {f.name: f.contents() for f in reader.fields.values()}
    moe = gguf_moe_arch_fields(lambda key, default: fields.get(f"qwen3moe.{key}", default))
    assert moe == dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=12, norm_topk_prob=True)
    assert ModelArch(**{**tiny_arch().__dict__, **moe}).num_experts == 6


def test_experts_take_gguf_blocks_kept_packed():
    """attach_packed gives each expert's linears (and the router) their blocks; the small-step
    output stays what the dense weights give."""
    import gguf

    from gguf.quants import dequantize, quantize

    arch = tiny_arch(hidden_size=32, moe_intermediate_size=32, num_layers=1)
    state, packed = hf_state(arch), {}
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, t in state.items():
        if ".mlp." in name:  # the dense weights hold exactly the blocks' values
            blocks = quantize(t.numpy(), q8)
            packed[name] = ("Q8_0", torch.from_numpy(blocks))
            state[name] = torch.from_numpy(dequantize(blocks, q8).copy())
    model = Qwen3MoeForCausalLM.from_hf_state_dict(arch, state, torch.float32, 64)
    block = model.layers[0].mlp
    x = torch.randn(3, arch.hidden_size)
    dense = block.forward(x)
    n = model.attach_packed(packed)
    assert n == 1 + 2 * arch.num_experts  # the router, and gate_up + down of every expert
    assert block.experts[3].down_proj.packed is not None and block.gate.packed is not None
    assert model.layers[0].self_attn.o_proj.packed is None  # not given
    torch.testing.assert_close(block.forward(x), dense, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("quant", [None, "Q8_0"])
def test_qwen3_moe_gguf_matches_transformers(tmp_path, quant):
    """A tiny Qwen3-MoE written as llama.cpp's qwen3moe GGUF (expert stacks; F32, or Q8_0 blocks
    kept packed and run from the blocks) loads and decodes as transformers does."""
    import gguf
    import transformers

    from pagedllm import LLM, SamplingParams
    from tests.conftest import save_tiny_model
    from tests.model.gguf_writing import finish_gguf, start_gguf
    from tests.model.test_hf_models import oracle_greedy

    hf_dir = save_tiny_model(tmp_path / "hf", "qwen3_moe", seed=8, head_dim=16, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, norm_topk_prob=True)  # fmt: skip
    w, cfg, state = start_gguf(hf_dir, tmp_path / "moe.gguf", "qwen3moe")
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(32)
    w.add_eos_token_id(2)

    def add(name, t):
        if quant is None or t.ndim == 1 or name.endswith("ffn_gate_inp.weight"):
            w.add_tensor(name, np.ascontiguousarray(t))
        else:
            q = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(t), q), raw_dtype=q)

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    add("output.weight", state["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}  # fmt: skip
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, gg in names.items():
            add(f"blk.{i}.{gg}.weight", state[f"model.layers.{i}.{hf_name}.weight"])
        for proj in ("gate", "up", "down"):
            stack = np.stack([state[f"model.layers.{i}.mlp.experts.{e}.{proj}_proj.weight"] for e in range(4)])
            add(f"blk.{i}.ffn_{proj}_exps.weight", stack)
    finish_gguf(w)

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    if quant is not None:  # the oracle holds the same quantized values
        from gguf.quants import dequantize

        with torch.no_grad():
            for name, p in hf.model.layers.named_parameters():
                if p.dim() == 2 and not name.endswith("mlp.gate.weight"):
                    blocks = gguf.quants.quantize(p.detach().numpy(), gguf.GGMLQuantizationType.Q8_0)
                    p.copy_(torch.from_numpy(dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)))
            for p in (hf.model.embed_tokens.weight, hf.lm_head.weight):
                blocks = gguf.quants.quantize(p.detach().numpy(), gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)))
    llm = LLM(str(tmp_path / "moe.gguf"), dtype="float32", num_kv_blocks=32, dense_weights="no",
              max_num_batched_tokens=32, log_stats_interval=1e9)  # fmt: skip
    assert llm.llm_engine.runner.model.arch.num_experts == 4
    prompts = [[5, 6, 7], list(range(3, 50))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # fmt: skip
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == oracle_greedy(hf, p, 8)
