"""Streaming text out of generated tokens: whole characters only, and stop strings held back until decided.

IncrementalDetokenizer turns each new token into the text it completes. A token may carry part of a
character (byte-level BPE and byte-fallback tokens split multi-byte UTF-8), so the bytes go through an
incremental UTF-8 decoder that keeps an unfinished sequence until its last byte arrives; the chunks joined
are exactly `tokenizer.decode(ids)` (same bytes, same replacement of invalid ones).

StopMatcher sits after it: text that could still be the start of a stop string is held back, so a client
never receives the first half of a stop string it asked never to see. It tracks, per stop string, the
longest suffix of the stream that is a prefix of that string (Knuth-Morris-Pratt), so each call costs
O(len(new text) * number of stops) and never rescans earlier text.
"""

from __future__ import annotations

import codecs
from typing import Protocol


class _TokenSource(Protocol):
    """What the detokenizer needs of a Tokenizer (tests pass small fakes)."""

    @property
    def add_space_prefix(self) -> bool: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def is_special(self, token_id: int) -> bool: ...


# Enough prompt tokens to hold any unfinished UTF-8 sequence at the prompt's end (at most 3 bytes, and every
# token is at least one byte).
_PROMPT_TAIL_TOKENS = 4


class IncrementalDetokenizer:
    """Token ids in, new complete text out. Not thread-safe: one per request."""

    def __init__(
        self, tokenizer: _TokenSource, prompt_ids: list[int] | None = None, skip_special_tokens: bool = False
    ) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # At the very start of a text a SentencePiece vocab's first space is the prefix the encoder added;
        # after a prompt it is a real space.
        self._strip_space = bool(tokenizer.add_space_prefix) and not prompt_ids
        if prompt_ids:
            # A prompt may end inside a character that the first generated token completes: load its tail
            # so that character comes out whole (the prompt's own text is not ours to emit).
            self._utf8.decode(b"".join(self._bytes(i) for i in prompt_ids[-_PROMPT_TAIL_TOKENS:]))

    def _bytes(self, token_id: int) -> bytes:
        if self._skip_special and self._tok.is_special(token_id):
            return b""
        return self._tok.token_bytes(token_id)

    def _emit(self, text: str) -> str:
        if self._strip_space and text:
            self._strip_space = False
            if text[0] == " ":
                return text[1:]
        return text

    def push(self, token_id: int) -> str:
        """The text this token completes: '' while a character is unfinished."""
        return self._emit(self._utf8.decode(self._bytes(token_id)))

    def flush(self) -> str:
        """At the end of the stream: an unfinished character comes out as U+FFFD."""
        return self._emit(self._utf8.decode(b"", final=True))


def _kmp_failure(pattern: str) -> list[int]:
    """fail[k]: length of the longest proper prefix of pattern[:k] that is also its suffix."""
    fail = [0] * (len(pattern) + 1)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i + 1] = k
    return fail


class StopMatcher:
    """Cuts a text stream at the first stop string. The first occurrence is the one that ends first (what
    a reader going character by character sees first); of two ending together, the longer one. So the
    result does not depend on how the stream is chunked."""

    def __init__(self, stops: tuple[str, ...], include_stop: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(dict.fromkeys(stops))  # deduplicated, order kept
        self._fail = [_kmp_failure(s) for s in self._stops]
        self._state = [0] * len(self._stops)  # per stop: matched prefix length at the stream's end
        self._include_stop = include_stop
        self._held = ""  # text not emitted yet: always the stream's last max(self._state) characters
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was reached). After a stop, always ('', True)."""
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        buf = self._held + text
        base = len(self._held)
        for pos, ch in enumerate(text, start=base):
            hit: str | None = None
            for j, stop in enumerate(self._stops):
                k, fail = self._state[j], self._fail[j]
                while k and stop[k] != ch:
                    k = fail[k]
                if stop[k] == ch:
                    k += 1
                if k == len(stop):
                    if hit is None or len(stop) > len(hit):
                        hit = stop
                    k = fail[k]
                self._state[j] = k
            if hit is not None:
                end = pos + 1
                self.stopped = True
                self._held = ""
                return buf[: end if self._include_stop else end - len(hit)], True
        hold = max(self._state)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """At the end of the stream with no stop reached: the held-back text, which was no stop after all."""
        held, self._held = self._held, ""
        self._state = [0] * len(self._stops)
        return "" if self.stopped else held
