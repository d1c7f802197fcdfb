"""The plain data that crosses the engine's boundaries.

The chain, from the HTTP front to the kernels and back:

    GenerateRequest   what the server asks for: prompt token ids + SamplingParams
      -> Request      the engine's live state of one request (tokens so far, status, detokenizer)
      -> ScheduledBatch   which requests compute which tokens this step   (engine/scheduler.py)
      -> StepPlan         the same as plain data, sent to every rank       (engine/forward_batch.py)
      -> ForwardBatch     the same as tensors for the model                (engine/forward_batch.py)
      -> StepOutput       sampled token ids and logprobs per request       (engine/model_runner.py)
      -> RequestOutput    what the server streams: new text, new tokens, finish reason

The server reads only GenerateRequest, SamplingParams (with its GuideSpec), RequestOutput and the errors
defined here.
"""

from __future__ import annotations

import enum
import itertools
import json
from dataclasses import dataclass, field
from typing import Any


class EngineError(Exception):
    """A request the engine cannot serve; the message is shown to the client."""


class InvalidRequestError(EngineError):
    """The request itself is wrong (HTTP 400)."""


class ContextLengthError(InvalidRequestError):
    """The prompt, or prompt + max_tokens, does not fit the context."""


class EngineDeadError(EngineError):
    """The engine stopped and serves nothing more (HTTP 503)."""


# The sampler computes in float32: logits / temperature, and logits / or * the repetition penalty. Past
# these bounds a logit (|x| <= ~1e4 with logit_bias) can become inf, the draw NaN and the token id out of
# range (found by fuzzing: temperature 1e-310, penalty 1e-300). Below 1e-5 a temperature is argmax anyway.
MIN_TEMPERATURE = 1e-5
PENALTY_RANGE = (1e-6, 1e6)


GUIDE_KINDS = ("json_schema", "json_object", "grammar", "regex", "choice")


@dataclass(frozen=True)
class GuideSpec:
    """What a request's output must match (constrained decoding, engine/grammar.py): `kind` one of GUIDE_KINDS,
    `text` the JSON schema (as JSON text), the GBNF grammar, the regex, or the choices (a JSON list of
    strings); empty for json_object."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GUIDE_KINDS:
            raise ValueError(f"guide kind {self.kind!r} is not one of {GUIDE_KINDS}")

    @classmethod
    def json_schema(cls, schema: Any) -> GuideSpec:
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))  # key order kept: it is the output's

    @classmethod
    def choice(cls, choices: list[str]) -> GuideSpec:
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. Validated at construction."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs of each sampled token; None: off
    prompt_logprobs: int | None = None  # same for the prompt tokens (completions with echo)
    include_stop_str_in_output: bool = False
    guide: GuideSpec | None = None  # constrained decoding: what the output must match (engine/grammar.py)

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise InvalidRequestError(msg)

        check(self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        check(self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}")
        check(
            not 0.0 < self.temperature < MIN_TEMPERATURE,
            f"temperature {self.temperature} is too small to sample with: use 0 for greedy, or at least {MIN_TEMPERATURE}",
        )
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        check(self.top_k >= -1, f"top_k must be -1, 0 or positive, got {self.top_k}")
        low, high = PENALTY_RANGE
        check(low <= self.repetition_penalty <= high, f"repetition_penalty must be in [{low}, {high}], got {self.repetition_penalty}")
        check(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        for n, what in ((self.logprobs, "logprobs"), (self.prompt_logprobs, "prompt_logprobs")):
            check(n is None or 0 <= n <= 20, f"{what} must be in [0, 20], got {n}")
        check(all(s for s in self.stop), "stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


_request_ids = itertools.count()


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{next(_request_ids)}"


@dataclass
class GenerateRequest:
    """One generation: the tokenized prompt and how to sample. Built by the server."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=new_request_id)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context
    ABORT = "abort"  # the client left or the engine aborted it


@dataclass
class TokenLogprob:
    """One position: the chosen token's logprob and the top alternatives (id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """The increment since the last output of one request, as the server streams it."""

    request_id: str
    text: str  # new text (never half a UTF-8 character)
    token_ids: list[int]  # new tokens
    logprobs: list[TokenLogprob] | None = None  # one per new token when asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first output only, when asked
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0  # so far, all outputs together

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
