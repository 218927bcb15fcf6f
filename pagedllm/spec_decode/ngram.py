"""Prompt-lookup drafting: the text often repeats itself (code, edits, quotes of the prompt), so
the tokens that followed the last occurrence of the current suffix are a cheap guess.

The rule: try suffix lengths n = n_max .. n_min; for the first n whose last-n tokens occur
earlier, draft the (up to k) tokens after the latest such occurrence. ``propose_ngram_reference``
says it literally (one vectorised sliding-window comparison per n); ``propose_ngram`` gives the
same drafts by walking back over the earlier places of the last token in plain Python, which
costs ~30 us a step on the caches a decode step leaves cold, against ~250 us for the numpy one
(a dozen numpy calls). Where the last token is everywhere, ``propose_ngram_places`` measures all
its earlier places at once (numpy, n_max passes over them). Tests compare the three.
"""

from __future__ import annotations

import numpy as np

# Earlier places of the last token that ``propose_ngram`` walks before it hands the sequence to
# the vectorised rule (a long text where that token is everywhere: its loop would cost more).
MAX_CANDIDATES = 256


def propose_ngram_reference(token_ids: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """The rule as stated, over an int64 array of the sequence (prompt + output)."""
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


def propose_ngram_places(token_ids: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """The same drafts from every earlier place of the last token at once: how far back each
    agrees with the sequence's end (up to n_max), then the latest of the longest. n_max passes
    over those places, where the rule as stated makes n_max passes over the whole sequence
    (seconds for long texts with a large n_max)."""
    total = len(token_ids)
    places = np.flatnonzero(token_ids[: total - 1] == token_ids[-1])  # where a match could end
    if places.size == 0:
        return []
    agree = np.ones(places.size, dtype=np.int64)
    alive = np.arange(places.size)
    for d in range(1, n_max):
        alive = alive[places[alive] >= d]
        alive = alive[token_ids[places[alive] - d] == token_ids[total - 1 - d]]
        if alive.size == 0:
            break
        agree[alive] += 1
    best = int(agree.max())
    if best < n_min:
        return []
    start = int(places[np.flatnonzero(agree == best)[-1]]) + 1
    return token_ids[start : start + k].tolist()


def propose_ngram(token_ids: list[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` draft tokens for the sequence ``token_ids`` (prompt + output): the rule above.

    Walks the earlier places of the last token from the latest back, measuring how far each
    agrees with the sequence's end (up to n_max). The longest agreement wins, the latest among
    equals: exactly the latest occurrence of the longest suffix. It stops at the first place
    that agrees over n_max tokens, since nothing before it can beat that.
    """
    ids = token_ids.tolist() if isinstance(token_ids, np.ndarray) else token_ids
    total = len(ids)
    if total < 2:
        return []
    rev = ids[::-1]  # rev[0] is the last token; rev[r] (r >= 1) is ids[total - 1 - r]
    best_n = best_r = r = 0
    for _ in range(MAX_CANDIDATES):
        try:
            r = rev.index(rev[0], r + 1)
        except ValueError:
            break
        n = 1
        while n < n_max and r + n < total and rev[r + n] == rev[n]:
            n += 1
        if n > best_n:
            best_n, best_r = n, r
            if n >= n_max:
                break
    else:  # as many places as the walk allows, none agreeing over n_max tokens
        return propose_ngram_places(np.asarray(ids, dtype=np.int64), k, n_min, n_max)
    if best_n < n_min:
        return []
    start = total - best_r  # the token after the match (which ends at ids[total - 1 - best_r])
    return ids[start : start + k]


class NgramProposer:
    """Drafts for the step's requests from their own token ids (no model, no state)."""

    def __init__(self, k: int, n_min: int, n_max: int):
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, token_ids: list[list[int]]) -> list[list[int]]:
        return [propose_ngram(ids, self.k, self.n_min, self.n_max) for ids in token_ids]
