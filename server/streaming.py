"""Server-sent events for chat and completions: start a stream, end it with `data: [DONE]`.

A stream starts only once the engine has produced its first output, so a request the engine refuses
(InvalidRequestError, ContextLengthError) still gets a proper 4xx instead of a 200 followed by an error
event. After that, errors can only travel inside the stream, as an event in the error envelope: an engine
failure, or a shutdown that cut the stream at its drain timeout (server/generation.py); either way the
stream still ends with `[DONE]`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.requests import Request

from vegaserve.engine.request import EngineError, RequestOutput
from vegaserve.server.errors import ApiError, from_engine_error
from vegaserve.server.generation import Choices, until_disconnect
from vegaserve.server.protocol import UsageInfo

logger = logging.getLogger("vegaserve.server")

DONE = "[DONE]"
# Keep-alive comments for proxies that cut idle connections during a long prefill; clients skip them.
_PING_INTERVAL_S = 15


def usage_of(choices: Choices, prompt_len: int, completion_tokens: int) -> UsageInfo:
    """Usage from the engine's own counts on each choice's last output (the prompt once, the tokens of every
    choice); the server's counts stand in only when an engine left them at zero."""
    return UsageInfo.of(choices.num_prompt() or prompt_len, choices.num_generated() or completion_tokens)


def finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason.value if out.finish_reason is not None else None


async def _first_output(choices: Choices) -> tuple[int, RequestOutput]:
    first = await anext(choices, None)
    if first is None:
        raise ApiError(500, "the engine ended the request without any output", type="server_error")
    return first


async def _events_then_done(events: AsyncIterator[str], generation: Choices) -> AsyncIterator[str]:
    """Every stream ends with [DONE]; a failure mid-stream is sent as an error event first."""
    try:
        async for event in events:
            yield event
    except EngineError as exc:
        yield json.dumps(from_engine_error(exc).body())
    except Exception:
        logger.exception("stream of %s failed", generation.request_id)
        yield json.dumps(ApiError(500, "internal server error", type="server_error").body())
    except BaseException:  # cancelled, or closed at a yield: the client went away mid-stream
        logger.info("stream of %s: the client went away", generation.request_id)
        raise
    finally:
        # Closing here (not only in the background task) frees the engine's slot as soon as the
        # events stop, whatever stopped them: the end, an error, or a disconnect's cancellation.
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
        await generation.close()
    yield DONE


async def start_stream(
    http: Request, generation: Choices, events_from: Callable[[tuple[int, RequestOutput]], AsyncIterator[str]]
) -> EventSourceResponse:
    """Waits for the first output of any choice (aborting if the client leaves meanwhile), then streams the
    events `events_from((index, first))` yields, each one JSON text."""
    try:
        first = await until_disconnect(http, lambda: _first_output(generation))
    except BaseException:
        await generation.close()
        raise
    return EventSourceResponse(
        _events_then_done(events_from(first), generation),
        sep="\n",
        ping=_PING_INTERVAL_S,
        # Runs even when the body never started (a disconnect right after the headers).
        background=BackgroundTask(generation.close),
    )
