"""The recall window (`h2o_cache.recall`): its slots hold exact copies of the archived tokens the latest
queries chose, per layer and KV head; nothing fed is lost or held twice; growing keeps the row's own
tokens; only changed slots are rewritten; both decode paths choose alike."""

import random
import shutil
from dataclasses import replace

import pytest
import torch

from h2o_cache import CacheConfig, Generator, SamplingParams, StaticDecoder, native_recall, recall, selection
from h2o_cache.archive import CANDIDATES
from h2o_cache.quantized import kernel
from h2o_cache.cache import BURST, FIRST, INTERVAL
from h2o_cache.cache import _epochs as cache_epochs
from h2o_cache.rope import rotate
from h2o_cache.quantized import NativeStep
from tests.conftest import ByteTokenizer, tiny_llama


@pytest.fixture(scope="module")
def peaked_model():
    return tiny_llama(init_std=0.3)  # peaked attention: real heavy hitters, no near-ties


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 128) for _ in range(n)]


def recall_config(**overrides) -> CacheConfig:
    """A small recall config; the text layout unless told (the tests of ranks say so); no re-reads (their
    tests are in test_reread.py)."""
    settings = dict(policy="h2o", budget=32, evict_slack=4, prefill_chunk=8,
                    recall_budget=16, recall_block=4, recall_probe=6, recall_archive=256, recall_interval=1,
                    recall_interval_max=1,  # the interval does not grow with the rows
                    recall_positions="text", recall_reread=0)
    return CacheConfig(**{**settings, **overrides})


def row_state(cache, row: int) -> dict[str, torch.Tensor]:
    n = cache.lengths[row]
    buffers = cache.buffers()
    return {"keys": buffers.keys[:, row, :, :n].clone(), "values": buffers.values[:, row, :, :n].clone(),
            "scores": buffers.scores[:, row, :, :n].clone(), "origins": buffers.origins[:, row, :, :n].clone(),
            "pinned": cache._pinned[:, row, :, :n].clone(), "rotated": buffers.rotated[:, row, :, :n].clone()}


def rope(model, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own cos, sin [n, D] for positions 0..n-1 (not the cache's table)."""
    x = torch.zeros(1, n, model.config.hidden_size // model.config.num_attention_heads)
    cos, sin = model.model.rotary_emb(x, torch.arange(n)[None])
    return cos[0], sin[0]


def blocks_of(window: torch.Tensor, size: int = 4) -> torch.Tensor:
    """A window of whole blocks ([..., b * size] archive token indices) as its block indices [..., b]."""
    first = window[..., ::size]
    assert torch.equal(window, selection.block_tokens(first // size, size))
    return first // size


def tokens_of(blocks: list[int], size: int = 4) -> torch.Tensor:
    return selection.block_tokens(torch.tensor(blocks), size)


def text_order_positions(origins: torch.Tensor, r: int) -> torch.Tensor:
    """origins [L, H, n] of a row with a window of r slots -> [L, H, r]: where each window token stood
    among the row's own tokens (slots r..n-1, ascending origins), worked out one token at a time."""
    out = torch.zeros(*origins.shape[:2], r, dtype=torch.float64)
    for layer in range(origins.shape[0]):
        for head in range(origins.shape[1]):
            own = origins[layer, head, r:].tolist()
            assert own == sorted(own)  # slots keep the order of the text
            for slot, o in enumerate(origins[layer, head, :r].tolist()):
                older = sum(x < o for x in own)
                since = own[older - 1] if older else -1
                until = own[older] if older < len(own) else o + 1
                out[layer, head, slot] = r - 1 + older + (o - since) / (until - since)
    return out


def assert_window_holds_archive_tokens(model, cache, row: int) -> None:
    """Slots [0, r) of every layer and head are copies of the archived tokens `windows[row]` names:
    their keys, values and origins, keys rotated to where their tokens stood in the text among the
    row's own tokens (`text_order_positions`); pinned is True exactly there; the row's own tokens
    [r, n) are rotated to their slots."""
    r, n = cache.recalled[row], cache.lengths[row]
    state = row_state(cache, row)
    assert torch.equal(state["pinned"], (torch.arange(n) < r).expand_as(state["pinned"]))
    cos, sin = rope(model, n)
    torch.testing.assert_close(state["rotated"][:, :, r:], rotate(state["keys"], cos, sin)[:, :, r:], rtol=1e-5, atol=1e-5)
    if r:
        placed = text_order_positions(state["origins"], r)
        x = torch.zeros(1, 1, state["keys"].shape[-1])
        cos, sin = (t[0].view(*placed.shape, -1) for t in model.model.rotary_emb(x, placed.reshape(1, -1).float()))
        # atol 5e-5: the kernel takes cos and sin of fractional position x frequency in fp32 itself;
        # rtol 2^-10: an fp32 cache's window keys are rounded to fp16 (`recall.stored`), so that the
        # native step's fp16 copy of the window holds them exactly
        window = state["rotated"][:, :, :r]
        torch.testing.assert_close(window, rotate(state["keys"][:, :, :r], cos, sin), rtol=2 ** -10, atol=5e-5)
        if window.dtype == torch.float32:
            assert torch.equal(window, window.half().float())
            assert torch.equal(state["values"][:, :, :r], state["values"][:, :, :r].half().float())
    if not r:
        assert cache.windows[row] is None
        return
    archive = cache.archives[row]
    epoch, held = cache.windows[row]
    assert epoch == archive.epoch and held.shape == (*archive.shape, r)
    ordered = held.sort(dim=-1).values  # each token once, in any slot (`recall.assign`)
    assert (ordered[..., 1:] > ordered[..., :-1]).all() and (held >= 0).all()
    assert (held < archive.full_blocks * archive.block).all()
    stored = archive.state()
    for name in ("keys", "values", "origins"):
        index = held if stored[name].dim() == 3 else held[..., None].expand(-1, -1, -1, stored[name].shape[-1])
        assert torch.equal(state[name][:, :, :r], stored[name].gather(2, index))


def assert_nothing_lost_or_held_twice(cache, row: int) -> None:
    """Per layer and head: the row's own tokens and the archive hold every token fed exactly once, and
    the window holds archived tokens, each once."""
    r, n = cache.recalled[row], cache.lengths[row]
    origins = cache.buffers().origins[:, row, :, :n]
    archive = cache.archives[row]
    archived = archive.state()["origins"] if archive is not None else torch.zeros(*origins.shape[:2], 0, dtype=torch.int64)
    assert archive is None or archive.dropped == 0  # the tests' archives hold everything
    for layer in range(origins.shape[0]):
        for head in range(origins.shape[1]):
            own, stored = origins[layer, head, r:].tolist(), archived[layer, head].tolist()
            assert sorted(own + stored) == list(range(cache.seen[row]))
            window = origins[layer, head, :r].tolist()
            assert len(set(window)) == r and set(window) <= set(stored)


def check_every_pass(gen, model, monkeypatch, rows: int = 1):
    """Check both invariants after every pass `gen` runs; returns the list of passes checked."""
    checked = []
    step = gen.step

    def checked_step(cache, pieces, ahead=None):
        logits = step(cache, pieces, ahead)
        for row in range(rows):
            assert_window_holds_archive_tokens(model, cache, row)
            assert_nothing_lost_or_held_twice(cache, row)
        checked.append((list(cache.recalled), list(cache.recall_count)))
        return logits

    monkeypatch.setattr(gen, "step", checked_step)
    return checked


def test_with_a_budget_above_the_conversation_recall_changes_nothing(peaked_model):
    prompt = random_tokens(60, seed=1)
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    full = Generator(peaked_model, ByteTokenizer(), CacheConfig(policy="full"))
    roomy = Generator(peaked_model, ByteTokenizer(), recall_config(budget=512, evict_slack=8))
    torch.testing.assert_close(roomy.prefill(roomy.new_cache(1), [prompt], recall=True),
                               full.prefill(full.new_cache(1), [prompt]), rtol=1e-5, atol=1e-5)
    full_cache, roomy_cache = full.new_cache(1), roomy.new_cache(1)
    for turn in range(3):
        ask = prompt[turn * 10:(turn + 1) * 10 + 5]
        [a], [b] = full.generate([ask], params, full_cache), roomy.generate([ask], params, roomy_cache)
        assert a.token_ids == b.token_ids
    assert roomy_cache.archives == [None] and roomy_cache.recalled == [0]
    assert roomy_cache.windows == [None] and roomy_cache.recall_count == [0]


@pytest.mark.parametrize("slack", [4, 1, 6])
def test_every_pass_leaves_exact_copies_of_archive_blocks_in_the_window_and_loses_nothing(peaked_model, monkeypatch, slack):
    """A conversation of turns and decode steps on the transformers path: after every pass, the window
    is exact copies of the archive blocks it names (keys, values, origins, rotations), pinned, and the
    row's own tokens and the archive hold every token fed, once. slack 1 and 6: evictions archive
    tokens that do not fill whole blocks, so blocks form from the tokens of several evictions."""
    gen = Generator(peaked_model, ByteTokenizer())
    cache = gen.new_cache(1, recall_config(evict_slack=slack))
    checked = check_every_pass(gen, peaked_model, monkeypatch)
    gen.prefill(cache, [random_tokens(90, seed=2)], recall=True)
    for turn in range(3):
        gen.prefill(cache, [random_tokens(9 + 5 * turn, seed=3 + turn)], recall=True)
        for token in random_tokens(20, seed=10 + turn):
            gen.step(cache, [[token]])
    recalled = [r[0] for r, _ in checked]
    assert recalled[-1] == 16 and 0 < min(r for r in recalled if r) < 16  # it grew in steps, up to the budget
    counts = [c[0] for _, c in checked]
    assert counts[-1] > 2 * 16 * 2 * 2  # the window was rewritten after it opened, not only filled once
    assert len(checked) > 60 and cache.seen[0] > 150 and len(cache.archives[0]) > 100


@pytest.mark.parametrize("slack", [1, 3])
def test_a_window_opened_while_decoding_one_eviction_at_a_time_holds_exact_copies(peaked_model, monkeypatch, slack):
    """Decode steps past the budget, evicting `slack` tokens at a time (fewer than a block): blocks form
    from the tokens of several evictions, which h2o does not drop in origin order."""
    gen = Generator(peaked_model, ByteTokenizer())
    cache = gen.new_cache(1, recall_config(evict_slack=slack))
    gen.prefill(cache, [random_tokens(32, seed=7)])
    checked = check_every_pass(gen, peaked_model, monkeypatch)
    for token in random_tokens(60, seed=8):
        gen.step(cache, [[token]])
    assert cache.recalled == [16] and len(checked) == 60


def test_windows_of_several_rows_are_copies_and_rows_choose_as_they_do_alone(peaked_model, monkeypatch):
    gen = Generator(peaked_model, ByteTokenizer())
    config = recall_config()
    turns = [[random_tokens(70, seed=10), random_tokens(9, seed=11), random_tokens(25, seed=12)],
             [random_tokens(50, seed=20), random_tokens(30, seed=21), random_tokens(4, seed=22)]]
    together = gen.new_cache(2, config)
    alone = [gen.new_cache(1, config) for _ in turns]
    for t in range(3):
        batched = gen.prefill(together, [turns[0][t], turns[1][t]], recall=True)
        for row in range(2):
            assert_window_holds_archive_tokens(peaked_model, together, row)
            assert_nothing_lost_or_held_twice(together, row)
        for row, cache in enumerate(alone):
            single = gen.prefill(cache, [turns[row][t]], recall=True)
            torch.testing.assert_close(batched[row], single[0], rtol=1e-4, atol=1e-5)
    for row, cache in enumerate(alone):
        assert together.recalled[row] == cache.recalled[0] > 0
        assert torch.equal(together.windows[row][1], cache.windows[0][1])
        assert together.recall_count[row] == cache.recall_count[0]
        a, b = row_state(together, row), row_state(cache, 0)
        assert torch.equal(a["origins"], b["origins"]) and torch.equal(a["pinned"], b["pinned"])
        r = together.recalled[row]
        torch.testing.assert_close(a["keys"][:, :, r:], b["keys"][:, :, r:], rtol=1e-4, atol=1e-5)
        # the window's copies come from an fp16 archive: a key that a batch's fp32 sums moved by ~1e-6
        # may round to the next fp16 value (one unit in the last place, 2^-11 relative)
        torch.testing.assert_close(a["keys"][:, :, :r], b["keys"][:, :, :r], rtol=2 ** -10, atol=1e-5)


@pytest.mark.parametrize("first", [28, 40])
def test_growing_moves_the_row_s_own_tokens_unchanged_and_rotates_them_to_their_new_slots(peaked_model, first):
    """first=28: the window opens (0 -> 8); first=40: it widens (12 -> 16). Growing happens at the
    start of the pass after an eviction; here it is called alone, between passes."""
    gen = Generator(peaked_model, ByteTokenizer())
    config = recall_config()
    cache = gen.new_cache(1, config)
    gen.prefill(cache, [random_tokens(first, seed=5)])
    gen.prefill(cache, [random_tokens(8, seed=6)])  # crosses the budget: evicts at the end of the pass
    assert cache.recalled[0] == (0 if first == 28 else 12)
    r, n = cache.recalled[0], cache.lengths[0]
    want = recall.window_size(cache, 0)
    assert want > r and want == min(16, cache.archives[0].full_blocks * 4)
    before, count = row_state(cache, 0), cache.recall_count[0]
    archived = cache.archives[0].state()
    assert recall.grow(cache, 0) and not recall.grow(cache, 0)
    after = row_state(cache, 0)
    assert cache.recalled[0] == want and cache.lengths[0] == n + want - r
    for name in ("keys", "values", "scores", "origins"):
        assert torch.equal(after[name][:, :, want:], before[name][:, :, r:])
    cos, sin = rope(peaked_model, n + want - r)
    torch.testing.assert_close(after["rotated"][:, :, want:], rotate(after["keys"], cos, sin)[:, :, want:],
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(after["pinned"], (torch.arange(n + want - r) < want).expand_as(after["pinned"]))
    # Until queries choose, the window holds the newest blocks of every head.
    full = cache.archives[0].full_blocks
    assert torch.equal(cache.windows[0][1], torch.arange(full * 4 - want, full * 4).expand(2, 2, want))
    assert cache.recall_count[0] == count + 2 * 2 * want
    assert_window_holds_archive_tokens(peaked_model, cache, 0)
    assert_nothing_lost_or_held_twice(cache, 0)
    for name in ("keys", "origins"):  # growing reads the archive, it does not change it
        assert torch.equal(cache.archives[0].state()[name], archived[name])


def crafted(model, needles: torch.Tensor, where: torch.Tensor, recall_budget: int = 8):
    """A 1-row cache of a few tokens whose archive is 10 blocks of 4 small keys, with needles[l, h] * 4
    in block where[l, h] of layer l, head h; its window opened on the newest blocks."""
    config = recall_config(recall_budget=recall_budget)
    gen = Generator(model, ByteTokenizer(), config)
    cache = gen.new_cache(1)
    gen.prefill(cache, [random_tokens(10, seed=1)])
    layers, heads, d = needles.shape
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(layers, heads, 40, d, generator=generator) * 0.05
    for layer in range(layers):
        for head in range(heads):
            keys[layer, head, int(where[layer, head]) * 4 + 2] = needles[layer, head] * 4
    archive = cache.new_archive()
    archive.append(keys, torch.randn(layers, heads, 40, d, generator=generator), None,
                   (torch.arange(40) + 100).expand(layers, heads, 40))
    cache.archives[0] = archive
    assert recall.grow(cache, 0) and cache.recalled == [recall_budget]
    return cache


def needles_of(model) -> torch.Tensor:
    config = model.config
    d = config.hidden_size // config.num_attention_heads
    v = torch.randn(config.num_hidden_layers, config.num_key_value_heads, d, generator=torch.Generator().manual_seed(3))
    return v / v.norm(dim=-1, keepdim=True) * 3


def test_a_query_matching_an_archived_key_brings_its_block_into_that_head_s_window(peaked_model):
    """Each KV head is asked (by one query head of its group; the other asks nothing) for its own
    needle; a layer's needles sit at one position, each layer's at another. One layer choosing alone
    takes its position's block; the layers choosing together pool their votes by position, and every
    head's window (two blocks) takes both positions' blocks, with its own needle's key."""
    needles = needles_of(peaked_model)
    where = torch.tensor([[1, 1], [3, 3]])
    cache = crafted(peaked_model, needles, where)
    layers, heads, d = needles.shape
    newest = torch.tensor([8, 9]).expand(layers, heads, 2)
    assert torch.equal(blocks_of(cache.windows[0][1]), newest)
    group = peaked_model.config.num_attention_heads // heads
    queries = torch.zeros(layers, heads, group, 1, d)
    queries[:, :, 0, 0] = needles
    queries = queries.view(layers, heads * group, 1, d)
    recall.choose(cache, 0, queries[1:], 1.0, slice(1, 2))  # one layer, as a pass asks
    assert torch.equal(blocks_of(cache.windows[0][1][0]), newest[0])
    assert [int(where[1, h]) in blocks_of(cache.windows[0][1][1, h]).tolist() for h in range(heads)] == [True] * heads
    recall.choose(cache, 0, queries, scaling=1.0)
    blocks = blocks_of(cache.windows[0][1])
    origins = cache.buffers().origins[:, 0, :, :8]
    keys = cache.buffers().keys[:, 0, :, :8]
    archived = cache.archives[0].dtype  # an fp32 cache archives in fp16: the needle comes back rounded
    for layer in range(layers):
        for head in range(heads):
            assert int(where[layer, head]) in blocks[layer, head].tolist()
            assert 100 + int(where[layer, head]) * 4 + 2 in origins[layer, head].tolist()
            needle = (needles[layer, head] * 4).to(archived).to(keys.dtype)
            assert any(torch.equal(k, needle) for k in keys[layer, head])
    assert_window_holds_archive_tokens(peaked_model, cache, 0)


def test_fill_rewrites_exactly_the_slots_whose_token_changed(peaked_model):
    """A slot is written only where its token changed, and the count is of the slots written (the
    kernel's fill: `test_native_recall.py`); a token that stays chosen stays in its slot."""
    needles = needles_of(peaked_model)
    cache = crafted(peaked_model, needles, torch.tensor([[1, 5], [3, 0]]))
    r = cache.recalled[0]
    keys = cache.buffers().keys
    layers, heads = needles.shape[:2]

    def poisoned_fill(chosen, layers_=slice(None)):
        """fill(chosen) with every window slot poisoned first: the slots not written stay poisoned."""
        keys[:, 0, :, :r] = 1234.0
        count = cache.recall_count[0]
        recall.fill(cache, 0, chosen, layers_)
        untouched = (keys[:, 0, :, :r] == 1234.0).all(dim=-1)  # [L, H, r]
        return untouched, cache.recall_count[0] - count

    chosen = cache.windows[0][1].clone()
    untouched, added = poisoned_fill(chosen.clone())
    assert untouched.all() and added == 0
    changed = torch.zeros(layers, heads, dtype=torch.bool)
    changed[0, 1] = changed[1, 0] = True
    chosen[changed] = tokens_of([0, 2])  # every slot of those heads differs from the newest blocks
    untouched, added = poisoned_fill(chosen.clone())
    assert torch.equal(untouched, ~changed[..., None].expand(-1, -1, r)) and added == int(changed.sum()) * r
    keys[:, 0, :, :r] = 0.0
    recall.fill(cache, 0, cache.windows[0][1].clone())  # nothing changed: nothing restored
    assert (keys[:, 0, :, :r] == 0).all()
    # Layer 1, head 1 keeps its last block (9) and changes its first (8 -> 6): half its slots.
    chosen = cache.windows[0][1].clone()
    chosen[1, 1] = tokens_of([6, 9])
    untouched, added = poisoned_fill(chosen.clone())
    assert untouched[0].all() and untouched[1, 0].all() and added == r // 2
    assert untouched[1, 1].tolist() == [False] * (r // 2) + [True] * (r // 2)
    # It keeps block 6 and takes block 5 before it: 6 stays in its slots (a list compared slot by slot
    # would differ everywhere), 5 goes to 9's.
    chosen = cache.windows[0][1].clone()
    chosen[1, 1] = tokens_of([5, 6])
    untouched, added = poisoned_fill(chosen.clone())
    assert untouched[1, 1].tolist() == [True] * (r // 2) + [False] * (r // 2) and added == r // 2
    assert torch.equal(cache.windows[0][1][1, 1], tokens_of([6, 5]))
    # Renumbered blocks (epoch): every slot is rewritten, though the indices are the same.
    archive = cache.archives[0]
    archive.load_state(archive.state())
    untouched, added = poisoned_fill(cache.windows[0][1].clone())
    assert not untouched.any() and added == layers * heads * r
    assert_window_holds_archive_tokens(peaked_model, cache, 0)


def recalling_rows(gen: Generator, seeds, decoders) -> None:
    """Rows prefilled with a long first turn and a question, one token pending, into each decoder's batch."""
    for seed in seeds:
        row = gen.new_cache(1)
        gen.prefill(row, [random_tokens(80, seed)], recall=True)
        logits = gen.prefill(row, [random_tokens(7, seed + 100)], recall=True)
        assert row.recalled == [16]
        row.pending = [[int(logits[0].argmax())]]
        for decoder in decoders:
            decoder.cache.extend(row)


def q_projections(model):
    """Collects each layer's q projection output of every pass: [B, C, H_q * D] per layer."""
    captured = []
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda module, args, out: captured.append(out))
             for layer in model.model.layers]
    return captured, hooks


@pytest.mark.parametrize("positions", ["text", "rank"])
def test_the_fast_step_and_the_transformers_path_decode_alike_and_choose_the_same_windows(peaked_model, positions):
    """With recall_interval=1, each step of either path attends with the window the previous step's
    queries chose: same logits, same windows, same tokens; the fast step's kept queries are its q
    projections (before RoPE), as the transformers path's are. With ranks (`recall_positions`), every
    step of both paths reads every held key at its rank (`decode.ranked_keys`, `recall.rank_rotated`),
    across the burst and after it, and the buffers keep the text layout."""
    config = recall_config(recall_positions=positions, recall_burst=12)
    gen = Generator(peaked_model, ByteTokenizer(), config)
    decoder = StaticDecoder(peaked_model, config, max_rows=2)
    eager = gen.new_cache(0)
    recalling_rows(gen, (30, 31), [decoder])
    eager.extend(decoder.cache)
    d = peaked_model.config.hidden_size // peaked_model.config.num_attention_heads
    changes = 0
    for _ in range(30):  # both rows cross the budget with their windows
        before = [w[1].clone() for w in decoder.cache.windows]
        captured, hooks = q_projections(peaked_model)
        try:
            expected = gen.step(eager, eager.pending)
        finally:
            for hook in hooks:
                hook.remove()
        got = decoder.step()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        queries = torch.stack([out[:, -1].view(2, -1, d) for out in captured])
        torch.testing.assert_close(decoder.queries[:, :2], queries, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(eager._queries[:, :2], queries, rtol=1e-4, atol=1e-4)
        assert decoder.cache.due == eager.due and all(decoder.cache.due)
        assert decoder.cache.recalled == eager.recalled == [16, 16] and decoder.cache.lengths == eager.lengths
        for row in range(2):
            assert torch.equal(decoder.cache.windows[row][1], eager.windows[row][1])
            changes += not torch.equal(decoder.cache.windows[row][1], before[row])
            fast, slow = row_state(decoder.cache, row), row_state(eager, row)
            assert torch.equal(fast["origins"], slow["origins"]) and torch.equal(fast["pinned"], slow["pinned"])
            r = decoder.cache.recalled[row]
            torch.testing.assert_close(fast["keys"][:, :, r:], slow["keys"][:, :, r:], rtol=1e-4, atol=1e-4)
            # the window's keys come back from the fp16 archive: the two paths' keys, a few 1e-6 apart,
            # may round to neighbouring fp16 values
            torch.testing.assert_close(fast["keys"][:, :, :r], slow["keys"][:, :, :r], rtol=2 ** -10, atol=1e-4)
            assert_window_holds_archive_tokens(peaked_model, decoder.cache, row)
            assert_nothing_lost_or_held_twice(decoder.cache, row)
        tokens = [[t] for t in expected.argmax(-1).tolist()]
        decoder.cache.pending, eager.pending = tokens, [list(t) for t in tokens]
    assert changes > 0  # the steps' queries did move the windows


@pytest.mark.parametrize("burst, interval, most, every", [(0, 1, 1, 1), (0, 3, 1, 3), (4, 5, 1, 5), (0, 1, 8, 2),
                                                          (2, 2, 3, 3)])
def test_the_fast_path_chooses_after_a_prefill_through_the_burst_and_every_interval_steps(peaked_model, monkeypatch,
                                                                                          burst, interval, most, every):
    """A row's k-th decode step after its prefill starts with a choice when k < burst or k is a
    multiple of the interval (k = 0: the prefill's last queries, pooled over all layers): with the 2
    rows decoding, 2 x recall_interval, at most recall_interval_max (1: it does not grow)."""
    config = recall_config(recall_burst=burst, recall_interval=interval, recall_interval_max=most)
    assert config.choice_interval(2) == every and config.choice_interval(1) == interval
    chooses = lambda k: k < burst or k % every == 0  # noqa: E731
    gen = Generator(peaked_model, ByteTokenizer(), config)
    decoder = StaticDecoder(peaked_model, config, max_rows=2)
    recalling_rows(gen, (40, 41), [decoder])
    refreshed, few = [], []
    refresh = recall.refresh
    monkeypatch.setattr(recall, "refresh", lambda cache, queries, scaling, rows, **kw:
                        refreshed.extend([decoder.steps] * len(rows)) or few.extend(row in kw["few"] for row in rows)
                        or refresh(cache, queries, scaling, rows, **kw))
    for step in range(1, 13):
        counts, windows = list(decoder.cache.recall_count), [w[1].clone() for w in decoder.cache.windows]
        keys = decoder.cache.buffers().keys[:, :2, :, :16].clone()
        logits = decoder.step()
        assert [bool(d) for d in decoder.cache.due] == [chooses(step)] * 2 and decoder.cache.decoded == [step] * 2
        assert decoder.cache.due == [BURST if step < burst else INTERVAL if chooses(step) else 0] * 2
        if not chooses(step - 1):  # no choice was due before this step
            assert decoder.cache.recall_count == counts
            assert all(torch.equal(w[1], before) for w, before in zip(decoder.cache.windows, windows))
            assert torch.equal(decoder.cache.buffers().keys[:, :2, :, :16], keys)
        decoder.cache.pending = [[t] for t in logits.argmax(-1).tolist()]
    # each row's choice runs at the start of its step, before it is fed; those after the burst by the
    # votes of `recall_voters`' layers (`few`), the reply's first and the burst's by every layer's
    assert refreshed == [k for k in range(12) if chooses(k) for _ in range(2)]
    assert few == [k >= max(burst, 1) for k in refreshed]


def test_a_choice_that_raises_fails_before_the_step_feeds_anything(peaked_model, monkeypatch):
    """A failing choice leaves the row due and the step unfed, so a retry (the runner's fallback to the
    transformers path) feeds each token once; once it succeeds, both rows go on as if nothing failed."""
    config = recall_config()
    gen = Generator(peaked_model, ByteTokenizer(), config)
    decoder = StaticDecoder(peaked_model, config, max_rows=2)
    recalling_rows(gen, (60, 61), [decoder])
    decoder.cache.pending = [[t] for t in decoder.step().argmax(-1).tolist()]
    assert all(decoder.cache.due)
    lengths, seen = list(decoder.cache.lengths), list(decoder.cache.seen)
    choose_rows = recall.choose_rows

    def failing(cache, asked, scaling, *args, done=None, **kw):  # row 1's choice raises, after the rows before it chose
        rows = [row for row, _ in asked]
        if 1 in rows:
            choose_rows(cache, asked[:rows.index(1)], scaling, *args, done=done, **kw)
            raise RuntimeError("injected choice failure")
        return choose_rows(cache, asked, scaling, *args, done=done, **kw)

    monkeypatch.setattr(recall, "choose_rows", failing)
    with pytest.raises(RuntimeError, match="injected"):
        decoder.step()
    assert not decoder.cache.due[0] and decoder.cache.due[1] and decoder.cache.seen == seen and decoder.cache.lengths == lengths
    with pytest.raises(RuntimeError, match="injected"):  # the transformers path fails before feeding too
        gen.step(decoder.cache, decoder.cache.pending)
    assert decoder.cache.seen == seen
    logits = gen.step(decoder.cache, [decoder.cache.pending[0], []])  # the other row alone goes on
    assert decoder.cache.seen == [seen[0] + 1, seen[1]] and torch.isfinite(logits[0]).all()


def test_a_choice_beside_the_step_is_the_choice_before_it_read_one_step_later(peaked_model):
    """With recall_overlap (a GPU's default, forced here on the CPU) a due choice runs after its step is
    queued, by the same queries: the step reads the window as it was (the logits of a step that made
    no choice), and the window it leaves is the one the choice before the step makes (same tokens,
    keys and counts); the choices due next are the serial path's. A reply's first choice still goes
    before its step. Each step starts the three decoders from the serial one's state."""
    config = recall_config(recall_burst=3, recall_interval=2)
    gen = Generator(peaked_model, ByteTokenizer(), config)
    serial, beside, unchosen = (StaticDecoder(peaked_model, replace(config, recall_overlap=overlap), max_rows=2)
                                for overlap in (False, True, False))
    assert (serial.overlap, beside.overlap, StaticDecoder(peaked_model, config, max_rows=1).overlap) == (False, True, False)
    decoders = (serial, beside, unchosen)
    recalling_rows(gen, (50, 51), decoders)
    assert beside.cache.due == [FIRST, FIRST]
    kinds = []
    for step in range(12):
        due = list(serial.cache.due)
        kinds.append(max(due))
        counts = list(serial.cache.recall_count)
        if due != [FIRST, FIRST]:
            unchosen.cache.due = [0, 0]
        got = [decoder.step() for decoder in decoders]
        if due == [FIRST, FIRST]:  # the reply's first choice: before its step on both
            assert torch.equal(got[1], got[0])
        elif any(due):
            assert torch.equal(got[1], got[2]) and serial.cache.recall_count != counts  # the step read the old window
            assert not torch.equal(got[1], got[0])
        assert beside.cache.due == serial.cache.due and beside.cache.lengths == serial.cache.lengths
        assert beside.cache.recall_count == serial.cache.recall_count
        for row in range(2):
            assert torch.equal(beside.cache.windows[row][1], serial.cache.windows[row][1])
            fast, slow = row_state(beside.cache, row), row_state(serial.cache, row)
            # all but the step's own new token (the last slot), whose keys came from a different window
            assert all(torch.equal(fast[name][..., :-1, :], slow[name][..., :-1, :]) for name in ("keys", "rotated", "values"))
            assert torch.equal(fast["origins"], slow["origins"])
            assert_nothing_lost_or_held_twice(beside.cache, row)
        tokens = [[t] for t in got[0].argmax(-1).tolist()]
        serial.cache.pending = tokens
        for decoder in (beside, unchosen):
            decoder.cache.pop(1), decoder.cache.pop(0)
            decoder.cache.extend(serial.cache)
    assert kinds[0] == FIRST and BURST in kinds and INTERVAL in kinds and 0 in kinds


def test_a_choice_beside_the_step_that_raises_leaves_the_step_fed_and_the_next_choice_before_its_step(
        peaked_model, monkeypatch):
    """A choice beside the step runs after the step fed its tokens: if it raises, the step still returns
    its logits (nothing is fed twice), the row stays due, and its next choice goes before its step,
    where a failure raises before anything is fed (as without overlap)."""
    config = recall_config(recall_overlap=True)
    gen = Generator(peaked_model, ByteTokenizer(), config)
    decoder = StaticDecoder(peaked_model, config, max_rows=2)
    recalling_rows(gen, (60, 61), [decoder])
    decoder.cache.pending = [[t] for t in decoder.step().argmax(-1).tolist()]  # the first choices, before it
    assert decoder.cache.due == [BURST, BURST]
    choose_rows = recall.choose_rows
    fail = [True]

    def failing(cache, asked, scaling, *args, **kw):
        if fail[0]:
            raise RuntimeError("injected choice failure")
        return choose_rows(cache, asked, scaling, *args, **kw)

    monkeypatch.setattr(recall, "choose_rows", failing)
    seen = list(decoder.cache.seen)
    logits = decoder.step()
    assert torch.isfinite(logits).all() and decoder.cache.seen == [n + 1 for n in seen] and decoder.cache.due == [BURST] * 2
    decoder.cache.pending = [[t] for t in logits.argmax(-1).tolist()]
    with pytest.raises(RuntimeError, match="injected"):  # before the step, which feeds nothing
        decoder.step()
    assert decoder.cache.seen == [n + 1 for n in seen]
    fail[0] = False
    counts = list(decoder.cache.recall_count)
    decoder.step()
    assert decoder.cache.seen == [n + 2 for n in seen] and decoder.cache.recall_count != counts


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler to build the kernel")
    from tests.h2o_cache.test_quantized import gguf_llama

    model = tiny_llama(init_std=0.3)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    gguf_llama(path, model)
    model.gguf_path = path
    return model


@pytest.mark.parametrize("positions", ["text", "rank"])
def test_the_native_step_leaves_decode_step_s_queries_and_chooses_the_same_windows(gguf_model, positions):
    """The native step and `decode_step` give the same logits, queries and windows, with the text
    layout and with every held key read at its rank (each rotates the keys as fed to their ranks
    itself; the text layout's logits differ from the ranks')."""
    config = recall_config(recall_positions=positions, recall_rank_steps=None)  # ranks: at every step
    gen = Generator(gguf_model, ByteTokenizer(), config)
    native = StaticDecoder(gguf_model, config, max_rows=4, exact=True)
    ops = StaticDecoder(gguf_model, config, max_rows=4, native=False)
    assert native.native is not None and ops.native is None
    recalling_rows(gen, (50, 51, 52), [native, ops])  # a bucket of 4 with a padding row
    text = (StaticDecoder(gguf_model, recall_config(recall_positions="text"), max_rows=4, exact=True)
            if positions == "rank" else None)
    if text is not None:
        recalling_rows(gen, (50, 51, 52), [text])
    differ = 0
    for _ in range(20):
        by_native, by_ops = native.step(), ops.step()
        torch.testing.assert_close(by_native, by_ops, rtol=1e-5, atol=1e-5 * by_ops.abs().max().item())
        if text is not None:
            differ += not torch.allclose(text.step(), by_native, rtol=1e-3, atol=1e-3)
            text.cache.pending = [[t] for t in by_ops.argmax(dim=-1).tolist()]
        torch.testing.assert_close(native.queries[:, :3], ops.queries[:, :3], rtol=1e-5, atol=1e-5)
        for row in range(3):
            assert torch.equal(native.cache.windows[row][1], ops.cache.windows[row][1])
            assert_window_holds_archive_tokens(gguf_model, native.cache, row)
        native.cache.pending = ops.cache.pending = [[t] for t in by_ops.argmax(dim=-1).tolist()]
    assert native.cache.lengths == ops.cache.lengths and native.cache.recalled == [16] * 3
    assert differ > 10 if positions == "rank" else differ == 0


def test_ranks_for_a_replys_first_steps_then_the_text_layout_row_by_row(gguf_model, monkeypatch):
    """`recall_rank_steps` K: a row reads its held keys at their ranks in its reply's first K decode steps
    after a prompt (bit for bit as with ranks at every step), then the text layout; rows at other steps
    of their replies share a batch, each read its own way, and the native step agrees with the torch
    step (`decode_step`'s per-row flags, as a CUDA graph runs it) all along."""
    steps = 5
    config = recall_config(recall_interval=2, recall_burst=2, recall_positions="rank", recall_rank_steps=steps)
    gen = Generator(gguf_model, ByteTokenizer(), config)
    native = StaticDecoder(gguf_model, config, max_rows=4, exact=True)
    ops = StaticDecoder(gguf_model, config, max_rows=4, native=False)
    always = StaticDecoder(gguf_model, replace(config, recall_rank_steps=None), max_rows=4, exact=True)
    recalling_rows(gen, (80, 81), [native, ops, always])
    flags = []
    call = NativeStep.__call__

    def recording(step, tokens, slots, origins, recalled=None, ranked=None, epochs=None):
        if step is native.native:
            flags.append([int(r > 0) for r in ranked])
        return call(step, tokens, slots, origins, recalled, ranked, epochs)

    monkeypatch.setattr(NativeStep, "__call__", recording)
    for i in range(12):
        if i == 3:  # a new reply joins: its first steps read ranks while the others' read the text
            recalling_rows(gen, (82,), [native, ops, always])
        by_native, by_ops, by_always = native.step(), ops.step(), always.step()
        torch.testing.assert_close(by_native, by_ops, rtol=1e-5, atol=1e-5 * by_ops.abs().max().item())
        if i < steps:  # every row in its first steps: as with ranks at every step
            assert torch.equal(by_native, by_always)
        for decoder in (native, ops, always):
            decoder.cache.pending = [[t] for t in by_ops.argmax(dim=-1).tolist()]
    expected = [[int(k < steps)] * 2 + ([int(k - 3 < steps)] if k >= 3 else []) for k in range(12)]
    assert flags == expected
    assert not torch.equal(native.step(), always.step())  # past the first steps the layouts differ


def test_a_step_where_no_row_reads_ranks_leaves_them_out_bit_for_bit(gguf_model, monkeypatch):
    """The torch step (a CUDA graph's body) of a batch whose rows are all past their reply's rank steps
    runs without ranks (`StaticDecoder._run(bucket, False)`: on CUDA the bucket's other graph): its
    logits are bit for bit those of the step with ranks, every row's flag 0, which it no longer runs."""
    import h2o_cache.static as static

    config = recall_config(recall_interval=2, recall_burst=2, recall_positions="rank", recall_rank_steps=3)
    gen = Generator(gguf_model, ByteTokenizer(), config)
    ops = StaticDecoder(gguf_model, config, max_rows=4, native=False)
    recalling_rows(gen, (80, 81), [ops])
    real, checked = static.decode_step, []

    def both(*args):
        out = real(*args)
        if args[-1] is None:  # the same step with ranks and every flag 0, its scores' second sum undone
            flags, scores = ops.inputs(args[2].shape[0])[3], args[1].scores.clone()
            assert not flags.any()
            checked.append(torch.equal(out, real(*args[:-1], flags)))
            args[1].scores.copy_(scores)
        else:
            checked.append(None)
        return out

    monkeypatch.setattr(static, "decode_step", both)
    for _ in range(8):
        logits = ops.step()
        ops.cache.pending = [[t] for t in logits.argmax(dim=-1).tolist()]
    assert checked == [None] * 3 + [True] * 5


def test_keys_kept_at_their_ranks_from_step_to_step_read_as_keys_rotated_at_every_step(gguf_model):
    """With ranks the native step keeps each row's keys rotated to their ranks from call to call and
    rotates again only the slots whose token or rank changed (`NativeStep(ranks=True)`): its logits
    are bit for bit those of a step whose rows take a new epoch before every call, so that it rotates
    every key at every call, through steps that
    choose and steps that do not, evictions, a bucket below the window copy's, rows that leave and
    rows that come in at a leaving row's index holding another sequence under the same origins (a
    new epoch: `H2OCache.epochs`)."""
    config = recall_config(recall_interval=3, recall_burst=2, recall_positions="rank", recall_rank_steps=None)
    gen = Generator(gguf_model, ByteTokenizer(), config)
    kept = StaticDecoder(gguf_model, config, max_rows=4, exact=True)
    every = StaticDecoder(gguf_model, config, max_rows=4, exact=True)
    assert kept.native._ranks is not None
    meta, every_meta = kept.native._ranks[2], every.native._ranks[2]
    recalling_rows(gen, (70, 71, 72), [kept, every])
    reused = steps = 0
    for i in range(30):
        if i in (8, 16):  # the first row leaves, the last takes its index; a new row comes
            for decoder in (kept, every):
                decoder.cache.pop(0)
            recalling_rows(gen, (73 + i,), [kept, every])
        if i == 24:  # one row left: a bucket of 1 reads the fp32 window, not its copy
            for decoder in (kept, every):
                decoder.cache.pop(0), decoder.cache.pop(0)
        every.cache.epochs = [next(cache_epochs) for _ in every.cache.epochs]  # nothing it kept is read
        by_kept, by_every = kept.step(), every.step()
        assert torch.equal(by_kept, by_every)
        rows = kept.cache.batch_size
        lengths = torch.tensor(kept.cache.lengths)[None, :, None]
        with_window = torch.tensor(every.cache.recalled)[None, :, None] > 0
        epochs = torch.tensor(every.cache.epochs)[None, :, None]
        assert bool(((every_meta[:, :rows, :, 0] == epochs) | ~with_window).all())  # every head read anew
        reused += int((meta[:, :rows, :, 2] < lengths).sum())
        steps += 1
        for decoder in (kept, every):
            decoder.cache.pending = [[t] for t in by_every.argmax(dim=-1).tolist()]
    assert kept.cache.lengths == every.cache.lengths and steps == 30
    assert reused >= 30  # heads did read their kept keys as they were (76 of 340 here), not only rotate anew
    assert sum(kept.cache.recall_count) > 4 * 2 * 2 * 16  # the last row's windows changed, not only filled once


@pytest.mark.parametrize("positions", ["text", "rank"])
def test_the_native_step_reads_an_exact_fp16_copy_of_every_window(gguf_model, monkeypatch, positions):
    """The native step reads each row's window from the cache's fp16 copy (`recall.WindowCopy`): at
    every call, choices, evictions, rows popped and rows added included, the copy equals the window's
    rotated keys and values bit for bit (they are fp16 values: `recall.stored`), and the step's logits
    are the torch ops' over the fp32 window. With ranks too the copy holds the text layout's rotated
    keys (a row that reads at ranks rotates its keys as fed itself and reads only the copy's values)."""
    # every bucket reads the copy by default (`static.WINDOW_COPY_MIN_ROWS` 1); from 2 here, so that a
    # bucket of 1 reads the fp32 window and the step switches between the two
    import h2o_cache.static as static

    monkeypatch.setattr(static, "WINDOW_COPY_MIN_ROWS", 2)
    config = recall_config(recall_interval=3, recall_positions=positions)
    gen = Generator(gguf_model, ByteTokenizer(), config)
    native = StaticDecoder(gguf_model, config, max_rows=4, exact=True)
    ops = StaticDecoder(gguf_model, config, max_rows=4, native=False)
    assert native.cache.window_copy() is not None and ops.cache.window_copy() is None
    checked = []
    call = NativeStep.__call__

    def checking(step, tokens, slots, origins, recalled=None, ranked=None, epochs=None):
        cache = native.cache
        assert (ranked is not None) == (positions == "rank")
        keys = cache._rotated
        if recalled is None:  # a bucket too small to read the copy: the fp32 window, the same values
            checked.append(None)
            return call(step, tokens, slots, origins, recalled, ranked, epochs)
        for row in range(cache.batch_size):
            r = cache.recalled[row]
            assert recalled[row] == r
            assert torch.equal(step.window[0, :, row, :, :r].float(), keys[:, row, :, :r])
            assert torch.equal(step.window[1, :, row, :, :r].float(), cache._values[:, row, :, :r])
        checked.append(sum(recalled))
        return call(step, tokens, slots, origins, recalled, ranked, epochs)

    monkeypatch.setattr(NativeStep, "__call__", checking)
    recalling_rows(gen, (60, 61, 62), [native, ops])
    for i in range(24):
        if i == 8:  # a row leaves (the last takes its place) and a new one comes
            for decoder in (native, ops):
                decoder.cache.pop(0)
            recalling_rows(gen, (63,), [native, ops])
        by_native, by_ops = native.step(), ops.step()
        torch.testing.assert_close(by_native, by_ops, rtol=1e-5, atol=1e-5 * by_ops.abs().max().item())
        for decoder in (native, ops):
            decoder.cache.pending = [[t] for t in by_ops.argmax(dim=-1).tolist()]
    assert len(checked) == 24 and min(checked) == 3 * 16
    assert native.cache.lengths == ops.cache.lengths
    assert sum(native.cache.recall_count) > 3 * 30 * 16  # the windows did change, not only fill once
    for decoder in (native, ops):  # one row left: a bucket of 1 reads the fp32 window
        decoder.cache.pop(0), decoder.cache.pop(0)
    native.cache.window_copy()  # current again, nothing marked
    count = native.cache.recall_count[0]
    for _ in range(6):  # its choices leave the unread copy as it was and mark the row
        by_native, by_ops = native.step(), ops.step()
        torch.testing.assert_close(by_native, by_ops, rtol=1e-5, atol=1e-5 * by_ops.abs().max().item())
        for decoder in (native, ops):
            decoder.cache.pending = [[t] for t in by_ops.argmax(dim=-1).tolist()]
    assert checked[24:] == [None] * 6
    assert native.cache.recall_count[0] > count and 0 in native.cache._window_copy.stale
    recalling_rows(gen, (64, 65), [native, ops])  # a bucket of 4 again: the copy is read, current again
    for _ in range(4):
        by_native, by_ops = native.step(), ops.step()
        torch.testing.assert_close(by_native, by_ops, rtol=1e-5, atol=1e-5 * by_ops.abs().max().item())
        for decoder in (native, ops):
            decoder.cache.pending = [[t] for t in by_ops.argmax(dim=-1).tolist()]
    assert len(checked) == 34 and None not in checked[30:]


@pytest.mark.parametrize("ahead", [True, False])
def test_a_body_chunk_takes_the_window_its_previous_chunk_chose_and_the_tail_chooses_its_own(peaked_model, monkeypatch, ahead):
    """With `recall_ahead`, a chunk of the prompt's body is given, before its pass, the window the
    previous chunk's choosing queries point at, in one choice over all layers; the question's tail
    chooses layer by layer with its own queries, as every chunk does without it. A body chunk chooses by
    `recall_queries` of its queries, the tail by all of its."""
    config = recall_config(recall_ahead=ahead, recall_queries=3)
    gen = Generator(peaked_model, ByteTokenizer(), config)
    layers = peaked_model.config.num_hidden_layers
    calls, stored = [], []
    choose_rows, step = recall.choose_rows, gen.step

    def recording_choose(cache, asked, scaling, layers=slice(None), everywhere=False, per_layer=False, done=None,
                         **kw):
        calls[-1].extend((layers, queries.clone(), per_layer) for _, queries in asked)
        return choose_rows(cache, asked, scaling, layers, everywhere, per_layer, done, **kw)

    def recording_step(cache, pieces, ahead_rows=None):
        calls.append([])
        logits = step(cache, pieces, ahead_rows)
        stored.append((len(pieces[0]), None if cache.ahead[0] is None else cache.ahead[0].clone()))
        return logits

    monkeypatch.setattr(recall, "choose_rows", recording_choose)  # what every choice goes through
    monkeypatch.setattr(gen, "step", recording_step)
    cache = gen.new_cache(1)
    gen.prefill(cache, [random_tokens(70, seed=5)], recall=True)
    tail = -(-config.recall_probe // config.prefill_chunk)
    assert [n for n, _ in stored] == [8] * 8 + [6]  # 64 tokens of body in chunks of 8, the tail of 6
    for i, (n, queries) in enumerate(stored):
        if not ahead:
            assert queries is None  # nothing kept for a choice ahead that never comes
            continue
        # the choosing queries: 3 of each body chunk's, evenly spaced, the last token's among them; all the tail's
        assert queries.shape[2] == (3 if i < len(stored) - 1 else 6)
        assert torch.equal(queries[:, :, -1], cache._queries[:, 0]) == (i == len(stored) - 1)
    assert all(queries.shape[2] == (3 if i < len(calls) - tail else 6)
               for i, pass_calls in enumerate(calls) for _, queries, _ in pass_calls)
    chose = [i for i, pass_calls in enumerate(calls) if pass_calls]
    assert chose and chose[-1] == len(calls) - 1  # windows open during the body; the tail chooses
    for i in chose:
        body = i < len(calls) - tail
        if ahead and body:
            (only, queries, per_layer), = calls[i]  # each layer's heads pool alone, as in a chunk's own choice
            assert only == slice(None) and per_layer and torch.equal(queries, stored[i - 1][1])
        else:
            assert [where for where, _, _ in calls[i]] == [slice(layer, layer + 1) for layer in range(layers)]


def test_a_decode_pass_forgets_the_chunk_s_queries_so_the_next_turn_chooses_its_own_first(peaked_model):
    gen = Generator(peaked_model, ByteTokenizer(), recall_config(recall_ahead=True))
    cache = gen.new_cache(1)
    gen.prefill(cache, [random_tokens(50, seed=6)], recall=True)
    assert cache.ahead[0] is not None
    gen.step(cache, [[5]])
    assert cache.ahead[0] is None


def test_recalled_tokens_take_places_that_read_with_the_row_s_own_tokens_in_the_order_of_the_text():
    """`text_positions`: sorted by position, window and own tokens come in the order of their origins,
    the window's tokens within (first - 1, first + m), as the one-at-a-time reference places them;
    a token older than every own token and one newer than all of them included."""
    g = torch.Generator().manual_seed(0)
    layers, heads, r, m = 2, 3, 8, 12
    first = r  # the window's slots come first
    recalled, own = torch.empty(layers, heads, r, dtype=torch.int64), torch.empty(layers, heads, m, dtype=torch.int64)
    for layer in range(layers):
        for head in range(heads):
            order = torch.randperm(40, generator=g)
            recalled[layer, head], own[layer, head] = order[:r], order[r:r + m].sort().values
    recalled[0, 0], own[0, 0] = torch.tensor([0, 13, 20, 14, 30, 15, 16, 17]), torch.arange(1, m + 1)  # 0: older than all
    recalled[0, 1], own[0, 1] = torch.tensor([39, 12, 14, 16, 18, 20, 22, 24]), torch.arange(m)  # 39: newer than all
    placed = recall.text_positions(recalled, own, first)
    assert placed.dtype == torch.float32 and placed.shape == (layers, heads, r)
    assert (placed > first - 1).all() and (placed < first + m).all()
    positions = torch.cat([placed, (first + torch.arange(m, dtype=torch.float32)).expand(layers, heads, m)], -1)
    origins = torch.cat([recalled, own], -1)
    in_place_order = origins.gather(-1, positions.argsort(dim=-1))
    assert (in_place_order[..., 1:] > in_place_order[..., :-1]).all()
    torch.testing.assert_close(placed.double(), text_order_positions(origins, r), rtol=0, atol=1e-6)


def test_held_ranks_order_every_held_token_by_its_origin_a_phrase_one_position_a_word():
    """`held_ranks`: a permutation of the slots in the order of the origins; where the window holds a
    phrase of 5 consecutive tokens from between two own tokens, its words stand one position apart
    (`text_positions` puts all five within one slot); own tokens newer than every window token keep
    their slots."""
    r, m = 8, 12
    window = torch.tensor([40, 41, 42, 43, 44, 3, 90, 5])  # a phrase 40-44 between own tokens 30 and 100
    own = torch.tensor([0, 1, 2, 10, 20, 30, 100, 110, 120, 121, 122, 123])
    origins = torch.cat([window, own])
    ranks = recall.held_ranks(origins[None, None])[0, 0]
    assert sorted(ranks.tolist()) == list(range(r + m))
    assert torch.equal(origins[ranks.argsort()], origins.sort().values)
    assert ranks[:5].tolist() == [8, 9, 10, 11, 12]  # 0 1 2 3 5 10 20 30 | 40..44
    assert torch.equal(ranks[r + 7:], torch.arange(r + 7, r + m))  # own tokens newer than the window: their slots
    fractional = recall.text_positions(window[None, None], own[None, None], r)[0, 0, :5]
    assert fractional.max() - fractional.min() < 1


def test_rank_positions_rotate_the_held_keys_of_a_row_with_a_window_to_their_ranks_and_no_other(peaked_model, monkeypatch):
    """recall_positions "rank": a pass attends to each held key rotated to its rank (`rank_rotated`,
    a copy: the buffers keep the text layout); a row with no window yet attends as before; generation
    with it is deterministic and reads other positions than the text layout's (other replies)."""
    config = recall_config(recall_positions="rank")
    gen = Generator(peaked_model, ByteTokenizer(), config)
    cache = gen.new_cache(2)
    gen.prefill(cache, [random_tokens(90, seed=1), random_tokens(10, seed=2)], recall=True)
    assert cache.recalled[0] > 0 and cache.recalled[1] == 0
    cache.begin([4, 4])  # a prefill chunk: its pass reads ranks from a copy
    step = cache._step
    layer = 1
    keys = cache._rotated[layer, :2, :, :step.kv_len]
    before = keys.clone()
    rotated = recall.rank_rotated(cache, step, layer, keys)
    assert torch.equal(keys, before)  # the buffers are untouched
    n = cache.lengths[0] + 4
    cos, sin = cache.spec.rope.at(recall.held_ranks(cache._origins[layer, 0, :, :n]))
    expected = rotate(cache._keys[layer, 0, :, :n].float(), cos, sin)
    r = cache.recalled[0]
    expected[:, :r] = expected[:, :r].half().float()  # the window's keys as a window holds them: fp16
    torch.testing.assert_close(rotated[0, :, :n], expected)
    assert torch.equal(rotated[0, :, :r], rotated[0, :, :r].half().float())
    assert not torch.allclose(rotated[0, :, :n], before[0, :, :n])
    assert torch.equal(rotated[1], before[1])
    # the C++ rotation (`native_recall.rank_rotate`, where there is a kernel) and the torch ops agree
    natively = native_recall.rank_rotate(cache, layer, 0, r, n, keys[0].clone())
    monkeypatch.setattr(native_recall, "rank_rotate", lambda *args: False)
    by_torch = recall.rank_rotated(cache, step, layer, keys)
    monkeypatch.undo()
    assert natively == (kernel() is not None)
    assert torch.equal(by_torch, rotated)
    cache._step = None
    prompt = [random_tokens(90, seed=3)]
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    first, again = (gen.generate(prompt, params)[0].token_ids for _ in range(2))
    text = Generator(peaked_model, ByteTokenizer(), recall_config()).generate(prompt, params)[0].token_ids
    assert first == again and first != text


def test_assign_keeps_every_token_still_chosen_in_its_slot_and_fills_the_rest():
    """`recall.assign` over random windows (some slots unknown, -1): the slots then hold exactly the
    chosen tokens; a slot whose token is still chosen keeps it; the others take the new tokens in
    ascending order, into the free slots in ascending order; only as many slots change as tokens are new."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(50):
        r, n = 8, 20
        held = torch.randperm(n, generator=generator)[:r]
        held[torch.rand(r, generator=generator) < 0.2] = -1
        chosen = torch.randperm(n, generator=generator)[:r].sort().values
        assigned = recall.assign(held[None], chosen[None])[0]
        assert sorted(assigned.tolist()) == chosen.tolist()
        stays = torch.isin(held, chosen)
        assert torch.equal(assigned[stays], held[stays])
        new = chosen[~torch.isin(chosen, held)]
        assert torch.equal(assigned[~stays], new)  # ascending tokens into ascending free slots
        assert int((assigned != held).sum()) == len(new)


def test_capped_choices_serve_a_replys_first_choice_first_then_the_rows_in_turn(peaked_model, monkeypatch):
    """recall_choices=1: one row chooses per step; a row whose pending choice is its reply's first (by
    the question) goes before rows whose later choices are due, and those take turns, none starved.
    The rows left waiting stay due and their windows hold tokens of their archives all along."""
    config = recall_config(recall_choices=1, recall_burst=0, recall_interval=1)
    gen = Generator(peaked_model, ByteTokenizer(), config)
    decoder = StaticDecoder(peaked_model, config, max_rows=4)
    recalling_rows(gen, (70, 71, 72), [decoder])
    chose = []
    refresh = recall.refresh
    monkeypatch.setattr(recall, "refresh", lambda cache, queries, scaling, rows, **kw: chose.extend(rows) or
                        refresh(cache, queries, scaling, rows, **kw))
    assert decoder.cache.due == [FIRST] * 3
    for _ in range(3):
        decoder.cache.pending = [[t] for t in decoder.step().argmax(-1).tolist()]
    assert chose == [0, 1, 2]  # three first choices, one per step, though every row is due again
    # a row that has just been prefilled again jumps the queue of later choices
    row = decoder.cache.pop(1)
    logits = gen.prefill(row, [random_tokens(5, 73)], recall=True)
    row.pending = [[int(logits[0].argmax())]]
    decoder.cache.extend(row)  # now rows 0, 1 (was 2), 2 (re-prefilled)
    assert decoder.cache.due == [INTERVAL, INTERVAL, FIRST]
    chose.clear()
    for _ in range(5):
        decoder.cache.pending = [[t] for t in decoder.step().argmax(-1).tolist()]
        for r in range(3):
            assert_window_holds_archive_tokens(peaked_model, decoder.cache, r)
            assert_nothing_lost_or_held_twice(decoder.cache, r)
    assert chose[0] == 2 and sorted(chose[1:4]) == [0, 1, 2]  # then in turn
    assert len(chose) == 5


def test_uncapped_choices_are_unchanged_by_the_cap_field(peaked_model):
    """recall_choices larger than the batch chooses exactly as None does: same windows, same logits."""
    windows, logits = [], []
    for cap in (None, 8):
        config = recall_config(recall_choices=cap)
        gen = Generator(peaked_model, ByteTokenizer(), config)
        decoder = StaticDecoder(peaked_model, config, max_rows=2)
        recalling_rows(gen, (80, 81), [decoder])
        out = []
        for _ in range(6):
            step = decoder.step()
            out.append(step)
            decoder.cache.pending = [[t] for t in step.argmax(-1).tolist()]
        windows.append([w[1].clone() for w in decoder.cache.windows])
        logits.append(torch.stack(out))
    assert all(torch.equal(a, b) for a, b in zip(*windows))
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_a_grown_window_is_wholly_rewritten_by_the_choice_that_follows(peaked_model, kernel):
    """A decode-time choice after the window grew writes every slot (the newest blocks are not filled
    first): every slot holds a token of the archive, each once, at every step of a reply whose window
    grows several times."""
    config = recall_config(recall_budget=64, recall_kernel=kernel)
    gen = Generator(peaked_model, ByteTokenizer(), config)
    cache = gen.new_cache(1)
    gen.prefill(cache, [random_tokens(60, 90)], recall=True)
    cache.pending = [[5]]
    sizes = []
    for _ in range(40):
        logits = gen.step(cache, cache.pending)
        cache.pending = [[int(logits[0].argmax())]]
        sizes.append(cache.recalled[0])
        assert_window_holds_archive_tokens(peaked_model, cache, 0)
        assert_nothing_lost_or_held_twice(cache, 0)
        assert (cache.windows[0][1] >= 0).all()
    assert len(set(sizes)) >= 4 and sizes[-1] == 64  # it grew at several decode-time choices


def test_placing_rows_together_places_each_as_alone():
    """The torch ops place the windows of all the rows of the same window and length in one go (an
    eviction cuts its rows to the same length), rows 0 and 2 of three here, not adjacent: each row's
    window keys come out as placing it alone puts them, and row 1 is untouched."""
    model = tiny_llama(heads=4, kv_heads=2, init_std=0.3)
    gen = Generator(model, ByteTokenizer())
    rows = gen.new_cache(0, recall_config(recall_kernel=False))
    for seed in (4, 5, 6):
        row = gen.new_cache(1, recall_config(recall_kernel=False))
        gen.prefill(row, [random_tokens(220, seed=seed)], recall=True)
        rows.extend(row)
    assert rows.recalled[0] == rows.recalled[2] > 0 and rows.lengths[0] == rows.lengths[2]
    rotated = rows.buffers().rotated
    for row in (0, 2):
        rotated[:, row, :, :rows.recalled[row]] = 0.0
        recall.place(rows, [row])
    alone, before = rotated.clone(), rotated.clone()
    for row in range(3):
        rotated[:, row, :, :rows.recalled[row]] = 0.0
    recall.place(rows, [0, 2])
    assert torch.equal(rotated[:, [0, 2]], alone[:, [0, 2]])
    assert (rotated[:, 1, :, :rows.recalled[1]] == 0).all() and torch.equal(rotated[:, 1, :, rows.recalled[1]:], before[:, 1, :, rows.recalled[1]:])
    assert_window_holds_archive_tokens(model, rows, 0)


def test_a_prefill_pass_hands_each_choosing_row_its_own_queries(monkeypatch):
    """Rows 0 and 2 of a pass choose (row 1 has no window yet): the queries each is handed, downloaded
    once for the two (`forward_pass._choose`, not a contiguous range of rows), are its own."""
    from h2o_cache import forward_pass

    model = tiny_llama(heads=4, kv_heads=2, init_std=0.3)
    gen = Generator(model, ByteTokenizer(), recall_config())
    batch = gen.new_cache(0)
    for seed, n in ((4, 120), (5, 6), (6, 130)):
        row = gen.new_cache(1)
        gen.prefill(row, [random_tokens(n, seed=seed)], recall=True)
        batch.extend(row)
    assert batch.recalled[0] and not batch.recalled[1] and batch.recalled[2]
    seen, handed = [], []
    choose, choose_rows = forward_pass._choose, recall.choose_rows
    monkeypatch.setattr(forward_pass, "_choose", lambda cache, step, layer, plain, scaling: seen.append(plain.clone()) or
                        choose(cache, step, layer, plain, scaling))
    monkeypatch.setattr(recall, "choose_rows", lambda cache, asked, *a, **k: (handed.append(asked) if asked else None)
                        or choose_rows(cache, asked, *a, **k))
    gen.step(batch, [random_tokens(8, seed=s) for s in (7, 8, 9)])
    assert len(handed) == len(seen) == model.config.num_hidden_layers
    for plain, asked in zip(seen, handed):
        assert [row for row, _ in asked] == [0, 2]
        for row, queries in asked:
            assert torch.equal(queries, plain[row:row + 1])


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_a_row_with_a_window_keeps_its_first_tokens_as_sinks(peaked_model, policy):
    """The sinks are the row's first own tokens (slots recalled .. recalled + sinks - 1), not the
    window's first slots: after a long prompt and decode steps past the budget, every layer and head
    still holds the conversation's first four tokens among its own."""
    gen = Generator(peaked_model, ByteTokenizer(), recall_config(policy=policy, sink_tokens=4))
    cache = gen.new_cache(1)
    gen.prefill(cache, [random_tokens(200, seed=3)], recall=True)
    for token in random_tokens(40, seed=4):
        gen.step(cache, [[token]])
    r, n = cache.recalled[0], cache.lengths[0]
    assert r > 0 and len(cache.archives[0]) > 100
    own = cache.buffers().origins[:, 0, :, r:n]
    assert torch.equal(own[..., :4], torch.arange(4).expand_as(own[..., :4]))


def test_a_new_prompt_empties_the_rows_sweep_and_its_replys_first_choice_ranks_every_block():
    """`recall_sweep`: the decode choices keep each head's candidates and move the stripe on; the next
    prompt's prefill empties them, so its reply's first choice ranks every block (by the question),
    and the choices after it keep candidates again."""
    model = tiny_llama(heads=4, kv_heads=2, init_std=0.3)
    gen = Generator(model, ByteTokenizer())
    cache = gen.new_cache(1, recall_config(recall_archive=512, recall_sweep=8))
    gen.prefill(cache, [random_tokens(420, seed=4)], recall=True)
    archive = cache.archives[0]
    candidates = CANDIDATES * cache.recalled[0] // archive.block
    assert archive.full_blocks > candidates + 8  # the bound ranks, and a stripe leaves blocks out
    for token in random_tokens(3, seed=5):
        gen.step(cache, [[token]])
    state = archive._sweep
    assert (state.counts == candidates).all() and int(state.cursor) > 0
    gen.prefill(cache, [random_tokens(12, seed=6)], recall=True)
    assert (state.counts == 0).all() and int(state.cursor) == 0
    gen.step(cache, [[7]])  # ranks every block, keeps them, moves the stripe on by 8
    assert (state.counts == candidates).all() and int(state.cursor) == 8


def test_a_long_prompt_s_archive_is_allocated_about_once_and_holds_what_growing_would(peaked_model, monkeypatch):
    """The prefill tells a row's archive what the rest of its prompt may evict (`Archive.expect`): the
    archive is not reallocated at every half again it grows, and what it holds and the logits are
    those of a prefill that let it grow."""
    from h2o_cache.archive import Archive

    prompt = random_tokens(220, seed=5)
    gen = Generator(peaked_model, ByteTokenizer())
    config = recall_config()
    calls = []
    original = Archive._reallocate
    monkeypatch.setattr(Archive, "_reallocate", lambda self, capacity: calls.append(capacity) or original(self, capacity))
    told = gen.new_cache(1, config)
    told_logits = gen.prefill(told, [prompt], recall=True)
    told_calls, calls[:] = list(calls), []
    monkeypatch.setattr(Archive, "expect", lambda self, more: None)
    grown = gen.new_cache(1, config)
    grown_logits = gen.prefill(grown, [prompt], recall=True)
    assert len(told_calls) <= 2 < len(calls)
    assert torch.equal(told_logits, grown_logits)
    for name, tensor in grown.archives[0].state().items():
        assert torch.equal(told.archives[0].state()[name], tensor), name
    assert torch.equal(told.buffers().keys, grown.buffers().keys)
