"""The Python work of one decode step of the GPU path, counted on the CPU: function calls per step, and
how many of them each row adds.

    python -m h2o_cache.bench.step_profile --rows 64 --generated 1000

The step is the one the server's runner takes on a GPU (`StaticDecoder.step`, the batched sampler,
then the eviction), run eagerly on a small random Llama (its tensor work does not matter here:
cProfile counts the calls Python makes, builtins included). Every row samples at temperature 1
with a frequency penalty and has `--generated` tokens of reply behind it, as a long reply would;
steps run with every row over the budget every `evict_slack` steps. Calls per row is
(calls at batch B - calls at batch 1) / (B - 1): the Python work that grows with the batch.

With `--recall kernel` or `--recall torch`, the model is bf16 (the GPU's dtype: the CPU kernel cannot
write the window, as on a GPU) and each row has a recall window of 32 tokens, one row choosing per
step as the server sets on CUDA (`recall_choices` 1), its choice made by the C++ kernel or by the torch
ops; torch calls per step counts the calls into torch (on a GPU, each a launch or a host op).

    python -m h2o_cache.bench.step_profile --rows 16 --generated 300 --recall kernel
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from dataclasses import replace

import torch

from h2o_cache import CacheConfig, Generator, Sampler, SamplingParams, StaticDecoder, sample
from h2o_cache.bench.common import IdsOnly, markdown_table


def random_llama(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def profiled(model, rows: int, generated: int, steps: int, recall: str | None = None) -> pstats.Stats:
    config = CacheConfig(policy="h2o", budget=64, evict_slack=8, prefill_chunk=64)
    if recall:
        config = replace(config, recall_budget=32, recall_block=8, recall_choices=1, recall_kernel=recall == "kernel")
    gen = Generator(model, IdsOnly(), config)
    decoder = StaticDecoder(model, config, max_rows=rows, quantized=False, native=False)
    for r in range(rows):
        row = gen.new_cache(1)
        gen.prefill(row, [[3 + (r + i) % 100 for i in range(40 + r % 24)]])
        row.pending = [[5]]
        decoder.cache.extend(row)
    samplers = [Sampler(SamplingParams(temperature=1.0, frequency_penalty=0.5, seed=r)) for r in range(rows)]

    def step():
        drawn = sample(decoder.step(evict=False), samplers)
        decoder.cache.pending = [[d.token] for d in drawn]
        decoder.cache.evict_over_budget()

    for _ in range(generated):
        step()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    return pstats.Stats(profile)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="the batch")
    parser.add_argument("--generated", type=int, default=1000, help="reply tokens each row has before the profile")
    parser.add_argument("--steps", type=int, default=16, help="profiled steps (a multiple of evict_slack, 8)")
    parser.add_argument("--vocab", type=int, default=4096, help="the random model's vocabulary")
    parser.add_argument("--recall", choices=("kernel", "torch"), help="a recall window, its choices made by ...")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = random_llama(args.vocab)
    if args.recall:
        model = model.to(torch.bfloat16)
    calls = {}
    for rows in (1, args.rows):
        stats = profiled(model, rows, args.generated, args.steps, args.recall)
        calls[rows] = stats
    per_step = {rows: stats.total_calls / args.steps for rows, stats in calls.items()}
    into_torch = {rows: sum(stat[1] for func, stat in stats.stats.items() if "torch" in pstats.func_std_string(func)
                            and "site-packages" not in func[0]) / args.steps for rows, stats in calls.items()}
    per_row = (per_step[args.rows] - per_step[1]) / (args.rows - 1)
    print(markdown_table(["batch", "Python calls per step", "per row", "torch calls per step"],
                         [[1, round(per_step[1]), "", round(into_torch[1])],
                          [args.rows, round(per_step[args.rows]), round(per_row, 1), round(into_torch[args.rows])]]))
    top = sorted(calls[args.rows].stats.items(), key=lambda item: -item[1][1])[:8]
    print()
    print(markdown_table(["function", f"calls per step at batch {args.rows}"],
                         [[f"{pstats.func_std_string(func)}", round(stat[1] / args.steps, 1)] for func, stat in top]))


if __name__ == "__main__":
    main()
