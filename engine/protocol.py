"""What the HTTP front may rely on from an engine: the only surface `server/` touches.

`AsyncEngine` implements it; tests of the server implement it with a fake.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from vegaserve.engine.request import GenerateRequest, GuideSpec, RequestOutput


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /metrics and /health."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float  # 0..1
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # speculative decoding (engine/speculative.py), vLLM's spec_decode counters
    spec_num_drafts: int = 0  # verify steps of a drafted sequence (all four stay 0 while speculation is off)
    spec_num_draft_tokens: int = 0  # guesses verified
    spec_num_accepted_tokens: int = 0  # guesses kept
    spec_accepted_per_pos: tuple[int, ...] = ()  # [j]: times guess j was kept


# Runs a piece of tokenizing work that holds no GIL where the caller wants it (engine/tokenizer.py's encode).
Runner = Callable[[Callable[[], Any]], Any]


class TokenizerLike(Protocol):
    def encode(
        self, text: str, add_special_tokens: bool = True, parse_special: bool = True, runner: Runner | None = None
    ) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def quote_special(self, text: str) -> str:
        """`text` with its control-token texts marked so that encode() reads them as plain text."""
        ...
    def min_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens of `text`, from its length alone (0: none known)."""
        ...

    @property
    def vocab_size(self) -> int: ...


class ChatTemplateLike(Protocol):
    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list | None = None, **extra: Any
    ) -> str: ...


class GrammarCompiler(Protocol):
    def compile(self, spec: GuideSpec) -> Any:
        """The compiled grammar (cached); InvalidRequestError naming what is wrong with it."""
        ...


class EngineClient(Protocol):
    model_name: str  # the id /v1/models lists and requests must name
    max_model_len: int  # context length in tokens
    tokenizer: TokenizerLike
    chat_template: ChatTemplateLike
    grammars: GrammarCompiler  # compiles a request's GuideSpec (engine/grammar.py); the server calls it first

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's increments; the last one has finish_reason set.

        Raises InvalidRequestError / ContextLengthError before the first output for a request that cannot
        run, EngineDeadError when the engine is gone. Leaving the iterator early (client disconnect) aborts
        the request and frees what it held.
        """
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    @property
    def is_alive(self) -> bool: ...
