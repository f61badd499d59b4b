"""Engine fixtures: the tiny Llama with the byte tokenizer and a plain-text chat template."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from h2o_cache import CacheConfig, SamplingParams
from server.engine import ChatRequest, Engine, EngineConfig, Finish


def render(messages: list[dict], add_generation_prompt: bool) -> str:
    """A prefix-stable template like ChatML, in bytes the tiny vocabulary represents exactly."""
    text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
    return text + ("<assistant>" if add_generation_prompt else "")


def greedy(n: int = 8, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kwargs)


def ask(content: str, params: SamplingParams | None = None, **kwargs) -> ChatRequest:
    return ChatRequest([{"role": "user", "content": content}], params or greedy(), **kwargs)


@dataclass
class Reply:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish: Finish | None = None
    session_id: str = ""


async def collect(handle) -> Reply:
    reply = Reply(session_id=handle.session_id)
    async for item in handle:
        if isinstance(item, Finish):
            reply.finish = item
        else:
            reply.text += item.text
            reply.token_ids += item.token_ids
    return reply


async def until(condition, timeout: float = 30.0) -> None:
    """Wait for something the engine thread does within a step or two."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


@pytest.fixture
def make_engine(tiny_model, byte_tokenizer, exact_model, exact_tokenizer):
    """Build and start engines; every one is stopped at the end of the test."""
    engines = []

    def make(policy: str = "full", budget: int = 64, clock=None, cache: dict | None = None, exact: bool = False,
             **config) -> Engine:
        """cache: more CacheConfig fields (recall); exact: the model with a token for every byte
        (grammars); config: EngineConfig fields."""
        extra = {"clock": clock} if clock else {}
        cache_config = CacheConfig(policy=policy, budget=budget, prefill_chunk=16, **(cache or {}))
        model, tokenizer = (exact_model, exact_tokenizer) if exact else (tiny_model, byte_tokenizer)
        engine = Engine(model, tokenizer, cache_config, EngineConfig(**config), render=render, **extra)
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()
