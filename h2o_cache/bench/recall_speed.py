"""What recall costs, as ratios measured in one run: the decode step and a long prompt's prefill, with
recall on vs off at the same budget.

- decode: every row first consumes a `--history`-token conversation (random tokens), so its archive
  holds history - budget evicted tokens per layer/head and its recall window is full; then it decodes
  on the fast path (`StaticDecoder`), where recall adds the window's `--recall` slots to attention,
  the archiving of what each eviction drops, and every `recall_interval` steps the choice of every
  row's window by its latest queries (bound over all archived blocks, exact logits over the
  candidates, every archived token scored by the pooled votes, the changed slots' tokens copied in;
  one C++ call on the CPU, and with `--torch-choice` also on the torch ops; with `--voters V`, also with
  the choices after the burst pooling the votes of V layers, `recall_voters`). Windows of `--steps` steps (>= slack, so each
  holds an eviction) are interleaved across the configurations for `--reps` repetitions; medians of
  step time and of per-window ratios to recall off. `--breakdown` adds two more: recall on but never
  choosing (the window's slots, archiving and placing alone), and recall off at budget + recall slots
  (what attending over as many slots costs by itself). `--split` times each step's forward pass (the
  native step) apart from the rest (the choice before it, evictions, sampling), and the kernel's
  choices by stage (`native_recall.stages`). `--by-step` times every step alone and prints
  medians of plain steps, of steps before which rows chose, and of steps after which rows were
  evicted: where the cost sits (a choosing step of 8 rows pays 8 choices at once).
- prefill: one `--prompt`-token prompt from an empty cache in chunks of budget / 2 (the server's), with
  recall as configured by default (every chunk chooses layer by layer by its own queries; the
  windows grow; the passages a look at the reply points at are fed again before the last
  `recall_probe` tokens, `h2o_cache.reread`, the look on a 1-row fast step as in the server; a chunk
  of the body chooses by 32 of its queries per head, `recall_queries`, the question's by all), the same
  with no re-read, with the body's chunks choosing by all their queries (`recall_queries=None`), with no
  re-read and `recall_ahead` (a body chunk takes the window its previous chunk chose, all layers in
  one choice), and without recall, interleaved.
Also printed: the host bytes one archived token takes, and what the archive holds.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import replace
from typing import TypeVar

import torch

from h2o_cache import CacheConfig, Generator, H2OCache, StaticDecoder, native_recall, reread
from h2o_cache.bench.common import add_model_args, load, markdown_table
from h2o_cache.bench.speed import greedy_step, greedy_step_seconds
from h2o_cache.bench.stats import Interval, median_interval

K, V = TypeVar("K"), TypeVar("V")


def conversation_row(gen: Generator, config: CacheConfig, history: list[int]) -> H2OCache:
    row = gen.new_cache(1, config)
    gen.prefill(row, [history])
    return row


def sync(gen: Generator) -> None:
    if gen.spec.device.type == "cuda":
        torch.cuda.synchronize(gen.spec.device)


def decoder_of(gen: Generator, config: CacheConfig, history: H2OCache, turn: list[int], batch: int,
               warmup: int) -> StaticDecoder:
    """A fast-path decoder of `batch` rows that each consumed `history` and then `turn`, warmed up by
    `warmup` steps (>= slack: one eviction; 0: none, the burst after the turn still ahead)."""
    decoder = StaticDecoder(gen.model, config, batch)
    for _ in range(batch):
        row = gen.new_cache(0, config)
        row.extend(history)
        logits = gen.prefill(row, [turn], recall=True)
        row.pending = [[int(logits[0].argmax())]]
        decoder.cache.extend(row, move=True)
    if warmup:
        greedy_step_seconds(decoder.step, decoder.cache, warmup)
    return decoder


class ForwardTimer:
    """Stands in for a decoder's native step (`StaticDecoder.native`) and adds up the seconds its calls
    take: the forward pass alone, apart from the choices, evictions and sampling around it."""

    def __init__(self, step):
        self.step, self.seconds = step, 0.0

    def __getattr__(self, name):
        return getattr(self.step, name)

    def __call__(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return self.step(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - began


def ratio_text(ratio: Interval) -> str:
    """A ratio's median as the table prints it: to the interval's decimals, so the interval holds it."""
    return f"{ratio.value:.3f}"


def interval_text(ratio: Interval) -> str:
    """A ratio's interval as the table prints it, rounded outward: the printed interval holds the true
    one, and so the median as `ratio_text` rounds it (to nearest, the interval's bounds holding a median
    at one of them: 0.83994 is [0.839, ...] and 0.840, not [0.840, ...] and 0.8399)."""
    return f"[{math.floor(ratio.low * 1000) / 1000:.3f}, {math.ceil(ratio.high * 1000) / 1000:.3f}]"


def rotated(timed: dict[K, V], rep: int) -> list[tuple[K, V]]:
    """The items timed in repetition `rep` (decoders, prefill configurations, a bench's rows), in the
    dict's order begun at its (rep mod n)-th. Run in one fixed order, an item's windows follow the same
    other item's every time, and on the project's CPU VM which one went before moved a ratio by 0.1-0.15
    (RESULTS.md, "Steady steps": identical pairs of decoders, fixed order against alternating, 1.441
    against 1.313)."""
    items = list(timed.items())
    start = rep % len(items) if items else 0
    return items[start:] + items[:start]


def decode_times(decoders: dict[str, StaticDecoder], reps: int, steps: int,
                 forward: dict[str, list[float]] | None = None,
                 stages: dict[str, dict[str, float]] | None = None, warm: int = 0) -> dict[str, list[float]]:
    """Mean seconds per step of each decoder over `reps` interleaved windows of `steps` greedy steps;
    with `forward`, also each window's mean seconds in the forward pass of decoders whose native step is
    a `ForwardTimer`; with `stages`, also each decoder's kernel choices timed by stage
    (`native_recall.stages`), summed over its windows. With `warm`, each window first runs that many
    greedy steps untimed, so that the steps timed are the steady ones: a decoder's first steps after
    another decoder's window run slower (on the default model at batch 1, 11-13 ms for the first and
    ~20 steps to settle, against a steady 4.6-6.8 ms in one run), and a short window averages that in.
    The decoders take turns in an order rotated at each repetition (`rotated`)."""
    times = {name: [] for name in decoders}
    for rep in range(reps):
        for name, decoder in rotated(decoders, rep):
            if warm:
                greedy_step_seconds(decoder.step, decoder.cache, warm)
            timer = decoder.native if isinstance(decoder.native, ForwardTimer) else None
            if timer is not None:
                timer.seconds = 0.0
            if stages is not None:
                native_recall.stages(True)
            times[name].append(greedy_step_seconds(decoder.step, decoder.cache, steps))
            if stages is not None:
                counted = native_recall.stages(False) or {}
                total = stages.setdefault(name, {})
                for stage, value in counted.items():
                    total[stage] = total.get(stage, 0.0) + value
            if timer is not None and forward is not None:
                forward.setdefault(name, []).append(timer.seconds / steps)
    return times


def stage_rows(stages: dict[str, dict[str, float]], batch: int, steps: int) -> list[list]:
    """Rows of a table of the kernel's decode choices by stage (`decode_times`' `stages`): choices per
    step and ms per choice in each stage, for the configurations that made any."""
    rows = []
    for name, total in stages.items():
        choices = total.get("choices", 0.0)
        if choices:
            per = [1e3 * total[stage] / choices for stage in native_recall.STAGES]
            rows.append([f"batch {batch}, {name}", choices / steps, *per, sum(per)])
    return rows


def step_kinds(decoder: StaticDecoder, steps: int) -> dict[str, list[float]]:
    """Each of `steps` greedy steps timed alone, by what it did besides decoding: some row chose its
    window before it ("choosing"), some row was evicted after it ("evicting"), neither ("plain")."""
    cache, times = decoder.cache, {"plain": [], "choosing": [], "evicting": []}
    for _ in range(steps):
        choosing, before = any(cache.due), list(cache.lengths)
        began = time.perf_counter()
        greedy_step(decoder.step, cache)
        elapsed = time.perf_counter() - began
        evicted = any(after < n + 1 for after, n in zip(cache.lengths, before))
        times["choosing" if choosing else "evicting" if evicted else "plain"].append(elapsed)
    return times


def step_table(decoders: dict[str, StaticDecoder], batch: int, reps: int, steps: int) -> list[list]:
    """Rows of medians by kind of step (`step_kinds`), the configurations interleaved `reps` times."""
    times = {name: {"plain": [], "choosing": [], "evicting": []} for name in decoders}
    for rep in range(reps):
        for name, decoder in rotated(decoders, rep):
            for kind, seconds in step_kinds(decoder, steps).items():
                times[name][kind] += seconds
    table = []
    for name, kinds in times.items():
        every = [t for ts in kinds.values() for t in ts]
        table.append([f"batch {batch}, {name}", *[f"{1e3 * statistics.median(ts):.2f} ({len(ts)})" if ts else ""
                                                  for ts in kinds.values()], 1e3 * statistics.mean(every)])
    return table


def prefill_times(gen: Generator, configs: dict[str, CacheConfig], prompt: list[int], reps: int,
                  lookers: dict | None = None) -> dict[str, list[float]]:
    """Each config's prefill times; lookers[name]: the 1-row fast step a config that re-reads
    (`h2o_cache.reread`) looks on, as the server does (`reread.looker`)."""
    times = {name: [] for name in configs}
    for rep in range(reps + 1):
        for name, config in rotated(configs, rep):
            row = gen.new_cache(1, config)
            gen.looker = (lookers or {}).get(name)
            sync(gen)
            began = time.perf_counter()
            gen.prefill(row, [prompt], recall=True)
            sync(gen)
            if rep:  # the first round warms up
                times[name].append(time.perf_counter() - began)
    gen.looker = None
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--recall", type=int, default=128, help="recall budget (tokens per layer/KV head)")
    parser.add_argument("--history", type=int, default=2048, help="tokens each row consumed before the timed turn")
    parser.add_argument("--turn", type=int, default=64, help="tokens of the turn each decoding row starts with")
    parser.add_argument("--prompt", type=int, default=4096, help="tokens of the timed prefill")
    parser.add_argument("--text", default=None,
                        help="a text file whose tokens make the history and the turn (from its 1,000th token), so "
                             "that the rows decode a continuation of real text; default: random tokens, on which "
                             "attention is flatter and a choice keeps more of its window from step to step")
    parser.add_argument("--intervals", type=int, nargs="+", default=[CacheConfig.recall_interval],
                        help="recall_interval values to time (a row decoding alone; with more rows, times their count, "
                             "at most recall_interval_max; default: the server's, a choice at every step)")
    parser.add_argument("--interval-max", type=int, default=CacheConfig.recall_interval_max,
                        help="recall_interval_max: the longest interval a row's grows to (at or below an interval: "
                             "it does not grow)")
    parser.add_argument("--voters", type=int, nargs="+", default=[],
                        help="also time each interval with recall_voters V: the choices after the burst read the "
                             "keys of V layers and pool their votes (0: all layers)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--breakdown", action="store_true",
                        help="also time recall on without choices, and recall off at budget + recall slots")
    parser.add_argument("--margins", type=float, nargs="+", default=[],
                        help="also time each interval with recall_margin M (a held token ranked by its votes x (1 + M))")
    parser.add_argument("--serial", action="store_true",
                        help="also time each interval with the choices before the step (recall_overlap False), where "
                             "they run beside it by default (a GPU)")
    parser.add_argument("--torch-choice", action="store_true",
                        help="also time each interval with a decode step's choice on the torch ops (recall_kernel=False)")
    parser.add_argument("--ranks", action="store_true",
                        help="also time each interval and the prefill with recall_positions='rank' (every held key "
                             "read at its rank in the text)")
    parser.add_argument("--rank-steps", type=int, nargs="+", default=[],
                        help="also time each interval with recall_positions='rank' and recall_rank_steps K: ranks for "
                             "a reply's first K steps, then the text layout (timed past the first --steps steps; "
                             "a step within the first K costs what --ranks' does)")
    parser.add_argument("--text-layout", action="store_true",
                        help="also time each interval with recall_positions='text' (every held key read at the "
                             "position of its slot; what the server sets on a GPU unless told)")
    parser.add_argument("--reps", type=int, default=7, help="0: time the prefill only")
    parser.add_argument("--prefill-reps", type=int, default=2, help="0: time the decode step only")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per timed window")
    parser.add_argument("--warm-steps", type=int, default=0,
                        help="untimed steps at the start of each window: a decoder's first steps after another's "
                             "window are slower (e.g. 11-13 ms against a steady 4.6-6.8 at batch 1), so a window of "
                             "--steps alone averages some of that in (0: as the target's runs so far)")
    parser.add_argument("--split", action="store_true",
                        help="also print each configuration's step split into its forward pass (the native step "
                             "alone) and the rest (the choice, evictions, sampling, Python): what recall adds to "
                             "each, and whether a choice slows the forward pass after it")
    parser.add_argument("--by-step", action="store_true",
                        help="also time every step alone: medians of plain, choosing and evicting steps")
    add_model_args(parser)
    args = parser.parse_args(argv)
    if args.reps < 0 or args.prefill_reps < 0 or not (args.reps or args.prefill_reps):
        parser.error("--reps and --prefill-reps count repetitions (>= 0), and one of them must be at least 1")
    if args.warm_steps < 0:
        parser.error("--warm-steps counts steps (>= 0)")

    model, tokenizer = load(args)
    gen = Generator(model, tokenizer)
    vocab = model.config.vocab_size
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            tokens = tokenizer(f.read())["input_ids"][1000:1000 + args.history + args.turn]
        if len(tokens) < args.history + args.turn:
            parser.error(f"--text holds {len(tokens) + 1000} tokens: fewer than 1,000 + --history + --turn")
    else:
        tokens = torch.randint(3, vocab, (args.history + args.turn,), generator=torch.Generator().manual_seed(0)).tolist()
    history, turn = tokens[:args.history], tokens[args.history:]
    configs = {"off": CacheConfig(budget=args.budget)}
    for k in args.intervals:
        configs[f"on, every {k}"] = CacheConfig(budget=args.budget, recall_budget=args.recall, recall_interval=k,
                                                recall_interval_max=args.interval_max)
        for voters in args.voters:
            configs[f"on, every {k}, {voters or 'all'} voting layers"] = replace(configs[f"on, every {k}"],
                                                                                 recall_voters=voters)
        for margin in args.margins:
            configs[f"on, every {k}, margin {margin:g}"] = replace(configs[f"on, every {k}"], recall_margin=margin)
        if args.serial:
            configs[f"on, every {k}, choices before the step"] = replace(configs[f"on, every {k}"], recall_overlap=False)
        if args.torch_choice:
            configs[f"on, every {k}, torch choice"] = replace(configs[f"on, every {k}"], recall_kernel=False)
        if args.ranks:
            configs[f"on, every {k}, ranks"] = replace(configs[f"on, every {k}"], recall_positions="rank")
        if args.text_layout:
            configs[f"on, every {k}, text layout"] = replace(configs[f"on, every {k}"], recall_positions="text")
        for steps in args.rank_steps:
            configs[f"on, every {k}, ranks for {steps} steps"] = replace(configs[f"on, every {k}"], recall_positions="rank",
                                                                          recall_rank_steps=steps)
    if args.breakdown:
        configs["on, never choosing"] = CacheConfig(budget=args.budget, recall_budget=args.recall,
                                                    recall_interval=1 << 30, recall_burst=0)
        configs[f"off, budget {args.budget + args.recall}"] = CacheConfig(budget=args.budget + args.recall)
    # each decode row consumes the history first; the prefill alone (--reps 0) needs none of them
    rows = {name: conversation_row(gen, config, history) for name, config in configs.items()} if args.reps else {}
    setup = (f"{args.threads} threads, {next(model.parameters()).dtype}, {gen.spec.device.type}, budget {args.budget}, "
             f"recall {args.recall}, history {args.history} tokens, turn {args.turn} tokens"
             f"{' of ' + args.text if args.text else ' (random)'}")

    table, by_step, split, staged = [], [], [], []
    for batch in args.batch_sizes if rows else []:
        decoders = {name: decoder_of(gen, config, rows[name], turn, batch, args.steps) for name, config in configs.items()}
        forward: dict[str, list[float]] = {}
        if args.split:
            for decoder in decoders.values():
                if decoder.native is not None:
                    decoder.native = ForwardTimer(decoder.native)
        stages: dict[str, dict[str, float]] | None = {} if args.split else None
        times = decode_times(decoders, args.reps, args.steps, forward, stages, args.warm_steps)
        if stages:
            staged += stage_rows(stages, batch, args.reps * args.steps)
        if forward:
            split += [[f"batch {batch}, {name}", 1e3 * statistics.median(times[name]), 1e3 * statistics.median(forward[name]),
                       1e3 * statistics.median(t - f for t, f in zip(times[name], forward[name])),
                       1e3 * statistics.median(f - o for f, o in zip(forward[name], forward["off"]))]
                      for name in configs if name in forward]
        for name in configs:
            if name == "off":
                continue
            ratio = median_interval([on / off for on, off in zip(times[name], times["off"])])
            judged = name.startswith("on, every")  # the breakdown's rows only explain the cost
            config = configs[name]
            grown = config.choice_interval(batch)  # recall_interval grows with the rows decoding
            label = f"{name} (a row every {grown})" if judged and grown != config.recall_interval else name
            table.append([f"decode step, batch {batch}, {label}", 1e3 * statistics.median(times["off"]),
                          1e3 * statistics.median(times[name]), ratio_text(ratio), interval_text(ratio),
                          "<= 1.25" if judged else "", ("met" if ratio.value <= 1.25 else "MISSED") if judged else ""])
        if args.by_step:  # the same decoders, on from where the windows above left them
            by_step += step_table(decoders, batch, args.reps, args.steps)
    if args.prefill_reps:  # 0: decode only
        prompt = torch.randint(3, vocab, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
        chunk = max(1, args.budget // 2)  # the server's chunk with recall
        prefills = {"off": replace(configs["off"], prefill_chunk=chunk),
                    "on": CacheConfig(budget=args.budget, recall_budget=args.recall, prefill_chunk=chunk)}
        prefills["no re-read"] = replace(prefills["on"], recall_reread=0)
        prefills["all queries"] = replace(prefills["on"], recall_queries=None)
        prefills["ahead"] = replace(prefills["no re-read"], recall_ahead=True)
        labels = [("on", f", re-reading {prefills['on'].recall_reread} tokens, body chunks choosing by "
                         f"{prefills['on'].recall_queries} queries per head (the defaults)"),
                  ("no re-read", ", no re-read (recall_reread=0)"),
                  ("all queries", ", re-reading, body chunks choosing by all their queries (recall_queries=None)"),
                  ("ahead", ", no re-read, body chunks given their previous chunk's choice (recall_ahead)")]
        if args.ranks:
            prefills["ranks"] = replace(prefills["on"], recall_positions="rank")
            labels.append(("ranks", ", re-reading, held keys read at their ranks (recall_positions='rank')"))
        lookers = {name: reread.looker(gen.model, config) for name, config in prefills.items()}
        times = prefill_times(gen, prefills, prompt, args.prefill_reps, lookers)
        for name, label in labels:
            ratio = median_interval([a / b for a, b in zip(times[name], times["off"])])
            table.append([f"prefill of a {args.prompt}-token prompt in chunks of {chunk}{label}", 1e3 * statistics.median(times["off"]),
                          1e3 * statistics.median(times[name]), ratio_text(ratio), interval_text(ratio), "<= 1.5",
                          "met" if ratio.value <= 1.5 else "MISSED"])
    print(markdown_table(["", "recall off, ms", "recall on, ms", "on / off", "95% CI", "target", ""], table,
                         f"Cost of recall, medians of {args.reps} interleaved repetitions "
                         f"({args.prefill_reps} for the prefill; decode windows of {args.steps} steps, each after "
                         f"{args.warm_steps} untimed): {setup}. On / off: the median of the repetitions' ratios, "
                         "with a percentile-bootstrap interval over the repetitions; a verdict whose interval "
                         "holds the target is one that this run does not resolve"))
    if split:
        print()
        print(markdown_table(["", "step, ms", "forward pass, ms", "the rest, ms", "forward pass - recall off's, ms"],
                             split, f"Each step split ({args.reps} x {args.steps} steps per configuration, medians of the "
                             "windows): the native forward pass alone, and the rest (the choice before it, evictions, "
                             "sampling, Python)"))
    elif args.split:
        print("\n--split: no native step here (it needs the C++ kernel and a CPU): nothing to split")
    if staged:
        print()
        print(markdown_table(["", "choices a step", *[f"{stage}, ms" for stage in native_recall.STAGES], "choice, ms"],
                             staged, "The kernel's decode choices in those steps, by stage (ms a choice; "
                             "`native_recall.stages`): rank = the voting heads' bound and exact stages, votes = "
                             "their votes pooled and the best positions, index = the position index updated, "
                             "picks = every head's tokens, fill = the copies into the window"))
    if by_step:
        print()
        print(markdown_table(["", "plain step, ms (steps)", "choosing", "evicting", "mean, ms"], by_step,
                             f"Decode steps timed one by one ({args.reps} x {args.steps} per configuration), medians by "
                             "what the step did besides decoding: some row chose its window before it, some row "
                             "was evicted after it"))
    if not rows:
        return
    archive = rows[f"on, every {args.intervals[0]}"].archives[0]
    per_token = archive.nbytes / max(len(archive), 1)
    print(f"\nArchive after the history: {len(archive)} tokens per layer/head, {archive.nbytes / 2**20:.1f} MiB "
          f"of host memory, {per_token / 1024:.1f} KiB per archived token (all layers and heads)")


if __name__ == "__main__":
    main()
