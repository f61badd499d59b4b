"""The engine's contract with the HTTP layer: plain dataclasses, no HTTP and no tensors.

The HTTP layer validates a request, turns it into a `ChatRequest` and calls `Engine.submit`, which
raises an `EngineError` subclass (mapped by type to an HTTP status) before anything is streamed,
or returns a `Handle` whose async iteration yields `Delta`s and ends with one `Finish`.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from h2o_cache import Sample, SamplingParams
from server.engine.tool_calls import ToolCall, Tools


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 16  # sequences decoded together in one step
    max_queue: int = 64  # requests waiting or running; more get QueueFull (429)
    max_sessions: int = 256  # live sessions kept; least recently used dropped beyond
    max_archive_bytes: int | None = None  # host bytes of archived KV kept over idle sessions; None: no limit
    session_ttl: float = 1800.0  # seconds an idle session is kept
    max_prompt_tokens: int = 32768  # longest conversation a request may prefill
    prefill_tokens: int = 512  # prompt tokens prefilled per engine iteration (several requests), between decode steps
    enforce_eager: bool = False  # decode on the transformers path, never the fast static step
    exact: bool = False  # the CPU step's products take fp32 activations as they are, not quantized to int8
    context_window: int | None = None  # for policies that never evict (full): prompt + reply limit
    state_dir: str | None = None  # sessions persist there (transcripts, snapshots at shutdown); None: not at all
    max_state_bytes: int = 8 << 30  # bytes of transcripts and snapshots kept in state_dir, oldest dropped first


@dataclass
class ChatRequest:
    messages: list[dict]  # validated, non-empty unless `prompt` is given; see `conversation` for their fields
    params: SamplingParams
    tools: Tools | None = None  # functions the model may call
    grammar: str | None = None  # what the reply must match (`grammar.output_grammar`); None: free text
    prompt: str | None = None  # a raw prompt instead of messages: no template, no session kept
    owner: str = ""  # opaque id of the API key that sent it ("" when auth is off)
    session_id: str | None = None  # client-named session: messages are only the new ones
    request_id: str = ""


@dataclass
class Delta:
    text: str  # never splits a UTF-8 character; may be "" when only logprobs advance
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Sample] = field(default_factory=list)  # one per token when params.logprobs is set


@dataclass
class Usage:
    prompt_tokens: int  # the whole conversation's prompt, as OpenAI counts it
    completion_tokens: int
    cached_tokens: int  # part of prompt_tokens served from the session instead of prefilled
    kv_resident_tokens: int  # tokens the session's cache holds per layer/head after the turn
    conversation_tokens: int  # tokens the session has consumed in all (re-read passages included)
    reread_tokens: int = 0  # tokens of the prompt fed again before its question (`h2o_cache.reread`)


@dataclass
class Finish:
    finish_reason: str  # "stop" | "length" | "tool_calls"
    usage: Usage
    durable: Future | None = None  # done once the turn's transcript is committed (with a state dir)
    tool_calls: list[ToolCall] = field(default_factory=list)


class EngineError(Exception):
    """Base of the errors the engine reports; the HTTP layer maps each type to a status and code."""


class EngineNotReady(EngineError):
    pass


class QueueFull(EngineError):
    retry_after: float = 1.0


class SessionNotFound(EngineError):
    pass


class SessionBusy(EngineError):
    pass


class PromptTooLong(EngineError):
    pass


class GenerationFailed(EngineError):
    pass


class InvalidGrammar(EngineError):
    """The request's output grammar does not build for this model's tokenizer."""


class InvalidTokenId(EngineError):
    """A token id the model's vocabulary does not have; `param` names the field that holds it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class Histogram:
    """Prometheus-style histogram of a duration in seconds.

    counts[i] is the number of observations <= bounds[i] (cumulative); `count` is the +Inf bucket.
    """

    bounds: tuple[float, ...]
    counts: list[int]
    sum: float = 0.0
    count: int = 0


@dataclass
class EngineStats:
    """A snapshot of the engine for /metrics and /health; totals count since the engine started."""

    active_sessions: int  # sessions kept (idle or busy)
    running: int  # sequences in the decode batch
    waiting: int  # sequences queued or prefilling
    resident_kv_tokens: int  # tokens held per layer/head, summed over every session's cache
    resident_kv_bytes: int
    archived_kv_tokens: int  # evicted tokens archived for recall per layer/head, summed over sessions
    archived_kv_bytes: int  # host bytes of those archives
    archives_dropped_total: int  # archives idle sessions lost to --max-archive-bytes
    prompt_tokens_total: int
    generated_tokens_total: int
    cached_tokens_total: int  # prompt tokens served from sessions instead of prefilled
    recalled_tokens_total: int  # tokens per layer/head that turns recalled from archives
    recall_turns_total: int  # turns that recalled at least one block
    decode_steps_total: int
    decode_step_seconds: Histogram
    requests_by_finish: dict[str, int]  # "stop" | "length" | "tool_calls" | "cancelled" | "error" -> count
    state: StateStats | None = None  # None: sessions are not persisted
    latency: dict[str, Histogram] = field(default_factory=dict)  # metrics.LATENCIES name -> histogram


@dataclass
class StateStats:
    """The state directory: what it holds now, and what restored sessions came from since start."""

    sessions: int
    transcript_bytes: int
    snapshot_bytes: int
    restored: dict[str, int]  # "snapshot" | "transcript" -> sessions restored from it
    snapshots_refused: int  # snapshots of another model, cache config or format: the transcript served
