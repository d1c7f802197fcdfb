"""`vegaserve serve`: load the model, run the engine's step loop on the main thread and uvicorn beside it.

The step loop owns the main thread because torch's CPU kernels run fastest in the thread that loaded the
model (see engine/async_engine.py); uvicorn's event loop only moves bytes.

Starting: the address is bound before the model loads, so a port in use or an address that is not this
host's stops the start at once, with one line and a non-zero exit; it listens once the model is loaded (until
then connections are refused, not left waiting).

Stopping (SIGTERM, or Ctrl+C): the server stops taking requests (new ones get a 503, so a load balancer
moves on, while the port stays open), lets those in flight finish for up to `server.drain_timeout_s`, then
ends those still running (a stream gets an error event and `[DONE]`, a plain request a 503; one warning line
says how many), stops uvicorn, which stops the step loop, and exits 0. A request still sending its body is
not waited for (server/middleware.py). A second signal stops at once.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import threading
import time

import uvicorn

from vegaserve.engine.async_engine import AsyncEngine
from vegaserve.engine.config import ConfigError, EngineConfig
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.executor import FAILURE_GRACE_S
from vegaserve.engine.gguf_file import ModelLoadError, default_model_path
from vegaserve.server.http_protocol import h11_with_header_deadline
from vegaserve.server.middleware import Drain

log = logging.getLogger(__name__)

# After the cut, how long the streams get to write their error event and [DONE]; then connections still
# open belong to clients that stopped reading, and are closed under them.
CUT_GRACE_S = 0.5
# uvicorn's own bound on waiting for connections after it is told to exit (the drain has waited already).
_UVICORN_GRACE_S = 2
# Once every client is answered, how long the step loop gets to finish the step it is in. A step nobody waits
# for is not worth more: on a busy two-core machine one took 6 s, which would hold the exit far past the
# drain timeout. The process then exits without it (the worker processes of a multi-GPU engine die with it).
_STEP_GRACE_S = 0.5


class GracefulStop:
    """The signal handler. It runs on the main thread, between two engine steps, so it only flips flags
    and leaves the waiting to a thread of its own."""

    def __init__(self, server: uvicorn.Server, drain: Drain, timeout_s: float) -> None:
        self.server = server
        self.drain = drain
        self.timeout_s = timeout_s
        self._waiter: threading.Thread | None = None

    @property
    def stopping(self) -> bool:
        """A signal asked the server to stop."""
        return self._waiter is not None

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
            "%s: refusing new requests, waiting up to %g s for %d in flight",
            signal.Signals(signum).name, self.timeout_s, self.drain.active,
        )
        if self.drain.wait_idle(self.timeout_s):
            log.info("all requests finished; stopping")
        else:
            log.warning("%d request(s) still running after the %g s drain timeout; ending them with an error",
                        self.drain.active, self.timeout_s)
            self.drain.cut()
            if not self.drain.wait_idle(CUT_GRACE_S):
                self._close_connections()
                if not self.drain.wait_idle(CUT_GRACE_S):
                    self.server.force_exit = True
        self.server.should_exit = True

    def _close_connections(self) -> None:
        # uvicorn keeps its connections (the h11 protocol objects) in server_state; closing a transport makes
        # the app's pending write return, so the request ends by itself instead of being cancelled.
        for conn in list(self.server.server_state.connections):
            transport, loop = getattr(conn, "transport", None), getattr(conn, "loop", None)
            if transport is not None and loop is not None:
                try:
                    loop.call_soon_threadsafe(transport.abort)
                except RuntimeError:  # its loop has closed
                    pass


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), not yet listening (uvicorn listens on it); one ConfigError line if the
    address cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses the port
        sock.bind((host, port))
    except (OSError, UnicodeError, OverflowError) as e:  # gaierror is an OSError
        sock.close()
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"cannot listen on {host}:{port}: {reason}") from None
    return sock


class _Server(uvicorn.Server):
    """Says where it serves once it does (uvicorn is quiet about sockets it is given)."""

    announce = ""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            log.info("%s", self.announce)


def load_core(config: EngineConfig, show_progress: bool = True) -> EngineCore:
    """The model, loaded. A file whose header passed the loader's checks but whose tokenizer, chat template
    or hyperparameters cannot be used raises ValueError on the way; that is still a bad model file, so it
    becomes one ModelLoadError line naming the file."""
    try:
        return EngineCore(config, show_progress)
    except (ModelLoadError, ConfigError):
        raise
    except ValueError as e:
        raise ModelLoadError(f"{config.model.path or default_model_path()}: {e}") from e


def run_server(config: EngineConfig) -> int:
    from vegaserve.engine.env import torchrun_rank
    from vegaserve.server.app import create_app

    started = torchrun_rank()
    if started is not None and started[0] != 0:
        # a rank torchrun started on some node: it serves no HTTP, it runs its share of every step
        from vegaserve.engine.executor import run_torchrun_worker

        run_torchrun_worker(config, *started)
        return 0

    s = config.server
    sock = listen_socket(s.host, s.port)
    engine = AsyncEngine(load_core(config), start_loop=False)
    app = create_app(engine, api_key=s.api_key, max_body_bytes=s.max_body_bytes, body_timeout_s=s.body_timeout_s,
                     special_tokens_in_content=s.special_tokens_in_content)
    server = _Server(uvicorn.Config(app, log_level=s.log_level, http=h11_with_header_deadline(s.header_timeout_s),
                                    timeout_graceful_shutdown=_UVICORN_GRACE_S))
    server.announce = f"serving {engine.model_name} on http://{s.host}:{s.port}/v1"
    # What the start allocated (torch, the model, the app: over 200,000 objects) lives as long as the process.
    # Frozen, the collector no longer walks it: a full collection held the GIL for 115 ms, which /health and the
    # step loop waited out; now it takes microseconds.
    gc.freeze()
    stop = GracefulStop(server, app.state.drain, s.drain_timeout_s)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    failure: list[str] = []
    loop_done = threading.Event()

    def serve() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as e:  # noqa: BLE001 - uvicorn's exit on a failed start, or listen() refused
            failure.append(f"{type(e).__name__}: {e}")
        finally:
            engine.shutdown()
        if server.started and stop.stopping and not loop_done.wait(_STEP_GRACE_S):
            log.info("stopped; not waiting for the engine step in progress")
            logging.shutdown()
            os._exit(0)

    front = threading.Thread(target=serve, name="http", daemon=True)
    front.start()
    engine.run_loop()
    loop_done.set()
    if engine.failure is not None:
        # clients hear of it: streams got an error event, new requests a 503; then the process ends non-zero
        log.error("the engine failed (%s); answering 503 for %.0f s, then exiting", engine.failure, FAILURE_GRACE_S)
        time.sleep(FAILURE_GRACE_S)
        server.should_exit = True
        front.join(timeout=5)
        return 1
    if not server.started:
        front.join(timeout=10)
        log.error("could not serve on %s:%d%s", s.host, s.port, f" ({failure[0]})" if failure else "")
        return 1
    server.should_exit = True
    front.join(timeout=10)
    return 0
