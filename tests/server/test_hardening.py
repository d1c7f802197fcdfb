"""Issue 6's hardening points, each against the layer that holds it: the body limit and the drain gate
over real HTTP, the API key compared in constant time, the default bind, and chat templates from a hostile
GGUF rendered in the sandbox while the real engine serves them."""

from __future__ import annotations

import asyncio
import hmac
import threading
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

import vegaserve.server.cli as cli
import vegaserve.server.middleware as middleware
from vegaserve.engine.async_engine import AsyncEngine
from vegaserve.engine.config import ConfigError, EngineConfig, ServerConfig
from vegaserve.engine.engine_core import EngineCore
from vegaserve.engine.env import SWITCHES
from vegaserve.server.app import create_app
from vegaserve.server.middleware import Drain

CHAT = "/v1/chat/completions"
GOOD_CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def assert_envelope(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# -- body size limit ------------------------------------------------------------------------------------


def test_body_over_the_limit_is_a_413_envelope_over_real_http_declared_or_chunked(fake, serve):
    engine = fake.FakeEngine()
    with serve(create_app(engine, max_body_bytes=1000)) as server:
        url = server.base_url + "/v1/completions"
        declared = httpx.post(url, json={"prompt": "x" * 2000})
        assert assert_envelope(declared, 413)["code"] == "body_too_large"

        def chunks():  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            for _ in range(20):
                yield b"x" * 100
            yield b'"}'

        assert assert_envelope(httpx.post(url, content=chunks()), 413)["code"] == "body_too_large"
        assert not engine.requests  # neither reached the engine
        assert httpx.post(url, json={"prompt": "ab", "max_tokens": 2}).status_code == 200


def test_served_body_limit_comes_from_the_config_with_16_mib_default():
    assert ServerConfig().max_body_bytes == 16 * 1024 * 1024
    with pytest.raises(ConfigError, match="max_body_bytes"):
        ServerConfig(max_body_bytes=0)


# -- API key, bind address ------------------------------------------------------------------------------


def test_api_key_is_compared_with_hmac_compare_digest(engine, monkeypatch):
    # `==` on strings returns at the first differing byte, leaking how much of a guess was right.
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    with TestClient(create_app(engine, api_key="s3cret")) as client:
        assert client.post(CHAT, json=GOOD_CHAT, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert client.post(CHAT, json=GOOD_CHAT, headers={"Authorization": "Bearer s3crex"}).status_code == 401
    assert calls == [(b"s3cret", b"s3cret"), (b"s3crex", b"s3cret")]


def test_default_bind_is_loopback_only(monkeypatch):
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert ServerConfig().host == "127.0.0.1"
    assert cli.load_config(cli.build_parser().parse_args(["serve"])).server.host == "127.0.0.1"


def test_drain_timeout_defaults_to_30_s_and_is_set_by_flag_or_config(monkeypatch):
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert ServerConfig().drain_timeout_s == 30.0
    assert cli.load_config(cli.build_parser().parse_args(["serve", "--drain-timeout", "2.5"])).server.drain_timeout_s == 2.5
    with pytest.raises(ConfigError, match="drain_timeout_s"):
        EngineConfig.from_dict({"server": {"drain_timeout_s": -1}})


# -- drain gate -----------------------------------------------------------------------------------------


def test_drain_counts_requests_and_refuses_new_ones_once_closed():
    drain = Drain()
    assert drain.enter() and drain.enter() and drain.active == 2
    drain.close()
    assert not drain.enter() and drain.active == 2  # a refused request is not counted
    assert not drain.wait_idle(0.05)
    drain.leave()
    threading.Timer(0.05, drain.leave).start()
    assert drain.wait_idle(5) and drain.active == 0


def test_closed_drain_answers_503_envelope_on_every_route(client):
    client.app.state.drain.close()
    for response in (client.post(CHAT, json=GOOD_CHAT), client.get("/health"), client.get("/v1/models")):
        error = assert_envelope(response, 503)
        assert (error["type"], error["code"]) == ("service_unavailable_error", "shutting_down")
        assert response.headers["connection"] == "close"


def test_a_stream_counts_as_in_flight_until_its_last_byte(fake, serve):
    engine = fake.FakeEngine(token_delay_s=0.02)
    app = create_app(engine)
    drain: Drain = app.state.drain

    async def run() -> tuple[int, int, str]:
        async with httpx.AsyncClient(base_url=server.base_url) as http:
            body = {"prompt": "abcdef", "max_tokens": 6, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.aiter_lines()
                await anext(lines)
                during = drain.active
                rest = [line async for line in lines if line]
            for _ in range(100):  # the server finishes its side just after the client read the end
                if drain.active == 0:
                    break
                await asyncio.sleep(0.05)
            return during, drain.active, rest[-1]

    with serve(app) as server:
        during, after, last = asyncio.run(run())
    assert (during, after, last) == (1, 0, "data: [DONE]")


# -- hostile chat templates, through the real engine ------------------------------------------------------

# One GGUF, one template: the user's message picks the attack (a GGUF each would cost 3 s of loading).
ATTACKS = {
    "globals_of_self": "{{ self.__init__.__globals__ }}",
    "subclasses_via_mro": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    # Outside the sandbox these two run a shell command (checked with a plain jinja2.Environment).
    "os_via_cycler": "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
    "os_via_lipsum": "{{ lipsum.__globals__['os'].popen('touch {marker}').read() }}",
}


def hostile_template(marker: Path) -> str:
    branches = "".join(
        f"{{% {'if' if i == 0 else 'elif'} messages[0]['content'] == '{name}' %}}{attack}"
        for i, (name, attack) in enumerate(ATTACKS.items())
    )
    return (branches + "{% else %}{{ messages[0]['content'] }}{% endif %}").replace("{marker}", str(marker))


@pytest.fixture(scope="module")
def hostile(gguf_factory, tmp_path_factory, serve):
    """(server, engine, marker file an escape would create): a tiny GGUF (64-token context) whose
    tokenizer.chat_template is hostile, loaded by the real EngineCore and served by the real app."""
    tmp = tmp_path_factory.mktemp("hostile")
    marker = tmp / "escaped"
    spec = gguf_factory.TinySpec(n_layers=1, context=64, chat_template=hostile_template(marker))
    path = gguf_factory.write_tiny_gguf(tmp / "hostile.gguf", spec)
    engine = AsyncEngine(EngineCore(EngineConfig.from_dict({"model": {"path": str(path)}, "device": "cpu"}), False))
    assert engine.chat_template.source == spec.chat_template  # the GGUF's template is the one in use
    with serve(create_app(engine)) as server:
        yield server, engine, marker
    engine.shutdown()


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_hostile_gguf_template_is_a_400_envelope_and_runs_no_code(hostile, attack):
    server, _, marker = hostile
    body = {"messages": [{"role": "user", "content": attack}], "max_tokens": 2}
    error = assert_envelope(httpx.post(server.base_url + CHAT, json=body, timeout=30), 400)
    assert error["type"] == "invalid_request_error"
    assert "unsafe" in error["message"] and "sandbox" in error["message"]
    assert not marker.exists()
    # The template's harmless branch still renders: the server and the engine carry on.
    harmless = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    assert httpx.post(server.base_url + CHAT, json=harmless, timeout=30).status_code == 200


def test_real_engine_clamps_max_tokens_to_the_room_left_and_finishes_with_length(hostile):
    server, engine, _ = hostile
    prompt = "one two three four five six seven"
    body = {"prompt": prompt, "max_tokens": 10_000, "ignore_eos": True, "temperature": 0}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == len(engine.tokenizer.encode(prompt, add_special_tokens=True))
    assert usage["prompt_tokens"] + usage["completion_tokens"] == engine.max_model_len == 64
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_real_engine_refuses_a_prompt_that_fills_the_context(hostile):
    server, _, _ = hostile
    response = httpx.post(server.base_url + "/v1/completions", json={"prompt": list(range(64)), "max_tokens": 1})
    error = assert_envelope(response, 400)
    assert error["code"] == "context_length_exceeded" and "64" in error["message"]
