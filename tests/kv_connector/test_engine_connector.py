"""The disk connector in an offline engine (tiny random Llama): blocks saved by one engine are
loaded by the next, outputs never change, and nothing unverified is ever loaded or saved."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.kv_cache.block_pool import hash_block

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# Prompt lengths: whole blocks exactly (the last block must still be computed), and not.
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 3 for j in range(n)]} for i, n in enumerate((64, 100, 37))]


def make_llm(model: Path, store: Path | None, **kw) -> LLM:
    kv = {"kv_transfer_config": {"kv_connector": "disk", "path": str(store), **kw.pop("kv", {})}} if store else {}
    return LLM(str(model), num_kv_blocks=64, log_stats_interval=1e9, **kv, **kw)


def run(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    out = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    if llm.llm_engine.kv_connector is not None:
        assert llm.llm_engine.kv_connector.flush(timeout=30)
    return out


def totals(llm: LLM):
    return llm.llm_engine.kv_connector.stats.total


@pytest.fixture(scope="module")
def cold(tiny_llama) -> list[list[int]]:
    """Outputs of an engine without a connector."""
    return run(make_llm(tiny_llama, None))


@pytest.fixture(scope="module")
def filled_store(tiny_llama, tmp_path_factory, cold) -> Path:
    """A store the first engine filled (outputs checked against the cold run)."""
    store = tmp_path_factory.mktemp("store")
    llm = make_llm(tiny_llama, store)
    assert run(llm) == cold
    assert totals(llm).num_hit_blocks == 0 and totals(llm).num_saved_blocks > 0
    llm.llm_engine.close()
    return store


def copy_store(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_restarted_engine_loads_the_blocks(tiny_llama, filled_store, cold, tmp_path):
    store = copy_store(filled_store, tmp_path / "s")
    llm = make_llm(tiny_llama, store)
    assert run(llm) == cold
    t = totals(llm)
    # Every whole prompt block but one holding the last prompt token: 3 + 6 + 2.
    assert t.num_queried_blocks == t.num_hit_blocks == t.num_loaded_blocks == 11
    assert t.num_rejected_blocks == 0 and t.num_loaded_bytes > 0
    # The loaded blocks counted as computed: only the prompts' tails ran, then 11 decode steps
    # each (the prefix-cache stats are local); the prompt-token counter has every prompt token.
    stats = llm.llm_engine.stats
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in PROMPTS)
    assert stats.scheduled_tokens_total == prompt_tokens - 11 * BS + len(PROMPTS) * (GREEDY.max_tokens - 1)
    assert stats.prompt_tokens_total == prompt_tokens


def test_a_load_after_a_local_prefix_hit_goes_to_the_blocks_after_it(tiny_llama, filled_store, cold, tmp_path):
    """A prompt whose first 2 blocks sit in the local prefix cache and the next 4 in the store:
    the loaded payloads must land in blocks 2..5 (into blocks 0..3 they overwrote the shared
    cached blocks and left 4 and 5 unwritten: wrong tokens)."""
    llm = make_llm(tiny_llama, copy_store(filled_store, tmp_path / "s"))
    shares_two = PROMPTS[1]["prompt_token_ids"][: 2 * BS] + [(5 * j) % 250 + 3 for j in range(40)]
    run(llm, [{"prompt_token_ids": shares_two}])  # loads blocks 0-1, which then stay cached here
    before = totals(llm).num_loaded_blocks
    assert run(llm, [PROMPTS[1]]) == [cold[1]]
    assert totals(llm).num_loaded_blocks - before == 4


def test_chunked_prefill_after_a_load(tiny_llama, filled_store, cold, tmp_path):
    longer = PROMPTS[1]["prompt_token_ids"] + list(range(3, 80))  # 6 stored blocks, then 77 new tokens
    ref = run(make_llm(tiny_llama, None, max_num_batched_tokens=24), [{"prompt_token_ids": longer}])
    llm = make_llm(tiny_llama, copy_store(filled_store, tmp_path / "s"), max_num_batched_tokens=24)
    assert run(llm, [{"prompt_token_ids": longer}]) == ref
    assert totals(llm).num_loaded_blocks == 6


def test_a_flipped_byte_is_detected_and_recomputed(tiny_llama, filled_store, cold, tmp_path):
    store = copy_store(filled_store, tmp_path / "s")
    # The second block of PROMPTS[1]: its file, by chained hash.
    ids = PROMPTS[1]["prompt_token_ids"]
    h0 = hash_block(None, ids[:BS])
    h1 = hash_block(h0, ids[BS : 2 * BS])
    (path,) = store.rglob(f"{h1.hex()}.kvb")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    llm = make_llm(tiny_llama, store)
    assert run(llm) == cold
    t = totals(llm)
    assert t.num_rejected_blocks == 1
    assert t.num_loaded_blocks == 3 + 1 + 2  # PROMPTS[1] stops at its bad second block
    assert path.exists()  # recomputed, then saved again, intact
    assert run(make_llm(tiny_llama, store)) == cold


def test_another_model_never_loads_the_blocks(tiny_llama, filled_store, tmp_path):
    from tests.conftest import save_tiny_model

    other = save_tiny_model(tmp_path / "other", seed=1)
    other_cold = run(make_llm(other, None))
    store = copy_store(filled_store, tmp_path / "s")
    llm = make_llm(other, store, kv={"kv_role": "kv_consumer"})
    assert run(llm) == other_cold
    assert totals(llm).num_hit_blocks == 0
    # Planted under this fingerprint's names: the headers give them away.
    mine = llm.llm_engine.kv_connector.store.dir
    for f in filled_store.rglob("*.kvb"):
        dst = mine / f.parent.name / f.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(f.read_bytes())
    llm2 = make_llm(other, store, kv={"kv_role": "kv_consumer"})
    assert run(llm2) == other_cold
    assert totals(llm2).num_hit_blocks == 0 and totals(llm2).num_rejected_blocks == 3  # one per prompt


def test_another_kv_cache_dtype_is_another_fingerprint(tiny_llama, filled_store, tmp_path):
    llm = make_llm(tiny_llama, copy_store(filled_store, tmp_path / "s"), kv_cache_dtype="bfloat16")
    run(llm)
    assert totals(llm).num_hit_blocks == 0


def test_the_torch_fallback_kernels_are_another_fingerprint(tiny_llama, tmp_path):
    """A host without a compiler runs the torch twins, which sum in other orders: its blocks
    are other bytes, so they must not meet the native kernels' (they shared a fingerprint)."""
    from pagedllm.kernels import ops

    store = tmp_path / "s"
    native = make_llm(tiny_llama, store, attention_backend="torch_sdpa")  # native GEMMs, the same attention
    run(native)
    assert totals(native).num_saved_blocks > 0
    native.llm_engine.close()
    with ops.torch_only():
        llm = make_llm(tiny_llama, store, attention_backend="torch_sdpa")
        run(llm)
    assert totals(llm).num_hit_blocks == 0


def test_roles(tiny_llama, filled_store, cold, tmp_path):
    store = copy_store(filled_store, tmp_path / "s")
    before = sorted(p.name for p in store.rglob("*.kvb"))
    producer = make_llm(tiny_llama, store, kv={"kv_role": "kv_producer"})
    assert run(producer) == cold
    assert totals(producer).num_queried_blocks == 0 and totals(producer).num_loaded_blocks == 0
    consumer = make_llm(tiny_llama, tmp_path / "empty", kv={"kv_role": "kv_consumer"})
    assert run(consumer) == cold
    assert totals(consumer).num_saved_blocks == 0 and not list((tmp_path / "empty").rglob("*.kvb"))
    assert sorted(p.name for p in store.rglob("*.kvb")) == before


def test_only_verified_tokens_are_saved(tiny_llama, tmp_path):
    """With speculative decoding, rejected drafts' K/V is written into blocks; only blocks of
    tokens that ended up in the sequence may be saved."""
    store = tmp_path / "s"
    llm = make_llm(tiny_llama, store, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    prompt = [5, 6, 7, 8] * 10 + [9, 10]  # repetition: n-gram drafts
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    llm.llm_engine.kv_connector.flush(timeout=30)
    assert llm.llm_engine.stats.spec_total.num_draft_tokens > 0
    tokens = prompt + list(out.outputs[0].token_ids)
    chain, parent = set(), None
    for i in range(len(tokens) // BS):
        parent = hash_block(parent, tokens[i * BS : (i + 1) * BS])
        chain.add(parent.hex())
    saved = {p.stem for p in store.rglob("*.kvb")}
    assert saved and saved <= chain
    # ... and every full block of verified tokens is saved: blocks that accepted drafts filled
    # were skipped (the next step's range began after them), breaking the stored chain.
    assert len(saved) == len(tokens[:-1]) // BS  # (the last token's K/V is never computed)


def test_two_live_replicas_share_a_directory(tiny_llama, cold, tmp_path):
    """The second replica started before the first saved anything: it finds the blocks by name."""
    store = tmp_path / "shared"
    first, second = make_llm(tiny_llama, store), make_llm(tiny_llama, store)
    assert run(first) == cold
    assert run(second) == cold
    assert totals(second).num_hit_blocks == 11 and totals(second).num_rejected_blocks == 0


def _savers() -> int:
    import threading

    return sum(t.name == "pagedllm-kv-saver" for t in threading.enumerate())


@pytest.mark.parametrize("ending", ["shutdown", "dropped"])
def test_an_engine_ended_without_close_stops_its_saver_and_keeps_its_saves(tiny_llama, tmp_path, ending, cold):
    """Found by an adversarial session: each LLM with a connector, shut down (LLM.shutdown did
    not close the engine) or just dropped, left its saver thread (and store) behind for the
    rest of the process. Now either ending writes the queue and stops the thread."""
    import gc
    import time

    gc.collect()  # (other tests' dropped engines stop their savers now, not in the middle of this one)
    before = _savers()
    llm = make_llm(tiny_llama, tmp_path / "store")
    assert _savers() == before + 1
    assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == cold
    if ending == "shutdown":
        llm.shutdown()
    del llm
    gc.collect()
    deadline = time.monotonic() + 10
    while _savers() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _savers() == before
    again = make_llm(tiny_llama, tmp_path / "store")  # what the first queued was written
    assert run(again) == cold and totals(again).num_hit_blocks > 0
    again.shutdown()


def test_blocks_served_from_the_local_prefix_cache_are_saved_again_when_the_store_lost_them(tiny_llama, tmp_path):
    """A producer whose store evicted (or lost) a prompt's blocks must save them again when the
    prompt comes back; it saved only the blocks it computed, and a prefix-cache hit computes
    none, so the consumer recomputed that prefix forever (found by a review)."""
    import shutil

    store = tmp_path / "store"
    llm = make_llm(tiny_llama, store, kv={"kv_role": "kv_producer"}, enable_prefix_caching=True)
    run(llm, PROMPTS[:1])
    saved = sorted(p.name for p in store.rglob("*") if p.is_file())
    assert saved
    shutil.rmtree(store)
    store.mkdir()
    run(llm, PROMPTS[:1])  # the same prompt: its full blocks come from the local prefix cache
    assert sorted(p.name for p in store.rglob("*") if p.is_file()) == saved


def test_a_block_waiting_for_the_saver_is_not_queued_again(tiny_llama, tmp_path, monkeypatch):
    """The same prompt again while the saver is behind: its blocks come from the local prefix
    cache and their files do not exist yet. They were queued again on every such request
    (a review counted 33 writes for 10 blocks), growing the backlog until saves were dropped."""
    import collections
    import threading
    import time

    from pagedllm.kv_connector.disk_store import SUFFIX, DiskKVStore

    gate = threading.Event()
    puts: collections.Counter = collections.Counter()
    put = DiskKVStore.put

    def slow_put(self, block_hash, payload):
        gate.wait(30)  # the saver is stuck until every request has been scheduled
        puts[block_hash] += 1
        return put(self, block_hash, payload)

    monkeypatch.setattr(DiskKVStore, "put", slow_put)
    llm = make_llm(tiny_llama, tmp_path / "store", kv={"kv_role": "kv_producer"}, enable_prefix_caching=True)
    prompt = PROMPTS[1]  # 100 tokens: 6 full blocks
    first = [list(o.outputs[0].token_ids) for o in llm.generate([prompt], GREEDY, use_tqdm=False)]
    for _ in range(3):
        assert [list(o.outputs[0].token_ids) for o in llm.generate([prompt], GREEDY, use_tqdm=False)] == first
    time.sleep(0.05)
    gate.set()
    assert llm.llm_engine.kv_connector.flush(timeout=30)
    assert len(puts) >= 6 and set(puts.values()) == {1}, puts.values()
    # A block written and then lost is still saved again (the store says so, not the queue).
    files = list((tmp_path / "store").rglob(f"*{SUFFIX}"))
    assert len(files) == len(puts)
    for path in files:
        path.unlink()
    run(llm, [prompt])
    assert set(puts.values()) == {2}
