"""Greedy parity helper: compare engine tokens with the transformers oracle, reporting near-ties.

A token flip is accepted only as a *near-tie*: at the first differing step the oracle's
logits rank the engine's token in their top 5 and within ``tie_tol`` of the best. Every
such flip is reported as a warning (never hidden); anything else fails.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch


class NearTieFlip(UserWarning):
    pass


@dataclass
class OracleResult:
    tokens: list[int]
    logits: list[torch.Tensor]  # raw fp32 logits per generated step


def oracle_generate(model, prompt_ids: list[int], max_new_tokens: int) -> OracleResult:
    """transformers greedy ``generate``, batch 1, no padding."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    return OracleResult(tokens, [step[0].float() for step in out.logits])


def assert_greedy_parity(name: str, engine_tokens: list[int], oracle: OracleResult, tie_tol: float = 1e-3) -> bool:
    """True when exact; a reported near-tie flip returns False; any other difference fails."""
    for step, (mine, ref) in enumerate(zip(engine_tokens, oracle.tokens)):
        if mine == ref:
            continue
        logits = oracle.logits[step]
        top5 = logits.topk(5).indices.tolist()
        gap = float(logits[ref] - logits[mine])
        assert mine in top5 and ref in top5 and gap <= tie_tol, (
            f"{name}: token {step} differs: engine {mine}, transformers {ref} "
            f"(oracle top5 {top5}, logit gap {gap:.4g}); not a near-tie"
        )
        warnings.warn(NearTieFlip(f"{name}: near-tie flip at token {step}: {mine} vs {ref}, gap {gap:.2e}"))
        return False
    assert len(engine_tokens) == len(oracle.tokens), (
        f"{name}: engine produced {len(engine_tokens)} tokens, transformers {len(oracle.tokens)}"
    )
    return True
