"""Decode-step cost, as ratios measured in one run: H2O vs the full cache, and the fast path vs eager.

For each scenario and batch size, an H2O cache and a full cache are prefilled with the same random
tokens, then timed over windows of `--steps` decode steps (one token per row), interleaved
h2o/full/h2o/full... for `--reps` repetitions after `--warmup` steps. The table gives the median
step time of each and the median of the per-repetition ratios, so slow drifts of a shared machine
cancel. Timings are only comparable on a quiet machine with a fixed thread count.

Scenarios:
- short, no eviction: a short context under a large budget; cost of scoring and rolling alone.
- short, evicting: context at the budget, so a window of `--steps` >= slack steps includes an
  eviction (compaction + re-rotation); the full cache starts with the same tokens.
- long: a long context; H2O holds `--budget` tokens while the full cache holds them all.

Fast path: the same H2O cache at its budget (rows evict as they cross it) decoded by the
`StaticDecoder` (fixed shapes; CUDA graphs on a GPU) and by the transformers path
(`--enforce-eager` in the server), interleaved the same way. Every step of both ends with the
greedy tokens on the host, as a server step does.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from h2o_cache import CacheConfig, Generator, H2OCache, StaticDecoder
from h2o_cache.bench.common import add_model_args, load, markdown_table
from h2o_cache.static import QUANTIZED_MAX_ROWS


@dataclass(frozen=True)
class Scenario:
    name: str
    context: int  # prompt tokens per row before timing starts
    h2o: CacheConfig
    target: str  # what the report expects of h2o / full
    max_ratio: float


@dataclass
class Timing:
    scenario: Scenario
    batch: int
    full_ms: float
    h2o_ms: float
    ratio: float  # median over repetitions of h2o / full


def scenarios(short: int, budget: int, long: int, large_budget: int = 8192) -> list[Scenario]:
    return [
        Scenario(f"short ({short} tok), no eviction", short, CacheConfig(budget=large_budget), "<= 1.15", 1.15),
        Scenario(f"short ({budget} tok), evicting", budget, CacheConfig(budget=budget), "<= 1.15", 1.15),
        Scenario(f"long ({long} tok), h2o budget {budget}", long, CacheConfig(budget=budget), "< 1", 1.0),
    ]


def prefilled(gen: Generator, config: CacheConfig, prompt: list[int], batch: int) -> H2OCache:
    """A cache of `batch` identical rows: one row is prefilled, then copied (prefill dominates otherwise)."""
    row = gen.new_cache(1, config)
    gen.prefill(row, [prompt])
    cache = gen.new_cache(0, config)
    for _ in range(batch):
        cache.extend(row)
    return cache


def step_seconds(gen: Generator, cache: H2OCache, steps: int) -> float:
    """Mean wall time of one decode step (one token per row) over `steps` steps."""
    piece = [[gen.tokenizer.eos_token_id or 0]] * cache.batch_size
    began = time.perf_counter()
    for _ in range(steps):
        gen.step(cache, piece)
    if gen.spec.device.type == "cuda":
        torch.cuda.synchronize(gen.spec.device)
    return (time.perf_counter() - began) / steps


def greedy_step(step, cache: H2OCache) -> None:
    """One `step()` -> logits, then the greedy tokens on the host as the cache's next pending ones."""
    cache.pending = [[t] for t in step().argmax(dim=-1).tolist()]


def greedy_step_seconds(step, cache: H2OCache, steps: int) -> float:
    """Mean wall time of `steps` greedy steps (`greedy_step`)."""
    began = time.perf_counter()
    for _ in range(steps):
        greedy_step(step, cache)
    return (time.perf_counter() - began) / steps


def measure(gen: Generator, scenario: Scenario, batch: int, reps: int = 7, steps: int = 16, warmup: int = 8,
            seed: int = 0) -> Timing:
    vocab = gen.model.config.vocab_size
    prompt = torch.randint(3, vocab, (scenario.context,), generator=torch.Generator().manual_seed(seed)).tolist()
    caches = {"h2o": prefilled(gen, scenario.h2o, prompt, batch),
              "full": prefilled(gen, CacheConfig(policy="full"), prompt, batch)}
    for cache in caches.values():
        step_seconds(gen, cache, warmup)
    times = {name: [] for name in caches}
    for _ in range(reps):
        for name, cache in caches.items():
            times[name].append(step_seconds(gen, cache, steps))
    ratio = statistics.median(h / f for h, f in zip(times["h2o"], times["full"]))
    return Timing(scenario, batch, 1e3 * statistics.median(times["full"]), 1e3 * statistics.median(times["h2o"]), ratio)


@dataclass
class FastTiming:
    batch: int
    eager_ms: float
    fast_ms: dict[str, float]  # per fast decoder
    ratio: dict[str, float]  # median over repetitions of fast / eager


def measure_fast(gen: Generator, decoders: dict[str, StaticDecoder], batch: int, reps: int = 7, steps: int = 16,
                 warmup: int = 8, seed: int = 0) -> FastTiming:
    """Eager vs fast decode steps of `batch` rows near the budget, each `i % slack` tokens short of it,
    so rows cross it at different steps and evictions are spread out as in a server. Every decoder
    starts from a copy of the same rows; the runs interleave."""
    config = next(iter(decoders.values())).config
    vocab = gen.model.config.vocab_size
    prompt = torch.randint(3, vocab, (config.budget,), generator=torch.Generator().manual_seed(seed)).tolist()
    eager = gen.new_cache(0, config)
    for i in range(batch):
        eager.extend(prefilled(gen, config, prompt[:config.budget - i % config.slack], 1))
    runs = {"eager": (lambda: gen.step(eager, eager.pending), eager)}
    for name, decoder in decoders.items():
        while decoder.cache.batch_size:
            decoder.cache.pop(0)
        decoder.cache.extend(eager)
        decoder.cache.pending = [[prompt[0]]] * batch
        runs[name] = (decoder.step, decoder.cache)
    eager.pending = [[prompt[0]]] * batch
    for step, cache in runs.values():
        greedy_step_seconds(step, cache, warmup)
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name, (step, cache) in runs.items():
            times[name].append(greedy_step_seconds(step, cache, steps))
    return FastTiming(batch, 1e3 * statistics.median(times["eager"]),
                      {name: 1e3 * statistics.median(times[name]) for name in decoders},
                      {name: statistics.median(f / e for f, e in zip(times[name], times["eager"])) for name in decoders})


def fast_table(timings: list[FastTiming], caption: str, device: torch.device) -> str:
    """The first decoder is the fast path as served (its ratio is the one with the target); others follow."""
    names = list(timings[0].fast_ms)
    served = names[0]
    rows = []
    for t in timings:
        row = [t.batch, t.eager_ms]
        for name in names:
            row += [t.fast_ms[name], t.ratio[name]]
        row += ["<= 0.6", "met" if t.ratio[served] <= 0.6 else "MISSED"]
        if device.type == "cuda":  # the GPU targets are absolute: 2.5 ms at batch 1, 5 ms at batch 64
            limit = 2.5 if t.batch == 1 else 5.0
            row.append(f"<= {limit:g} ms: {'met' if t.fast_ms[served] <= limit else 'MISSED'}")
        rows.append(row)
    headers = ["batch", "eager ms/step"]
    for name in names:
        headers += [f"{name} ms/step", f"{name} / eager"]
    headers += ["target", ""] + (["GPU target"] if device.type == "cuda" else [])
    return markdown_table(headers, rows, caption)


def table(timings: list[Timing], caption: str) -> str:
    rows = [[t.scenario.name, t.batch, t.full_ms, t.h2o_ms, t.ratio, t.scenario.target,
             "met" if t.ratio <= t.scenario.max_ratio and (t.scenario.max_ratio > 1 or t.ratio < 1) else "MISSED"]
            for t in timings]
    headers = ["scenario", "batch", "full ms/step", "h2o ms/step", "h2o / full", "target", ""]
    return markdown_table(headers, rows, caption)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="rows decoded together")
    parser.add_argument("--short-context", type=int, default=128, help="tokens resident in the no-eviction scenario")
    parser.add_argument("--budget", type=int, default=256, help="H2O budget of the evicting and long scenarios")
    parser.add_argument("--long-context", type=int, default=4096, help="tokens fed before timing the long scenario")
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions (median reported)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timed window (>= slack = budget // 16)")
    parser.add_argument("--warmup", type=int, default=8, help="untimed decode steps per cache first")
    parser.add_argument("--only", choices=["all", "h2o-vs-full", "fast-vs-eager"], default="all", help="which tables")
    add_model_args(parser)
    args = parser.parse_args(argv)

    model, tokenizer = load(args)
    gen = Generator(model, tokenizer)
    setup = (f"{args.threads} threads, {model.config.num_hidden_layers} layers, {next(model.parameters()).dtype}, "
             f"{gen.spec.device.type}, median of {args.reps} interleaved windows of {args.steps} steps")
    if args.only != "fast-vs-eager":
        timings = [measure(gen, s, b, args.reps, args.steps, args.warmup)
                   for s in scenarios(args.short_context, args.budget, args.long_context) for b in args.batch_sizes]
        print(table(timings, f"Decode step, h2o vs full: {setup}"), end="\n\n", flush=True)
    if args.only != "h2o-vs-full":
        config, rows = CacheConfig(budget=args.budget), max(args.batch_sizes)
        decoder = StaticDecoder(model, config, rows)
        decoders = {"fast": decoder}
        if decoder.native is not None:  # what int8 activations buy, and one C++ call, against the same step
            decoders["fast exact"] = StaticDecoder(model, config, rows, exact=True)
            decoders["fast torch ops"] = StaticDecoder(model, config, rows, native=False)
        if decoder.quantized_weights is not None:  # what the GGUF blocks buy, against the same step on fp32 weights
            decoders["fast fp32 weights"] = StaticDecoder(model, config, rows, quantized=False)
        fast = [measure_fast(gen, decoders, b, args.reps, args.steps, args.warmup) for b in args.batch_sizes]
        graphs = " (CUDA graphs)" if decoder.cuda_graphs else ""
        if decoder.native is not None:
            weights = f", GGUF blocks, one C++ call per step, {decoder.native.activations} activations"
        elif decoder.quantized_weights is not None:
            weights = f", GGUF blocks up to {QUANTIZED_MAX_ROWS} rows"
        else:
            weights = ""
        caption = (f"Decode step to greedy tokens on the host, h2o budget {args.budget}, fast path{graphs}{weights} "
                   f"vs eager: {setup}")
        print(fast_table(fast, caption, gen.spec.device))


if __name__ == "__main__":
    main()
