"""XSum ROUGE-2 vs. KV budget: one-sentence summaries with the budget a fraction of each input.

Like the H2O paper's XSum table (Rouge-2 vs. KV cache size), on the chat model: each article is
put in a chat prompt asking for a one-sentence summary, decoded greedily, and scored against the
reference summary with ROUGE-2 F1 (rouge_score, stemming).

Batching: one cache has one budget, so articles are sorted by prompt length and batched in groups
of `--batch`; a group's budget is `fraction x its shortest prompt`. Every article thus gets at most
`fraction` of its own length (never more, which would flatter eviction); the table reports the
mean budget actually given. The default length range (300-600 prompt tokens) keeps a batch's
lengths close, hence its budget close to the fraction of each article. Prompts are fed in chunks of budget // 4 so eviction runs between
chunks as it would token by token (the cache holds at most 1.25 x budget during a chunk).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from h2o_cache import CacheConfig, Generator, SamplingParams
from h2o_cache.bench.common import add_model_args, data_path, load, markdown_table

INSTRUCTION = "Summarize the following article in one sentence.\n\nArticle:\n"
MIN_BUDGET = 16  # below this the recent window of a few tokens is all a cache holds
FULL_CHUNK = 512  # the full cache never evicts, so its chunk only trades memory for speed


@dataclass
class Article:
    prompt: list[int]
    reference: str


@dataclass
class Scores:
    """ROUGE-2 F1 and budget/prompt-length ratio of each article run under one configuration."""

    rouge2: list[float] = field(default_factory=list)
    budget_share: list[float] = field(default_factory=list)
    budget_tokens: list[int] = field(default_factory=list)


def load_articles(gen: Generator, path: Path, limit: int, min_tokens: int, max_tokens: int) -> list[Article]:
    """The first `limit` articles (file order) whose chat prompt has min_tokens..max_tokens tokens."""
    articles = []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            prompt = gen.encode_chat([{"role": "user", "content": INSTRUCTION + record["document"].strip()}])
            if min_tokens <= len(prompt) <= max_tokens:
                articles.append(Article(prompt, record["summary"]))
            if len(articles) == limit:
                break
    return articles


def cache_config(policy: str, fraction: float, shortest: int, heavy_ratio: float) -> CacheConfig:
    if policy == "full":
        return CacheConfig(policy="full", prefill_chunk=FULL_CHUNK)
    budget = max(MIN_BUDGET, int(fraction * shortest))
    return CacheConfig(policy=policy, budget=budget, heavy_ratio=heavy_ratio, position_rolling=True,
                       prefill_chunk=max(1, budget // 4))


def evaluate(gen: Generator, articles: list[Article], fractions: list[float], policies: list[str],
             batch: int = 4, max_new_tokens: int = 48, heavy_ratio: float = 0.5,
             log=None) -> dict[tuple[str, float], Scores]:
    """Scores per (policy, fraction); the full cache is keyed ("full", 1.0)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge2"], use_stemmer=True)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    runs = [("full", 1.0)] + [(p, f) for f in fractions for p in policies]
    results = {run: Scores() for run in runs}
    ordered = sorted(articles, key=lambda a: len(a.prompt))
    for start in range(0, len(ordered), batch):
        group = ordered[start:start + batch]
        shortest = len(group[0].prompt)
        began = time.perf_counter()
        for policy, fraction in runs:
            config = cache_config(policy, fraction, shortest, heavy_ratio)
            outs = gen.generate([a.prompt for a in group], params, gen.new_cache(len(group), config))
            scores = results[(policy, fraction)]
            for article, out in zip(group, outs):
                scores.rouge2.append(scorer.score(article.reference, out.text)["rouge2"].fmeasure)
                budget = len(article.prompt) if policy == "full" else config.budget
                scores.budget_share.append(budget / len(article.prompt))
                scores.budget_tokens.append(budget)
        if log:
            log(f"articles {start + len(group)}/{len(ordered)} ({shortest}+ tokens): {time.perf_counter() - began:.0f} s")
    return results


def table(results: dict[tuple[str, float], Scores], fractions: list[float], policies: list[str], caption: str) -> str:
    full = statistics.mean(results[("full", 1.0)].rouge2)
    headers = ["budget", "mean budget given", *policies, *(f"{p} / full" for p in policies)]
    rows = []
    for f in fractions:
        first = results[(policies[0], f)]
        given = f"{statistics.mean(first.budget_share):.1%} ({statistics.mean(first.budget_tokens):.0f} tok)"
        means = [statistics.mean(results[(p, f)].rouge2) for p in policies]
        rows.append([f"{f:.0%}", given, *means, *(m / full if full else float("nan") for m in means)])
    rows.append(["full", "100%", *([full] * len(policies)), *([1.0] * len(policies))])
    return markdown_table(headers, rows, caption)


def targets(results: dict[tuple[str, float], Scores], fractions: list[float]) -> list[str]:
    """The report's targets: H2O within 5% of full at ~20% budget, and H2O >= local at every budget."""
    lines = []
    full = statistics.mean(results[("full", 1.0)].rouge2)
    if ("h2o", 0.2) in results and full:
        ratio = statistics.mean(results[("h2o", 0.2)].rouge2) / full
        lines.append(f"- H2O at 20% / full = {ratio:.3f} (target >= 0.95): {'met' if ratio >= 0.95 else 'MISSED'}")
    if all(("local", f) in results and ("h2o", f) in results for f in fractions):
        below = [f"{f:.0%}" for f in fractions
                 if statistics.mean(results[("h2o", f)].rouge2) < statistics.mean(results[("local", f)].rouge2)]
        lines.append(f"- H2O >= local at every budget: {'met' if not below else 'MISSED at ' + ', '.join(below)}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=data_path("xsum_dev.jsonl"), help="JSONL with `document` and `summary` fields")
    parser.add_argument("--limit", type=int, default=16, help="articles to score (the first that fit the length range)")
    parser.add_argument("--min-tokens", type=int, default=300, help="shortest chat prompt kept, in tokens")
    parser.add_argument("--max-tokens", type=int, default=600, help="longest chat prompt kept, in tokens")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.2, 0.4, 0.6, 1.0], help="budgets as fractions of the prompt length")
    parser.add_argument("--policies", nargs="+", default=["h2o", "streaming", "local"], help="evicting policies to compare with full")
    parser.add_argument("--batch", type=int, default=8, help="articles per batch (one budget per batch, see above)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="summary length limit (greedy; stops at EOS)")
    parser.add_argument("--heavy-ratio", type=float, default=0.5, help="H2O share of heavy hitters in the budget")
    add_model_args(parser)
    args = parser.parse_args(argv)

    model, tokenizer = load(args)
    gen = Generator(model, tokenizer)
    articles = load_articles(gen, args.data, args.limit, args.min_tokens, args.max_tokens)
    if not articles:
        sys.exit(f"no article of {args.data} has a prompt of {args.min_tokens}..{args.max_tokens} tokens")
    lengths = [len(a.prompt) for a in articles]
    results = evaluate(gen, articles, args.fractions, args.policies, args.batch, args.max_new_tokens,
                       args.heavy_ratio, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    caption = (f"ROUGE-2 F1 (stemmed), {len(articles)} articles of {args.data.name}, prompts of "
               f"{min(lengths)}-{max(lengths)} tokens (mean {statistics.mean(lengths):.0f}), greedy, "
               f"<= {args.max_new_tokens} new tokens, position rolling, heavy_ratio {args.heavy_ratio}")
    print(table(results, args.fractions, args.policies, caption))
    print("\n".join(["", *targets(results, args.fractions)]))


if __name__ == "__main__":
    main()
