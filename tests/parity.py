"""Greedy parity helper: compare engine tokens with the transformers oracle, reporting near-ties.

A token flip is accepted only as a *near-tie*: at the first differing step the oracle's
logits rank the engine's token in their top 5 and within ``tie_tol`` of the best. Every
such flip is reported as a warning (never hidden); anything else fails.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from pagedllm.bench.workloads import parity_prompts as bench_parity_prompts


class NearTieFlip(UserWarning):
    pass


def load_gguf_oracle(path) -> torch.nn.Module:
    """transformers' own fp32 load of a GGUF file (the oracle), its metadata parsed once.

    ``from_pretrained`` builds a ``gguf.GGUFReader`` twice (for the config, then for the
    weights). Its parse walks every string of the vocabulary through numpy: ~28 s for Gemma 3's
    262k tokens on this machine kind, half the load. The second read of the same file gets the
    first reader back; what transformers makes of it is unchanged."""
    from pathlib import Path

    import gguf
    import transformers

    path = Path(path)
    real, readers = gguf.GGUFReader, {}

    def reader(p, *args, **kwargs):
        key = (str(p), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real(p, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32)  # fmt: skip
    finally:
        gguf.GGUFReader = real
    return model.eval()


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


def assert_engines_agree(name: str, mine, ref, top: int = 5, tie_tol: float = 0.1) -> bool:
    """Two engine runs (CompletionOutputs with ``logprobs=top``) give the same greedy tokens.

    At the first differing step both tokens must sit in each other's top ``top``, each side
    preferring its token by at most ``tie_tol`` nats (a tie that rounding flipped; reported
    as a warning). The sequences diverge after it, so the comparison stops there. The default
    tolerance is bf16's noise: a 2^-8 relative rounding of the hidden state moves logits by a
    few hundredths. True when exact.
    """
    for step, (a, b) in enumerate(zip(mine.token_ids, ref.token_ids)):
        if a == b:
            continue
        mine_top, ref_top = mine.logprobs[step], ref.logprobs[step]
        assert a in ref_top and b in mine_top, (
            f"{name}: token {step} differs: {a} vs {b}; top-{top} {sorted(mine_top)} vs {sorted(ref_top)}: not a tie"
        )
        gaps = (mine_top[a].logprob - mine_top[b].logprob, ref_top[b].logprob - ref_top[a].logprob)
        assert max(gaps) <= tie_tol, f"{name}: token {step} differs: {a} vs {b}, logprob gaps {gaps}: not a tie"
        warnings.warn(NearTieFlip(f"{name}: near-tie flip at token {step}: {a} vs {b}, logprob gaps {gaps[0]:.3g} / {gaps[1]:.3g}"))
        return False
    assert len(mine.token_ids) == len(ref.token_ids), f"{name}: {len(mine.token_ids)} vs {len(ref.token_ids)} tokens"
    return True


def parity_prompts(tok) -> list[list[int]]:
    """The parity prompts (pagedllm/bench/workloads.py), checked to span 1 to ~1,500 tokens."""
    out = bench_parity_prompts(tok)
    lens = sorted(len(p) for p in out)
    assert len(out) >= 10 and lens[0] == 1 and lens[-1] >= 1400, lens
    return out
