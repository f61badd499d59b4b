"""Planning a turn: which tokens of a conversation a session's cache already holds, which to prefill."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from h2o_cache import CacheConfig, SamplingParams
from server.engine.session import Session
from server.engine.types import EngineConfig, PromptTooLong

Render = Callable[[list[dict], bool], str]  # (messages, add_generation_prompt) -> prompt text


@dataclass
class Turn:
    """What one request feeds to its session's cache.

    prompt_text: the whole conversation rendered with the generation prompt.
    prefill: tokens to feed, the cache's pending token first; never empty.
    prompt_tokens: the conversation's prompt as the model sees it: reused tokens plus new ones.
    cached_tokens: tokens of the conversation the session's cache already consumed (0 when fresh),
        its pending token included.
    continues: whether the session's cache is reused; otherwise it starts empty.
    """

    conversation: list[dict]
    prompt_text: str
    prefill: list[int]
    prompt_tokens: int
    cached_tokens: int
    continues: bool


def plan_turn(session: Session, conversation: list[dict], render: Render, tokenizer) -> Turn:
    """Reuse the session's cache when the rendered conversation extends exactly what it consumed.

    Comparing text rather than messages catches every way the history can diverge from the cache:
    an edited message, a reply the client trimmed, or one cut by a stop string (whose stop tokens
    the cache holds but the reply omits). Those fall back to a fresh prefill of the whole text.
    """
    text = render(conversation, True)
    cache = session.cache
    if cache is not None and session.consumed_text and text.startswith(session.consumed_text):
        new = tokenizer.encode(text[len(session.consumed_text):], add_special_tokens=False)
        pending = list(cache.pending[0])
        if pending or new:
            cached = cache.seen[0] + len(pending) - session.reread  # re-read passages are not the prompt's
            return Turn(conversation, text, pending + new, cached + len(new), cached, continues=True)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return Turn(conversation, text, tokens, len(tokens), cached_tokens=0, continues=False)


def check_length(turn: Turn, params: SamplingParams, cache_config: CacheConfig, config: EngineConfig) -> None:
    """Refuse a turn before it starts: too much to prefill, or no room left for the reply."""
    if len(turn.prefill) > config.max_prompt_tokens:
        raise PromptTooLong(
            f"{len(turn.prefill)} prompt tokens to prefill, more than the limit of {config.max_prompt_tokens}"
        )
    if not cache_config.evicts and config.context_window is not None:
        needed = turn.prompt_tokens + params.max_new_tokens
        if needed > config.context_window:
            raise PromptTooLong(
                f"the conversation ({turn.prompt_tokens} tokens) plus max_tokens ({params.max_new_tokens}) "
                f"exceeds the context window of {config.context_window} tokens"
            )
