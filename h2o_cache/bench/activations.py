"""What int8 activations cost in quality: the native CPU step with its integer products vs the exact one.

    python -m h2o_cache.bench.activations --articles 100

Each XSum article's summary prompt is prefilled once (the transformers path, exact), then the same
row is decoded by two `StaticDecoder`s on the GGUF model, one batch-1 row at a time: `exact` (fp32
activations times the weights' exact values) and `int8` (activations quantized per 32-block,
integer dot products; the default). Two measures, paired over articles:
- teacher-forced NLL of the reference summary's tokens after its first (the first is predicted by the
  prefill, the same for both): the mean per token, and int8's difference relative to exact with a
  95% paired bootstrap interval (the target: within +0.5%);
- greedy agreement: of `--greedy` tokens generated from each prompt, how many leading tokens both
  paths produce alike, and the share of articles where all of them agree.
"""

from __future__ import annotations

import argparse

import torch

from h2o_cache import CacheConfig, Generator, StaticDecoder
from h2o_cache.bench.common import add_model_args, add_xsum_args, load, markdown_table
from h2o_cache.bench.nll import load_items
from h2o_cache.bench.stats import ratio_of_sums_difference


@torch.no_grad()
def teacher_forced(decoder: StaticDecoder, row, target: list[int]) -> float:
    """Summed NLL (nats) of target[1:], each predicted by a decode step after feeding the one before."""
    decoder.cache.extend(row)
    total = 0.0
    for previous, wanted in zip(target, target[1:]):
        decoder.cache.pending = [[previous]]
        total -= decoder.step()[0].log_softmax(-1)[wanted].item()
    decoder.cache.pop(0)
    return total


@torch.no_grad()
def greedy(decoder: StaticDecoder, row, first: int, tokens: int) -> list[int]:
    decoder.cache.extend(row)
    out = [first]
    for _ in range(tokens - 1):
        decoder.cache.pending = [[out[-1]]]
        out.append(int(decoder.step()[0].argmax()))
    decoder.cache.pop(0)
    return out


def agreeing(a: list[int], b: list[int]) -> int:
    """Leading tokens two sequences share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    add_xsum_args(parser)
    parser.add_argument("--greedy", type=int, default=32, help="greedy tokens generated per article by each path")
    args = parser.parse_args(argv)
    model, tokenizer = load(args)
    config = CacheConfig()
    gen = Generator(model, tokenizer, config)
    decoders = {"exact": StaticDecoder(model, config, max_rows=1, exact=True),
                "int8": StaticDecoder(model, config, max_rows=1)}
    if any(d.native is None for d in decoders.values()):
        raise SystemExit("the native step does not run here (a GGUF model with Q4_1/Q8_0 matrices and a C++ compiler)")
    items, _ = load_items(gen, args.data, args.articles, args.max_prompt_tokens)
    nll = {name: torch.zeros(len(items), dtype=torch.float64) for name in decoders}
    agree = []
    for i, item in enumerate(items):
        row = gen.new_cache(1)
        first = int(gen.prefill(row, [item.context])[0].argmax())
        row.pending = [[first]]
        texts = {}
        for name, decoder in decoders.items():
            nll[name][i] = teacher_forced(decoder, row, item.target)
            texts[name] = greedy(decoder, row, first, args.greedy)
        agree.append(agreeing(texts["exact"], texts["int8"]))
    tokens = torch.tensor([len(item.target) - 1 for item in items], dtype=torch.float64)
    exact_mean = float(nll["exact"].sum() / tokens.sum())
    diff = ratio_of_sums_difference(nll["int8"], nll["exact"], tokens)
    rows = [["exact", exact_mean, "", ""],
            ["int8", float(nll["int8"].sum() / tokens.sum()),
             f"{100 * diff.value / exact_mean:+.3f}% [{100 * diff.low / exact_mean:+.3f}, {100 * diff.high / exact_mean:+.3f}]",
             f"{sum(agree) / len(agree):.1f} / {args.greedy}, all in {sum(a == args.greedy for a in agree)} of {len(agree)}"]]
    print(markdown_table(["activations", "NLL / token", "vs exact (95% CI)", "greedy tokens agreeing"], rows,
                         caption=f"{len(items)} XSum articles, {int(tokens.sum())} scored tokens, batch 1, "
                                 f"{decoders['int8'].native.activations}, {args.threads} threads"))


if __name__ == "__main__":
    main()
