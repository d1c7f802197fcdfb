"""The OpenAI wire format we serve, as pydantic v2 models.

Requests ignore fields they do not know (the OpenAI SDKs send some we have no use for), and are strict about
the types of those they know, as OpenAI's schema is: `"max_tokens": "2"` or `prompt: [true, false]` is a 400,
not a 2 or [1, 0] (an integer is still a valid number where a float is asked for). Ranges that
`SamplingParams` already checks (temperature, top_p, penalties, ...) are left to it, so each rule lives in
one place; the models here check only the shape of the JSON and what the HTTP API itself limits (n,
top_logprobs, legacy logprobs, suffix). Validation failures become 400s in `server/errors.py`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Request(BaseModel):
    # inf/nan never reach the engine: a JSON body cannot hold them anyway (our parser refuses the
    # non-standard NaN/Infinity literals), and this keeps direct construction honest too.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True, populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type json_schema needs json_schema.schema")
        return self


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


MAX_CHOICES = 128  # choices a request may ask for (n)


class SamplingFields(_Request):
    """Fields chat and completions share: OpenAI's, then the llama-server / vLLM extras."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # -1: a random seed, as in llama-server
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # what the output must match (server/structured.py): OpenAI's, llama-server's, vLLM's; one at most
    response_format: ResponseFormat | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("n")
    @classmethod
    def _choices(cls, n: int) -> int:
        # each choice is its own engine request (server/generation.py Choices), so n is bounded like a batch
        if not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"n must be between 1 and {MAX_CHOICES}, got {n}")
        return n

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            try:
                int(key)
            except ValueError:
                raise ValueError(f"keys must be token ids written as strings, got {key!r}") from None
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"bias for token {key} must be in [-100, 100], got {value}")
        return bias

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# ---- chat completions ---------------------------------------------------------------------------------


class ChatMessage(BaseModel):
    # Extra keys (tool_calls, tool_call_id, reasoning_content, ...) are kept and handed to the chat
    # template, which is where models expect them; the template renders in a sandbox.
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if isinstance(content, list):
            for part in content:
                if part.get("type") != "text":
                    raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
                if not isinstance(part.get("text"), str):
                    raise ValueError("a text content part needs a string 'text'")
        return content

    def text(self) -> str | None:
        """The content as one string: list parts joined by newlines, as most chat templates expect a
        string and newline keeps separately written parts apart."""
        if isinstance(self.content, list):
            return "\n".join(part["text"] for part in self.content)
        return self.content

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it. `developer` is OpenAI's newer name for `system`,
        which is the only one the templates in GGUF files know."""
        message = self.model_dump(exclude_none=True)
        message["role"] = "system" if self.role == "developer" else self.role
        message["content"] = self.text() or ""
        # OpenAI sends a call's arguments as JSON text; templates print them with `| tojson` (HF's convention
        # is an object), which would encode the text a second time: they get the object, as vLLM gives them
        for call in message.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    args = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    continue
                if isinstance(args, dict):
                    call["function"] = {**fn, "arguments": args}
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, as OpenAI's default
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables (enable_thinking, ...)
    # llama-server's field: "none" leaves a reply's <think>...</think> in content; "auto" and "deepseek" split it
    # into reasoning_content (the default, where the template reasons). gpt-oss's channels are always split.
    reasoning_format: Literal["auto", "deepseek", "none"] = "auto"

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        return self

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's newer name; it wins when a client sends both.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class ChatLogprobAlternative(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobEntry(ChatLogprobAlternative):
    top_logprobs: list[ChatLogprobAlternative]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry]
    refusal: list[ChatLogprobEntry] | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the reply is only tool calls, as OpenAI sends it
    reasoning_content: str | None = None  # the model's reasoning (<think>, harmony's analysis), vLLM's name
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None or k == "content"}


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's deltas: index, then id/type/name or arguments

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A delta lists only what changed: the last chunk's delta is {} rather than nulls.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


# ---- legacy completions -------------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # the legacy API's default, unlike chat's "up to the context"
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
        # A batch of prompts would need n choices per response; we serve one prompt per request.
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(f"exactly one prompt per request is supported, got {len(prompt)}")
            return prompt[0]
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be empty")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> None:
        if suffix:
            raise ValueError("suffix is not supported")
        return None

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, best_of: int | None) -> int | None:
        if best_of is not None and best_of != 1:
            raise ValueError(f"only best_of=1 is supported, got {best_of}")
        return best_of


class CompletionLogprobs(BaseModel):
    """The legacy shape: parallel lists, one entry per token; the first prompt token has no logprob."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---- models, tokenizer, errors ------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "vegaserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    """llama-server's /tokenize body, or vLLM's chat form: `messages` (and `tools`) tokenized exactly as
    /v1/chat/completions would tokenize them, template and all."""

    content: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special: bool = False
    with_pieces: bool = False

    @model_validator(mode="after")
    def _content_or_messages(self) -> TokenizeRequest:
        if (self.content is None) == (self.messages is None):
            raise ValueError("give either content (text) or messages (a chat), not both or neither")
        return self


class DetokenizeRequest(_Request):
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    content: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
