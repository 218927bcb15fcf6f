"""Turns a SchedulerOutput into tensors, runs the model over the flattened batch, samples.

The runner owns everything device-side: the weights, the KV-cache tensors (one key and one
value pool per layer, [num_blocks, block_size, num_kv_heads, head_dim]), the attention
backend and the sampler. The scheduler only ever sees block ids.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata, get_attention_backend
from pagedllm.model.arch import ModelArch
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.sampler.sampler import Sampler, SamplingBatch
from pagedllm.scheduler.output import SchedulerOutput


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
    ):
        self.model = model
        self.arch = model.arch
        self.device = torch.device(device)
        self.block_size = block_size
        self.backend = get_attention_backend(attention_backend)
        shape = (num_blocks, block_size, self.arch.num_kv_heads, self.arch.head_dim)
        # Zero-filled so padded slots inside a gathered block are finite (masked, never NaN).
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in range(self.arch.num_layers)
        ]
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # Host staging buffer for block tables, allocated once.
        self._block_tables = np.zeros((max_num_seqs, self.max_blocks_per_seq), dtype=np.int64)
        self.sampler = Sampler(seed, self.device)
        self._generators: dict[str, torch.Generator] = {}

    def free_request(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        g = self._generators.get(request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            self._generators[request_id] = g
        return g

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k[src])
            v.index_copy_(0, dst, v[src])

    def execute(self, out: SchedulerOutput) -> list[int | None]:
        """Run one step; return the sampled token for each scheduled request (None mid-prompt)."""
        self._copy_blocks(out.block_copies)
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

        sample_rows = [row for row, i in enumerate(order) if sched[i].samples]
        result: list[int | None] = [None] * len(sched)
        if not sample_rows:
            return result
        last_token = torch.from_numpy(query_start_loc[1:][sample_rows] - 1).to(dev)
        logits = self.model.compute_logits(hidden[last_token])
        params = [sched[order[row]].request.sampling_params for row in sample_rows]
        batch = SamplingBatch(
            temperatures=torch.tensor([p.temperature if not p.greedy else 0.0 for p in params], dtype=torch.float32),
            generators=[
                self._generator(sched[order[row]].request.request_id, p.seed) for row, p in zip(sample_rows, params)
            ],
            all_greedy=all(p.greedy for p in params),
        )
        tokens_out = self.sampler(logits, batch).tolist()
        for row, tok in zip(sample_rows, tokens_out):
            result[order[row]] = int(tok)
        return result
