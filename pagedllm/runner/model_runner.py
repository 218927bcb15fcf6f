"""Turns a SchedulerOutput into tensors, runs the model over the flattened batch, samples.

The runner owns everything device-side: the weights, the KV-cache tensors (one key and one
value pool per layer slot of a KV-cache group, [num_blocks, block_size, num_kv_heads,
head_dim]: per layer without sliding windows; see kv_cache/groups.py - stored as the
``kv_cache_dtype`` says: see ``attention/kv_cache_dtype.py``), the attention backend
and the sampler. It reads only the step's plain data (``scheduler/output.py``) and
keeps its own state per request: token ids (extended with what it samples), sampling
params, seeded generator. The scheduler only ever sees block ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata, get_attention_backend
from pagedllm.attention.kv_cache_dtype import (
    KVCacheSpec, KVPool, allocate_pool, cache_parts, carve_pool, pool_nbytes, resolve_kv_cache_dtype, zeros_on_first_touch,
)  # fmt: skip
from pagedllm.kv_cache.groups import KVCacheLayout
from pagedllm.kv_connector.worker_side import WorkerConnector
from pagedllm.lora.manager import LoRAManager
from pagedllm.lora.request import LoRARequest
from pagedllm.model.arch import ModelArch
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.sampler.sampler import Sampler, SamplingBatch, gather_logprobs
from pagedllm.sampling_params import SamplingParams
from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.proposer import DraftPool, Proposer, make_proposer
from pagedllm.spec_decode.rejection import verify_drafts
from pagedllm.scheduler.output import GrammarBitmask, ModelRunnerOutput, NewRequestData, SchedulerOutput


SPEC_HISTORY = ("spec_hits", "spec_misses", "spec_backoff", "spec_skip", "spec_drafted")


@dataclass
class CachedRequestState:
    """What the runner knows about a running request, kept across steps."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    bad_words_token_ids: list[list[int]]
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    # Speculative decoding's per-request history (spec_decode/draft_length.py).
    spec_hits: float = 0.0
    spec_misses: float = 0.0
    spec_backoff: int = 0
    spec_skip: int = 0
    spec_drafted: int = 0
    lora_request: LoRARequest | None = None
    # allowed_token_ids and logit_bias as tensors, made once: a request may bring thousands of
    # ids, and converting them every step slowed everyone's steps (found by an adversarial session).
    allowed_ids: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None

    @classmethod
    def from_new(cls, new: NewRequestData) -> "CachedRequestState":
        state = cls(new.req_id, new.prompt_token_ids, list(new.output_token_ids), new.sampling_params,
                    new.eos_token_ids, new.bad_words_token_ids, lora_request=new.lora_request)  # fmt: skip
        state.token_ids = list(new.prompt_token_ids) + state.output_token_ids
        p = new.sampling_params
        if p.allowed_token_ids is not None:
            state.allowed_ids = torch.tensor(p.allowed_token_ids, dtype=torch.int64)
        if p.logit_bias:
            state.bias_ids = torch.tensor(list(p.logit_bias), dtype=torch.int64)
            state.bias_values = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
        return state

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)


def kv_cache_layout(arch: ModelArch) -> KVCacheLayout:
    """The model's KV-cache groups: one per attention type and window (kv_cache/groups.py)."""
    return KVCacheLayout.from_windows([arch.sliding_window if arch.is_sliding(i) else None for i in range(arch.num_layers)])


def kv_block_bytes(arch: ModelArch, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes one pool block takes (keys and values, and their scales when quantised): across
    all layers, or with sliding windows across the layers of one KV-cache group."""
    spec = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
    num_slots = kv_cache_layout(arch).num_slots
    return 2 * num_slots * block_size * arch.num_kv_heads * spec.bytes_per_token_head(arch.head_dim)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        dtype: torch.dtype,
        attention_backend: str,
        seed: int,
        device: torch.device | str = "cpu",
        num_swap_blocks: int = 0,
        swap_path: str | None = None,
        kv_cache_dtype: str = "auto",
        speculative_config: SpeculativeConfig | None = None,
        draft_model: LlamaForCausalLM | None = None,
        lora: tuple[int, int, int] | None = None,
    ):
        """``draft_model``: the loaded draft of ``speculative_config`` method "draft_model";
        ``lora``: (max_loras, max_lora_rank, max_cpu_loras) to serve LoRA adapters."""
        self.model = model
        self.arch = model.arch
        self.device = torch.device(device)
        self.block_size = block_size
        self.backend = get_attention_backend(attention_backend, dtype, self.device)
        self.layout = kv_cache_layout(self.arch)
        self.kv_spec: KVCacheSpec = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, self.arch.num_kv_heads, self.arch.head_dim)
        # Zero-filled so padded slots inside a gathered block are finite (masked, never NaN).
        # One K and V per layer slot; layer l uses its slot's (shared with the layers of the
        # same slot in other groups, at other blocks).
        self.slot_caches: list[tuple[KVPool, KVPool]] = [
            (allocate_pool(self.kv_spec, shape, self.device), allocate_pool(self.kv_spec, shape, self.device))
            for _ in range(self.layout.num_slots)
        ]
        self.kv_caches = [self.slot_caches[slot] for slot in self.layout.layer_slot]
        self.swap_caches = self._allocate_swap(num_swap_blocks, shape[1:], swap_path)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # Host staging buffers for block tables (one per KV-cache group), allocated once.
        self._block_tables = [
            np.zeros((max_num_seqs, self.max_blocks_per_seq), dtype=np.int64) for _ in self.layout.groups
        ]
        self.sampler = Sampler(seed, self.device)
        self.proposer: Proposer | None = None
        if speculative_config is not None:
            self.proposer = make_proposer(speculative_config, model, draft_model, DraftPool(
                num_blocks, block_size, max_model_len, self.kv_spec, self.backend, self.device))  # fmt: skip
        self.requests: dict[str, CachedRequestState] = {}
        # LoRA: the adapters' slot table and LRU; the model's linears read its step mapping.
        self.lora: LoRAManager | None = None
        if lora is not None:
            self.lora = LoRAManager(model, *lora)
            model.lora_context = self.lora.context
        # Seeded requests' generators; they outlive a preemption (the stream goes on).
        self._generators: dict[str, torch.Generator] = {}
        self._spec_history: dict[str, tuple] = {}  # preempted requests' SPEC_HISTORY fields
        self.kv_connector: WorkerConnector | None = None  # set by the engine (kv_transfer_config)
        # False on a pipeline stage before the last: its model returns no hidden states, it
        # samples nothing and learns the step's tokens through ``accept`` (executor/worker.py).
        self.samples = True

    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the KV pool indexed by block (what a block's bytes are)."""
        return self._block_tensors(self.slot_caches)

    def update_states(self, out: SchedulerOutput) -> None:
        """Apply the step's diff: forget ended and preempted requests, learn new ones, move blocks."""
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
            self._generators.pop(req_id, None)
            self._spec_history.pop(req_id, None)
        for req_id in out.preempted_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:  # its drafting history resumes with it (the policy need not relearn)
                self._spec_history[req_id] = tuple(getattr(state, f) for f in SPEC_HISTORY)
        if self.proposer is not None:
            for req_id in (*out.finished_req_ids, *out.preempted_ids):
                self.proposer.forget(req_id)
        for s in out.scheduled:
            if s.new is not None:
                state = self.requests[s.req_id] = CachedRequestState.from_new(s.new)
                for f, value in zip(SPEC_HISTORY, self._spec_history.pop(s.req_id, ())):
                    setattr(state, f, value)
        self.move_blocks(out)

    def _generator(self, req: CachedRequestState) -> torch.Generator | None:
        """A seeded request's own generator, so its draws do not depend on the batch."""
        seed = req.sampling_params.seed
        if seed is None:
            return None
        g = self._generators.get(req.req_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            self._generators[req.req_id] = g
        return g

    def _allocate_swap(
        self, num_blocks: int, block_shape: tuple[int, ...], path: str | None
    ) -> list[tuple[KVPool, KVPool]]:
        """The secondary pool for swap preemption, laid out as the KV pools (scales included):
        host memory, or a memory-mapped file, carved into every layer's pools."""
        if num_blocks <= 0:
            return []
        shape = (num_blocks, *block_shape)
        per_pool = pool_nbytes(self.kv_spec, shape)
        num_slots = self.layout.num_slots
        total = 2 * num_slots * per_pool
        if path is not None:
            flat = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        else:
            flat = zeros_on_first_touch((total,), torch.uint8, torch.device("cpu"))
        pools = [carve_pool(self.kv_spec, shape, flat[i * per_pool : (i + 1) * per_pool]) for i in range(2 * num_slots)]
        return [(pools[2 * i], pools[2 * i + 1]) for i in range(num_slots)]

    @staticmethod
    def _block_tensors(caches: list[tuple[KVPool, KVPool]]) -> list[torch.Tensor]:
        """Every tensor indexed by block (values and scales of keys and values of every slot)."""
        return [t for k, v in caches for pool in (k, v) for t in cache_parts(pool)]

    def _swap(self, pairs: list[tuple[int, int]], to_swap: bool) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs])
        dst = torch.tensor([d for _, d in pairs])
        for t, st in zip(self._block_tensors(self.slot_caches), self._block_tensors(self.swap_caches)):
            # Bytes, not values: index_copy_ has no fp8 kernel on CPU.
            t, st = t.view(torch.uint8), st.view(torch.uint8)
            if to_swap:
                st.index_copy_(0, dst, t[src.to(t.device)].to(st.device))
            else:
                t.index_copy_(0, dst.to(t.device), st[src].to(t.device))

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for t in self._block_tensors(self.slot_caches):
            t = t.view(torch.uint8)
            t.index_copy_(0, dst, t[src])

    def move_blocks(self, out: SchedulerOutput) -> None:
        """Apply the step's block moves (``update_states`` does, before ``execute``).

        Order matters: save swapped-out blocks before anyone reuses them; copy-on-write
        copies read their sources before a swap-in may reuse a block freed this step;
        swap-ins last overwrite whatever a withdrawn copy wrote.
        """
        if self.kv_connector is not None:  # first (only fresh blocks; no swaps with a connector)
            self.kv_connector.load(out.kv_connector_metadata, self.block_tensors())
        self._swap(out.swap_out, to_swap=True)
        self._copy_blocks(out.block_copies)
        self._swap(out.swap_in, to_swap=False)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step's forward and sampling over ``out.scheduled`` (after ``update_states``).

        It only writes the K/V of the scheduled tokens into their own slots and changes its
        request state only once everything succeeded, so running it again, or over a subset
        of the requests, is safe: the engine does that to find which request a failing step
        belongs to.
        """
        sched = out.scheduled
        states = [self.requests[s.req_id] for s in sched]
        # Decode rows (one query token) first: the backend batches them in one call. With LoRA,
        # each adapter's rows next to each other (one run among the decodes, one among the rest).
        if self.lora is None:
            order = sorted(range(len(sched)), key=lambda i: sched[i].num_new_tokens != 1)
        else:
            lora_slots = self.lora.prepare_step([st.lora_request for st in states])
            order = sorted(range(len(sched)), key=lambda i: (sched[i].num_new_tokens != 1, lora_slots[i]))
        # The step's index arithmetic in plain Python: a handful of small numpy calls cost
        # more than these loops at decode sizes, on the caches a step's weight stream leaves
        # cold (20-40 us each), and a chunk of a few thousand tokens takes well under a ms.
        bs = self.block_size
        num_seqs = len(order)
        q_lens = [sched[i].num_new_tokens for i in order]
        starts = [sched[i].num_computed_tokens for i in order]
        seq_lens = [a + q for a, q in zip(starts, q_lens)]
        max_blocks = -(-max(seq_lens) // bs)
        tokens: list[int] = []
        query_start_loc = [0]
        for i in order:
            s = sched[i]
            known = s.num_new_tokens - len(s.spec_token_ids)
            tokens.extend(states[i].token_ids[s.num_computed_tokens : s.num_computed_tokens + known] if known >= 0 else ())
            tokens.extend(s.spec_token_ids)
            if len(tokens) - query_start_loc[-1] != s.num_new_tokens:  # positions and slots follow num_new_tokens
                raise ValueError(f"request {s.req_id}: {len(tokens) - query_start_loc[-1]} tokens for a step of "
                                 f"{s.num_new_tokens} (known {len(states[i].token_ids)}, drafts {len(s.spec_token_ids)})")  # fmt: skip
            query_start_loc.append(len(tokens))
        positions = [p for a, b in zip(starts, seq_lens) for p in range(a, b)]
        self._check_positions(starts, seq_lens)

        dev = self.device
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64, device=dev)
        query_start_loc_t = torch.tensor(query_start_loc, dtype=torch.int64, device=dev)
        num_decodes = q_lens.count(1)
        metas: list[AttentionMetadata] = []
        for g in range(len(self.layout.groups)):  # one block table (and slot mapping) per KV-cache group
            ids_of = [sched[i].block_ids if g == 0 else sched[i].group_block_ids[g - 1] for i in order]
            self._check_blocks([sched[i].req_id for i in order], ids_of, seq_lens)
            tables = self._block_tables[g][:num_seqs, :max_blocks]
            tables.fill(0)
            for row, ids in enumerate(ids_of):
                tables[row, : min(len(ids), max_blocks)] = ids[:max_blocks]
            slots = [ids[p // bs] * bs + p % bs for ids, a, b in zip(ids_of, starts, seq_lens) for p in range(a, b)]
            metas.append(AttentionMetadata(
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
                block_tables=torch.from_numpy(np.ascontiguousarray(tables)).to(dev),
                seq_lens=seq_lens_t,
                query_start_loc=query_start_loc_t,
                seq_lens_list=seq_lens,
                query_lens_list=q_lens,
                num_decodes=num_decodes,
                block_size=bs,
            ))  # fmt: skip
        # One metadata for every layer, or each layer its group's.
        meta = metas[0] if len(metas) == 1 else [metas[g] for g in self.layout.layer_group]
        if self.lora is not None:
            self.lora.context.mapping = LoRAManager.mapping([lora_slots[i] for i in order], q_lens)
        try:
            hidden = self.model(
                torch.tensor(tokens, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev),
                self.kv_caches,
                self.backend,
                meta,
            )
        finally:
            if self.lora is not None:
                self.lora.context.mapping = None
        if not self.samples:  # an earlier pipeline stage: the last one samples
            return ModelRunnerOutput(req_ids=[s.req_id for s in sched], sampled=[[] for _ in sched],
                                     logprobs=[[] for _ in sched])  # fmt: skip
        if self.kv_connector is not None:  # the step's K/V is written: copy newly full blocks out
            self.kv_connector.save(out.kv_connector_metadata, [s.req_id for s in sched], self.block_tensors())

        result = ModelRunnerOutput(req_ids=[s.req_id for s in sched], sampled=[[] for _ in sched], logprobs=[[] for _ in sched])
        self._prompt_logprobs(sched, states, order, query_start_loc, hidden, result)
        # Sampling rows of a request due a token: its chunk's last known position, then one per draft.
        rows = [(row, i) for row, i in enumerate(order) if sched[i].samples]
        if not rows:
            return result
        drafts = [sched[i].spec_token_ids for _, i in rows]
        row_hidden = torch.tensor(
            [int(query_start_loc[row + 1]) - 1 - len(d) + j for (row, _), d in zip(rows, drafts) for j in range(len(d) + 1)],
            device=dev,
        )
        logits = self.model.compute_logits(hidden[row_hidden])
        if any(drafts):
            row_states = [states[i] for (_, i), d in zip(rows, drafts) for _ in range(len(d) + 1)]
            drawn, logprobs = verify_drafts(self.sampler, logits, self._sampling_batch(row_states, out.grammar), drafts)
        else:
            sampled = self.sampler(logits, self._sampling_batch([states[i] for _, i in rows], out.grammar))
            drawn, logprobs = [[t] for t in sampled.token_ids], [[lp] for lp in sampled.logprobs]
        for (_, i), toks, lps in zip(rows, drawn, logprobs):
            result.sampled[i].extend(toks)
            result.logprobs[i].extend(lps)
        for state, tokens in zip(states, result.sampled):  # all went well: remember the draws
            for tok in tokens:
                state.append(tok)
        if self.proposer is not None:
            accepted = [s.num_accepted(t) for s, t in zip(sched, result.sampled)]
            last_hidden = None
            if self.proposer.needs_hidden:  # each request's row that sampled its newest token
                at = [0] * len(sched)
                for (row, i), d in zip(rows, drafts):
                    at[i] = int(query_start_loc[row + 1]) - 1 - len(d) + len(result.sampled[i]) - 1
                last_hidden = hidden[torch.tensor(at, device=dev)]
            features = None
            if self.proposer.needs_features:  # the rows of each request's verified positions
                features = [(0, hidden[:0])] * len(sched)
                for row, i in enumerate(order):
                    s = sched[i]
                    n = s.num_new_tokens - len(s.spec_token_ids) + (accepted[i] or 0)
                    features[i] = (s.num_computed_tokens, hidden[int(query_start_loc[row]) : int(query_start_loc[row]) + n])
            result.spec_token_ids = self.proposer.propose(states, [bool(t) for t in result.sampled], accepted,
                                                          last_hidden, features, [len(s.spec_token_ids) for s in sched])  # fmt: skip
        return result

    def accept(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        """The tokens another rank sampled this step (a pipeline stage before the last)."""
        for req_id, tokens in zip(req_ids, sampled):
            state = self.requests.get(req_id)
            if state is not None:
                for tok in tokens:
                    state.append(tok)

    def _check_positions(self, starts: list[int], seq_lens: list[int]) -> None:
        """The native kernels trust their indices: check the step's once, here, so a bad
        position is an error, never a stray memory access (block ids: ``_check_blocks``)."""
        max_positions = self.model.rope.cos.shape[0]
        if min(seq_lens) < 1 or min(starts) < 0 or max(seq_lens) > max_positions:
            raise ValueError(f"step positions outside [0, {max_positions}) or an empty sequence")

    def _check_blocks(self, req_ids: list[str], ids_of: list[list[int]], seq_lens: list[int]) -> None:
        """Every block id of the step's tables (built from these lists, padded with block 0)
        inside the pool, and enough of them for each sequence's positions."""
        num_blocks = self.num_blocks
        for req_id, ids, n in zip(req_ids, ids_of, seq_lens):
            if not ids or min(ids) < 0 or max(ids) >= num_blocks:
                raise ValueError(f"request {req_id}: block ids outside the pool [0, {num_blocks})")
            if len(ids) * self.block_size < n:
                raise ValueError(f"request {req_id}: {len(ids)} blocks for {n} tokens")

    def _sampling_batch(self, reqs: list[CachedRequestState], grammar: GrammarBitmask | None = None) -> SamplingBatch:
        params = [r.sampling_params for r in reqs]
        batch = SamplingBatch(
            temperatures=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            generators=[self._generator(r) for r in reqs],
            num_logprobs=[p.logprobs for p in params],
        )
        if any(p.top_k > 0 for p in params):
            batch.top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
        if any(p.top_p < 1 for p in params):
            batch.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        if any(p.min_p > 0 for p in params):
            batch.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        for row, (r, p) in enumerate(zip(reqs, params)):
            if p.needs_penalties:
                batch.penalty_rows.append(row)
                batch.presence.append(p.presence_penalty)
                batch.frequency.append(p.frequency_penalty)
                batch.repetition.append(p.repetition_penalty)
                batch.output_ids.append(r.output_token_ids)
                batch.prompt_ids.append(r.prompt_token_ids if p.repetition_penalty != 1 else [])
            if r.bias_ids is not None:
                batch.logit_bias.append((row, r.bias_ids, r.bias_values))
            if r.allowed_ids is not None:
                batch.allowed.append((row, r.allowed_ids))
            banned = self._banned_tokens(r)
            if banned:
                batch.banned.append((row, banned))
        if grammar is not None:
            mask_rows = []
            for row, r in enumerate(reqs):
                if r.req_id in grammar.rows:
                    batch.bitmask_rows.append(row)
                    mask_rows.append(grammar.rows[r.req_id])
            if mask_rows:
                whole = mask_rows == list(range(grammar.bitmask.shape[0]))
                batch.token_bitmask = grammar.bitmask if whole else grammar.bitmask[torch.tensor(mask_rows)]
        return batch

    def _banned_tokens(self, r: CachedRequestState) -> list[int]:
        """EOS and stop ids before min_tokens; the last token of any bad word whose prefix just appeared."""
        p = r.sampling_params
        banned: list[int] = []
        if len(r.output_token_ids) < p.min_tokens:
            banned.extend(p.stop_token_ids)
            if not p.ignore_eos:
                banned.extend(r.eos_token_ids)
        for word_ids in r.bad_words_token_ids:
            prefix = word_ids[:-1]
            if not prefix or r.token_ids[-len(prefix) :] == prefix:
                banned.append(word_ids[-1])
        return banned

    def _prompt_logprobs(self, sched, states, order, query_start_loc, hidden, result: ModelRunnerOutput) -> None:
        """Log-probabilities of the prompt tokens this step's chunk predicts, where asked for.

        Keyed by request: (first prompt position predicted, entries). A recomputed chunk after
        a preemption reports its positions again; the engine keeps each position once.
        """
        for row, i in enumerate(order):
            s, req = sched[i], states[i]
            k = req.sampling_params.prompt_logprobs
            if k is None:
                continue
            # Position p predicts prompt token p + 1.
            first = s.num_computed_tokens
            last = min(s.num_computed_tokens + s.num_new_tokens, len(req.prompt_token_ids) - 1)
            if first >= last:
                continue
            base = int(query_start_loc[row]) - s.num_computed_tokens
            logits = self.model.compute_logits(hidden[base + first : base + last])
            targets = torch.tensor(req.prompt_token_ids[first + 1 : last + 1], device=logits.device)
            result.prompt_logprobs[req.req_id] = (first, gather_logprobs(logits, targets, [k] * (last - first)))
