"""A request's CPU work off the event loop: parsing its body, rendering the chat template, tokenizing, and
writing a large response.

The event loop must stay free for /health and for the streams it is writing: run on the loop, an 8 MB
/tokenize held /health for 20 s and stalled a running stream for 24 s. Requests take one of two lanes of
worker threads by body size, so huge bodies queue behind each other while ordinary requests keep their turn:

    regular  bodies up to BULK_BYTES: REGULAR_THREADS threads
    bulk     larger bodies: BULK_THREADS threads, whose tokenizing runs on one thread at nice BULK_NICE

Tokenizing a huge text is seconds of one core. At nice 19 (Linux gives a thread its own nice value) it gets
the cores the decode steps leave, not theirs: on this project's two-core test machine a busy loop at nice 0
beside a stream tripled its inter-token gap, at nice 19 it added a third. Only the tokenizers call runs
there, because it holds no GIL: a low-priority thread that held the GIL would hold up every thread behind it
while it waited for a core (a 2 s stall of the stream, measured). The rest, which holds the GIL, runs at
normal priority in short pieces (response bodies are written in slices, `json_array`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, TypeVar

log = logging.getLogger("vegaserve.server")

T = TypeVar("T")

BULK_BYTES = 256 * 1024  # a chat body this size renders and tokenizes in about 0.1 s of one core
REGULAR_THREADS = 2
BULK_THREADS = 2
BULK_NICE = 19
_SLICE = 1 << 14  # elements per GIL-holding call when writing a long JSON array


def _lower_priority(nice: int) -> None:
    if sys.platform != "linux":
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)  # this thread only, on Linux
    except OSError as e:
        log.debug("cannot lower the priority of the bulk worker thread: %s", e)


class _Threads:
    """A fixed set of daemon threads taking work from one queue. Not ThreadPoolExecutor: Python joins its
    threads at exit, so a huge text still being tokenized would hold the process past its drain timeout."""

    def __init__(self, n: int, name: str, initializer: Callable[[], None] | None = None) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, args=(initializer,), name=f"{name}-{i}", daemon=True)
                         for i in range(n)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        self._queue.put((future, lambda: fn(*args, **kwargs)))
        return future

    def _work(self, initializer: Callable[[], None] | None) -> None:
        if initializer is not None:
            initializer()
        while (item := self._queue.get()) is not None:
            self._run(*item)
            item = None  # the future holds the result (a huge text's tokens): not kept here until the next job

    @staticmethod
    def _run(future: Future[Any], work: Callable[[], Any]) -> None:
        if not future.set_running_or_notify_cancel():  # cancelled while queued: its client left
            return
        try:
            future.set_result(work())
        except BaseException as e:  # noqa: BLE001 - handed to whoever awaits the future
            future.set_exception(e)

    def shutdown(self) -> None:
        for _ in self._threads:
            self._queue.put(None)


class Workers:
    """The two lanes. `await workers.run(size, fn, *args)` runs fn(*args, runner=...) on the lane `size`
    picks; `runner` is what fn hands the tokenizer (engine/tokenizer.py's `encode(..., runner)`): None on
    the regular lane, the low-priority thread on the bulk lane."""

    def __init__(self) -> None:
        self._regular = _Threads(REGULAR_THREADS, "front-cpu")
        self._bulk = _Threads(BULK_THREADS, "front-bulk")
        self._tokenize = _Threads(1, "front-tokenize", initializer=lambda: _lower_priority(BULK_NICE))

    def _low_priority(self, work: Callable[[], T]) -> T:
        return self._tokenize.submit(work).result()  # from a bulk thread, which waits without the GIL

    async def run(self, size: int, fn: Callable[..., T], *args: object) -> T:
        bulk = size > BULK_BYTES
        runner = self._low_priority if bulk else None
        # wrap_future: a request cancelled while queued (its client left) is taken off the queue
        return await asyncio.wrap_future((self._bulk if bulk else self._regular).submit(fn, *args, runner=runner))

    def shutdown(self) -> None:
        for pool in (self._regular, self._bulk, self._tokenize):
            pool.shutdown()


def json_array(items: list[object], item: Callable[[object], str] = str) -> Iterable[str]:
    """A JSON array of `items` in pieces, `item` writing each one; joined by the caller. Written in slices
    so that no single call holds the GIL for long (one json.dumps of two million ids held it for 0.1 s)."""
    yield "["
    for start in range(0, len(items), _SLICE):
        if start:
            yield ","
        yield ",".join(map(item, items[start : start + _SLICE]))
    yield "]"
