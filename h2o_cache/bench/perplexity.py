"""Streaming perplexity of a long text through budgeted caches, past the model's context window.

The text is fed through one cache in order, in chunks of C tokens with every position's logits
(`hf.forward(all_logits=True)`); each token's NLL comes from what the cache held when it was
predicted. Perplexity is reported per segment of `--segment` tokens. With position rolling, H2O
never shows RoPE a position beyond budget + C, so it should stay flat past the trained window
(8192 for SmolLM2); the full cache and H2O without rolling use absolute positions and should not.

Chunking: C = min(32, budget // 4), so eviction runs between chunks much as it would token by
token; during a chunk the cache holds up to budget + C tokens. The full cache never evicts and its
result does not depend on C, so it is fed in chunks of 128 for speed.

With `--recall N`, each rolling budget also runs with a recall window of N tokens: every chunk first
fills each layer and head's window with the archived blocks its queries point at (`h2o_cache.recall`).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from h2o_cache import CacheConfig, H2OCache, forward, model_spec
from h2o_cache.bench.common import add_model_args, data_path, load, markdown_table

FULL_CHUNK = 128


@dataclass(frozen=True)
class Run:
    label: str
    config: CacheConfig

    @property
    def chunk(self) -> int:
        return self.config.prefill_chunk


def runs(budgets: list[int], no_rolling_budgets: list[int], full: bool = True, recall: int = 0) -> list[Run]:
    def h2o(budget: int, rolling: bool, recall: int = 0) -> Run:
        label = f"h2o {budget}" + ("" if rolling else " no-roll") + (f" +r{recall}" if recall else "")
        chunk = max(1, min(32, budget // 4))
        config = CacheConfig(policy="h2o", budget=budget, position_rolling=rolling, prefill_chunk=chunk, recall_budget=recall)
        return Run(label, config)

    out = [h2o(b, True) for b in budgets] + [h2o(b, False) for b in no_rolling_budgets]
    out += [h2o(b, True, recall) for b in budgets] if recall else []
    return out + ([Run("full", CacheConfig(policy="full", prefill_chunk=FULL_CHUNK))] if full else [])


def stream_nll(model, config: CacheConfig, tokens: torch.Tensor) -> torch.Tensor:
    """NLL in nats of tokens[1:] [N-1], each predicted from the cache as it stood at its turn.

    tokens: [N] int64. Chunks of config.prefill_chunk tokens are fed through one fresh cache.
    """
    cache = H2OCache(model_spec(model), config, rows=1)
    chunk, last = config.prefill_chunk, len(tokens) - 1
    nll = []
    for start in range(0, last, chunk):
        piece = tokens[start:min(start + chunk, last)]
        ids = piece[None].to(cache.spec.device)
        logits = forward(model, cache, ids, [len(piece)], all_logits=True)[0]
        targets = tokens[start + 1:start + 1 + len(piece)].to(logits.device)
        nll.append(F.cross_entropy(logits, targets, reduction="none").cpu())
    return torch.cat(nll)


def segment_perplexity(nll: torch.Tensor, segment: int) -> list[float]:
    """Perplexity of the tokens at positions [k*segment, (k+1)*segment) of the text (token 0 has no NLL)."""
    positions = torch.arange(1, len(nll) + 1)
    return [math.exp(float(nll[(positions // segment) == k].mean())) for k in range(int(positions[-1]) // segment + 1)]


def edges(nll: torch.Tensor, span: int) -> tuple[float, float]:
    """Perplexity of the first and of the last `span` predicted tokens: does quality drift over a long run?"""
    return math.exp(float(nll[:span].mean())), math.exp(float(nll[-span:].mean()))


def table(perplexities: dict[str, list[float]], segment: int, window: int, caption: str) -> str:
    labels = list(perplexities)
    n = max(len(p) for p in perplexities.values())
    rows = [[f"{k * segment / 1024:g}k-{(k + 1) * segment / 1024:g}k", *(perplexities[c][k] for c in labels)] for k in range(n)]
    before, after = window // segment, -(-window // segment)

    def drift(p: list[float]) -> float:
        """Worst segment past the window over the mean of the segments before it (1 = flat)."""
        if len(p) <= after or before < 2:
            return float("nan")
        return max(p[after:]) / (sum(p[1:before]) / (before - 1))

    rows.append([f"worst past {window / 1024:g}k / mean 1k-{window / 1024:g}k", *(drift(perplexities[c]) for c in labels)])
    return markdown_table(["tokens", *labels], rows, caption)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", type=Path, default=data_path("botchan.txt"), help="plain-text file to stream")
    parser.add_argument("--tokens", type=int, default=12288, help="tokens of the text to stream")
    parser.add_argument("--segment", type=int, default=1024, help="tokens per reported segment")
    parser.add_argument("--budgets", type=int, nargs="*", default=[64, 128, 256, 512, 1024], help="H2O budgets with position rolling")
    parser.add_argument("--no-rolling-budgets", type=int, nargs="*", default=[256, 1024], help="H2O budgets without position rolling")
    parser.add_argument("--no-full", action="store_true", help="skip the full-cache baseline")
    parser.add_argument("--edge", type=int, default=10240, help="tokens compared at the start and end of the run")
    parser.add_argument("--recall", type=int, default=0, help="also run each rolling budget with this recall budget")
    add_model_args(parser)
    args = parser.parse_args(argv)

    model, tokenizer = load(args)
    tokens = torch.tensor(tokenizer.encode(args.text.read_text())[:args.tokens])
    window = getattr(model.config, "max_position_embeddings", 0)
    perplexities, drift = {}, {}
    for run in runs(args.budgets, args.no_rolling_budgets, not args.no_full, args.recall):
        began = time.perf_counter()
        nll = stream_nll(model, run.config, tokens)
        perplexities[run.label] = segment_perplexity(nll, args.segment)
        drift[run.label] = edges(nll, args.edge)
        print(f"{run.label} (chunk {run.chunk}): {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    caption = (f"Perplexity per {args.segment}-token segment, first {len(tokens)} tokens of {args.text.name}, "
               f"heavy_ratio 0.5, model context window {window}")
    print(table(perplexities, args.segment, window, caption))
    if len(tokens) >= 2 * args.edge:
        rows = [[label, first, last, last / first] for label, (first, last) in drift.items()]
        print("\n" + markdown_table(["cache", f"first {args.edge}", f"last {args.edge}", "last / first"], rows,
                                     f"Perplexity of the first and last {args.edge} tokens of the same run"))


if __name__ == "__main__":
    main()
