"""Engine counters and latency histograms, written by the engine thread, read by /metrics."""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter

from server.engine.types import Histogram

# Seconds: a decode step of a small model on a GPU takes milliseconds, a large batch on a CPU seconds.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Seconds a request waits, to its first token, or to its end: milliseconds to minutes.
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

LATENCIES = {
    "time_to_first_token": "seconds from a request's arrival to its first token",
    "inter_token_latency": "seconds between two tokens of a reply",
    "e2e_request_latency": "seconds from a request's arrival to its last token",
    "queue_time": "seconds a request waited before its prefill started",
}


class _Buckets:
    """One histogram's running counts (non-cumulative; `histogram` accumulates)."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        at = bisect_left(self.bounds, seconds)
        if at < len(self.bounds):
            self.counts[at] += 1
        self.sum += seconds
        self.count += 1

    def histogram(self) -> Histogram:
        cumulative, running = [], 0
        for n in self.counts:
            running += n
            cumulative.append(running)
        return Histogram(self.bounds, cumulative, self.sum, self.count)


class EngineMetrics:
    """Totals since start; `snapshot` copies them under a lock for the asyncio thread."""

    def __init__(self, bounds: tuple[float, ...] = STEP_BUCKETS, request_bounds: tuple[float, ...] = REQUEST_BUCKETS):
        self._step = _Buckets(bounds)
        self._latency = {name: _Buckets(request_bounds) for name in LATENCIES}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.cached_tokens = 0
        self.recalled_tokens = 0
        self.recall_turns = 0
        self.finishes: Counter[str] = Counter()
        self._lock = threading.Lock()

    def observe_step(self, seconds: float) -> None:
        with self._lock:
            self._step.observe(seconds)

    def observe(self, latency: str, seconds: list[float]) -> None:
        """Observations of one of `LATENCIES` (a step's worth at once: one lock)."""
        with self._lock:
            for s in seconds:
                self._latency[latency].observe(s)

    def record_request(self, finish: str, prompt_tokens: int, cached_tokens: int, generated_tokens: int,
                       recalled_tokens: int = 0) -> None:
        """Count a request once it ends: finish is "stop" | "length" | "tool_calls" | "cancelled" |
        "error"; recalled_tokens: what its turn's recall brought back per layer/KV head."""
        with self._lock:
            self.finishes[finish] += 1
            self.prompt_tokens += prompt_tokens
            self.cached_tokens += cached_tokens
            self.generated_tokens += generated_tokens
            self.recalled_tokens += recalled_tokens
            self.recall_turns += recalled_tokens > 0

    def snapshot(self) -> tuple[dict, Histogram]:
        """(totals, decode-step histogram) as plain values; totals["latency"] holds the request latencies."""
        with self._lock:
            totals = dict(
                prompt_tokens_total=self.prompt_tokens,
                generated_tokens_total=self.generated_tokens,
                cached_tokens_total=self.cached_tokens,
                recalled_tokens_total=self.recalled_tokens,
                recall_turns_total=self.recall_turns,
                decode_steps_total=self._step.count,
                requests_by_finish=dict(self.finishes),
                latency={name: buckets.histogram() for name, buckets in self._latency.items()},
            )
            return totals, self._step.histogram()
