"""Load generator for any OpenAI-compatible server (ours, llama-server, vLLM): streaming latency and throughput.

Clients stream `/v1/completions` (default) or `/v1/chat/completions` through httpx. The load is closed-loop
(`--concurrency C`: C clients, each sending its next request as soon as its last one ended) or open-loop
(`--request-rate R`: Poisson arrivals at R req/s, at most `--max-concurrency` in flight). Issuing stops after
`--num-requests` (default 100 when no `--duration`) or `--duration` seconds, whichever comes first; requests
in flight then finish. Prints a table and one JSON line (`--json-out FILE` writes that line too).

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8080 --concurrency 4 --num-requests 64 \\
        --prompt-len uniform:64:512 --output-len 128 [--endpoint chat] [--calibrate] [--api-key KEY] \\
        [--prefix-len 2048 --prefix-groups 4]

`--prefix-len N` puts a shared head of about N tokens before every prompt (`--prefix-groups G`: G heads,
request i taking head i mod G, as clients sharing system prompts send them), which a server with prefix
caching computes once per head; the prompt length counts the tokens after it.

Measured per request, every time from the moment the request is sent:
  TTFT    time to the first chunk carrying text (a chat stream's role-only first chunk is not text);
  ITL     time between successive text chunks. A chunk carrying several tokens is one gap, so against a
          server that packs tokens into chunks ITL reads high; TPOT = (E2E - TTFT) / (tokens - 1) does not;
  E2E     time to `data: [DONE]`;
  tokens  completion_tokens of the final usage chunk (asked for with stream_options.include_usage) when the
          server sends one, else the number of text chunks.
A failure is a non-200 answer, an error event inside the stream, a stream cut before `data: [DONE]` or a
transport error; the report counts each distinct message.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, fields

import httpx
import numpy as np

# Common English words; in the usual BPE and SentencePiece vocabularies nearly all are one token each, with or
# without a leading space, so a prompt of n words is about n tokens (`--calibrate` measures it instead).
WORDS = tuple(
    "the of and to in is it you that he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part over new sound take only little work know place year live me back give most very".split()
)


@dataclass(frozen=True)
class LengthDist:
    """A length in tokens: `128`, `uniform:a:b` (both ends included) or `normal:mean:std`; samples are >= 1."""

    kind: str  # fixed | uniform | normal
    a: float
    b: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "normal"):
            raise ValueError(f"unknown length distribution {self.kind!r}")
        if self.kind == "fixed" and (self.a < 1 or self.a != int(self.a)):
            raise ValueError(f"a fixed length is a whole number >= 1, not {self.a}")
        if self.kind == "uniform" and not 0 <= self.a <= self.b:
            raise ValueError(f"uniform:{self.a}:{self.b} needs 0 <= a <= b")
        if self.kind == "normal" and self.b < 0:
            raise ValueError(f"normal:{self.a}:{self.b} needs std >= 0")

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        parts = text.split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", int(parts[0]))
            if len(parts) == 3:
                return cls(parts[0], float(parts[1]), float(parts[2]))
        except ValueError as exc:
            raise ValueError(f"length {text!r}: {exc}") from None
        raise ValueError(f"length {text!r}: expected N, uniform:a:b or normal:mean:std")

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.integers(round(self.a), round(self.b), endpoint=True)
        else:
            value = round(rng.normal(self.a, self.b))
        return max(1, int(value))

    def __str__(self) -> str:
        return str(int(self.a)) if self.kind == "fixed" else f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8080"  # with or without the trailing /v1
    endpoint: str = "completions"  # completions | chat
    model: str | None = None  # None: the first of GET /v1/models
    api_key: str | None = None
    concurrency: int | None = None  # neither this nor request_rate: one client
    request_rate: float | None = None
    max_concurrency: int | None = None  # only with request_rate
    num_requests: int | None = None
    duration: float | None = None
    seed: int = 0
    prompt_len: LengthDist = LengthDist("fixed", 128)
    output_len: LengthDist = LengthDist("fixed", 128)
    temperature: float = 0.0
    prefix_len: int = 0  # a shared head of this many tokens before every prompt
    prefix_groups: int = 1  # distinct heads, request i taking head i % prefix_groups
    calibrate: bool = False
    include_usage: bool = True
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint is completions or chat, not {self.endpoint!r}")
        if self.concurrency is not None and self.request_rate is not None:
            raise ValueError("give --concurrency or --request-rate, not both")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError("--request-rate must be > 0")
        if self.max_concurrency is not None and (self.request_rate is None or self.max_concurrency < 1):
            raise ValueError("--max-concurrency is a cap >= 1 for --request-rate")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("--num-requests must be >= 1")
        if self.duration is not None and self.duration <= 0:
            raise ValueError("--duration must be > 0")
        if self.prefix_len < 0 or self.prefix_groups < 1:
            raise ValueError("--prefix-len must be >= 0 and --prefix-groups >= 1")

    @property
    def root(self) -> str:
        return self.base_url.rstrip("/").removesuffix("/v1")

    @property
    def request_limit(self) -> int | None:
        return self.num_requests if self.num_requests is not None or self.duration is not None else 100

    def settings(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(prompt_len=str(self.prompt_len), output_len=str(self.output_len))
        out.update(api_key="***" if self.api_key else None, num_requests=self.request_limit)
        out["concurrency"] = self.concurrency if self.request_rate is not None else self.concurrency or 1
        return out


@dataclass(frozen=True)
class PromptMaker:
    """Random-word prompts of about n tokens: n * words_per_token words drawn from `words`."""

    words: tuple[str, ...] = WORDS
    words_per_token: float = 1.0

    def make(self, rng: np.random.Generator, n_tokens: int) -> str:
        n_words = max(1, round(n_tokens * self.words_per_token))
        return " ".join(rng.choice(self.words, size=n_words))


async def calibrate(client: httpx.AsyncClient, n_sample: int = 256) -> PromptMaker:
    """Keeps the words that stay one token each in "w w w w" (so both with and without a leading space), then
    measures words per token on a sample prompt; uses the llama-server-style POST /tokenize {"content": ...}."""

    async def count(text: str) -> int:
        response = await client.post("/tokenize", json={"content": text})
        response.raise_for_status()
        return len(response.json()["tokens"])

    counts = await asyncio.gather(*(count(" ".join([w] * 4)) for w in WORDS))
    words = tuple(w for w, n in zip(WORDS, counts) if n == 4) or WORDS
    sample = PromptMaker(words).make(np.random.default_rng(0), n_sample)
    return PromptMaker(words, n_sample / await count(sample))


@dataclass
class RequestResult:
    prompt_len: int  # asked
    output_len: int  # asked: max_tokens
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    chunks: int = 0  # chunks carrying text
    usage_completion: int | None = None
    usage_prompt: int | None = None

    @property
    def tokens(self) -> int:
        return self.usage_completion if self.usage_completion is not None else self.chunks

    @property
    def tpot(self) -> float | None:
        if self.e2e is None or self.ttft is None or self.tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.tokens - 1)


def _error_message(raw: bytes) -> str:
    try:
        err = json.loads(raw)["error"]
        return str(err["message"] if isinstance(err, dict) else err)
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", errors="replace")[:300]


def _text_of(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or [{}]
    if not chat:
        return choices[0].get("text") or ""
    delta = choices[0].get("delta") or {}
    # a reasoning model streams its thinking as reasoning_content: those are generated tokens too
    return delta.get("content") or delta.get("reasoning_content") or ""


async def send_one(client: httpx.AsyncClient, cfg: BenchConfig, model: str, prompt: str, p_len: int,
                   max_tokens: int) -> RequestResult:
    chat = cfg.endpoint == "chat"
    res = RequestResult(p_len, max_tokens)
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": cfg.temperature, "ignore_eos": True,
                  "stream": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if cfg.include_usage:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                res.error = f"HTTP {response.status_code}: {_error_message(await response.aread())}"
                return res
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank event separators, ": ping" keep-alive comments
                data = line[5:].strip()
                if data == "[DONE]":
                    res.e2e = time.perf_counter() - start
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"error event in stream: {_error_message(data.encode())}"
                    return res
                if usage := chunk.get("usage"):
                    res.usage_completion = usage.get("completion_tokens")
                    res.usage_prompt = usage.get("prompt_tokens")
                if _text_of(chunk, chat):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.chunks += 1
    except Exception as exc:  # a transport error or a stream that does not parse fails this request, not the run
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    if res.e2e is None:
        res.error = "stream ended before data: [DONE]"
        return res
    res.ok = True
    return res


async def first_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _closed_loop(cfg: BenchConfig, may_issue: Callable[[int, float], bool],
                       issue: Callable[[int], Awaitable[None]], t0: float) -> None:
    counter = itertools.count()

    async def one_client() -> None:
        while may_issue(i := next(counter), time.perf_counter() - t0):
            await issue(i)

    await asyncio.gather(*(one_client() for _ in range(cfg.concurrency or 1)))


async def _open_loop(cfg: BenchConfig, may_issue: Callable[[int, float], bool],
                     issue: Callable[[int], Awaitable[None]], t0: float) -> None:
    assert cfg.request_rate is not None
    rng = np.random.default_rng([cfg.seed, 0])
    cap = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

    async def capped(i: int) -> None:
        if cap is None:
            return await issue(i)
        async with cap:  # an arrival that finds the cap full waits here; its timings start when it is sent
            await issue(i)

    tasks, due = [], 0.0
    # Arrivals follow a schedule fixed by the seed (not sleeps that add up drift), and --duration is checked
    # against the schedule, so a seed always issues the same number of requests.
    for i in itertools.count():
        if not may_issue(i, due):
            break
        if (wait := t0 + due - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(capped(i)))
        due += rng.exponential(1 / cfg.request_rate)
    await asyncio.gather(*tasks)


async def run_benchmark(cfg: BenchConfig) -> dict:
    """Runs the load and returns the report (see summarize)."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    # no connection cap: the client pool must never be what limits concurrency
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=cfg.root, headers=headers, timeout=cfg.timeout, limits=limits) as client:
        model = cfg.model or await first_model(client)
        prompts = await calibrate(client) if cfg.calibrate else PromptMaker()
        results: list[RequestResult] = []
        limit = cfg.request_limit
        heads = [prompts.make(np.random.default_rng([cfg.seed, 2, g]), cfg.prefix_len) + " "
                 for g in range(cfg.prefix_groups)] if cfg.prefix_len else [""]

        def may_issue(i: int, elapsed: float) -> bool:
            return (limit is None or i < limit) and (cfg.duration is None or elapsed < cfg.duration)

        async def issue(i: int) -> None:
            # each request's shape depends only on (seed, i): the same prompts whatever the load mode
            rng = np.random.default_rng([cfg.seed, 1, i])
            p_len, o_len = cfg.prompt_len.sample(rng), cfg.output_len.sample(rng)
            text = heads[i % len(heads)] + prompts.make(rng, p_len)
            results.append(await send_one(client, cfg, model, text, p_len + cfg.prefix_len, o_len))

        t0 = time.perf_counter()
        loop = _open_loop if cfg.request_rate is not None else _closed_loop
        await loop(cfg, may_issue, issue, t0)
        wall = time.perf_counter() - t0
    return summarize(cfg, model, prompts, results, wall)


def _stats_ms(values: list[float]) -> dict | None:
    if not values:
        return None
    ms = np.asarray(values) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": float(ms.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99), "n": len(ms)}


def summarize(cfg: BenchConfig, model: str, prompts: PromptMaker, results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.tokens for r in ok)
    # prompt tokens as the server counted them when it said; else the asked length (about right, see WORDS)
    prompt_tokens = sum(r.usage_prompt if r.usage_prompt is not None else r.prompt_len for r in ok)
    n_usage = sum(r.usage_completion is not None for r in ok)
    return {
        "bench": "serving",
        "settings": {**cfg.settings(), "model": model, "words_per_token": round(prompts.words_per_token, 4),
                     "prompt_words": len(prompts.words)},
        "requests": {"issued": len(results), "ok": len(ok), "failed": len(results) - len(ok)},
        "errors": dict(Counter(r.error for r in results if not r.ok).most_common()),
        "duration_s": wall,
        "throughput": {
            "requests_per_s": len(ok) / wall,
            "output_tokens_per_s": out_tokens / wall,
            "total_tokens_per_s": (out_tokens + prompt_tokens) / wall,
        },
        "tokens": {"output": out_tokens, "prompt": prompt_tokens, "output_from_usage": n_usage,
                   "output_from_chunks": len(ok) - n_usage},
        "ttft_ms": _stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itl]),
        "tpot_ms": _stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "e2e_ms": _stats_ms([r.e2e for r in ok if r.e2e is not None]),
    }


def print_table(report: dict) -> None:
    s, req, thr, tok = report["settings"], report["requests"], report["throughput"], report["tokens"]
    load = (f"rate {s['request_rate']} req/s, max concurrency {s['max_concurrency']}" if s["request_rate"]
            else f"concurrency {s['concurrency']}")
    print(f"{s['base_url']} /v1/{'chat/' if s['endpoint'] == 'chat' else ''}completions  model {s['model']}")
    head = f" after a shared head of {s['prefix_len']} ({s['prefix_groups']} heads)" if s["prefix_len"] else ""
    print(f"{load}; prompt {s['prompt_len']}{head} output {s['output_len']} tokens; seed {s['seed']}")
    print(f"requests: {req['ok']} ok, {req['failed']} failed, in {report['duration_s']:.2f} s")
    for message, n in report["errors"].items():
        print(f"  {n:5d} x {message[:110]}")
    print(f"throughput: {thr['requests_per_s']:.2f} req/s, {thr['output_tokens_per_s']:.1f} output tok/s, "
          f"{thr['total_tokens_per_s']:.1f} total tok/s ({tok['output']} output tokens, "
          f"{tok['output_from_usage']} requests counted by usage)")
    print(f"{'ms':6s} {'mean':>9s} {'p50':>9s} {'p90':>9s} {'p99':>9s} {'n':>7s}")
    for key in ("ttft", "itl", "tpot", "e2e"):
        st = report[f"{key}_ms"]
        if st is None:
            print(f"{key:6s} {'-':>9s}")
        else:
            print(f"{key:6s} {st['mean']:9.2f} {st['p50']:9.2f} {st['p90']:9.2f} {st['p99']:9.2f} {st['n']:7d}")


def _length_arg(text: str) -> LengthDist:
    try:
        return LengthDist.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, str | None]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8080")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--model", help="default: the first model of GET /v1/models")
    ap.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="C clients sending back to back (default 1)")
    load.add_argument("--request-rate", type=float, help="Poisson arrivals at R requests/s")
    ap.add_argument("--max-concurrency", type=int, help="cap on requests in flight with --request-rate")
    ap.add_argument("--num-requests", type=int, help="requests to issue (default 100 unless --duration)")
    ap.add_argument("--duration", type=float, help="stop issuing after S seconds; requests in flight finish")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-len", type=_length_arg, default=LengthDist("fixed", 128),
                    help="tokens: N, uniform:a:b or normal:mean:std (clipped to >= 1); random common words, "
                         "about one token each")
    ap.add_argument("--output-len", type=_length_arg, default=LengthDist("fixed", 128),
                    help="max_tokens, same forms; sent with ignore_eos: true (llama-server, vLLM and ours honour "
                         "it; a server that ignores it may stop early, and the report counts the tokens received)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prefix-len", type=int, default=0,
                    help="a shared head of about N tokens before every prompt (prefix caching's workload)")
    ap.add_argument("--prefix-groups", type=int, default=1, help="G distinct heads, request i taking head i mod G")
    ap.add_argument("--calibrate", action="store_true",
                    help="measure words per token once through POST /tokenize (ours, llama-server) so prompt "
                         "lengths come out within a token or two (chat templates add their own tokens)")
    ap.add_argument("--no-usage", dest="include_usage", action="store_false",
                    help="do not send stream_options.include_usage; tokens are then counted as text chunks")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per network read")
    ap.add_argument("--json-out", help="also write the JSON report line to this file")
    args = vars(ap.parse_args(argv))
    json_out = args.pop("json_out")
    try:
        return BenchConfig(**args), json_out
    except ValueError as exc:
        ap.error(str(exc))
        raise  # unreachable: ap.error exits


def main(argv: list[str] | None = None) -> dict:
    cfg, json_out = parse_args(argv)
    try:
        report = asyncio.run(run_benchmark(cfg))
    except httpx.HTTPError as exc:  # only the setup calls raise (GET /v1/models, /tokenize); requests record theirs
        raise SystemExit(f"bench_serving: {type(exc).__name__}: {exc}") from None
    print_table(report)
    line = json.dumps(report)
    print(line)
    if json_out:
        with open(json_out, "w") as f:
            f.write(line + "\n")
    return report


if __name__ == "__main__":
    main()
