"""AsyncEngine: the asyncio face of EngineCore, one output queue per request.

The core's step loop and the HTTP front's event loop run in two threads of one process. torch releases the
GIL inside its kernels, so the front keeps accepting and streaming while a step computes; a process would
add a copy of every output across a pipe for no gain on one host (see docs/ARCHITECTURE.md).

`vegaserve serve` runs the step loop on the main thread (`run_loop`) and uvicorn on a second one: on the
CPU path, torch's kernels measured 1.7x slower in a thread other than the one that loaded the model.
Tests let the loop start its own thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

import torch

from vegaserve.engine.config import EngineConfig
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.protocol import EngineStats
from vegaserve.engine.request import EngineDeadError, EngineError, GenerateRequest, RequestOutput

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, core: EngineCore, start_loop: bool = True) -> None:
        self.core = core
        self.model_name = core.model_name
        self.max_model_len = core.max_model_len
        self.tokenizer = core.tokenizer
        self.chat_template = core.chat_template
        self.grammars = core.grammars  # the server compiles requests' grammars with it, off the event loop
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self._stopping = False
        self._running = False
        self._thread: threading.Thread | None = None
        workers = core.executor.workers
        if workers is not None:  # several processes: a worker's death ends the engine (engine/executor.py)
            workers.callbacks.append(self._worker_died)
        if start_loop:
            self._thread = threading.Thread(target=self.run_loop, name="engine-core", daemon=True)
            self._running = True
            self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, show_progress: bool = True) -> AsyncEngine:
        return cls(EngineCore(config, show_progress))

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._running

    @property
    def failure(self) -> BaseException | None:
        """Why the engine stopped, when it did not stop on request."""
        return self._dead

    def stats(self) -> EngineStats:
        return self.core.stats()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if not self.is_alive:
            raise EngineDeadError("the engine has stopped; no new requests are served")
        self.core.check(request)  # raise before the first output: the server answers 4xx, not a broken stream
        rid = request.request_id
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._queues[rid] = (asyncio.get_running_loop(), q)
        self._post("add", request)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._queues.pop(rid, None)
            if not finished:
                self._post("abort", rid)

    async def abort(self, request_id: str) -> None:
        self._post("abort", request_id)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _worker_died(self, msg: str) -> None:
        """From the executor's monitor thread: fail every stream now; new requests get a 503."""
        self._dead = EngineDeadError(msg)
        self._stopping = True
        self._fail_all(f"the engine failed: {msg}")

    def _fail_all(self, msg: str) -> None:
        with self._lock:
            rids = list(self._queues)
        for rid in rids:
            self._deliver(rid, EngineDeadError(msg))

    # -- the loop thread --------------------------------------------------------------------------------
    def _post(self, kind: str, payload: object) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            target = self._queues.get(rid)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.core.add_request(payload)  # type: ignore[arg-type]
                except EngineError as e:
                    self._deliver(payload.request_id, e)  # type: ignore[union-attr]
            else:
                self.core.abort(payload)  # type: ignore[arg-type]

    def run_loop(self) -> None:
        """The step loop; returns after shutdown() or a failure. Runs in whichever thread calls it: on a CPU,
        best the one that loaded the model (the server's main thread), else with one torch thread (below)."""
        self._running = True
        elsewhere = threading.get_ident() != self.core.loaded_on
        if self.core.device.type == "cpu" and elsewhere and torch.get_num_threads() > 1:
            # OpenMP (libgomp) keeps a pool of workers per thread that runs parallel ops; with the loading
            # thread's pool alive, a second one holds more threads than cores, and libgomp then lets its
            # workers sleep between ops instead of spinning: every parallel op waits for a wake-up. Measured
            # on 2 cores, SmolLM2's decode step: 15 ms on the loading thread, 28-36 ms with 2 threads on another,
            # 20 ms with 1 thread there (no second pool). Threads started later take torch's count: put back at the end.
            log.info("engine loop on a thread other than the model's loader: one torch thread for its CPU ops")
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                self._loop()
            finally:
                torch.set_num_threads(threads)
        else:
            self._loop()

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.core.has_work:
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                for out in self.core.step():
                    self._deliver(out.request_id, out)
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine; every waiter hears of it
            log.exception("engine loop failed")
            if self._dead is None:
                self._dead = e
            self._fail_all(f"the engine failed: {type(e).__name__}: {e}")
        finally:
            self._running = False
            if self._dead is None:
                self.core.close()  # the other ranks stop with the loop (a dead peer: the monitor ends it)
