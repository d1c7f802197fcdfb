"""Prometheus metrics under vLLM's names, so dashboards built for vLLM read vegaserve unchanged.

Two sources: the engine's own counts (queue lengths, KV use, prefix cache, preemptions, and speculative
decoding's guesses while it runs) are read from `engine.stats()` when Prometheus scrapes; per-request latencies
and token counts are measured here, in the server, from the stream of outputs each request produces. Every app gets its own registry, so several apps
(tests, or one process serving two models) never collide in prometheus-client's global one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from vegaserve.engine.protocol import EngineClient, EngineStats
from vegaserve.engine.request import FinishReason, RequestOutput

logger = logging.getLogger("vegaserve.server")

LABELS = ["model_name"]
# Seconds: from a fast decode step (a few ms) to a long prompt on a slow card (minutes).
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0, 300.0)


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (and the context length itself)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            if step * scale >= max_model_len:
                return (*buckets, float(max_model_len))
            buckets.append(float(step * scale))
        scale *= 10


class _EngineStatsCollector:
    """Reads engine.stats() at scrape time: these numbers live in the engine, not in the server."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine

    def _families(self) -> tuple[GaugeMetricFamily | CounterMetricFamily, ...]:
        return (
            GaugeMetricFamily("vllm:num_requests_running", "Requests in the running batch.", labels=LABELS),
            GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to be scheduled.", labels=LABELS),
            # vLLM's name says "perc" but its value is a fraction in [0, 1]; dashboards expect that.
            GaugeMetricFamily("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use.", labels=LABELS),
            CounterMetricFamily("vllm:num_preemptions", "Requests preempted by the scheduler.", labels=LABELS),
            CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels=LABELS),
            CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels=LABELS),
        )

    def describe(self) -> Iterator[Metric]:
        # Names only, so registering does not call into the engine.
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._engine.stats()
        except Exception:
            # A scrape must keep working while the engine is down; /health reports that.
            logger.warning("engine.stats() failed; engine metrics left out of this scrape", exc_info=True)
            return
        values = (
            stats.num_requests_running,
            stats.num_requests_waiting,
            stats.kv_cache_usage,
            stats.num_preemptions,
            stats.prefix_cache_queries,
            stats.prefix_cache_hits,
        )
        model = [self._engine.model_name]
        for family, value in zip(self._families(), values, strict=True):
            family.add_metric(model, float(value))
            yield family
        if stats.spec_accepted_per_pos:  # one count per draft position while the engine speculates, () otherwise
            yield from _spec_decode_families(stats, model)


def _spec_decode_families(stats: EngineStats, model: list[str]) -> Iterator[Metric]:
    """vLLM's spec_decode counters: the acceptance rate is accepted / draft tokens, the mean accepted length
    1 + accepted / drafts."""
    for name, doc, value in (
        ("vllm:spec_decode_num_drafts", "Verify steps of a sequence that had guesses.", stats.spec_num_drafts),
        ("vllm:spec_decode_num_draft_tokens", "Guessed tokens verified.", stats.spec_num_draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens", "Guessed tokens kept.", stats.spec_num_accepted_tokens),
    ):
        family = CounterMetricFamily(name, doc, labels=LABELS)
        family.add_metric(model, float(value))
        yield family
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Guesses kept, by their position in the draft (0: the first).",
                                  labels=[*LABELS, "position"])
    for position, kept in enumerate(stats.spec_accepted_per_pos):
        per_pos.add_metric([*model, str(position)], float(kept))
    yield per_pos


class ServerMetrics:
    """The app's registry and the server-measured metrics; `track()` one request at a time."""

    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry()
        self.model_name = engine.model_name
        reg = self.registry
        tokens = token_buckets(engine.max_model_len)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", LABELS, registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", LABELS, registry=reg)
        self.request_success = Counter(
            "vllm:request_success", "Finished requests by finish reason.", [*LABELS, "finished_reason"], registry=reg
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", LABELS, buckets=_LATENCY_BUCKETS, registry=reg
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens.", LABELS, buckets=_LATENCY_BUCKETS, registry=reg
        )
        # The name older vLLM dashboards query for the same measurement.
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds", "Time per output token.", LABELS, buckets=_LATENCY_BUCKETS, registry=reg
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.", LABELS,
            buckets=_LATENCY_BUCKETS, registry=reg,
        )
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Prompt length per request.", LABELS, buckets=tokens, registry=reg
        )
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", LABELS, buckets=tokens, registry=reg
        )
        reg.register(_EngineStatsCollector(engine))
        # Create the labelled series now, so they read 0 from the first scrape instead of appearing
        # with the first request (rate() over a series that pops into existence misses its first step).
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.tpot, self.e2e,
                       self.request_prompt_tokens, self.request_generation_tokens):
            metric.labels(self.model_name)
        for reason in FinishReason:
            self.request_success.labels(self.model_name, reason.value)

    def track(self, arrival: float | None = None) -> RequestMetrics:
        return RequestMetrics(self, time.perf_counter() if arrival is None else arrival)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestMetrics:
    """One request's timeline, fed with each output as it streams past."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self._m = metrics
        self._arrival = arrival
        self._last_token_time: float | None = None
        self._num_prompt_tokens = 0
        self._num_generated = 0
        self._done = False

    def on_output(self, out: RequestOutput, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        m, model = self._m, self._m.model_name
        if not self._num_prompt_tokens and out.num_prompt_tokens:
            self._num_prompt_tokens = out.num_prompt_tokens
            m.prompt_tokens.labels(model).inc(out.num_prompt_tokens)
        n_new = len(out.token_ids)
        if n_new:
            if self._last_token_time is None:
                m.ttft.labels(model).observe(now - self._arrival)
            else:
                # Several tokens in one output share the wait evenly, so the histogram stays per token
                # whatever the engine delivers together.
                gap = (now - self._last_token_time) / n_new
                for _ in range(n_new):
                    m.itl.labels(model).observe(gap)
                    m.tpot.labels(model).observe(gap)
            self._last_token_time = now
            self._num_generated += n_new
            m.generation_tokens.labels(model).inc(n_new)
        if out.finish_reason is not None:
            self.finish(out.finish_reason.value, now)

    def finish(self, reason: str, now: float | None = None) -> None:
        """Record the end once; called with 'abort' when the client leaves before the last output."""
        if self._done:
            return
        self._done = True
        now = time.perf_counter() if now is None else now
        m, model = self._m, self._m.model_name
        m.e2e.labels(model).observe(now - self._arrival)
        m.request_prompt_tokens.labels(model).observe(self._num_prompt_tokens)
        m.request_generation_tokens.labels(model).observe(self._num_generated)
        m.request_success.labels(model, reason).inc()
