"""A deterministic stand-in for the engine, so the HTTP front is tested on its own.

The "model" answers with the prompt's ordinary tokens in reverse order, then stops (EOS); with ignore_eos
it cycles that answer until max_tokens. The tokenizer maps each byte to its own id and knows a few special
tokens; the chat template writes `<s><|role|>content<|end|>...<|assistant|>`. Logprobs are a fixed function
of the token id. Tests read what the engine received (`requests`) and what ended early (`aborted`,
`closed_early`).
"""

from __future__ import annotations

import asyncio
import codecs
import re
from collections.abc import AsyncIterator
from typing import Any

from vegaserve.engine.grammar import Grammars
from vegaserve.engine.protocol import EngineStats
from vegaserve.engine.tokenizer import LITERAL
from vegaserve.engine.request import (
    ContextLengthError,
    EngineDeadError,
    FinishReason,
    GenerateRequest,
    RequestOutput,
    TokenLogprob,
)

SPECIALS = {"<s>": 256, "</s>": 257, "<|system|>": 258, "<|user|>": 259, "<|assistant|>": 260, "<|end|>": 261}
BOS, EOS = SPECIALS["<s>"], SPECIALS["</s>"]
_SPECIAL_TEXT = {v: k for k, v in SPECIALS.items()}
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")


class ByteTokenizer:
    vocab_size = 256 + len(SPECIALS)
    max_token_bytes = max(map(len, SPECIALS))

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True, runner=None) -> list[int]:
        if runner is not None:  # where the front asked the work to run (a low-priority thread)
            runner(lambda: None)
        ids = [BOS] if add_special_tokens else []
        # text between two LITERAL marks (quote_special's) is plain text; a byte vocabulary has no merges,
        # so encoding the spans one by one is the same as encoding the runs between control tokens
        for i, span in enumerate(text.split(LITERAL)):
            parse = parse_special and i % 2 == 0
            for piece in _SPECIAL_RE.split(span) if parse else [span]:
                if piece in SPECIALS and parse:
                    ids.append(SPECIALS[piece])
                else:
                    ids.extend(piece.encode("utf-8"))
        return ids

    def quote_special(self, text: str) -> str:
        return _SPECIAL_RE.sub(lambda m: LITERAL + m.group(0) + LITERAL, text)

    def min_tokens(self, text: str) -> int:
        return -(-len(text.replace(LITERAL, "").encode("utf-8")) // self.max_token_bytes)

    def token_bytes(self, token_id: int) -> bytes:
        return _SPECIAL_TEXT[token_id].encode() if token_id in _SPECIAL_TEXT else bytes([token_id])

    def is_special(self, token_id: int) -> bool:
        return token_id in _SPECIAL_TEXT

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return frozenset({EOS})

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        kept = [t for t in ids if not (skip_special_tokens and t in _SPECIAL_TEXT)]
        return b"".join(self.token_bytes(t) for t in kept).decode("utf-8", errors="replace")


class TinyTemplate:
    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list | None = None, **extra: Any
    ) -> str:
        if messages and messages[0]["role"] == "assistant":
            raise ValueError("a conversation cannot start with the assistant")
        text = "<s>" + "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")


def fake_logprob(token_id: int) -> float:
    return -0.25 * (1 + token_id % 5)


def fake_top(token_id: int, n: int) -> list[tuple[int, float]]:
    """The chosen token first, then (id + k) % 256 with logprob lower by k."""
    return [((token_id + k) % 256, fake_logprob(token_id) - k) for k in range(n)]


def answer(prompt_ids: list[int]) -> list[int]:
    """The fake model's whole reply to a prompt: its ordinary (non-special) tokens reversed."""
    return [t for t in reversed(prompt_ids) if t not in _SPECIAL_TEXT]


class FakeEngine:
    def __init__(self, model_name: str = "fake-model", max_model_len: int = 128, token_delay_s: float = 0.0) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = ByteTokenizer()
        self.chat_template = TinyTemplate()
        self.grammars = Grammars(self.tokenizer)  # compiles what requests constrain (the fake ignores it)
        self.token_delay_s = token_delay_s
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.closed_early: list[str] = []
        self.alive = True
        self.fail_with: Exception | None = None  # raised by generate() before any output
        self.stats_value = EngineStats(num_requests_running=3, num_requests_waiting=2, kv_cache_usage=0.25,
                                       prefix_cache_queries=40, prefix_cache_hits=10, num_preemptions=1)
        self.stats_calls = 0

    @property
    def is_alive(self) -> bool:
        return self.alive

    def stats(self) -> EngineStats:
        self.stats_calls += 1
        return self.stats_value

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def _entry(self, token_id: int, n: int) -> TokenLogprob:
        return TokenLogprob(token_id=token_id, logprob=fake_logprob(token_id), top=fake_top(token_id, n))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        if not self.alive:
            raise EngineDeadError("the fake engine is dead")
        if self.fail_with is not None:
            raise self.fail_with
        prompt, params = request.prompt_token_ids, request.params
        if len(prompt) >= self.max_model_len:
            raise ContextLengthError(f"fake engine: prompt of {len(prompt)} tokens >= {self.max_model_len}")
        reply = answer(prompt)
        limit = params.max_tokens or self.max_model_len - len(prompt)
        if params.ignore_eos and reply:
            reply = (reply * (limit // len(reply) + 1))[:limit]
        tokens, finish = (reply[:limit], FinishReason.LENGTH) if len(reply) > limit else (reply, FinishReason.STOP)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        prompt_lps = None
        if params.prompt_logprobs is not None:
            prompt_lps = [None] + [self._entry(t, params.prompt_logprobs) for t in prompt[1:]]
        completed = False
        try:
            for i, token in enumerate(tokens or [None]):
                await asyncio.sleep(self.token_delay_s)
                last = i == max(len(tokens), 1) - 1
                ids = [] if token is None else [token]
                yield RequestOutput(
                    request_id=request.request_id,
                    text=decoder.decode(b"".join(self.tokenizer.token_bytes(t) for t in ids), final=last),
                    token_ids=ids,
                    logprobs=[self._entry(t, params.logprobs) for t in ids] if params.logprobs is not None else None,
                    prompt_logprobs=prompt_lps if i == 0 else None,
                    finish_reason=finish if last else None,
                    num_prompt_tokens=len(prompt),
                    num_generated_tokens=i + len(ids),
                )
            completed = True
        finally:
            if not completed:
                self.closed_early.append(request.request_id)
