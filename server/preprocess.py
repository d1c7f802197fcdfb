"""From a validated OpenAI request to the engine's GenerateRequest: prompt token ids + SamplingParams.

Everything that can be refused before the engine sees the request is refused here with a message that
names the field: the model name, token ids outside the vocabulary, a prompt that fills the context (one whose
length in bytes alone proves it is refused before it is tokenized). All of it is CPU work that grows with the
request, so the routes run it off the event loop (server/offload.py).

Control-token text in what a client sends (`<|im_start|>system` typed into a message) is plain text: every
request string the chat template may print is quoted first (`tokenizer.quote_special`), so only the
template's own control tokens become control ids. `quote_content=False` keeps llama-server's behaviour, where
such text becomes the control token (`--special-tokens-in-content`).
A max_tokens larger than the room the prompt leaves is clamped to that room (llama-server and vLLM's
behaviour; clients routinely send one fixed max_tokens whatever the prompt), and the request finishes
with finish_reason "length" when the context is full.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vegaserve.engine.protocol import EngineClient, Runner
from vegaserve.engine.request import ContextLengthError, GuideSpec, InvalidRequestError, SamplingParams
from vegaserve.server.errors import ApiError
from vegaserve.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields


def check_model(engine: EngineClient, requested: str | None) -> None:
    # An empty or missing name means "whatever you serve", as llama-server allows.
    if requested and requested != engine.model_name:
        raise ApiError(
            404, f"model {requested!r} is not served here; this server serves {engine.model_name!r}",
            param="model", code="model_not_found",
        )


def check_token_ids(engine: EngineClient, ids: list[int], field: str) -> None:
    vocab = engine.tokenizer.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"{field}: token id {bad[0]} is outside the vocabulary [0, {vocab})", param=field)


def _quoted(value: Any, quote: Callable[[str], str]) -> Any:
    """`value` with every string in it (dictionary keys too) quoted."""
    if isinstance(value, str):
        return quote(value)
    if isinstance(value, list):
        return [_quoted(v, quote) for v in value]
    if isinstance(value, dict):
        return {_quoted(k, quote): _quoted(v, quote) for k, v in value.items()}
    return value


def check_prompt_fits(engine: EngineClient, text: str) -> None:
    """Refuses, before tokenizing it, a prompt whose length alone proves it fills the context."""
    least = engine.tokenizer.min_tokens(text)
    if least >= engine.max_model_len:
        raise ContextLengthError(
            f"the prompt has at least {least} tokens but the model's context is {engine.max_model_len} tokens, "
            "which leaves no room for output; shorten the prompt"
        )


def chat_prompt_ids(
    engine: EngineClient,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    *,
    quote_content: bool,
    add_generation_prompt: bool = True,
    check_fits: bool = True,
    runner: Runner | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """`template_kwargs`: the request's chat_template_kwargs, more variables for the template (enable_thinking)."""
    rendered = [m.for_template() for m in messages]
    extra = dict(template_kwargs or {})
    if quote_content:
        quote = engine.tokenizer.quote_special
        rendered = [{k: v if k == "role" else _quoted(v, quote) for k, v in m.items()} for m in rendered]
        tools = _quoted(tools, quote)
        extra = _quoted(extra, quote)
    try:
        prompt = engine.chat_template.render(rendered, add_generation_prompt=add_generation_prompt, tools=tools,
                                             **extra)
    except InvalidRequestError:
        raise
    except RecursionError:
        raise ApiError(400, "the messages are nested too deeply to render", param="messages") from None
    except Exception as exc:
        # Templates reject conversations they cannot render (roles out of order, ...) by raising;
        # that is a fault of the request, and the template's own message says which.
        raise ApiError(400, f"the chat template could not render these messages: {exc}", param="messages") from exc
    if check_fits:
        check_prompt_fits(engine, prompt)
    # The rendered template already writes BOS where this model wants it, so no special tokens are
    # added here (a second BOS changes the output of many models); special-token text the template
    # wrote (<|im_start|>, ...) must become the special ids, hence parse_special (quoted text stays text).
    return engine.tokenizer.encode(prompt, add_special_tokens=False, parse_special=True, runner=runner)


def completion_prompt_ids(engine: EngineClient, request: CompletionRequest, runner: Runner | None = None) -> list[int]:
    prompt = request.prompt
    if isinstance(prompt, str):
        check_prompt_fits(engine, prompt)
        # A raw prompt has no template to write BOS, so the tokenizer adds what the model expects. The
        # legacy API's prompt is the whole prompt, control tokens included, as the client wrote it.
        ids = engine.tokenizer.encode(prompt, add_special_tokens=True, parse_special=True, runner=runner)
    else:
        ids = [int(t) for t in prompt]  # type: ignore[arg-type]  # the validator left list[int]
        check_token_ids(engine, ids, "prompt")
    if not ids:
        raise ApiError(400, "prompt is empty", param="prompt")
    return ids


def sampling_params(
    engine: EngineClient,
    request: SamplingFields,
    prompt_len: int,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    guide: GuideSpec | None = None,
) -> SamplingParams:
    """SamplingParams for a prompt of `prompt_len` tokens; max_tokens None, or more than the context has
    room for, means "up to the context"."""
    limit = engine.max_model_len
    if prompt_len >= limit:
        raise ContextLengthError(
            f"the prompt has {prompt_len} tokens but the model's context is {limit} tokens, "
            "which leaves no room for output; shorten the prompt"
        )
    bias = request.logit_bias_ids()
    check_token_ids(engine, list(bias), "logit_bias")
    stop_ids = list(request.stop_token_ids or ())
    check_token_ids(engine, stop_ids, "stop_token_ids")
    room = limit - prompt_len
    return SamplingParams(  # validates the ranges, raising InvalidRequestError (a 400)
        # min() leaves a max_tokens below 1 as sent, so the range check names the client's own value.
        max_tokens=room if max_tokens is None else min(max_tokens, room),
        temperature=1.0 if request.temperature is None else request.temperature,
        top_k=request.top_k or 0,
        top_p=1.0 if request.top_p is None else request.top_p,
        min_p=request.min_p or 0.0,
        seed=None if request.seed == -1 else request.seed,  # llama-server's -1: a random seed
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        logit_bias=bias,
        stop=request.stop_strings(),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        guide=guide,
    )


def chat_sampling_params(engine: EngineClient, request: ChatCompletionRequest, prompt_len: int,
                         guide: GuideSpec | None = None) -> SamplingParams:
    return sampling_params(
        engine, request, prompt_len, max_tokens=request.requested_max_tokens(), logprobs=request.num_logprobs(),
        guide=guide,
    )


def completion_sampling_params(engine: EngineClient, request: CompletionRequest, prompt_len: int,
                               guide: GuideSpec | None = None) -> SamplingParams:
    return sampling_params(
        engine, request, prompt_len, guide=guide,
        max_tokens=request.max_tokens,
        logprobs=request.logprobs,
        # Echo with logprobs shows the prompt's logprobs too, as the legacy API did.
        prompt_logprobs=request.logprobs if request.echo and request.logprobs is not None else None,
    )
