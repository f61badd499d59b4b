import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from h2o_cache.eviction import accumulate_scores, keep_indices


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    budget=st.integers(4, 24),
    sinks=st.integers(0, 2),
    recent_share=st.floats(0.1, 0.9),
    seed=st.integers(0, 2**16),
)
def test_keep_indices_invariants(lengths, budget, sinks, recent_share, seed):
    recent = max(1, min(budget - sinks, int(budget * recent_share)))
    n = max(lengths)
    generator = torch.Generator().manual_seed(seed)
    priority = torch.rand(len(lengths), 3, n, generator=generator)
    counts = torch.tensor([min(length, budget) for length in lengths])
    keep = keep_indices(priority, torch.tensor(lengths), counts, sinks, recent)
    assert keep.shape == (len(lengths), 3, int(counts.max()))
    for b, length in enumerate(lengths):
        for h in range(3):
            kept = keep[b, h].tolist()
            assert kept == sorted(kept)
            real = kept[:min(length, budget)]
            if length <= budget:
                assert real == list(range(length))
                continue
            assert len(set(real)) == budget and max(real) < length
            assert set(range(length - recent, length)) <= set(real)
            assert set(range(min(sinks, length))) <= set(real)
            # The heavy part is the best of the evictable slots.
            evictable = [s for s in range(sinks, length - recent)]
            heavy = sorted(evictable, key=lambda s: -priority[b, h, s].item())[: budget - recent - sinks]
            assert set(heavy) <= set(real)


def test_keep_indices_choose_per_head_independently():
    priority = torch.tensor([[[5.0, 0, 0, 0, 0], [0, 0, 5.0, 0, 0]]])
    keep = keep_indices(priority, torch.tensor([5]), torch.tensor([3]), sinks=0, recent=2)
    assert keep[0, 0].tolist() == [0, 3, 4]
    assert keep[0, 1].tolist() == [2, 3, 4]


def test_rows_that_fit_are_kept_whole_beside_rows_that_are_evicted():
    priority = torch.rand(2, 1, 6)
    keep = keep_indices(priority, torch.tensor([6, 5]), torch.tensor([3, 5]), sinks=0, recent=1)
    assert keep.shape == (2, 1, 5)
    assert keep[1, 0].tolist() == [0, 1, 2, 3, 4]
    assert keep[0, 0, :3].tolist() == sorted(keep[0, 0, :3].tolist()) and keep[0, 0, 2] == 5


def test_behind_a_recall_window_the_sinks_are_each_row_s_first_own_slots():
    """Rows whose first slots are a pinned recall window (2 and 0 slots): the sinks are the two slots
    after it, whatever their priority, not the window's first two (which its pins keep anyway)."""
    priority = torch.ones(2, 1, 8)
    priority[:, :, 2:4] = 0.0  # the first own slots of row 0 rank last
    priority[1, :, 0:2] = 0.0  # and those of row 1
    pinned = torch.zeros(2, 1, 8, dtype=torch.bool)
    pinned[0, :, :2] = True
    keep = keep_indices(priority, torch.tensor([8, 8]), torch.tensor([5, 3]), sinks=2, recent=1, width=5,
                        pinned=pinned, first=torch.tensor([2, 0]))
    assert keep[0, 0].tolist() == [0, 1, 2, 3, 7]  # the window, the sinks after it, the recent slot
    assert keep[1, 0, :3].tolist() == [0, 1, 7]


def test_accumulate_scores_reduces_over_group_and_queries_but_not_batch():
    probs = torch.zeros(2, 1, 3, 2, 4)  # [B, H_kv, G, C, K]
    probs[0, 0, :, :, 1] = 1.0
    probs[1, 0, 0, 0, 3] = 1.0
    scores = accumulate_scores(probs, None)
    assert scores.shape == (2, 1, 4)
    assert scores[0, 0].tolist() == [0, 6, 0, 0]
    assert scores[1, 0].tolist() == [0, 0, 0, 1]


def test_accumulate_scores_ignores_padding_queries():
    probs = torch.ones(1, 1, 1, 3, 2, dtype=torch.float16)
    valid = torch.tensor([[True, True, False]])
    scores = accumulate_scores(probs, valid)
    assert scores.dtype == torch.float32
    assert scores[0, 0].tolist() == [2, 2]


def test_fp32_accumulation_keeps_growing_where_fp16_stalls():
    # 10k decode steps each giving a key 0.01 attention: an fp16 running sum stops at 32.
    total16 = torch.zeros((), dtype=torch.float16)
    total32 = torch.zeros(())
    step = torch.full((1, 1, 1, 1, 1), 0.01, dtype=torch.float16)
    for _ in range(10_000):
        total16 += step.sum()
        total32 += accumulate_scores(step, None).sum()
    assert total16.item() < 40
    assert abs(total32.item() - 100.0) < 0.5
