"""The FastAPI application: routes, and the middleware and error handlers around them.

The app holds an EngineClient and nothing else from the engine; `create_app` is the whole assembly, so a
test can build one around a fake engine and a process can build one per model.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from vegaserve.engine.protocol import EngineClient
from vegaserve.server.body import json_response, openapi_body, parse_body
from vegaserve.server.chat import create_chat_completion
from vegaserve.server.completions import create_completion
from vegaserve.server.errors import ApiError, CatchAllMiddleware, install_error_handlers
from vegaserve.server.metrics import ServerMetrics
from vegaserve.server.middleware import (
    DEFAULT_MAX_BODY_BYTES,
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    Drain,
    DrainMiddleware,
)
from vegaserve.server.preprocess import check_token_ids
from vegaserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenPiece,
)


def create_app(
    engine: EngineClient, *, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> FastAPI:
    app = FastAPI(title="vegaserve", summary="OpenAI-compatible GGUF inference server")
    metrics = ServerMetrics(engine)
    started = int(time.time())
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.drain = Drain()  # serve_cmd closes it on SIGTERM

    install_error_handlers(app)
    # add_middleware wraps what is there, so the last added runs first: the drain gate outermost, so a
    # request counts until its error response too is sent; then errors, so that also catches failures
    # of the key check and the size limit.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(CatchAllMiddleware)
    app.add_middleware(DrainMiddleware, drain=app.state.drain)

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        return await create_chat_completion(engine, metrics, request, body)

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        return await create_completion(engine, metrics, request, body)

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(id=engine.model_name, created=started, max_model_len=engine.max_model_len)
        return json_response(ModelList(data=[card]))

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return ApiError(503, "the engine is not running", type="service_unavailable_error").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        content, content_type = metrics.render()
        return Response(content, media_type=content_type)

    @app.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        body = await parse_body(request, TokenizeRequest)
        ids = engine.tokenizer.encode(body.content, add_special_tokens=body.add_special, parse_special=True)
        tokens: list[int] | list[TokenPiece] = ids
        if body.with_pieces:
            tokens = [TokenPiece(id=t, piece=_piece(engine, t)) for t in ids]
        return json_response(TokenizeResponse(tokens=tokens))

    @app.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        body = await parse_body(request, DetokenizeRequest)
        check_token_ids(engine, body.tokens, "tokens")
        text = engine.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return json_response(DetokenizeResponse(content=text))

    return app


def _piece(engine: EngineClient, token_id: int) -> str | list[int]:
    # As llama-server does: the text when the token is whole UTF-8, else its bytes, which a client can
    # join with its neighbours' bytes.
    raw = engine.tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)
