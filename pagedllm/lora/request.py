"""``LoRARequest``: how a request names its adapter (vLLM's shape). Plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).

    ``lora_int_id`` (>= 1) is the adapter's identity inside the engine: requests with the same
    id share one loaded copy and one slot, so one id must always mean the same name and path.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must name the adapter's directory, got {self.lora_path!r}")

    @property
    def cache_key(self) -> tuple:
        """The prefix cache's extra key for this adapter's blocks: K/V computed under one adapter
        is never reused under another (or under the base model)."""
        return ("lora", self.lora_int_id, self.lora_name, self.lora_path)
