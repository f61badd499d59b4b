"""The fast decode step stays capture-safe with recall: run under a dispatch mode that fails on every op
that reads a tensor back to the host or returns a shape that depends on tensor values, the whole
torch step (`decode.decode_step`, the body a CUDA graph captures, the queries it leaves for the recall
window included) runs without one, for every bucket; and the buffers a step reads are never
reallocated by anything between steps (eviction, archiving, the window's choice and growth).

The window's choice itself runs between steps, on the host where the archive lives (see
`h2o_cache/recall.py` and the README's GPU notes); this file holds the step to its contract.
"""

import pytest
import torch

from h2o_cache import CacheConfig, Generator, StaticDecoder
from tests.conftest import ByteTokenizer, tiny_llama
from tests.device_audit import HostReads


def test_the_mode_catches_what_it_must():
    x = torch.arange(6.0)
    with HostReads() as mode:
        x.sum().item()
        x.nonzero()
        x[x > 2]
        torch.unique(x)
    assert len(mode.forbidden) == 4


@pytest.fixture(scope="module", params=["text", "rank"])
def recalling_decoder(request):
    """Rows with windows; with "rank" the step reads every held key at its rank (a sort per head)."""
    model = tiny_llama(init_std=0.3)
    config = CacheConfig(budget=24, evict_slack=4, prefill_chunk=8, recall_budget=8, recall_block=4, recall_archive=256,
                         recall_positions=request.param)
    gen = Generator(model, ByteTokenizer(), config)
    decoder = StaticDecoder(model, config, max_rows=8, quantized=False, native=False)
    for n in (90, 60, 33, 10, 75):  # most rows have archived blocks and an open window; one has none
        row = gen.new_cache(1)
        gen.prefill(row, [[(7 * i + n) % 120 + 3 for i in range(n)]])
        row.pending = [[5 + n % 50]]
        decoder.cache.extend(row)
    assert sum(1 for r in decoder.cache.recalled if r) >= 3
    return decoder


def buffers_read(decoder: StaticDecoder) -> dict[str, int]:
    out = {name: t.data_ptr() for name, t in vars(decoder.cache.buffers()).items() if t is not None}
    return out | {"queries": decoder.queries.data_ptr(), "inputs": decoder._inputs.data_ptr(),
                  "cos": decoder._cos.data_ptr(), "sin": decoder._sin.data_ptr(), "rope": decoder._rope.data_ptr()}


@pytest.mark.parametrize("reads_ranks", [True, False], ids=["some-row-at-ranks", "no-row-at-ranks"])
@pytest.mark.parametrize("bucket", [1, 2, 4, 8])
def test_every_bucket_of_the_step_runs_without_host_reads_or_data_dependent_shapes(recalling_decoder, bucket,
                                                                                    reads_ranks):
    """Each graph a bucket captures (two with ranks: some row reads them, or none does)."""
    decoder = recalling_decoder
    cache = decoder.cache
    rows = min(bucket, cache.batch_size)
    decoder._inputs.zero_()
    ranked = [int(cache.ranked(row)) for row in range(cache.batch_size)]
    decoder.inputs(bucket)[:, :rows] = torch.tensor([[p[0] for p in cache.pending], cache.lengths, cache.seen,
                                                     ranked])[:, :rows]
    decoder.queries.zero_()  # a bucket runs twice (with ranks and without): the second writes the same queries
    before = decoder.queries.clone()
    with HostReads() as mode:
        logits = decoder._run(bucket, reads_ranks)
    assert mode.ops and not mode.forbidden, mode.forbidden
    assert logits.shape == (bucket, decoder.weights.embed.shape[0]) and torch.isfinite(logits).all()
    assert not torch.equal(decoder.queries[:, :rows], before[:, :rows])  # the step left its queries


def test_steps_with_evictions_and_window_choices_never_reallocate_what_the_step_reads(recalling_decoder):
    decoder = recalling_decoder
    cache = decoder.cache
    pointers = buffers_read(decoder)
    grown = list(cache.recalled)
    counted = list(cache.recall_count)
    for _ in range(20):  # several evictions per row; windows grow and are chosen again
        logits = decoder.step()
        cache.pending = [[int(t)] for t in logits.argmax(dim=-1)]
    assert buffers_read(decoder) == pointers
    assert any(after > before for after, before in zip(cache.recalled, grown))  # the empty row's window opened
    assert any(after > before for after, before in zip(cache.recall_count, counted))  # choices changed windows


def test_the_ranking_of_archived_blocks_runs_without_host_reads_and_picks_what_archive_select_picks():
    """`h2o_cache.selection`, both stages and the candidates' bookkeeping, as a device would run them in
    a captured step: no host read, no data-dependent shape; the same blocks `Archive.select` returns."""
    from h2o_cache.archive import CANDIDATES, POSITIONS, Archive, _voting
    from h2o_cache.selection import (block_mass, block_tokens, bound_mass, pool_by_position, position_votes, span_votes,
                                     token_mass, token_votes, top_blocks)

    layers, heads, d, block, n = 2, 3, 8, 4, 192  # 48 blocks: more than the 32 candidates of 2 wanted
    generator = torch.Generator().manual_seed(0)
    archive = Archive(layers, heads, d, torch.float32, block=block, limit=256)
    archive.append(torch.randn(layers, heads, n, d, generator=generator), torch.randn(layers, heads, n, d, generator=generator),
                   None, torch.arange(n).expand(layers, heads, n))
    queries = torch.randn(layers, heads, 6, d, generator=generator)
    lo, hi = archive._digests()
    state = archive.state()
    keys = state["keys"].view(layers, heads, n // block, block, d)
    origins = state["origins"].view(layers, heads, n // block, block)
    wanted = 2
    with HostReads() as mode:
        candidates = top_blocks(bound_mass(queries, lo, hi, 0.5), min(CANDIDATES * wanted, n // block))  # as select
        # the candidates' keys, gathered on the device (the archive's keys there)
        picked = keys.gather(2, candidates[..., None, None].expand(-1, -1, -1, block, d)).flatten(2, 3)
        at = origins.gather(2, candidates[..., None].expand(-1, -1, -1, block)).flatten(2, 3)
        mass = pool_by_position(token_mass(queries, picked, 0.5), at, POSITIONS)
        chosen = block_tokens(top_blocks(block_mass(mass, block), wanted, candidates).sort(dim=-1).values, block)
        mass = pool_by_position(token_mass(queries, picked, 0.5), at, POSITIONS, per_layer=True)
        alone = block_tokens(top_blocks(block_mass(mass, block), wanted, candidates).sort(dim=-1).values, block)
        # a choice everywhere: every token of every head scored by the pooled votes of its neighbourhood
        votes = span_votes(position_votes(token_mass(queries, picked, 0.5), at, POSITIONS), CacheConfig.recall_span)
        everywhere = top_blocks(token_votes(votes, state["origins"]), wanted * block).sort(dim=-1).values
        # the same by the votes of layer 1 alone (`recall_voters`), every layer taking its tokens by them
        votes = span_votes(position_votes(_voting(token_mass(queries, picked, 0.5), [1]), at, POSITIONS),
                           CacheConfig.recall_span)
        few = top_blocks(token_votes(votes, state["origins"]), wanted * block).sort(dim=-1).values
    assert mode.ops and not mode.forbidden, mode.forbidden
    assert torch.equal(chosen, archive.select(queries, 0.5, wanted * block))
    assert torch.equal(alone, archive.select(queries, 0.5, wanted * block, per_layer=True))
    assert torch.equal(everywhere, archive.select(queries, 0.5, wanted * block, everywhere=True))
    assert torch.equal(few, archive.select(queries, 0.5, wanted * block, everywhere=True, voters=[1]))
    assert not torch.equal(few, everywhere)
