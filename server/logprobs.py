"""The engine's TokenLogprob lists in the two shapes OpenAI clients read.

Chat: one entry per token with its text, its raw bytes (a token can be half a UTF-8 character, so the
text alone cannot rebuild the output) and the top alternatives. Legacy completions: parallel lists of
token texts, logprobs, {text: logprob} alternatives and character offsets.
"""

from __future__ import annotations

from collections.abc import Sequence

from vegaserve.engine.protocol import TokenizerLike
from vegaserve.engine.request import TokenLogprob
from vegaserve.server.protocol import ChatLogprobAlternative, ChatLogprobEntry, ChatLogprobs, CompletionLogprobs


# OpenAI's stand-in for a logprob of -inf (a token masked out by top-k, top-p or logit_bias): JSON has
# no infinity, and clients do arithmetic on these values.
IMPOSSIBLE_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return logprob if logprob > IMPOSSIBLE_LOGPROB else IMPOSSIBLE_LOGPROB


def token_text(tokenizer: TokenizerLike, token_id: int) -> str:
    # errors="replace": a piece of a multi-byte character still gets a printable stand-in; the exact
    # bytes travel alongside in the chat shape.
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def _alternative(tokenizer: TokenizerLike, token_id: int, logprob: float) -> ChatLogprobAlternative:
    raw = tokenizer.token_bytes(token_id)
    return ChatLogprobAlternative(token=raw.decode("utf-8", errors="replace"), logprob=finite(logprob), bytes=list(raw))


def chat_logprobs(tokenizer: TokenizerLike, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    content = []
    for entry in entries:
        chosen = _alternative(tokenizer, entry.token_id, entry.logprob)
        top = [_alternative(tokenizer, tid, lp) for tid, lp in entry.top]
        content.append(ChatLogprobEntry(**chosen.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


class LegacyLogprobs:
    """Builds the legacy shape piece by piece, keeping text offsets running across stream chunks.

    Offsets count characters of the choice's `text` as the client receives it; `skip_to` realigns them
    where the text is not the concatenation of token texts (the echoed prompt is the prompt as sent,
    without the BOS text its first token would add).
    """

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self._tokenizer = tokenizer
        self.offset = 0

    def skip_to(self, offset: int) -> None:
        self.offset = offset

    def add(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> CompletionLogprobs:
        """The part for these tokens; `entries[i]` None means token i has no logprob (a prompt's first)."""
        part = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries, strict=True):
            text = token_text(self._tokenizer, token_id)
            part.tokens.append(text)
            part.text_offset.append(self.offset)
            self.offset += len(text)
            if entry is None:
                part.token_logprobs.append(None)
                part.top_logprobs.append(None)
            else:
                part.token_logprobs.append(finite(entry.logprob))
                part.top_logprobs.append({token_text(self._tokenizer, tid): finite(lp) for tid, lp in entry.top})
        return part


def merge(parts: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    whole = CompletionLogprobs()
    for part in parts:
        whole.tokens += part.tokens
        whole.token_logprobs += part.token_logprobs
        whole.top_logprobs += part.top_logprobs
        whole.text_offset += part.text_offset
    return whole
