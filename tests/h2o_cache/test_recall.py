"""Recall of evicted tokens: exact contents, budgets, row independence, both decode paths."""

import random

import pytest
import torch

from h2o_cache import CacheConfig, Generator, SamplingParams, StaticDecoder
from h2o_cache.rope import rotate
from tests.conftest import ByteTokenizer, tiny_llama


@pytest.fixture(scope="module")
def peaked_model():
    return tiny_llama(init_std=0.3)  # peaked attention: real heavy hitters, no near-ties


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 128) for _ in range(n)]


def recall_config(**overrides) -> CacheConfig:
    settings = dict(policy="h2o", budget=32, evict_slack=4, prefill_chunk=8,
                    recall_budget=16, recall_block=4, recall_probe=6, recall_archive=256)
    return CacheConfig(**{**settings, **overrides})


def row_state(cache, row: int) -> dict[str, torch.Tensor]:
    n = cache.lengths[row]
    buffers = cache.buffers()
    return {"keys": buffers.keys[:, row, :, :n].clone(), "values": buffers.values[:, row, :, :n].clone(),
            "scores": buffers.scores[:, row, :, :n].clone(), "origins": buffers.origins[:, row, :, :n].clone(),
            "pinned": cache._pinned[:, row, :, :n].clone(), "rotated": buffers.rotated[:, row, :, :n].clone()}


def by_origin(state: dict[str, torch.Tensor], layer: int, head: int) -> dict[int, tuple]:
    origins = state["origins"][layer, head].tolist()
    return {o: (state["keys"][layer, head, i], state["values"][layer, head, i], state["scores"][layer, head, i])
            for i, o in enumerate(origins)}


def test_recalling_every_evicted_token_reproduces_the_full_cache():
    """One layer: every key and value depends on its token alone, so once recall brings back every
    evicted token, in order at its own position, the next pass is the full model's."""
    model = tiny_llama(layers=1)
    gen = Generator(model, ByteTokenizer())
    config = recall_config(recall_budget=64, recall_block=1, recall_probe=2)
    cache = gen.new_cache(1, config)
    ids = random_tokens(44, seed=0)
    gen.prefill(cache, [ids[:42]])  # history: no turn of its own to recall for
    assert cache.lengths == [30] and len(cache.archives[0]) == 12
    logits = gen.prefill(cache, [ids[42:]], recall=True)
    assert cache.recalled == [12] and cache.lengths == [44]
    assert (cache.buffers().origins[:, 0, :, :44] == torch.arange(44)).all()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, rtol=1e-5, atol=1e-5)


def test_a_long_first_turn_recalls_what_its_own_beginning_evicted():
    """Recall is decided once the turn's head is in: a first prompt longer than the budget has an
    archive by then, and its probe brings back every evicted token (one layer: the full model's
    logits, as above)."""
    model = tiny_llama(layers=1)
    gen = Generator(model, ByteTokenizer())
    cache = gen.new_cache(1, recall_config(recall_budget=64, recall_block=1, recall_probe=2))
    ids = random_tokens(44, seed=0)
    logits = gen.prefill(cache, [ids], recall=True)
    assert cache.recalled == [12] and cache.lengths == [44] and len(cache.archives[0]) == 0
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, rtol=1e-5, atol=1e-5)


def test_with_a_budget_above_the_conversation_recall_changes_nothing(peaked_model):
    prompt = random_tokens(40, seed=1)
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    full = Generator(peaked_model, ByteTokenizer(), CacheConfig(policy="full"))
    roomy = Generator(peaked_model, ByteTokenizer(), recall_config(budget=512, evict_slack=8))
    full_cache, roomy_cache = full.new_cache(1), roomy.new_cache(1)
    for turn in range(3):
        ask = prompt[turn * 10:(turn + 1) * 10 + 5]
        [a], [b] = full.generate([ask], params, full_cache), roomy.generate([ask], params, roomy_cache)
        assert a.token_ids == b.token_ids
    assert roomy_cache.archives == [None] and not roomy_cache.can_recall()


def test_recalled_tokens_come_back_exactly_merged_by_origin_and_rotated_to_their_slots(peaked_model):
    gen = Generator(peaked_model, ByteTokenizer())
    cache = gen.new_cache(1, recall_config())
    gen.prefill(cache, [random_tokens(90, seed=2)])
    before, archived = row_state(cache, 0), cache.archives[0].state()
    n, stored = cache.lengths[0], len(cache.archives[0])
    [recalled] = gen.recall(cache, [random_tokens(6, seed=3)])
    assert recalled == 16 and cache.recalled == [16] and cache.lengths == [n + 16]
    assert len(cache.archives[0]) == stored - 16
    after = row_state(cache, 0)
    cos, sin = peaked_model.model.rotary_emb(after["keys"], torch.arange(n + 16)[None])
    torch.testing.assert_close(after["rotated"], rotate(after["keys"], cos[0], sin[0]), rtol=1e-5, atol=1e-5)
    for layer in range(peaked_model.config.num_hidden_layers):
        for head in range(peaked_model.config.num_key_value_heads):
            origins = after["origins"][layer, head].tolist()
            assert origins == sorted(origins)
            old = by_origin(before, layer, head)
            pinned = after["pinned"][layer, head].tolist()
            assert sum(pinned) == 16
            from_archive = {o: (archived["keys"][layer, head, i], archived["values"][layer, head, i],
                                archived["scores"][layer, head, i])
                            for i, o in enumerate(archived["origins"][layer, head].tolist())}
            for (origin, (key, value, score)), is_pinned in zip(by_origin(after, layer, head).items(), pinned):
                source = from_archive if is_pinned else old
                assert origin in source and (origin in old) != is_pinned
                expected = source[origin]
                assert torch.equal(key, expected[0]) and torch.equal(value, expected[1]) and torch.equal(score, expected[2])


def test_pinned_tokens_stay_for_the_turn_then_compete_and_what_loses_returns_to_the_archive(peaked_model):
    gen = Generator(peaked_model, ByteTokenizer())
    config = recall_config()
    cache = gen.new_cache(1, config)
    gen.prefill(cache, [random_tokens(90, seed=4)], recall=True)
    gen.prefill(cache, [random_tokens(10, seed=5)], recall=True)
    pinned = cache._pinned[:, 0, :, :cache.lengths[0]]
    recalled = cache.buffers().origins[:, 0, :, :cache.lengths[0]][pinned].view(-1, 16)
    for token in random_tokens(50, seed=6):  # decode past the budget, several evictions
        gen.step(cache, [[token]])
        assert cache.lengths[0] <= config.budget + 16
        origins = cache.buffers().origins[:, 0, :, :cache.lengths[0]]
        still = cache._pinned[:, 0, :, :cache.lengths[0]]
        assert torch.equal(origins[still].view(-1, 16), recalled)
    seen = cache.seen[0]
    gen.prefill(cache, [random_tokens(8, seed=7)], recall=True)  # the next turn unpins them first
    held = cache.buffers().origins[:, 0, :, :cache.lengths[0]]
    archive = cache.archives[0].state()["origins"]
    for layer in range(held.shape[0]):
        for head in range(held.shape[1]):
            everywhere = sorted(held[layer, head].tolist() + archive[layer, head].tolist())
            assert everywhere == list(range(seen + 8 - cache.archives[0].dropped))  # nothing lost, nothing twice


def test_rows_recall_independently_and_batched_equals_alone(peaked_model):
    gen = Generator(peaked_model, ByteTokenizer())
    config = recall_config()
    turns = [[random_tokens(70, seed=10), random_tokens(9, seed=11), random_tokens(25, seed=12)],
             [random_tokens(50, seed=20), random_tokens(30, seed=21), random_tokens(4, seed=22)]]
    together = gen.new_cache(2, config)
    alone = [gen.new_cache(1, config) for _ in turns]
    for t in range(3):
        batched = gen.prefill(together, [turns[0][t], turns[1][t]], recall=True)
        for row, cache in enumerate(alone):
            single = gen.prefill(cache, [turns[row][t]], recall=True)
            torch.testing.assert_close(batched[row], single[0], rtol=1e-4, atol=1e-5)
    for row, cache in enumerate(alone):
        assert together.recalled[row] == cache.recalled[0] > 0
        a, b = row_state(together, row), row_state(cache, 0)
        assert torch.equal(a["origins"], b["origins"]) and torch.equal(a["pinned"], b["pinned"])
        torch.testing.assert_close(a["keys"], b["keys"], rtol=1e-4, atol=1e-5)


def test_the_static_decoder_decodes_recalled_rows_like_the_transformers_path(peaked_model):
    config = recall_config()
    gen = Generator(peaked_model, ByteTokenizer(), config)
    decoder = StaticDecoder(peaked_model, config, max_rows=2)
    eager = gen.new_cache(0)
    for seed in (30, 31):
        row = gen.new_cache(1)
        gen.prefill(row, [random_tokens(80, seed)], recall=True)
        logits = gen.prefill(row, [random_tokens(7, seed + 100)], recall=True)
        assert row.recalled == [16]
        row.pending = [[int(logits[0].argmax())]]
        eager.extend(row)
        decoder.cache.extend(row)
    for _ in range(40):  # both rows cross the budget with their pinned tokens
        expected = gen.step(eager, eager.pending)
        got = decoder.step()
        assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        for cache in (eager, decoder.cache):
            cache.pending = [[token] for token in expected.argmax(-1).tolist()]
    assert decoder.cache.lengths == eager.lengths and decoder.cache.recalled == eager.recalled == [16, 16]
    for row in range(2):
        assert torch.equal(row_state(decoder.cache, row)["origins"], row_state(eager, row)["origins"])
