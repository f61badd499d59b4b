"""Engine counters and the decode-step latency histogram, written by the engine thread."""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter

from server.engine.types import Histogram

# Seconds: a decode step of a small model on a GPU takes milliseconds, a large batch on a CPU seconds.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class EngineMetrics:
    """Totals since start; `snapshot` copies them under a lock for the asyncio thread."""

    def __init__(self, bounds: tuple[float, ...] = STEP_BUCKETS):
        self.bounds = bounds
        self._bucket_counts = [0] * len(bounds)  # non-cumulative; snapshot accumulates
        self._step_sum = 0.0
        self._step_count = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.cached_tokens = 0
        self.recalled_tokens = 0
        self.recall_turns = 0
        self.finishes: Counter[str] = Counter()
        self._lock = threading.Lock()

    def observe_step(self, seconds: float) -> None:
        with self._lock:
            at = bisect_left(self.bounds, seconds)
            if at < len(self.bounds):
                self._bucket_counts[at] += 1
            self._step_sum += seconds
            self._step_count += 1

    def record_request(self, finish: str, prompt_tokens: int, cached_tokens: int, generated_tokens: int,
                       recalled_tokens: int = 0) -> None:
        """Count a request once it ends: finish is "stop" | "length" | "cancelled" | "error";
        recalled_tokens: what its turn's recall brought back per layer/KV head."""
        with self._lock:
            self.finishes[finish] += 1
            self.prompt_tokens += prompt_tokens
            self.cached_tokens += cached_tokens
            self.generated_tokens += generated_tokens
            self.recalled_tokens += recalled_tokens
            self.recall_turns += recalled_tokens > 0

    def snapshot(self) -> tuple[dict, Histogram]:
        """(totals, decode-step histogram) as plain values."""
        with self._lock:
            cumulative, running = [], 0
            for n in self._bucket_counts:
                running += n
                cumulative.append(running)
            histogram = Histogram(self.bounds, cumulative, self._step_sum, self._step_count)
            totals = dict(
                prompt_tokens_total=self.prompt_tokens,
                generated_tokens_total=self.generated_tokens,
                cached_tokens_total=self.cached_tokens,
                recalled_tokens_total=self.recalled_tokens,
                recall_turns_total=self.recall_turns,
                decode_steps_total=self._step_count,
                requests_by_finish=dict(self.finishes),
            )
            return totals, histogram
