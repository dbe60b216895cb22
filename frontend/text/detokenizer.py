"""Incremental detokenization of one request's output, with stop strings.

Token ids arrive a few at a time; text leaves in chunks that are always valid UTF-8: a character
split over several byte-level tokens is held back until its last byte arrives (tokenizers'
DecodeStream does that). Stop strings are matched on the text, also across chunk boundaries: the
end of the text that could still grow into a stop string is withheld until it either completes one
(the output is cut before it) or cannot any more. Text once released is never taken back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import tokenizers
from tokenizers.decoders import DecodeStream

logger = logging.getLogger("tern.frontend")

# Prompt tokens fed to the decoder first: enough context for decoders that treat the first token
# specially (SentencePiece's leading-space strip) to decode the first output token as vLLM does.
_NUM_PREFIX_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        prefix = [int(t) for t in prompt_token_ids[-_NUM_PREFIX_TOKENS:]]
        self._stream = DecodeStream(ids=prefix, skip_special_tokens=skip_special_tokens)
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""  # the output so far, cut at a stop string once one is found
        self.num_tokens = 0  # output tokens consumed (tokens after a stop string are not)
        self.stop_reason: str | None = None  # the stop string that ended the output
        self._num_released = 0  # chars of self.text already handed out

    @property
    def is_stopped(self) -> bool:
        """True once a stop string has been found: the output is complete."""
        return self.stop_reason is not None

    def update(self, new_token_ids: Sequence[int], ends_with_stop_token: bool = False) -> None:
        """Consumes new output tokens, stopping at the first stop string.

        `ends_with_stop_token`: the engine finished the request because the last token is EOS or
        a stop token id; like vLLM, its text is only kept with include_stop_str_in_output.
        """
        for i, token_id in enumerate(new_token_ids):
            if self.is_stopped:
                return
            self.num_tokens += 1
            is_stop_token = ends_with_stop_token and i == len(new_token_ids) - 1
            if is_stop_token and not self.include_stop_str_in_output:
                return
            prev_len = len(self.text)
            self.text += self._step(token_id)
            if self.stop:
                self._check_stop(prev_len)

    def take_new_text(self, final: bool = False) -> str:
        """Text not yet handed out, minus an end that could still become a stop string.

        `final`: the request is over, release everything.
        """
        end = len(self.text)
        if not (final or self.is_stopped) and self.stop:
            end -= self._partial_stop_len()
        if end <= self._num_released:
            return ""
        chunk = self.text[self._num_released : end]
        self._num_released = end
        return chunk

    def _step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._tokenizer, token_id) or ""
        except Exception as e:  # noqa: BLE001
            # NOTE: a model's vocabulary can be larger than its tokenizer's (padded embeddings);
            # such ids have no text. Never fail the request over it.
            logger.warning("cannot decode token id %d: %s", token_id, e)
            return ""

    def _check_stop(self, prev_len: int) -> None:
        # A stop string that ends in the new text starts at most len(stop) - 1 chars before it.
        start = max(0, prev_len - self._max_stop_len + 1, self._num_released)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return
        idx, s = best
        self.text = (
            self.text[: idx + len(s)] if self.include_stop_str_in_output else self.text[:idx]
        )
        self.stop_reason = s

    def _partial_stop_len(self) -> int:
        """Length of the longest unreleased suffix of the text that is a proper prefix of a stop."""
        tail_start = max(self._num_released, len(self.text) - self._max_stop_len + 1)
        for k in range(tail_start, len(self.text)):
            suffix = self.text[k:]
            if any(s.startswith(suffix) for s in self.stop):
                return len(self.text) - k
        return 0
