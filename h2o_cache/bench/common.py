"""What the bench programs share: model/thread options, repo-relative data paths, markdown tables."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import fields
from pathlib import Path
from typing import Sequence

import torch

from h2o_cache.config import CacheConfig

REPO_ROOT = Path(__file__).resolve().parents[2]


def data_path(name: str) -> Path:
    """A file of the shared data set, which sits beside the repository (../shared/data)."""
    return REPO_ROOT / ".." / "shared" / "data" / name


def read_text(path: str | Path) -> str:
    """A text file, or the documents of a jsonl file (XSum's `document` field) joined by blank lines."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return "\n\n".join(json.loads(line)["document"] for line in path.read_text().splitlines() if line.strip())
    return path.read_text()


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct); 'random': "
                             "random weights in the default model's shapes (speed only, where the GGUF cannot go)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on GPU), float32, bfloat16, float16")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (results are compared on 2)")
    parser.add_argument("--prefill-dtype", default="float32", choices=("auto", "float32", "bfloat16", "int8"),
                        help="dtype of prefill's MLP products (the server's default is auto: bf16 where the CPU has it); "
                             "the benches measure the fp32 model unless told")


def add_xsum_args(parser: argparse.ArgumentParser) -> None:
    """The XSum articles a bench reads: how many, the longest prompt, the file."""
    parser.add_argument("--articles", type=int, default=100, help="XSum articles, the first that fit")
    parser.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts are skipped")
    parser.add_argument("--data", default=str(data_path("xsum_dev.jsonl")), help="XSum jsonl (document, summary)")


def load(args: argparse.Namespace):
    """(model, tokenizer) as chosen by the options of `add_model_args`."""
    from h2o_cache import load_model
    from h2o_cache.prefill_products import apply_prefill_dtype

    torch.set_num_threads(args.threads)
    if args.model == "random":
        return random_default_shapes(args.device, args.dtype), IdsOnly()
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    apply_prefill_dtype(model, getattr(args, "prefill_dtype", "float32"))
    return model, tokenizer


class IdsOnly:
    """The tokenizer of a bench that feeds token ids: the special ids alone."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2


def random_default_shapes(device: str = "auto", dtype: str = "auto"):
    """A random-init Llama of SmolLM2-135M-Instruct's shapes (30 layers, 9 query / 3 KV heads of 64,
    hidden 576, MLP 1536, vocab 49152, RoPE theta 1e5, tied embeddings): the same work per token as
    the default model without its weights, for timing on a machine the GGUF cannot reach."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from h2o_cache.loading import resolve_dtype

    place = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(place, resolve_dtype(dtype, place)).eval()


def config_field(name: str, value: str):
    """A command line's value for CacheConfig's field `name`, as the field takes it: int, float, bool or
    str; `none` for None (`passkey --set`, `flat --variants`)."""
    known = {f.name: f for f in fields(CacheConfig)}
    if name not in known:
        raise ValueError(f"CacheConfig has no field {name!r} (fields: {', '.join(known)})")
    if value.lower() == "none":
        return None
    kind = known[name].type.split("|")[0].strip()
    if kind == "bool":
        return value.lower() in ("1", "true", "yes", "on")
    return {"int": int, "float": float}.get(kind, str)(value)


def cell(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence], caption: str = "") -> str:
    lines = [f"{caption}\n" if caption else ""]
    lines.append("| " + " | ".join(headers) + " |")
    lines.append("|" + "|".join("---" for _ in headers) + "|")
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines).lstrip("\n")
