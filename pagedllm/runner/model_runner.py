"""Turns a SchedulerOutput into tensors, runs the model over the flattened batch, samples.

The runner owns everything device-side: the weights, the KV-cache tensors (one key and one
value pool per layer, [num_blocks, block_size, num_kv_heads, head_dim]), the attention
backend and the sampler. The scheduler only ever sees block ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata, get_attention_backend
from pagedllm.model.arch import ModelArch
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.engine.request import Request
from pagedllm.sampler.sampler import RowLogprobs, Sampler, SamplingBatch, gather_logprobs
from pagedllm.scheduler.output import SchedulerOutput


@dataclass
class ModelRunnerOutput:
    """Per scheduled request (in SchedulerOutput order): tokens drawn - none mid-prompt, else
    one for the request then one per pending fork - and their log-probabilities."""

    sampled: list[list[int]]
    logprobs: list[list[RowLogprobs | None]]
    prompt_logprobs: dict[str, list[RowLogprobs]] = field(default_factory=dict)


def kv_block_bytes(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (keys and values)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


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
    ):
        self.model = model
        self.arch = model.arch
        self.device = torch.device(device)
        self.block_size = block_size
        self.backend = get_attention_backend(attention_backend, dtype, self.device)
        shape = (num_blocks, block_size, self.arch.num_kv_heads, self.arch.head_dim)
        # Zero-filled so padded slots inside a gathered block are finite (masked, never NaN).
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in range(self.arch.num_layers)
        ]
        self.swap_caches = self._allocate_swap(num_swap_blocks, shape[1:], dtype, swap_path)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # Host staging buffer for block tables, allocated once.
        self._block_tables = np.zeros((max_num_seqs, self.max_blocks_per_seq), dtype=np.int64)
        self.sampler = Sampler(seed, self.device)
        self._generators: dict[str, torch.Generator] = {}

    def free_request(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator | None:
        """A seeded sequence's own generator; sample i of a request gets a seed derived from i."""
        seed = req.sampling_params.seed
        if seed is None:
            return None
        g = self._generators.get(req.request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed if req.index == 0 else hash((seed, req.index)) & (2**63 - 1))
            self._generators[req.request_id] = g
        return g

    def _allocate_swap(
        self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, path: str | None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The secondary pool for swap preemption: host memory, or a memory-mapped file."""
        if num_blocks <= 0:
            return []
        per_cache = num_blocks * int(torch.Size(block_shape).numel())
        total = 2 * self.arch.num_layers * per_cache
        if path is not None:
            flat = torch.from_file(path, shared=True, size=total, dtype=dtype)
        else:
            flat = torch.zeros(total, dtype=dtype)
        views = flat.view(2 * self.arch.num_layers, num_blocks, *block_shape)
        return [(views[2 * i], views[2 * i + 1]) for i in range(self.arch.num_layers)]

    def _swap(self, pairs: list[tuple[int, int]], to_swap: bool) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs])
        dst = torch.tensor([d for _, d in pairs])
        for (k, v), (sk, sv) in zip(self.kv_caches, self.swap_caches):
            if to_swap:
                sk.index_copy_(0, dst, k[src.to(k.device)].to(sk.device))
                sv.index_copy_(0, dst, v[src.to(v.device)].to(sv.device))
            else:
                k.index_copy_(0, dst.to(k.device), sk[src].to(k.device))
                v.index_copy_(0, dst.to(v.device), sv[src].to(v.device))

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k[src])
            v.index_copy_(0, dst, v[src])

    def move_blocks(self, out: SchedulerOutput) -> None:
        """Apply the step's block moves; call before ``execute``.

        Order matters: save swapped-out blocks before anyone reuses them; copy-on-write
        copies read their sources before a swap-in may reuse a block freed this step;
        swap-ins last overwrite whatever a withdrawn copy wrote.
        """
        self._swap(out.swap_out, to_swap=True)
        self._copy_blocks(out.block_copies)
        self._swap(out.swap_in, to_swap=False)

    def execute(self, out: SchedulerOutput) -> "ModelRunnerOutput":
        """Run one step's forward and sampling over ``out.scheduled`` (blocks already moved).

        It only writes the K/V of the scheduled tokens into their own slots, so running it
        again, or over a subset of the requests, is safe: the engine does that to find which
        request a failing step belongs to.
        """
        sched = out.scheduled
        # Decode rows (one query token) first: the backend batches them in one call.
        order = sorted(range(len(sched)), key=lambda i: sched[i].num_new_tokens != 1)
        bs = self.block_size
        num_seqs = len(order)
        q_lens = np.array([sched[i].num_new_tokens for i in order], dtype=np.int64)
        starts = np.array([sched[i].num_computed_tokens for i in order], dtype=np.int64)
        seq_lens = starts + q_lens
        max_blocks = int(-(-seq_lens.max() // bs))
        tables = self._block_tables[:num_seqs, :max_blocks]
        tables.fill(0)
        tokens: list[int] = []
        for row, i in enumerate(order):
            s = sched[i]
            ids = s.block_ids[:max_blocks]
            tables[row, : len(ids)] = ids
            tokens.extend(s.request.all_token_ids[s.num_computed_tokens : s.num_computed_tokens + s.num_new_tokens])
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        positions = np.arange(len(tokens), dtype=np.int64) - query_start_loc[seq_of_token] + starts[seq_of_token]
        slots = tables[seq_of_token, positions // bs] * bs + positions % bs

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            block_tables=torch.from_numpy(np.ascontiguousarray(tables)).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            query_start_loc=torch.from_numpy(query_start_loc).to(dev),
            seq_lens_list=seq_lens.tolist(),
            query_lens_list=q_lens.tolist(),
            num_decodes=int((q_lens == 1).sum()),
            block_size=bs,
        )
        hidden = self.model(
            torch.tensor(tokens, dtype=torch.int64, device=dev),
            torch.from_numpy(positions).to(dev),
            self.kv_caches,
            self.backend,
            meta,
        )

        result = ModelRunnerOutput(sampled=[[] for _ in sched], logprobs=[[] for _ in sched])
        self._prompt_logprobs(sched, order, query_start_loc, hidden, result)
        # One sampling row per sequence due a token: the request, then its pending forks
        # (parallel samples drawing from the same logits row).
        row_hidden: list[int] = []
        row_reqs: list[Request] = []
        row_owner: list[int] = []
        for row, i in enumerate(order):
            s = sched[i]
            if s.samples:
                for target in (s.request, *s.request.pending_forks):
                    row_hidden.append(int(query_start_loc[row + 1]) - 1)
                    row_reqs.append(target)
                    row_owner.append(i)
        if not row_reqs:
            return result
        logits = self.model.compute_logits(hidden[torch.tensor(row_hidden, device=dev)])
        out = self.sampler(logits, self._sampling_batch(row_reqs))
        for i, tok, lp in zip(row_owner, out.token_ids, out.logprobs):
            result.sampled[i].append(int(tok))
            result.logprobs[i].append(lp)
        return result

    def _sampling_batch(self, reqs: list[Request]) -> SamplingBatch:
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
            if p.logit_bias:
                batch.logit_bias.extend((row, t, b) for t, b in p.logit_bias.items())
            if p.allowed_token_ids is not None:
                batch.allowed.append((row, p.allowed_token_ids))
            banned = self._banned_tokens(r)
            if banned:
                batch.banned.append((row, banned))
        return batch

    def _banned_tokens(self, r: Request) -> list[int]:
        """EOS and stop ids before min_tokens; the last token of any bad word whose prefix just appeared."""
        p = r.sampling_params
        banned: list[int] = []
        if len(r.output_token_ids) < p.min_tokens:
            banned.extend(p.stop_token_ids)
            if not p.ignore_eos:
                banned.extend(r.eos_token_ids)
        for word_ids in r.bad_words_token_ids:
            prefix = word_ids[:-1]
            if not prefix or r.all_token_ids[-len(prefix) :] == prefix:
                banned.append(word_ids[-1])
        return banned

    def _prompt_logprobs(self, sched, order, query_start_loc, hidden, result: "ModelRunnerOutput") -> None:
        """Log-probabilities of prompt tokens 1..n-1 from this step's chunk, where asked for."""
        for row, i in enumerate(order):
            s = sched[i]
            req = s.request
            k = req.sampling_params.prompt_logprobs
            if k is None:
                continue
            # Position p predicts prompt token p + 1; skip what an earlier pass recorded.
            first = max(s.num_computed_tokens, len(req.prompt_logprobs))
            last = min(s.num_computed_tokens + s.num_new_tokens, req.num_prompt_tokens - 1)
            if first >= last:
                continue
            base = int(query_start_loc[row]) - s.num_computed_tokens
            logprobs = self.model.compute_logits(hidden[base + first : base + last]).log_softmax(dim=-1)
            targets = torch.tensor(req.prompt_token_ids[first + 1 : last + 1], device=logprobs.device)
            entries = gather_logprobs(logprobs, targets, [k] * (last - first))
            result.prompt_logprobs.setdefault(req.request_id, []).extend(entries)
