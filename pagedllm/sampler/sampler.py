"""Turns the logits of a step into one token per sampling row, all rows at once.

Greedy rows take the argmax. Random rows use the "exponential race": with E ~ Exp(1) per
vocabulary entry, argmax(p / E) is a draw from p. The noise of a seeded request comes from
its own generator, so its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """Per-row parameters of the rows to sample this step."""

    temperatures: torch.Tensor  # [rows] fp32; 0 means greedy
    generators: list[torch.Generator | None]  # per row: the request's own generator, or None
    all_greedy: bool


class Sampler:
    def __init__(self, seed: int, device: torch.device | str = "cpu"):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [rows, vocab] fp32 -> token ids [rows] int64."""
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy_tokens
        temps = batch.temperatures.to(logits.device)
        is_greedy = temps == 0
        probs = torch.softmax(logits / torch.where(is_greedy, 1.0, temps)[:, None], dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(batch.generators) if g is None]
        if unseeded:
            rows = noise[unseeded] if len(unseeded) < len(batch.generators) else noise
            rows.exponential_(generator=self.generator)
            if len(unseeded) < len(batch.generators):
                noise[unseeded] = rows
        for i, g in enumerate(batch.generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(is_greedy, greedy_tokens, sampled)
