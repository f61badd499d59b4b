"""A plain Llama decode step over an `H2OCache`'s buffers: one token per row, fixed shapes, no sync.

This is the fast path's model code. It computes what the transformers model computes through
`hf.forward` for a one-token pass (same RMSNorm, RoPE, GQA and MLP math, the same fp32 softmax and
per-KV-head score accumulation as `H2OCache.attend`), but over preallocated buffers, with every
per-step input a device tensor, so one call can be captured in a CUDA graph or compiled:
- the new key, value and rotated key are scattered into slot `slots[b]` of row b;
- attention runs over all `capacity` slots, with slots past `slots[b]` masked, so the cost per step
  is the same whatever the rows hold;
- nothing here reads a tensor back to the host or allocates beyond the step's own temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from h2o_cache.quantized import QuantizedMatrix
from h2o_cache.recall import held_ranks

Matrix = torch.Tensor | QuantizedMatrix


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer, with q/k/v and gate/up fused so a decode step runs 4 matmuls per layer.

    Matrices are [out, in] like nn.Linear's, dense or GGUF blocks; see `linear` for how they are applied.
    qkv: [(H_q + 2 H_kv) * D, hidden]; o: [hidden, H_q * D]; gate_up: [2 I, hidden]; down: [hidden, I].
    Biases are None for models without them.
    """

    input_norm: torch.Tensor
    qkv: Matrix
    qkv_bias: torch.Tensor | None
    o: Matrix
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: Matrix
    gate_up_bias: torch.Tensor | None
    down: Matrix
    down_bias: torch.Tensor | None


@dataclass(frozen=True)
class DecoderWeights:
    """The tensors of a Llama-family causal LM, shared with the model but for the fused q/k/v and gate/up."""

    embed: torch.Tensor  # [V, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: Matrix  # [V, hidden]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float  # softmax scale of q.k
    eps: float  # RMSNorm epsilon
    act: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class CacheBuffers:
    """Views of an `H2OCache`'s buffers, [L, rows, H_kv, capacity, D] ([.., capacity] for scores).

    keys: before RoPE when rolling, else rotated to their absolute positions; rotated: None unless
    rolling; scores: None unless the policy scores; origins: int64, each slot's token index in its
    row's sequence; pinned: bool, recalled tokens (None without recall; the step reads it only with ranks).
    """

    keys: torch.Tensor
    values: torch.Tensor
    rotated: torch.Tensor | None
    scores: torch.Tensor | None
    origins: torch.Tensor
    pinned: torch.Tensor | None = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalize in fp32, scale in the input dtype (one fused op in fp32)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def linear(x: torch.Tensor, weight: Matrix, bias: torch.Tensor | None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + x @ weight.T + bias: x [B, in] -> [B, out], computed as (weight [out, in] @ x.T).T.

    A `QuantizedMatrix` runs its own kernel (row-major [B, out] out).

    With few rows, MKL runs this "tall" product 1.4x faster than x @ weight.T (all 30 layers of
    SmolLM2 at batch 8: 62 vs 86 ms on 2 cores). The result is a transposed view, so activations
    stay feature-major from layer to layer and x.T is contiguous at the next product. The residual
    is added by the product itself (beta = 1).
    """
    if isinstance(weight, QuantizedMatrix):
        out = weight.matmul(x, residual)
    elif residual is None:
        out = torch.mm(weight, x.t()).t()
    else:
        out = torch.addmm(residual.t(), weight, x.t()).t()
    return out if bias is None else out + bias


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it, x * cos + rotate_half(x) * sin, in three ops.

    signed_sin is sin with its first half negated, so rotate_half(x) * sin == x.roll(D/2) * signed_sin.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def attention_logits(q: torch.Tensor, keys_t: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """mask + scaling * q @ keys_t in fp32: q [N, G, D] and keys_t [N, D, K] in the model's dtype.

    On CUDA, bf16 / fp16 operands are multiplied as they are, accumulating and returning fp32: the
    products of bf16 values are exact in fp32, so this is the fp32 product up to summation order,
    without an fp32 copy of every row's key slab per layer and step (3x the attention's reads). The
    CPU has no such kernel; there the model is fp32 and `float()` copies nothing.
    """
    if q.dtype != torch.float32 and q.device.type == "cuda":
        return torch.bmm(q, keys_t, out_dtype=torch.float32).mul_(scaling).add_(mask)
    return torch.baddbmm(mask, q.float(), keys_t.float(), alpha=scaling)


def rope_table(cos_table: torch.Tensor, sin_table: torch.Tensor) -> torch.Tensor:
    """[P, 2D]: each position's cos, then its sin with the first half negated (`rotate`'s signed_sin),
    so that one gather reads both."""
    d = cos_table.shape[-1]
    return torch.cat((cos_table, -sin_table[:, :d // 2], sin_table[:, d // 2:]), dim=-1)


def ranked_keys(fed: torch.Tensor, ranks: torch.Tensor, table: torch.Tensor,
                window: torch.Tensor | None = None) -> torch.Tensor:
    """fed [B, H_kv, capacity, D] (keys before RoPE) rotated to `ranks` [B, H_kv, capacity] (their
    `recall.held_ranks` among the visible slots of their row; slots past them rank after every held one
    and are masked anyway), by `rope_table`'s rows. window: None, or [B, H_kv, capacity] bool, the
    recall window's slots, whose keys an fp32 cache holds in fp16 at whatever position they are read
    (`recall.stored`): rounded so after their rotation. Fixed shapes, no host reads."""
    d = fed.shape[-1]
    rope = table[ranks]  # [B, H_kv, capacity, 2D]
    out = rotate(fed.float(), rope[..., :d], rope[..., d:])
    if window is not None and fed.dtype == torch.float32:
        out = torch.where(window[..., None], out.half().float(), out)
    return out


@torch.no_grad()
def decode_step(
    w: DecoderWeights,
    cache: CacheBuffers,
    tokens: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    origins: torch.Tensor,
    rope: torch.Tensor,
    queries: torch.Tensor | None = None,
    ranked: torch.Tensor | None = None,
) -> torch.Tensor:
    """Feed tokens[b] to row b at slot slots[b], RoPE position positions[b]; rows are 0..B-1.

    tokens, slots, positions, origins: [B] int64 on the model's device; origins[b] is the token's
    index in row b's sequence. rope: [P, 2D] fp32, `rope_table` of the model's RoPE tables (built once
    by the caller: the step reads each position's cos and signed sin in one gather). queries: None, or [L, >= B, H_q, D]
    where each layer's queries before RoPE are left (what chooses a recall window, `h2o_cache.recall`).
    ranked: None, or [B] int64 on the device: where nonzero, every held key of row b is read at its rank
    in the order of the text among the row's held tokens (`recall_positions` "rank", `H2OCache.ranked`,
    `recall.held_ranks`), rotated from the keys as fed (rolling only; a row without a recall window
    reads its slots, as before, and positions[b] must be slots[b]); the other rows read `rotated`.
    Returns fp32 logits [B, V]. Writes each row's new key/value and origin (and zeroes its score) at
    its slot, and adds each key's softmax weight, summed over the KV head's query group, to its score.
    """
    b = tokens.shape[0]
    h_q, h_kv, d = w.num_heads, w.num_kv_heads, w.head_dim
    group = h_q // h_kv
    capacity = cache.keys.shape[3]
    dtype = w.embed.dtype
    x = F.embedding(tokens, w.embed)  # [B, hidden]
    at = rope[positions].to(dtype)[:, None]  # [B, 1, 2D]: the sign flips before the rounding, which it commutes with
    cos, signed_sin = at[..., :d], at[..., d:]
    # Additive mask, the same for every layer and head: slots past the new token are -inf. [B*H_kv, 1, capacity]
    visible = torch.arange(capacity, device=tokens.device) <= slots[:, None]
    mask = torch.zeros(visible.shape, device=tokens.device).masked_fill_(~visible, float("-inf"))
    mask = mask[:, None, None].expand(b, h_kv, 1, capacity).reshape(b * h_kv, 1, capacity)
    write = slots[:, None, None, None].expand(b, h_kv, 1, d)
    spread = (len(w.layers), b, h_kv, 1)  # the same slot in every layer and head: one write
    cache.origins[:, :b].scatter_(3, slots[None, :, None, None].expand(spread),
                                  origins[None, :, None, None].expand(spread))
    if ranked is not None and cache.rotated is not None:
        # Every layer's ranks in one sort (the origins change only at the new tokens' slots, written
        # above): a CUDA graph's step is launch-bound at small batches, and a sort, the tables and the
        # flag per layer were ~18 kernels of each layer's ~35.
        unseen = torch.iinfo(cache.origins.dtype).max  # slots past a row's new token rank after its held ones
        ranks = held_ranks(cache.origins[:, :b].masked_fill(~visible[None, :, None], unseen))  # [L, B, H_kv, capacity]
        reads_ranks = (ranked != 0)[:, None, None, None]
    for layer, lw in enumerate(w.layers):
        qkv = linear(rms_norm(x, lw.input_norm, w.eps), lw.qkv, lw.qkv_bias)
        if queries is not None:
            queries[layer, :b] = qkv[:, :h_q * d].view(b, h_q, d)
        qk = rotate(qkv[:, :(h_q + h_kv) * d].view(b, h_q + h_kv, d), cos, signed_sin)  # one RoPE for q and k
        k = qkv[:, h_q * d:(h_q + h_kv) * d].view(b, h_kv, d)
        v = qkv[:, (h_q + h_kv) * d:].view(b, h_kv, d)
        keys, values = cache.keys[layer, :b], cache.values[layer, :b]  # [B, H_kv, capacity, D]
        if cache.rotated is not None:
            keys.scatter_(2, write, k[:, :, None])
            fed, keys = keys, cache.rotated[layer, :b]
        keys.scatter_(2, write, qk[:, h_q:, None])
        values.scatter_(2, write, v[:, :, None])
        if ranked is not None and cache.rotated is not None:
            window = None if cache.pinned is None else cache.pinned[layer, :b]
            keys = torch.where(reads_ranks, ranked_keys(fed, ranks[layer], rope, window).to(keys.dtype), keys)

        # fp32 attention of the group's query heads over every slot: [B*H_kv, G, capacity]
        q = qk[:, :h_q].reshape(b * h_kv, group, d)
        keys_t = keys.reshape(b * h_kv, capacity, d).transpose(1, 2)
        probs = attention_logits(q, keys_t, mask, w.scaling).softmax(dim=-1)
        if cache.scores is not None:
            scores = cache.scores[layer, :b]  # [B, H_kv, capacity]
            scores.scatter_(2, write[..., 0], 0.0)
            scores.add_(probs.view(b, h_kv, group, capacity).sum(dim=2))
        out = torch.bmm(probs.to(dtype), values.reshape(b * h_kv, capacity, d)).view(b, h_q * d)
        x = linear(out, lw.o, lw.o_bias, residual=x)

        gate, up = linear(rms_norm(x, lw.post_norm, w.eps), lw.gate_up, lw.gate_up_bias).chunk(2, dim=-1)
        x = linear(w.act(gate) * up, lw.down, lw.down_bias, residual=x)
    return linear(rms_norm(x, w.norm, w.eps), w.lm_head, None).float()
