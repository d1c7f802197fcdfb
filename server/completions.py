"""POST /v1/completions: the legacy API, prompt text or token ids in, text out, with echo and logprobs.

`prepare_completion` is the CPU part (parse, tokenize), run off the event loop; `create_completion` drives
the engine and answers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from vegaserve.engine.protocol import EngineClient, Runner
from vegaserve.engine.request import GenerateRequest, RequestOutput, SamplingParams, TokenLogprob
from vegaserve.server.body import json_response, parse_body
from vegaserve.server.generation import Choices, collect
from vegaserve.server.logprobs import LegacyLogprobs, merge
from vegaserve.server.metrics import ServerMetrics
from vegaserve.server.preprocess import check_model, completion_prompt_ids, completion_sampling_params
from vegaserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    new_id,
    now,
)
from vegaserve.server.streaming import finish_reason, start_stream, usage_of
from vegaserve.server.structured import compile_constraint, constraint


class _Echo:
    """What a completion choice shows before the generated text, and the logprobs of its tokens.

    Holds the running LegacyLogprobs so stream chunks and the whole response share one offset count.
    """

    def __init__(self, engine: EngineClient, body: CompletionRequest, prompt_ids: list[int]) -> None:
        self.prompt_ids = prompt_ids
        self.text = ""
        if body.echo:
            # The prompt as the client sent it; a token-id prompt has no text but its decoding.
            self.text = body.prompt if isinstance(body.prompt, str) else engine.tokenizer.decode(prompt_ids)
        self.logprobs = LegacyLogprobs(engine.tokenizer) if body.logprobs is not None else None
        self.echo = body.echo

    def prompt_part(self, first: RequestOutput) -> CompletionLogprobs | None:
        if self.logprobs is None or not self.echo:
            return None
        entries: Sequence[TokenLogprob | None] = first.prompt_logprobs or [None] * len(self.prompt_ids)
        part = self.logprobs.add(self.prompt_ids, entries)
        # Generated tokens' offsets point into the text after the echoed prompt.
        self.logprobs.skip_to(len(self.text))
        return part

    def output_part(self, out: RequestOutput) -> CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        entries: Sequence[TokenLogprob | None] = out.logprobs or [None] * len(out.token_ids)
        return self.logprobs.add(out.token_ids, entries)


@dataclass(frozen=True)
class PreparedCompletion:
    body: CompletionRequest
    prompt_ids: list[int]
    params: SamplingParams


def prepare_completion(engine: EngineClient, raw: bytes, runner: Runner | None = None) -> PreparedCompletion:
    body = parse_body(raw, CompletionRequest)
    check_model(engine, body.model)
    guide = compile_constraint(engine, constraint(body))  # llama-server's json_schema / grammar, vLLM's guided_*
    prompt_ids = completion_prompt_ids(engine, body, runner)
    return PreparedCompletion(body, prompt_ids, completion_sampling_params(engine, body, len(prompt_ids), guide))


async def create_completion(
    engine: EngineClient, metrics: ServerMetrics, http: Request, prepared: PreparedCompletion
) -> Response:
    body, prompt_ids, params = prepared.body, prepared.prompt_ids, prepared.params
    choices = Choices(engine, GenerateRequest(prompt_ids, params, new_id("cmpl")), body.n, metrics,
                      drain=http.app.state.drain)
    echoes = [_Echo(engine, body, prompt_ids) for _ in range(body.n)]
    if body.stream:
        return await start_stream(http, choices, lambda first: _chunks(engine, body, choices, echoes, first))

    per_choice = await collect(http, choices)
    response = CompletionResponse(
        id=choices.request_id,
        model=engine.model_name,
        choices=[_choice(i, outputs, echo) for i, (outputs, echo) in enumerate(zip(per_choice, echoes, strict=True))],
        usage=usage_of(choices, len(prompt_ids), sum(len(o.token_ids) for outs in per_choice for o in outs)),
    )
    return json_response(response)


def _choice(index: int, outputs: list[RequestOutput], echo: _Echo) -> CompletionChoice:
    parts = [echo.prompt_part(outputs[0])] if outputs else []
    parts += [echo.output_part(out) for out in outputs]
    return CompletionChoice(
        index=index,
        text=echo.text + "".join(out.text for out in outputs),
        logprobs=merge([p for p in parts if p is not None]) if echo.logprobs is not None else None,
        finish_reason=finish_reason(outputs[-1]) if outputs else None,
    )


async def _chunks(
    engine: EngineClient, body: CompletionRequest, choices: Choices, echoes: list[_Echo],
    first: tuple[int, RequestOutput]
) -> AsyncIterator[str]:
    created = now()

    def chunk(parts: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        return CompletionResponse(
            id=choices.request_id, created=created, model=engine.model_name, choices=parts, usage=usage
        ).model_dump_json()

    n_generated = 0
    started: set[int] = set()  # the choices whose first output went out (with the echoed prompt)
    step: tuple[int, RequestOutput] | None = first
    while step is not None:
        i, out = step
        echo = echoes[i]
        n_generated += len(out.token_ids)
        prefix, prompt_part = ("", None) if i in started else (echo.text, echo.prompt_part(out))
        started.add(i)
        part = echo.output_part(out)
        if prompt_part is not None and part is not None:
            part = merge([prompt_part, part])
        text = prefix + out.text
        if text or out.finished or part is not None and part.tokens:
            yield chunk([CompletionChoice(index=i, text=text, logprobs=part, finish_reason=finish_reason(out))])
        step = await anext(choices, None)
    if body.include_usage:
        yield chunk([], usage=usage_of(choices, len(echoes[0].prompt_ids), n_generated))
