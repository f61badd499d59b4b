"""Greedy XSum summaries through budgeted caches: ROUGE-1/2/L with paired bootstrap CIs against `full`.

The same articles, prompts, grid (policies x fixed budgets) and chunking as `nll`, but each
summary is generated greedily (<= `--max-new-tokens`, stops at EOS) and scored against the reference
with rouge_score (stemming). ROUGE of one 135M-model summary is mostly luck, so the table gives the
per-article paired difference from `full` with its 95% bootstrap interval: a difference whose
interval holds zero is not evidence either way. `nll` is the low-variance measure of the same thing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from h2o_cache import Generator, SamplingParams
from h2o_cache.bench.common import add_model_args, data_path, load, markdown_table
from h2o_cache.bench.nll import Item, Run, grid, load_items, skipped_phrase
from h2o_cache.bench.stats import mean_difference

METRICS = ("rouge1", "rouge2", "rougeL")


def summarize(gen: Generator, run: Run, items: list[Item], batch: int, max_new_tokens: int) -> list[str]:
    """Greedy summaries in item order; items are batched by prompt length."""
    order = sorted(range(len(items)), key=lambda i: len(items[i].context))
    params = SamplingParams(max_new_tokens=max_new_tokens)
    texts = [""] * len(items)
    for start in range(0, len(order), batch):
        picked = order[start:start + batch]
        outs = gen.generate([items[i].context for i in picked], params, gen.new_cache(len(picked), run.config))
        for i, out in zip(picked, outs):
            texts[i] = out.text
    return texts


def rouge(references: list[str], summaries: list[str]) -> dict[str, torch.Tensor]:
    """Per-article F1 of each metric: {metric: [N]}."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(list(METRICS), use_stemmer=True)
    scores = [scorer.score(ref, out) for ref, out in zip(references, summaries)]
    return {m: torch.tensor([s[m].fmeasure for s in scores], dtype=torch.float64) for m in METRICS}


def report(results: dict[str, dict[str, torch.Tensor]], runs: list[Run], caption: str) -> str:
    full = results["full"]
    rows = []
    for run in runs:
        scores = results[run.label]
        means = [scores[m].mean().item() for m in METRICS]
        if run.label == "full":
            rows.append([run.label, *means, "", "", ""])
        else:
            rows.append([run.label, *means, *(str(mean_difference(scores[m], full[m])) for m in METRICS)])
    headers = ["cache", *METRICS, *(f"{m} - full [95% CI]" for m in METRICS)]
    text = markdown_table(headers, rows, caption)
    pairs = [(run.label, f"{other} {run.config.budget}") for run in runs if run.config.policy == "h2o"
             for other in ("streaming", "local") if f"{other} {run.config.budget}" in results]
    if pairs:
        rows = [[f"{a} - {b}", *(str(mean_difference(results[a][m], results[b][m])) for m in METRICS)]
                for a, b in pairs]
        text += "\n\n" + markdown_table(["h2o - recency policy, same budget", *(f"{m} [95% CI]" for m in METRICS)],
                                         rows, "Paired differences between policies at the same budget (positive: h2o better)")
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=data_path("xsum_dev.jsonl"), help="JSONL with `document` and `summary`")
    parser.add_argument("--limit", type=int, default=80,
                        help="articles to summarize (file order); 80 over the default grid is about an hour of a 2-core CPU")
    parser.add_argument("--max-prompt-tokens", type=int, default=1024, help="skip articles whose prompt is longer")
    parser.add_argument("--min-prompt-tokens", type=int, default=0, help="skip articles whose prompt is shorter")
    parser.add_argument("--policies", nargs="+", default=["h2o", "streaming", "local"], help="evicting policies")
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512], help="KV budgets")
    parser.add_argument("--batch", type=int, default=8, help="articles per forward pass")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="summary length limit")
    add_model_args(parser)
    args = parser.parse_args(argv)

    model, tokenizer = load(args)
    gen = Generator(model, tokenizer)
    items, skipped = load_items(gen, args.data, args.limit, args.max_prompt_tokens, args.min_prompt_tokens)
    if not items:
        sys.exit(f"no article of {args.data} has a prompt of {args.min_prompt_tokens}-{args.max_prompt_tokens} tokens")
    references = [item.reference for item in items]
    runs = grid(args.policies, args.budgets)
    results = {}
    for run in runs:
        began = time.perf_counter()
        results[run.label] = rouge(references, summarize(gen, run, items, args.batch, args.max_new_tokens))
        print(f"{run.label}: ROUGE-2 {results[run.label]['rouge2'].mean().item():.4f}, "
              f"{time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    lengths = [len(item.context) for item in items]
    caption = (f"ROUGE F1 (stemmed) of greedy summaries (<= {args.max_new_tokens} tokens), {len(items)} XSum articles "
               f"(prompts {min(lengths)}-{max(lengths)} tokens; "
               f"{skipped_phrase(skipped, args.min_prompt_tokens, args.max_prompt_tokens)}); "
               f"differences from full with 95% paired bootstrap CIs over articles")
    print(report(results, runs, caption))


if __name__ == "__main__":
    main()
