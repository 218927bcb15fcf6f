"""Multi-LoRA serving: PEFT adapters over one base model, many adapters in one batch.

- ``request.py``: ``LoRARequest`` (vLLM's shape), what a request names its adapter with;
- ``adapter.py``: reading and validating a PEFT adapter directory against the base model;
- ``slots.py``: the slot table (``max_loras`` preallocated slots of stacked A/B per linear)
  and the per-step row mapping the model's linears consult to add each row's delta;
- ``manager.py``: the LRU of loaded adapters (``max_cpu_loras``) and which adapter holds
  which slot.

The scheduler only counts distinct adapters (at most ``max_loras`` among running requests);
the runner puts the step's adapters into slots and hands the model the row mapping.
See docs/lora.md.
"""

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
