"""`Archive` on its own: what goes in comes out exactly, blocks are chosen by their digests."""

import pytest
import torch

from h2o_cache.archive import Archive

L, H, D = 2, 3, 8


def tokens(m: int, start: int, seed: int = 0):
    """m tokens per head with origins start.. (the same in every head, as an eviction's would not be)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(L, H, m, D, generator=gen)
    values = torch.randn(L, H, m, D, generator=gen)
    scores = torch.rand(L, H, m, generator=gen)
    origins = (torch.arange(m) + start).expand(L, H, m).clone()
    return keys, values, scores, origins


def archive(block=4, limit=64):
    return Archive(L, H, D, torch.float32, block=block, limit=limit)


def test_append_in_uneven_pieces_then_state_holds_everything_in_order():
    a = archive()
    pieces = [tokens(m, start, seed) for m, start, seed in [(5, 0, 1), (3, 5, 2), (9, 8, 3)]]
    for piece in pieces:
        a.append(*piece)
    assert len(a) == 17 and a.full_blocks == 4
    state = a.state()
    for name, i in [("keys", 0), ("values", 1), ("scores", 2), ("origins", 3)]:
        assert torch.equal(state[name], torch.cat([p[i] for p in pieces], dim=2))


def test_take_returns_exactly_the_chosen_blocks_and_keeps_the_rest_in_order():
    a = archive()
    keys, values, scores, origins = tokens(18, 0)  # 4 full blocks and a 2-token tail
    a.append(keys, values, scores, origins)
    chosen = torch.tensor([[[0, 2], [1, 3], [2, 3]], [[0, 1], [0, 3], [1, 2]]])  # [L, H, 2]
    got = a.take(chosen)
    for l in range(L):
        for h in range(H):
            picked = [b * 4 + i for b in chosen[l, h].tolist() for i in range(4)]
            rest = [i for i in range(18) if i not in picked]
            for taken, full in zip(got, (keys, values, scores, origins)):
                assert torch.equal(taken[l, h], full[l, h, picked])
            state = a.state()
            assert torch.equal(state["origins"][l, h], origins[l, h, rest])
            assert torch.equal(state["keys"][l, h], keys[l, h, rest])
    assert len(a) == 10 and a.full_blocks == 2


def test_select_finds_the_block_holding_the_key_a_query_matches_and_every_head_follows_the_vote():
    """The needle (origin 37, block 9) sits in two heads only; all heads recall the positions the
    heads that match it voted for, since every head here holds origin 37 in its block 9."""
    a = archive(block=4, limit=256)
    keys, values, scores, origins = tokens(64, 0)
    keys = keys * 0.1
    needle = torch.randn(D, generator=torch.Generator().manual_seed(7))
    keys[0, 1, 37] = keys[1, 2, 37] = needle * 3
    a.append(keys, values, scores, origins)
    chosen = a.select(needle.expand(L, H, 6, D), scaling=1.0, blocks=1)
    assert (chosen[..., 0] == 9).all()


def test_a_head_recalls_its_own_tokens_of_the_voted_positions():
    """Heads evict different tokens: each recalls the block of its own archive holding the voted origin."""
    a = archive(block=4, limit=256)
    keys, values, scores, _ = tokens(32, 0)
    keys = keys * 0.1
    origins = torch.stack([torch.randperm(32, generator=torch.Generator().manual_seed(i)) for i in range(L * H)])
    origins = origins.view(L, H, 32)
    needle = torch.randn(D, generator=torch.Generator().manual_seed(5))
    at = (origins == 20).nonzero()  # where origin 20 sits in each head
    keys[0, 0, at[0, 2]] = needle * 3  # one head matches the needle
    a.append(keys, values, scores, origins)
    taken = a.take(a.select(needle.expand(L, H, 4, D), scaling=1.0, blocks=1))
    assert (taken[3] == 20).any(dim=-1).all()


def test_a_token_repeated_at_every_turn_does_not_outvote_a_fact_stated_once():
    """A chat template repeats at every turn: its copies (equal layer-0 keys, as one token's are)
    each match the query a little better than the fact does, and summed they would take the recall;
    weighted by their rarity, the fact's block wins."""
    a = archive(block=4, limit=256)
    keys, values, scores, origins = tokens(96, 0)
    keys = keys * 0.05
    query = torch.randn(D, generator=torch.Generator().manual_seed(11))
    query = query / query.norm()
    template = query * 2.5 + torch.randn(D, generator=torch.Generator().manual_seed(12)) * 0.05
    fact = query * 2.0 + torch.randn(D, generator=torch.Generator().manual_seed(13)) * 0.05
    copies = list(range(2, 96, 16))  # 6 turns, one template token each
    keys[:, :, copies] = template
    keys[:, :, 41] = fact  # block 10, between two copies
    a.append(keys, values, scores, origins)
    got = a.take(a.select(query.expand(L, H, 4, D), scaling=2.0, blocks=2))
    assert (got[3] == 41).any(dim=-1).all()


def test_select_digests_follow_takes_and_appends():
    """Taken blocks are never chosen again, and blocks appended later are scored too."""
    a = archive(block=4, limit=256)
    keys, values, scores, origins = tokens(32, 0)
    keys = keys * 0.1
    needle = torch.randn(D, generator=torch.Generator().manual_seed(3))
    keys[:, :, 29] = needle * 3
    a.append(keys, values, scores, origins)
    first = a.take(a.select(needle.expand(L, H, 2, D), scaling=1.0, blocks=1))
    assert (first[3] == 29).any(dim=-1).all()
    more = tokens(8, 32, seed=9)
    more_keys = more[0] * 0.1
    more_keys[:, :, 5] = needle * 2  # origin 37: the best block left
    a.append(more_keys, *more[1:])
    second = a.take(a.select(needle.expand(L, H, 2, D), scaling=1.0, blocks=1))
    assert (second[3] == 37).any(dim=-1).all() and len(a) == 32


def test_many_takes_and_appends_keep_every_token_exactly_once():
    a = archive(block=4, limit=64)
    everything = {}
    gen = torch.Generator().manual_seed(0)
    start = 0
    for round in range(30):
        m = int(torch.randint(1, 12, (1,), generator=gen))
        piece = tokens(m, start, seed=round)
        a.append(*piece)
        for i in range(m):
            everything[start + i] = piece[0][0, 0, i]
        start += m
        if a.full_blocks and round % 2:
            got = a.take(a.select(torch.randn(L, H, 3, D, generator=gen), 1.0, 1))
            for origin, key in zip(got[3][0, 0].tolist(), got[0][0, 0]):
                assert torch.equal(everything.pop(origin), key)
    held = a.state()
    n = held["origins"].shape[2]
    assert len(a) == n <= 64 and a.dropped > 0
    # The limit dropped the oldest tokens held (origins grow with appends): what is left is the newest n.
    assert held["origins"][0, 0].tolist() == sorted(everything)[-n:]
    for origin, key in zip(held["origins"][0, 0].tolist(), held["keys"][0, 0]):
        assert torch.equal(everything[origin], key)


def test_limit_drops_the_oldest_whole_blocks():
    a = archive(block=4, limit=32)
    for start in range(0, 48, 6):
        a.append(*tokens(6, start, seed=start))
    assert len(a) <= 32 and len(a) + a.dropped == 48 and a.dropped % 4 == 0
    assert a.state()["origins"][0, 0].tolist() == list(range(a.dropped, 48))


def test_copy_is_independent():
    a = archive()
    a.append(*tokens(12, 0))
    twin = a.copy()
    a.take(torch.zeros(L, H, 1, dtype=torch.int64))
    assert len(twin) == 12 and len(a) == 8
    assert torch.equal(twin.state()["origins"][0, 0], torch.arange(12))


def test_a_copy_keeps_the_blocks_as_they_were_formed():
    """Each batch of evicted tokens is sorted by origin when its blocks form; a copy (and a snapshot,
    which goes through the same state) keeps those blocks rather than re-sorting the whole archive,
    so a restored session recalls what it would have."""
    a = archive(block=4, limit=256)
    first, second = tokens(12, 0, seed=1), tokens(12, 0, seed=2)
    first[3][:] = torch.tensor([20, 3, 11, 7, 0, 9, 22, 15, 1, 5, 18, 13])
    second[3][:] = torch.tensor([4, 16, 2, 21, 8, 12, 23, 10, 6, 17, 14, 19])
    a.append(*first)
    a.select(torch.randn(L, H, 2, D), scaling=1.0, blocks=1)  # the first batch forms its blocks
    a.append(*second)
    twin = a.copy()
    query = torch.randn(L, H, 2, D, generator=torch.Generator().manual_seed(4))
    assert torch.equal(twin.take(twin.select(query, 1.0, 2))[3], a.take(a.select(query, 1.0, 2))[3])
    assert torch.equal(twin.state()["origins"], a.state()["origins"])


def test_an_empty_archive_copies_and_restores_empty():
    twin = archive().copy()
    assert len(twin) == 0 and twin.state()["origins"].shape == (L, H, 0)


def test_a_block_larger_than_the_limit_is_refused():
    with pytest.raises(ValueError):
        Archive(L, H, D, torch.float32, block=16, limit=8)
