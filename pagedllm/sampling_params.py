"""Per-request generation settings, with vLLM's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature=0`` is greedy decoding. ``seed`` gives the request its own random
    generator, so its samples do not depend on what else is in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    max_tokens: int | None = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n != 1:
            # Parallel sampling (n > 1) arrives with the sampling issue.
            raise ValueError(f"n must be 1 for now, got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a non-negative number, got {self.temperature!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
