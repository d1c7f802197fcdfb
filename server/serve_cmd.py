"""`vegaserve serve`: load the model, run the engine's step loop on the main thread and uvicorn beside it.

The step loop owns the main thread because torch's CPU kernels run fastest in the thread that loaded the
model (see engine/async_engine.py); uvicorn's event loop only moves bytes.

Stopping (SIGTERM, or Ctrl+C): the server stops taking requests (new ones get a 503, so a load balancer
moves on, while the port stays open), lets those in flight finish for up to `server.drain_timeout_s`,
then stops uvicorn, which stops the step loop, and exits 0. A second signal stops at once.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import uvicorn

from vegaserve.engine.async_engine import AsyncEngine
from vegaserve.engine.config import EngineConfig
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.executor import FAILURE_GRACE_S
from vegaserve.server.middleware import Drain

log = logging.getLogger(__name__)


class GracefulStop:
    """The signal handler. It runs on the main thread, between two engine steps, so it only flips flags
    and leaves the waiting to a thread of its own."""

    def __init__(self, server: uvicorn.Server, drain: Drain, timeout_s: float) -> None:
        self.server = server
        self.drain = drain
        self.timeout_s = timeout_s
        self._waiter: threading.Thread | None = None

    def __call__(self, signum: int, _frame: object = None) -> None:
        if self._waiter is not None:  # the second signal: whoever sends it wants the process gone now
            self.server.force_exit = True
            self.server.should_exit = True
            return
        self.drain.close()
        self._waiter = threading.Thread(target=self._wait_then_stop, args=(signum,), name="drain", daemon=True)
        self._waiter.start()

    def _wait_then_stop(self, signum: int) -> None:
        log.info(
            "%s: refusing new requests, waiting up to %.0f s for %d in flight",
            signal.Signals(signum).name, self.timeout_s, self.drain.active,
        )
        if self.drain.wait_idle(self.timeout_s):
            log.info("all requests finished; stopping")
        else:
            log.warning("%d request(s) still running after %.0f s; cutting them off", self.drain.active, self.timeout_s)
            self.server.force_exit = True  # uvicorn would otherwise wait for those connections to close
        self.server.should_exit = True


def run_server(config: EngineConfig) -> int:
    from vegaserve.engine.env import torchrun_rank
    from vegaserve.server.app import create_app

    started = torchrun_rank()
    if started is not None and started[0] != 0:
        # a rank torchrun started on some node: it serves no HTTP, it runs its share of every step
        from vegaserve.engine.executor import run_torchrun_worker

        run_torchrun_worker(config, *started)
        return 0

    engine = AsyncEngine(EngineCore(config), start_loop=False)
    app = create_app(engine, api_key=config.server.api_key, max_body_bytes=config.server.max_body_bytes)
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.server.host, port=config.server.port, log_level=config.server.log_level)
    )
    stop = GracefulStop(server, app.state.drain, config.server.drain_timeout_s)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)

    def serve() -> None:
        try:
            server.run()
        finally:
            engine.shutdown()

    front = threading.Thread(target=serve, name="http", daemon=True)
    front.start()
    log.info("serving %s on http://%s:%d/v1", engine.model_name, config.server.host, config.server.port)
    engine.run_loop()
    if engine.failure is not None:
        # clients hear of it: streams got an error event, new requests a 503; then the process ends non-zero
        log.error("the engine failed (%s); answering 503 for %.0f s, then exiting", engine.failure, FAILURE_GRACE_S)
        time.sleep(FAILURE_GRACE_S)
        server.should_exit = True
        front.join(timeout=5)
        return 1
    server.should_exit = True
    front.join(timeout=10)
    return 0 if server.started or not front.is_alive() else 1
