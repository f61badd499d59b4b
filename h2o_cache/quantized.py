"""The GGUF file's own block-quantized matrices for the CPU decode step, read without dequantizing.

At batch 1-16 a CPU decode step is bound by reading the weights: fp32 SmolLM2-135M is 540 MB per
step. The GGUF it came from holds the same matrices as Q4_1 (20 bytes per 32 weights) and Q8_0 (34
bytes), 5-6x fewer. `kernels/qmatmul.cpp` multiplies by them directly, forming each weight in
registers with one rounding, so every weight it uses is bit for bit the fp32 value the transformers
model was loaded with (checked here for every matrix before it is used): the product is the dense
one up to the order of the sums, like any other matmul kernel's.

The kernel is C++ with AVX2, built with the system's C++ compiler on first use into
`$H2O_KERNEL_CACHE` (default `~/.cache/h2o-cache/kernels`) and called through ctypes, which lets go
of the GIL. Without a compiler or AVX2, `kernel()` returns None and callers keep the dense weights.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "qmatmul.cpp"
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
BLOCK = 32  # weights per GGUF block
KINDS = {"Q4_1": (0, 20), "Q8_0": (1, 34)}  # GGUF type -> (kernel's kind, bytes per block)


@dataclass(frozen=True)
class QuantizedMatrix:
    """An [out_features, in_features] weight as GGUF blocks: `blocks` is uint8 [out, in / 32 * bytes]."""

    kind: str  # "Q4_1" or "Q8_0"
    blocks: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    def matmul(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + x @ W.T: x [B, in] fp32 -> [B, out] fp32 (residual [B, out] is not modified)."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features) if residual is None else residual.clone(memory_format=torch.contiguous_format)
        status = kernel().h2o_qmatmul(KINDS[self.kind][0], self.blocks.data_ptr(), x.data_ptr(), out.data_ptr(),
                                      x.shape[0], self.out_features, self.in_features, x.stride(0), out.stride(0),
                                      int(residual is not None), torch.get_num_threads())
        if status:
            raise ValueError(f"qmatmul refused {self.kind} [{self.out_features}, {self.in_features}] (status {status})")
        return out

    def dequantize(self) -> torch.Tensor:
        """fp32 [out, in], as gguf's reference dequantizer gives it."""
        import gguf

        kind = gguf.GGMLQuantizationType[self.kind]
        return torch.from_numpy(gguf.dequantize(self.blocks.numpy(), kind).reshape(self.out_features, self.in_features))

    @staticmethod
    def cat(parts: list[QuantizedMatrix]) -> QuantizedMatrix | None:
        """Matrices applied to the same input, stacked like `torch.cat` of their weights; None unless all
        share one kind and width."""
        if len({(p.kind, p.in_features) for p in parts}) != 1:
            return None
        return QuantizedMatrix(parts[0].kind, torch.cat([p.blocks for p in parts]), parts[0].in_features)


@cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel library, built on first use; None where it cannot be (logged once)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.info("quantized CPU kernel off: this CPU has no AVX2")
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        log.info("quantized CPU kernel off: no C++ compiler (install g++ for 2-3x faster CPU decoding)")
        return None
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("H2O_KERNEL_CACHE") or Path.home() / ".cache" / "h2o-cache" / "kernels")
    library = root / f"qmatmul-{tag}.so"
    if not library.exists():
        try:
            root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=root) as tmp:  # same filesystem: the rename is atomic
                built = Path(tmp) / library.name
                subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], check=True,
                               capture_output=True, text=True, timeout=300)
                os.replace(built, library)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", None) or e
            log.warning("quantized CPU kernel off: building %s failed: %s", SOURCE.name, detail)
            return None
    lib = ctypes.CDLL(str(library))
    lib.h2o_qmatmul.restype = ctypes.c_int
    lib.h2o_qmatmul.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 3, *[ctypes.c_int64] * 5, ctypes.c_int, ctypes.c_int]
    return lib


def _llama_rows(n: int, heads: int) -> np.ndarray:
    """The row order transformers gives a llama.cpp-permuted q or k matrix (its `_reverse_permute_weights`)."""
    return np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(2, 1).reshape(n)


def gguf_matrices(path: str | os.PathLike, model) -> dict[int, QuantizedMatrix]:
    """The Q4_1 / Q8_0 matrices of a Llama GGUF file, keyed by `id()` of the model parameter each one is.

    model: the transformers model loaded from that file. A matrix is kept only if its blocks
    dequantize to exactly the parameter's values (so a model cast to another dtype, or edited after
    loading, gets none); other types (F32, K-quants) are left to the dense weights.
    """
    import gguf

    decoder = model.get_decoder()
    config = model.config
    params: dict[str, tuple[torch.Tensor, int | None]] = {"token_embd.weight": (decoder.embed_tokens.weight, None)}
    output = model.get_output_embeddings().weight
    params["output.weight"] = (output, None)
    for i, layer in enumerate(decoder.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for name, linear, heads in (("attn_q", attn.q_proj, config.num_attention_heads),
                                    ("attn_k", attn.k_proj, config.num_key_value_heads),
                                    ("attn_v", attn.v_proj, None), ("attn_output", attn.o_proj, None),
                                    ("ffn_gate", mlp.gate_proj, None), ("ffn_up", mlp.up_proj, None),
                                    ("ffn_down", mlp.down_proj, None)):
            params[f"blk.{i}.{name}.weight"] = (linear.weight, heads)
    found: dict[int, QuantizedMatrix] = {}
    tied = output is decoder.embed_tokens.weight
    for tensor in gguf.GGUFReader(path).tensors:
        if tensor.tensor_type.name not in KINDS or tensor.name not in params:
            continue
        param, heads = params[tensor.name]
        if param.dtype != torch.float32 or param.device.type != "cpu" or param.shape[1] % BLOCK:
            continue
        blocks = np.asarray(tensor.data)
        if heads is not None:
            blocks = blocks[_llama_rows(blocks.shape[0], heads)]
        matrix = QuantizedMatrix(tensor.tensor_type.name, torch.from_numpy(np.array(blocks)), param.shape[1])  # a copy: not the file's mapping
        if matrix.out_features != param.shape[0] or not torch.equal(matrix.dequantize(), param.detach()):
            log.info("%s: blocks differ from the loaded weights; keeping the dense matrix", tensor.name)
            continue
        found[id(param)] = matrix
        if tensor.name == "token_embd.weight" and tied:
            found[id(output)] = matrix
    return found
