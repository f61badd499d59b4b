"""Teacher-forced likelihood of XSum reference summaries through budgeted caches, with paired CIs.

Each article goes into a chat prompt asking for a one-sentence summary; the prompt is prefilled
through a cache under a policy and budget, then the reference summary is fed token by token through
the same cache (so eviction during the summary counts, as in a real reply), and each reference token
is scored by the NLL the model gives it there. Unlike ROUGE of a greedy summary, every reference
token contributes, so differences of a few hundredths of a nat are resolved on 200 articles.

Reported per configuration: mean NLL per reference token (token-weighted over articles), its
difference from `full` with a 95% paired bootstrap interval over articles, and for h2o the paired
difference from `local` and `streaming` at the same budget (negative: h2o is better).

Prompts are fed in chunks of budget // 4 (as `xsum` and `perplexity` do), so eviction runs between
chunks; the full cache takes chunks of 512, which does not change its result.

`--recall N` also runs h2o at each of `--recall-budgets` with a recall budget of N: the prompt is fed
as the server feeds a user turn (its last `recall_probe` tokens probe the archive of what the rest
evicted, and the blocks they point at come back for the reply). Its rows are compared with h2o
alone at the same budget and, when that budget is in the grid, at budget + N: the same cache slots.

`--recall-intervals K ...` runs each recall configuration once per decode-time choice interval
(`recall_interval`, not grown with the rows decoding; labels `h2o B +rN every K`) and prints each
against the default interval, paired: the reply's first `recall_burst` steps choose at every
interval, so what the interval changes is a reply's tokens after them. `--text FILE --context C --target T --items N` scores, instead of XSum
summaries, N continuations of a plain text: at N evenly spaced places, C tokens of the text prefilled
(as one user turn, recall choosing as it does for one) and the next T tokens teacher-forced one decode
step at a time: a long reply that goes on from a long pasted document.

`--json` saves each run's per-article results; `--merge` reports several such files as one paired
table (the grid run in parts, e.g. one budget per program), and `--pool` adds files on other articles
(the articles over 1024 tokens, scored with `--min-prompt-tokens 1025 --max-prompt-tokens 8192`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from h2o_cache import CacheConfig, Generator, H2OCache
from h2o_cache.bench.common import add_model_args, data_path, load, markdown_table
from h2o_cache.bench.stats import ratio_of_sums_difference
from h2o_cache.bench.xsum import INSTRUCTION
from h2o_cache.config import POSITIONS

FULL_CHUNK = 512


@dataclass(frozen=True)
class Item:
    """A context to prefill and the tokens to score after it."""

    context: list[int]
    target: list[int]
    reference: str = ""  # the target as text, where there is one (an XSum summary)
    asked: tuple[bool, ...] = ()  # per target token, whether greedy decoding is asked to hit it (empty: all)

    @property
    def needed(self) -> int:
        """Target tokens greedy decoding must hit (the rest are fed, as a template's words)."""
        return sum(self.asked) if self.asked else len(self.target)


@dataclass(frozen=True)
class Run:
    label: str
    config: CacheConfig


def load_items(gen: Generator, path: Path, limit: int, max_prompt_tokens: int,
               min_prompt_tokens: int = 0) -> tuple[list[Item], int]:
    """The first `limit` articles of the file whose prompt has `min_prompt_tokens` to `max_prompt_tokens`
    tokens; also how many others were skipped."""
    items, skipped = [], 0
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            prompt = gen.encode_chat([{"role": "user", "content": INSTRUCTION + record["document"].strip()}])
            if not min_prompt_tokens <= len(prompt) <= max_prompt_tokens:
                skipped += 1
                continue
            summary = record["summary"].strip()
            items.append(Item(prompt, gen.tokenizer.encode(summary, add_special_tokens=False), summary))
            if len(items) == limit:
                break
    return items, skipped


def load_text_items(gen: Generator, path: Path, items: int, context: int, target: int) -> list[Item]:
    """`items` windows of a plain text, at evenly spaced offsets: `context` tokens to prefill, the next
    `target` tokens to score."""
    tokens = gen.tokenizer.encode(path.read_text(), add_special_tokens=False)
    span = context + target
    if len(tokens) < span:
        raise ValueError(f"{path} holds {len(tokens)} tokens, fewer than --context + --target ({span})")
    step = (len(tokens) - span) // max(items - 1, 1)
    return [Item(tokens[i * step:i * step + context], tokens[i * step + context:i * step + span]) for i in range(items)]


def skipped_phrase(skipped: int, min_prompt_tokens: int, max_prompt_tokens: int) -> str:
    """How a table's caption says which articles were left out."""
    if min_prompt_tokens:
        return f"{skipped} outside {min_prompt_tokens}-{max_prompt_tokens} tokens skipped"
    return f"{skipped} longer than {max_prompt_tokens} skipped"


@torch.no_grad()
def score(gen: Generator, config: CacheConfig, items: list[Item], cache: H2OCache | None = None,
          turn: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per item, the summed NLL (nats) of its target tokens and how many of them greedy decoding hits
    (of those it `asked` for).

    All items run as rows of one cache: prefill in chunks, then one target token per row and pass,
    teacher-forced. Rows never share scores (the cache keeps them apart), so an item's result does
    not depend on the batch. With `cache` (one row per item, already holding a common prefix, see
    `fork`), each context continues what its row holds. turn: the contexts are user turns, prefilled
    with recall when the cache recalls. Returns ([N] fp64 NLL sums, [N] int64 hits).
    """
    cache = cache if cache is not None else gen.new_cache(len(items), config)
    logits = gen.prefill(cache, [item.context for item in items], recall=turn)  # [B, V], predicts target[0]
    # feed target[t] to the rows that still have a token to predict after it
    return teacher_forced(items, logits, lambda t: gen.step(
        cache, [[item.target[t]] if t + 1 < len(item.target) else [] for item in items]))


def teacher_forced(items: list[Item], logits: torch.Tensor, step) -> tuple[torch.Tensor, torch.Tensor]:
    """`score`'s NLL sums and greedy hits of the items' targets, from `logits` [B, V] predicting each
    target[0]; step(t) feeds target[t] and returns the logits predicting target[t + 1]."""
    width = max(len(item.target) for item in items)
    targets = torch.tensor([item.target + [-1] * (width - len(item.target)) for item in items])
    valid = targets >= 0
    asked = torch.tensor([list(item.asked or [True] * len(item.target)) + [False] * (width - len(item.target)) for item in items])
    nll = torch.zeros(len(items), dtype=torch.float64)
    hits = torch.zeros(len(items), dtype=torch.int64)
    for t in range(width):
        logits = logits.float().cpu()
        wanted = targets[:, t].clamp(min=0)
        token_nll = -logits.log_softmax(-1).gather(1, wanted[:, None])[:, 0]
        nll += torch.where(valid[:, t], token_nll.double(), 0.0)
        hits += (valid[:, t] & asked[:, t] & (logits.argmax(-1) == wanted)).long()
        if t + 1 == width:
            break
        logits = step(t)
    return nll, hits


@torch.no_grad()
def fork(gen: Generator, config: CacheConfig, prefix: list[int], rows: int) -> H2OCache:
    """A cache of `rows` identical rows that have consumed `prefix` (prefilled once, then copied)."""
    cache = gen.new_cache(rows=0, config=config)
    if not prefix:
        cache.add_rows(rows)
        return cache
    single = gen.new_cache(1, config)
    gen.prefill(single, [prefix])
    for _ in range(rows):
        cache.extend(single)
    return cache


def score_batched(gen: Generator, config: CacheConfig, items: list[Item], batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`score` over batches of similar length (items sorted by context length); results in item order."""
    return in_batches(items, batch, lambda group: score(gen, config, group, turn=True))


def in_batches(items: list[Item], batch: int, scorer) -> tuple[torch.Tensor, torch.Tensor]:
    """scorer(group) -> (NLL sums, hits) over groups of `batch` items of similar context length."""
    order = sorted(range(len(items)), key=lambda i: len(items[i].context))
    nll = torch.zeros(len(items), dtype=torch.float64)
    hits = torch.zeros(len(items), dtype=torch.int64)
    for start in range(0, len(order), batch):
        picked = order[start:start + batch]
        nll[picked], hits[picked] = scorer([items[i] for i in picked])
    return nll, hits


def score_fast(gen: Generator, config: CacheConfig, items: list[Item], batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`score_batched` with the contexts as turns, the targets fed on the fast step (`StaticDecoder`)
    instead of the transformers path: for what only the fast step does, such as recall's choices
    beside the step (`recall_overlap`). Each item prefilled alone, then `batch` of them decode
    together (on the CPU the quantized step, whose products round the activations to int8)."""
    return in_batches(items, batch, lambda group: _score_fast_group(gen, config, group))


@torch.no_grad()
def _score_fast_group(gen: Generator, config: CacheConfig, items: list[Item]) -> tuple[torch.Tensor, torch.Tensor]:
    from h2o_cache import StaticDecoder, reread

    decoder = StaticDecoder(gen.model, config, len(items))
    gen.looker = reread.looker(gen.model, config, share=decoder)  # re-reads look on the fast step too
    firsts = []
    for item in items:
        row = gen.new_cache(1, config)
        firsts.append(gen.prefill(row, [item.context], recall=True)[0])
        row.pending = [[item.target[0]]]
        decoder.cache.extend(row, move=True)

    def step(t: int) -> torch.Tensor:  # every row feeds a token: a finished one its last again, unscored
        decoder.cache.pending = [[item.target[min(t, len(item.target) - 1)]] for item in items]
        return decoder.step()

    return teacher_forced(items, torch.stack(firsts), step)


def interval_label(budget: int, recall: int, interval: int, voters: int, overlap: bool | None = None,
                   margin: float | None = None, positions: str | None = None) -> str:
    """`h2o B +rN every K`, ` voters V` where V layers vote in the choices after the burst,
    ` beside` / ` before` where the fast step's choices run beside / before the step (`recall_overlap`),
    ` margin M` where a decode choice favours held tokens by M (`recall_margin`; none: the default),
    and ` text` / ` rank` where the held keys' layout (`recall_positions`) is not the default's."""
    label = f"h2o {budget} +r{recall} every {interval}" + (f" voters {voters}" if voters else "")
    label += "" if overlap is None else " beside" if overlap else " before"
    label += "" if margin is None else f" margin {margin:g}"
    return label + ("" if positions in (None, CacheConfig.recall_positions) else f" {positions}")


def grid(policies: list[str], budgets: list[int], heavy_ratio: float = 0.5, recall: int = 0,
         recall_budgets: list[int] | None = None, intervals: list[int] | None = None,
         voters: list[int] | None = None, overlaps: list[bool] | None = None,
         margins: list[float] | None = None, positions: list[str] | None = None) -> list[Run]:
    """`full`, then every policy at every budget, and h2o with a recall budget of `recall` at each of
    `recall_budgets` (default: every budget) as `h2o B +rN`, or with `intervals` once per decode-time
    choice interval and count of voting layers of `voters` (default: the config's), with `overlaps`
    once per `recall_overlap` value and with `margins` once per `recall_margin` (default: the
    config's) and with `positions` once per `recall_positions`, as `interval_label` names them."""
    runs = [Run("full", CacheConfig(policy="full", prefill_chunk=FULL_CHUNK))]
    for budget in budgets:
        for policy in policies:
            config = CacheConfig(policy=policy, budget=budget, heavy_ratio=heavy_ratio, prefill_chunk=max(1, budget // 4))
            runs.append(Run(f"{policy} {budget}", config))
    for budget in (budgets if recall_budgets is None else recall_budgets) if recall else []:
        config = CacheConfig(policy="h2o", budget=budget, heavy_ratio=heavy_ratio, prefill_chunk=max(1, budget // 4),
                             recall_budget=recall)
        if not intervals:
            runs.append(Run(f"h2o {budget} +r{recall}", config))
        for k in intervals or []:  # every k steps for every row, however many decode together
            for v in voters or [config.recall_voters]:
                for overlap in overlaps or [None]:
                    for margin in margins or [None]:
                        for scheme in positions or [config.recall_positions]:
                            runs.append(Run(interval_label(budget, recall, k, v, overlap, margin, scheme),
                                            replace(config, recall_interval=k, recall_interval_max=k, recall_voters=v,
                                                    recall_overlap=overlap, recall_positions=scheme,
                                                    recall_margin=config.recall_margin if margin is None else margin)))
    return runs


def sweep_label(budget: int, heavy_ratio: float, sinks: int) -> str:
    return f"h2o {budget} heavy {heavy_ratio:g} sinks {sinks}"


def sweep(budgets: list[int], heavy_ratios: list[float], sinks: list[int]) -> list[Run]:
    """h2o's settings users choose: heavy-hitter share and sink tokens, per budget."""
    return [
        Run(sweep_label(budget, ratio, s),
            CacheConfig(policy="h2o", budget=budget, heavy_ratio=ratio, sink_tokens=s, prefill_chunk=max(1, budget // 4)))
        for budget in budgets for ratio in heavy_ratios for s in sinks
    ]


def label_run(label: str) -> Run:
    """The run a table row names (`full`, `h2o 256`, `h2o 128 heavy 0.75 sinks 0`, `h2o 256 +r128`),
    with the policy and budget the report groups by."""
    if label == "full":
        return Run(label, CacheConfig(policy="full", prefill_chunk=FULL_CHUNK))
    policy, budget = label.split()[:2]
    return Run(label, CacheConfig(policy=policy, budget=int(budget)))


def merge(paths: list[Path], pool: bool = False
          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor, list[Run]]:
    """The per-article results of several runs (their `--json` files) as one grid: (results, hits where
    saved, tokens, runs ordered full first, then by budget and policy).

    Files on the same articles are paired: their runs become one table. Files on other articles are
    refused, unless `pool`: then each set of articles is merged on its own and the sets are pooled,
    keeping the runs every set has (e.g. the short articles' grid plus the long ones at two budgets).
    """
    groups: list[tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
    for path in paths:
        saved = json.loads(path.read_text())
        these = torch.tensor(saved["tokens"], dtype=torch.float64)
        group = next((g for g in groups if torch.equal(g[0], these)), None)
        if group is None:
            if groups and not pool:
                raise ValueError(f"{path} scored other articles than {paths[0]} (pool them with --pool)")
            group = (these, {}, {})
            groups.append(group)
        _, results, hits = group
        for label, sums in saved["nll"].items():
            sums = torch.tensor(sums, dtype=torch.float64)
            if label in results:
                # The same configuration twice (e.g. `full` in every file) must agree, or the files
                # come from different articles, data or code.
                if not torch.allclose(results[label], sums, rtol=1e-4):
                    raise ValueError(f"{path}: {label} differs from the same run in an earlier file")
                continue
            results[label] = sums
            if label in saved.get("hits", {}):
                hits[label] = torch.tensor(saved["hits"][label], dtype=torch.int64)
    labels = [label for label in groups[0][1] if all(label in g[1] for g in groups)]
    if "full" not in labels:
        raise ValueError("no run of `full` on every set of articles, which every difference is taken from")
    tokens = torch.cat([g[0] for g in groups])
    results = {label: torch.cat([g[1][label] for g in groups]) for label in labels}
    hits = {label: torch.cat([g[2][label] for g in groups]) for label in labels if all(label in g[2] for g in groups)}
    order = {"h2o": 0, "streaming": 1, "local": 2}
    runs = sorted((label_run(label) for label in results),
                  key=lambda run: (run.label != "full", run.config.budget or 0, order.get(run.config.policy, 3), run.label))
    return results, hits, tokens, runs


def report(results: dict[str, torch.Tensor], hits: dict[str, torch.Tensor], tokens: torch.Tensor,
           runs: list[Run], caption: str) -> str:
    """One row per run: mean NLL/token, greedy hit rate, paired difference from full and (h2o) from the
    recency policies at the same budget. Differences in nats per token, with 95% bootstrap CIs."""
    total = tokens.sum().item()
    full = results["full"]
    full_mean = full.sum().item() / total
    rows = []
    for run in runs:
        nll = results[run.label]
        mean = nll.sum().item() / total
        hit = hits[run.label].sum().item() / total if run.label in hits else ""  # merged files may lack it
        if run.label == "full":
            rows.append([run.label, mean, hit, "0", "0%", "", ""])
            continue
        vs_full = ratio_of_sums_difference(nll, full, tokens)
        against = []
        for other in ("local", "streaming"):
            label = f"{other} {run.config.budget}"
            if run.config.policy == "h2o" and label in results:
                against.append(str(ratio_of_sums_difference(nll, results[label], tokens)))
            else:
                against.append("")
        rows.append([run.label, mean, hit, str(vs_full),
                     f"{vs_full.value / full_mean:+.1%}", *against])
    headers = ["cache", "NLL/token", "greedy hit", "vs full [95% CI]", "vs full", "h2o - local [95% CI]",
               "h2o - streaming [95% CI]"]
    return markdown_table(headers, rows, caption)


def targets(results: dict[str, torch.Tensor], tokens: torch.Tensor, budgets: list[int]) -> list[str]:
    """The issue's goals: h2o at 128-256 within 5% of full, and better than local/streaming with the CI
    excluding zero; with recall, no worse than h2o alone at the same budget and at the same slots."""
    lines = []
    for label in (k for k in results if " +r" in k):
        parts = label.split()  # h2o B +rN [every K]
        budget, recall = int(parts[1]), int(parts[2].removeprefix("+r"))
        for alone in (f"h2o {budget}", f"h2o {budget + recall}"):
            if alone in results:
                diff = ratio_of_sums_difference(results[label], results[alone], tokens)
                lines.append(f"- {label} - {alone}: {diff} nats/token (goal: no worse, i.e. the CI reaching zero "
                             f"or below): {'met' if diff.low <= 0 else 'MISSED'}")
    full_mean = results["full"].sum().item() / tokens.sum().item()
    for budget in (b for b in budgets if 128 <= b <= 256):
        label = f"h2o {budget}"
        if label not in results:
            continue
        gap = ratio_of_sums_difference(results[label], results["full"], tokens)
        share = gap.value / full_mean
        lines.append(f"- h2o {budget} vs full: {gap} nats/token = {share:+.1%} (goal within 5%): "
                     f"{'met' if share <= 0.05 else 'MISSED'}")
        for other in ("local", "streaming"):
            if f"{other} {budget}" in results:
                diff = ratio_of_sums_difference(results[label], results[f"{other} {budget}"], tokens)
                better = diff.high < 0
                lines.append(f"- h2o {budget} - {other} {budget}: {diff} (goal: below zero, CI excluding it): "
                             f"{'met' if better else 'MISSED'}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=data_path("xsum_dev.jsonl"), help="JSONL with `document` and `summary`")
    parser.add_argument("--limit", type=int, default=100, help="articles to score (file order)")
    parser.add_argument("--max-prompt-tokens", type=int, default=1024, help="skip articles whose prompt is longer")
    parser.add_argument("--min-prompt-tokens", type=int, default=0,
                        help="skip articles whose prompt is shorter (e.g. 1025 with --max-prompt-tokens 8192: the long ones)")
    parser.add_argument("--policies", nargs="+", default=["h2o", "streaming", "local"], help="evicting policies")
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512], help="KV budgets")
    parser.add_argument("--sweep", action="store_true",
                        help="instead of the policy grid: h2o heavy ratio x sink tokens at --sweep-budgets")
    parser.add_argument("--sweep-budgets", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--heavy-ratios", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--sinks", type=int, nargs="+", default=[0, 4])
    parser.add_argument("--recall", type=int, default=0, help="also run h2o with this recall budget")
    parser.add_argument("--recall-budgets", type=int, nargs="+", default=None,
                        help="budgets that also run with --recall (default: all of --budgets)")
    parser.add_argument("--recall-intervals", type=int, nargs="+", default=None,
                        help="run each recall configuration once per decode-time choice interval (recall_interval)")
    parser.add_argument("--recall-voters", type=int, nargs="+", default=None,
                        help="with --recall-intervals: run each interval once per count of layers that vote in the "
                             "choices after the burst (recall_voters; 0: all)")
    parser.add_argument("--recall-overlap", type=int, nargs="+", choices=(0, 1), default=None,
                        help="with --recall-intervals: run each once with the fast step's choices before it (0) and/or "
                             "beside it (1, as on a GPU; recall_overlap); implies --fast-path")
    parser.add_argument("--recall-margins", type=float, nargs="+", default=None,
                        help="with --recall-intervals: run each once per margin for held tokens (recall_margin)")
    parser.add_argument("--recall-positions", nargs="+", choices=POSITIONS, default=None,
                        help="with --recall-intervals: run each once per layout of the held keys (recall_positions)")
    parser.add_argument("--fast-path", action="store_true",
                        help="feed the targets on the fast step (StaticDecoder, `score_fast`), contexts as turns; "
                             "`full` (which the fast step cannot take) stays on the transformers path")
    parser.add_argument("--text", type=Path, default=None,
                        help="score continuations of this plain text instead of XSum summaries (with --context, --target, --items)")
    parser.add_argument("--context", type=int, default=2048, help="with --text: tokens of the text prefilled")
    parser.add_argument("--target", type=int, default=128, help="with --text: tokens after them, teacher-forced one step at a time")
    parser.add_argument("--items", type=int, default=24, help="with --text: places in the text, evenly spaced")
    parser.add_argument("--batch", type=int, default=8, help="articles per forward pass")
    parser.add_argument("--json", type=Path, default=None, help="also write per-article NLL sums here")
    parser.add_argument("--merge", type=Path, nargs="+", default=None,
                        help="run nothing: report the `--json` files of earlier runs on the same articles as one table")
    parser.add_argument("--pool", action="store_true",
                        help="with --merge: files on different articles are pooled (the runs every set has)")
    add_model_args(parser)
    args = parser.parse_args(argv)
    if args.merge:
        try:
            results, hits, tokens, runs = merge(args.merge, args.pool)
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"cannot merge: {e}")
        what = (f"{args.target}-token continuations of {args.text.name}, {len(tokens)} places" if args.text
                else f"the reference summary, {len(tokens)} XSum articles")
        caption = (f"Teacher-forced NLL of {what}, {int(tokens.sum())} reference tokens, {len(runs)} runs merged from "
                   f"{len(args.merge)} files (pass --text with files of continuations); differences in nats/token "
                   f"with 95% paired bootstrap CIs over {'places' if args.text else 'articles'}")
        print(report(results, hits, tokens, runs, caption))
        lines = targets(results, tokens, sorted({run.config.budget for run in runs if run.config.budget}))
        print("\n".join(["", *lines, *sweep_differences(results, tokens), *interval_differences(results, tokens)]))
        return

    model, tokenizer = load(args)
    gen = Generator(model, tokenizer)
    if args.text:
        try:
            items, skipped = load_text_items(gen, args.text, args.items, args.context, args.target), 0
        except (OSError, ValueError) as e:
            sys.exit(f"cannot read the text: {e}")
    else:
        items, skipped = load_items(gen, args.data, args.limit, args.max_prompt_tokens, args.min_prompt_tokens)
    if not items:
        sys.exit(f"no article of {args.data} has a prompt of {args.min_prompt_tokens}-{args.max_prompt_tokens} tokens")
    runs = grid(args.policies, args.budgets, recall=args.recall, recall_budgets=args.recall_budgets,
                intervals=args.recall_intervals, voters=args.recall_voters,
                overlaps=None if args.recall_overlap is None else [bool(v) for v in args.recall_overlap],
                margins=args.recall_margins, positions=args.recall_positions)
    if args.sweep:
        runs = runs[:1] + sweep(args.sweep_budgets, args.heavy_ratios, args.sinks)
    tokens = torch.tensor([len(item.target) for item in items], dtype=torch.float64)
    results, hits = {}, {}
    for run in runs:
        began = time.perf_counter()
        fast = (args.fast_path or args.recall_overlap) and run.config.rolling  # `full` stays on the transformers path
        scorer = score_fast if fast else score_batched
        results[run.label], hits[run.label] = scorer(gen, run.config, items, args.batch)
        print(f"{run.label}: {results[run.label].sum().item() / tokens.sum().item():.4f} nats/token, "
              f"{time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps({"tokens": tokens.tolist(), "nll": {k: v.tolist() for k, v in results.items()},
                                         "hits": {k: v.tolist() for k, v in hits.items()}}))
    lengths = [len(item.context) for item in items]
    if args.text:
        caption = (f"Teacher-forced NLL of {args.target}-token continuations of {args.text.name} after {args.context} "
                   f"tokens of it, at {len(items)} places; differences in nats/token with 95% paired bootstrap CIs "
                   f"over places")
    else:
        caption = (f"Teacher-forced NLL of the reference summary, {len(items)} XSum articles of {args.data.name} "
                   f"(prompts {min(lengths)}-{max(lengths)} tokens, mean {sum(lengths) / len(lengths):.0f}; "
                   f"{skipped_phrase(skipped, args.min_prompt_tokens, args.max_prompt_tokens)}), "
                   f"{int(tokens.sum())} reference tokens; "
                   f"differences in nats/token with 95% paired bootstrap CIs over articles")
    print(report(results, hits, tokens, runs, caption))
    lines = sweep_differences(results, tokens) if args.sweep else targets(results, tokens, args.budgets)
    print("\n".join(["", *lines, *interval_differences(results, tokens)]))


def interval_differences(results: dict[str, torch.Tensor], tokens: torch.Tensor) -> list[str]:
    """Each decode-time choice interval's run (`interval_label`) against the default interval and
    voters' at the same budgets, paired per item."""
    lines = []
    for label in results:
        parts = label.split()
        if len(parts) not in (5, 6, 7, 8, 9, 10, 11) or parts[3] != "every":
            continue
        if parts[-1] == "ranks":
            parts = parts[:-1]
        if parts[-2] == "margin":
            parts = parts[:-2]
        overlap = {"beside": True, "before": False}.get(parts[-1])
        default = interval_label(int(parts[1]), int(parts[2][2:]), CacheConfig.recall_interval, CacheConfig.recall_voters,
                                 None if overlap is None else False)
        if label != default and default in results:
            diff = ratio_of_sums_difference(results[label], results[default], tokens)
            lines.append(f"- {label} - {default}: {diff} nats/token (negative: better than the default)")
    return lines


def sweep_differences(results: dict[str, torch.Tensor], tokens: torch.Tensor) -> list[str]:
    """Each swept setting against h2o's defaults (`CacheConfig`'s heavy ratio, no sinks) at the same
    budget, paired per article."""
    lines = []
    for label in results:
        parts = label.split()
        if len(parts) != 6 or parts[2] != "heavy":
            continue
        default = sweep_label(int(parts[1]), CacheConfig.heavy_ratio, 0)
        if label != default and default in results:
            diff = ratio_of_sums_difference(results[label], results[default], tokens)
            lines.append(f"- {label} - {default}: {diff} nats/token (negative: better than the default)")
    return lines


if __name__ == "__main__":
    main()
