"""What the scheduler decided for one step: the contract between scheduler and model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.engine.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """Run tokens [num_computed_tokens, num_computed_tokens + num_new_tokens) of ``request``."""

    request: Request
    num_new_tokens: int
    num_computed_tokens: int
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a new token is due."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # Copy-on-write block copies (src, dst) to apply before the forward pass.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Swap preemption: (primary, swap) block copies to save, then (swap, primary) to restore.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Prefix cache, in tokens, for requests admitted for the first time this step.
    num_prefix_queries: int = 0
    num_prefix_hits: int = 0
    num_uncacheable_tokens: int = 0  # beyond the last cacheable full block

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
