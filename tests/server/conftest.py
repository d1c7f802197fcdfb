"""Fixtures for the HTTP front: a fake engine, an app around it, and clients for that app."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import uvicorn
from fastapi.testclient import TestClient

from vegaserve.server.app import create_app


def _load_fake_engine() -> ModuleType:
    # The suite runs with --import-mode=importlib (no sys.path changes, no __init__.py in tests), so a
    # helper module beside the tests is loaded by path.
    name = "vegaserve_tests_server_fake_engine"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("fake_engine.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def fake() -> ModuleType:
    """The fake_engine module: FakeEngine, answer(), fake_logprob(), SPECIALS, ..."""
    return _load_fake_engine()


@pytest.fixture
def engine(fake: ModuleType):  # -> fake.FakeEngine
    return fake.FakeEngine()


@pytest.fixture
def client(engine) -> Iterator[TestClient]:
    with TestClient(create_app(engine)) as test_client:
        yield test_client


class LiveServer:
    """A uvicorn server on a free localhost port, in a thread: the real HTTP path the SDK uses."""

    def __init__(self, app) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    @property
    def base_url(self) -> str:
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="session")
def serve() -> type[LiveServer]:
    """`with serve(app) as server:` runs the app on a free port; server.base_url reaches it."""
    return LiveServer


@pytest.fixture(scope="module")
def live(fake: ModuleType) -> Iterator[tuple[LiveServer, object]]:
    """(server, its fake engine), shared by a module's SDK tests."""
    engine = fake.FakeEngine()
    with LiveServer(create_app(engine)) as server:
        yield server, engine
