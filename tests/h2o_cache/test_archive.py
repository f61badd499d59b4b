"""`Archive` on its own: what goes in comes out exactly and stays, blocks are chosen per layer and KV
head (Quest bound, then exact logits, pooled by position over the heads that choose together), and blocks keep their meaning until
`epoch` says otherwise."""

import pytest
import torch

from h2o_cache import selection
from h2o_cache.archive import CANDIDATES, Archive

L, H, D = 2, 3, 8
FIELDS = ("keys", "values", "scores", "origins")


def tokens(m: int, start: int, seed: int = 0):
    """m tokens per head with origins start.. (the same in every head, as an eviction's would not be)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(L, H, m, D, generator=gen)
    values = torch.randn(L, H, m, D, generator=gen)
    scores = torch.rand(L, H, m, generator=gen)
    origins = (torch.arange(m) + start).expand(L, H, m).clone()
    return keys, values, scores, origins


def archive(block=4, limit=64, dtype=torch.float32):
    return Archive(L, H, D, dtype, block=block, limit=limit)


def unit(seed: int) -> torch.Tensor:
    v = torch.randn(D, generator=torch.Generator().manual_seed(seed))
    return v / v.norm()


def select_blocks(a: Archive, queries, scaling: float, blocks: int, *args, **kwargs) -> torch.Tensor:
    """`Archive.select` of whole blocks (any choice but `everywhere`) as block indices [L', H, blocks]."""
    chosen = a.select(queries, scaling, blocks * a.block, *args, **kwargs)
    first = chosen[..., ::a.block]
    assert torch.equal(chosen, (first[..., None] + torch.arange(a.block)).flatten(-2)) and (first % a.block == 0).all()
    return first // a.block


def block_tokens(blocks: list[int], size: int) -> list[int]:
    return [b * size + i for b in blocks for i in range(size)]


def test_append_in_uneven_pieces_then_state_holds_everything_in_order():
    a = archive()
    pieces = [tokens(m, start, seed) for m, start, seed in [(5, 0, 1), (3, 5, 2), (9, 8, 3)]]
    for piece in pieces:
        a.append(*piece)
    assert len(a) == 17 and a.full_blocks == 4
    state = a.state()
    for name, i in [("keys", 0), ("values", 1), ("scores", 2), ("origins", 3)]:
        assert torch.equal(state[name], torch.cat([p[i] for p in pieces], dim=2))


@pytest.mark.parametrize("group", [1, 6])
def test_heads_pool_their_votes_by_position_over_the_layers_that_choose_together(group):
    """Two needles in every head, in different blocks; four heads of six ask for the second, two for
    the first. Chosen together, every head takes the second's block: the heads that point at a
    position bring it to the rest. One layer at a time (as a prefill chunk chooses), a layer's heads
    pool alone; asked for two blocks, every head holds both."""
    a = archive(block=4, limit=256)
    keys, values, scores, origins = tokens(64, 0)
    keys = keys * 0.1
    first, second = unit(7), unit(8)
    keys[:, :, 13] = first * 4  # block 3
    keys[:, :, 45] = second * 4  # block 11
    a.append(keys, values, scores, origins)
    asks_second = torch.tensor([[True, False, False], [True, True, True]])  # [L, H]
    queries = torch.where(asks_second[..., None], second, first)[:, :, None].expand(L, H, group, D)
    chosen = select_blocks(a, queries, scaling=2.0, blocks=1)
    assert chosen.shape == (L, H, 1)
    assert (chosen[..., 0] == 11).all()
    assert (select_blocks(a, queries[:1], 2.0, 1, slice(0, 1))[..., 0] == 3).all()  # layer 0 alone: 1 of 3 asks the second
    assert (select_blocks(a, queries[1:], 2.0, 1, slice(1, 2))[..., 0] == 11).all()
    # all layers in one choice, each layer's heads pooling alone: what each layer chooses by itself
    assert torch.equal(select_blocks(a, queries, 2.0, 1, per_layer=True), torch.tensor([3, 11])[:, None, None].expand(L, H, 1))
    assert torch.equal(select_blocks(a, queries, 2.0, 2), torch.tensor([3, 11]).expand(L, H, 2))


def test_each_head_finds_a_position_in_the_block_where_its_own_archive_holds_it():
    """Heads evict different tokens, so one position sits in different blocks of different heads; the
    queries point at the needle's position, and each head takes the block of its own archive that
    holds it."""
    a = archive(block=4, limit=256)
    keys, values, scores, _ = tokens(64, 0)
    keys = keys * 0.1
    needle, at = unit(5), 100
    gen = torch.Generator().manual_seed(4)
    origins = torch.empty(L, H, 64, dtype=torch.int64)
    where = torch.empty(L, H, dtype=torch.int64)
    for layer in range(L):
        for head in range(H):
            others = torch.randperm(199, generator=gen)[:63]
            held = torch.cat([others + (others >= at).long(), torch.tensor([at])]).sort().values
            origins[layer, head] = held
            index = int((held == at).nonzero())
            keys[layer, head, index] = needle * 4
            where[layer, head] = index // 4
    assert len(set(where.flatten().tolist())) > 1
    a.append(keys, values, scores, origins)
    chosen = select_blocks(a, needle.expand(L, H, 3, D), scaling=2.0, blocks=1)
    assert torch.equal(chosen[..., 0], where)


def test_select_returns_distinct_ascending_blocks_and_all_of_them_when_asked_for_all():
    a = archive(block=4, limit=256)
    a.append(*tokens(40, 0))
    query = torch.randn(L, H, 5, D, generator=torch.Generator().manual_seed(1))
    for blocks in (1, 3, 10):
        chosen = select_blocks(a, query, 1.0, blocks)
        assert chosen.shape == (L, H, blocks)
        assert (chosen[..., 1:] > chosen[..., :-1]).all() and (chosen >= 0).all() and (chosen < 10).all()
    assert torch.equal(select_blocks(a, query, 1.0, 10), torch.arange(10).expand(L, H, 10))


def test_the_exact_logits_choose_the_needle_over_blocks_of_large_noisy_keys():
    """Blocks of large keys pointing every way have a loose Quest bound (c |q|_1) above the needle's
    (q . needle), though no key in them matches the query; the exact stage ranks the bound's candidates
    by their real logits and picks the needle's block."""
    size = 2 * D
    a = archive(block=size, limit=512)
    n = 10 * size
    keys, values, scores, origins = tokens(n, 0, seed=3)
    keys = keys * 0.02
    query = unit(11)
    noisy = 3.0 * torch.cat([torch.eye(D), -torch.eye(D)])  # every channel +-3: hi = 3, lo = -3
    for b in (1, 4, 8):  # three noisy blocks: the needle's is 4th by the bound, still a candidate
        keys[:, :, b * size:(b + 1) * size] = noisy
    keys[:, :, 6 * size + 5] = query * 4.0  # block 6
    a.append(keys, values, scores, origins)

    blocked = keys.view(L, H, 10, size, D)
    hi, lo = blocked.amax(dim=3), blocked.amin(dim=3)
    bound = (query.clamp(min=0) * hi + query.clamp(max=0) * lo).sum(-1)  # [L, H, blocks]
    by_bound = bound.argsort(dim=-1, descending=True)
    assert (by_bound[..., :3].sort(dim=-1).values == torch.tensor([1, 4, 8])).all()  # the bound alone is fooled
    assert (by_bound[..., 3] == 6).all() and CANDIDATES >= 4

    chosen = select_blocks(a, query.expand(L, H, 2, D), scaling=2.0, blocks=1)
    assert (chosen[..., 0] == 6).all()


def test_gather_returns_exactly_the_chosen_blocks_and_the_archive_keeps_them():
    a = archive()
    stored = tokens(18, 0)  # 4 full blocks and a 2-token tail
    a.append(*stored)
    before = a.state()
    chosen = torch.tensor([[[0, 2], [1, 3], [2, 3]], [[0, 1], [0, 3], [1, 2]]])  # [L, H, 2]
    for _ in range(2):  # the archive keeps what it gives: the same again
        got = a.gather(chosen)
        for layer in range(L):
            for head in range(H):
                picked = block_tokens(chosen[layer, head].tolist(), 4)
                for part, full in zip(got, stored):
                    assert torch.equal(part[layer, head], full[layer, head, picked])
    one_layer = a.gather(chosen[1:], slice(1, 2), ("origins", "keys"))
    assert torch.equal(one_layer[0], got[3][1:]) and torch.equal(one_layer[1], got[0][1:])
    assert len(a) == 18 and a.full_blocks == 4
    for name in FIELDS:
        assert torch.equal(a.state()[name], before[name])


def test_gather_heads_returns_for_each_listed_head_what_gather_returns_for_it():
    a = archive()
    a.append(*tokens(24, 0, seed=4))
    chosen = torch.randint(0, 6, (L, H, 3), generator=torch.Generator().manual_seed(2))
    whole = a.gather(chosen)
    layer_ids, head_ids = torch.tensor([1, 0, 1, 0]), torch.tensor([2, 0, 0, 2])
    held = selection.block_tokens(chosen, a.block)  # gather_heads takes tokens, as a window holds them
    some = a.gather_heads(layer_ids, head_ids, held[layer_ids, head_ids])
    for i, (layer, head) in enumerate(zip(layer_ids.tolist(), head_ids.tolist())):
        for part, full in zip(some, whole):
            assert torch.equal(part[i], full[layer, head])
    [origins] = a.gather_heads(layer_ids[:1], head_ids[:1], torch.tensor([[5, 0, 17]]), ("origins",))
    assert torch.equal(origins[0], a.state()["origins"][1, 2, [5, 0, 17]])


def test_select_does_not_change_the_archive_and_chooses_the_same_twice():
    a = archive(block=4, limit=256)
    a.append(*tokens(40, 0, seed=6))
    query = torch.randn(L, H, 4, D, generator=torch.Generator().manual_seed(3))
    first = select_blocks(a, query, 1.0, 3)
    state = a.state()
    assert torch.equal(select_blocks(a, query, 1.0, 3), first) and len(a) == 40
    for name in FIELDS:
        assert torch.equal(a.state()[name], state[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("native", [True, False], ids=["kernel", "torch"])
def test_blocks_form_in_origin_order_among_the_tokens_archived_since_the_last_were_formed(native, dtype, monkeypatch):
    """Eviction archives a phrase a few tokens at a time; the tokens not yet in a block are sorted by
    origin when blocks form, and a formed block keeps its tokens (in C++ on the CPU, else torch ops)."""
    if native:
        assert archive(dtype=dtype).native(), "the kernel forms an fp32 or fp16 archive's blocks on the CPU"
    else:
        monkeypatch.setattr(Archive, "native", lambda self: False)
    a = archive(block=4, limit=256, dtype=dtype)
    first = tokens(6, 0, seed=1)
    first[3][:] = torch.tensor([10, 2, 7, 0, 5, 3])
    a.append(*first)
    select_blocks(a, torch.randn(L, H, 2, D), 1.0, 1)  # forms block 0 from the lowest four: 0, 2, 3, 5
    held = a.state()["origins"][0, 0].tolist()
    assert held[:4] == [0, 2, 3, 5] and sorted(held[4:]) == [7, 10]
    second = tokens(6, 0, seed=2)
    second[3][:] = torch.tensor([1, 20, 4, 6, 15, 8])
    a.append(*second)
    select_blocks(a, torch.randn(L, H, 2, D), 1.0, 1)
    origins = a.state()["origins"]
    assert origins[0, 0].tolist() == [0, 2, 3, 5, 1, 4, 6, 7, 8, 10, 15, 20]  # block 0 kept, then sorted
    assert (origins == origins[0, 0]).all()
    # Each token keeps its own key, value and score through the sorting.
    state = a.state()
    source = {origin: piece for piece in (first, second) for origin in piece[3][0, 0].tolist()}
    for slot, origin in enumerate(state["origins"][1, 2].tolist()):
        piece = source[origin]
        at = piece[3][1, 2].tolist().index(origin)
        for field, name in enumerate(FIELDS):
            assert torch.equal(state[name][1, 2, slot], piece[field][1, 2, at].to(state[name].dtype))


@pytest.mark.parametrize("digest", ["centre", "mean", "minmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_the_kernel_forms_blocks_and_digests_as_the_torch_ops_bit_for_bit(dtype, digest, monkeypatch):
    """Appends of uneven sizes whose origins are scrambled differently in every head, formed after each
    append (some leaving a tail short of a block) and at the limit: the same storage order, digests and
    (an fp32 archive's) fp16 keys."""
    def filled(native: bool) -> list[dict[str, torch.Tensor]]:
        with monkeypatch.context() as patch:
            if not native:
                patch.setattr(Archive, "native", lambda self: False)
            a, seen, out = Archive(L, H, D, dtype, block=4, limit=48, digest=digest), 0, []
            for i, m in enumerate([3, 6, 1, 9, 4, 7, 12, 5, 8]):
                keys, values, scores, _ = tokens(m, 0, seed=10 + i)
                gen = torch.Generator().manual_seed(100 + i)
                origins = torch.stack([seen + torch.randperm(m, generator=gen) for _ in range(L * H)]).view(L, H, m)
                a.append(keys, values, scores, origins)
                seen += m
                lo, hi = a._digests()
                state, full = a.state(), a.full_blocks * a.block
                out.append(state | {"lo": lo.clone(), "hi": hi.clone(), "dropped": torch.tensor(a.dropped)})
                if dtype == torch.float32:
                    half = a.storage()["half"][:, :, :full]  # the full blocks' keys in fp16, for ranking
                    assert torch.equal(half, state["keys"][:, :, :full].half())  # after drops at the limit too
                    out[-1]["half"] = half.clone()
            return out

    assert archive(dtype=dtype).native()
    for step, (mine, theirs) in enumerate(zip(filled(True), filled(False), strict=True)):
        for name, value in theirs.items():
            assert torch.equal(mine[name], value), (step, name)
    assert filled(True)[-1]["dropped"] > 0  # the limit was reached


def test_a_block_appended_later_is_found_by_the_next_select():
    a = archive(block=4, limit=256)
    keys, values, scores, origins = tokens(32, 0)
    a.append(keys * 0.1, values, scores, origins)
    needle = unit(3)
    assert not (select_blocks(a, needle.expand(L, H, 2, D), 2.0, 1) == 9).any()
    more = tokens(8, 32, seed=9)
    more_keys = more[0] * 0.1
    more_keys[:, :, 5] = needle * 4  # origin 37, block 9
    a.append(more_keys, *more[1:])
    assert (select_blocks(a, needle.expand(L, H, 2, D), 2.0, 1)[..., 0] == 9).all()


def test_the_limit_drops_the_oldest_whole_blocks_bumps_the_epoch_and_keeps_the_newest_once():
    a = archive(block=4, limit=32)
    everything = {}
    epochs = [a.epoch]
    gen = torch.Generator().manual_seed(0)
    start = 0
    for round in range(30):
        m = int(torch.randint(1, 12, (1,), generator=gen))
        piece = tokens(m, start, seed=round)
        dropped = a.dropped
        a.append(*piece)
        for i in range(m):
            everything[start + i] = (piece[0][:, :, i], piece[1][:, :, i])
        start += m
        assert a.epoch == epochs[-1] + (a.dropped > dropped)  # renumbered exactly when blocks went
        epochs.append(a.epoch)
        assert a.dropped % 4 == 0 and len(a) <= 32 and len(a) + a.dropped == start
        if round % 3 == 0 and a.full_blocks:
            select_blocks(a, torch.randn(L, H, 2, D, generator=gen), 1.0, 1)
    assert a.epoch > 0
    held = a.state()
    assert held["origins"][0, 0].tolist() == list(range(a.dropped, start))  # the newest, each once
    assert (held["origins"] == held["origins"][0, 0]).all()
    for slot, origin in enumerate(held["origins"][0, 0].tolist()):
        assert torch.equal(held["keys"][:, :, slot], everything[origin][0])
        assert torch.equal(held["values"][:, :, slot], everything[origin][1])


def test_copy_is_independent():
    a = archive()
    a.append(*tokens(12, 0))
    twin = a.copy()
    a.append(*tokens(8, 12, seed=1))
    twin.append(*tokens(4, 12, seed=2))
    assert len(a) == 20 and len(twin) == 16
    assert twin.state()["origins"][0, 0].tolist() == list(range(16))
    assert torch.equal(twin.state()["keys"][:, :, 12:], tokens(4, 12, seed=2)[0])
    assert torch.equal(a.state()["keys"][:, :, 12:], tokens(8, 12, seed=1)[0])


def test_state_and_copies_keep_the_blocks_as_they_were_formed():
    """Each batch of evicted tokens is sorted by origin when its blocks form; a copy and a restored
    state (what a snapshot holds) keep those blocks rather than re-sorting the whole archive, so a
    restored session chooses what it would have, and the blocks still to form form alike."""
    a = archive(block=4, limit=256)
    first, second = tokens(12, 0, seed=1), tokens(12, 0, seed=2)
    first[3][:] = torch.tensor([20, 3, 11, 7, 0, 9, 22, 15, 1, 5, 18, 13])
    second[3][:] = torch.tensor([4, 16, 2, 21, 8, 12, 23, 10, 6, 17, 14, 19])
    a.append(*first)
    select_blocks(a, torch.randn(L, H, 2, D), scaling=1.0, blocks=1)  # the first batch forms its blocks
    a.append(*(t[:, :, :6] for t in second))  # half a batch: its tokens wait, unformed
    twin = a.copy()
    restored = archive(block=4, limit=256)
    restored.load_state(a.state())
    for other in (twin, restored):
        assert torch.equal(other.state()["origins"], a.state()["origins"])
    rest = tuple(t[:, :, 6:] for t in second)
    query = torch.randn(L, H, 2, D, generator=torch.Generator().manual_seed(4))
    for other in (a, twin, restored):
        other.append(*rest)
    chosen = select_blocks(a, query, 1.0, 2)
    for other in (twin, restored):
        assert torch.equal(select_blocks(other, query, 1.0, 2), chosen)
        for got, want in zip(other.gather(chosen), a.gather(chosen)):
            assert torch.equal(got, want)
    assert restored.epoch > 0  # a load renumbers blocks for whoever held indices into the old contents


def test_an_fp32_archive_s_state_loads_into_an_fp16_archive_rounded_with_its_blocks_as_formed():
    """A snapshot written before the cache archived in fp16 restores into today's fp16 archive: every
    token kept, keys and values rounded to nearest even, the formed blocks and digests as an fp16
    archive forms them."""
    old = archive(block=4, limit=256)
    old.append(*tokens(10, 0, seed=1))
    old._digests()  # two blocks formed, two tokens in the tail
    state = old.state()
    new = archive(block=4, limit=256, dtype=torch.float16)
    new.load_state(state)
    loaded = new.state()
    for name in FIELDS:
        assert torch.equal(loaded[name], state[name].to(loaded[name].dtype))
    assert loaded["keys"].dtype == torch.float16 and int(loaded["blocked"][0]) == 2
    lo, hi = new._digests()
    keys = state["keys"][:, :, :8].half().float().view(L, H, 2, 4, D)
    torch.testing.assert_close(lo.float(), keys.mean(dim=3), rtol=1e-3, atol=1e-5)  # the default digest, in fp16
    assert torch.equal(lo, hi)


def test_a_block_s_digest_is_its_keys_mean_and_mean_deviation_or_their_min_and_max():
    """The digests of `CacheConfig.recall_digest`, against their definitions: per channel, the keys'
    mean (a box of no width, lo and hi one storage), the box [mean - mean |k - mean|, mean + mean
    |k - mean|] (ArkVale) or [min, max] (Quest)."""
    keys, values, scores, origins = tokens(12, 0, seed=3)
    for digest in ("centre", "mean", "minmax"):
        a = Archive(L, H, D, torch.float16, block=4, limit=64, digest=digest)
        a.append(keys, values, scores, origins)
        lo, hi = a._digests()
        assert lo.dtype == hi.dtype == torch.float16  # computed in fp32, stored rounded to nearest
        blocks = a.state()["keys"][:, :, :12].float().view(L, H, 3, 4, D)
        if digest == "centre":
            torch.testing.assert_close(lo.float(), blocks.mean(dim=3), rtol=1e-3, atol=1e-5)
            assert torch.equal(lo, hi) and lo.data_ptr() == hi.data_ptr()  # one buffer: a choice reads it once
        elif digest == "mean":
            centre = blocks.mean(dim=3)
            spread = (blocks - centre[:, :, :, None]).abs().mean(dim=3)
            torch.testing.assert_close(lo.float(), centre - spread, rtol=1e-3, atol=1e-5)
            torch.testing.assert_close(hi.float(), centre + spread, rtol=1e-3, atol=1e-5)
            assert (hi > lo).all() and (lo.float() > blocks.amin(dim=3)).any()  # narrower than the min and max
        else:  # fp16 keys: their min and max are fp16 values
            assert torch.equal(lo.float(), blocks.amin(dim=3)) and torch.equal(hi.float(), blocks.amax(dim=3))
    with pytest.raises(ValueError, match="digest"):
        Archive(L, H, D, torch.float16, block=4, limit=64, digest="median")


def test_an_empty_archive_copies_and_restores_empty():
    twin = archive().copy()
    assert len(twin) == 0 and twin.state()["origins"].shape == (L, H, 0)


def test_a_block_larger_than_the_limit_is_refused():
    with pytest.raises(ValueError):
        Archive(L, H, D, torch.float32, block=16, limit=8)


def test_a_choice_everywhere_brings_a_head_the_tokens_the_other_heads_voted_for_though_its_own_bound_missed_them():
    """Head 1's keys for positions 20-23 point away from the query, so its bound leaves their block
    out of its candidates; head 0's keys there match the query. Pooled among its own candidates,
    head 1 cannot take the block; everywhere, the position votes bring it those tokens (`token_votes`)."""
    gen = torch.Generator().manual_seed(3)
    needle = torch.zeros(D)
    needle[0] = 4.0
    n = 8 * CANDIDATES  # twice the blocks that one wanted block's candidates cover
    keys = 0.15 * torch.randn(1, 2, n, D, generator=gen)  # no other key draws head 1's queries near as much
    keys[0, 0, 20:24] = needle
    keys[0, 1, 20:24] = -needle
    a = Archive(1, 2, D, torch.float32, block=4, limit=256)
    a.append(keys, keys.clone(), None, torch.arange(n).expand(1, 2, n))
    query = needle.expand(1, 2, 3, D)
    own = select_blocks(a, query, 2.0, blocks=1)
    everywhere = a.select(query, 2.0, 4, everywhere=True)
    assert own[0, 0, 0] == 5 and own[0, 1, 0] != 5
    assert torch.equal(everywhere, torch.arange(20, 24).expand(1, 2, 4))


def test_a_choice_everywhere_takes_tokens_not_blocks_and_the_neighbours_of_what_drew_the_votes():
    """Eviction scatters a phrase over blocks mixed with other tokens: here positions 100-107 (one
    phrase) sit two by two in four blocks, each beside two unrelated tokens. Only the keys at 101 and
    105 match the query; everywhere, every head takes the phrase's archived tokens, the unmatched
    ones too (they are within the span, 4, of the matched), and none of the blocks' other tokens."""
    gen = torch.Generator().manual_seed(5)
    needle = torch.zeros(D)
    needle[1] = 4.0
    a = Archive(1, 2, D, torch.float32, block=4, limit=256)
    for b in range(16):  # one block per eviction, formed before the next
        origins = torch.tensor([1000 + 40 * b + i for i in range(4)])
        if b % 4 == 0:
            origins[:2] = torch.tensor([100, 101]) + b // 2
        keys = 0.3 * torch.randn(1, 2, 4, D, generator=gen)
        keys[0, :, 1] = needle if b in (0, 8) else keys[0, :, 1]  # positions 101 and 105
        a.append(keys, keys.clone(), None, origins.expand(1, 2, 4))
        a.state()
    chosen = a.select(needle.expand(1, 2, 3, D), 2.0, 8, everywhere=True)
    held = a.state()["origins"].gather(2, chosen)
    assert torch.equal(held, torch.tensor([100, 101, 102, 103, 104, 105, 106, 107]).expand(1, 2, 8))


@pytest.mark.parametrize("radius", [0, 1, 4])
def test_span_votes_add_to_each_position_the_votes_within_its_radius_and_leave_empty_stretches_at_zero(radius):
    gen = torch.Generator().manual_seed(radius)
    votes = torch.rand(300, generator=gen) * (torch.rand(300, generator=gen) < 0.2)
    votes[0], votes[-1] = 5.0, 7.0  # the ends: no wrap-around, no padding counted
    spans = selection.span_votes(votes, radius)
    for p in range(300):
        near = votes[max(0, p - radius):p + radius + 1].sum()
        assert torch.isclose(spans[p], votes[p] + near, atol=1e-5)
        if near == 0:
            assert spans[p] == 0  # exactly: a token no vote came near ranks below any that one did


@pytest.mark.parametrize("native", [True, False], ids=["c++", "torch"])
def test_digests_stay_finite_in_fp16_where_a_key_channel_passes_its_range(monkeypatch, native):
    """An fp32 archive's key channel past fp16's range (65504): its blocks' digests are clamped to it,
    by the C++ forming and the torch ops alike, so a block's bound stays finite and the ranking ranks."""
    if not native:
        monkeypatch.setattr(Archive, "native", lambda self: False)
    keys, values, scores, origins = tokens(12, 0, seed=4)
    keys[0, 1, 5, 3] = 1e6
    keys[1, 2, 9, 0] = -3e5
    a = Archive(L, H, D, torch.float32, block=4, limit=64)
    a.append(keys, values, scores, origins)
    lo, hi = a._digests()
    assert torch.isfinite(lo).all() and torch.isfinite(hi).all()
    assert hi.float().max() == 65504 and lo.float().min() == -65504
    mass = selection.bound_mass(torch.randn(L, H, 4, D), lo, hi, 0.3)
    assert torch.isfinite(mass).all()


def test_a_swept_choice_ranks_its_kept_candidates_and_the_stripe_and_finds_the_rest_as_the_stripe_reaches_it():
    """`recall_sweep`: after a choice that ranked every block, a head ranks only the candidates it kept,
    those of that first choice (its question's) and the next `sweep` blocks in turn. A block the first query turned away from and the stripe has not
    reached is not found, though a choice ranking every block finds it; it is found at the choice whose
    stripe covers it, and stays while it ranks among the kept; an emptied sweep (a new prompt) ranks
    every block again."""
    gen = torch.Generator().manual_seed(7)
    blocks, sweep, needle_block = 4 * CANDIDATES, 8, 40
    n = 4 * blocks
    keys = 0.1 * torch.randn(1, 2, n, D, generator=gen)
    target = unit(3)
    keys[0, :, 4 * needle_block:4 * needle_block + 4] = 4.0 * target
    a = Archive(1, 2, D, torch.float32, block=4, limit=n)
    a.append(keys, keys.clone(), None, torch.arange(n).expand(1, 2, n))
    away, toward = (-target).expand(1, 2, 3, D), target.expand(1, 2, 3, D)
    needle = torch.arange(4 * needle_block, 4 * needle_block + 4).expand(1, 2, 4)

    first = a.select(away, 2.0, 4, everywhere=True, sweep=sweep)  # ranks every block: the cursor moves on
    state = a._sweep
    assert not (first == needle).all() and int(state.cursor) == sweep and (state.counts == CANDIDATES).all()
    assert needle_block not in state.candidates
    found = []
    for choice in range(2, 8):  # stripes 8-15, 16-23, 24-31, 32-39, 40-47, 48-55
        kept = state.candidates.clone()
        cursor = int(state.cursor)
        chosen = a.select(toward, 2.0, 4, everywhere=True, sweep=sweep)
        stripe = set(range(cursor, cursor + sweep))
        assert all(set(state.candidates[0, h].tolist()) <= set(kept[0, h].tolist()) | stripe
                   | set(state.question[0, h].tolist()) for h in range(2))
        found.append(bool(torch.equal(chosen, needle)))
    assert found == [False, False, False, False, True, True]
    every = Archive(1, 2, D, torch.float32, block=4, limit=n)
    every.append(keys, keys.clone(), None, torch.arange(n).expand(1, 2, n))
    every.select(away, 2.0, 4, everywhere=True)
    assert torch.equal(every.select(toward, 2.0, 4, everywhere=True), needle)  # no sweep: found at once

    a.select(away, 2.0, 4, everywhere=True, sweep=sweep)
    a.select(away, 2.0, 4, everywhere=True, sweep=sweep)  # the needle out of the kept candidates again
    assert needle_block not in state.candidates
    a.forget_sweep()
    assert torch.equal(a.select(toward, 2.0, 4, everywhere=True, sweep=sweep), needle)
    # that choice ranked every block by its queries (a reply's first, by its question): the blocks it
    # took stay candidates for the reply, and come back at once though the kept ones left them
    a.select(away, 2.0, 4, everywhere=True, sweep=sweep)
    a.select(away, 2.0, 4, everywhere=True, sweep=sweep)
    assert needle_block not in state.candidates and needle_block in state.question
    assert torch.equal(a.select(toward, 2.0, 4, everywhere=True, sweep=sweep), needle)


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("more", [2, 20, 60], ids=["appends", "grows", "drops"])
def test_a_lent_twin_given_back_leaves_its_lender_as_if_it_had_never_lent(native, more, monkeypatch):
    """`Archive.lend`: a twin works on its lender's storage (appending, forming blocks among the
    lender's unformed tokens, growing, dropping its oldest at the limit) and, given back, leaves the
    lender going on exactly as an archive that never lent: the same tokens, blocks and choices."""
    if not native:
        monkeypatch.setattr(Archive, "native", lambda self: False)
    queries = torch.randn(L, H, 2, D, generator=torch.Generator().manual_seed(5))

    def filled() -> Archive:
        a = archive(block=4, limit=64)
        a.append(*tokens(10, 0, seed=1))
        select_blocks(a, queries, 1.0, 1)  # two blocks formed, two tokens not
        late = tokens(3, 100, seed=2)
        late[3][:] = torch.tensor([102, 40, 101])  # out of order: forming sorts them
        a.append(*late)
        return a

    lender, never = filled(), filled()
    twin = lender.lend()
    early = tokens(more, 50, seed=3)
    early[3][:] = torch.arange(more).flip(0) + 50  # sorted among the lender's unformed tokens
    twin.append(*early)
    select_blocks(twin, queries, 1.0, 2)  # forms the twin's blocks
    shared = twin._data["keys"] is lender._data["keys"]
    assert shared == (more == 2)  # one that grew or dropped blocks took storage of its own
    if shared:  # the twin's forming sorted the lender's unformed tokens among its own
        assert not torch.equal(lender._data["origins"][..., 8:13], never._data["origins"][..., 8:13])
    twin.give_back()
    for a in (lender, never):
        a.append(*tokens(7, 200, seed=4))
    ours, theirs = lender.state(), never.state()
    assert all(torch.equal(ours[name], theirs[name]) for name in (*FIELDS, "blocked"))
    assert torch.equal(select_blocks(lender, queries, 1.0, 2), select_blocks(never, queries, 1.0, 2))
    assert lender.version == never.version


def test_expected_tokens_land_in_one_allocation_and_leave_the_contents_as_growing_would(monkeypatch):
    """`expect` makes room for what is announced at once (up to the limit): appending it reallocates
    nothing more, and the archive holds what one that grew piece by piece holds."""
    grown, hinted = archive(limit=200), archive(limit=200)
    pieces = [tokens(m, start, seed) for m, start, seed in [(5, 0, 1), (7, 5, 2), (30, 12, 3), (41, 42, 4)]]
    grown.append(*pieces[0])
    hinted.append(*pieces[0])
    hinted.expect(78)
    calls = []
    original = Archive._reallocate
    monkeypatch.setattr(Archive, "_reallocate", lambda self, capacity: calls.append(self) or original(self, capacity))
    for piece in pieces[1:]:
        grown.append(*piece)
        hinted.append(*piece)
    assert len(hinted) == len(grown) == 83
    assert hinted not in calls and calls.count(grown) >= 2  # only the archive that was not told grew
    for name in FIELDS:
        assert torch.equal(hinted.state()[name], grown.state()[name])
    assert hinted.storage()["lo"][:, :, :hinted.full_blocks].equal(grown.storage()["lo"][:, :, :grown.full_blocks])
    capped = archive(limit=64)
    capped.expect(1000)
    assert capped._capacity == 64


def test_a_lent_twin_told_to_expect_more_keeps_sharing_its_lender_s_storage():
    a = archive(limit=200)
    a.append(*tokens(12, 0))
    twin = a.lend()
    twin.expect(150)
    assert twin._data is a._data
    twin.give_back()
