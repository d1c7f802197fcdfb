"""One engine request as the routes drive it: measured, and aborted whenever the client stops listening.

`Generation` wraps `engine.generate()`; `close()` is the single place a request ends early: it closes the
engine's iterator and calls `engine.abort`, shielded from the cancellation that usually triggers it (a
client disconnect cancels the task that was reading outputs). `until_disconnect` lets a route that is not
streaming yet notice the client leaving, since nothing is being sent that could fail.

A shutdown whose drain timed out cuts the requests still running (`Drain.cut`): each wait for the engine's
next output also waits on the cut, which raises ServerShuttingDown, so a stream ends with an error event and
`[DONE]` and a plain request with a 503, instead of being cancelled under the server's feet.

`Choices` is what the routes drive: OpenAI's `n` choices of one response, one Generation each (the same
prompt, their own samplers), their outputs as (choice index, output) in the order the engine gives them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.requests import Request

from vegaserve.engine.protocol import EngineClient
from vegaserve.engine.request import EngineError, GenerateRequest, RequestOutput
from vegaserve.server.errors import ClientDisconnected, ServerShuttingDown
from vegaserve.server.metrics import RequestMetrics, ServerMetrics
from vegaserve.server.middleware import Drain

logger = logging.getLogger("vegaserve.server")

T = TypeVar("T")

# Cleanup runs shielded from cancellation, so it needs its own deadline: an engine that hangs in
# abort() must not hold a finished connection forever.
_CLEANUP_TIMEOUT_S = 10.0


class Generation:
    """The outputs of one GenerateRequest; iterate it, and always `await close()` at the end."""

    def __init__(
        self, engine: EngineClient, request: GenerateRequest, metrics: ServerMetrics, drain: Drain | None = None
    ) -> None:
        self.request = request
        self._engine = engine
        self._timer: RequestMetrics = metrics.track()
        self._outputs: AsyncIterator[RequestOutput] = engine.generate(request)
        self.finished = False  # the engine delivered the output with finish_reason
        self._failed = False  # the engine raised: it has ended the request itself, nothing to abort
        self._closed = False
        self.last: RequestOutput | None = None
        self._drain = drain
        self._cut: asyncio.Event | None = drain.cut_event() if drain is not None else None
        self._cut_wait: asyncio.Future[bool] | None = None  # one waiter on the cut for the request's life
        self._step: asyncio.Future[RequestOutput] | None = None  # the wait for the engine's next output

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        try:
            out = await (self._outputs.__anext__() if self._cut is None else self._next_unless_cut(self._cut))
        except ServerShuttingDown:
            raise
        except EngineError:
            self._failed = True
            raise
        self._timer.on_output(out)
        self.last = out
        self.finished = out.finished
        return out

    async def _next_unless_cut(self, cut: asyncio.Event) -> RequestOutput:
        if self._cut_wait is None:
            self._cut_wait = asyncio.ensure_future(cut.wait())
        step = self._step = asyncio.ensure_future(self._outputs.__anext__())
        try:
            await asyncio.wait((step, self._cut_wait), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not step.done():  # cut, or this task cancelled: the engine's iterator ends (and aborts)
                step.cancel()
        if not step.done():
            raise ServerShuttingDown
        return step.result()

    async def close(self) -> None:
        """Idempotent. Aborts the request in the engine unless it finished or the engine failed it."""
        if self._closed:
            return
        self._closed = True
        if self._cut_wait is not None:
            self._cut_wait.cancel()
        if self._drain is not None and self._cut is not None:
            self._drain.forget(self._cut)
        with anyio.move_on_after(_CLEANUP_TIMEOUT_S, shield=True) as scope:
            if self._step is not None and not self._step.done():
                # a cancelled wait for the engine is still running its iterator; it ends at its next step
                await asyncio.wait((self._step,))
            if self.finished:
                await self._run_to_end()
            aclose = getattr(self._outputs, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:
                    logger.warning("closing the engine stream of %s failed", self.request_id, exc_info=True)
            if not (self.finished or self._failed):
                self._timer.finish("abort")
                await self._engine.abort(self.request_id)
        if scope.cancelled_caught:
            logger.warning("cleanup of %s took longer than %.0f s; left behind", self.request_id, _CLEANUP_TIMEOUT_S)

    async def _run_to_end(self) -> None:
        # After its last output the engine's iterator is still suspended at that yield; closing it there
        # would look like a client leaving early (an abort) to the engine, so let it end by itself.
        try:
            async for extra in self._outputs:
                logger.warning("engine sent output after the finish of %s: %r", self.request_id, extra)
        except Exception:
            logger.warning("the engine stream of %s failed after its finish", self.request_id, exc_info=True)


class Choices:
    """The n choices of one response, each its own engine request (`{id}-{i}` past the first; a seed given
    becomes seed + i, so sampled choices differ and repeat): iterate (index, output) pairs, and always
    `await close()` at the end, which ends every one."""

    def __init__(self, engine: EngineClient, request: GenerateRequest, n: int, metrics: ServerMetrics,
                 drain: Drain | None = None) -> None:
        def member(i: int) -> GenerateRequest:
            if i == 0:
                return request
            seed = request.params.seed
            params = request.params if seed is None else dataclasses.replace(request.params, seed=(seed + i) % 2**64)
            return dataclasses.replace(request, params=params, request_id=f"{request.request_id}-{i}")

        self.request_id = request.request_id
        self.members = [Generation(engine, member(i), metrics, drain) for i in range(n)]
        self._next: dict[int, asyncio.Future[RequestOutput]] = {}  # each unfinished choice's wait (n > 1)

    def __aiter__(self) -> Choices:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if len(self.members) == 1:  # (no task a token where there is nothing to merge)
            return 0, await self.members[0].__anext__()
        if not self._next:
            self._next = {i: asyncio.ensure_future(g.__anext__()) for i, g in enumerate(self.members) if not g.finished}
        while self._next:
            await asyncio.wait(self._next.values(), return_when=asyncio.FIRST_COMPLETED)
            i = min(i for i, f in self._next.items() if f.done())  # (the lowest index first where several are)
            try:
                out = self._next.pop(i).result()
            except StopAsyncIteration:
                continue
            if not out.finished:
                self._next[i] = asyncio.ensure_future(self.members[i].__anext__())
            return i, out
        raise StopAsyncIteration

    def num_generated(self) -> int | None:
        """The engine's count of tokens generated over every choice, None where it gave none."""
        counts = [g.last.num_generated_tokens if g.last is not None else 0 for g in self.members]
        return sum(counts) if all(counts) else None

    def num_prompt(self) -> int | None:
        last = self.members[0].last
        return last.num_prompt_tokens if last is not None and last.num_prompt_tokens else None

    async def close(self) -> None:
        """Idempotent: ends every choice (aborting those not finished)."""
        waits, self._next = list(self._next.values()), {}
        for f in waits:
            f.cancel()
        if waits:
            with anyio.move_on_after(_CLEANUP_TIMEOUT_S, shield=True):
                await asyncio.wait(waits)
        for g in self.members:
            await g.close()


async def until_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Runs `work()`; if the client disconnects first, cancels it and raises ClientDisconnected.

    Reads `receive` directly, which is only safe once the body has been read (the routes parse it first).
    """
    gone = False
    result: T
    error: Exception | None = None
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            nonlocal gone
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    gone = True
                    group.cancel_scope.cancel()
                    return

        group.start_soon(watch)
        try:
            result = await work()
        except Exception as exc:  # re-raised below, outside the task group, so it is not wrapped
            error = exc
        group.cancel_scope.cancel()
    if gone:
        raise ClientDisconnected
    if error is not None:
        raise error
    return result


async def collect(request: Request, choices: Choices) -> list[list[RequestOutput]]:
    """All outputs of a non-streaming request, per choice; aborts them if the client leaves while they run."""

    async def drain() -> list[list[RequestOutput]]:
        outputs: list[list[RequestOutput]] = [[] for _ in choices.members]
        async for i, out in choices:
            outputs[i].append(out)
        return outputs

    try:
        return await until_disconnect(request, drain)
    finally:
        await choices.close()
