"""POST /v1/chat/completions: messages -> chat template -> tokens -> engine -> n choices, whole or streamed.

`prepare_chat` is the CPU part (parse, check the tools and the output constraint and compile its grammar,
render, tokenize), run off the event loop; `create_chat_completion` drives the engine and answers. The reply's
text goes through the request's parsers (server/chat_reply.py) into content, reasoning_content and tool_calls,
streamed as deltas by the same parsers, so both modes give the same message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from vegaserve.engine.protocol import EngineClient, Runner
from vegaserve.engine.request import GenerateRequest, RequestOutput, SamplingParams, TokenLogprob
from vegaserve.server.body import json_response, parse_body
from vegaserve.server.chat_reply import ChatReply, delta_json, reply_parser
from vegaserve.server.generation import Choices, collect
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
from vegaserve.server.structured import check_tools, compile_constraint, constraint, tool_constraint
from vegaserve.server.errors import ApiError

# a prompt's last tokens, enough to see whether the template left the reply inside a think block
_PROMPT_TAIL_TOKENS = 8


@dataclass(frozen=True)
class PreparedChat:
    body: ChatCompletionRequest
    prompt_ids: list[int]
    params: SamplingParams
    constrained_by: str | None = None  # the field whose grammar holds decoding, if any


def prepare_chat(engine: EngineClient, raw: bytes, quote_content: bool, runner: Runner | None = None) -> PreparedChat:
    body = parse_body(raw, ChatCompletionRequest)
    check_model(engine, body.model)
    check_tools(body.tools, body.tool_choice)
    own = constraint(body)
    by_tools = tool_constraint(body.tools, body.tool_choice, body.parallel_tool_calls)
    if own is not None and by_tools is not None:
        raise ApiError(400, f"tool_choice {_choice_name(body)} constrains the reply, and so does {own[1]}: give one",
                       param=own[1])
    chosen = own or by_tools
    guide = compile_constraint(engine, chosen)
    prompt_ids = chat_prompt_ids(engine, body.messages, body.tools, quote_content=quote_content, runner=runner,
                                 template_kwargs=body.chat_template_kwargs)
    return PreparedChat(body, prompt_ids, chat_sampling_params(engine, body, len(prompt_ids), guide),
                        chosen[1] if chosen else None)


def _choice_name(body: ChatCompletionRequest) -> str:
    return repr(body.tool_choice) if isinstance(body.tool_choice, str) else f"naming {body.tool_choice.function.name!r}"


def _reply(engine: EngineClient, prepared: PreparedChat) -> ChatReply:
    body = prepared.body
    tail = engine.tokenizer.decode(prepared.prompt_ids[-_PROMPT_TAIL_TOKENS:])
    source = getattr(engine.chat_template, "source", "")
    return ChatReply(reply_parser(source, tail, body.tools, body.tool_choice, prepared.constrained_by,
                                  split_reasoning=body.reasoning_format != "none"))


async def create_chat_completion(
    engine: EngineClient, metrics: ServerMetrics, http: Request, prepared: PreparedChat
) -> Response:
    body, prompt_ids, params = prepared.body, prepared.prompt_ids, prepared.params
    request = GenerateRequest(prompt_ids, params, new_id("chatcmpl"))
    choices = Choices(engine, request, body.n, metrics, drain=http.app.state.drain)
    replies = [_reply(engine, prepared) for _ in range(body.n)]
    if body.stream:
        return await start_stream(
            http, choices, lambda first: _chunks(engine, body, choices, first, len(prompt_ids), replies)
        )

    per_choice = await collect(http, choices)
    response = ChatCompletionResponse(
        id=choices.request_id,
        model=engine.model_name,
        choices=[_choice(engine, params, i, outputs, reply)
                 for i, (outputs, reply) in enumerate(zip(per_choice, replies, strict=True))],
        usage=usage_of(choices, len(prompt_ids), sum(len(o.token_ids) for outs in per_choice for o in outs)),
    )
    return json_response(response)


def _choice(engine: EngineClient, params: SamplingParams, index: int, outputs: list[RequestOutput],
            reply: ChatReply) -> ChatChoice:
    entries: list[TokenLogprob] = [e for out in outputs for e in (out.logprobs or ())]
    reply.feed("".join(out.text for out in outputs))
    reply.finish()
    return ChatChoice(
        index=index,
        message=AssistantMessage(**reply.message_fields()),
        logprobs=chat_logprobs(engine.tokenizer, entries) if params.logprobs is not None else None,
        finish_reason=reply.finish_reason(finish_reason(outputs[-1])) if outputs else None,
    )


async def _chunks(
    engine: EngineClient,
    body: ChatCompletionRequest,
    choices: Choices,
    first: tuple[int, RequestOutput],
    prompt_len: int,
    replies: list[ChatReply],
) -> AsyncIterator[str]:
    created = now()
    want_logprobs = body.num_logprobs() is not None

    def chunk(parts: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        return ChatCompletionChunk(
            id=choices.request_id, created=created, model=engine.model_name, choices=parts, usage=usage
        ).model_dump_json()

    # OpenAI's first chunk of each choice names the role and carries no text; clients key on it.
    for i in range(len(replies)):
        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
    n_generated = 0
    step: tuple[int, RequestOutput] | None = first
    while step is not None:
        i, out = step
        reply = replies[i]
        n_generated += len(out.token_ids)
        inc = reply.feed(out.text)
        if out.finished:
            inc += reply.finish()
        # Tokens that end mid-character (or text a parser holds back) bring nothing yet; skip them unless
        # they carry logprobs.
        if inc or out.finished or (want_logprobs and out.logprobs):
            logprobs = chat_logprobs(engine.tokenizer, out.logprobs or ()) if want_logprobs else None
            delta = ChatDelta(content=inc.content or None, reasoning_content=inc.reasoning or None,
                              tool_calls=[delta_json(d) for d in inc.calls] or None)
            yield chunk(
                [
                    ChatChunkChoice(
                        index=i,
                        delta=delta,
                        logprobs=logprobs,
                        finish_reason=reply.finish_reason(finish_reason(out)),
                    )
                ]
            )
        step = await anext(choices, None)
    if body.include_usage:
        yield chunk([], usage=usage_of(choices, prompt_len, n_generated))
