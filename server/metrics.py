"""/metrics on `prometheus_client`: the engine's families are collected from its snapshot at scrape
time (nothing is updated per token on the HTTP side), beside the client library's process collector."""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.engine.metrics import LATENCIES
from server.engine.types import EngineStats, Histogram, StateStats

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


class RequestCounter:
    """HTTP responses by status code. Touched only from the event loop, so no lock is needed."""

    def __init__(self):
        self.by_status: Counter[int] = Counter()


class CountResponses:
    """ASGI middleware counting every response by status; an exception that escapes counts as 500.

    Plain ASGI rather than BaseHTTPMiddleware, which would buffer and detach streaming responses.
    """

    def __init__(self, app: ASGIApp, counter: RequestCounter):
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.counter.by_status[message["status"]] += 1
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:
                self.counter.by_status[500] += 1
            raise


def _labelled(family, values: dict) -> Metric:
    for key, value in sorted(values.items()):
        family.add_metric([str(key)], value)
    return family


def _histogram(name: str, help: str, h: Histogram) -> HistogramMetricFamily:
    buckets = [(repr(float(bound)), n) for bound, n in zip(h.bounds, h.counts)] + [("+Inf", h.count)]
    return HistogramMetricFamily(name, help, buckets=buckets, sum_value=h.sum)


def _engine(stats: EngineStats) -> Iterator[Metric]:
    for name, kind, help, value in [
        ("h2o_prompt_tokens_total", CounterMetricFamily, "prompt tokens of finished requests",
         stats.prompt_tokens_total),
        ("h2o_generated_tokens_total", CounterMetricFamily, "tokens generated", stats.generated_tokens_total),
        ("h2o_cached_tokens_total", CounterMetricFamily,
         "prompt tokens served from a session's cache instead of prefilled", stats.cached_tokens_total),
        ("h2o_decode_steps_total", CounterMetricFamily, "decode steps run", stats.decode_steps_total),
        ("h2o_recalled_tokens_total", CounterMetricFamily, "evicted tokens per layer/KV head that turns brought "
         "back from their session's archive (counted when the request ends)", stats.recalled_tokens_total),
        ("h2o_recall_turns_total", CounterMetricFamily, "turns that recalled evicted tokens", stats.recall_turns_total),
        ("h2o_active_sessions", GaugeMetricFamily, "conversations kept, idle or busy", stats.active_sessions),
        ("h2o_running_sequences", GaugeMetricFamily, "sequences in the decode batch", stats.running),
        ("h2o_waiting_sequences", GaugeMetricFamily, "sequences queued or prefilling", stats.waiting),
        ("h2o_resident_kv_tokens", GaugeMetricFamily, "KV tokens held per layer/head, summed over sessions",
         stats.resident_kv_tokens),
        ("h2o_resident_kv_bytes", GaugeMetricFamily, "bytes of KV cache held by all sessions",
         stats.resident_kv_bytes),
        ("h2o_archived_kv_tokens", GaugeMetricFamily, "evicted tokens archived for recall per layer/KV head, "
         "summed over sessions", stats.archived_kv_tokens),
        ("h2o_archived_kv_bytes", GaugeMetricFamily, "host memory of the archives of evicted tokens of all sessions",
         stats.archived_kv_bytes),
        ("h2o_archives_dropped_total", CounterMetricFamily, "archives idle sessions lost to --max-archive-bytes",
         stats.archives_dropped_total),
    ]:
        yield kind(name, help, value=value)
    yield _labelled(CounterMetricFamily("h2o_requests_finished_total", "requests ended, by reason",
                                        labels=["reason"]), stats.requests_by_finish)
    yield _histogram("h2o_decode_step_seconds", "duration of one batched decode step", stats.decode_step_seconds)
    for name, help in LATENCIES.items():
        if name in stats.latency:
            yield _histogram(f"h2o_{name}_seconds", help, stats.latency[name])
    if stats.state is not None:
        yield from _state(stats.state)


def _state(state: StateStats) -> Iterator[Metric]:
    yield _labelled(CounterMetricFamily("h2o_sessions_restored_total", "sessions brought back from the state dir, "
                                        "by source", labels=["source"]), state.restored)
    yield CounterMetricFamily("h2o_snapshots_refused_total",
                              "snapshots of another model, cache config or format (the transcript served instead)",
                              value=state.snapshots_refused)
    yield GaugeMetricFamily("h2o_state_sessions", "sessions kept in the state dir", value=state.sessions)
    state_bytes = GaugeMetricFamily("h2o_state_bytes", "bytes kept in the state dir, by kind", labels=["kind"])
    yield _labelled(state_bytes, {"transcript": state.transcript_bytes, "snapshot": state.snapshot_bytes})


class ServerCollector:
    """What the server knows at scrape time: responses by status, readiness, and the engine's snapshot
    (left out while the model is loading)."""

    def __init__(self, requests: RequestCounter, stats: Callable[[], EngineStats | None]):
        self.requests = requests
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        yield _labelled(CounterMetricFamily("h2o_http_requests_total", "HTTP responses by status code",
                                            labels=["code"]), dict(self.requests.by_status))
        stats = self.stats()
        yield GaugeMetricFamily("h2o_model_ready", "1 once the model is loaded and the engine runs",
                                value=0 if stats is None else 1)
        if stats is not None:
            yield from _engine(stats)


def registry(requests: RequestCounter, stats: Callable[[], EngineStats | None]) -> CollectorRegistry:
    """One registry per app (no module globals): the server's collector and the process collector
    (process_resident_memory_bytes, process_cpu_seconds_total, open fds, ... on Linux)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ServerCollector(requests, stats))
    ProcessCollector(registry=reg)
    return reg


def render(reg: CollectorRegistry) -> bytes:
    return generate_latest(reg)
