"""The chat engine: sessions with budgeted KV caches, continuous batching on one model thread."""

from server.engine.engine import Engine
from server.engine.handle import Handle
from server.engine.types import (
    ChatRequest, Delta, EngineConfig, EngineError, EngineNotReady, EngineStats, Finish, GenerationFailed,
    Histogram, PromptTooLong, QueueFull, SessionBusy, SessionNotFound, Usage,
)

__all__ = [
    "ChatRequest", "Delta", "Engine", "EngineConfig", "EngineError", "EngineNotReady", "EngineStats", "Finish",
    "GenerationFailed", "Handle", "Histogram", "PromptTooLong", "QueueFull", "SessionBusy", "SessionNotFound",
    "Usage",
]
