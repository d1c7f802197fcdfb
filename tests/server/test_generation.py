"""server/generation.py and streaming.py: a client that leaves stops the engine's work.

The app is driven through raw ASGI calls so the disconnect lands at a chosen moment: after some stream
chunks, or while a non-streaming request is still generating.
"""

from __future__ import annotations

import json

import anyio
import pytest

from vegaserve.engine.request import EngineDeadError
from vegaserve.server.app import create_app

LONG = {"max_tokens": 100, "ignore_eos": True}  # the fake cycles its reply: 100 outputs


class AsgiCall:
    """One POST to the app whose client disconnects when `leave` is set."""

    def __init__(self, app, path: str, body: dict) -> None:
        self.app, self.path, self.body = app, path, json.dumps(body).encode()
        self.messages: list[dict] = []
        self.leave = anyio.Event()
        self._body_sent = False

    async def receive(self) -> dict:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.messages.append(message)

    def body_chunks(self) -> list[bytes]:
        return [m["body"] for m in self.messages if m["type"] == "http.response.body" and m.get("body")]

    async def run(self) -> None:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": self.path, "raw_path": self.path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(self.body)).encode())],
            "client": ("127.0.0.1", 5000), "server": ("testserver", 80),
        }
        await self.app(scope, self.receive, self.send)


def test_leaving_a_stream_aborts_the_request_and_closes_the_engine_iterator(fake):
    engine = fake.FakeEngine(token_delay_s=0.005)
    call = AsgiCall(create_app(engine), "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "abc"}], "stream": True, **LONG})

    async def main() -> None:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as group:
                group.start_soon(call.run)
                while len(call.body_chunks()) < 3:  # role chunk + two content chunks
                    await anyio.sleep(0.001)
                call.leave.set()

    anyio.run(main)
    request_id = engine.requests[0].request_id
    assert engine.aborted == [request_id]
    assert engine.closed_early == [request_id]
    assert len(call.body_chunks()) < 20  # it stopped long before the 100 tokens
    assert b"[DONE]" not in b"".join(call.body_chunks())


def test_leaving_while_a_whole_response_is_generated_aborts_it(fake):
    engine = fake.FakeEngine(token_delay_s=0.01)  # 100 tokens: a second, if nobody stops it
    call = AsgiCall(create_app(engine), "/v1/completions", {"prompt": "abc", **LONG})

    async def main() -> float:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as group:
                group.start_soon(call.run)
                await anyio.sleep(0.1)
                call.leave.set()
                left_at = anyio.current_time()
            return anyio.current_time() - left_at

    took = anyio.run(main)
    request_id = engine.requests[0].request_id
    assert engine.aborted == [request_id] and engine.closed_early == [request_id]
    assert took < 0.5


@pytest.mark.parametrize("stream", [True, False])
def test_leaving_ends_every_choice(fake, stream):
    """n = 3 (server/generation.py Choices): a client leaving a stream, or a whole response, aborts all three."""
    engine = fake.FakeEngine(token_delay_s=0.005)
    body = {"messages": [{"role": "user", "content": "abc"}], "n": 3, "stream": stream, **LONG}
    call = AsgiCall(create_app(engine), "/v1/chat/completions", body)

    async def main() -> None:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as group:
                group.start_soon(call.run)
                while len(engine.requests) < 3 or (stream and len(call.body_chunks()) < 6):
                    await anyio.sleep(0.001)
                call.leave.set()

    anyio.run(main)
    ids = sorted(r.request_id for r in engine.requests)
    assert len(ids) == 3 and sorted(engine.aborted) == ids and sorted(engine.closed_early) == ids


def test_finished_request_is_not_aborted(client, engine):
    client.post("/v1/completions", json={"prompt": "abc"})
    client.post("/v1/completions", json={"prompt": "abc", "stream": True})
    assert engine.aborted == [] and engine.closed_early == []


def test_abort_is_counted_in_the_metrics(fake):
    engine = fake.FakeEngine(token_delay_s=0.005)
    app = create_app(engine)
    call = AsgiCall(app, "/v1/completions", {"prompt": "abc", "stream": True, **LONG})

    async def main() -> None:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as group:
                group.start_soon(call.run)
                while len(call.body_chunks()) < 2:
                    await anyio.sleep(0.001)
                call.leave.set()

    anyio.run(main)
    text = app.state.metrics.render()[0].decode()
    assert 'vllm:request_success_total{finished_reason="abort",model_name="fake-model"} 1.0' in text


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}], "stream": True}),
    ("/v1/completions", {"prompt": "abc", "stream": True}),
])
def test_engine_failure_mid_stream_becomes_an_error_event_then_done(fake, path, body):
    engine = fake.FakeEngine()
    original = engine.generate

    async def dies_after_one(request):
        async for out in original(request):
            yield out
            raise EngineDeadError("engine died mid-stream")

    engine.generate = dies_after_one
    call = AsgiCall(create_app(engine), path, body)
    anyio.run(call.run)
    events = [line.removeprefix("data: ") for line in b"".join(call.body_chunks()).decode().splitlines()
              if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "engine died mid-stream"
