"""Prefill's MLP products in bf16, on CPUs that multiply bf16 natively.

A prompt chunk sends up to `prefill_chunk` rows through every linear layer of the decoder, and on
the CPU those products are most of a prefill (2.3 of 4.2 s for a 2k-token prompt of the default
model in chunks of 256). Where the CPU has AVX512-BF16 or AMX-BF16, oneDNN's bf16 products run 3-4x
faster than MKL's fp32 ones (this project's Zen 5, 256 rows of the default model's shapes: 600-764
against 178-205 GFLOP/s). Inputs are rounded to bf16, products accumulate in fp32, results come back
in the model's dtype.

Only the MLP's products (gate, up, down: three quarters of a layer's weights) by default: with the
attention's projections in bf16 too, the queries and keys that choose the recall window and attend
to it moved enough that a pass key at depth 50% of a 5k-token message was found 0 times in 10
through the server (fp32: 10/10; MLP only: 10/10). Decode steps (one token per row) keep the exact
products: on the CPU they run in the native step or, on the transformers path, here in fp32.

`use_bf16_prefill(model)` keeps a bf16 copy of each chosen weight beside the fp32 one (+2 bytes per
weight, 160 MB for the default model's MLPs) and returns a switch; `prefill_dtype` says what `auto`
means on this machine. `use_int8_prefill` (`--prefill-dtype int8`, an option) sends every GGUF-block
product through the decode step's integer kernel instead: faster again, but it loses pass keys deep
in long prompts (RESULTS.md, "Prefill on the integer products").
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU multiplies bf16 natively (its /proc/cpuinfo flags name AVX512-BF16 or AMX-BF16);
    False where that cannot be read. Without them oneDNN emulates bf16, slower than fp32."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def prefill_dtype(name: str, model: nn.Module) -> torch.dtype:
    """The dtype of prefill's products for `name` (auto, float32 or bfloat16) and a loaded model:
    auto is bf16 for an fp32 model on a CPU with native bf16, else the model's own dtype."""
    weight = next(model.parameters())
    if name == "auto":
        on_cpu = weight.device.type == "cpu"
        return torch.bfloat16 if weight.dtype == torch.float32 and on_cpu and native_bf16() else weight.dtype
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"unknown prefill dtype {name!r}; choose auto, float32 or bfloat16")
    return dtypes[name]


@dataclass
class PrefillSwitch:
    """The switch `use_bf16_prefill` and `use_int8_prefill` return: while `enabled`, inputs of more
    than one token per row of its `layers` take their bf16 (or integer) products."""

    layers: list[nn.Linear] = field(default_factory=list)
    enabled: bool = True


def use_bf16_prefill(model: nn.Module, parts: tuple[str, ...] = ("mlp",)) -> PrefillSwitch:
    """Give the linear layers of the model's decoder whose names contain one of `parts` a bf16 product
    for multi-token inputs ([B, T, D] with T > 1). The output head is left alone: a prefill takes the
    logits of one token per row."""
    switch = PrefillSwitch()
    for name, module in model.get_decoder().named_modules():
        if isinstance(module, nn.Linear) and module.weight.dtype == torch.float32 and any(p in name for p in parts):
            module.register_buffer("bf16_weight", module.weight.detach().to(torch.bfloat16), persistent=False)
            bias = None if module.bias is None else module.bias.detach().to(torch.bfloat16)
            module.register_buffer("bf16_bias", bias, persistent=False)
            module.forward = types.MethodType(_forward(switch), module)
            switch.layers.append(module)
    return switch


def use_int8_prefill(model: nn.Module) -> PrefillSwitch:
    """Give every linear layer of the decoder whose weight the model's GGUF file holds as Q4_1 / Q8_0
    blocks (`quantized.gguf_matrices`, the same values bit for bit) the decode step's integer product
    for multi-token inputs: inputs quantized per 32-block to int8, integer dot products with the
    blocks packed 8 rows at a time (`kernels/int8_products.h`), fp32 results. Needs a model loaded
    from a GGUF file on the CPU and the compiled kernel; the switch lists the layers it changed."""
    from h2o_cache.quantized import fastest_activations, gguf_matrices, kernel

    switch = PrefillSwitch()
    path = getattr(model, "gguf_path", None)
    if path is None or kernel() is None:
        return switch
    matrices = gguf_matrices(path, model)
    activations = fastest_activations()
    for module in model.get_decoder().modules():
        matrix = matrices.get(id(module.weight)) if isinstance(module, nn.Linear) else None
        if matrix is not None and module.bias is None:
            module.int8_matrix = matrix
            module.forward = types.MethodType(_int8_forward(switch, activations, module.forward), module)
            switch.layers.append(module)
    return switch


def apply_prefill_dtype(model: nn.Module, name: str) -> PrefillSwitch | None:
    """Give an fp32 model bf16 MLP products in prefill when `name` (`prefill_dtype`) says bf16, or
    integer products in every layer when it says int8; the switch, or None where nothing changed (an
    fp32 prefill, a model already in bf16 or fp16, or int8 without GGUF blocks or the kernel)."""
    if next(model.parameters()).dtype != torch.float32:
        return None
    if name == "int8":
        switch = use_int8_prefill(model)
        return switch if switch.layers else None
    if prefill_dtype(name, model) == torch.bfloat16:
        return use_bf16_prefill(model)
    return None


def _int8_forward(switch: PrefillSwitch, activations: str, otherwise):
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if switch.enabled and x.dim() == 3 and x.shape[1] > 1 and x.dtype == torch.float32:
            return self.int8_matrix.matmul(x.reshape(-1, x.shape[-1]), activations=activations).view(*x.shape[:-1], -1)
        return otherwise(x)
    return forward


def _forward(switch: PrefillSwitch):
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if switch.enabled and x.dim() == 3 and x.shape[1] > 1:
            return F.linear(x.to(torch.bfloat16), self.bf16_weight, self.bf16_bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)
    return forward
