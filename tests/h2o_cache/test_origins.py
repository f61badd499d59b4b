"""Each slot's origin (its token's index in the row's sequence) follows the slot through eviction,
on the transformers path and the fast path alike; `kept_tokens` reads it back."""

import random

import pytest
import torch

from h2o_cache import POLICIES, CacheConfig, Generator, H2OCache, StaticDecoder, forward, model_spec
from h2o_cache.kept import kept_tokens
from tests.conftest import ByteTokenizer, tiny_llama
from tests.h2o_cache.test_cache import distinct_ids, layer0_values, resident_positions
from tests.h2o_cache.test_recall import random_tokens, recall_config

EVICTING = [name for name, policy in POLICIES.items() if policy.evicts]


@pytest.fixture(scope="module")
def peaked_model():
    return tiny_llama(init_std=0.3)  # peaked attention: heads keep different heavy hitters


def origins(cache: H2OCache, row: int) -> torch.Tensor:
    return cache.buffers().origins[:, row, :, :cache.lengths[row]]  # [L, H, n]


class KeyRecord:
    """Keys as written, by origin: a token's keys are recorded when it is the newest in its row
    (the newest token is always in the recent window, so it sits in the last slot)."""

    def __init__(self):
        self.keys: dict[int, list[torch.Tensor]] = {}  # row id -> [L, H, D] per origin

    def record(self, cache: H2OCache, row: int, row_id: int) -> None:
        written = self.keys.setdefault(row_id, [])
        assert len(written) == cache.seen[row] - 1
        written.append(cache.buffers().keys[:, row, :, cache.lengths[row] - 1].clone())

    def check(self, cache: H2OCache, row: int, row_id: int) -> None:
        """The properties every row holds after any number of evictions."""
        held = origins(cache, row)  # [L, H, n]
        assert held.shape[-1] == cache.lengths[row] <= cache.config.budget
        assert bool((held[..., 1:] > held[..., :-1]).all()), "origins must be strictly increasing per head"
        assert held.min() >= 0 and held.max() < cache.seen[row]
        assert bool((held[..., -1] == cache.seen[row] - 1).all())
        written = torch.stack(self.keys[row_id], dim=2)  # [L, H, seen, D]
        expected = written.gather(2, held[..., None].expand(-1, -1, -1, written.shape[-1]))
        assert torch.equal(cache.buffers().keys[:, row, :, :cache.lengths[row]], expected)


@pytest.mark.parametrize("policy", ["h2o", "streaming", "local"])
@pytest.mark.parametrize("rolling, slack", [(True, 1), (True, 4), (False, 4)])
def test_origins_name_the_tokens_layer_0_holds_after_chunked_prefill(tiny_model, policy, rolling, slack):
    """Independent evidence: layer 0's values fingerprint their tokens, so the positions they
    reveal must be the recorded origins."""
    config = CacheConfig(policy=policy, budget=16, position_rolling=rolling, evict_slack=slack)
    ids = distinct_ids(2, 61, seed=2)
    fingerprints = layer0_values(tiny_model, ids)
    cache = H2OCache(model_spec(tiny_model), config, rows=2)
    seen = 0
    for chunk in [5, 1, 9, 3, 20, 1, 18, 4]:
        forward(tiny_model, cache, ids[:, seen:seen + chunk], [chunk, chunk])
        seen += chunk
        for row in range(2):
            assert origins(cache, row)[0].tolist() == resident_positions(cache, fingerprints, row)
    assert seen > 3 * config.budget


@pytest.mark.parametrize("policy", EVICTING)
def test_eager_and_fast_paths_keep_the_same_origins_with_their_keys_through_many_evictions(peaked_model, policy):
    """Rows join (after a prefill) and leave at random steps; after every step, in both paths, each
    head's origins are increasing, within [0, seen), and its keys are the ones written at them."""
    config = CacheConfig(policy=policy, budget=20, evict_slack=3, prefill_chunk=8)
    gen = Generator(peaked_model, ByteTokenizer(), config)
    decoder = StaticDecoder(peaked_model, config, max_rows=3)
    eager, fast = gen.new_cache(0), decoder.cache
    rng = random.Random(1)
    ids: list[int] = []  # row order, the same in both caches
    records = {"eager": KeyRecord(), "fast": KeyRecord()}
    evictions = 0
    for step in range(96):
        if len(ids) < 3 and rng.random() < 0.25:
            row = gen.new_cache(1)
            prompt = [rng.randrange(3, 128) for _ in range(rng.randrange(1, 15))]
            for token in prompt:  # one token a pass, so every token's keys are recorded as written
                gen.step(row, [[token]])
                for record in records.values():
                    record.record(row, 0, step)
            row.pending = [[prompt[-1]]]
            eager.extend(row)
            fast.extend(row)
            ids.append(step)
        if ids and rng.random() < 0.05:
            leaving = rng.randrange(len(ids))
            assert torch.equal(origins(eager.pop(leaving), 0), origins(fast.pop(leaving), 0))
            ids[leaving] = ids[-1]
            ids.pop()
        if not ids:
            continue
        before = list(eager.lengths)
        by_eager = gen.step(eager, eager.pending).argmax(dim=-1).tolist()
        by_fast = decoder.step().argmax(dim=-1).tolist()
        evictions += sum(n < m for n, m in zip(eager.lengths, before))
        eager.pending = [[t] for t in by_eager]
        fast.pending = [[t] for t in by_fast]
        for row, row_id in enumerate(ids):
            for name, cache in (("eager", eager), ("fast", fast)):
                records[name].record(cache, row, row_id)
                records[name].check(cache, row, row_id)
            assert torch.equal(origins(eager, row), origins(fast, row))
    assert evictions > 15


def test_kept_tokens_classifies_sinks_and_the_recent_window(peaked_model):
    config = CacheConfig(policy="streaming", budget=16, evict_slack=4)  # 4 sinks by default
    cache = H2OCache(model_spec(peaked_model), config, rows=1)
    forward(peaked_model, cache, torch.arange(3, 43)[None], [40])
    kept = kept_tokens(cache, 0)
    assert (kept.seen, kept.length, kept.sinks, kept.recent) == (40, 12, 4, 8)
    assert len(kept.heads) == 2 and len(kept.heads[0]) == 2 and kept.heads[0][0].scores is None
    for head in (h for layer in kept.heads for h in layer):
        assert head.positions == [0, 1, 2, 3] + list(range(32, 40))


def test_kept_tokens_gives_each_head_its_own_heavy_hitters_and_scores(peaked_model):
    config = CacheConfig(policy="h2o", budget=16, evict_slack=4)
    cache = H2OCache(model_spec(peaked_model), config, rows=1)
    forward(peaked_model, cache, torch.arange(3, 43)[None], [40])
    kept = kept_tokens(cache, 0)
    assert (kept.length, kept.sinks, kept.recent) == (12, 0, config.recent)
    heads = [h for layer in kept.heads for h in layer]
    assert len({tuple(h.positions) for h in heads}) > 1, "heads should choose their own heavy hitters"
    for head in heads:
        assert head.positions[-config.recent:] == list(range(40 - config.recent, 40))
        assert len(head.scores) == 12 and all(s > 0 for s in head.scores)
    flat = torch.tensor([h.scores for h in heads])
    assert torch.equal(flat, cache.buffers().scores[:, 0, :, :12].reshape(4, 12))


def test_kept_tokens_names_each_heads_recalled_tokens_and_the_archive(peaked_model):
    gen = Generator(peaked_model, ByteTokenizer())
    cache = gen.new_cache(1, recall_config())
    gen.prefill(cache, [random_tokens(20, seed=2)])
    before = kept_tokens(cache, 0)  # within the budget: nothing evicted, archived or recalled
    assert before.recalled == before.archived == 0 and not any(h.recalled for heads in before.heads for h in heads)
    gen.prefill(cache, [random_tokens(70, seed=2)])  # evicts: its later chunks open a window
    gen.prefill(cache, [random_tokens(10, seed=3)], recall=True)
    kept = kept_tokens(cache, 0)
    assert kept.recalled == cache.recalled[0] == 16 and kept.archived == len(cache.archives[0]) > 0
    pinned = cache._pinned[:, 0, :, :cache.lengths[0]]
    scores = cache.buffers().scores[:, 0, :, :cache.lengths[0]]
    for layer, heads in enumerate(kept.heads):
        for h, head in enumerate(heads):
            assert len(head.recalled) == 16 and set(head.recalled) < set(head.positions)
            assert head.recalled == sorted(origins(cache, 0)[layer, h][pinned[layer, h]].tolist())
            # listed by position though the window's slots come first: each score stays with its token
            assert head.positions == sorted(head.positions)
            by_origin = dict(zip(origins(cache, 0)[layer, h].tolist(), scores[layer, h].tolist()))
            assert head.scores == [by_origin[p] for p in head.positions]
            assert not set(head.recalled) & set(head.positions[-kept.recent:])  # recalled tokens are old ones
