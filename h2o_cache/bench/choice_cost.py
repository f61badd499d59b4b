"""What one decode-time choice of a recall window costs at several archive sizes, with and without the
sweep (`CacheConfig.recall_sweep`), side by side in one run: the choices alone, not the steps around
them, so that a few tenths of a millisecond show through the noise of whole replies.

A batch-1 row consumes each `--histories` tokens of a text (its archive then holds the history less the
budget); a copy of it decodes the text's next `--choices` tokens teacher-forced and keeps each step's
queries. Then, every repetition, for every sweep of `--sweeps` (interleaved), a copy of the row makes the
choices of a reply by those queries in turn, timed one by one (`recall.refresh`): a reply's first (every
block ranked, the sweep emptied as a new prompt empties it), then the rest as a burst's (every layer
votes) and, again from a fresh copy, as the choices after the burst (`recall_voters` layers vote, the
held tokens favoured by `recall_margin`). Printed: the median milliseconds of a choice after the first.

    python -m h2o_cache.bench.choice_cost --histories 2048 8192 16000 --sweeps 0 128 512
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from h2o_cache import CacheConfig, Generator, recall
from h2o_cache.bench.common import add_model_args, data_path, load, markdown_table, read_text
from h2o_cache.bench.recall_speed import conversation_row


def reply_queries(gen: Generator, config: CacheConfig, history, tokens: list[int]) -> list[torch.Tensor]:
    """The queries ([L, 1, H_q, D]) each of `tokens`, fed one by one after `history`, leaves for a choice."""
    row = gen.new_cache(0, config)
    row.extend(history)
    queries = []
    for token in tokens:
        gen.step(row, [[token]])
        queries.append(row._queries.clone())
    return queries


def choice_seconds(gen: Generator, config: CacheConfig, history, queries: list[torch.Tensor],
                   after_burst: bool) -> tuple[list[float], list[int]]:
    """Seconds of each choice after the first, made by `queries` in turn on a copy of `history`, and the
    window slots each rewrote (all layers and heads)."""
    row = gen.new_cache(0, config)
    row.extend(history)
    if row.archives[0] is not None:
        row.archives[0].forget_sweep()  # a new prompt's: the first choice ranks every block
    few = {0} if after_burst else set()
    times, written = [], []
    for i, q in enumerate(queries):
        before = row.recall_count[0]
        began = time.perf_counter()
        recall.refresh(row, q, row.spec.scaling, [0], few=few if i else set())
        times.append(time.perf_counter() - began)
        written.append(row.recall_count[0] - before)
    return times[1:], written[1:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--histories", type=int, nargs="+", default=[2048, 8192, 16000])
    parser.add_argument("--sweeps", type=int, nargs="+", default=[0, 128, 512], help="recall_sweep values")
    parser.add_argument("--text", default=str(data_path("botchan.txt")), help="the conversation's text ('random': random tokens)")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--recall", type=int, default=128)
    parser.add_argument("--choices", type=int, default=16, help="choices of a reply (a burst's: 16)")
    parser.add_argument("--reps", type=int, default=5)
    add_model_args(parser)
    args = parser.parse_args(argv)
    if args.choices < 2 or args.reps < 1:
        parser.error("--choices must be >= 2 and --reps >= 1")
    model, tokenizer = load(args)
    gen = Generator(model, tokenizer)
    histories = sorted(set(args.histories))
    if args.text == "random":
        tokens = torch.randint(3, model.config.vocab_size, (histories[-1] + args.choices,),
                               generator=torch.Generator().manual_seed(0)).tolist()
    else:
        tokens = tokenizer(read_text(args.text))["input_ids"]
    if len(tokens) < histories[-1] + args.choices:
        parser.error(f"--text holds {len(tokens)} tokens: fewer than the longest history and the choices")
    base = CacheConfig(budget=args.budget, recall_budget=args.recall)
    configs = {sweep: replace(base, recall_sweep=sweep) for sweep in args.sweeps}
    rows = {n: conversation_row(gen, base, tokens[:n]) for n in histories}
    queries = {n: reply_queries(gen, base, rows[n], tokens[n:n + args.choices]) for n in histories}
    times = {(n, sweep, kind): [] for n in histories for sweep in configs for kind in (False, True)}
    written = {key: [] for key in times}
    for _ in range(args.reps):
        for n in histories:
            for after_burst in (False, True):
                for sweep, config in configs.items():
                    seconds, slots = choice_seconds(gen, config, rows[n], queries[n], after_burst)
                    times[n, sweep, after_burst] += seconds
                    written[n, sweep, after_burst] += slots
    table = []
    for n in histories:
        archived = len(rows[n].archives[0])
        for sweep in configs:
            burst, after = (1e3 * statistics.median(times[n, sweep, kind]) for kind in (False, True))
            slots = [statistics.mean(written[n, sweep, kind]) for kind in (False, True)]
            table.append([n, archived, sweep, f"{burst:.2f}", f"{after:.2f}", f"{slots[0]:.0f} / {slots[1]:.0f}"])
    print(markdown_table(
        ["history, tokens", "archived per layer/head", "recall_sweep", "ms a burst choice (every layer votes)",
         "ms a choice after the burst", "slots rewritten a choice (burst / after)"], table,
        f"Median time of a decode choice after a reply's first, {args.choices - 1} per reply, {args.reps} interleaved "
        f"repetitions: batch 1, {args.threads} threads, {gen.spec.device.type}, budget {args.budget} + recall {args.recall}"))


if __name__ == "__main__":
    main()
