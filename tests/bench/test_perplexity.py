import math

import torch

from h2o_cache import CacheConfig
from h2o_cache.bench.perplexity import runs, segment_perplexity, stream_nll, table

TOKENS = torch.randint(3, 128, (150,), generator=torch.Generator().manual_seed(0))


def test_full_cache_nll_does_not_depend_on_the_chunk(tiny_model):
    one = stream_nll(tiny_model, CacheConfig(policy="full", prefill_chunk=7), TOKENS)
    other = stream_nll(tiny_model, CacheConfig(policy="full", prefill_chunk=64), TOKENS)
    assert one.shape == (len(TOKENS) - 1,)
    torch.testing.assert_close(one, other, rtol=1e-4, atol=1e-4)


def test_h2o_above_the_text_length_matches_the_full_cache(tiny_model):
    full = stream_nll(tiny_model, CacheConfig(policy="full", prefill_chunk=8), TOKENS)
    h2o = stream_nll(tiny_model, CacheConfig(policy="h2o", budget=256, prefill_chunk=8), TOKENS)
    torch.testing.assert_close(h2o, full, rtol=1e-4, atol=1e-4)


def test_evicting_runs_give_one_finite_perplexity_per_segment(tiny_model):
    perplexities = {}
    for run in runs([32], [32]):
        assert run.chunk <= run.config.budget // 4 or run.config.policy == "full"
        perplexities[run.label] = segment_perplexity(stream_nll(tiny_model, run.config, TOKENS), 64)
    assert list(perplexities) == ["h2o 32", "h2o 32 no-roll", "full"]
    assert all(len(p) == 3 and all(math.isfinite(x) and x > 1 for x in p) for p in perplexities.values())
    lines = table(perplexities, 64, 128, "caption").splitlines()
    assert lines[2] == "| tokens | h2o 32 | h2o 32 no-roll | full |"
    assert lines[4].startswith("| 0k-0.0625k |") and len(lines) == 4 + 3 + 1


def test_segment_perplexity_is_exp_of_the_mean_nll_of_its_tokens():
    nll = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])  # NLL of tokens 1..5
    assert segment_perplexity(nll, 3) == [math.exp(1.5), math.exp(4.0)]


def test_edges_compare_the_first_and_last_tokens_of_a_run():
    from h2o_cache.bench.perplexity import edges

    nll = torch.tensor([1.0, 1.0, 2.0, 3.0, 3.0])
    first, last = edges(nll, 2)
    assert first == math.exp(1.0) and last == math.exp(3.0)


def test_recall_chooses_a_window_at_every_chunk_once_blocks_are_archived_and_stays_finite(tiny_model, monkeypatch):
    from h2o_cache import recall

    chosen = []
    original = recall.choose_rows  # every choice goes through it
    monkeypatch.setattr(recall, "choose_rows", lambda cache, asked, *a, **k:
                        chosen.extend(cache.seen[row] for row, _ in asked) or original(cache, asked, *a, **k))
    [run] = [r for r in runs([32], [], full=False, recall=16) if r.config.recalls]
    assert run.label == "h2o 32 +r16"
    nll = stream_nll(tiny_model, run.config, TOKENS)
    assert nll.shape == (len(TOKENS) - 1,) and torch.isfinite(nll).all()
    layers = tiny_model.config.num_hidden_layers
    # chunks of 8; the window opens once the archive holds a 16-token block (the first evictions
    # archive 2 tokens each), then every layer of every later chunk chooses
    assert chosen and len(chosen) % layers == 0 and chosen[0] > 32 and chosen == sorted(chosen)