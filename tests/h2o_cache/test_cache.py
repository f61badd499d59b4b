"""H2OCache against transformers' DynamicCache, and its invariants under eviction."""

import pytest
import torch
from transformers import DynamicCache

from h2o_cache import CacheConfig, H2OCache, compaction, forward, model_spec
from h2o_cache.archive import Archive
from tests.conftest import tiny_llama

POLICIES = ["h2o", "streaming", "local", "full"]
EXACT = "donot_use_mm_for_euclid_dist"


def feed(model, cache, ids, chunk):
    """Feed ids [B, T] in chunks; return logits of every position [B, T, V]."""
    out = [forward(model, cache, ids[:, s:s + chunk], [ids[:, s:s + chunk].shape[1]] * ids.shape[0], all_logits=True)
           for s in range(0, ids.shape[1], chunk)]
    return torch.cat(out, dim=1)


def distinct_ids(rows, n, seed):
    """Token ids without repeats in a row, so each position has its own fingerprint."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(125, generator=gen)[:n] + 3 for _ in range(rows)])


def layer0_values(model, ids):
    """Layer-0 values depend on the token alone: [B, H_kv, T, D], a fingerprint of each position."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    return cache.layers[0].values


def resident_positions(cache, fingerprints, row):
    """Original positions held by each KV head of layer 0, recovered from the value vectors."""
    n = cache.lengths[row]
    held = cache.buffers().values[0, row, :, :n]  # [H, n, D]
    dist = torch.cdist(held, fingerprints[row], compute_mode=EXACT)  # [H, n, T]
    apart = torch.cdist(fingerprints[row], fingerprints[row], compute_mode=EXACT)
    separation = apart[apart > 0].min()
    assert dist.min(dim=-1).values.max() < separation / 100  # every match is unambiguous
    return dist.argmin(dim=-1).tolist()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_budget_above_length_reproduces_full_cache_logits(tiny_model, policy, chunk):
    ids = torch.randint(3, 128, (2, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = tiny_model(ids).logits
    cache = H2OCache(model_spec(tiny_model), CacheConfig(policy=policy, budget=64), rows=2)
    assert torch.allclose(feed(tiny_model, cache, ids, chunk), reference, atol=1e-5)


@pytest.mark.parametrize("policy", ["h2o", "streaming", "local"])
@pytest.mark.parametrize("rolling, slack", [(True, 1), (True, 4), (False, 4)])
def test_resident_tokens_obey_budget_recent_window_and_order(tiny_model, policy, rolling, slack):
    config = CacheConfig(policy=policy, budget=16, position_rolling=rolling, evict_slack=slack)
    ids = distinct_ids(2, 61, seed=2)
    fingerprints = layer0_values(tiny_model, ids)
    cache = H2OCache(model_spec(tiny_model), config, rows=2)
    seen = resident = 0
    for chunk in [5, 1, 1, 9, 1, 3, 20, 1, 1, 1, 18]:
        forward(tiny_model, cache, ids[:, seen:seen + chunk], [chunk, chunk])
        seen += chunk
        resident = resident + chunk if resident + chunk <= 16 else 16 - slack
        assert cache.lengths == [resident] * 2 and cache.seen == [seen] * 2
        for row in range(2):
            for positions in resident_positions(cache, fingerprints, row):
                assert positions == sorted(positions) and len(set(positions)) == len(positions)
                assert set(range(max(0, seen - config.recent), seen)) <= set(positions)
                assert set(range(min(config.sinks, seen))) <= set(positions)


def test_h2o_heads_keep_different_tokens_and_rows_do_not_mix():
    tiny_model = tiny_llama(init_std=0.3)  # peaked attention, so heads disagree on heavy hitters
    config = CacheConfig(policy="h2o", budget=12)
    ids = distinct_ids(2, 40, seed=3)
    ids[1] = ids[0]  # same text in both rows...
    fingerprints = layer0_values(tiny_model, ids)
    cache = H2OCache(model_spec(tiny_model), config, rows=2)
    forward(tiny_model, cache, ids[:, :30], [30, 20])  # ...fed differently: row 1 has only 20 tokens
    forward(tiny_model, cache, ids[:, 30:40], [10, 10])
    held0 = resident_positions(cache, fingerprints, 0)
    assert held0[0] != held0[1], "KV heads should choose their own heavy hitters"
    alone = H2OCache(model_spec(tiny_model), config, rows=1)
    forward(tiny_model, alone, ids[:1, :30], [30])
    forward(tiny_model, alone, ids[:1, 30:40], [10])
    assert resident_positions(alone, fingerprints[:1], 0) == held0


def test_scores_are_fp32_attention_sums_per_kv_head(tiny_model):
    """Accumulated scores equal eager attention weights summed over queries and each head's group."""
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(4))
    tiny_model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = tiny_model(ids, output_attentions=True).attentions
    finally:
        tiny_model.set_attn_implementation("sdpa")
    cache = H2OCache(model_spec(tiny_model), CacheConfig(policy="h2o", budget=64), rows=1)
    feed(tiny_model, cache, ids, chunk=6)
    for scores, weights in zip(cache.buffers().scores, attentions):  # weights: [1, H_q, T, T]
        expected = weights.sum(dim=2).view(1, 2, 2, 20).sum(dim=2)  # group of 2 query heads per KV head
        assert scores.dtype == torch.float32
        assert torch.allclose(scores[:, :, :20], expected, atol=1e-5)


def test_batched_rows_equal_single_rows_under_eviction(tiny_model):
    config = CacheConfig(policy="h2o", budget=10, prefill_chunk=8)
    spec = model_spec(tiny_model)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (25, 9, 17)]
    batch = H2OCache(spec, config, rows=3)
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    batched = forward(tiny_model, batch, ids, [len(p) for p in prompts])
    for row, prompt in enumerate(prompts):
        single = H2OCache(spec, config, rows=1)
        alone = forward(tiny_model, single, torch.tensor([prompt]), [len(prompt)])
        assert torch.allclose(batched[row], alone[0], atol=1e-5)
        n = single.lengths[0]
        assert batch.lengths[row] == n
        # rows 0 and 2 evict in one call (not a contiguous range of rows), row 1 does not
        for name in ("keys", "values", "rotated", "scores", "origins"):
            mine, theirs = getattr(single.buffers(), name)[:, 0, :, :n], getattr(batch.buffers(), name)[:, row, :, :n]
            assert torch.allclose(mine.double(), theirs.double(), atol=1e-5), name


def test_a_kept_eviction_scratch_changes_nothing_but_allocations(tiny_model, monkeypatch):
    """A batch cache reserved with scratch=True (the static decoder's) evicts exactly as one without,
    whichever rows cross the budget together, and allocates nothing more once full (the torch path:
    the native compaction moves vectors in place, with no scratch)."""
    monkeypatch.setattr(compaction, "native_compaction", lambda cache: False)
    config = CacheConfig(policy="h2o", budget=12, evict_slack=3, recall_budget=4, recall_block=2)
    spec = model_spec(tiny_model)
    plain, kept = H2OCache(spec, config, rows=3), H2OCache(spec, config, rows=3)
    kept.reserve(3, 20, scratch=True)
    gen = torch.Generator().manual_seed(9)
    allocated = []
    for step in range(30):
        n_new = [1 + (step + row) % 3 for row in range(3)]  # rows cross the budget at different steps
        ids = torch.randint(3, 128, (3, max(n_new)), generator=gen)
        for cache in (plain, kept):
            forward(tiny_model, cache, ids, n_new)
        assert plain.lengths == kept.lengths
        for row, n in enumerate(plain.lengths):
            for name in ("keys", "values", "rotated", "scores", "origins"):
                mine, theirs = getattr(plain.buffers(), name)[:, row, :, :n], getattr(kept.buffers(), name)[:, row, :, :n]
                assert torch.equal(mine, theirs), (step, row, name)
        assert plain.archived_tokens() == kept.archived_tokens()
        allocated.append(kept.allocated_bytes())
    assert kept._scratch is not None and plain._scratch is None
    assert len(set(allocated[10:])) == 1


@pytest.mark.parametrize("config", [
    CacheConfig(policy="h2o", budget=12, evict_slack=3, recall_budget=4, recall_block=2),
    CacheConfig(policy="h2o", budget=12, evict_slack=2),
    CacheConfig(policy="h2o", budget=12, evict_slack=2, position_rolling=False),
    CacheConfig(policy="streaming", budget=10),
], ids=["recall", "h2o", "no-rolling", "streaming"])
@pytest.mark.parametrize("lockstep", [False, True], ids=["apart", "rows-0-and-2-in-lockstep"])
def test_the_native_compaction_moves_and_rotates_as_the_torch_ops_bit_for_bit(tiny_model, monkeypatch, config, lockstep):
    """On the CPU in fp32 an eviction's kept vectors move and rotate in one C++ call, what it drops goes
    to the archive in one call per row, and the archive's blocks are formed in one call; the same rows
    fed the same tokens on the torch path (`move_kept`, `archive`, `Archive._digests`) end with the
    same buffers and archives (tokens, order, digests), bit for bit, whichever rows cross the budget
    together (non-contiguous rows, a recall window kept in place; in lockstep, rows 0 and 2 drop as
    many tokens at once, which the torch path takes together, and row 1 sometimes another count)."""
    spec = model_spec(tiny_model)
    assert spec.head_dim % 16 == 0 and compaction.native_compaction(H2OCache(spec, config, rows=1))
    native, torch_ops = H2OCache(spec, config, rows=3), H2OCache(spec, config, rows=3)
    gen = torch.Generator().manual_seed(11)
    for step in range(30):
        n_new = [1 + (step + 2 * row) % 3 for row in range(3)]
        if lockstep:
            n_new = [1 + step % 3, 1 + step % 2, 1 + step % 3]
        ids = torch.randint(3, 128, (3, max(n_new)), generator=gen)
        forward(tiny_model, native, ids, n_new)
        with monkeypatch.context() as patch:
            patch.setattr(compaction, "native_compaction", lambda cache: False)
            patch.setattr(Archive, "native", lambda archive: False)
            forward(tiny_model, torch_ops, ids, n_new)
            theirs_archived = [a.state() | {"lo": a._digests()[0], "hi": a._digests()[1]} if a else None
                               for a in torch_ops.archives]
        assert native.lengths == torch_ops.lengths
        for row, n in enumerate(native.lengths):
            for name in ("keys", "values", "rotated", "scores", "origins", "pinned"):
                mine, theirs = getattr(native.buffers(), name), getattr(torch_ops.buffers(), name)
                if mine is not None:
                    assert torch.equal(mine[:, row, :, :n], theirs[:, row, :, :n]), (step, row, name)
        assert native.archived_tokens() == torch_ops.archived_tokens()
        for row, (archive, theirs) in enumerate(zip(native.archives, theirs_archived)):
            assert (archive is None) == (theirs is None)
            if archive is not None:
                mine = archive.state() | {"lo": archive._digests()[0], "hi": archive._digests()[1]}
                for name, value in theirs.items():
                    assert torch.equal(mine[name], value), (step, row, name)
    assert sum(native.seen) > 3 * config.budget  # evicted many times
    assert not config.recalls or min(native.archived_tokens(row) for row in range(3)) > 4 * config.recall_block


def test_pop_and_extend_move_rows_without_changing_them(tiny_model):
    config = CacheConfig(policy="h2o", budget=10)
    spec = model_spec(tiny_model)
    ids = torch.randint(3, 128, (3, 14), generator=torch.Generator().manual_seed(6))
    batch = H2OCache(spec, config, rows=3)
    forward(tiny_model, batch, ids, [14, 12, 7])
    keys, scores = batch.buffers().keys[:, :3].clone(), batch.buffers().scores[:, :3].clone()
    lengths = list(batch.lengths)
    popped = batch.pop(0)
    assert batch.lengths == [lengths[2], lengths[1]] and popped.lengths == [lengths[0]]
    batch.extend(popped)
    assert batch.lengths == [lengths[2], lengths[1], lengths[0]]
    for now, before in [(0, 2), (1, 1), (2, 0)]:
        n = lengths[before]
        assert torch.equal(batch.buffers().keys[:, now, :, :n], keys[:, before, :, :n])
        assert torch.equal(batch.buffers().scores[:, now, :, :n], scores[:, before, :, :n])


def test_prefill_never_attends_beyond_budget_plus_chunk(tiny_model, monkeypatch):
    """A long prompt is never materialized as an L x L attention matrix."""
    config = CacheConfig(policy="h2o", budget=32, prefill_chunk=16)
    cache = H2OCache(model_spec(tiny_model), config, rows=1)
    shapes = []
    attend = cache.attend

    def recording(layer_idx, query, keys, values, scaling):
        shapes.append((query.shape[2], keys.shape[2]))
        return attend(layer_idx, query, keys, values, scaling)

    monkeypatch.setattr(cache, "attend", recording)
    ids = torch.randint(3, 128, (1, 4000), generator=torch.Generator().manual_seed(7))
    for start in range(0, 4000, 16):
        forward(tiny_model, cache, ids[:, start:start + 16], [16])
    assert max(k for _, k in shapes) <= 32 + 16 and max(q for q, _ in shapes) <= 16
    assert cache.lengths[0] <= 32 and cache.seen == [4000]


def test_rolling_positions_stay_within_budget(tiny_model):
    cache = H2OCache(model_spec(tiny_model), CacheConfig(policy="h2o", budget=16), rows=1)
    for _ in range(40):
        positions = cache.begin([1])
        assert positions.max().item() <= 16
        cache.abort()
        forward(tiny_model, cache, torch.tensor([[5]]), [1])
    assert cache.seen == [40]


def test_memory_is_constant_once_full(tiny_model):
    cache = H2OCache(model_spec(tiny_model), CacheConfig(policy="h2o", budget=16, evict_slack=4), rows=1)
    resident, allocated = [], []
    for _ in range(60):
        forward(tiny_model, cache, torch.tensor([[7]]), [1])
        resident.append(cache.resident_bytes())
        allocated.append(cache.allocated_bytes())
    assert len(set(allocated[16:])) == 1 and max(resident) == resident[15]
    assert set(resident[16:]) == {resident[15] * n // 16 for n in range(12, 17)}
