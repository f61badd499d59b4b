"""The chat engine: sessions with budgeted KV caches, continuous batching on one model thread.

    engine = Engine(model, tokenizer, CacheConfig(policy="h2o", budget=256), EngineConfig())
    engine.start()
    handle = await engine.submit(ChatRequest(messages, SamplingParams(max_new_tokens=64), owner=key_id))
    async for item in handle: ...   # Delta ... then one Finish; GenerationFailed on an internal error
    engine.stop()

How a request finds its conversation (`sessions.SessionStore.claim`, `turn.plan_turn`; what makes
two histories the same conversation, tool calls included, is `conversation`):
- `session_id` given: the owner's session or SessionNotFound; `messages` are only the new ones.
- otherwise the owner's idle session whose messages are the longest strict prefix of `messages`
  (a busy one is skipped: the request starts a new session); else a new session.
- a raw `prompt` (text completions) gets a session of its own that is never kept.
- the session's cache is reused when the rendered conversation starts with the text it consumed;
  only the rest is prefilled. Otherwise (an edited history, a reply cut by a stop string) the whole
  conversation is prefilled afresh in the same session.

When a request ends early: cancelled after its first token, the session keeps the partial reply
(in its cache, messages and consumed text alike); cancelled before, or failed, the session keeps
its previous messages and forgets its cache (untouched if prefill had not started). A session
that never got a reply is dropped.
"""

from server.engine.engine import Engine
from server.engine.handle import Handle
from server.engine.inspection import CacheView
from server.engine.types import (
    ChatRequest, Delta, EngineConfig, EngineError, EngineNotReady, EngineStats, Finish, GenerationFailed,
    Histogram, PromptTooLong, QueueFull, SessionBusy, SessionNotFound, Usage,
)

__all__ = [
    "CacheView", "ChatRequest", "Delta", "Engine", "EngineConfig", "EngineError", "EngineNotReady", "EngineStats",
    "Finish", "GenerationFailed", "Handle", "Histogram", "PromptTooLong", "QueueFull", "SessionBusy",
    "SessionNotFound", "Usage",
]
