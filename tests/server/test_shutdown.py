"""`vegaserve serve` on SIGTERM: new requests get a 503 while the streams in flight finish, then the process
exits 0; past `--drain-timeout` the streams are cut and it still exits 0. Real processes, real model."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

STREAM = {"prompt": "Once upon a time", "temperature": 0, "ignore_eos": True, "stream": True,
          "stream_options": {"include_usage": True}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def vegaserve(*flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`python -m vegaserve.server serve` on the embedded model, ready to serve; killed if a test leaves it."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vegaserve.server", "serve", "--port", str(port), "-c", "512", "--device", "cpu",
         "--log-level", "warning", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the server exited at start: {proc.stderr.read()}"  # type: ignore[union-attr]
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up within 60 s"
            time.sleep(0.2)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def read_events(lines: Iterator[str]) -> Iterator[dict | str]:
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


def stream_text(events: list[dict | str]) -> tuple[str, str | None, dict | None]:
    """(text, finish_reason, usage) of a completions stream."""
    chunks = [e for e in events if isinstance(e, dict)]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    usage = next((c["usage"] for c in chunks if c.get("usage")), None)
    return text, (reasons[-1] if reasons else None), usage


def test_sigterm_finishes_the_stream_in_flight_refuses_new_requests_and_exits_0():
    with vegaserve() as (proc, base):
        body = {**STREAM, "max_tokens": 40}
        alone = stream_text(list(read_events(httpx.post(base + "/v1/completions", json=body, timeout=60).iter_lines())))
        assert alone[1:] == ("length", {"prompt_tokens": 4, "completion_tokens": 40, "total_tokens": 44})

        with httpx.Client(base_url=base, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as r:
            events = read_events(r.iter_lines())
            seen = [next(events)]  # the stream is running when the signal comes
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)  # the handler runs on the engine's thread, between two steps
            try:
                refused = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "shutting_down"
            except httpx.ConnectError:
                assert proc.poll() == 0  # too late for a 503: the server had already finished and exited
            seen += list(events)

        assert stream_text(seen) == alone  # the whole text, the finish reason and the usage
        assert seen[-1] == "[DONE]"
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - signalled < 30  # the default drain timeout


def test_sigterm_cuts_streams_still_running_at_the_drain_timeout_and_exits_0():
    with vegaserve("--drain-timeout", "1") as (proc, base):
        body = {**STREAM, "max_tokens": 500}  # many seconds of decoding on this CPU
        with httpx.Client(base_url=base, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as r:
            events = read_events(r.iter_lines())
            seen = [next(events)]
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                seen += list(events)
            except httpx.TransportError:
                pass  # the connection was closed under the stream, as it should be
            assert proc.wait(timeout=15) == 0
            waited = time.monotonic() - signalled
        text, reason, usage = stream_text(seen)
        assert reason is None and usage is None  # cut, not finished
        assert 1 <= waited < 10
