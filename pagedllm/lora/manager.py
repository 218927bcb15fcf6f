"""Which adapters are loaded (an LRU of up to ``max_cpu_loras``) and which hold a slot.

The scheduler guarantees that the requests running at once use at most ``max_loras``
distinct adapters, so the adapters of any step fit in the slots. ``prepare_step`` keeps the
adapters already in a slot where they are and puts each missing one into a free slot, or
into the least recently used slot whose adapter this step does not need. Loading from disk
happens at most once per adapter while it stays in the LRU; an adapter in a slot is never
evicted from the LRU (its slot copy and its tensors stay in step), nor is one that a live
request uses (``in_use``): its files may be gone by the time the request runs (an unloaded
adapter's directory may be deleted at once), and its id must keep naming it. The LRU may then
hold more than ``max_cpu_loras`` adapters until those requests end.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable

from pagedllm.lora.adapter import LoRAAdapter, load_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.slots import SlotTable, StepMapping

logger = logging.getLogger("pagedllm.lora")


class LoRAManager:
    def __init__(self, model, max_loras: int, max_lora_rank: int, max_cpu_loras: int):
        if max_loras < 1 or max_lora_rank < 1 or max_cpu_loras < max_loras:
            raise ValueError(f"need max_loras >= 1, max_lora_rank >= 1, max_cpu_loras >= max_loras; got "
                             f"{max_loras}, {max_lora_rank}, {max_cpu_loras}")  # fmt: skip
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.table = SlotTable(model, max_loras, max_lora_rank)
        self.context = self.table.context
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter, LRU first
        self._slot_ids: list[int | None] = [None] * max_loras  # slot -> lora_int_id
        self._slot_of: dict[int, int] = {}
        self._slot_use: list[int] = [0] * max_loras  # step number of each slot's last use
        self._step = 0
        self.num_loads = 0  # adapters read from disk
        self.num_slot_loads = 0  # adapters copied into a slot
        self.in_use: Callable[[], set[int]] = set  # ids live requests use (the engine sets it)

    # ------------------------------------------------------------------ the LRU
    def add(self, req: LoRARequest) -> LoRAAdapter:
        """The adapter of ``req``, loaded and validated if it is not in the LRU (ValueError,
        changing nothing, if it cannot be). One id must keep its name and path."""
        adapter = self._loaded.get(req.lora_int_id)
        if adapter is not None:
            if adapter.request != req:
                raise ValueError(f"lora_int_id {req.lora_int_id} is already {adapter.request.lora_name!r} at "
                                 f"{adapter.request.lora_path}; an id must always name the same adapter")  # fmt: skip
            self._loaded.move_to_end(req.lora_int_id)
            return adapter
        adapter = load_adapter(req, self.table.targets, self.max_lora_rank)
        self.num_loads += 1
        self._loaded[req.lora_int_id] = adapter
        logger.info("LoRA adapter %r (id %d, rank %d, %s) loaded from %s", req.lora_name, req.lora_int_id,
                    adapter.rank, ",".join(adapter.target_modules), req.lora_path)  # fmt: skip
        self._evict(keep=req.lora_int_id)
        return adapter

    def _evict(self, keep: int) -> None:
        if len(self._loaded) <= self.max_cpu_loras:
            return
        busy = self.in_use()
        while len(self._loaded) > self.max_cpu_loras:
            victim = next((i for i in self._loaded if i != keep and i not in self._slot_of and i not in busy), None)
            if victim is None:
                return
            del self._loaded[victim]

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot is emptied). False if it was not loaded."""
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            self._slot_ids[slot] = None
            self.table.clear(slot)
        return self._loaded.pop(lora_int_id, None) is not None

    def loaded_ids(self) -> list[int]:
        return list(self._loaded)

    def slot_of(self, lora_int_id: int) -> int | None:
        return self._slot_of.get(lora_int_id)

    # ------------------------------------------------------------------ slots
    def prepare_step(self, requests: list[LoRARequest | None]) -> list[int]:
        """The slot of each request's adapter (-1 for none), putting missing adapters into
        slots. RuntimeError if the step names more distinct adapters than there are slots."""
        self._step += 1
        needed = {r.lora_int_id: r for r in requests if r is not None}
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step with {len(needed)} distinct LoRA adapters; max_loras is {self.max_loras}")
        for lora_id, req in needed.items():
            slot = self._slot_of.get(lora_id)
            if slot is None:
                slot = self._free_slot(needed)
                adapter = self.add(req)
                old = self._slot_ids[slot]
                if old is not None:
                    del self._slot_of[old]
                self.table.load(slot, adapter)
                self.num_slot_loads += 1
                self._slot_ids[slot], self._slot_of[lora_id] = lora_id, slot
                self._evict(keep=lora_id)
            else:
                self._loaded.move_to_end(lora_id)
            self._slot_use[slot] = self._step
        return [-1 if r is None else self._slot_of[r.lora_int_id] for r in requests]

    def _free_slot(self, needed: dict[int, LoRARequest]) -> int:
        empty = [s for s, i in enumerate(self._slot_ids) if i is None]
        if empty:
            return empty[0]
        candidates = [s for s, i in enumerate(self._slot_ids) if i not in needed]
        return min(candidates, key=lambda s: self._slot_use[s])

    @staticmethod
    def mapping(slots: list[int], num_rows: list[int]) -> StepMapping | None:
        """The step's row runs: request k (in batch order) has ``num_rows[k]`` rows and uses
        ``slots[k]`` (-1: none). None when no row has an adapter."""
        runs: list[tuple[int, int, int]] = []
        row = 0
        for slot, n in zip(slots, num_rows):
            if slot >= 0:
                if runs and runs[-1][0] == slot and runs[-1][2] == row:
                    runs[-1] = (slot, runs[-1][1], row + n)
                else:
                    runs.append((slot, row, row + n))
            row += n
        return StepMapping(runs) if runs else None
