import json

import pytest
import torch
import torch.nn.functional as F

from h2o_cache import CacheConfig, Generator
from h2o_cache.bench.nll import (Item, grid, interval_differences, interval_label, load_items, load_text_items, report,
                                 score, score_batched, score_fast, sweep, sweep_differences, targets)
from tests.conftest import ByteTokenizer


class ChatByteTokenizer(ByteTokenizer):
    def apply_chat_template(self, messages, **kwargs):
        return self.encode(messages[-1]["content"])


def items(lengths, target_len=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [Item(torch.randint(3, 128, (n,), generator=generator).tolist(),
                 torch.randint(3, 128, (target_len + i,), generator=generator).tolist()) for i, n in enumerate(lengths)]


def test_full_cache_scores_equal_a_plain_forward_of_the_whole_sequence(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer)
    batch = items([40, 25, 33])
    nll, hits = score(gen, CacheConfig(policy="full", prefill_chunk=16), batch)
    for item, got_nll, got_hits in zip(batch, nll, hits):
        ids = torch.tensor([item.context + item.target])
        with torch.no_grad():
            logits = tiny_model(ids).logits[0, len(item.context) - 1:-1].float()
        target = torch.tensor(item.target)
        assert got_nll.item() == pytest.approx(F.cross_entropy(logits, target, reduction="sum").item(), rel=1e-4)
        assert got_hits.item() == (logits.argmax(-1) == target).sum().item()


def test_hits_count_only_the_target_tokens_asked_for_and_the_nll_all_of_them(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer)
    config = CacheConfig(policy="full", prefill_chunk=16)
    [item] = items([30], target_len=8)
    nll, hits = score(gen, config, [item])
    asked = tuple(i % 2 == 0 for i in range(len(item.target)))
    odd = Item(item.context, item.target, asked=asked)
    nll_odd, hits_odd = score(gen, config, [odd])
    with torch.no_grad():
        logits = tiny_model(torch.tensor([item.context + item.target])).logits[0, len(item.context) - 1:-1]
    right = (logits.argmax(-1) == torch.tensor(item.target)).tolist()
    assert hits.item() == sum(right) and hits_odd.item() == sum(r for r, a in zip(right, asked) if a)
    assert torch.equal(nll, nll_odd) and odd.needed == 4 and item.needed == 8


def test_h2o_with_a_budget_beyond_the_sequence_equals_full(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer)
    batch = items([40, 25])
    full, _ = score(gen, CacheConfig(policy="full"), batch)
    roomy, _ = score(gen, CacheConfig(policy="h2o", budget=200, prefill_chunk=8), batch)
    assert torch.allclose(full, roomy, rtol=1e-4)


def test_an_item_scores_the_same_whatever_its_batch(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer)
    batch = items([60, 45, 70, 52])
    config = CacheConfig(policy="h2o", budget=24, prefill_chunk=6)  # evicts during prompt and target
    together, hits = score_batched(gen, config, batch, batch=3)
    alone = torch.cat([score(gen, config, [item])[0] for item in batch])
    assert torch.allclose(together, alone, rtol=1e-4)
    full, _ = score(gen, CacheConfig(policy="full"), batch)
    assert not torch.allclose(together, full, rtol=1e-3)  # the budget really evicted something


def test_load_items_skips_long_prompts_and_keeps_file_order(tiny_model, tmp_path):
    path = tmp_path / "x.jsonl"
    docs = ["a" * 10, "b" * 300, "c" * 60]
    path.write_text("".join(json.dumps({"document": d, "summary": d[:4]}) + "\n" for d in docs))
    loaded, skipped = load_items(Generator(tiny_model, ChatByteTokenizer()), path, limit=5, max_prompt_tokens=200)
    assert skipped == 1 and [len(i.target) for i in loaded] == [4, 4]
    assert len(loaded[0].context) < len(loaded[1].context)
    long, skipped = load_items(Generator(tiny_model, ChatByteTokenizer()), path, limit=5, max_prompt_tokens=1000,
                               min_prompt_tokens=len(loaded[1].context) + 1)
    assert skipped == 2 and [i.reference for i in long] == ["b" * 4]  # only the long one


def test_report_and_targets_compare_every_run_with_full_and_h2o_with_local():
    tokens = torch.tensor([10.0, 20.0, 30.0])
    full = torch.tensor([20.0, 40.0, 60.0])
    results = {"full": full, "h2o 128": full + tokens * 0.01, "local 128": full + tokens * 0.3}
    hits = {k: torch.tensor([5, 10, 15]) for k in results}
    runs = [run for run in grid(["h2o", "local"], [128])]
    text = report(results, hits, tokens, runs, "caption")
    assert "| local 128 |" in text and "+0.3000 [+0.3000, +0.3000]" in text
    lines = targets(results, tokens, [128])
    assert lines[0].endswith("met") and "+0.5%" in lines[0]  # 0.01 nats on a mean of 2
    assert lines[1].startswith("- h2o 128 - local 128: -0.2900") and lines[1].endswith("met")


def test_sweep_covers_every_setting():
    runs = sweep([128, 256], [0.25, 0.75], [0, 4])
    assert len(runs) == 8 and len({r.label for r in runs}) == 8
    assert {(r.config.heavy_ratio, r.config.sinks) for r in runs} == {(0.25, 0), (0.25, 4), (0.75, 0), (0.75, 4)}


def test_a_forked_prefix_scores_like_feeding_prefix_and_context_together(tiny_model, byte_tokenizer):
    from h2o_cache.bench.nll import fork

    gen = Generator(tiny_model, byte_tokenizer)
    config = CacheConfig(policy="h2o", budget=200, prefill_chunk=200)  # never evicts: one pass == two passes
    prefix, batch = [7] * 30, items([20, 12])
    forked, _ = score(gen, config, batch, fork(gen, config, prefix, len(batch)))
    whole, _ = score(gen, config, [Item(prefix + item.context, item.target) for item in batch])
    assert torch.allclose(forked, whole, rtol=1e-4)


def test_recall_runs_feed_the_prompt_as_a_turn_that_recalls(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer)
    [run] = [r for r in grid(["h2o"], [24, 40], recall=16, recall_budgets=[24]) if "+r" in r.label]
    assert run.label == "h2o 24 +r16" and run.config.recall_budget == 16 and run.config.budget == 24
    config = CacheConfig(policy="h2o", budget=24, prefill_chunk=6, recall_budget=16, recall_block=4, recall_probe=8)
    batch = items([60, 45, 70])
    turns, _ = score_batched(gen, config, batch, batch=2)
    alone = torch.cat([score(gen, config, [item], turn=True)[0] for item in batch])
    assert torch.allclose(turns, alone, rtol=1e-4)
    plain, _ = score(gen, config, batch)  # not a turn: every pass still fills its window, no probe
    no_recall, _ = score(gen, CacheConfig(policy="h2o", budget=24, prefill_chunk=6), batch)
    assert not torch.allclose(plain, no_recall, rtol=1e-3) and not torch.allclose(turns, no_recall, rtol=1e-3)


def test_targets_compare_recall_with_h2o_alone_at_the_same_budget_and_the_same_slots():
    tokens = torch.tensor([10.0, 20.0, 30.0])
    full = torch.tensor([20.0, 40.0, 60.0])
    results = {"full": full, "h2o 256": full + tokens * 0.02, "h2o 384": full - tokens * 0.01,
               "h2o 256 +r128": full}
    lines = [line for line in targets(results, tokens, [256, 384]) if "+r128" in line]
    assert lines[0].startswith("- h2o 256 +r128 - h2o 256: -0.0200") and lines[0].endswith("met")
    assert lines[1].startswith("- h2o 256 +r128 - h2o 384: +0.0100") and lines[1].endswith("MISSED")


def test_merge_reports_runs_saved_by_separate_programs_as_one_grid(tmp_path, capsys):
    from h2o_cache.bench import nll

    tokens = [10.0, 20.0, 30.0]
    full = [20.0, 40.0, 60.0]
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"tokens": tokens, "nll": {"full": full, "local 256": [23.0, 46.0, 69.0]},
                                 "hits": {"full": [5, 10, 15], "local 256": [4, 8, 12]}}))
    second.write_text(json.dumps({"tokens": tokens, "nll": {"full": full, "h2o 256": [20.1, 40.2, 60.3],
                                                            "h2o 64": [22.0, 44.0, 66.0]}}))
    results, hits, merged_tokens, runs = nll.merge([first, second])
    assert [run.label for run in runs] == ["full", "h2o 64", "h2o 256", "local 256"]  # by budget, then policy
    assert set(hits) == {"full", "local 256"} and merged_tokens.tolist() == tokens
    nll.main(["--merge", str(first), str(second)])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| h2o 256 |"))
    assert "-0.2900 [-0.2900, -0.2900]" in row  # h2o - local, from two files, paired per article
    assert "- h2o 256 vs full: +0.0100" in out

    other = tmp_path / "c.json"  # another set of articles: refused, not silently paired
    other.write_text(json.dumps({"tokens": [10.0, 20.0, 31.0], "nll": {"full": full}}))
    with pytest.raises(ValueError, match="other articles"):
        nll.merge([first, other])
    other.write_text(json.dumps({"tokens": [40.0], "nll": {"full": [80.0], "h2o 256": [84.0]}}))
    results, _, pooled, runs = nll.merge([first, second, other], pool=True)  # two sets of articles
    assert [run.label for run in runs] == ["full", "h2o 256"]  # only what both sets ran
    assert pooled.tolist() == tokens + [40.0] and results["h2o 256"].tolist() == [20.1, 40.2, 60.3, 84.0]
    drifted = tmp_path / "d.json"  # same token counts, different full: different data or code
    drifted.write_text(json.dumps({"tokens": tokens, "nll": {"full": [21.0, 40.0, 60.0]}}))
    with pytest.raises(ValueError, match="differs"):
        nll.merge([first, drifted])


def test_sweep_differences_pair_each_setting_with_the_default_at_its_budget():
    tokens = torch.tensor([10.0, 20.0, 30.0])
    full = torch.tensor([20.0, 40.0, 60.0])
    results = {"full": full, "h2o 128 heavy 0.5 sinks 0": full + tokens * 0.2,
               "h2o 128 heavy 0.75 sinks 0": full + tokens * 0.1, "h2o 256 heavy 0.75 sinks 4": full}
    assert sweep_differences(results, tokens) == [
        "- h2o 128 heavy 0.75 sinks 0 - h2o 128 heavy 0.5 sinks 0: -0.1000 [-0.1000, -0.1000] nats/token "
        "(negative: better than the default)"]  # 256 has no default run to pair with


def test_text_items_are_evenly_spaced_windows_of_the_text(tiny_model, tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("".join(chr(ord("a") + i % 26) for i in range(100)))
    gen = Generator(tiny_model, ByteTokenizer())
    text = ByteTokenizer().encode(path.read_text(), add_special_tokens=False)
    loaded = load_text_items(gen, path, items=4, context=20, target=8)
    assert [(len(i.context), len(i.target)) for i in loaded] == [(20, 8)] * 4
    assert loaded[0].context == text[:20] and loaded[0].target == text[20:28]
    assert loaded[-1].context + loaded[-1].target == text[-28:]  # the last window ends at the text's end
    assert loaded[1].context == text[24:44]  # (100 - 28) // 3 = 24 apart
    with pytest.raises(ValueError, match="fewer than"):
        load_text_items(gen, path, items=2, context=90, target=20)


def test_recall_intervals_run_each_configuration_once_per_interval_and_pair_with_the_default():
    runs = grid(["h2o"], [256], recall=128, recall_budgets=[256], intervals=[1, 16, 32], voters=[0])
    assert [(r.label, r.config.choice_interval(8)) for r in runs if "+r" in r.label] == [
        ("h2o 256 +r128 every 1", 1), ("h2o 256 +r128 every 16", 16), ("h2o 256 +r128 every 32", 32)]  # not grown
    runs = grid(["h2o"], [256], recall=128, recall_budgets=[256], intervals=[2], voters=[0, 5])
    assert [(r.label, r.config.recall_voters) for r in runs if "+r" in r.label] == [
        ("h2o 256 +r128 every 2", 0), ("h2o 256 +r128 every 2 voters 5", 5)]
    runs = grid(["h2o"], [256], recall=128, recall_budgets=[256], intervals=[1], voters=[5], margins=[0.0, 0.3])
    assert [(r.label, r.config.recall_margin) for r in runs if "+r" in r.label] == [
        ("h2o 256 +r128 every 1 voters 5 margin 0", 0.0), ("h2o 256 +r128 every 1 voters 5 margin 0.3", 0.3)]
    runs = grid(["h2o"], [256], recall=128, recall_budgets=[256], intervals=[1], voters=[5], positions=["text", "rank"])
    assert [(r.label, r.config.recall_positions) for r in runs if "+r" in r.label] == [
        ("h2o 256 +r128 every 1 voters 5 text", "text"), ("h2o 256 +r128 every 1 voters 5", "rank")]  # rank: the default
    tokens = torch.tensor([10.0, 20.0, 30.0])
    full = torch.tensor([20.0, 40.0, 60.0])
    default = interval_label(256, 128, CacheConfig.recall_interval, CacheConfig.recall_voters)
    ranked = f"{default} text"
    assert interval_differences({default: full, ranked: full + tokens * 0.01}, tokens) == [
        f"- {ranked} - {default}: +0.0100 [+0.0100, +0.0100] nats/token (negative: better than the default)"]
    other = "h2o 256 +r128 every 7 margin 0"  # an interval and margin other than the default's
    results = {"full": full, "h2o 256": full + tokens * 0.1, default: full + tokens * 0.05,
               other: full + tokens * 0.02}
    assert interval_differences(results, tokens) == [
        f"- {other} - {default}: -0.0300 [-0.0300, -0.0300] nats/token "
        "(negative: better than the default)"]
    lines = targets(results, tokens, [256])  # the interval runs are recall runs at budget 256
    assert any(line.startswith(f"- {other} - h2o 256: -0.0800") for line in lines)


def test_the_fast_path_scores_as_the_transformers_path_does(tiny_model, byte_tokenizer):
    """`score_fast` feeds the targets on the fast step: the same NLL and hits as `score_batched` for
    contexts fed as turns (a tiny fp32 model: no quantized products), whatever the batch."""
    gen = Generator(tiny_model, byte_tokenizer)
    config = CacheConfig(policy="h2o", budget=16, prefill_chunk=8)
    batch = [Item(context=[(5 * i + n) % 100 + 3 for i in range(20 + n)], target=[(3 * i + n) % 90 + 3 for i in range(6 + n)])
             for n in range(3)]
    want, want_hits = score_batched(gen, config, batch, batch=3)
    got, got_hits = score_fast(gen, config, batch, batch=2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got_hits, want_hits)


def test_the_overlap_grid_names_its_runs_and_compares_them_with_the_choices_before_the_step():
    k, v = CacheConfig.recall_interval, CacheConfig.recall_voters  # the default's: beside pairs with before at it
    runs = grid(["h2o"], [256], recall=128, intervals=[k], voters=[v], overlaps=[False, True])
    labels = [run.label for run in runs]
    assert labels == ["full", "h2o 256", f"h2o 256 +r128 every {k} voters {v} before",
                      f"h2o 256 +r128 every {k} voters {v} beside"]
    assert [run.config.recall_overlap for run in runs[2:]] == [False, True]
    results = {label: torch.tensor([1.0 + i, 2.0]) for i, label in enumerate(labels)}
    lines = interval_differences(results, torch.tensor([4.0, 4.0]))
    assert len(lines) == 1 and lines[0].startswith(f"- {labels[3]} - {labels[2]}:")
