import pytest

from server.engine.metrics import EngineMetrics


def test_step_histogram_is_cumulative_with_sum_and_count():
    metrics = EngineMetrics(bounds=(0.1, 1.0))
    for seconds in (0.05, 0.1, 0.5, 3.0):
        metrics.observe_step(seconds)
    totals, histogram = metrics.snapshot()
    assert histogram.counts == [2, 3] and histogram.count == 4 and histogram.sum == pytest.approx(3.65)
    assert totals["decode_steps_total"] == 4


def test_requests_are_counted_by_finish_with_their_tokens():
    metrics = EngineMetrics()
    metrics.record_request("stop", prompt_tokens=10, cached_tokens=4, generated_tokens=3)
    metrics.record_request("cancelled", prompt_tokens=5, cached_tokens=0, generated_tokens=1)
    metrics.record_request("stop", prompt_tokens=1, cached_tokens=0, generated_tokens=1)
    totals, _ = metrics.snapshot()
    assert totals["requests_by_finish"] == {"stop": 2, "cancelled": 1}
    assert (totals["prompt_tokens_total"], totals["cached_tokens_total"], totals["generated_tokens_total"]) == (16, 4, 5)


def test_recalled_tokens_are_summed_and_turns_that_recalled_counted():
    metrics = EngineMetrics()
    metrics.record_request("stop", 10, 4, 3, recalled_tokens=32)
    metrics.record_request("stop", 10, 4, 3)
    metrics.record_request("error", 10, 4, 0, recalled_tokens=16)
    totals, _ = metrics.snapshot()
    assert (totals["recalled_tokens_total"], totals["recall_turns_total"]) == (48, 2)


def test_request_latencies_are_histograms_of_their_own():
    metrics = EngineMetrics(request_bounds=(0.1, 1.0))
    metrics.observe("time_to_first_token", [0.05, 2.0])
    metrics.observe("inter_token_latency", [0.01] * 5)
    totals, _ = metrics.snapshot()
    ttft = totals["latency"]["time_to_first_token"]
    assert (ttft.counts, ttft.count, ttft.sum) == ([1, 1], 2, pytest.approx(2.05))
    assert totals["latency"]["inter_token_latency"].counts == [5, 5]
    assert totals["latency"]["queue_time"].count == 0 and set(totals["latency"]) == {
        "time_to_first_token", "inter_token_latency", "e2e_request_latency", "queue_time"}
