"""server/metrics.py: vLLM's metric names on /metrics, moved by requests and read from engine.stats()."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vegaserve.engine.request import FinishReason, RequestOutput
from vegaserve.server.metrics import ServerMetrics, token_buckets

VLLM_NAMES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
    "vllm:time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
    "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
]


def scrape(client) -> dict[tuple[str, frozenset], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset({"model_name": "fake-model", **labels}.items())), 0.0)


def test_all_vllm_names_are_exposed_with_the_model_label_after_a_request(client):
    client.post("/v1/completions", json={"prompt": "abc"})
    names = {name for name, labels in scrape(client) if ("model_name", "fake-model") in labels}
    assert set(VLLM_NAMES) <= names


def test_request_moves_the_token_counters_and_histograms_by_its_usage(client):
    before = scrape(client)
    usage = client.post("/v1/completions", json={"prompt": "abcde"}).json()["usage"]
    after = scrape(client)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("vllm:prompt_tokens_total") == usage["prompt_tokens"]
    assert moved("vllm:generation_tokens_total") == usage["completion_tokens"]
    assert moved("vllm:request_success_total", finished_reason="stop") == 1
    assert moved("vllm:request_prompt_tokens_sum") == usage["prompt_tokens"]
    assert moved("vllm:request_generation_tokens_sum") == usage["completion_tokens"]
    assert moved("vllm:time_to_first_token_seconds_count") == 1
    assert moved("vllm:e2e_request_latency_seconds_count") == 1
    # One gap between each pair of consecutive tokens (the fake sends one token per output).
    assert moved("vllm:inter_token_latency_seconds_count") == usage["completion_tokens"] - 1
    assert moved("vllm:time_per_output_token_seconds_count") == usage["completion_tokens"] - 1


def test_length_finish_is_counted_under_its_reason(client):
    client.post("/v1/completions", json={"prompt": "abcde", "max_tokens": 1})
    samples = scrape(client)
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 1
    assert value(samples, "vllm:request_success_total", finished_reason="stop") == 0


def test_engine_gauges_and_counters_are_read_from_stats_at_scrape_time(client, engine):
    engine.stats_value = replace(engine.stats_value, num_requests_running=7, kv_cache_usage=0.5, prefix_cache_hits=33)
    samples = scrape(client)
    stats = engine.stats_value
    assert value(samples, "vllm:num_requests_running") == stats.num_requests_running
    assert value(samples, "vllm:num_requests_waiting") == stats.num_requests_waiting
    assert value(samples, "vllm:kv_cache_usage_perc") == stats.kv_cache_usage
    assert value(samples, "vllm:num_preemptions_total") == stats.num_preemptions
    assert value(samples, "vllm:prefix_cache_queries_total") == stats.prefix_cache_queries
    assert value(samples, "vllm:prefix_cache_hits_total") == stats.prefix_cache_hits


def test_a_failing_stats_call_leaves_engine_metrics_out_but_the_scrape_works(client, engine):
    def broken():
        raise RuntimeError("engine gone")

    engine.stats = broken
    samples = scrape(client)
    assert not any(name == "vllm:num_requests_running" for name, _ in samples)
    assert any(name.startswith("vllm:prompt_tokens") for name, _ in samples)


def test_each_app_has_its_own_registry(fake):
    first, second = ServerMetrics(fake.FakeEngine()), ServerMetrics(fake.FakeEngine())
    first.prompt_tokens.labels("fake-model").inc(5)
    assert re.search(r'vllm:prompt_tokens_total\{model_name="fake-model"\} 5\.0', first.render()[0].decode())
    assert re.search(r'vllm:prompt_tokens_total\{model_name="fake-model"\} 0\.0', second.render()[0].decode())


def test_tokens_arriving_together_share_the_gap_evenly(fake):
    metrics = ServerMetrics(fake.FakeEngine())
    tracker = metrics.track(arrival=0.0)

    def out(ids: list[int], reason: FinishReason | None = None) -> RequestOutput:
        return RequestOutput("r", "", ids, finish_reason=reason, num_prompt_tokens=4)

    tracker.on_output(out([1]), now=1.0)
    tracker.on_output(out([2, 3, 4, 5]), now=3.0)  # four tokens, two seconds after the first
    tracker.on_output(out([], FinishReason.STOP), now=3.5)
    samples = {s.name: s.value for f in text_string_to_metric_families(metrics.render()[0].decode()) for s in f.samples}
    assert samples["vllm:time_to_first_token_seconds_sum"] == pytest.approx(1.0)
    assert samples["vllm:inter_token_latency_seconds_count"] == 4
    assert samples["vllm:inter_token_latency_seconds_sum"] == pytest.approx(2.0)
    assert samples["vllm:e2e_request_latency_seconds_sum"] == pytest.approx(3.5)
    assert samples["vllm:request_generation_tokens_sum"] == 5


@pytest.mark.parametrize("max_len", [1, 7, 100, 4096])
def test_token_buckets_rise_and_end_at_the_context_length(max_len):
    buckets = token_buckets(max_len)
    assert list(buckets) == sorted(set(buckets))
    assert buckets[-1] == max_len and all(b <= max_len for b in buckets)


def test_a_fresh_app_exposes_its_series_at_zero_before_any_request(client):
    samples = scrape(client)
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:e2e_request_latency_seconds_count"):
        assert (name, frozenset({("model_name", "fake-model")})) in samples
    for reason in ("stop", "length", "abort"):
        assert samples[("vllm:request_success_total",
                        frozenset({("model_name", "fake-model"), ("finished_reason", reason)}))] == 0


def test_speculative_decoding_metrics_are_not_exported_while_it_does_not_run(client):
    client.post("/v1/completions", json={"prompt": "abc"})
    text = client.get("/metrics").text
    families = {family.name for family in text_string_to_metric_families(text)}
    assert not [name for name in families if "spec_decode" in name]
    assert "spec_decode" not in text


def test_speculative_decoding_counters_are_read_from_stats_while_it_runs(client, engine):
    engine.stats_value = replace(engine.stats_value, spec_num_drafts=9, spec_num_draft_tokens=30,
                                 spec_num_accepted_tokens=17, spec_accepted_per_pos=(8, 5, 4))
    samples = scrape(client)
    assert value(samples, "vllm:spec_decode_num_drafts_total") == 9
    assert value(samples, "vllm:spec_decode_num_draft_tokens_total") == 30
    assert value(samples, "vllm:spec_decode_num_accepted_tokens_total") == 17
    per_pos = [value(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(j)) for j in range(4)]
    assert per_pos == [8, 5, 4, 0]
