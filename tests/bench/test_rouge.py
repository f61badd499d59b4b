import torch

from h2o_cache import Generator
from h2o_cache.bench.nll import Item, grid
from h2o_cache.bench.rouge import report, rouge, summarize


def test_summaries_come_back_in_item_order_whatever_the_batching(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer)
    items = [Item([3 + (i * 7 + n) % 120 for i in range(n)], [5], "ref") for n in (50, 20, 35)]
    run = grid(["h2o"], [16])[1]
    batched = summarize(gen, run, items, batch=2, max_new_tokens=4)
    alone = [summarize(gen, run, [item], batch=1, max_new_tokens=4)[0] for item in items]
    assert batched == alone


def test_rouge_and_report_give_paired_differences_from_full():
    refs = ["the cat sat on the mat", "a dog ran far away"]
    scores = {"full": rouge(refs, refs), "h2o 64": rouge(refs, ["the cat sat", "nothing alike"])}
    assert torch.equal(scores["full"]["rouge1"], torch.ones(2, dtype=torch.float64))
    assert scores["h2o 64"]["rouge2"][1] == 0
    text = report(scores, grid(["h2o"], [64]), "caption")
    row = next(line for line in text.splitlines() if line.startswith("| h2o 64 |"))
    assert row.count("[") == 3 and "-0.6667 [-1.0000, -0.3333]" in row  # one interval per metric
    assert "h2o 64 - local 64" not in text  # no pair without both policies


def test_report_gives_h2o_minus_each_recency_policy_at_the_same_budget():
    refs = ["the cat sat on the mat", "a dog ran far away"]
    scores = {"full": rouge(refs, refs), "h2o 64": rouge(refs, ["the cat sat", "a dog ran far away"]),
              "streaming 64": rouge(refs, ["the cat sat", "nothing alike"]), "local 64": rouge(refs, refs)}
    text = report(scores, grid(["h2o", "streaming", "local"], [64]), "caption")
    row = next(line for line in text.splitlines() if line.startswith("| h2o 64 - streaming 64 |"))
    assert "+0.5000 [+0.0000, +1.0000]" in row  # rouge1: article 2 gains 1.0, article 1 nothing
    row = next(line for line in text.splitlines() if line.startswith("| h2o 64 - local 64 |"))
    assert row.count("[") == 3 and row.split("|")[2].strip().startswith("-")  # local is better here
