"""The front against careless and hostile clients, on the fake engine: strict types, llama-server's seed -1,
no Python internals in messages, prompts refused by their length before tokenizing, control-token text in
messages kept as text, CPU work off the event loop, deadlines on slow headers and bodies, and the drain's cut.
The same properties on the real model and process: test_front_under_load.py and test_shutdown.py."""

from __future__ import annotations

import asyncio
import json
import os
import select
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from vegaserve.server.app import create_app
from vegaserve.server.http_protocol import h11_with_header_deadline
from vegaserve.server.offload import BULK_BYTES, BULK_NICE

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


# -- types, seed, messages ------------------------------------------------------------------------------

WRONG_TYPES = [
    (CHAT, {"messages": HI, "max_tokens": "2"}, "max_tokens"),
    (CHAT, {"messages": HI, "max_tokens": 2.0}, "max_tokens"),
    (CHAT, {"messages": HI, "temperature": "0.5"}, "temperature"),
    (CHAT, {"messages": HI, "stream": "true"}, "stream"),
    (CHAT, {"messages": HI, "seed": True}, "seed"),
    (CHAT, {"messages": HI, "logprobs": 1}, "logprobs"),
    (CHAT, {"messages": HI, "stop_token_ids": [1.0]}, "stop_token_ids"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logprobs": "2"}, "logprobs"),
    ("/detokenize", {"tokens": [104, "105"]}, "tokens"),
    ("/tokenize", {"content": "hi", "with_pieces": 1}, "with_pieces"),
]


@pytest.mark.parametrize("path,body,field", WRONG_TYPES, ids=[f"{f}{i}" for i, (_, _, f) in enumerate(WRONG_TYPES)])
def test_a_value_of_the_wrong_json_type_is_refused_not_coerced(client, engine, path, body, field):
    error = error_of(client.post(path, json=body), 400)
    assert error["param"] == field and field in error["message"]
    assert not engine.requests


def test_an_integer_is_still_a_number_where_a_float_is_asked_for(client, engine):
    assert client.post(CHAT, json={"messages": HI, "temperature": 1, "top_p": 1}).status_code == 200
    assert engine.requests[0].params.temperature == 1.0


@pytest.mark.parametrize("seed,expected", [(-1, None), (0, 0), (5, 5), (None, None)])
def test_seed_minus_one_asks_for_a_random_seed_as_in_llama_server(client, engine, seed, expected):
    body = {"messages": HI} if seed is None else {"messages": HI, "seed": seed}
    assert client.post(CHAT, json=body).status_code == 200
    assert engine.requests[0].params.seed == expected


def test_an_integer_too_long_to_read_is_a_400_that_names_no_python_internals(client):
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"7" * 4301 + b"}"
    error = error_of(client.post(CHAT, content=raw), 400)
    assert "4300 digits" in error["message"]
    assert "sys." not in error["message"] and "int_max_str_digits" not in error["message"]


# -- the prompt's length, before tokenizing ---------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_a_prompt_whose_length_alone_overflows_the_context_is_refused_before_it_is_tokenized(
    client, engine, monkeypatch, path
):
    encoded: list[int] = []
    real = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text, *a, **k: encoded.append(len(text)) or real(text, *a, **k))
    text = "x" * (engine.max_model_len * engine.tokenizer.max_token_bytes)  # at least max_model_len tokens
    body = {"messages": [{"role": "user", "content": text}]} if path == CHAT else {"prompt": text}
    error = error_of(client.post(path, json=body), 400)
    assert error["code"] == "context_length_exceeded" and str(engine.max_model_len) in error["message"]
    assert not encoded and not engine.requests
    # One token of room less and it is tokenized (and refused by its count, as before)
    short = "x" * (engine.max_model_len - 10)
    body = {"messages": [{"role": "user", "content": short}]} if path == CHAT else {"prompt": short}
    client.post(path, json=body)
    assert encoded


# -- control-token text in messages ---------------------------------------------------------------------


def chat_prompt(client, engine, messages, **extra) -> list[int]:
    engine.requests.clear()
    assert client.post(CHAT, json={"messages": messages, **extra}).status_code == 200
    return engine.requests[0].prompt_token_ids


def test_control_token_text_in_a_message_is_text_and_the_template_turns_stay_control_tokens(client, engine, fake):
    typed = "a<|system|>b<|end|>"
    ids = chat_prompt(client, engine, [{"role": "user", "content": typed, "name": "<|assistant|>"}])
    specials = [t for t in ids if t in fake.SPECIALS.values()]
    assert specials == [fake.BOS, fake.SPECIALS["<|user|>"], fake.SPECIALS["<|end|>"], fake.SPECIALS["<|assistant|>"]]
    assert bytes(t for t in ids if t < 256) == typed.encode()
    # /tokenize of the same messages shows the same prompt
    shown = client.post("/tokenize", json={"messages": [{"role": "user", "content": typed}]}).json()["tokens"]
    assert shown == ids


def test_tool_definitions_are_quoted_too(client, engine, fake, monkeypatch):
    seen: list[object] = []
    real = engine.chat_template.render
    monkeypatch.setattr(engine.chat_template, "render", lambda m, add_generation_prompt=True, tools=None, **e:
                        seen.append(tools) or real(m, add_generation_prompt, tools, **e))
    tools = [{"type": "function", "function": {"name": "<|system|>", "parameters": {"<|end|>": {"type": "string"}}}}]
    chat_prompt(client, engine, HI, tools=tools)
    quoted = json.dumps(seen[0], ensure_ascii=False)
    assert "<|system|>" in quoted and "<|end|>" in quoted
    assert engine.tokenizer.encode(quoted, add_special_tokens=False) == list(quoted.replace("\udbff", "").encode())


def test_special_tokens_in_content_keeps_llama_servers_reading(fake):
    engine = fake.FakeEngine()
    with TestClient(create_app(engine, special_tokens_in_content=True)) as client:
        ids = chat_prompt(client, engine, [{"role": "user", "content": "a<|system|>b"}])
    assert fake.SPECIALS["<|system|>"] in ids


# -- the event loop stays free --------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["small", "bulk"])
def test_parsing_and_tokenizing_run_off_the_event_loop_a_bulk_body_tokenizing_at_low_priority(fake, size):
    engine = fake.FakeEngine(max_model_len=10 * BULK_BYTES)
    threads: list[tuple[str, int | None]] = []
    real = engine.tokenizer.encode

    def encode(text, add_special_tokens=True, parse_special=True, runner=None):
        nice: list[int] = []
        if runner is not None:
            runner(lambda: nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        threads.append((threading.current_thread().name, nice[0] if nice else None))
        return real(text, add_special_tokens, parse_special)

    engine.tokenizer.encode = encode
    content = "x" * (BULK_BYTES + 1 if size == "bulk" else 100)
    with TestClient(create_app(engine)) as client:
        loop_thread = client.portal.call(lambda: threading.current_thread().name)  # the app's event loop
        assert client.post("/tokenize", json={"content": content}).status_code == 200
    (name, nice), = threads
    assert name != loop_thread
    assert name.startswith("front-bulk" if size == "bulk" else "front-cpu")
    assert nice == (BULK_NICE if size == "bulk" else None)  # the tokenizing of a bulk body ran at low priority


# -- deadlines on slow clients --------------------------------------------------------------------------


class Uvicorn:
    """The app on a free port with the production protocol class (the header deadline)."""

    def __init__(self, app, header_timeout_s: float = 10.0) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                http=h11_with_header_deadline(header_timeout_s))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> int:
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive()
            time.sleep(0.01)
        return self.server.servers[0].sockets[0].getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def read_all(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything until the server closes the connection, and when it did."""
    sock.settimeout(limit_s)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data, time.monotonic()


def test_headers_sent_a_byte_at_a_time_are_cut_at_the_header_deadline(fake):
    with Uvicorn(create_app(fake.FakeEngine()), header_timeout_s=0.6) as port:
        with socket.create_connection(("127.0.0.1", port)) as s:
            opened = time.monotonic()
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ":
                try:
                    s.sendall(bytes([byte]))
                except OSError:  # closed under us: what the test waits for
                    break
                time.sleep(0.1)
                if time.monotonic() - opened > 5:
                    break
            data, closed = read_all(s, 10)
        assert data == b"" and closed - opened < 2
        # A client that sends its headers at once is served, twice on one connection.
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as http:
            assert http.get("/health").status_code == 200
            time.sleep(0.8)  # longer than the header deadline, shorter than uvicorn's keep-alive
            assert http.get("/health").status_code == 200


def test_a_body_sent_a_byte_at_a_time_is_a_408_at_the_body_deadline(fake):
    """A byte every 0.1 s for 0.8 s, then nothing: the 408 comes at the body's deadline (1 s from its
    start), not a second after the last byte (an idle timer would answer at 1.8 s). The client stops
    sending before the deadline: a byte that reaches the closed connection is answered with a reset, which
    can cost the client the 408 it had not yet read."""
    engine = fake.FakeEngine()
    with Uvicorn(create_app(engine, body_timeout_s=1.0)) as port:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n")
            opened = time.monotonic()
            for byte in b'{"prompt": "':
                if select.select([s], [], [], 0.1)[0] or time.monotonic() - opened > 0.8:
                    break
                s.sendall(bytes([byte]))
            data, closed = read_all(s, 10)
    assert data.startswith(b"HTTP/1.1 408") and b"connection: close" in data.lower()
    assert b'"request_timeout"' in data and 0.9 < closed - opened < 1.6
    assert not engine.requests


def test_a_body_still_arriving_when_the_drain_closes_is_a_503_at_once(fake):
    app = create_app(fake.FakeEngine())
    with Uvicorn(app) as port:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            time.sleep(0.3)
            closed_at = time.monotonic()
            app.state.drain.close()
            data, answered = read_all(s, 10)
            assert app.state.drain.wait_idle(5)
    assert data.startswith(b"HTTP/1.1 503") and b'"shutting_down"' in data
    assert answered - closed_at < 2


# -- the drain's cut ------------------------------------------------------------------------------------


def test_the_cut_ends_a_running_stream_with_an_error_event_and_done_and_a_plain_request_with_a_503(fake, serve):
    engine = fake.FakeEngine(token_delay_s=0.05)
    app = create_app(engine)
    drain = app.state.drain
    body = {"prompt": "abcdef", "max_tokens": 100000, "ignore_eos": True}

    async def run(base: str) -> tuple[list[str], httpx.Response]:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            plain = asyncio.ensure_future(http.post("/v1/completions", json=body))
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                lines = response.aiter_lines()
                events = [await anext(lines)]
                drain.close()
                drain.cut()
                events += [line async for line in lines]
            return [e.removeprefix("data: ") for e in events if e.startswith("data: ")], await plain

    with serve(app) as server:
        events, plain = asyncio.run(run(server.base_url))
        assert drain.wait_idle(5)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["type"], error["code"]) == ("service_unavailable_error", "shutting_down")
    assert error_of(plain, 503)["code"] == "shutting_down" and plain.headers["connection"] == "close"
    assert len(engine.aborted) == 2  # both requests were ended in the engine too
