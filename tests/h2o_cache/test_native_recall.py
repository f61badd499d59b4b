"""The C++ choices of a recall window (`native_recall`: a decode step's over all layers, a prefill
chunk's by whole blocks) against the torch ops they replace (`Archive.select` and `recall.fill`): the
same tokens in the same slots, the same copies, the same count, the same replies."""

import collections
import ctypes
from dataclasses import replace

import pytest
import torch

from h2o_cache import Generator, SamplingParams, native_recall, recall
from h2o_cache.archive import CANDIDATES
from h2o_cache.recall import text_positions
from h2o_cache.quantized import kernel
from tests.conftest import ByteTokenizer, tiny_llama
from tests.h2o_cache.test_recall import assert_window_holds_archive_tokens, random_tokens, recall_config, row_state


def conversation(model, **overrides):
    """A 1-row cache that consumed a long conversation: its archive holds more blocks than the
    window's candidates (CANDIDATES per block it takes), so every stage of the choice runs, the
    digests' bound included."""
    gen = Generator(model, ByteTokenizer())
    cache = gen.new_cache(1, recall_config(**{"recall_archive": 512, **overrides}))
    gen.prefill(cache, [random_tokens(420, seed=4)], recall=True)
    archive = cache.archives[0]
    assert archive.full_blocks > CANDIDATES * cache.recalled[0] // archive.block
    return gen, cache


def twin(gen, cache, **config):
    copy = gen.new_cache(0, replace(cache.config, **config))
    copy.extend(cache)
    return copy


def assert_same_windows(model, kernel, torch_ops):
    """Row 0 of the two caches: the same tokens in the same window slots, the same copies (rotated
    keys to within rounding), the same count of slots written; the kernel's window holds what it names."""
    assert torch.equal(kernel.windows[0][1], torch_ops.windows[0][1])
    a, b = row_state(kernel, 0), row_state(torch_ops, 0)
    for name in ("keys", "values", "origins", "scores", "pinned"):
        assert torch.equal(a[name], b[name]), name
    # the two place a window key by different roundings of the same angles (the torch ops: position x
    # frequency in fp32; the kernel: the slot's table row turned by share x frequency), both within a
    # few 1e-6 of the exact rotation for keys of norm ~8, then round it to fp16 (`recall.stored`): the
    # same fp16 value or, at a rounding boundary, its neighbour
    r = kernel.recalled[0]
    torch.testing.assert_close(a["rotated"][:, :, r:], b["rotated"][:, :, r:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a["rotated"][:, :, :r], b["rotated"][:, :, :r], rtol=2 ** -10, atol=1e-5)
    assert kernel.recall_count == torch_ops.recall_count
    assert_window_holds_archive_tokens(model, kernel, 0)


@pytest.mark.parametrize("heads, kv_heads, span, hidden, block, digest, sweep", [
    (4, 2, 4, 64, 4, "centre", 0), (8, 1, 0, 64, 4, "centre", 0), (4, 4, 3, 64, 4, "centre", 0),
    (8, 2, 40, 64, 4, "centre", 0), (6, 2, 4, 96, 4, "centre", 0), (5, 1, 2, 80, 3, "centre", 0),
    (4, 2, 4, 64, 4, "mean", 0), (6, 2, 4, 96, 4, "minmax", 0),
    (4, 2, 4, 64, 4, "centre", 30), (5, 1, 2, 80, 3, "centre", 29), (6, 2, 4, 96, 4, "minmax", 31)])
def test_the_kernel_chooses_and_copies_what_the_torch_ops_do(heads, kv_heads, span, hidden, block, digest, sweep):
    """Query groups of 2, 8 (passes of 3, 3 and 2 queries), 1, 3 (the default model's) and 5 (3 and 2);
    spans 0 to 40; blocks of 3 tokens (a head's candidate keys not a multiple of 4: the last ones
    scored apart); the digests of no width (q . centre) and the boxes (their best corner); every block
    ranked at every choice, or (`recall_sweep`) after the first only each head's kept candidates and a
    stripe of a few blocks, the stripe wrapping around the archive. Queries: the row's own, then ever
    noisier ones, each choice starting from the window the last one left; every other choice reads its
    row's queries in place from a buffer of 3 rows (`Choice.query_layer_stride`), as a batch's choices do."""
    model = tiny_llama(heads=heads, kv_heads=kv_heads, init_std=0.3, hidden=hidden)
    gen, cache = conversation(model, recall_span=span, recall_block=block, recall_budget=16 if block == 4 else 15,
                              recall_digest=digest, recall_sweep=sweep)
    if not native_recall.supports(cache):
        pytest.skip("no C++ compiler: the recall kernel is not built")
    kernel, torch_ops = twin(gen, cache, recall_kernel=True), twin(gen, cache, recall_kernel=False)
    assert native_recall.supports(kernel) and not native_recall.supports(torch_ops)
    generator = torch.Generator().manual_seed(0)
    queries = cache._queries
    for i, noise in enumerate((0.0, 0.5, 1.0, 2.0, 4.0)):
        asked = queries + noise * torch.randn(queries.shape, generator=generator)
        if i % 2:  # row 0 of a buffer of 3 rows: each layer's queries 3 rows apart
            batch = torch.randn(queries.shape[0], 3, *queries.shape[2:], generator=generator)
            batch[:, :1] = asked
            asked = batch
        for copy in (kernel, torch_ops):
            recall.refresh(copy, asked, copy.spec.scaling, [0])
        assert_same_windows(model, kernel, torch_ops)
        if sweep:
            assert_same_sweeps(kernel, torch_ops)
    assert kernel.recall_count[0] > 2 * kernel.recalled[0]  # the windows changed along the way
    if sweep:  # the stripe went round the archive's blocks at least once
        assert 5 * sweep > kernel.archives[0].full_blocks


def assert_same_sweeps(kernel, torch_ops):
    """Row 0's running candidates (`archive.Sweep`): the same blocks kept by the same heads, the same
    question's candidates, the same cursor."""
    a, b = kernel.archives[0]._sweep, torch_ops.archives[0]._sweep
    assert torch.equal(a.counts, b.counts) and torch.equal(a.cursor, b.cursor)
    kept = a.counts[..., None] > 0
    assert torch.equal(a.candidates * kept, b.candidates * kept) and torch.equal(a.question * kept, b.question * kept)


@pytest.mark.parametrize("margin", [0.1, 0.5])
def test_the_kernel_favours_held_tokens_by_the_margin_as_the_torch_ops_do(margin):
    """`recall_margin`: a decode choice ranks each head's held tokens by their votes times 1 + margin,
    in the kernel as in the torch ops (the same windows, copies and counts, choice after choice); it
    rewrites fewer slots than the choice without a margin from the same windows and queries."""
    model = tiny_llama(heads=4, kv_heads=2, init_std=0.3, layers=4)
    gen, cache = conversation(model, recall_margin=margin)
    if not native_recall.supports(cache):
        pytest.skip("no C++ compiler: the recall kernel is not built")
    kernel, torch_ops = twin(gen, cache, recall_kernel=True), twin(gen, cache, recall_kernel=False)
    generator = torch.Generator().manual_seed(5)
    queries = cache._queries
    fewer = 0
    for noise in (0.0, 0.5, 1.0, 2.0, 4.0, 1.0, 0.5):
        asked = queries + noise * torch.randn(queries.shape, generator=generator)
        plain = twin(gen, kernel, recall_margin=0.0)  # from the same windows, no margin
        before = kernel.recall_count[0]
        for copy in (kernel, torch_ops, plain):
            recall.refresh(copy, asked, copy.spec.scaling, [0], few={0})  # a choice after the burst
        assert_same_windows(model, kernel, torch_ops)
        written, without = kernel.recall_count[0] - before, plain.recall_count[0] - before
        assert written <= without  # favouring held tokens can only keep more of them
        fewer += written < without
    assert fewer >= 3
    # a burst's choice follows its queries as they are: the window with no margin, where a choice after
    # the burst from the same window keeps other tokens
    plain, after = twin(gen, kernel, recall_margin=0.0), twin(gen, kernel)
    for copy in (kernel, plain):
        recall.refresh(copy, queries, copy.spec.scaling, [0])
    recall.refresh(after, queries, after.spec.scaling, [0], few={0})
    assert torch.equal(kernel.windows[0][1], plain.windows[0][1])
    assert not torch.equal(after.windows[0][1], plain.windows[0][1])


@pytest.mark.parametrize("voters, layers", [(2, [1, 3]), (1, [2]), (4, None)])
def test_the_kernel_chooses_by_the_votes_of_a_few_layers_as_the_torch_ops_do(voters, layers):
    """`recall_voters`: in a choice after the burst (`few`) only the heads of a few layers (of 4: layers
    1 and 3, or layer 2; 4 voters: all) vote, and every head of every layer takes its tokens by their
    votes, as the torch ops choose; the votes of all layers choose otherwise. A choice in the burst
    (not `few`) still pools every layer's votes."""
    model = tiny_llama(heads=4, kv_heads=2, init_std=0.3, layers=4)
    gen, cache = conversation(model, recall_voters=voters, recall_margin=0.0)  # the voters alone
    if not native_recall.supports(cache):
        pytest.skip("no C++ compiler: the recall kernel is not built")
    assert cache.config.voter_layers(4) == layers
    kernel, torch_ops = twin(gen, cache, recall_kernel=True), twin(gen, cache, recall_kernel=False)
    everyone, burst = twin(gen, cache, recall_voters=0), twin(gen, cache)
    generator = torch.Generator().manual_seed(4)
    queries = cache._queries
    differs = 0
    for noise in (0.0, 0.5, 1.0, 2.0, 4.0):
        asked = queries + noise * torch.randn(queries.shape, generator=generator)
        for copy in (kernel, torch_ops, everyone):
            recall.refresh(copy, asked, copy.spec.scaling, [0], few={0})
        recall.refresh(burst, asked, burst.spec.scaling, [0])
        assert_same_windows(model, kernel, torch_ops)
        assert torch.equal(burst.windows[0][1], everyone.windows[0][1])
        differs += not torch.equal(kernel.windows[0][1], everyone.windows[0][1])
    assert differs >= 3 if layers is not None else differs == 0


@pytest.fixture(params=[True, False], ids=["tile-unit", "fma"])
def products(request):
    """A prefill choice's products on the tile unit (AMX, where this CPU has it) or as fused
    multiply-adds: the kernel chooses the same either way."""
    lib = kernel()
    if lib is None:
        pytest.skip("no C++ compiler: the recall kernel is not built")
    if lib.h2o_recall_amx(int(request.param)) != request.param:
        pytest.skip("this CPU (or its OS) has no AMX for the tile unit's products")
    yield request.param
    lib.h2o_recall_amx(1)


@pytest.mark.parametrize("digest", ["centre", "minmax"])
@pytest.mark.parametrize("heads, kv_heads, chunk, layers", [(4, 2, 8, (0, 1)), (8, 1, 12, (1, 2)), (4, 4, 30, (0, 2))])
def test_the_kernel_chooses_a_prefill_chunks_blocks_as_the_torch_ops_do(heads, kv_heads, chunk, layers, digest, products):
    """A prefill chunk's choice by whole blocks, votes pooled over the heads of its layers: query
    groups of 2, 8 and 1 times chunks of 8-30 (8 x 12 = 96 queries per KV head: parts of 48 summed),
    one layer or two, noisier queries each time, each starting from the window the last one left;
    the products on the tile unit or as fused multiply-adds; digests of no width (one product, q .
    centre) and boxes (the queries split against their rows hi and lo)."""
    model = tiny_llama(heads=heads, kv_heads=kv_heads, init_std=0.3)
    gen, cache = conversation(model, recall_digest=digest)
    if not native_recall.supports(cache):
        pytest.skip("no C++ compiler: the recall kernel is not built")
    kernel, torch_ops = twin(gen, cache, recall_kernel=True), twin(gen, cache, recall_kernel=False)
    generator = torch.Generator().manual_seed(1)
    spec = cache.spec
    chosen = slice(*layers)
    base = torch.randn(layers[1] - layers[0], spec.num_heads, chunk, spec.head_dim, generator=generator)
    for noise in (0.0, 0.5, 1.0, 3.0):
        asked = base + noise * torch.randn(base.shape, generator=generator)
        for copy in (kernel, torch_ops):
            recall.choose(copy, 0, asked, copy.spec.scaling, chosen)
        assert_same_windows(model, kernel, torch_ops)
    window = kernel.windows[0][1]
    r, block = kernel.recalled[0], kernel.config.recall_block
    assert kernel.recall_count[0] > r  # the windows changed along the way
    # whole blocks, each in a run of slots of its own, each once, in the chosen layers only: the other
    # layers' windows were not touched
    runs = window[chosen].view(*window[chosen].shape[:2], -1, block)
    assert torch.equal(runs % block, torch.arange(block).expand(*window[chosen].shape[:2], r // block, block))
    assert (runs[..., 1:] - runs[..., :-1] == 1).all() and (window[chosen].sort(dim=-1).values.diff(dim=-1) > 0).all()
    untouched = torch.ones(window.shape[0], dtype=torch.bool)
    untouched[chosen] = False
    assert torch.equal(window[untouched], cache.windows[0][1][untouched])


@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 24, 40, 1000, 2048])
def test_the_choices_softmax_gives_the_same_floats_on_both_instruction_sets(n):
    """`softmax_into` (every choice's masses): the AVX-512 version gives the AVX2 version's floats bit for
    bit, the probabilities and the masses they are added to or written into, past the last 16 and 8
    elements too; and both are the softmax of the scaled logits."""
    lib = kernel()
    if lib is None:
        pytest.skip("no C++ compiler: the recall kernel is not built")
    generator = torch.Generator().manual_seed(n)
    start = torch.rand(n, generator=generator)
    # near-uniform logits, whose sum's rounding depends on its order, and spread ones
    for first, logits in [(0, torch.rand(n, generator=generator)), (1, torch.rand(n, generator=generator)),
                          (0, torch.randn(n, generator=generator) * 40), (1, torch.randn(n, generator=generator) * 40)]:
        results = {}
        for wide in (0, 1):
            p, mass = logits.clone(), start.clone()
            if lib.h2o_recall_softmax_into(p.data_ptr(), n, 0.125, mass.data_ptr(), first, wide):
                continue  # no AVX-512 on this CPU
            expected = torch.softmax(logits * 0.125, dim=0)
            torch.testing.assert_close(p / p.sum(), expected, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(mass, expected if first else start + expected, rtol=1e-5, atol=1e-7)
            results[wide] = p, mass
        if len(results) == 2:
            assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("items, depth", [(16, 8), (20, 16), (45, 64), (50, 64), (226, 128)])
def test_the_products_of_queries_and_packed_tiles_agree_on_both_instruction_sets(items, depth):
    """The prefill choice's products (`panel_product`): AVX2 and AVX-512 give the same floats (the same
    fused multiply-adds per output), and both the product of the queries with the items."""
    lib = kernel()
    if lib is None:
        pytest.skip("no C++ compiler: the recall kernel is not built")
    generator = torch.Generator().manual_seed(items)
    queries, rows = torch.randn(12, depth, generator=generator), torch.randn(items, depth, generator=generator)
    tiles = -(-items // 16)
    padded = torch.zeros(tiles * 16, depth)
    padded[:items] = rows
    panel = padded.view(tiles, 16, depth).transpose(1, 2).contiguous()  # tile t: [depth][16]
    results = {}
    for wide in (0, 1):
        out = torch.full((12, tiles * 16 + 3), float("nan"))
        if lib.h2o_recall_panel_product(queries.data_ptr(), 12, depth, panel.data_ptr(), tiles, out.data_ptr(),
                                        out.shape[1], wide):
            continue  # no AVX-512 on this CPU
        results[wide] = out[:, :items]
        torch.testing.assert_close(out[:, :items], queries @ rows.T, rtol=1e-5, atol=1e-4)
        assert (out[:, items:tiles * 16] == 0).all() and out[:, tiles * 16:].isnan().all()
    if len(results) == 2:
        assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("items, depth, halves, dtype", [
    (16, 8, False, torch.float16), (20, 16, True, torch.float16), (45, 64, False, torch.float16),
    (50, 64, True, torch.bfloat16), (226, 128, True, torch.float16), (2048, 64, False, torch.float16),
    (31, 96, False, torch.bfloat16)])
def test_the_tile_units_products_are_as_close_to_exact_as_fused_multiply_adds(items, depth, halves, dtype):
    """A prefill choice's products on AMX (`amx_product`): bf16 products summed in fp32, the 16-bit
    items split into two bf16 terms and the fp32 queries into three. Against fp64 products of the same
    values, no further off than fp32 products are, for 1-48 queries (row tiles of 16 part-filled),
    whole and partial tiles, depths not a multiple of the unit's 32, items packed whole or in two
    halves (as the digests' hi and lo); the items past the last are zero, nothing past the tiles is
    written."""
    lib = kernel()
    if lib is None:
        pytest.skip("no C++ compiler: the recall kernel is not built")
    generator = torch.Generator().manual_seed(items)
    rows = (2 * torch.randn(items, depth, generator=generator)).to(dtype)
    tiles = -(-items // 16)
    for count in (1, 5, 16, 48):
        queries = 3 * torch.randn(count, depth, generator=generator)
        out = torch.full((count, tiles * 16 + 3), float("nan"))
        if lib.h2o_recall_amx_product(queries.data_ptr(), count, depth, rows.view(torch.int16).data_ptr(), items,
                                      int(dtype == torch.bfloat16), int(halves), out.data_ptr(), out.shape[1]):
            pytest.skip("this CPU (or its OS) has no AMX for the tile unit's products")
        exact = queries.double() @ rows.double().T
        fp32 = (queries @ rows.float().T).double()
        error, fp32_error = (out[:, :items].double() - exact).abs().max(), (fp32 - exact).abs().max()
        assert error <= 4 * fp32_error + 1e-6, (error, fp32_error)
        assert (out[:, items:tiles * 16] == 0).all() and out[:, tiles * 16:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_decode_choices_logits_are_the_products_of_its_queries_and_keys(dtype):
    """The exact stage's products (`dot_keys`): queries 3 at a time, keys 4 at a time and the last 1-3
    apart, for every query count 1-7 and key counts around multiples of 4, against fp64 products of
    the same (16-bit) keys."""
    lib = kernel()
    if lib is None:
        pytest.skip("no C++ compiler: the recall kernel is not built")
    generator = torch.Generator().manual_seed(0)
    for depth in (8, 64):
        for groups in range(1, 8):
            for count in (1, 3, 4, 5, 22, 63):
                queries = torch.randn(groups, depth, generator=generator)
                keys = torch.randn(count, depth, generator=generator).to(dtype)
                out = torch.full((groups, count), float("nan"))
                assert lib.h2o_recall_key_logits(
                    ctypes.c_void_p(queries.data_ptr()), ctypes.c_int64(groups), ctypes.c_int64(depth),
                    ctypes.c_void_p(keys.data_ptr()), ctypes.c_int64(count), ctypes.c_int(dtype == torch.bfloat16),
                    ctypes.c_void_p(out.data_ptr())) == 0
                expected = (queries.double() @ keys.double().T).float()
                torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def best_tokens(lib, score, origins, held, r, margin, above, cut=0):
    out = torch.full((r,), -7, dtype=torch.int64)
    status = lib.h2o_recall_best_tokens(
        ctypes.c_void_p(score.data_ptr()), ctypes.c_int64(score.numel()), ctypes.c_void_p(origins.data_ptr()),
        ctypes.c_int64(origins.numel()), ctypes.c_void_p(held.data_ptr()), ctypes.c_int64(r), ctypes.c_double(margin),
        ctypes.c_int(above), ctypes.c_int64(cut), ctypes.c_void_p(out.data_ptr()))
    return status, out


@pytest.mark.parametrize("margin", [0.0, 0.3])
def test_a_head_takes_the_same_tokens_from_the_best_positions_as_by_ranking_them_all(margin):
    """A decode choice's heads rank only their tokens at the positions of the best scores (those above
    a threshold that marks at most `cut` positions; `best_above`), instead of every archived token
    (`best_by_scan`): the same r tokens, ties (many here: scores in eighths) to the lower index, held
    tokens favoured by the margin, as a plain sort of every token says, with two tokens at one position
    of a conversation longer than the positions among them. Where fewer than r tokens it does not hold
    score above the threshold (the rest tie at or below it) it says so and the scan decides. The same
    from a position index of the head's tokens (`best_indexed`), which says so too where a position
    holds two of them."""
    lib = kernel()
    if lib is None:
        pytest.skip("no C++ compiler: the recall kernel is not built")
    generator = torch.Generator().manual_seed(1)
    positions, shared, tally = 256, 0, collections.Counter()
    for case in range(300):
        n = int(torch.randint(8, 200, (), generator=generator))
        r = int(torch.randint(1, n + 1, (), generator=generator))
        origins = torch.randperm(positions * 2 if case % 10 == 0 else positions, generator=generator)[:n]
        origins = origins.to(torch.int64)  # every 10th case may put two tokens at one position (mod 256)
        voted = torch.rand(positions, generator=generator) < (0.2 if case % 7 == 0 else 0.9)
        score = torch.randint(0, 9, (positions,), generator=generator).float() / 8 * voted
        held = torch.randint(-1, n, (r,), generator=generator)
        bonus = torch.tensor(1.0 + margin, dtype=torch.float32)
        token_score = score[origins % positions]
        favoured = torch.zeros(n, dtype=torch.bool)
        favoured[held[held >= 0]] = margin != 0
        ranked = torch.where(favoured, token_score * bonus, token_score).tolist()
        expected = sorted(sorted(range(n), key=lambda t: (-ranked[t], t))[:r])
        status, scanned = best_tokens(lib, score, origins, held, r, margin, above=0)
        assert status == 0 and scanned.tolist() == expected
        for cut in (0, 2 * r, r + 3):
            for above in (1, 2):  # among the head's origins (`best_above`), through a position index (`best_indexed`)
                status, out = best_tokens(lib, score, origins, held, r, margin, above=above, cut=cut)
                tally[above, status == 2] += 1
                if status == 2:
                    assert (out == -7).all()
                else:
                    shared += above == 1 and len(set((origins % positions).tolist())) < n
                    assert status == 0 and out.tolist() == expected
    # both ways, each decided and refused, and positions held twice, were tried
    assert min(tally[above, refused] for above in (1, 2) for refused in (False, True)) > 100 and shared > 10


def test_the_kernel_writes_only_the_slots_whose_token_changed():
    model = tiny_llama(init_std=0.3)
    gen, cache = conversation(model)
    if not native_recall.supports(cache):
        pytest.skip("no C++ compiler: the recall kernel is not built")
    r = cache.recalled[0]
    keys = cache.buffers().keys
    recall.refresh(cache, cache._queries, cache.spec.scaling, [0])
    keys[:, 0, :, :r] = 1234.0
    count = cache.recall_count[0]
    recall.refresh(cache, cache._queries, cache.spec.scaling, [0])  # the same choice: nothing to write
    assert (keys[:, 0, :, :r] == 1234.0).all() and cache.recall_count[0] == count
    cache.archives[0].load_state(cache.archives[0].state())  # renumbered: every slot is written again
    recall.refresh(cache, cache._queries, cache.spec.scaling, [0])
    assert not (keys[:, 0, :, :r] == 1234.0).all(dim=-1).any()
    assert cache.recall_count[0] == count + keys.shape[0] * keys.shape[2] * r
    assert_window_holds_archive_tokens(model, cache, 0)


def test_the_kernel_places_the_windows_of_the_rows_it_is_given_as_the_torch_ops_do():
    """`recall.place` for rows 0 and 2 of three (one kernel call; the torch ops row by row): every
    window key of those rows back at its text position, row 1 and the own tokens untouched."""
    model = tiny_llama(heads=4, kv_heads=2, init_std=0.3)
    gen = Generator(model, ByteTokenizer())
    rows = gen.new_cache(0, recall_config())
    for seed, n in ((4, 220), (5, 150), (6, 260)):
        row = gen.new_cache(1, recall_config())
        gen.prefill(row, [random_tokens(n, seed=seed)], recall=True)
        rows.extend(row)
    if not native_recall.supports(rows):
        pytest.skip("no C++ compiler: the recall kernel is not built")
    kernel, torch_ops = twin(gen, rows, recall_kernel=True), twin(gen, rows, recall_kernel=False)
    placed = {}
    for copy in (kernel, torch_ops):
        rotated = copy.buffers().rotated
        before = rotated.clone()
        for row in range(3):
            rotated[:, row, :, :copy.recalled[row]] = 0.0
        recall.place(copy, [0, 2])
        assert (rotated[:, 1, :, :copy.recalled[1]] == 0).all()
        for row in (0, 2):
            r, n = copy.recalled[row], copy.lengths[row]
            assert r and torch.equal(rotated[:, row, :, r:n], before[:, row, :, r:n])
            torch.testing.assert_close(rotated[:, row, :, :r], before[:, row, :, :r], rtol=1e-5, atol=1e-5)
            assert_window_holds_archive_tokens(model, copy, row)
        placed[copy.config.recall_kernel] = rotated
    torch.testing.assert_close(placed[True], placed[False], rtol=1e-5, atol=1e-5)


def test_replies_are_the_same_with_the_kernel_and_with_the_torch_ops():
    """A reply choosing at every step, and a second turn: the same tokens and windows either way."""
    model = tiny_llama(init_std=0.3)
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    replies, windows = [], []
    for kernel in (True, False):
        gen = Generator(model, ByteTokenizer(), recall_config(recall_kernel=kernel))
        cache = gen.new_cache(1)
        tokens = [gen.generate([random_tokens(160, seed=5)], params, cache)[0].token_ids,
                  gen.generate([random_tokens(30, seed=6)], params, cache)[0].token_ids]
        replies.append(tokens)
        windows.append(cache.windows[0][1])
    assert replies[0] == replies[1]
    assert torch.equal(windows[0], windows[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_kernel_chooses_for_a_cache_it_cannot_fill_as_the_torch_ops_do(dtype):
    """A 16-bit cache (as on a GPU): the kernel cannot write its window, but it still makes the choice
    from the archive in host memory, ranking by the archive's own 16-bit keys (`native_recall.ranks`),
    and `recall.fill` writes it. Decode-time choices over all layers and a prefill chunk's by whole
    blocks hold the same tokens in the same slots, with the same copies, as the torch ops' choices."""
    model = tiny_llama(heads=8, kv_heads=2, init_std=0.3).to(dtype)
    gen, cache = conversation(model)
    if kernel() is None:
        pytest.skip("no C++ compiler: the recall kernel is not built")
    with_kernel, torch_ops = twin(gen, cache, recall_kernel=True), twin(gen, cache, recall_kernel=False)
    assert native_recall.ranks(with_kernel) and not native_recall.supports(with_kernel)
    assert not native_recall.ranks(torch_ops)
    generator = torch.Generator().manual_seed(2)
    spec = cache.spec
    chunk = torch.randn(1, spec.num_heads, 12, spec.head_dim, generator=generator)
    for noise in (0.0, 1.0, 4.0):
        asked = (cache._queries.float() + noise * torch.randn(cache._queries.shape, generator=generator)).to(dtype)
        for copy in (with_kernel, torch_ops):
            recall.refresh(copy, asked, spec.scaling, [0])
        assert torch.equal(with_kernel.windows[0][1], torch_ops.windows[0][1])
        asked = chunk + noise * torch.randn(chunk.shape, generator=generator)
        for copy in (with_kernel, torch_ops):
            recall.choose(copy, 0, asked, spec.scaling, slice(1, 2))
        assert torch.equal(with_kernel.windows[0][1], torch_ops.windows[0][1])
        a, b = row_state(with_kernel, 0), row_state(torch_ops, 0)
        for name in ("keys", "values", "origins", "scores", "pinned", "rotated"):
            assert torch.equal(a[name], b[name]), name
    assert with_kernel.recall_count == torch_ops.recall_count and with_kernel.recall_count[0] > 2 * cache.recalled[0]
    # the slots hold copies of the archived tokens the window names
    held, r = with_kernel.windows[0][1], with_kernel.recalled[0]
    layers, heads = torch.meshgrid(torch.arange(held.shape[0]), torch.arange(held.shape[1]), indexing="ij")
    keys, values = with_kernel.archives[0].gather_heads(layers.flatten(), heads.flatten(), held.flatten(0, 1))[:2]
    state = row_state(with_kernel, 0)
    assert torch.equal(state["keys"][:, :, :r], keys.view(*held.shape, -1))
    assert torch.equal(state["values"][:, :, :r], values.view(*held.shape, -1))


def test_the_kernels_assignment_alone_names_the_slots_its_fill_writes_and_writes_nothing_else():
    """`native_recall.assign` (the choice for a window elsewhere) on an fp32 cache: which slot takes
    which token is what the kernel's own fill puts there, and nothing of the cache is written."""
    model = tiny_llama(heads=4, kv_heads=2, init_std=0.3)
    gen, cache = conversation(model)
    if not native_recall.supports(cache):
        pytest.skip("no C++ compiler: the recall kernel is not built")
    filled = twin(gen, cache)
    generator = torch.Generator().manual_seed(3)
    for noise in (0.0, 2.0):
        asked = cache._queries + noise * torch.randn(cache._queries.shape, generator=generator)
        before, count = row_state(cache, 0), list(cache.recall_count)
        queries = asked[:, 0, :, None]
        grouped = queries.reshape(queries.shape[0], cache.spec.num_kv_heads, -1, cache.spec.head_dim)
        native_recall.assign(cache, 0, grouped, cache.spec.scaling, slice(None), everywhere=True)
        after = row_state(cache, 0)
        assert all(torch.equal(before[name], after[name]) for name in before) and cache.recall_count == count
        recall.refresh(filled, asked, filled.spec.scaling, [0])
        assert torch.equal(cache.windows[0][1], filled.windows[0][1])
    assert filled.recall_count[0] > count[0]


def rows_of_lengths(gen, rows):
    """A batch of recalling rows: (seed, tokens, more) each, `more` tokens fed after the first pass
    (under the budget: another length)."""
    batch = gen.new_cache(0, recall_config())
    for seed, n, more in rows:
        row = gen.new_cache(1, recall_config())
        gen.prefill(row, [random_tokens(n, seed=seed)], recall=True)
        if more:
            gen.prefill(row, [random_tokens(more, seed=seed + 10)], recall=True)
        batch.extend(row)
    return batch


def test_rows_whose_windows_are_written_together_end_as_written_one_by_one():
    """A bf16 batch (the GPU's path: the kernel chooses, `recall.write_rows` writes): rows 0 and 2 of
    three, of different lengths, choosing in one `refresh` (their windows written together, one
    upload) end with the same windows, buffers and counts as each choosing alone; row 1 untouched."""
    model = tiny_llama(heads=8, kv_heads=2, init_std=0.3).to(torch.bfloat16)
    if kernel() is None:
        pytest.skip("no C++ compiler: the recall kernel is not built")
    gen = Generator(model, ByteTokenizer())
    together = rows_of_lengths(gen, ((4, 220, 0), (5, 150, 0), (6, 260, 3)))
    alone = twin(gen, together)
    assert native_recall.ranks(together) and len({together.lengths[0], together.lengths[2]}) == 2
    generator = torch.Generator().manual_seed(4)
    untouched = row_state(together, 1)
    for noise in (0.5, 3.0):
        asked = (together._queries.float() + noise * torch.randn(together._queries.shape, generator=generator)).bfloat16()
        recall.refresh(together, asked, together.spec.scaling, [0, 2])
        for row in (0, 2):
            recall.refresh(alone, asked, alone.spec.scaling, [row])
    assert together.recall_count == alone.recall_count and together.recall_count[0] > 0 and together.recall_count[2] > 0
    for row in range(3):
        assert torch.equal(together.windows[row][1], alone.windows[row][1])
        a, b = row_state(together, row), row_state(alone, row)
        assert all(torch.equal(a[name], b[name]) for name in a), row
    assert all(torch.equal(untouched[name], row_state(together, 1)[name]) for name in untouched)


def test_a_window_copy_no_step_reads_is_not_written_and_is_exact_again_before_a_step_reads_it():
    """While the steps do not read the window's fp16 copy (a batch below `WINDOW_COPY_MIN_ROWS`), the
    kernel's choices and placements leave it as it was and mark the rows they write; once a step reads
    it, `window_copy()` copies those rows again, and every row's copy equals its window."""
    model = tiny_llama(heads=8, kv_heads=2, init_std=0.3)
    if kernel() is None:
        pytest.skip("no C++ compiler: the recall kernel is not built")
    gen = Generator(model, ByteTokenizer())
    cache = rows_of_lengths(gen, ((4, 220, 0), (5, 150, 0), (6, 260, 3)))
    assert native_recall.supports(cache)
    cache.keep_window_copy()
    cache.window_copy()
    cache.read_window_copy(False)
    assert cache.window_copy(current=False) is None  # writers are given none
    kept = cache._window_copy.data.clone()
    generator = torch.Generator().manual_seed(5)
    count = list(cache.recall_count)
    asked = cache._queries + 2.0 * torch.randn(cache._queries.shape, generator=generator)
    recall.refresh(cache, asked, cache.spec.scaling, [0, 2])  # two rows side by side (`choose_many`)
    recall.refresh(cache, asked, cache.spec.scaling, [1])  # one alone
    assert all(cache.recall_count[row] > count[row] for row in range(3))
    assert torch.equal(cache._window_copy.data, kept)  # not written
    assert cache._window_copy.stale == {0, 1, 2}
    kept = cache.window_copy().clone()  # current again, nothing marked
    native_recall.place(cache, [1])  # a placement alike
    assert torch.equal(cache._window_copy.data, kept) and cache._window_copy.stale == {1}
    cache.read_window_copy(True)
    copy = cache.window_copy()
    assert not cache._window_copy.stale
    for row in range(3):
        r, state = cache.recalled[row], row_state(cache, row)
        assert torch.equal(copy[0, :, row, :, :r].float(), state["rotated"][:, :, :r])
        assert torch.equal(copy[1, :, row, :, :r].float(), state["values"][:, :, :r])
    # read again: the kernel keeps it equal as it writes the windows, with nothing marked
    recall.refresh(cache, cache._queries - asked, cache.spec.scaling, [1])
    assert not cache._window_copy.stale
    r, state = cache.recalled[1], row_state(cache, 1)
    assert torch.equal(cache._window_copy.data[0, :, 1, :, :r].float(), state["rotated"][:, :, :r])


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # rows choose side by side from as many rows as threads
    yield
    torch.set_num_threads(threads)


def test_rows_choosing_side_by_side_end_as_rows_choosing_one_by_one(monkeypatch, two_threads):
    """An fp32 batch on the CPU: rows 0, 2 and 3 of four, of different lengths, choosing in one
    `refresh` (one kernel call, each row's choice on one thread: `native_recall.choose_many`) end with
    the same windows, buffers, window copies and counts as each choosing alone on every thread; row 1
    untouched. A row the kernel refuses does not stop the others, and raises after."""
    model = tiny_llama(heads=8, kv_heads=2, init_std=0.3)
    if kernel() is None:
        pytest.skip("no C++ compiler: the recall kernel is not built")
    gen = Generator(model, ByteTokenizer())
    together = rows_of_lengths(gen, ((4, 220, 0), (5, 150, 0), (6, 260, 3), (7, 240, 0)))
    alone = twin(gen, together)
    together.keep_window_copy()
    together.window_copy()  # current for every row: from here the kernel keeps it so
    calls = []
    choose_many = native_recall.choose_many
    monkeypatch.setattr(native_recall, "choose_many", lambda *a, **k: calls.append(len(a[1])) or choose_many(*a, **k))
    assert native_recall.supports(together) and len({together.lengths[0], together.lengths[2]}) == 2
    generator = torch.Generator().manual_seed(4)
    untouched = row_state(together, 1)
    for noise in (0.5, 3.0):
        asked = together._queries + noise * torch.randn(together._queries.shape, generator=generator)
        recall.refresh(together, asked, together.spec.scaling, [0, 2, 3])
        for row in (0, 2, 3):
            recall.refresh(alone, asked, alone.spec.scaling, [row])
    assert calls == [3, 3]  # side by side, and never for one row alone
    assert together.recall_count == alone.recall_count and min(together.recall_count[r] for r in (0, 2, 3)) > 0
    copy = together.window_copy(current=False)
    for row in range(4):
        assert torch.equal(together.windows[row][1], alone.windows[row][1])
        a, b = row_state(together, row), row_state(alone, row)
        assert all(torch.equal(a[name], b[name]) for name in a), row
        r = together.recalled[row]  # the choices wrote the copy as they wrote the window: nothing to refresh
        assert torch.equal(copy[0, :, row, :, :r].float(), a["rotated"][:, :, :r])
        assert torch.equal(copy[1, :, row, :, :r].float(), a["values"][:, :, :r])
    assert not together._window_copy.stale
    assert all(torch.equal(untouched[name], row_state(together, 1)[name]) for name in untouched)
    # a row the kernel refuses (here a Choice it cannot run: nothing written) is left as it was; the
    # others choose, and the call raises after
    prepare = native_recall._prepare

    def refusing(cache, row, *args, **kwargs):
        choice, written, tally, keep = prepare(cache, row, *args, **kwargs)
        if row == 2:
            choice.positions = 3  # not a power of two
        return choice, written, tally, keep

    monkeypatch.setattr(native_recall, "_prepare", refusing)
    before, counts = [row_state(together, row) for row in range(4)], list(together.recall_count)
    done = []
    with pytest.raises(ValueError, match=r"refused its input \(row, status: \[\(2, 1\)\]\)"):
        recall.refresh(together, asked * 2, together.spec.scaling, [0, 2, 3], done=done)
    assert done == [0, 3] and together.recall_count[2] == counts[2]
    assert all(torch.equal(before[2][name], row_state(together, 2)[name]) for name in before[2])
    assert all(together.recall_count[row] > counts[row] for row in (0, 3))


def test_slot_positions_are_text_positions_slot_by_slot():
    """`recall.slot_positions` (single slots of many rows, each its own window and length) gives what
    `text_positions` gives for the whole window of each row, to the bit."""
    generator = torch.Generator().manual_seed(5)
    capacity, heads = 40, 3
    origins = torch.zeros(2, heads, capacity, dtype=torch.int64)
    rows = []
    for b, (r, n) in enumerate(((8, 30), (12, 40))):
        own = torch.randperm(500, generator=generator)[:n - r].sort().values.expand(heads, -1) + torch.arange(heads)[:, None]
        window = torch.randint(0, 520, (heads, r), generator=generator)
        origins[b, :, :r], origins[b, :, r:n] = window, own
        rows.append((r, n, text_positions(window[None], own[None], r)[0]))
    b, h, j = torch.meshgrid(torch.arange(2), torch.arange(heads), torch.arange(8), indexing="ij")
    b, h, j = b.flatten(), h.flatten(), j.flatten()
    r = torch.tensor([rows[i][0] for i in b.tolist()])
    n = torch.tensor([rows[i][1] for i in b.tolist()])
    got = recall.slot_positions(origins[b, h], origins[b, h, j], r, n)
    want = torch.stack([rows[i][2][hh, jj] for i, hh, jj in zip(b.tolist(), h.tolist(), j.tolist())])
    assert torch.equal(got, want)


def test_whether_the_kernel_chooses_is_asked_again_when_the_buffers_or_the_config_change():
    """`supports` is answered once per buffers and config (it is asked before every decode choice):
    none before the cache has buffers, and a new answer for new buffers or a new config."""
    from h2o_cache import H2OCache
    from h2o_cache.hf import model_spec

    cache = H2OCache(model_spec(tiny_llama()), recall_config())
    assert not native_recall.supports(cache)  # no buffers yet
    cache.reserve(1, 64)
    assert native_recall.supports(cache) and native_recall.supports(cache)
    config = cache.config
    cache.config = replace(config, recall_kernel=False)
    assert not native_recall.supports(cache)
    cache.config = config
    assert native_recall.supports(cache)
    keys = cache._keys
    cache._keys = keys.transpose(3, 4)  # buffers the kernel cannot read in place
    assert not native_recall.supports(cache)
    cache._keys = keys
    assert native_recall.supports(cache)


@pytest.mark.parametrize("positions", [native_recall.POSITIONS, 256])
def test_a_decode_choice_reads_the_position_index_as_it_would_every_origin(monkeypatch, two_threads, positions):
    """A decode choice's heads find their tokens at the best positions through the row's
    `PositionIndex` (with no margin): the same windows, buffers and counts as a twin whose heads read
    all their archived origins, choice after choice while the conversation grows: blocks formed
    between choices (indexed from where the last call stopped), with and without the margin for held
    tokens (`recall_margin`, the voters' choices), the archive's oldest blocks dropped
    at its limit (a new epoch: indexed again), and, with 256 positions, tokens whose positions
    coincide (a head with two at one position, or one past the index's rows, reads its origins)."""
    model = tiny_llama(heads=8, kv_heads=2, init_std=0.3)
    if kernel() is None:
        pytest.skip("no C++ compiler: the recall kernel is not built")
    monkeypatch.setattr(native_recall, "POSITIONS", positions)
    gen = Generator(model, ByteTokenizer())
    indexed = rows_of_lengths(gen, ((4, 220, 0), (6, 260, 3)))
    plain = twin(gen, indexed)
    index_of = native_recall._index
    generator = torch.Generator().manual_seed(5)
    epochs, twice, read = set(), 0, 0
    for step in range(14):
        asked = indexed._queries + 2.0 * torch.randn(indexed._queries.shape, generator=generator)
        few = {0, 1} if step % 2 else set()  # a burst's choices, and the voters' with the margin for held tokens
        recall.refresh(indexed, asked, indexed.spec.scaling, [0, 1], few=few)  # side by side
        monkeypatch.setattr(native_recall, "_index", lambda *args: None)
        for row in (0, 1):
            recall.refresh(plain, asked, plain.spec.scaling, [row], few=few)
        monkeypatch.setattr(native_recall, "_index", index_of)
        assert indexed.recall_count == plain.recall_count
        for row in (0, 1):
            assert torch.equal(recall.held(indexed, row), recall.held(plain, row))
            a, b = row_state(indexed, row), row_state(plain, row)
            assert all(torch.equal(a[name], b[name]) for name in a)
            index, archive = native_recall._indexes[indexed][row], indexed.archives[row]
            assert index.archive() is archive and index.epoch == archive.epoch
            assert int(index.state[0]) == archive.full_blocks * archive.block  # every full block indexed
            heads = archive.shape[0] * archive.shape[1]
            table = index.table.view(index.rows + 1, heads)
            twice += int((table[:-1] == -2).any(dim=0).sum())
            read += int((table[:-1] >= 0).sum())
            epochs.add((row, archive.epoch))
        more = 40 if step % 3 == 2 else 6  # at times past the blocks a drop renumbered: indexed again
        for cache in (indexed, plain):  # the conversations go on: blocks formed, oldest ones dropped
            gen.prefill(cache, [random_tokens(more, seed=100 + step), random_tokens(more - 1, seed=200 + step)],
                        recall=True)
    assert read > 0 and len(epochs) > 2  # indexed, across a drop of each row's oldest blocks
    assert (twice > 0) == (positions == 256)


def test_a_decode_choice_made_again_with_its_kept_choice_ends_as_one_made_the_whole_way(monkeypatch):
    """A conversation decoding with a choice at every step: where nothing a row's last decode choice was
    built from has changed, the next is made with its kept `Choice` (`native_recall.choose_again`),
    and the conversation ends with the same windows, buffers, copies and counts, step by step, as a twin
    whose every choice goes the whole way (`recall.refresh` to `_prepare`). It is not made again after
    what would leave the kept one pointing at what moved or built with what changed: an eviction's
    archived tokens (blocks formed), the buffers reallocated (`H2OCache.layout`: a pass outgrowing them, or
    `reserve`), the window's copy kept or no longer read, the burst's choices giving way to the voters'
    (another margin); and is made again at every other step."""
    model = tiny_llama(heads=8, kv_heads=2, init_std=0.3)
    if kernel() is None:
        pytest.skip("no C++ compiler: the recall kernel is not built")
    gen = Generator(model, ByteTokenizer())
    again = rows_of_lengths(gen, ((4, 220, 0),))
    whole = twin(gen, again)
    choose_again = native_recall.choose_again
    made = []

    def counted(cache, *args):
        if cache is whole:
            return False
        done = choose_again(cache, *args)
        made.append(done)
        return done

    monkeypatch.setattr(native_recall, "choose_again", counted)
    changes = {22: lambda c: (c.keep_window_copy(), c.window_copy()), 33: lambda c: c.read_window_copy(False),
               44: lambda c: c.reserve(c.batch_size, c._capacity + 64)}  # between evictions (every 5th step)
    seen = []  # per step: the archive's version and the buffers' layout its choice saw
    for step, token in enumerate(random_tokens(56, seed=9)):
        for cache in (again, whole):
            changes.get(step, lambda c: None)(cache)
        seen.append((again.archives[0].version, again.layout))
        for cache in (again, whole):
            gen.step(cache, [[token]])
        assert len(made) == step + 1  # one choice a step, before the pass
        assert torch.equal(recall.held(again, 0), recall.held(whole, 0))
        a, b = row_state(again, 0), row_state(whole, 0)
        assert all(torch.equal(a[name], b[name]) for name in a), step
        assert again.recall_count == whole.recall_count
        if again.window_copy(current=False) is not None:
            assert torch.equal(again.window_copy(), whole.window_copy())
    assert again.recall_count[0] > 0
    archived = {step for step in range(1, len(seen)) if seen[step][0] != seen[step - 1][0]}
    moved = {step for step in range(1, len(seen)) if seen[step][1] != seen[step - 1][1]}
    refused = {0, *archived, *moved, again.config.recall_burst}
    assert len(archived) > 5 and {22, 33, 44} <= moved and not archived & {22, 33, 44}
    assert [step for step, done in enumerate(made) if not done] == sorted(refused)
    # made again only with the scaling, voters and margin it was built with
    voters, margin = again.config.voter_layers(again.spec.num_layers), again.config.recall_margin
    scaling = again.spec.scaling
    assert not choose_again(again, 0, again._queries, 2 * scaling, voters, margin)
    assert not choose_again(again, 0, again._queries, scaling, voters, 2 * margin)
    assert not choose_again(again, 0, again._queries, scaling, [0], margin)
    assert not choose_again(again, 0, again._queries.clone(), scaling, voters, margin)  # queries elsewhere
    count = again.recall_count[0]
    assert choose_again(again, 0, again._queries + 1.0, scaling, voters, margin) is False  # a temporary: elsewhere
    assert choose_again(again, 0, again._queries, scaling, voters, margin) and again.recall_count[0] >= count
    rope = again.spec.rope  # a RoPE table grown (replaced) since: built again
    rope.get(2 * rope.cos.shape[0])
    assert not choose_again(again, 0, again._queries, scaling, voters, margin)


def test_decode_choices_are_timed_by_stage_only_while_counting_is_on():
    model = tiny_llama(init_std=0.3)
    gen, cache = conversation(model)
    if not native_recall.supports(cache):
        pytest.skip("no C++ compiler: the recall kernel is not built")
    try:
        native_recall.stages(True)
        for _ in range(3):
            recall.refresh(cache, cache._queries, cache.spec.scaling, [0])
        counted = native_recall.stages(False)
        assert counted["choices"] == 3
        # every stage ran (the archive holds more blocks than the candidates: the bound too), each
        # timed apart, none counted twice
        assert all(counted[stage] > 0 for stage in native_recall.STAGES), counted
        recall.refresh(cache, cache._queries, cache.spec.scaling, [0])  # off: nothing more counted
        assert native_recall.stages() == counted
        native_recall.stages(True)  # on again: from zero
        assert native_recall.stages(False) == dict.fromkeys(("choices", *native_recall.STAGES), 0.0)
    finally:
        native_recall.stages(False)
