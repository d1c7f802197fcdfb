"""`vegaserve serve`: load the model, run the engine's step loop on the main thread and uvicorn beside it.

The step loop owns the main thread because torch's CPU kernels run fastest in the thread that loaded the
model (see engine/async_engine.py); uvicorn's event loop only moves bytes. Ctrl+C or SIGTERM stops the
server, which then stops the loop.
"""

from __future__ import annotations

import logging
import signal
import threading

import uvicorn

from vegaserve.engine.async_engine import AsyncEngine
from vegaserve.engine.config import EngineConfig
from vegaserve.engine.engine_core import EngineCore

log = logging.getLogger(__name__)


def run_server(config: EngineConfig) -> int:
    from vegaserve.server.app import create_app

    engine = AsyncEngine(EngineCore(config), start_loop=False)
    app = create_app(engine, api_key=config.server.api_key, max_body_bytes=config.server.max_body_bytes)
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.server.host, port=config.server.port, log_level=config.server.log_level)
    )

    def stop(*_: object) -> None:
        server.should_exit = True

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
    server.should_exit = True
    front.join(timeout=10)
    return 0 if server.started or not front.is_alive() else 1
