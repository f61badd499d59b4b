"""A session's cache as the inspector shows it: which tokens each layer and KV head still holds.

The snapshot is taken on the engine thread between two steps (`Scheduler.call`), wherever the
session's row lives at that moment: its own cache between turns, the cache being prefilled, or its
row of the batch cache during a reply. So it never reads a tensor the engine is writing, and its
cost (one copy of a row's origins and scores) is paid only when someone asks.
"""

from __future__ import annotations

import asyncio
from array import array
from dataclasses import dataclass
from typing import Callable, TypeVar

from h2o_cache.kept import KeptTokens, kept_tokens
from server.engine.scheduler import Scheduler
from server.engine.session import Session

T = TypeVar("T")


@dataclass
class CacheView:
    """What a session's cache holds, with the text of the conversation's last tokens.

    live: True when read from the request in flight (mid-reply); False: as the last turn left it.
    kept: None when the session holds no cache (its last turn failed or was cancelled before a token).
    tokens: tokens[i] is the text of the token at position first_position + i; they run to the end of
        the conversation (the pending token, sampled but not fed yet, included).
    turns: after each completed turn, (conversation tokens, resident tokens per layer and head).
    """

    session_id: str
    live: bool
    conversation_tokens: int
    kept: KeptTokens | None
    first_position: int
    tokens: list[str]
    turns: list[tuple[int, int]]


def snapshot(scheduler: Scheduler, session: Session) -> tuple[KeptTokens | None, array, bool]:
    """(kept tokens, token ids, live) of the session's row now; engine thread only, between steps."""
    for row, seq in enumerate(scheduler.running):  # running[i] is row i of the batch
        if seq.session is session:
            return kept_tokens(scheduler.batch, row), seq.token_ids, True
    for seq in scheduler.waiting:
        if seq.session is session and seq.cache is not None:  # prefilling on its own cache
            return kept_tokens(seq.cache, 0), seq.token_ids, True
    cache = session.cache  # idle, or its request has not started: the last turn's state
    return (kept_tokens(cache, 0) if cache is not None else None), session.token_ids, False


async def on_engine_thread(scheduler: Scheduler, fn: Callable[[], T]) -> T:
    """Run `fn` on the engine thread before its next step; its result or exception comes back here."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error) -> None:
        if not future.done():  # the caller may have gone (client disconnected)
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except Exception as exc:  # handed to the caller, who maps it like any other
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the event loop is gone: nobody waits
            pass

    scheduler.call(run)
    return await future


def spell(tokenizer, ids: array) -> list[str]:
    """Each token's own text (special tokens spelled out; a token holding part of a UTF-8 character
    shows U+FFFD)."""
    return [tokenizer.decode([token], skip_special_tokens=False) for token in ids]
