"""Shared fixtures: a tiny random-init GQA Llama for fast tests, and the real default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)


def tiny_llama(seed: int = 0, layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 128, init_std: float = 0.02,
               hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=init_std,
    )
    return LlamaForCausalLM(config).eval()


class ByteTokenizer:
    """Minimal tokenizer: one token per byte (offset 3), ids 0..2 special.

    With the tiny model's 128-token vocabulary, bytes above 124 wrap around (lossy); vocab=259 is exact.
    """

    pad_token_id, eos_token_id = 0, 2
    eos_token = "</s>"
    all_special_ids = [0, 1, 2]

    def __init__(self, vocab: int = 128):
        self.vocab = vocab

    def __len__(self) -> int:
        return self.vocab

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b % (self.vocab - 3) + 3 for b in text.encode()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")


@pytest.fixture(scope="session", autouse=True)
def private_data_home(tmp_path_factory):
    """Servers the tests start keep their default state dir (--state-dir) in a temporary
    XDG_DATA_HOME, never in the home directory; child processes inherit it."""
    previous = os.environ.get("XDG_DATA_HOME")
    os.environ["XDG_DATA_HOME"] = str(tmp_path_factory.mktemp("data-home"))
    yield
    if previous is None:
        del os.environ["XDG_DATA_HOME"]
    else:
        os.environ["XDG_DATA_HOME"] = previous


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_llama()


@pytest.fixture(scope="session")
def byte_tokenizer():
    return ByteTokenizer()


@pytest.fixture(scope="session")
def exact_model():
    """The tiny Llama with a logit for every byte (vocab 259), for grammars that need `{` and `}`."""
    return tiny_llama(vocab=259)


@pytest.fixture(scope="session")
def exact_tokenizer():
    return ByteTokenizer(259)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny Llama saved with a real tokenizer, for `python -m server --model DIR` in a child process."""
    from h2o_cache.bench import random_model

    out = tmp_path_factory.mktemp("tiny")
    random_model.main([str(out), "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2"])
    return out


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, loaded once per test session."""
    from h2o_cache import load_model

    return load_model()


DATA_DIR = Path(os.environ.get("H2O_DATA_DIR", Path(__file__).resolve().parents[1] / ".." / "shared" / "data"))


def shared_data(name: str) -> Path:
    """A file of the shared data set beside the repo; CI must have it, elsewhere the test is skipped."""
    path = DATA_DIR / name
    if not path.is_file():
        if os.environ.get("CI"):
            raise FileNotFoundError(f"{path} is missing: CI must provide ../shared/data beside the repo")
        pytest.skip(f"{path} not found (set H2O_DATA_DIR to the folder holding {name})")
    return path
