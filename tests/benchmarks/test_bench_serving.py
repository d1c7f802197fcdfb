"""benchmarks/bench_serving.py against a fake OpenAI-compatible server with known timing: the load generator
counts tokens exactly, measures the delays the server injects, keeps to its concurrency and arrival rate, and
reports failed requests with their messages."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

BENCH_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serving.py"


def load_bench() -> ModuleType:
    # benchmarks/ is not a package; registered in sys.modules so its dataclasses resolve their module
    if "bench_serving" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_serving", BENCH_PATH)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_serving"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_serving"]


bench = load_bench()


def fake_token_count(text: str) -> int:
    """The fake tokenizer: a word of up to 3 letters is one token, a longer one two."""
    return sum(1 if len(w) <= 3 else 2 for w in text.split())


class FakeServer:
    """Streams max_tokens tokens, tokens_per_chunk to a chunk: the first chunk `ttft` s after the request, the
    next ones `itl` s apart (a chat stream opens with a role-only chunk at once). Request k (from 1) answers
    500 when fail_every divides k, is cut mid-stream when cut_every does, and gets an error event when
    error_every does. Records in-flight counts, arrival times, bodies and headers."""

    def __init__(self, ttft: float = 0.03, itl: float = 0.015, tokens_per_chunk: int = 1, fail_every: int = 0,
                 cut_every: int = 0, error_every: int = 0) -> None:
        self.ttft, self.itl, self.tokens_per_chunk = ttft, itl, tokens_per_chunk
        self.fail_every, self.cut_every, self.error_every = fail_every, cut_every, error_every
        self.in_flight = self.max_in_flight = self.n_requests = 0
        self.arrivals: list[float] = []
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/tokenize")(self.tokenize)
        self.app.post("/v1/completions")(self.completions)
        self.app.post("/v1/chat/completions")(self.chat)

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def tokenize(self, request: Request) -> dict:
        return {"tokens": list(range(fake_token_count((await request.json())["content"])))}

    async def completions(self, request: Request):
        return await self.generate(request, chat=False)

    async def chat(self, request: Request):
        return await self.generate(request, chat=True)

    async def generate(self, request: Request, chat: bool):
        self.n_requests += 1
        k = self.n_requests
        self.arrivals.append(time.perf_counter())
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("authorization"))
        if self.fail_every and k % self.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, status_code=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        return StreamingResponse(self.events(body, chat, k, fake_token_count(prompt)), media_type="text/event-stream")

    async def events(self, body: dict, chat: bool, k: int, n_prompt: int) -> AsyncIterator[str]:
        def sse(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        try:
            if chat:
                yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await asyncio.sleep(self.ttft)
            n, sent = body["max_tokens"], 0
            while sent < n:
                if sent:
                    await asyncio.sleep(self.itl)
                    if self.cut_every and k % self.cut_every == 0:
                        raise RuntimeError("cut")  # uvicorn drops the connection mid-body
                    if self.error_every and k % self.error_every == 0:
                        yield sse({"error": {"message": "engine exploded", "type": "server_error"}})
                        yield "data: [DONE]\n\n"
                        return
                m = min(self.tokens_per_chunk, n - sent)
                text = " tok" * m
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                yield sse({"choices": [{**choice, "finish_reason": "length" if sent + m == n else None}]})
                sent += m
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
                yield sse({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


@contextmanager
def serving(fake: FakeServer) -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(fake.app, host="127.0.0.1", port=0, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def run_against() -> Callable[..., tuple[dict, FakeServer]]:
    """run_against(fake, **config) -> (report, fake) with the fake served on a free localhost port."""

    def run(fake: FakeServer, **config) -> tuple[dict, FakeServer]:
        with serving(fake) as url:
            report = asyncio.run(bench.run_benchmark(bench.BenchConfig(base_url=url + "/v1", **config)))
        return report, fake

    return run


def fixed(n: int):
    return bench.LengthDist("fixed", n)


def test_length_distributions_sample_in_range_and_clip_to_one() -> None:
    rng = np.random.default_rng(0)
    assert {bench.LengthDist.parse("7").sample(rng) for _ in range(20)} == {7}
    assert {bench.LengthDist.parse("uniform:3:5").sample(rng) for _ in range(200)} == {3, 4, 5}
    normal = [bench.LengthDist.parse("normal:2:10").sample(rng) for _ in range(200)]
    assert min(normal) == 1 and max(normal) > 10
    assert str(bench.LengthDist.parse("normal:64:8")) == "normal:64:8"
    for bad in ("0", "x", "uniform:5:3", "normal:5:-1", "poisson:1:2", "uniform:1"):
        with pytest.raises(ValueError):
            bench.LengthDist.parse(bad)


def test_config_rejects_contradictory_load_settings() -> None:
    with pytest.raises(ValueError, match="not both"):
        bench.BenchConfig(concurrency=2, request_rate=1.0)
    with pytest.raises(ValueError, match="max-concurrency"):
        bench.BenchConfig(concurrency=2, max_concurrency=2)
    with pytest.raises(ValueError, match="endpoint"):
        bench.BenchConfig(endpoint="embeddings")
    assert bench.BenchConfig().request_limit == 100 and bench.BenchConfig(duration=1.0).request_limit is None


def test_concurrency_mode_counts_tokens_exactly_and_measures_injected_delays(run_against) -> None:
    ttft, itl = 0.04, 0.015
    report, fake = run_against(FakeServer(ttft=ttft, itl=itl), concurrency=3, num_requests=12,
                               prompt_len=fixed(8), output_len=fixed(6))
    assert report["requests"] == {"issued": 12, "ok": 12, "failed": 0} and report["errors"] == {}
    assert report["tokens"]["output"] == 72 and report["tokens"]["output_from_usage"] == 12
    assert fake.max_in_flight == 3
    ms = 1e3
    assert ttft * ms <= report["ttft_ms"]["p50"] <= ttft * ms + 30
    assert report["itl_ms"]["n"] == 12 * 5
    assert itl * ms - 2 <= report["itl_ms"]["p50"] <= itl * ms + 30
    assert report["itl_ms"]["p99"] <= itl * ms + 60
    assert (ttft + 5 * itl) * ms <= report["e2e_ms"]["p50"] <= (ttft + 5 * itl) * ms + 60
    assert itl * ms - 2 <= report["tpot_ms"]["p50"] <= itl * ms + 30
    assert report["settings"]["model"] == "fake-model"
    body = fake.bodies[0]
    assert body["model"] == "fake-model" and body["max_tokens"] == 6 and body["ignore_eos"] is True
    assert body["temperature"] == 0 and body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert report["throughput"]["output_tokens_per_s"] == pytest.approx(72 / report["duration_s"])


def test_usage_counts_tokens_of_chunks_carrying_several_and_chunks_count_without_it(run_against) -> None:
    report, _ = run_against(FakeServer(ttft=0.01, itl=0.01, tokens_per_chunk=3), concurrency=2, num_requests=4,
                            output_len=fixed(9))
    assert report["tokens"]["output"] == 36
    assert report["itl_ms"]["n"] == 4 * 2  # three chunks a request: two gaps, whatever they carry
    report, fake = run_against(FakeServer(ttft=0.01, itl=0.01, tokens_per_chunk=3), concurrency=2, num_requests=4,
                               output_len=fixed(9), include_usage=False)
    assert "stream_options" not in fake.bodies[0]
    assert report["tokens"]["output"] == 12 and report["tokens"]["output_from_chunks"] == 4


def test_chat_ttft_waits_for_text_not_the_role_chunk(run_against) -> None:
    report, fake = run_against(FakeServer(ttft=0.06, itl=0.01), endpoint="chat", num_requests=3, output_len=fixed(4))
    assert report["requests"]["ok"] == 3 and report["tokens"]["output"] == 12
    assert 60 <= report["ttft_ms"]["p50"] <= 90
    assert fake.bodies[0]["messages"][0]["role"] == "user"


def test_request_rate_issues_about_rate_times_duration_at_poisson_spacing(run_against) -> None:
    rate, duration = 40.0, 1.0
    report, fake = run_against(FakeServer(ttft=0.005, itl=0.005), request_rate=rate, duration=duration,
                               output_len=fixed(2), seed=3)
    n = report["requests"]["issued"]
    assert 20 <= n <= 60 and fake.n_requests == n and report["requests"]["ok"] == n
    gaps = np.diff(fake.arrivals)
    assert 0.6 / rate <= gaps.mean() <= 1.6 / rate
    assert gaps.std() > 0.4 / rate  # exponential gaps vary about as much as their mean; a fixed pace would not
    assert fake.arrivals[-1] - fake.arrivals[0] < duration + 0.05


def test_max_concurrency_caps_requests_in_flight(run_against) -> None:
    report, fake = run_against(FakeServer(ttft=0.03, itl=0.005), request_rate=1000.0, max_concurrency=2,
                               num_requests=10, output_len=fixed(3))
    assert report["requests"]["ok"] == 10 and fake.max_in_flight == 2


def test_duration_stops_issuing_and_lets_requests_in_flight_finish(run_against) -> None:
    report, fake = run_against(FakeServer(ttft=0.02, itl=0.01), concurrency=2, duration=0.3, output_len=fixed(3))
    n = report["requests"]["issued"]
    assert 4 <= n <= 16 and report["requests"]["ok"] == n and fake.in_flight == 0
    assert report["duration_s"] < 0.3 + 0.2


def test_http_500_is_a_failure_with_its_message(run_against) -> None:
    report, _ = run_against(FakeServer(ttft=0.005, itl=0.005, fail_every=3), num_requests=9, output_len=fixed(2))
    assert report["requests"] == {"issued": 9, "ok": 6, "failed": 3}
    assert report["errors"] == {"HTTP 500: injected failure": 3}
    assert report["tokens"]["output"] == 12


def test_cut_streams_and_error_events_are_failures_with_their_messages(run_against) -> None:
    report, _ = run_against(FakeServer(ttft=0.005, itl=0.005, cut_every=2), num_requests=4, output_len=fixed(4))
    assert report["requests"]["failed"] == 2
    [(message, count)] = report["errors"].items()
    assert count == 2 and message.startswith("RemoteProtocolError")
    report, _ = run_against(FakeServer(ttft=0.005, itl=0.005, error_every=2), num_requests=4, output_len=fixed(4))
    assert report["errors"] == {"error event in stream: engine exploded": 2}


def test_calibration_makes_prompts_the_asked_number_of_tokens(run_against) -> None:
    report, fake = run_against(FakeServer(ttft=0.005, itl=0.005), num_requests=5, prompt_len=fixed(17),
                               output_len=fixed(1), calibrate=True)
    assert [fake_token_count(b["prompt"]) for b in fake.bodies] == [17] * 5
    assert report["tokens"]["prompt"] == 85 and report["settings"]["prompt_words"] < len(bench.WORDS)
    # without it, the fake's two-token words make prompts longer than asked
    _, fake = run_against(FakeServer(ttft=0.005, itl=0.005), num_requests=5, prompt_len=fixed(17),
                          output_len=fixed(1))
    assert sum(fake_token_count(b["prompt"]) for b in fake.bodies) > 85 * 1.2


def test_a_shared_prefix_heads_every_prompt_by_group(run_against) -> None:
    """--prefix-len 12 --prefix-groups 2: requests 0, 2, 4 start with one 12-word head, 1, 3, 5 with another,
    each then its own words; the asked length counts both."""
    report, fake = run_against(FakeServer(ttft=0.005, itl=0.005), concurrency=1, num_requests=6,
                               prompt_len=fixed(5), output_len=fixed(1), prefix_len=12, prefix_groups=2)
    words = [b["prompt"].split() for b in fake.bodies]
    assert all(len(w) == 17 for w in words)
    heads = [w[:12] for w in words]
    assert heads[0] == heads[2] == heads[4] != heads[1] == heads[3] == heads[5]
    assert len({tuple(w[12:]) for w in words}) == 6
    assert report["settings"]["prefix_len"] == 12
    with pytest.raises(ValueError, match="--prefix-len must be >= 0"):
        bench.BenchConfig(prefix_len=-1)


def test_main_prints_a_table_and_one_json_line_and_sends_the_api_key(tmp_path, capsys) -> None:
    fake = FakeServer(ttft=0.005, itl=0.005)
    out = tmp_path / "report.json"
    with serving(fake) as url:
        report = bench.main(["--base-url", url, "--api-key", "secret", "--num-requests", "3", "--output-len", "2",
                             "--prompt-len", "uniform:4:9", "--json-out", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert any(line.startswith("ttft") for line in lines) and any(line.startswith("itl") for line in lines)
    assert fake.auth == ["Bearer secret"] * 3
    assert report["settings"]["api_key"] == "***" and report["settings"]["prompt_len"] == "uniform:4:9"
