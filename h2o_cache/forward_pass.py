"""One forward pass over an `H2OCache`: positions, masks and write slots for a chunk (`begin`), the
chunk's keys and values stored (`store`), and attention with score accumulation (`attend`).

A pass feeds n_new[b] tokens to row b, right-padded to max(n_new). Every layer writes the new tokens
at the same slots, after the row's resident tokens; with position rolling the positions RoPE gives
them are their slots, so a query never sees a key farther than the row's length. A scoring policy
adds each key's softmax weight, summed over the query group of its KV head, to the key's fp32 score
(`eviction.accumulate_scores`); the logits are [B, H_kv, group x C, K], never C x C over the history.

With recall, each layer's queries (before RoPE) also choose that layer's window in the rows of a
prefill chunk before they attend (InfLLM), and the last fed token's queries are kept for the
row's next decode-time choice (`H2OCache.choose_due`). `H2OCache.end` then counts the tokens and
evicts (`H2OCache.advance`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from h2o_cache import recall
from h2o_cache.eviction import accumulate_scores
from h2o_cache.rope import unrotate
from h2o_cache.transfer import as_slice, upload

if TYPE_CHECKING:
    from h2o_cache.cache import H2OCache


@dataclass
class Step:
    """Shared by all layers during one forward pass of a chunk of C (padded) tokens per row."""

    n_new: list[int]
    positions: torch.Tensor  # [B, C] int64, positions RoPE gives the new tokens
    write_slots: torch.Tensor  # [B, C] int64
    uniform_start: int | None  # all rows write at the same slots: plain slice writes
    kv_len: int  # max(lengths) + C: keys visible to this pass
    mask: torch.Tensor | None  # [B, 1, C, kv_len] bool (True = attend); None: attend to all
    hidden: torch.Tensor | None  # ~mask from slot masked_from on (True = not attended), computed once
    masked_from: int  # every query attends to every slot below this (each row's resident slots)
    query_valid: torch.Tensor | None  # [B, C] bool; None: no padding queries
    fed: torch.Tensor | None = None  # [2, rows given tokens]: those rows, and their last token's index (with recall)
    chosen: set[int] | None = None  # rows whose window this pass's chunk was given before it (with recall)
    turns: tuple[torch.Tensor, ...] | None = None  # `unrotation`'s, kept for the pass's other layers
    body: list[bool] | None = None  # per row: its chunk is of a prompt's body (`begin`'s ahead), not its tail


def begin(cache: H2OCache, n_new: list[int], ahead: list[bool] | None = None) -> Step:
    """The pass that feeds n_new[b] tokens to row b; its `positions` ([B, C]) go to the model.

    With recall, before a prefill chunk, rows whose archive gained blocks first widen their window
    (`recall.grow`); with `recall_ahead`, a row whose chunk is of a prompt's body (ahead[b]) then
    takes the window its previous chunk's queries choose (`cache.ahead[b]`), all layers in one
    choice (each layer's heads pooling alone); other chunks choose layer by layer in the pass
    (`attend`). Before a decode pass, rows whose choice is due make it (`choose_due`).
    """
    if len(n_new) != cache.batch_size:
        raise ValueError(f"got new tokens for {len(n_new)} rows, cache has {cache.batch_size}")
    spec = cache.spec
    chunk = max(n_new)
    fed = chosen = None
    if cache.config.recalls:
        fed, chosen = [row for row, n in enumerate(n_new) if n], set()
        # A row given one token decodes, whatever the others are given, so that it evolves as alone.
        for row in fed:
            if n_new[row] > 1:
                recall.grow(cache, row)
                cache.due[row] = 0  # the chunk chooses, with its own queries or its previous chunk's
                if cache.config.recall_ahead:
                    if ahead is not None and ahead[row] and cache.ahead[row] is not None:
                        recall.choose(cache, row, cache.ahead[row], spec.scaling, per_layer=True)
                        chosen.add(row)
                    count = len(range(n_new[row])[choosing(cache, n_new[row], bool(ahead and ahead[row]))])
                    cache.ahead[row] = torch.empty(spec.num_layers, spec.num_heads, count, spec.head_dim,
                                                   device=spec.device)
        cache.choose_due([row for row in fed if n_new[row] == 1])
    device = spec.device
    starts = torch.tensor(cache.lengths, device=device)
    offsets = torch.arange(chunk, device=device)
    write_slots = starts[:, None] + offsets
    kv_len = max(cache.lengths) + chunk
    cache._reserve(cache.batch_size, kv_len)

    uniform = len(set(cache.lengths)) == 1
    if uniform and chunk == 1:
        mask = None
    else:
        key_slots = torch.arange(kv_len, device=device)
        mask = (key_slots <= write_slots[:, :, None])[:, None]
    query_valid = None
    if min(n_new) != chunk:
        query_valid = offsets < torch.tensor(n_new, device=device)[:, None]

    masked_from = min(cache.lengths)  # every row attends to all its resident slots: all rows to those below
    origins = torch.tensor(cache.seen, device=device)[:, None] + offsets  # [B, C]
    positions = write_slots if cache.config.rolling else origins
    # Every layer and head writes the new tokens at the same slots: one write for all of them.
    spread = (spec.num_layers, cache.batch_size, spec.num_kv_heads, chunk)
    cache._origins[:, :cache.batch_size].scatter_(3, write_slots[None, :, None].expand(spread),
                                                  origins[None, :, None].expand(spread))
    return Step(
        n_new=list(n_new), positions=positions, write_slots=write_slots,
        uniform_start=cache.lengths[0] if uniform else None,
        kv_len=kv_len, mask=mask, hidden=None if mask is None else ~mask[..., masked_from:],
        masked_from=masked_from, query_valid=query_valid,
        fed=None if fed is None else upload([fed, [n_new[row] - 1 for row in fed]], device),
        chosen=chosen, body=None if ahead is None else list(ahead),
    )


def store(cache: H2OCache, step: Step, key_states: torch.Tensor, value_states: torch.Tensor, layer: int):
    """Store the chunk's keys/values; return every visible key (rotated) and value.

    key_states, value_states: [B, H_kv, C, D], keys already rotated to `step.positions`.
    Returns [B, H_kv, kv_len, D] each: views of the cache's buffers.
    """
    rows = cache.batch_size
    targets = [(cache._values[layer], value_states)]
    if cache.config.rolling:
        unrotated = unrotate(key_states.float(), *unrotation(cache, step))
        targets += [(cache._keys[layer], unrotated.to(key_states.dtype)), (cache._rotated[layer], key_states)]
    else:
        targets.append((cache._keys[layer], key_states))
    scores = cache._scores[layer] if cache._scores is not None else None
    chunk = key_states.shape[2]
    if step.uniform_start is not None:
        start = step.uniform_start
        for buffer, states in targets:
            buffer[:rows, :, start:start + chunk] = states
        if scores is not None:
            scores[:rows, :, start:start + chunk] = 0
    else:
        index = step.write_slots[:, None, :].expand(-1, key_states.shape[1], -1)
        for buffer, states in targets:
            buffer[:rows].scatter_(2, index[..., None].expand_as(states), states)
        if scores is not None:
            scores[:rows].scatter_(2, index, 0.0)
    keys = (cache._rotated if cache.config.rolling else cache._keys)[layer]
    return keys[:rows, :, :step.kv_len], cache._values[layer][:rows, :, :step.kv_len]


def attend(cache: H2OCache, step: Step, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           scaling: float) -> torch.Tensor:
    """Attention of the chunk's queries; accumulates each key's attention when the policy scores.

    query: [B, H_q, C, D]; keys, values: [B, H_kv, K, D] as `store` returns them (views of the
    buffers, so a recall window filled here is what they attend to).
    Returns [B, C, H_q, D], the layout transformers' attention functions return.
    """
    b, h_q, c, d = query.shape
    h_kv, k = keys.shape[1], keys.shape[2]
    if cache.config.recalls:
        plain = _plain(cache, step, query)
        # Each fed row keeps its last token's queries (rows given no token keep what they had):
        # the next decode pass chooses by them, pooled over every layer.
        rows, last = step.fed
        cache._queries[layer, rows] = plain[rows, :, last].to(cache._queries.dtype)
        _choose(cache, step, layer, plain, scaling)
        if cache.config.ranks:
            keys = recall.rank_rotated(cache, step, layer, keys)
    if not cache.policy.needs_scores:
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=step.mask, scale=scaling, enable_gqa=h_q != h_kv,
        )
        return out.transpose(1, 2)
    group = h_q // h_kv
    # Query heads h_kv*G .. h_kv*G+G-1 share KV head h_kv: fold them into the query axis.
    grouped = query.reshape(b, h_kv, group * c, d).float()
    logits = torch.matmul(grouped, keys.float().transpose(-1, -2)).mul_(scaling)
    logits = logits.view(b, h_kv, group, c, k)
    if step.mask is not None:  # the resident slots every query attends to are left as they are
        logits[..., step.masked_from:].masked_fill_(step.hidden[:, :, None], float("-inf"))
    probs = logits.softmax(dim=-1)
    cache._scores[layer][:b, :, :k] += accumulate_scores(probs, step.query_valid)
    out = torch.matmul(probs.view(b, h_kv, group * c, k).to(values.dtype), values)
    return out.view(b, h_q, c, d).transpose(1, 2)


def choosing(cache: H2OCache, n: int, body: bool) -> slice:
    """Which of a chunk's n queries choose: of a prompt's body (`body`), `recall_queries` of them, evenly
    spaced, ending at the last; of its tail (the question), all of them (a slice: indexing by a host
    list would upload it to a device)."""
    most = cache.config.recall_queries if body else None
    stride = 1 if most is None or n <= most else -(-n // most)
    return slice((n - 1) % stride, n, stride)


def _plain(cache: H2OCache, step: Step, query: torch.Tensor) -> torch.Tensor:
    """query [B, H_q, C, D] rotated to this pass's positions -> before RoPE, fp32."""
    return unrotate(query.float(), *unrotation(cache, step))


def unrotation(cache: H2OCache, step: Step) -> tuple[torch.Tensor, ...]:
    """cos, sin ([B, 1, C, D]) at the pass's positions and cos^2 + sin^2, which `unrotate` divides by:
    gathered once a pass, the same for every layer's keys and queries."""
    if step.turns is None:
        cos, sin = cache.spec.rope.get(step.kv_len)
        cos, sin = cos[step.positions][:, None], sin[step.positions][:, None]
        step.turns = (cos, sin, cos * cos + sin * sin)
    return step.turns


def _choose(cache: H2OCache, step: Step, layer: int, plain: torch.Tensor, scaling: float) -> None:
    """Fill the recall window of `layer` in every prefill row that has one and was not given it
    before the pass with what this chunk's real queries ([B, H_q, C, D] before RoPE, fp32) point
    at; with `recall_ahead`, keep each prefill row's choosing queries of `layer` (`cache.ahead`)."""
    asked = []
    for row, n in enumerate(step.n_new):
        chooses = cache.recalled[row] and row not in step.chosen
        if n > 1 and (chooses or cache.ahead[row] is not None):
            which = choosing(cache, n, bool(step.body and step.body[row]))
            if cache.ahead[row] is not None:
                cache.ahead[row][layer] = plain[row, :, which]
            if chooses:
                asked.append((row, which))
    if not asked:
        return
    # the choices run on the host: one download of the choosing rows' queries, and their windows
    # written together (`recall.choose_rows`)
    rows = [row for row, _ in asked]
    at = as_slice(rows)
    host = (plain[at] if at else plain.index_select(0, upload(rows, plain.device))).cpu()
    recall.choose_rows(cache, [(row, host[i:i + 1, :, which]) for i, (row, which) in enumerate(asked)],
                       scaling, slice(layer, layer + 1))
