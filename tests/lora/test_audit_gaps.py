"""LoRA behaviours a mutation audit found unpinned (each rule could be broken without a test
failing): adapters the loader must refuse (a layer the model lacks, half a pair, fused and
unfused parts at once, weights outside target_modules, biases, extra trained modules, another
PEFT method, rank 0), PEFT's default lora_alpha, the slots' batched delta (scaling, the parts
side by side, each run of rows its own slot, a slot reloaded or cleared), and the manager's
bookkeeping when an adapter in a slot is removed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedllm.kernels import ops
from pagedllm.lora.adapter import LoRAAdapter, TargetShapes, load_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.slots import LinearSlots, LoRAContext, StepMapping

HIDDEN, Q, KV, INTER, LAYERS = 8, 8, 4, 16, 2
SHAPES = TargetShapes(LAYERS, {"q_proj": (HIDDEN, Q), "k_proj": (HIDDEN, KV), "v_proj": (HIDDEN, KV),
                               "qkv_proj": (HIDDEN, Q + 2 * KV), "o_proj": (Q, HIDDEN), "up_proj": (HIDDEN, INTER),
                               "gate_proj": (HIDDEN, INTER), "gate_up_proj": (HIDDEN, 2 * INTER),
                               "down_proj": (INTER, HIDDEN)}, {})  # fmt: skip


def _key(layer: int, module: str, which: str) -> str:
    part = "mlp" if module in ("up_proj", "gate_proj", "gate_up_proj", "down_proj") else "self_attn"
    return f"base_model.model.model.layers.{layer}.{part}.{module}.lora_{which}.weight"


def _pair(module: str, r: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n_in, n_out = SHAPES.shapes[module]
    return torch.randn(r, n_in, generator=g), torch.randn(n_out, r, generator=g)


def write_adapter(path: Path, config: dict, modules=("q_proj", "v_proj"), r: int = 4, layers=(0, 1), drop=()) -> str:
    """A PEFT-format adapter directory: ``config`` over a plain LoRA config of rank ``r``, and
    A/B tensors for ``modules`` in ``layers`` (less the keys in ``drop``)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(modules), "bias": "none"} | config
    (path / "adapter_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    tensors = {}
    for layer in layers:
        for i, m in enumerate(modules):
            a, b = _pair(m, r, seed=10 * layer + i)
            tensors[_key(layer, m, "A")], tensors[_key(layer, m, "B")] = a, b
    save_file({k: v for k, v in tensors.items() if k not in drop}, str(path / "adapter_model.safetensors"))
    return str(path)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(config={}, layers=(0, LAYERS)), f"is for layer {LAYERS}; the base model has {LAYERS} layers"),
        (dict(config={}, drop=(_key(1, "v_proj", "B"),)), "has lora_A but not both"),
        (dict(config={"target_modules": ["qkv_proj", "q_proj"]}, modules=("qkv_proj", "q_proj")), "which overlap"),
        (dict(config={"target_modules": ["q_proj"]}), "weights for v_proj not listed in target_modules"),
        (dict(config={"bias": "all"}), "bias='all' is not supported"),
        (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
        (dict(config={"peft_type": "IA3"}), "only LORA adapters"),
        (dict(config={"r": 0}), "r must be a positive integer"),
    ],
    ids=["layer-out-of-range", "half-pair", "fused-and-parts", "unlisted-weights", "bias", "modules-to-save", "ia3",
         "rank-0"],
)  # fmt: skip
def test_adapters_the_engine_cannot_apply_as_trained_are_refused(tmp_path, kwargs, message):
    """Each of these would otherwise load and serve something other than the trained model
    (weights silently dropped, a bias or an extra module ignored, another method read as LoRA)
    or crash later with an error that does not name the adapter."""
    path = write_adapter(tmp_path / "a", **kwargs)
    with pytest.raises(ValueError, match=message):
        load_adapter(LoRARequest("bad", 1, path), SHAPES, max_rank=8)


def test_lora_alpha_defaults_to_peft_s_8(tmp_path):
    """A config without lora_alpha: PEFT's default 8 applies (scaling 8 / r), as in the model
    PEFT would build from it; the rank and alpha at the limit still load."""
    a = load_adapter(LoRARequest("a", 1, write_adapter(tmp_path / "a", {"lora_alpha": None}, r=4)), SHAPES, max_rank=8)
    assert a.scaling == 2.0 and a.rank == 4
    b = load_adapter(LoRARequest("b", 2, write_adapter(tmp_path / "b", {"lora_alpha": 24}, r=8)), SHAPES, max_rank=8)
    assert b.scaling == 3.0


# ---------------------------------------------------------------------------- the batched delta
def _adapter(name: str, weights: dict[str, int], scaling: float, seed: int) -> LoRAAdapter:
    ws = {(0, m): _pair(m, r, seed + i) for i, (m, r) in enumerate(weights.items())}
    return LoRAAdapter(LoRARequest(name, seed + 1, "/" + name), max(weights.values()), scaling, tuple(sorted(weights)), ws)


def _expected_delta(adapter: LoRAAdapter | None, x: torch.Tensor) -> torch.Tensor:
    """PEFT's delta on the fused q/k/v output: each part's columns get (x A^T) B^T * scaling."""
    cols = {"q_proj": (0, Q), "k_proj": (Q, Q + KV), "v_proj": (Q + KV, Q + 2 * KV)}
    out = torch.zeros(x.shape[0], Q + 2 * KV)
    if adapter is not None:
        for (_, m), (a, b) in adapter.weights.items():
            c0, c1 = cols[m]
            out[:, c0:c1] += (x @ a.t()) @ b.t() * adapter.scaling
    return out


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_each_run_of_rows_gets_its_own_slot_s_delta(native):
    """The fused q/k/v linear with two slots: rows 0-1 take slot 1, row 2 none, rows 3-4 slot 0;
    each row's delta is its own adapter's PEFT delta, scaling included, every part in its own
    columns. After slot 0 is loaded with another adapter (the packed panels made for the old
    one must go) and slot 1 cleared, the same rows get the new adapter's delta and nothing."""
    if native and not ops.native_available():
        pytest.skip("no native kernels")
    ctx = LoRAContext()
    parts = {"q_proj": (0, Q), "k_proj": (Q, Q + KV), "v_proj": (Q + KV, Q + 2 * KV), "qkv_proj": (0, Q + 2 * KV)}
    slots = LinearSlots(ctx, parts, HIDDEN, Q + 2 * KV, max_loras=2, max_rank=4)
    qv = _adapter("qv", {"q_proj": 4, "v_proj": 2}, scaling=2.0, seed=1)
    k = _adapter("k", {"k_proj": 3}, scaling=0.5, seed=5)
    qk = _adapter("qk", {"q_proj": 1, "k_proj": 2}, scaling=3.0, seed=9)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(0))
    ctx.mapping = StepMapping([(1, 0, 2), (0, 3, 5)])

    def delta() -> torch.Tensor:
        y = torch.zeros(5, Q + 2 * KV)
        if native:
            slots.add_delta(x, y)
        else:
            with ops.torch_only():
                slots.add_delta(x, y)
        return y

    slots.load(0, qv, 0)
    slots.load(1, k, 0)
    want = torch.cat([_expected_delta(k, x[:2]), _expected_delta(None, x[2:3]), _expected_delta(qv, x[3:])])
    torch.testing.assert_close(delta(), want, rtol=1e-4, atol=1e-5)
    slots.load(0, qk, 0)
    slots.clear(1)
    want = torch.cat([_expected_delta(None, x[:3]), _expected_delta(qk, x[3:])])
    torch.testing.assert_close(delta(), want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------- the manager
def _model():
    """Just what the slot table reads of a model: per layer its q/k/v, o, gate/up and down
    linears' sizes (those of SHAPES)."""
    from types import SimpleNamespace as NS

    def lin(n_in: int, n_out: int):
        return NS(in_features=n_in, out_features=n_out)

    layer = lambda: NS(self_attn=NS(q_size=Q, kv_size=KV, qkv_proj=lin(HIDDEN, Q + 2 * KV), o_proj=lin(Q, HIDDEN)),  # noqa: E731
                       mlp=NS(intermediate_size=INTER, gate_up_proj=lin(HIDDEN, 2 * INTER), down_proj=lin(INTER, HIDDEN)))  # fmt: skip
    return NS(layers=[layer() for _ in range(LAYERS)])


def _manager(tmp_path: Path, n: int, **kw):
    from pagedllm.lora.manager import LoRAManager

    m = LoRAManager(_model(), **({"max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 3} | kw))
    reqs = [LoRARequest(f"a{i}", i, write_adapter(tmp_path / f"a{i}", {}, r=2 + i % 3)) for i in range(1, n + 1)]
    return m, reqs


def test_a_removed_adapter_s_slot_is_free_for_the_next_one(tmp_path):
    """remove() of an adapter in a slot empties that slot: the next step puts a new adapter
    there (the other slot's adapter, still needed, stays put) instead of failing on the
    removed adapter's bookkeeping."""
    m, (a, b, c) = _manager(tmp_path, 3)
    assert m.prepare_step([a, b]) == [0, 1]
    assert m.remove(a.lora_int_id) and m.loaded_ids() == [b.lora_int_id]
    assert m.prepare_step([c, b]) == [0, 1]
    assert m.slot_of(c.lora_int_id) == 0 and m.slot_of(b.lora_int_id) == 1 and m.num_slot_loads == 3


def test_an_adapter_live_requests_use_is_not_evicted_from_the_lru(tmp_path):
    """max_cpu_loras=1: loading b would evict a, but a live request still names a (in_use), so
    a stays loaded past the limit, and comes back into the slot without reading its files
    (which may be gone by then, as after an unload); once unused it goes."""
    import shutil

    m, (a, b) = _manager(tmp_path, 2, max_loras=1, max_cpu_loras=1)
    busy = {a.lora_int_id}
    m.in_use = lambda: set(busy)
    assert m.prepare_step([a]) == [0] and m.prepare_step([b]) == [0]
    assert sorted(m.loaded_ids()) == [1, 2]
    shutil.rmtree(a.lora_path)
    assert m.prepare_step([a]) == [0] and m.num_loads == 2
    busy.clear()
    m.prepare_step([b])
    assert m.loaded_ids() == [2]


def test_the_lru_drops_the_least_recently_used_adapter(tmp_path):
    """max_cpu_loras=3 and four adapters used in turn through one slot: the fourth load drops
    the one used longest ago (a), not a more recent one, so going back to b reads nothing."""
    m, (a, b, c, d) = _manager(tmp_path, 4, max_loras=1, max_cpu_loras=3)
    for r in (a, b, c, d):
        m.prepare_step([r])
    assert m.loaded_ids() == [2, 3, 4] and m.num_loads == 4
    m.prepare_step([b])
    assert m.num_loads == 4 and m.loaded_ids() == [3, 4, 2]


def test_a_new_adapter_takes_the_least_recently_used_slot_not_a_needed_one(tmp_path):
    """Two slots (a used last step, b before): c alone takes b's slot; c with b in one step
    takes a's slot instead, leaving b where it is (taking b's slot would copy b into a slot
    again, a reload every such step)."""
    m, (a, b, c) = _manager(tmp_path, 3, max_cpu_loras=4)
    m.prepare_step([a, b])
    m.prepare_step([a])
    assert m.prepare_step([c]) == [1] and m.num_slot_loads == 3
    m, (a, b, c) = _manager(tmp_path / "again", 3, max_cpu_loras=4)
    m.prepare_step([a, b])
    m.prepare_step([a])
    assert m.prepare_step([c, b]) == [0, 1] and m.num_slot_loads == 3


def test_an_adapter_pushed_out_of_its_slot_is_dropped_once_over_the_lru_limit(tmp_path):
    """max_cpu_loras=1: while b is loaded a still holds the slot, so a can only be dropped once
    b has replaced it there; it must go in that same step, not stay until the next load."""
    m, (a, b) = _manager(tmp_path, 2, max_loras=1, max_cpu_loras=1)
    m.prepare_step([a])
    m.prepare_step([b])
    assert m.loaded_ids() == [2] and m.slot_of(1) is None
