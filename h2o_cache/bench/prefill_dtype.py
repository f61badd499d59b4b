"""What bf16 and int8 prefill products cost in quality and gain in time, against fp32 (`prefill_products`).

    python -m h2o_cache.bench.prefill_dtype --articles 100

Quality: each XSum article's summary prompt is prefilled with fp32 products, then again with bf16
MLP products (`--prefill-dtype bfloat16`), and again with integer products in every layer
(`--prefill-dtype int8`, where the model has GGUF blocks and the kernel is built), and the reference
summary is teacher-forced after each (one token per pass, fp32 products every time), through the
server's default cache (h2o 256 + recall 128): the NLL per token and each form's difference
relative to fp32 with a 95% paired bootstrap interval (the goal set for the integer decode path:
within +0.5%), and the share of summary tokens greedy decoding hits.
Time: the prefill of a `--prompt-tokens` prompt of `botchan.txt`, the forms alternating, the median
of `--reps` each, and their ratio to fp32, measured in this run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from h2o_cache import CacheConfig, Generator
from h2o_cache.bench.common import add_model_args, add_xsum_args, data_path, load, markdown_table
from h2o_cache.bench.nll import load_items, score
from h2o_cache.bench.passkey import FILLER_START
from h2o_cache.bench.stats import ratio_of_sums_difference
from h2o_cache.prefill_products import native_bf16, use_bf16_prefill, use_int8_prefill


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    add_xsum_args(parser)
    parser.add_argument("--batch", type=int, default=10, help="articles per forward pass")
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="prompt of the timed prefill")
    parser.add_argument("--reps", type=int, default=3, help="timed prefills per dtype")
    args = parser.parse_args(argv)
    args.prefill_dtype = "float32"  # the switch below is what this bench turns
    model, tokenizer = load(args)
    switches = {"bfloat16": use_bf16_prefill(model)}
    int8 = use_int8_prefill(model)  # wraps the bf16 forms: off, they decide
    if int8.layers:
        switches["int8"] = int8
    config = CacheConfig(prefill_chunk=128, recall_budget=128)  # the server's defaults
    gen = Generator(model, tokenizer, config)

    def use(form: str) -> None:
        for name, switch in switches.items():
            switch.enabled = name == form

    forms = ["float32", *switches]
    items, _ = load_items(gen, args.data, args.articles, args.max_prompt_tokens)
    nll, hits = {}, {}
    for form in forms:
        use(form)
        parts = [score(gen, config, items[i:i + args.batch]) for i in range(0, len(items), args.batch)]
        nll[form] = torch.cat([p[0] for p in parts])
        hits[form] = int(sum(p[1].sum() for p in parts))
    tokens = torch.tensor([len(item.target) for item in items], dtype=torch.float64)
    base = float(nll["float32"].sum() / tokens.sum())
    rows = [["float32", base, "", f"{hits['float32'] / tokens.sum():.4f}"]]
    for form in forms[1:]:
        diff = ratio_of_sums_difference(nll[form], nll["float32"], tokens)
        rows.append([form, float(nll[form].sum() / tokens.sum()),
                     f"{100 * diff.value / base:+.3f}% [{100 * diff.low / base:+.3f}, {100 * diff.high / base:+.3f}]",
                     f"{hits[form] / tokens.sum():.4f}"])
    print(markdown_table(["prefill products", "NLL / token", "vs float32 (95% CI)", "greedy hits"], rows,
                         caption=f"{len(items)} XSum articles, {int(tokens.sum())} scored tokens, "
                                 f"{config.describe()}, {args.threads} threads"))

    prompt = tokenizer.encode(data_path("botchan.txt").read_text(), add_special_tokens=False)
    prompt = prompt[FILLER_START:FILLER_START + args.prompt_tokens]
    seconds = {form: [] for form in forms}
    for _ in range(args.reps):
        for form in forms:
            use(form)
            cache = gen.new_cache(1)
            began = time.perf_counter()
            gen.prefill(cache, [prompt], recall=True)
            seconds[form].append(time.perf_counter() - began)
    medians = {form: statistics.median(times) for form, times in seconds.items()}
    print()
    print(markdown_table(["prefill of", *[f"{form} s" for form in forms], *[f"float32 / {form}" for form in forms[1:]]],
                         [[f"{len(prompt)} tokens", *medians.values(),
                           *[f"{medians['float32'] / medians[form]:.2f}x" for form in forms[1:]]]],
                         caption=f"median of {args.reps}, alternating; native bf16 on this CPU: {native_bf16()}"))


if __name__ == "__main__":
    main()
