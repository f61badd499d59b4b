"""Write a random-init Llama with the default model's tokenizer, as a Hugging Face directory.

Two uses, both about speed rather than quality:
- the default model's exact configuration (no flags) gives the same shapes, hence the same work,
  without moving its weights (e.g. onto a GPU machine that cannot fetch them);
- a tiny configuration (`--layers 2 --hidden 64`) makes the model nearly free, so a server run on
  it measures everything else: scheduling, sampling, detokenization, HTTP and SSE.

    python -m h2o_cache.bench.random_model out/tiny-smollm2 --layers 2 --hidden 64 --heads 4 --kv-heads 2
    python -m server --model out/tiny-smollm2
"""

from __future__ import annotations

import argparse

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="directory to write (config, tokenizer, safetensors)")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the default model's)")
    parser.add_argument("--hidden", type=int, help="hidden size; the MLP keeps the default model's ratio")
    parser.add_argument("--heads", type=int, help="query heads")
    parser.add_argument("--kv-heads", type=int, help="key/value heads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    from h2o_cache.loading import default_model_path

    gguf = default_model_path()
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if args.hidden:
        ratio = config.intermediate_size / config.hidden_size
        config.hidden_size, config.intermediate_size = args.hidden, int(args.hidden * ratio)
        config.head_dim = args.hidden // (args.heads or config.num_attention_heads)
    for name, value in (("num_hidden_layers", args.layers), ("num_attention_heads", args.heads),
                        ("num_key_value_heads", args.kv_heads)):
        if value:
            setattr(config, name, value)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{config.num_attention_heads}/{config.num_key_value_heads} heads, {params / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
