"""The fast path against the transformers path on fixed chat prompts: greedy text and logit agreement.

Both paths start from copies of the same prefilled rows (one per prompt, decoded together as a
batch) and decode greedily in lockstep, each feeding back its own tokens, with a budget small
enough that rows evict while they decode. Per prompt the table gives whether the texts are
identical, the first step where the tokens differ, and the largest logit difference relative to
the largest logit. On the CPU in fp32 the texts must be identical; in bf16 on a GPU the two paths
round differently, so the table states how far they agree.

    python -m h2o_cache.bench.equivalence                          # CPU, fp32
    python -m h2o_cache.bench.equivalence --device cuda            # bf16, CUDA graphs
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from h2o_cache import CacheConfig, Generator, StaticDecoder
from h2o_cache.bench.common import add_model_args, load, markdown_table

PROMPTS = [
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
]


@dataclass
class Lockstep:
    eager: list[list[int]]  # per row, the tokens the transformers path chose
    fast: list[list[int]]
    worst: list[float]  # per row, max |fast - eager| / max |eager| over the steps they agreed
    # per row, where the paths first chose differently: the eager logit of its token less that of the
    # fast path's, over max |eager| (0: an exact tie); None while they agree
    margin: list[float | None]


def lockstep(gen: Generator, decoder: StaticDecoder, prompts: list[list[int]], steps: int) -> Lockstep:
    """Greedy-decode `prompts` for `steps` steps on both paths from copies of the same prefilled rows."""
    eager = gen.new_cache(0)
    for prompt in prompts:
        row = gen.new_cache(1)
        gen.prefill(row, [prompt[:-1]])
        row.pending = [[prompt[-1]]]
        eager.extend(row)
        decoder.cache.extend(row)
    out = Lockstep([[] for _ in prompts], [[] for _ in prompts], [0.0] * len(prompts), [None] * len(prompts))
    for _ in range(steps):
        expected, logits = gen.step(eager, eager.pending), decoder.step()
        error = ((logits - expected).abs().amax(dim=-1) / expected.abs().amax(dim=-1)).tolist()
        for row, (e, f) in enumerate(zip(expected.argmax(dim=-1).tolist(), logits.argmax(dim=-1).tolist())):
            if out.eager[row] == out.fast[row]:
                out.worst[row] = max(out.worst[row], error[row])
                if e != f:
                    scores = expected[row].float()
                    out.margin[row] = float((scores[e] - scores[f]) / scores.abs().max())
            out.eager[row].append(e)
            out.fast[row].append(f)
        eager.pending = [[tokens[-1]] for tokens in out.eager]
        decoder.cache.pending = [[tokens[-1]] for tokens in out.fast]
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=64, help="H2O budget: small, so rows evict while decoding")
    parser.add_argument("--steps", type=int, default=128, help="greedy tokens per prompt")
    add_model_args(parser)
    args = parser.parse_args(argv)

    model, tokenizer = load(args)
    config = CacheConfig(budget=args.budget)
    gen = Generator(model, tokenizer, config)
    decoder = StaticDecoder(model, config, max_rows=len(PROMPTS), exact=True)  # the transformers path's values
    prompts = [gen.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    result = lockstep(gen, decoder, prompts, args.steps)
    rows = []
    for prompt, eager, fast, worst in zip(PROMPTS, result.eager, result.fast, result.worst):
        diverged = first_difference(eager, fast)
        rows.append([prompt, "yes" if diverged is None else "no", "-" if diverged is None else diverged, worst,
                     tokenizer.decode(fast[:24], skip_special_tokens=True).replace("\n", " ").replace("|", "/")])
    graphs = ", CUDA graphs" if decoder.cuda_graphs else ""
    blocks = ", GGUF blocks" if decoder.quantized_weights is not None else ""
    blocks += ", one C++ call per step" if decoder.native is not None else ""
    caption = (f"Fast path vs transformers path, greedy, {args.steps} tokens, h2o budget {args.budget}, "
               f"{next(model.parameters()).dtype}, {gen.spec.device.type}{graphs}{blocks}")
    headers = ["prompt", "same text", "first different token", "max logit diff / max logit", "fast path's text (start)"]
    print(markdown_table(headers, rows, caption))


if __name__ == "__main__":
    main()
