"""The GGUF file's own block-quantized matrices for the CPU decode step, read without dequantizing.

At batch 1-16 a CPU decode step is bound by reading the weights: fp32 SmolLM2-135M is 540 MB per
step. The GGUF it came from holds the same matrices as Q4_1 (20 bytes per 32 weights) and Q8_0 (34
bytes), 5-6x fewer. `kernels/cpu_decode.cpp` multiplies by them directly, forming each weight in
registers with one rounding, so every weight it uses is bit for bit the fp32 value the transformers
model was loaded with (checked here for every matrix before it is used): the product is the dense
one up to the order of the sums, like any other matmul kernel's.

The same library runs a whole decode step in one call (`NativeStep`): `decode.decode_step`'s math
with no per-op Python or dispatch, which at batch 1 was half the step's time.

By default the step quantizes every product's input per 32-block to int8 and multiplies integers
(as llama.cpp does; AVX-512 VNNI where the CPU has it, chosen at run time): the weights are the same,
the activations are rounded, and the teacher-forced NLL moves by +0.13% (`bench.activations`).
`activations=EXACT` keeps the fp32 activations, for whoever needs the dense model's values.

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
from functools import cache, cached_property
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
SOURCES = [KERNELS / "cpu_decode.cpp", KERNELS / "recall_choice.cpp", KERNELS / "compaction.cpp"]
HEADERS = [KERNELS / "amx_products.h", KERNELS / "int8_products.h", KERNELS / "placement.h", KERNELS / "vector_math.h"]
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
BLOCK = 32  # weights per GGUF block
KINDS = {"Q4_1": (0, 20), "Q8_0": (1, 34)}  # GGUF type -> (kernel's kind, bytes per block)
# How a product takes its fp32 input (the kernel's `Activations`): as is, or quantized per 32-block to
# int8 and multiplied with integer dot products (AVX2, or AVX-512 VNNI)
EXACT, INT8_AVX2, INT8_VNNI = "exact", "int8-avx2", "int8-vnni"
ACTIVATIONS = {EXACT: 0, INT8_AVX2: 1, INT8_VNNI: 2}


@dataclass(frozen=True)
class QuantizedMatrix:
    """An [out_features, in_features] weight as GGUF blocks: `blocks` is uint8 [out, in / 32 * bytes]."""

    kind: str  # "Q4_1" or "Q8_0"
    blocks: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    def matmul(self, x: torch.Tensor, residual: torch.Tensor | None = None, activations: str = EXACT) -> torch.Tensor:
        """residual + x @ W.T: x [B, in] fp32 -> [B, out] fp32 (residual [B, out] is not modified).
        activations: EXACT, or an integer path (`ACTIVATIONS`)."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features) if residual is None else residual.clone(memory_format=torch.contiguous_format)
        kind, blocks = self.product_blocks(activations)
        status = kernel().h2o_qmatmul(kind, blocks.data_ptr(), x.data_ptr(), out.data_ptr(),
                                      x.shape[0], self.out_features, self.in_features, x.stride(0), out.stride(0),
                                      int(residual is not None), torch.get_num_threads(), ACTIVATIONS[activations])
        if status:
            raise ValueError(f"the quantized product refused {self.kind} [{self.out_features}, {self.in_features}] (status {status})")
        return out

    def product_blocks(self, activations: str) -> tuple[int, torch.Tensor]:
        """(the kernel's kind, blocks) for a product on the path `activations`: on an integer path the
        blocks packed 8 rows at a time (`pack_rows`, made once and kept: as many bytes again) where
        the rows come in whole groups of 8, else the GGUF blocks as they are."""
        if activations != EXACT and self.out_features % 8 == 0:
            return KINDS[self.kind][0] + 2, self.packed
        return KINDS[self.kind][0], self.blocks

    @cached_property
    def packed(self) -> torch.Tensor:
        return pack_rows(self.kind, self.blocks)

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


def pack_rows(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """GGUF blocks [N, K / 32 * bytes] (N a multiple of 8) packed 8 rows at a time for the integer
    path's products (`kernels/int8_products.h`, "Weights packed 8 rows at a time"): per group of 8
    rows and per 32-block, the 8 rows' fp16 scales, for Q4_1 their fp16 minimums, then the quants
    interleaved so that 4 bytes of each of the 8 rows sit side by side. [N / 8, K / 32 * 8 * bytes] uint8."""
    n = blocks.shape[0]
    size = KINDS[kind][1]
    b = blocks.numpy().reshape(n // 8, 8, -1, size).transpose(0, 2, 1, 3)  # [groups, K / 32, 8 rows, bytes]
    if kind == "Q4_1":
        # byte p holds element p (low nibble) and 16 + p (high): byte 4 i + c holds 4 i + c and 16 + 4 i + c
        parts = [b[..., 0:2], b[..., 2:4], b[..., 4:].reshape(*b.shape[:3], 4, 4).transpose(0, 1, 3, 2, 4)]  # [.., i, row, c]
    else:
        parts = [b[..., 0:2], b[..., 2:].reshape(*b.shape[:3], 8, 4).transpose(0, 1, 3, 2, 4)]  # [.., j, row, c]
    packed = np.concatenate([p.reshape(*b.shape[:2], -1) for p in parts], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(packed).reshape(n // 8, -1))


def fastest_activations() -> str:
    """The fastest integer path this CPU runs (the kernel must be built)."""
    return INT8_VNNI if kernel().h2o_has_vnni() else INT8_AVX2


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
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    tag = hashlib.sha256(source + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("H2O_KERNEL_CACHE") or Path.home() / ".cache" / "h2o-cache" / "kernels")
    library = root / f"cpu_decode-{tag}.so"
    if not library.exists():
        try:
            root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=root) as tmp:  # same filesystem: the rename is atomic
                built = Path(tmp) / library.name
                subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", str(built)], check=True,
                               capture_output=True, text=True, timeout=300)
                os.replace(built, library)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", None) or e
            log.warning("quantized CPU kernel off: building %s failed: %s", " ".join(p.name for p in SOURCES), detail)
            return None
    lib = ctypes.CDLL(str(library))
    lib.h2o_qmatmul.restype = ctypes.c_int
    lib.h2o_qmatmul.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 3, *[ctypes.c_int64] * 5, *[ctypes.c_int] * 3]
    lib.h2o_has_vnni.restype = ctypes.c_int
    lib.h2o_decode_step.restype = ctypes.c_int
    lib.h2o_decode_step.argtypes = [ctypes.POINTER(StepLayout), *[ctypes.c_void_p] * 3, ctypes.c_int64, ctypes.c_void_p]
    lib.h2o_compact.restype = ctypes.c_int
    lib.h2o_compact.argtypes = [ctypes.c_void_p]
    lib.h2o_archive_dropped.restype = ctypes.c_int
    lib.h2o_archive_dropped.argtypes = [ctypes.c_void_p]
    lib.h2o_form_blocks.restype = ctypes.c_int
    lib.h2o_form_blocks.argtypes = [ctypes.c_void_p]
    lib.h2o_recall_choose.restype = ctypes.c_int
    lib.h2o_recall_choose.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.h2o_recall_choose_rows.restype = ctypes.c_int
    lib.h2o_recall_choose_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.h2o_recall_choose_blocks.restype = ctypes.c_int
    lib.h2o_recall_choose_blocks.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.h2o_recall_place.restype = ctypes.c_int
    lib.h2o_recall_place.argtypes = [ctypes.c_void_p]
    lib.h2o_recall_panel_product.restype = ctypes.c_int
    lib.h2o_recall_panel_product.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                             ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.h2o_rank_rotate.restype = ctypes.c_int
    lib.h2o_rank_rotate.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, *[ctypes.c_int64] * 5,
                                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.h2o_recall_softmax_into.restype = ctypes.c_int
    lib.h2o_recall_softmax_into.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p,
                                            ctypes.c_int, ctypes.c_int]
    lib.h2o_recall_amx_product.restype = ctypes.c_int
    lib.h2o_recall_amx_product.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
    lib.h2o_recall_amx.restype = ctypes.c_int
    lib.h2o_recall_amx.argtypes = [ctypes.c_int]
    lib.h2o_recall_stages.restype = ctypes.c_int
    lib.h2o_recall_stages.argtypes = [ctypes.c_int, ctypes.c_void_p]
    return lib


class StepLayout(ctypes.Structure):
    """The kernel's `Layout`: one model and its batch cache, as shapes, pointers and strides."""

    _fields_ = ([(name, ctypes.c_int64) for name in ("layers", "hidden", "intermediate", "heads", "kv_heads",
                                                     "head_dim", "vocab", "capacity", "positions", "threads")]
                + [("eps", ctypes.c_double), ("scaling", ctypes.c_double),
                   ("layer_weights", ctypes.POINTER(ctypes.c_void_p)), ("layer_kinds", ctypes.POINTER(ctypes.c_int64)),
                   ("embed", ctypes.c_void_p), ("norm", ctypes.c_void_p), ("lm_head", ctypes.c_void_p),
                   ("lm_head_kind", ctypes.c_int64), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p)]
                + [(name, ctypes.c_void_p) for name in ("keys", "values", "rotated", "scores", "origins")]
                + [(name, ctypes.c_int64) for name in ("kv_layer_stride", "kv_row_stride", "score_layer_stride",
                                                       "score_row_stride", "origin_layer_stride", "origin_row_stride")]
                + [("queries", ctypes.c_void_p), ("query_layer_stride", ctypes.c_int64), ("activations", ctypes.c_int64)]
                + [("window_keys", ctypes.c_void_p), ("window_values", ctypes.c_void_p)]
                + [(name, ctypes.c_int64) for name in ("window_layer_stride", "window_row_stride", "window_capacity")]
                + [("recalled", ctypes.c_void_p), ("ranked", ctypes.c_void_p)]
                + [("rank_keys", ctypes.c_void_p), ("rank_tags", ctypes.c_void_p), ("rank_meta", ctypes.c_void_p),
                   ("rank_rows", ctypes.c_int64), ("rank_epochs", ctypes.c_void_p)])


class NativeStep:
    """`decode.decode_step` for an fp32 Llama on the CPU whose matrices are all GGUF blocks, in one C++ call.

    The same math in the same order for every row, whatever its batch (fp32 softmax, each key's
    weight summed over its KV head's query group into its score, the new key rotated to its slot);
    the sums run in another order than torch's, so results agree with `decode_step` to rounding.
    With an integer `activations` path, every product's input is first quantized per 32-block to
    int8 (attention, norms and H2O's scores stay fp32).
    Built over one cache's buffers: `step` must see the same buffers (StaticDecoder checks that).
    """

    def __init__(self, weights, buffers, cos: torch.Tensor, sin: torch.Tensor, max_rows: int,
                 queries: torch.Tensor | None = None, activations: str = EXACT, window: torch.Tensor | None = None,
                 ranks: bool = False):
        """queries: [L, max_rows, H_q, D] fp32 contiguous, where every step leaves each row's queries
        before RoPE (to choose recall windows), or None. window: the cache's fp16 copy of its recall
        windows (`H2OCache.window_copy`, [2, L, rows, H_kv, R, D]), which the step then reads for
        slots 0 .. recalled[b] - 1 of row b (the `recalled` argument of each call), or None.
        ranks: for calls with `ranked` (and `epochs`): each row's keys are kept rotated to their ranks
        from call to call, so that a step rotates only the keys whose rank or token changed since the
        row's last step: one more buffer the size of the keys', whose pages only rows that read at
        ranks touch."""
        self.activations = activations
        self._keep = (weights, buffers, cos, sin, queries, window)  # the kernel reads these through raw pointers
        self.window = window
        self.recalled = torch.zeros(max_rows, dtype=torch.int64)
        self.ranked = torch.zeros(max_rows, dtype=torch.int64)
        self.epochs = torch.zeros(max_rows, dtype=torch.int64)
        rows = buffers.keys.shape[1]
        # with ranks: the keys at their ranks and what each slot holds there; -1: nothing yet
        self._ranks = (torch.empty_like(buffers.keys), torch.empty_like(buffers.origins),
                       torch.full((len(weights.layers), rows, weights.num_kv_heads, 4), -1, dtype=torch.int64)) if ranks else None
        layers = weights.layers
        products = {id(m): m.product_blocks(activations) for lw in layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down)}
        head_kind, head_blocks = weights.lm_head.product_blocks(activations)
        self._blocks = [blocks for _, blocks in products.values()] + [head_blocks]  # kept alive for the kernel
        pointers = [t.data_ptr() if isinstance(t, torch.Tensor) else products[id(t)][1].data_ptr()
                    for lw in layers for t in (lw.input_norm, lw.qkv, lw.o, lw.post_norm, lw.gate_up, lw.down)]
        self._pointers = (ctypes.c_void_p * len(pointers))(*pointers)
        self._kinds = (ctypes.c_int64 * (4 * len(layers)))(*[products[id(m)][0] for lw in layers
                                                            for m in (lw.qkv, lw.o, lw.gate_up, lw.down)])
        keys = buffers.keys
        first = layers[0]
        self.layout = StepLayout(
            layers=len(layers), hidden=weights.embed.shape[1], intermediate=first.down.in_features,
            heads=weights.num_heads, kv_heads=weights.num_kv_heads, head_dim=weights.head_dim,
            vocab=weights.lm_head.out_features, capacity=keys.shape[3], positions=cos.shape[0],
            threads=torch.get_num_threads(), eps=weights.eps, scaling=weights.scaling,
            layer_weights=self._pointers, layer_kinds=self._kinds, embed=weights.embed.data_ptr(),
            norm=weights.norm.data_ptr(), lm_head=head_blocks.data_ptr(),
            lm_head_kind=head_kind, cos=cos.data_ptr(), sin=sin.data_ptr(),
            keys=keys.data_ptr(), values=buffers.values.data_ptr(),
            rotated=None if buffers.rotated is None else buffers.rotated.data_ptr(),
            scores=None if buffers.scores is None else buffers.scores.data_ptr(),
            origins=buffers.origins.data_ptr(),
            kv_layer_stride=keys.stride(0), kv_row_stride=keys.stride(1),
            score_layer_stride=0 if buffers.scores is None else buffers.scores.stride(0),
            score_row_stride=0 if buffers.scores is None else buffers.scores.stride(1),
            origin_layer_stride=buffers.origins.stride(0), origin_row_stride=buffers.origins.stride(1),
            queries=None if queries is None else queries.data_ptr(),
            query_layer_stride=0 if queries is None else queries.stride(0), activations=ACTIVATIONS[activations],
            window_keys=None if window is None else window[0].data_ptr(),
            window_values=None if window is None else window[1].data_ptr(),
            window_layer_stride=0 if window is None else window.stride(1),
            window_row_stride=0 if window is None else window.stride(2),
            window_capacity=0 if window is None else window.shape[4], recalled=self.recalled.data_ptr(),
            ranked=self.ranked.data_ptr(),
            rank_keys=None if self._ranks is None else self._ranks[0].data_ptr(),
            rank_tags=None if self._ranks is None else self._ranks[1].data_ptr(),
            rank_meta=None if self._ranks is None else self._ranks[2].data_ptr(), rank_rows=rows,
            rank_epochs=self.epochs.data_ptr())
        self.logits = torch.empty(max_rows, self.layout.vocab)

    @staticmethod
    def supports(weights, buffers, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Whether the kernel can run this model over these buffers: every matrix GGUF blocks, no biases,
        SiLU, fp32 on the CPU, contiguous tensors, shapes of whole 32-blocks."""
        matrices = [m for lw in weights.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down)] + [weights.lm_head]
        biases = [b for lw in weights.layers for b in (lw.qkv_bias, lw.o_bias, lw.gate_up_bias, lw.down_bias)]
        floats = [weights.embed, weights.norm, cos, sin, *[t for lw in weights.layers for t in (lw.input_norm, lw.post_norm)],
                  *[t for t in (buffers.keys, buffers.values, buffers.rotated, buffers.scores) if t is not None]]
        if kernel() is None or not all(isinstance(m, QuantizedMatrix) for m in matrices):
            return False
        return (all(b is None for b in biases) and weights.act is torch.nn.functional.silu
                and all(t.device.type == "cpu" and t.is_contiguous() and t.dtype == torch.float32 for t in floats)
                and buffers.origins.is_contiguous() and buffers.origins.dtype == torch.int64
                and weights.head_dim % 16 == 0 and weights.num_heads % weights.num_kv_heads == 0
                and weights.embed.shape[0] == weights.lm_head.out_features
                and weights.embed.shape[1] % BLOCK == 0 and weights.layers[0].down.in_features % BLOCK == 0)

    def __call__(self, tokens: torch.Tensor, slots: torch.Tensor, origins: torch.Tensor,
                 recalled: list[int] | None = None, ranked: list[int] | None = None,
                 epochs: list[int] | None = None) -> torch.Tensor:
        """Logits [B, V] (a view of a buffer the next call overwrites) for int64 CPU tensors [B];
        recalled: each row's window slots, read from the window's copy (with `window`; else none);
        ranked: each row's window slots where every held key is read at its rank in the order of the
        text (`recall_positions` "rank": rotated from the keys as fed; the window's copy, which holds
        the text layout, then gives only its values; else none); epochs: with `ranks` and
        `ranked`, each row's `H2OCache.epochs` entry (a row whose epoch changed holds other tokens)."""
        b = tokens.shape[0]
        self.recalled[:b] = 0
        self.ranked[:b] = 0
        if self.window is not None and recalled:
            self.recalled[:len(recalled)] = torch.tensor(recalled, dtype=torch.int64)
        if ranked:
            if self._ranks is None or epochs is None or len(epochs) < len(ranked):
                raise ValueError("rows read at their ranks need a step built with ranks=True and each row's epoch")
            self.epochs[:len(ranked)] = torch.tensor(epochs[:len(ranked)], dtype=torch.int64)
            self.ranked[:len(ranked)] = torch.tensor(ranked, dtype=torch.int64)
        self.layout.threads = torch.get_num_threads()
        status = kernel().h2o_decode_step(ctypes.byref(self.layout), tokens.data_ptr(), slots.data_ptr(),
                                          origins.data_ptr(), b, self.logits.data_ptr())
        if status:
            raise ValueError(f"the native decode step refused its input (status {status})")
        return self.logits[:b]


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
