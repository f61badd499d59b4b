"""Snapshots of cache rows: bit-exact round trips that continue with the same greedy tokens, and
clean refusals of snapshots from another model, config or format."""

from dataclasses import replace

import pytest
import torch

from h2o_cache import POLICIES, CacheConfig, Generator, SamplingParams
from h2o_cache.snapshot import FORMAT_VERSION, SnapshotMismatch, cache_identity, dump_row, load_row, model_fingerprint, read_metadata
from tests.conftest import tiny_llama

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def evicted_batch(gen: Generator) -> object:
    """A 2-row cache that has evicted (budget 12, ~40 tokens fed) and holds a pending token per row."""
    prompts = [list(range(3, 40)), list(range(50, 80))]
    cache = gen.new_cache(2)
    gen.generate(prompts, GREEDY, cache=cache)
    return cache


@pytest.mark.parametrize("rolling", [True, False])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_row_round_trips_bit_exact_and_continues_with_the_same_tokens(tiny_model, byte_tokenizer, policy, rolling):
    gen = Generator(tiny_model, byte_tokenizer, CacheConfig(policy=policy, budget=12, evict_slack=3,
                                                            position_rolling=rolling, prefill_chunk=8))
    batch = evicted_batch(gen)
    identity = cache_identity(batch, model_fingerprint(tiny_model))
    blob = dump_row(batch, 1, identity, {"note": "kept"})
    original = batch.pop(1)
    restored = load_row(gen.new_cache(1), blob, identity)

    assert (restored.lengths, restored.seen, restored.pending) == (original.lengths, original.seen, original.pending)
    assert original.pending[0] and (policy == "full" or original.lengths[0] < original.seen[0])
    n = original.lengths[0]
    for name, mine in vars(restored).items():
        if isinstance(mine, torch.Tensor) and mine.dim() >= 4:
            assert torch.equal(mine[:, 0, :, :n], getattr(original, name)[:, 0, :, :n]), name
    assert read_metadata(blob)["note"] == "kept"

    more = [list(range(90, 110))]
    [expected] = gen.generate(more, GREEDY, cache=original)
    [got] = gen.generate(more, GREEDY, cache=restored)
    assert got.token_ids == expected.token_ids and restored.seen == original.seen


def test_a_row_with_an_archive_and_recalled_tokens_round_trips_and_continues_the_same(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer, CacheConfig(policy="h2o", budget=12, evict_slack=3, prefill_chunk=8,
                                                            recall_budget=8, recall_block=4, recall_probe=4))
    batch = evicted_batch(gen)
    gen.generate([list(range(20, 30)), list(range(60, 65))], GREEDY, cache=batch)  # a turn that recalls
    assert batch.recalled[1] == 8 and len(batch.archives[1]) > 8
    identity = cache_identity(batch, model_fingerprint(tiny_model))
    blob = dump_row(batch, 1, identity)
    original = batch.pop(1)
    restored = load_row(gen.new_cache(1), blob, identity)
    assert restored.recalled == original.recalled and restored._pinned[:, 0].sum() == original._pinned[:, 0].sum()
    for name, saved in original.archives[0].state().items():
        assert torch.equal(restored.archives[0].state()[name], saved), name
    more = [list(range(90, 110))]
    [expected] = gen.generate(more, GREEDY, cache=original)
    [got] = gen.generate(more, GREEDY, cache=restored)
    assert got.token_ids == expected.token_ids and restored.recalled == original.recalled


def test_a_buffer_the_cache_gains_is_saved_without_changing_the_snapshot_code(tiny_model, byte_tokenizer):
    """`_origins` arrived this way; `_future` stands for the next buffer someone adds to H2OCache."""
    gen = Generator(tiny_model, byte_tokenizer, CacheConfig(policy="h2o", budget=12, prefill_chunk=8))
    cache = evicted_batch(gen)
    spec = cache.spec
    cache._future = torch.randint(0, 99, (spec.num_layers, 2, spec.num_kv_heads, cache.buffers().keys.shape[3]))
    identity = cache_identity(cache, model_fingerprint(tiny_model))
    blob = dump_row(cache, 0, identity)

    with pytest.raises(SnapshotMismatch, match="_future"):  # a cache without it refuses the snapshot
        load_row(gen.new_cache(1), blob, identity)
    blank = gen.new_cache(1)
    n = cache.lengths[0]
    blank.reserve(1, n)
    blank._future = torch.zeros(spec.num_layers, 1, spec.num_kv_heads, n, dtype=cache._future.dtype)
    restored = load_row(blank, blob, identity)
    assert torch.equal(restored._future[:, 0], cache._future[:, 0, :, :n])
    assert torch.equal(restored._origins[:, 0, :, :n], cache._origins[:, 0, :, :n])


def test_snapshots_of_another_model_config_or_format_are_refused(tiny_model, byte_tokenizer):
    config = CacheConfig(policy="h2o", budget=12, prefill_chunk=8)
    gen = Generator(tiny_model, byte_tokenizer, config)
    cache = evicted_batch(gen)
    identity = cache_identity(cache, model_fingerprint(tiny_model))
    blob = dump_row(cache, 0, identity)

    other_weights = tiny_llama(seed=1)  # the same architecture, other weights
    assert model_fingerprint(other_weights) != model_fingerprint(tiny_model)
    other_budget = Generator(tiny_model, byte_tokenizer, CacheConfig(policy="h2o", budget=16, prefill_chunk=8))
    for blank, fingerprint in [(gen.new_cache(1), model_fingerprint(other_weights)),
                               (other_budget.new_cache(1), model_fingerprint(tiny_model))]:
        with pytest.raises(SnapshotMismatch, match="another model or cache config"):
            load_row(blank, blob, cache_identity(blank, fingerprint))

    old = blob.replace(f'"format":"{FORMAT_VERSION}"'.encode(), b'"format":"0"')  # the same length: the offsets stay valid
    assert old != blob
    with pytest.raises(SnapshotMismatch, match="format"):
        load_row(gen.new_cache(1), old, identity)


def test_a_snapshot_moves_between_settings_that_change_how_not_what(tiny_model, byte_tokenizer):
    """recall_kernel picks the C++ or the torch choice of the same windows: not part of the identity."""
    config = CacheConfig(policy="h2o", budget=12, prefill_chunk=8, recall_budget=4, recall_block=4)
    kernel = Generator(tiny_model, byte_tokenizer, config).new_cache(1)
    torch_ops = Generator(tiny_model, byte_tokenizer, replace(config, recall_kernel=False)).new_cache(1)
    fingerprint = model_fingerprint(tiny_model)
    assert cache_identity(kernel, fingerprint) == cache_identity(torch_ops, fingerprint)
    assert cache_identity(kernel, fingerprint) != cache_identity(
        Generator(tiny_model, byte_tokenizer, replace(config, recall_span=2)).new_cache(1), fingerprint)
