"""`vegaserve serve`: load the model, build the app, run uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from vegaserve.engine.async_engine import AsyncEngine
from vegaserve.engine.config import EngineConfig

log = logging.getLogger(__name__)


def run_server(config: EngineConfig) -> int:
    from vegaserve.server.app import create_app

    engine = AsyncEngine.from_config(config)
    app = create_app(engine, api_key=config.server.api_key)
    log.info("serving %s on http://%s:%d/v1", engine.model_name, config.server.host, config.server.port)
    try:
        uvicorn.run(app, host=config.server.host, port=config.server.port, log_level=config.server.log_level)
    finally:
        engine.shutdown()
    return 0
