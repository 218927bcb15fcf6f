"""Incremental detokenization with stop strings.

Tokens are decoded one at a time with ``tokenizers``' ``DecodeStream``, which buffers
byte-level BPE pieces until they form whole UTF-8 characters, so no emitted piece ever holds
a broken character and the pieces concatenate to the final text. Stop strings are searched
in the accumulated text, so they are found across token boundaries; while stop strings are
set, the last ``len(longest stop) - 1`` characters are held back from streaming until it is
clear they do not start a stop string.

The stream is primed with the end of the prompt, so the first generated token decodes as a
continuation (a SentencePiece decoder strips the leading space of a text's first token: "Paris"
after "is" must read " Paris", as in vLLM).
"""

from __future__ import annotations

from typing import Any, Sequence

from pagedllm.sampling_params import SamplingParams

# Priming feeds the shortest prompt suffix of at least PRIME_MIN tokens (at most PRIME_MAX) that
# does not start inside a character: a few tokens of context for the decoder.
PRIME_MIN, PRIME_MAX = 4, 24


def prime_tokens(tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool) -> list[int]:
    """The end of a prompt to prime a request's detokenizers with (once per request: its n
    samples share it). A suffix that ends inside a character is fine (the output completes it,
    as the text would read); one that starts inside a character is not (its first bytes are
    missing). No such suffix: nothing."""
    backend = tokenizer.backend_tokenizer
    for n in range(min(PRIME_MIN, len(prompt_token_ids)), min(PRIME_MAX, len(prompt_token_ids)) + 1):
        suffix = list(prompt_token_ids[-n:])
        if not backend.decode(suffix, skip_special_tokens=skip_special_tokens).startswith("\ufffd"):
            return suffix
    return []


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, params: SamplingParams, eos_token_ids: frozenset[int] = frozenset(),
                 prime: Sequence[int] = ()):  # fmt: skip
        """``prime``: the prompt's end (``prime_tokens``), read first and not output."""
        self._backend = tokenizer.backend_tokenizer
        self._skip_special = params.skip_special_tokens
        self._stream = self._new_stream()
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._hold_back = max(0, params.max_stop_len - 1)
        self._min_tokens = params.min_tokens
        # A token that ends the request - a stop token id, or EOS unless ignored - ends the text
        # without its own text (as vLLM: "<|im_end|>" showed with skip_special_tokens=false),
        # unless asked to keep it.
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self._stop_ids = frozenset() if params.include_stop_str_in_output else frozenset(stop_ids)
        self.text = ""
        self._emitted = 0
        self._num_tokens = 0
        self.tokens_after_stop = 0  # of the last update's tokens, those after the one a stop string ended in
        for token_id in prime:
            self._step(token_id)

    def _new_stream(self) -> Any:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=self._skip_special)

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as e:
            # A byte-fallback decoder turns a run of byte tokens that is not UTF-8 into one U+FFFD
            # per byte, text already read included; the stream cannot go on from there ("Invalid
            # prefix encountered"). Start a fresh stream at this token: what was shown stays.
            if "invalid prefix" not in str(e).lower():
                raise
            self._stream = self._new_stream()
            return self._stream.step(self._backend, token_id)

    def update(self, token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string that ended the text, if one appeared."""
        for j, token_id in enumerate(token_ids):
            self._num_tokens += 1
            if token_id in self._stop_ids and self._num_tokens > self._min_tokens:
                return None  # the request ends here (Request.check_stop)
            piece = self._step(token_id)
            if not piece:
                continue
            start = max(0, len(self.text) - self._hold_back)
            self.text += piece
            # Like vLLM, stop strings count only after min_tokens.
            if self._stop and self._num_tokens > self._min_tokens:
                hit = self._find_stop(start)
                if hit is not None:
                    self.tokens_after_stop = len(token_ids) - j - 1
                    return hit
        return None

    def _find_stop(self, start: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self._stop:
            idx = self.text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[: idx + len(stop)] if self._include_stop else self.text[:idx]
        return stop

    def visible_text(self, finished: bool) -> str:
        """All text so far, minus what might still turn out to be a stop string."""
        return self.text if finished else self.text[: max(0, len(self.text) - self._hold_back)]

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out, minus what might still turn out to be a stop string."""
        end = max(self._emitted, len(self.visible_text(finished)))
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
