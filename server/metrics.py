"""/metrics in the Prometheus text exposition format (0.0.4), written by hand: no client library needed."""

from __future__ import annotations

import os

from collections import Counter

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.engine.types import EngineStats, Histogram, StateStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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


def _family(lines: list[str], name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
    lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{labels} {_number(value)}" for labels, value in samples]


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _histogram(lines: list[str], name: str, help: str, h: Histogram) -> None:
    samples = [(f'_bucket{{le="{bound}"}}', n) for bound, n in zip(h.bounds, h.counts)]
    samples += [('_bucket{le="+Inf"}', h.count), ("_sum", h.sum), ("_count", h.count)]
    lines += [f"# HELP {name} {help}", f"# TYPE {name} histogram"]
    lines += [f"{name}{suffix} {_number(value)}" for suffix, value in samples]


def resident_memory_bytes() -> int | None:
    """The process's resident set now (Linux /proc; None elsewhere), as Prometheus clients name it."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _state(lines: list[str], state: StateStats) -> None:
    _family(lines, "h2o_sessions_restored_total", "counter", "sessions brought back from the state dir, by source",
            [(f'{{source="{source}"}}', n) for source, n in sorted(state.restored.items())])
    _family(lines, "h2o_snapshots_refused_total", "counter",
            "snapshots of another model, cache config or format (the transcript served instead)",
            [("", state.snapshots_refused)])
    _family(lines, "h2o_state_sessions", "gauge", "sessions kept in the state dir", [("", state.sessions)])
    _family(lines, "h2o_state_bytes", "gauge", "bytes kept in the state dir, by kind",
            [('{kind="transcript"}', state.transcript_bytes), ('{kind="snapshot"}', state.snapshot_bytes)])


def render(requests: RequestCounter, stats: EngineStats | None) -> str:
    """The exposition text; the engine's families are left out while the model is loading."""
    lines: list[str] = []
    _family(lines, "h2o_http_requests_total", "counter", "HTTP responses by status code",
            [(f'{{code="{code}"}}', n) for code, n in sorted(requests.by_status.items())])
    _family(lines, "h2o_model_ready", "gauge", "1 once the model is loaded and the engine runs",
            [("", 0 if stats is None else 1)])
    rss = resident_memory_bytes()
    if rss is not None:
        _family(lines, "process_resident_memory_bytes", "gauge", "resident memory of the server process",
                [("", rss)])
    if stats is None:
        return "\n".join(lines) + "\n"
    for name, kind, help, value in [
        ("h2o_prompt_tokens_total", "counter", "prompt tokens of finished requests", stats.prompt_tokens_total),
        ("h2o_generated_tokens_total", "counter", "tokens generated", stats.generated_tokens_total),
        ("h2o_cached_tokens_total", "counter", "prompt tokens served from a session's cache instead of prefilled",
         stats.cached_tokens_total),
        ("h2o_decode_steps_total", "counter", "decode steps run", stats.decode_steps_total),
        ("h2o_recalled_tokens_total", "counter", "evicted tokens per layer/KV head that turns brought back from "
         "their session's archive (counted when the request ends)", stats.recalled_tokens_total),
        ("h2o_recall_turns_total", "counter", "turns that recalled evicted tokens", stats.recall_turns_total),
        ("h2o_active_sessions", "gauge", "conversations kept, idle or busy", stats.active_sessions),
        ("h2o_running_sequences", "gauge", "sequences in the decode batch", stats.running),
        ("h2o_waiting_sequences", "gauge", "sequences queued or prefilling", stats.waiting),
        ("h2o_resident_kv_tokens", "gauge", "KV tokens held per layer/head, summed over sessions",
         stats.resident_kv_tokens),
        ("h2o_resident_kv_bytes", "gauge", "bytes of KV cache held by all sessions", stats.resident_kv_bytes),
        ("h2o_archived_kv_tokens", "gauge", "evicted tokens archived for recall per layer/KV head, summed over "
         "sessions", stats.archived_kv_tokens),
        ("h2o_archived_kv_bytes", "gauge", "host memory of the archives of evicted tokens of all sessions",
         stats.archived_kv_bytes),
        ("h2o_archives_dropped_total", "counter", "archives idle sessions lost to --max-archive-bytes",
         stats.archives_dropped_total),
    ]:
        _family(lines, name, kind, help, [("", value)])
    _family(lines, "h2o_requests_finished_total", "counter", "requests ended, by reason",
            [(f'{{reason="{reason}"}}', n) for reason, n in sorted(stats.requests_by_finish.items())])
    _histogram(lines, "h2o_decode_step_seconds", "duration of one batched decode step", stats.decode_step_seconds)
    if stats.state is not None:
        _state(lines, stats.state)
    return "\n".join(lines) + "\n"
