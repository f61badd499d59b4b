"""Does a reply cost the same per token however long the conversation behind it? Side by side in one
run, at several history lengths: the server's decode of whole replies, burst and all.

Each configuration's row first consumes `--histories` tokens of a text (its archive then holds the
history less the budget, up to `--recall-archive`); then, every repetition, a fresh batch-1 decoder
takes a copy of it, prefills a `--turn`-token prompt as a turn (its last tokens choose the window, and
the reply's first `recall_burst` steps choose with every layer's votes, as the server's do) and decodes
`--reply` greedy steps on the fast path (`StaticDecoder`), timed; the configurations and histories are
interleaved, `--reps` times, each repetition begun one further on (`recall_speed.rotated`). Printed:
the median time per token of a reply at each history, and its ratio to the shortest history's (a flat
cost: ratios near 1). Recall off (h2o alone at the same
budget) is the reference, flat by construction; `--digests` adds a recall configuration per block
digest (`CacheConfig.recall_digest`) beside the default, `--sweeps` one per stripe of the decode
choices (`CacheConfig.recall_sweep`; 0: every choice ranks every block), `--variants` one per set of
CacheConfig fields changed (where a reply's time goes: `recall_burst=0`, `recall_positions=text`, ...).

    python -m h2o_cache.bench.flat --histories 2048 8192 16000 --digests mean --sweeps 0
    python -m h2o_cache.bench.flat --histories 2048 16000 --reps 3 --phases

`--phases` also times each step of the replies alone and prints the medians by phase of a reply
(its first step, the rest of the burst, the steps at ranks after it, the others), each with its
native forward pass apart.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from h2o_cache import CacheConfig, Generator
from h2o_cache.bench.common import add_model_args, config_field, data_path, load, markdown_table, read_text
from h2o_cache.bench.recall_speed import ForwardTimer, conversation_row, decoder_of, rotated
from h2o_cache.bench.speed import greedy_step, greedy_step_seconds
from h2o_cache.config import DIGESTS


def reply_seconds(gen: Generator, config: CacheConfig, history, turn: list[int], steps: int,
                  phases: dict[str, list[tuple[float, float]]] | None = None) -> float:
    """Mean seconds per token of one reply: a batch-1 decoder on a copy of `history` takes `turn` as a
    prompt and decodes `steps` greedy tokens (only the decoding is timed). With `phases`, each step is
    timed alone instead, and (seconds, of them in the native forward pass) added to its phase's list
    (`phase_of`)."""
    decoder = decoder_of(gen, config, history, turn, 1, 0)
    if phases is None:
        return greedy_step_seconds(decoder.step, decoder.cache, steps)
    timer = decoder.native = ForwardTimer(decoder.native) if decoder.native is not None else None
    cache, total = decoder.cache, 0.0
    for step in range(steps):
        if timer is not None:
            timer.seconds = 0.0
        began = time.perf_counter()
        greedy_step(decoder.step, cache)
        seconds = time.perf_counter() - began
        total += seconds
        phases.setdefault(phase_of(step), []).append((seconds, timer.seconds if timer is not None else 0.0))
    return total / steps


PHASES = ("first", "burst", "ranks", "after")


def phase_of(step: int) -> str:
    """Where a reply's decode step falls by what recall does in it, by the default recall configuration's
    counts whatever the configuration timed (so that recall off's steps line up): the reply's first step (the choice by
    its question), the rest of the burst (every step chooses by all layers' votes), the steps after it
    that still read held keys at their ranks (`recall_rank_steps`), and the steps after those."""
    if step == 0:
        return "first"
    if step < CacheConfig.recall_burst:
        return "burst"
    return "ranks" if CacheConfig.recall_rank_steps and step < CacheConfig.recall_rank_steps else "after"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--histories", type=int, nargs="+", default=[2048, 8192, 16000],
                        help="tokens of conversation behind the timed replies")
    parser.add_argument("--text", default=str(data_path("botchan.txt")),
                        help="the conversation's text ('random': random tokens)")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--recall", type=int, default=128, help="recall budget (tokens per layer/KV head)")
    parser.add_argument("--turn", type=int, default=64, help="tokens of each reply's prompt")
    parser.add_argument("--reply", type=int, default=64, help="decode steps timed per reply")
    parser.add_argument("--reps", type=int, default=5, help="replies per configuration and history")
    parser.add_argument("--digests", nargs="*", default=[], choices=DIGESTS,
                        help="also time recall with these block digests")
    parser.add_argument("--sweeps", nargs="*", type=int, default=[],
                        help="also time recall with these recall_sweep values (0: every block, every choice)")
    parser.add_argument("--variants", nargs="*", default=[], metavar="FIELD=VALUE[,FIELD=VALUE]",
                        help="also time recall with these CacheConfig fields changed, one configuration each, e.g. "
                             "recall_burst=0 recall_positions=text,recall_burst=0 (where a reply's time goes)")
    parser.add_argument("--phases", action="store_true",
                        help="also print each configuration's time per step by phase of the reply (its first step, "
                             "the rest of the burst, the steps reading ranks after it, the others), with the native "
                             "forward pass's share: where a reply's time goes (each step timed alone)")
    add_model_args(parser)
    args = parser.parse_args(argv)
    histories = sorted(set(args.histories))
    if args.reps < 1 or args.reply < 1 or args.turn < 1 or histories[0] < 1:
        parser.error("--reps, --reply, --turn and --histories must be positive")

    recall = CacheConfig(budget=args.budget, recall_budget=args.recall)
    variants = {}  # checked before the model loads
    for variant in args.variants:
        try:
            changes = dict(change.split("=", 1) for change in variant.split(","))
            variants[f"recall {args.recall}, {variant}"] = replace(recall, **{k: config_field(k, v) for k, v in changes.items()})
        except ValueError as error:  # no '=', an unknown field, a value of the wrong kind, a bad config
            parser.error(f"--variants {variant}: {error}")

    model, tokenizer = load(args)
    gen = Generator(model, tokenizer)
    needed = histories[-1] + args.turn * args.reps
    if args.text == "random":
        vocab = model.config.vocab_size
        tokens = torch.randint(3, vocab, (needed,), generator=torch.Generator().manual_seed(0)).tolist()
    else:
        tokens = tokenizer(read_text(args.text))["input_ids"]
    if len(tokens) < needed:
        parser.error(f"--text holds {len(tokens)} tokens: fewer than the longest history and the turns ({needed})")
    configs = {"recall off": CacheConfig(budget=args.budget),
               f"recall {args.recall}, digest {recall.recall_digest}, sweep {recall.recall_sweep} (default)": recall}
    for digest in args.digests:
        if digest != recall.recall_digest:
            configs[f"recall {args.recall}, digest {digest}"] = replace(recall, recall_digest=digest)
    for sweep in args.sweeps:
        if sweep != recall.recall_sweep:
            configs[f"recall {args.recall}, sweep {sweep}"] = replace(recall, recall_sweep=sweep)
    configs.update(variants)
    rows = {(name, n): conversation_row(gen, config, tokens[:n]) for name, config in configs.items() for n in histories}
    times: dict[tuple[str, int], list[float]] = {key: [] for key in rows}
    phases: dict[tuple[str, int], dict[str, list[tuple[float, float]]]] = {key: {} for key in rows}
    for rep in range(args.reps):
        turn = tokens[histories[-1] + rep * args.turn:histories[-1] + (rep + 1) * args.turn]  # new words each reply
        for (name, n), row in rotated(rows, rep):
            times[name, n].append(reply_seconds(gen, configs[name], row, turn, args.reply,
                                                phases[name, n] if args.phases else None))
    table = []
    for name in configs:
        first = statistics.median(times[name, histories[0]])
        for n in histories:
            archived = len(rows[name, n].archives[0]) if rows[name, n].archives[0] is not None else 0
            median = statistics.median(times[name, n])
            off = statistics.median(a / b for a, b in zip(times[name, n], times["recall off", n]))
            table.append([name, n, archived, 1e3 * median, median / first, off])
    print(markdown_table(
        ["", "history, tokens", "archived per layer/head", "ms per token of a reply", f"/ at {histories[0]}",
         "/ recall off (median of the reps' ratios)"], table,
        f"Time per token of a {args.reply}-token reply to a {args.turn}-token turn, batch 1, medians of {args.reps} "
        f"interleaved replies: {args.threads} threads, {gen.spec.device.type}, budget {args.budget}, text {args.text}"))
    if args.phases:
        table = []
        for (name, n), by_phase in phases.items():
            cells = []
            for phase in PHASES:
                timed = by_phase.get(phase, [])
                cells.append(f"{1e3 * statistics.median(t for t, _ in timed):.2f} "
                             f"({1e3 * statistics.median(f for _, f in timed):.2f})" if timed else "")
            table.append([name, n, *cells])
        print()
        print(markdown_table(["", "history, tokens", *[f"{p}, ms (forward pass)" for p in PHASES]], table,
                             f"Each step of those replies timed alone, medians by phase: the first step (step 0), the "
                             f"rest of the burst (1-{CacheConfig.recall_burst - 1}: every layer votes), the steps that read "
                             f"held keys at their ranks after it ({CacheConfig.recall_burst}-{CacheConfig.recall_rank_steps - 1}), "
                             f"the others; in brackets the native forward pass alone"))


if __name__ == "__main__":
    main()
