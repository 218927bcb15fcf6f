"""Multi-LoRA on a tiny random Llama: adapter validation, the slot table and its LRU, the
scheduler's adapter cap, prefix-cache keying by adapter, and greedy parity with transformers +
PEFT (adapters merged) for several adapters and the base model mixed in one batch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.kv_cache.kv_cache_manager import KVCacheManager
from pagedllm.lora.adapter import load_adapter
from pagedllm.lora.manager import LoRAManager
from pagedllm.request import Request
from pagedllm.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.conftest import save_tiny_model
from tests.lora.adapters import make_peft_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("lora-base"))


@pytest.fixture(scope="module")
def hf(base):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("lora-adapters")
    return {
        "qv4": make_peft_adapter(hf, d / "qv4", 4, ["q_proj", "v_proj"], seed=1, b_std=0.3),
        "all8-rslora": make_peft_adapter(hf, d / "all8", 8, ALL, seed=2, b_std=0.3, rslora=True),
        "mlp2": make_peft_adapter(hf, d / "mlp2", 2, ["up_proj", "down_proj"], seed=3, b_std=0.3),
        "ko16": make_peft_adapter(hf, d / "ko16", 16, ["k_proj", "o_proj"], seed=4, b_std=0.3),
    }


def lora(adapters, name: str, i: int) -> LoRARequest:
    return LoRARequest(name, i, str(adapters[name]))


_MERGED: dict[tuple, list[int]] = {}


def merged_greedy(base: Path, adapter: Path | None, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens with the adapter merged into the weights by PEFT."""
    key = (base, adapter, tuple(prompt), n)
    if key not in _MERGED:
        import peft
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
        if adapter is not None:
            model = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
        _MERGED[key] = out[0, len(prompt) :].tolist()
    return _MERGED[key]


# ---------------------------------------------------------------------------- validation
@pytest.fixture(scope="module")
def manager(base) -> LoRAManager:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.startup import load_model

    model = load_model(EngineConfig(model=str(base))).model
    return LoRAManager(model, max_loras=2, max_lora_rank=8, max_cpu_loras=3)


def test_adapter_loads_with_peft_scaling(manager, adapters):
    plain = manager.add(lora(adapters, "qv4", 1))
    assert plain.rank == 4 and plain.scaling == pytest.approx(8 / 4) and plain.target_modules == ("q_proj", "v_proj")
    rs = manager.add(lora(adapters, "all8-rslora", 2))
    assert rs.scaling == pytest.approx(16 / 8**0.5) and set(rs.target_modules) == set(ALL)
    assert torch.count_nonzero(rs.weights[(0, "q_proj")][1]) > 0  # B is not zero


def _broken(adapters, tmp_path, edit) -> str:
    path = tmp_path / "broken"
    shutil.copytree(adapters["qv4"], path)
    edit(path)
    return str(path)


def _edit_weights(path: Path, change) -> None:
    """Rewrite the adapter's first lora_B tensor as ``change(tensor)`` returns it."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "adapter_model.safetensors"))
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key] = change(tensors[key].clone())
    save_file(tensors, str(path / "adapter_model.safetensors"))


def _set_config(**changes):
    def edit(path: Path) -> None:
        cfg = json.loads((path / "adapter_config.json").read_text())
        cfg.update(changes)
        (path / "adapter_config.json").write_text(json.dumps(cfg))

    return edit


@pytest.mark.parametrize(
    "edit, message",
    [
        (None, "no such adapter directory"),
        (lambda p: (p / "adapter_config.json").unlink(), "no adapter_config.json"),
        (lambda p: (p / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors"),
        (lambda p: (p / "adapter_config.json").write_text("{not json"), "not valid JSON"),
        (_set_config(r=32), "rank 32 exceeds max_lora_rank 8"),
        (_set_config(target_modules=["q_proj", "lm_head"]), "unknown target module(s) lm_head"),
        (_set_config(use_dora=True), "DoRA"),
        (_set_config(alora_invocation_tokens=[5, 6]), "activated LoRA"),  # it acts only after those tokens
        (_set_config(r=3), "do not fit the base's"),  # tensors of rank 4 under a config of rank 3
        (_set_config(lora_alpha=float("nan")), "lora_alpha must be a finite number"),
        (lambda p: _edit_weights(p, lambda t: t.fill_(float("nan"))), "NaN or infinite"),
        (lambda p: _edit_weights(p, lambda t: t.to(torch.int64)), "must be floating point"),
        ("x" * 5000, "cannot open the adapter directory"),
    ],
    ids=["missing-dir", "no-config", "no-weights", "bad-json", "over-rank", "unknown-target", "dora", "alora", "rank-mismatch",
         "nan-alpha", "nan-weights", "int-weights", "path-too-long"],
)
def test_bad_adapters_are_refused_clearly(manager, adapters, tmp_path, edit, message):
    # (NaN weights used to load and make the adapter's requests emit token 0; a path too long
    # for the OS was an OSError, a 500 on the server: found by an adversarial session.)
    if isinstance(edit, str):
        path = str(tmp_path / edit)
    else:
        path = str(tmp_path / "nowhere") if edit is None else _broken(adapters, tmp_path, edit)
    before = manager.loaded_ids()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        manager.add(LoRARequest("bad", 99, path))
    assert manager.loaded_ids() == before


def test_adapter_of_another_model_is_a_shape_error(manager, tmp_path):
    import transformers

    other = save_tiny_model(tmp_path / "other", hidden_size=32, intermediate_size=64)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(other)).eval()
    path = make_peft_adapter(model, tmp_path / "other-adapter", 4, ["q_proj"], seed=5)
    with pytest.raises(ValueError, match=r"do not fit the base's 64 -> 64 linear"):
        manager.add(LoRARequest("other", 98, str(path)))


def test_load_adapter_is_plain(manager, adapters):
    a = load_adapter(lora(adapters, "mlp2", 3), manager.table.targets, max_rank=8)
    assert a.weights[(1, "down_proj")][0].shape == (2, 128) and a.weights[(1, "down_proj")][1].shape == (64, 2)


def test_lora_request_checks_its_fields():
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("a", 1, "")


# ---------------------------------------------------------------------------- slots and LRU
def test_slots_and_lru(base, adapters):
    from pagedllm.config import EngineConfig
    from pagedllm.engine.startup import load_model

    m = LoRAManager(load_model(EngineConfig(model=str(base))).model, max_loras=2, max_lora_rank=16, max_cpu_loras=3)
    a, b, c, d = (lora(adapters, n, i + 1) for i, n in enumerate(["qv4", "all8-rslora", "mlp2", "ko16"]))
    assert m.prepare_step([a, None, b, a]) == [0, -1, 1, 0]
    assert m.num_slot_loads == 2 and m.loaded_ids() == [1, 2]
    # c needs a slot: the least recently used one whose adapter this step does not need (a's).
    assert m.prepare_step([b]) == [1]
    assert m.prepare_step([c, b]) == [0, 1] and m.slot_of(1) is None
    # The slot's old columns are gone: c (up/down only) left q/k/v empty, a's q/v columns zeroed.
    qkv = m.table.layers[0]["qkv_proj"]
    assert qkv.width[0] == 0 and torch.count_nonzero(qkv.a[0]) == 0 and torch.count_nonzero(qkv.b[0]) == 0
    assert m.table.layers[0]["gate_up_proj"].width[0] == 2
    m.add(d)  # a fourth adapter: the LRU (max 3) drops the least recently used not in a slot (a)
    assert sorted(m.loaded_ids()) == [2, 3, 4]
    with pytest.raises(RuntimeError, match="3 distinct LoRA adapters"):
        m.prepare_step([a, b, c])
    with pytest.raises(ValueError, match="an id must always name the same adapter"):
        m.add(LoRARequest("renamed", 2, str(adapters["qv4"])))
    assert m.remove(3) and m.slot_of(3) is None and 3 not in m.loaded_ids()
    assert LoRAManager.mapping([0, 0, -1, 1, 0], [1, 1, 1, 5, 3]).runs == [(0, 0, 2), (1, 3, 8), (0, 8, 11)]
    assert LoRAManager.mapping([-1, -1], [4, 1]) is None


def test_the_least_recently_used_slot_is_the_one_reused(base, adapters):
    """Three slots, so a choice among several free ones: with max_loras=2 only one slot was ever
    free, and reusing the most recently used one passed (found by a mutation audit)."""
    from pagedllm.config import EngineConfig
    from pagedllm.engine.startup import load_model

    m = LoRAManager(load_model(EngineConfig(model=str(base))).model, max_loras=3, max_lora_rank=16, max_cpu_loras=4)
    a, b, c, e = (lora(adapters, n, i + 1) for i, n in enumerate(["qv4", "all8-rslora", "mlp2", "ko16"]))
    for step in ([a], [b], [c], [b], [c]):
        m.prepare_step(step)
    assert m.num_slot_loads == 3
    m.prepare_step([e])  # a's slot was used longest ago
    assert m.slot_of(1) is None and m.slot_of(2) is not None and m.slot_of(3) is not None
    assert m.num_slot_loads == 4


# ---------------------------------------------------------------------------- scheduling
def _req(i: int, lora_id: int) -> Request:
    from pagedllm.sampling_params import SamplingParams as SP

    lr = LoRARequest(f"a{lora_id}", lora_id, f"/a{lora_id}") if lora_id else None
    return Request(f"r{i}", None, [1, 2, 3, 4], SP(max_tokens=4), lora_request=lr)


def test_scheduler_caps_distinct_adapters_without_blocking_others():
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, max_loras=2),
                  KVCacheManager(64, 4))  # fmt: skip
    for i, lora_id in enumerate([1, 2, 3, 0, 1, 3]):
        s.add_request(_req(i, lora_id))
    out = s.schedule()
    assert [x.req_id for x in out.scheduled] == ["r0", "r1", "r3", "r4"]  # r2, r5 (adapter 3) wait
    assert [r.request_id for r in s.waiting] == ["r2", "r5"]  # in their order
    assert {x.new.lora_request.lora_int_id for x in out.scheduled if x.new.lora_request} == {1, 2}
    # Once adapter 2's only request ends, adapter 3's requests get in.
    s.finish(s.requests["r1"], s.requests["r1"].status.FINISHED_ABORTED)
    out = s.schedule()
    assert {x.req_id for x in out.scheduled} == {"r0", "r3", "r4", "r2", "r5"}


def test_prefix_cache_blocks_are_keyed_by_adapter():
    kv = KVCacheManager(64, 4, enable_caching=True)
    tokens = list(range(20))
    keys = [(), LoRARequest("a", 1, "/a").cache_key, LoRARequest("b", 2, "/b").cache_key]
    hashes = [kv._block_hashes(f"r{i}", tokens, extra_keys=k) for i, k in enumerate(keys)]
    assert len({h[0] for h in hashes}) == 3  # even the first block differs


# ---------------------------------------------------------------------------- the engine
def test_lora_needs_enable_lora(base, adapters):
    llm = LLM(str(base), num_kv_blocks=32, log_stats_interval=1e9)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([{"prompt_token_ids": [1, 2]}], lora_request=lora(adapters, "qv4", 1), use_tqdm=False)


def test_two_adapters_and_base_never_share_kv_blocks(base, adapters):
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=64, log_stats_interval=1e9)
    prompt = {"prompt_token_ids": [(7 * i) % 250 + 3 for i in range(100)]}  # 6 full blocks
    params = SamplingParams(temperature=0, max_tokens=4)
    a, b = lora(adapters, "qv4", 1), lora(adapters, "all8-rslora", 2)

    def cached(req) -> int:
        return llm.generate([prompt], params, lora_request=req, use_tqdm=False)[0].num_cached_tokens

    assert [cached(None), cached(a), cached(b)] == [0, 0, 0]  # same tokens, other adapter: no hit
    assert [cached(b), cached(a), cached(None)] == [96, 96, 96]  # the same adapter again: its own blocks
    # All three in one batch, after a reset: nobody reuses another's blocks.
    llm.reset_prefix_cache()
    outs = llm.generate([prompt] * 3, params, lora_request=[None, a, b], use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 3
    assert [o.lora_request for o in outs] == [None, a, b]  # each output names its adapter, as vLLM's


@pytest.mark.parametrize("config", [dict(), dict(num_kv_blocks=12, max_num_batched_tokens=16), dict(torch_only=True)],
                         ids=["default", "preemption", "torch-kernels"])  # fmt: skip
def test_mixed_batch_matches_transformers_with_merged_adapters(base, adapters, config):
    """(torch-kernels: the slots' torch path, for machines without the native kernels.)"""
    if config.get("torch_only"):
        from pagedllm.kernels import ops

        with ops.torch_only():
            return test_mixed_batch_matches_transformers_with_merged_adapters(base, adapters, {})
    names = list(adapters)
    prompts = [[5, 9, 33, 71, 100, 3, 8], [17, 18, 19, 20, 21] * 6, [200, 201], [(3 * i) % 240 + 2 for i in range(40)]]
    # Every prompt with every adapter and the base; max_loras=2 makes adapters wait for a slot.
    reqs = [None] + [lora(adapters, n, i + 1) for i, n in enumerate(names)]
    batch = [(p, r) for p in prompts for r in reqs]
    kwargs = dict(enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2, num_kv_blocks=64,
                  log_stats_interval=1e9) | config  # fmt: skip
    llm = LLM(str(base), **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], SamplingParams(temperature=0, max_tokens=10),
                        lora_request=[r for _, r in batch], use_tqdm=False)  # fmt: skip
    if "num_kv_blocks" in config:
        assert llm.llm_engine.num_preemptions_total > 0
    runner_lora = llm.llm_engine.runner.lora
    assert runner_lora.num_slot_loads >= len(names) > runner_lora.max_loras  # 4 adapters took turns in 2 slots
    for (p, r), o in zip(batch, outs):
        ref = merged_greedy(base, None if r is None else Path(r.lora_path), p, 10)
        assert o.outputs[0].token_ids == ref, f"{r and r.lora_name} on prompt {p[:5]}"
    # The adapters do change the answers.
    by_prompt = [{tuple(o.outputs[0].token_ids) for (p2, _), o in zip(batch, outs) if p2 == p} for p in prompts]
    assert all(len(s) >= 4 for s in by_prompt)


def test_two_lora_engines_in_one_process_are_independent(base, adapters):
    kwargs = dict(enable_lora=True, max_loras=1, max_lora_rank=16, num_kv_blocks=32, log_stats_interval=1e9)
    first, second = LLM(str(base), **kwargs), LLM(str(base), **kwargs)
    prompt, params = [{"prompt_token_ids": [9, 8, 7, 6, 5]}], SamplingParams(temperature=0, max_tokens=8)
    a, b = lora(adapters, "qv4", 1), lora(adapters, "ko16", 1)  # the same id in each engine, other adapters
    outs = [e.generate(prompt, params, lora_request=r, use_tqdm=False)[0].outputs[0].token_ids
            for e, r in [(first, a), (second, b), (first, a), (second, None)]]  # fmt: skip
    assert outs[0] == outs[2] == merged_greedy(base, Path(a.lora_path), prompt[0]["prompt_token_ids"], 8)
    assert outs[1] == merged_greedy(base, Path(b.lora_path), prompt[0]["prompt_token_ids"], 8)
    assert outs[3] == merged_greedy(base, None, prompt[0]["prompt_token_ids"], 8)


def test_bench_writes_adapters_the_engine_loads(manager, tmp_path):
    from pagedllm.bench.lora import write_random_adapter

    path = write_random_adapter(tmp_path / "bench-adapter", manager.table.targets, rank=4, seed=0)
    adapter = manager.add(LoRARequest("bench", 77, str(path)))
    assert set(adapter.target_modules) == set(ALL) and adapter.scaling == 2.0
    manager.remove(77)


def test_an_adapter_that_requests_wait_for_stays_loaded_when_its_files_go(base, adapters, tmp_path):
    """With one adapter kept in memory, loading B evicted A while A's requests still waited;
    A's directory was then deleted (as after an unload), the step re-read it from disk, failed
    for every request in it, and the engine was declared dead (an adversarial session). Now an
    adapter live requests use is never evicted, and its id keeps naming it."""
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine

    shutil.copytree(adapters["qv4"], tmp_path / "a")
    a, b = LoRARequest("a", 1, str(tmp_path / "a")), lora(adapters, "mlp2", 2)
    engine = LLMEngine(EngineConfig(model=str(base), enable_lora=True, max_loras=1, max_lora_rank=16, max_cpu_loras=1,
                                    num_kv_blocks=64), log_stats_interval=0)  # fmt: skip
    prompt, params = [9, 8, 7, 6, 5], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request({"prompt_token_ids": prompt}, params, "b0", lora_request=b)
    engine.step()  # b0 runs, in the one slot
    engine.add_request({"prompt_token_ids": prompt}, params, "a1", lora_request=a)
    engine.add_request({"prompt_token_ids": prompt}, params, "b1", lora_request=b)
    shutil.rmtree(tmp_path / "a")
    with pytest.raises(ValueError, match="an id must always name the same adapter"):
        engine.add_request({"prompt_token_ids": prompt}, params, "x", lora_request=lora(adapters, "ko16", 1))
    outs = {}
    while engine.has_unfinished_requests():
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    assert {k: o.error for k, o in outs.items()} == {"b0": None, "a1": None, "b1": None}
    assert outs["a1"].outputs[0].token_ids == merged_greedy(base, adapters["qv4"], prompt, 6)
    assert outs["b1"].outputs[0].token_ids == merged_greedy(base, adapters["mlp2"], prompt, 6)
    engine.add_request({"prompt_token_ids": prompt}, params, "c", lora_request=lora(adapters, "ko16", 3))
    manager = engine.runner.lora  # unused now, a and b make room, but for the one in the slot
    assert sorted(manager.loaded_ids()) == sorted([3, *(i for i in (1, 2) if manager.slot_of(i) is not None)])
    assert len(manager.loaded_ids()) == 2


def test_beam_search_runs_with_the_adapter(base, adapters):
    """A beam search with a LoRA adapter ran the base model (an adversarial session): its
    beams are those of transformers' beam search with the adapter merged."""
    import peft
    import transformers

    prompt = [5, 9, 33, 71, 100]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(model, str(adapters["all8-rslora"])).merge_and_unload()
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), num_beams=2, do_sample=False, max_new_tokens=6, early_stopping=False)
    llm = LLM(str(base), enable_lora=True, max_lora_rank=16, num_kv_blocks=64, log_stats_interval=1e9)
    params = SamplingParams(temperature=0, max_tokens=6, use_beam_search=True, best_of=2, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=lora(adapters, "all8-rslora", 1), use_tqdm=False)
    base_beams = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == ref[0, len(prompt):].tolist() != base_beams[0].outputs[0].token_ids
    assert got[0].lora_request == lora(adapters, "all8-rslora", 1) and base_beams[0].lora_request is None


def test_an_adapted_request_s_logprobs_do_not_depend_on_its_batch(base, adapters):
    """Batch invariance with LoRA: the delta's matmul summed in another order once a run of
    one adapter had 4 or more rows, so logprobs (and seeded samples under speculative
    decoding, whose verifying steps have several rows) depended on the company."""
    llm = LLM(str(base), enable_lora=True, max_lora_rank=16, num_kv_blocks=128, log_stats_interval=1e9)
    a = lora(adapters, "all8-rslora", 1)
    prompt = {"prompt_token_ids": [5, 9, 33, 71, 100, 3, 8]}
    others = [{"prompt_token_ids": [(11 * i + j) % 250 + 2 for j in range(5 + i)]} for i in range(7)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)

    def logprobs(batch) -> list:
        out = llm.generate([prompt, *batch], params, lora_request=a, use_tqdm=False)[0].outputs[0]
        return [sorted((t, lp.logprob) for t, lp in pos.items()) for pos in out.logprobs]

    alone = logprobs([])
    assert logprobs(others) == alone and logprobs(others[:3]) == alone


def test_lora_gauges_count_the_samples_held_back_as_waiting(base, adapters):
    """The LoRA gauges' waiting count is the engine's: samples 1..n-1 held until sample 0's
    prompt is cached are waiting requests of their adapter too."""
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=16, num_kv_blocks=64, log_stats_interval=1e9)
    engine = llm.llm_engine
    engine.add_request({"prompt_token_ids": [9, 8, 7, 6, 5]}, SamplingParams(max_tokens=4, n=3, seed=0),
                       request_id="r", lora_request=lora(adapters, "qv4", 1))  # fmt: skip
    assert engine.num_waiting() == 3 and engine.lora_requests_info() == ({}, {"qv4": 3})
    engine.abort_request("r")
    assert engine.lora_requests_info() == ({}, {})


@pytest.mark.parametrize("held", ["grammar", "beam"])
def test_an_unloaded_adapter_serves_its_accepted_requests_then_goes(tiny_llama_tok, tmp_path, held):
    """Found by an adversarial session: ``remove_lora`` (the server's unload) looked only at the
    scheduler's requests, so a request held back for its grammar, or a beam search waiting for
    room in the pool, lost its adapter: with the adapter's directory deleted it failed (HTTP
    500). And an adapter removed while in use stayed loaded after its requests ended."""
    from pagedllm.config import EngineConfig
    from pagedllm.engine.beam_search import BeamSearchParams
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import StructuredOutputsParams

    import transformers

    base = tiny_llama_tok  # (a grammar needs a tokenizer)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    make_peft_adapter(hf_model, tmp_path / "kept", 8, ALL, seed=2, b_std=0.3)
    shutil.copytree(tmp_path / "kept", tmp_path / "a")
    a, same = LoRARequest("a", 1, str(tmp_path / "a")), LoRARequest("kept", 2, str(tmp_path / "kept"))  # same weights
    prompt = {"prompt_token_ids": [5, 9, 33, 71, 100, 3, 8]}
    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 3}}, "required": ["k"]}
    kv = dict(num_kv_blocks=64) if held == "grammar" else dict(num_kv_blocks=12, block_size=4)
    engine = LLMEngine(EngineConfig(model=str(base), enable_lora=True, max_loras=1, max_lora_rank=16, **kv), log_stats_interval=0)

    def add(request_id: str, req: LoRARequest) -> None:
        if held == "grammar":
            params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(json=schema))
            engine.add_request(prompt, params, request_id, lora_request=req)
        else:
            engine.add_beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=8), request_id, lora_request=req)

    def run() -> dict[str, list]:
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        return {rid: [c.token_ids for c in o.outputs] for rid, o in outs.items() if o.error is None}

    add("ref", same)
    expected = run()["ref"]
    if held == "beam":  # a base-model search takes the pool's room, so the adapter's one waits
        engine.add_beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=8), "first")
    add("held", a)
    assert "held" not in engine.scheduler.requests  # held outside the scheduler's queues
    assert engine.remove_lora(1) is False and 1 in engine.list_loras()
    shutil.rmtree(tmp_path / "a")  # allowed once unloaded (lora/manager.py)
    assert run()["held"] == expected
    assert 1 not in engine.list_loras() and engine.kv_cache_manager.usage() == 0.0  # dropped once unused
    # A request that named an adapter before its unload, reaching the engine after it: served,
    # then the adapter goes again (it stayed loaded for good); loading it again keeps it.
    engine.add_lora(same)
    assert engine.remove_lora(2) is True and 2 not in engine.list_loras()
    add("late", same)
    assert run()["late"] == expected and 2 not in engine.list_loras()
    engine.add_lora(same)
    add("again", same)
    assert run()["again"] == expected and 2 in engine.list_loras()
