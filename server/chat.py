"""POST /v1/chat/completions: messages -> chat template -> tokens -> engine -> one choice, whole or streamed.

`prepare_chat` is the CPU part (parse, render, tokenize), run off the event loop; `create_chat_completion`
drives the engine and answers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from vegaserve.engine.protocol import EngineClient, Runner
from vegaserve.engine.request import GenerateRequest, RequestOutput, SamplingParams, TokenLogprob
from vegaserve.server.body import json_response, parse_body
from vegaserve.server.generation import Generation, collect
from vegaserve.server.logprobs import chat_logprobs
from vegaserve.server.metrics import ServerMetrics
from vegaserve.server.preprocess import chat_prompt_ids, chat_sampling_params, check_model
from vegaserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    UsageInfo,
    new_id,
    now,
)
from vegaserve.server.streaming import finish_reason, start_stream, usage_of


@dataclass(frozen=True)
class PreparedChat:
    body: ChatCompletionRequest
    prompt_ids: list[int]
    params: SamplingParams


def prepare_chat(engine: EngineClient, raw: bytes, quote_content: bool, runner: Runner | None = None) -> PreparedChat:
    body = parse_body(raw, ChatCompletionRequest)
    check_model(engine, body.model)
    prompt_ids = chat_prompt_ids(engine, body.messages, body.tools, quote_content=quote_content, runner=runner)
    return PreparedChat(body, prompt_ids, chat_sampling_params(engine, body, len(prompt_ids)))


async def create_chat_completion(
    engine: EngineClient, metrics: ServerMetrics, http: Request, prepared: PreparedChat
) -> Response:
    body, prompt_ids, params = prepared.body, prepared.prompt_ids, prepared.params
    request = GenerateRequest(prompt_ids, params, new_id("chatcmpl"))
    generation = Generation(engine, request, metrics, drain=http.app.state.drain)
    if body.stream:
        return await start_stream(
            http, generation, lambda first: _chunks(engine, body, generation, first, len(prompt_ids))
        )

    outputs = await collect(http, generation)
    entries: list[TokenLogprob] = [e for out in outputs for e in (out.logprobs or ())]
    n_generated = sum(len(out.token_ids) for out in outputs)
    response = ChatCompletionResponse(
        id=generation.request_id,
        model=engine.model_name,
        choices=[
            ChatChoice(
                message=AssistantMessage(content="".join(out.text for out in outputs)),
                logprobs=chat_logprobs(engine.tokenizer, entries) if params.logprobs is not None else None,
                finish_reason=finish_reason(outputs[-1]) if outputs else None,
            )
        ],
        usage=usage_of(generation, len(prompt_ids), n_generated),
    )
    return json_response(response)


async def _chunks(
    engine: EngineClient,
    body: ChatCompletionRequest,
    generation: Generation,
    first: RequestOutput,
    prompt_len: int,
) -> AsyncIterator[str]:
    created = now()
    want_logprobs = body.num_logprobs() is not None

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        return ChatCompletionChunk(
            id=generation.request_id, created=created, model=engine.model_name, choices=choices, usage=usage
        ).model_dump_json()

    # OpenAI's first chunk names the role and carries no text; clients key on it.
    yield chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])
    n_generated = 0
    out: RequestOutput | None = first
    while out is not None:
        n_generated += len(out.token_ids)
        # Tokens that end mid-character bring no text yet; skip them unless they carry logprobs.
        if out.text or out.finished or (want_logprobs and out.logprobs):
            logprobs = chat_logprobs(engine.tokenizer, out.logprobs or ()) if want_logprobs else None
            yield chunk(
                [
                    ChatChunkChoice(
                        delta=ChatDelta(content=out.text or None),
                        logprobs=logprobs,
                        finish_reason=finish_reason(out),
                    )
                ]
            )
        out = None if out.finished else await anext(generation, None)
    if body.include_usage:
        yield chunk([], usage=usage_of(generation, prompt_len, n_generated))
