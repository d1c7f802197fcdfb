"""The FastAPI application: routes, and the middleware and error handlers around them.

The app holds an EngineClient and nothing else from the engine; `create_app` is the whole assembly, so a
test can build one around a fake engine and a process can build one per model.

Each POST route reads its body on the event loop and does the rest of its CPU work (parsing, the chat
template, tokenizing) on the app's worker threads (server/offload.py), so that /health and the running
streams never wait behind a large request.
"""

from __future__ import annotations

import time

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from vegaserve.engine.protocol import EngineClient
from vegaserve.server.body import json_response, openapi_body, read_body
from vegaserve.server.chat import create_chat_completion, prepare_chat
from vegaserve.server.completions import create_completion, prepare_completion
from vegaserve.server.errors import ApiError, CatchAllMiddleware, install_error_handlers
from vegaserve.server.metrics import ServerMetrics
from vegaserve.server.middleware import (
    DEFAULT_MAX_BODY_BYTES,
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    Drain,
    DrainMiddleware,
    UploadDeadlineMiddleware,
)
from vegaserve.server.offload import Workers
from vegaserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from vegaserve.server.tokenize import detokenize, tokenize

DEFAULT_BODY_TIMEOUT_S = 60.0


def create_app(
    engine: EngineClient,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    special_tokens_in_content: bool = False,
) -> FastAPI:
    """special_tokens_in_content: control-token text in request strings becomes control tokens, as in
    llama-server (off: it is plain text, as in OpenAI's API; server/preprocess.py)."""
    workers = Workers()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        workers.shutdown()

    app = FastAPI(title="vegaserve", summary="OpenAI-compatible GGUF inference server", lifespan=lifespan)
    metrics = ServerMetrics(engine)
    started = int(time.time())
    quote = not special_tokens_in_content
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.drain = Drain()  # serve_cmd closes it on SIGTERM, and cuts what still runs at its timeout

    install_error_handlers(app)
    # add_middleware wraps what is there, so the last added runs first: the drain gate outermost, so a
    # request counts until its error response too is sent; then errors, so that also catches failures
    # of the key check and the size limit.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(UploadDeadlineMiddleware, timeout_s=body_timeout_s, drain=app.state.drain)
    app.add_middleware(CatchAllMiddleware)
    app.add_middleware(DrainMiddleware, drain=app.state.drain)

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        raw = await read_body(request)
        prepared = await workers.run(len(raw), prepare_chat, engine, raw, quote)
        return await create_chat_completion(engine, metrics, request, prepared)

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        raw = await read_body(request)
        prepared = await workers.run(len(raw), prepare_completion, engine, raw)
        return await create_completion(engine, metrics, request, prepared)

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
    async def tokenize_route(request: Request) -> Response:
        raw = await read_body(request)
        return await workers.run(len(raw), tokenize, engine, raw, quote)

    @app.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize_route(request: Request) -> Response:
        raw = await read_body(request)
        return await workers.run(len(raw), detokenize, engine, raw)

    return app
