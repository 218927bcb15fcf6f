"""Prompt-lookup drafting: the text often repeats itself (code, edits, quotes of the prompt), so
the tokens that followed the last occurrence of the current suffix are a cheap guess."""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` draft tokens for the sequence ``token_ids`` (int64, prompt + output).

    Tries suffix lengths n = n_max .. n_min; for the first n whose last-n tokens occur earlier,
    returns the (up to k) tokens after the latest such occurrence. Vectorised over positions:
    one sliding-window comparison per n.
    """
    total = len(token_ids)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = token_ids[total - n :]
        # Windows starting at 0 .. total-n-1: every earlier place the suffix could sit.
        windows = np.lib.stride_tricks.sliding_window_view(token_ids[: total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return token_ids[start : start + k].tolist()
    return []


class NgramProposer:
    """Drafts for the step's requests from their own token ids (no model, no state)."""

    def __init__(self, k: int, n_min: int, n_max: int):
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, token_ids: list[list[int]]) -> list[list[int]]:
        return [propose_ngram(np.asarray(ids, dtype=np.int64), self.k, self.n_min, self.n_max) for ids in token_ids]
