"""How well a block digest finds what a decode query attends to: the candidate stage of recall.

A choice first ranks the archive's blocks by their digests (`Archive.select`: the box [lo, hi] per
channel, scored by its corner best aligned with the query) and reads the exact logits of the best
blocks' keys only, so a token whose block the digest ranks low cannot come back. For every digest of
`config.DIGESTS` ("centre": the keys' mean; "mean": ArkVale's centre -/+ mean deviation; "minmax": Quest's
min and max) and
block size, this measures, on decode queries of a long text:

- recall: of each layer and KV head's 128 archived tokens of most attention (its own queries' softmax
  over every archived key, before RoPE, as the choice scores them), the share inside the candidate
  blocks;
- mass: the share of the head's whole attention over the archive that falls inside them;

for candidate budgets of 512, 1,024 and 2,048 tokens (the shipped choice reads 16 x 128 = 2,048: at a
6k-token archive, a third of it). Per layer it also prints how concentrated the attention is (the
share of a head's archive mass on its own top 128 tokens), the measure by which Quest keeps its first
two layers dense.

Each text place is prefilled into h2o 256 + recall 128 (`--history` tokens), then decodes
`--steps` teacher-forced steps of the text that follows on the fast path; the archive's keys are
grouped into blocks of 8, 16 and 32 in their storage order (sorted by position within each formed
run) and digested by `archive.block_digests`, the function the archive digests with.

    python -m h2o_cache.bench.digests --history 6144 --steps 24 --offsets 0 90000 180000
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from h2o_cache import CacheConfig, Generator
from h2o_cache.archive import block_digests
from h2o_cache.bench.common import add_model_args, data_path, load, markdown_table, read_text
from h2o_cache.bench.recall_speed import conversation_row, decoder_of
from h2o_cache.config import DIGESTS
from h2o_cache.recall import by_kv_head
from h2o_cache.selection import bound_mass, token_mass

BLOCKS = (8, 16, 32)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default=str(data_path("botchan.txt")), help="a text file, or an XSum jsonl")
    parser.add_argument("--history", type=int, default=6144, help="tokens prefilled before the decode steps")
    parser.add_argument("--steps", type=int, default=24, help="decode steps measured per place")
    parser.add_argument("--offsets", type=int, nargs="+", default=[0, 90000, 180000],
                        help="character offsets of the places in the text")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--recall", type=int, default=128, help="recall budget; also the top tokens a head is scored on")
    parser.add_argument("--candidates", type=int, nargs="+", default=[512, 1024, 2048],
                        help="candidate budgets, in tokens (multiples of 32)")
    add_model_args(parser)
    args = parser.parse_args(argv)
    TOP, BUDGETS = args.recall, args.candidates
    model, tokenizer = load(args)
    gen = Generator(model, tokenizer)
    config = CacheConfig(budget=args.budget, recall_budget=args.recall)
    text = read_text(args.text)
    recall: dict[tuple, list[torch.Tensor]] = {}
    mass_in: dict[tuple, list[torch.Tensor]] = {}
    concentration = []
    for offset in args.offsets:
        tokens = tokenizer.encode(text[offset:offset + 12 * (args.history + args.steps + 64)])
        tokens = tokens[:args.history + 64 + args.steps]
        if len(tokens) < args.history + 64 + args.steps:
            raise SystemExit(f"the text from offset {offset} is shorter than {args.history + 64 + args.steps} tokens")
        row = conversation_row(gen, config, tokens[:args.history])
        decoder = decoder_of(gen, config, row, tokens[args.history:args.history + 64], 1, 8)
        archive = decoder.cache.archives[0]
        storage = archive.storage()
        n = archive.full_blocks * archive.block
        n -= n % max(BLOCKS)
        if n < max(BUDGETS) or n < TOP:
            raise SystemExit(f"{n} archived tokens per head: fewer than the candidates or the top; a longer --history")
        keys = storage["keys"][:, :, :n].float()  # [L, H, n, D]
        L, H, _, D = keys.shape
        digests = {(kind, block): block_digests(keys.view(L, H, n // block, block, D), kind)
                   for kind in DIGESTS for block in BLOCKS}
        for step in range(args.steps):
            decoder.cache.pending = [[tokens[args.history + 64 + step]]]
            decoder.step()
            queries = by_kv_head(decoder.cache, decoder.cache._queries[:, 0].float())  # [L, H, group, D]
            mass = token_mass(queries, keys, gen.spec.scaling)  # [L, H, n]
            top = torch.zeros_like(mass, dtype=torch.bool).scatter_(-1, mass.topk(TOP, dim=-1).indices, True)
            total = mass.sum(-1)
            concentration.append((mass * top).sum(-1) / total)
            for (kind, block), (lo, hi) in digests.items():
                score = bound_mass(queries, lo, hi, gen.spec.scaling)  # [L, H, n / block]
                for budget in BUDGETS:
                    chosen = score.topk(budget // block, dim=-1).indices
                    inside = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, chosen, True)
                    inside = inside.repeat_interleave(block, dim=-1)
                    recall.setdefault((kind, block, budget), []).append((top & inside).sum(-1) / TOP)
                    mass_in.setdefault((kind, block, budget), []).append((mass * inside).sum(-1) / total)
        print(f"offset {offset}: {n} archived tokens per layer and head", flush=True)

    def mean(values: list[torch.Tensor]) -> float:
        return float(torch.stack(values).mean())

    queries = len(args.offsets) * args.steps
    print(f"\n{Path(args.text).name}, {args.history}-token history, {queries} decode queries; recall of each "
          f"head's top {TOP} / attention mass inside the candidate blocks, by candidate budget (tokens)\n")
    rows = [[kind, block] + [f"{mean(recall[kind, block, budget]):.3f} / {mean(mass_in[kind, block, budget]):.3f}"
                             for budget in BUDGETS]
            for kind in DIGESTS for block in BLOCKS]
    print(markdown_table(["digest", "block"] + [f"{budget}" for budget in BUDGETS], rows))
    per_layer = torch.stack(concentration).mean(0).mean(-1)  # [L]
    middle = BUDGETS[len(BUDGETS) // 2]
    by_digest = {kind: torch.stack(recall[kind, BLOCKS[0], middle]).mean(0).mean(-1) for kind in DIGESTS}
    print(f"\nper layer: share of a head's archive mass on its own top {TOP}; recall at block {BLOCKS[0]}, "
          f"{middle} candidates\n")
    print(markdown_table(["layer", f"top-{TOP} share"] + [f"recall, {kind}" for kind in DIGESTS],
                         [[layer, f"{float(per_layer[layer]):.3f}"] + [f"{float(by_digest[kind][layer]):.3f}"
                                                                      for kind in DIGESTS]
                          for layer in range(len(per_layer))]))


if __name__ == "__main__":
    main()
