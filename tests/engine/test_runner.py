"""The runner's two decode paths: the fast static step and --enforce-eager serve the same tokens."""

import asyncio
import logging
from types import SimpleNamespace

import pytest

from h2o_cache import CacheConfig, Generator, Sampler, SamplingParams, StaticDecoder, compaction
from server.engine import ChatRequest, GenerationFailed
from server.engine.runner import ModelRunner
from tests.engine.conftest import ask, collect, greedy, render

PROMPTS = ["hello there", "what is a cache?", "x", "tell me a long story about heavy hitters", "abc abc abc"]


async def replies(engine, requests):
    handles = [await engine.submit(r) for r in requests]
    return await asyncio.gather(*(collect(h) for h in handles))


def test_evicting_policies_decode_on_the_fast_path_unless_eager(make_engine):
    assert make_engine(policy="h2o", budget=24).runner.fast
    assert not make_engine(policy="h2o", budget=24, enforce_eager=True).runner.fast
    assert not make_engine(policy="full").runner.fast  # no fixed shape


@pytest.mark.parametrize("policy", ["h2o", "streaming", "local"])
async def test_fast_and_eager_engines_serve_the_same_tokens(make_engine, policy):
    """Rows join and leave at different steps, batches are padded (5 rows in a bucket of 8), rows
    evict at different steps; sampled rows follow their own seeds."""
    requests = [ask(p, greedy(40 - 5 * i)) for i, p in enumerate(PROMPTS)]
    requests.append(ask("sampled", SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7)))
    results = []
    for eager in (False, True):
        engine = make_engine(policy=policy, budget=24, max_batch_size=8, enforce_eager=eager)
        results.append(await replies(engine, requests))
        conversation = results[-1][0].finish.usage.conversation_tokens
        assert conversation > 24 + 8  # the first request's row evicted while it decoded
    fast, eager = results
    assert [r.token_ids for r in fast] == [r.token_ids for r in eager]


async def test_a_failed_fast_step_is_retried_so_only_the_failing_row_fails(make_engine, monkeypatch):
    engine = make_engine(policy="h2o", budget=24)
    healthy = ask("hello there", greedy(20))
    alone = await collect(await engine.submit(healthy))
    bad = ask("a prompt whose row fails once it decodes", greedy(20))
    threshold = len(engine.tokenizer.encode(render(bad.messages, True)))

    def failing_fast_step(evict=True):
        raise RuntimeError("injected failure of the fast step")

    step = engine.generator.step

    def failing_step(cache, pieces, ahead=None):  # the transformers path fails only for the bad row
        if any(len(p) == 1 and cache.seen[row] >= threshold for row, p in enumerate(pieces)):
            raise RuntimeError("injected failure")
        return step(cache, pieces, ahead)

    monkeypatch.setattr(engine.runner.decoder, "step", failing_fast_step)
    monkeypatch.setattr(engine.generator, "step", failing_step)
    handles = [await engine.submit(r) for r in (healthy, bad)]
    together, failed = await asyncio.gather(*(collect(h) for h in handles), return_exceptions=True)
    assert isinstance(failed, GenerationFailed)
    assert together.token_ids == alone.token_ids
    monkeypatch.undo()
    assert len((await collect(await engine.submit(ChatRequest(bad.messages, greedy(3))))).token_ids) == 3


def test_exact_reaches_the_fast_path(tiny_model, byte_tokenizer, monkeypatch):
    asked = []
    monkeypatch.setattr("server.engine.runner.StaticDecoder",
                        lambda *args, **kwargs: asked.append(kwargs["exact"]) or StaticDecoder(*args, **kwargs))
    generator = Generator(tiny_model, byte_tokenizer, CacheConfig(policy="h2o", budget=24, prefill_chunk=16))
    ModelRunner(generator, max_batch_size=4, exact=True)
    ModelRunner(generator, max_batch_size=4)
    assert asked == [True, False]


def test_a_fast_path_that_fails_to_start_falls_back_to_eager_with_a_warning(tiny_model, byte_tokenizer, monkeypatch,
                                                                            caplog):
    """Capturing CUDA graphs on a machine without CUDA fails as a capture failure (or out of memory)
    would on a GPU: the server must still start."""
    monkeypatch.setattr("server.engine.runner.StaticDecoder",
                        lambda *args, **kwargs: StaticDecoder(*args, **kwargs, cuda_graphs=True))
    generator = Generator(tiny_model, byte_tokenizer, CacheConfig(policy="h2o", budget=24, prefill_chunk=16))
    with caplog.at_level(logging.WARNING, logger="server.engine.runner"):
        runner = ModelRunner(generator, max_batch_size=4)
    assert not runner.fast
    assert any("transformers path" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_an_eviction_that_fails_after_a_fast_step_fails_its_rows_and_feeds_no_token_twice(
        tiny_model, byte_tokenizer, monkeypatch):
    config = CacheConfig(policy="h2o", budget=24, evict_slack=4, prefill_chunk=16)
    generator = Generator(tiny_model, byte_tokenizer, config)
    runner = ModelRunner(generator, max_batch_size=4)
    assert runner.fast
    for n in (24, 9, 17):  # the first row crosses the budget at the next step
        row = generator.new_cache(1)
        generator.prefill(row, [list(range(3, 3 + n))])
        row.pending = [[5]]
        runner.batch.extend(row)
    seqs = [SimpleNamespace(matcher=None, sampler=Sampler(SamplingParams())) for _ in range(3)]
    seen = list(runner.batch.seen)

    def failing_evict(cache, rows):
        raise RuntimeError("injected failure of an eviction")

    monkeypatch.setattr(compaction, "evict", failing_evict)
    results = runner.decode(seqs)
    assert isinstance(results[0], RuntimeError) and all(not isinstance(r, Exception) for r in results[1:])
    assert runner.batch.seen == [n + 1 for n in seen]  # each row was fed its pending token once
