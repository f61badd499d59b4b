"""Re-reading: the passages a reply will answer from, fed again right after the question.

A fact said once in a long prompt can be brought back into the recall window (`h2o_cache.recall`) and
still not be read: the window is per layer and head and swings with every query, and a small model
reads a phrase recalled into a few heads' windows, at a step chosen by the step before, far worse than
the same phrase said again next to the question (RESULTS.md, "Re-reading"). So, after a turn's body is
fed and before its tail (the probe, where the question usually is):

1. A look: the tail is fed and the reply's first `recall_reread_look` tokens are decoded greedily on
   a transient 1-row cache that holds every token of the row, up to `recall_reread_dense` of the
   newest (its own slots and its archive, in the order of the text, each at its place: `dense_row`),
   and evicts nothing. The reply's opening ("The access code for the north gate is") points at the
   fact as the question alone does not, and the look attends to the fact itself, not to what a
   128-token window holds of it. Each position that the row holds only in its archive (for a layer
   and KV head) gains, at each step of the look after its first, the attention it draws there beyond
   twice what it drew at the look's first step, summed over layers and heads; positions below a
   fifth of the best gain are dropped. What every step attends to (the first tokens, the question)
   cancels or is resident anyway. With `recall_reread_dense` 0 the look runs on a copy of the row
   itself (`H2OCache.copy`), each step choosing its window by its own queries, and a position gains
   the windows that hold it beyond the most that held it after the tail alone or at the first step.
2. The positions that gained most, each widened to `SPAN_BEFORE` tokens before and `SPAN_AFTER` after
   it, merged where they touch, up to `recall_reread` tokens, each then run on to the end of its
   sentence or line and back to its start within `SNAP` tokens, are the excerpt: their tokens in the order of the text, a
   separator (a blank line) before and after each passage.
3. The row itself, which the look left as it was, is then fed the tail with the excerpt inside it
   (`Generator.prefill`): after the question and before the chat template's end of the user's turn
   where the tail ends with it, else before the tail. Measured (RESULTS.md, "A look that reads every
   token"): before the question, a document that ends in a list of headline questions led the reply
   away from the fact the excerpt held ("I'm here to help you with your questions").

The excerpt is fed like any text (it is scored, evicted and archived as the prompt is) and changes the
tokens the cache has seen: a server keeps it in the row's token ids, so positions still name tokens.
It costs the tail once more, `recall_reread_look` decode steps over up to `recall_reread_dense`
tokens, and the excerpt's prefill, and runs only for a turn whose body is longer than the budget
(only then was any of it evicted).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import torch

from h2o_cache.cache import H2OCache
from h2o_cache.config import CacheConfig
from h2o_cache.rope import rotate_into

SPAN_BEFORE = 8  # tokens of the text before a chosen position that its passage starts with
SPAN_AFTER = 16  # tokens after it (a fact usually follows the words that point at it: "... is 482913")
# A dense look's position gains from the attention a step gives it beyond FIRST_TIMES the first
# step's, and keeps the positions of at least KEEP_SHARE of the best gain: the first token draws much
# of every step's attention and its swings from step to step are below twice its first step's, and
# the passages of a fifth of the best are still about the fact (RESULTS.md, "A look that reads every token").
FIRST_TIMES = 2.0
KEEP_SHARE = 0.2
# Tokens a passage may run on past its end to finish its sentence or line, and reach back before its
# start to begin one: one cut inside a number ("The pass key is 60494. Remember it. 6049") put the cut
# number last before the answer, which the reply then took (a pass key at depth 25% of a 4k prompt: 3 of
# 10, RESULTS.md "A look that reads every token"); one begun after the words that name what it tells
# (" Leeds is to drink hot chocolate", without "The best thing to do in") was read less often
SNAP = 16
STOPS = (".", "!", "?", "\n")


def due(cache: H2OCache, body: int) -> bool:
    """Whether a turn whose body (the prompt before its tail) is `body` tokens is re-read: with recall
    and re-reading on, when the body alone overflows the budget."""
    config = cache.config
    return config.recalls and config.recall_reread > 0 and body > config.budget


def held_counts(cache: H2OCache, start: int, end: int) -> torch.Tensor:
    """[end - start] int64: how many windows (layers x KV heads) of row 0 hold each position in [start, end)."""
    r = cache.recalled[0]
    origins = cache.buffers().origins[:, 0, :, :r].reshape(-1).cpu()
    inside = origins[(origins >= start) & (origins < end)] - start
    return torch.bincount(inside, minlength=end - start)


def gains(generator, cache: H2OCache, row: int, tail: list[int], start: int, end: int, look: int,
          decoder=None) -> torch.Tensor:
    """[end - start]: per position of the text in [start, end), what the look gains it (step 1 of the
    module's account): the dense look's attention where `recall_reread_dense` allows one (fp64), else the
    windows of a look on a copy of `row` whose archive borrows the row's storage (`Archive.lend`; int64).
    `cache` is left as it was. decoder: a `StaticDecoder` with no rows, to take the windowed look's
    steps (the fast step) instead of `generator.step`; a dense look takes its steps on a decoder of its
    own that reads the same packed matrices (`StaticDecoder(share=...)`)."""
    room = len(tail) + look + 1
    limit = min(cache.config.recall_reread_dense, _positions(generator)) - room
    if cache.config.recall_reread_dense > 0 and limit > 0:
        return _dense_look(generator, cache, row, tail, start, end, look, limit, decoder)
    twin = cache.copy(row, lend=True)
    lent = twin.archives[0]
    try:
        return _look(generator, twin, tail, start, end, look, decoder)
    finally:
        if lent is not None:
            lent.give_back()


def _positions(generator) -> int:
    """The positions the model was trained on (no bound where its config names none)."""
    return getattr(generator.model.config, "max_position_embeddings", None) or (1 << 62)


def dense_config(config: CacheConfig, budget: int) -> CacheConfig:
    """A `dense_row`'s config: `config`'s policy and rolling at `budget` tokens, no recall."""
    return replace(config, budget=budget, recall_budget=0, evict_slack=None)


def dense_size(cache: H2OCache, row: int, limit: int) -> int:
    """How many tokens per layer and KV head `dense_row(cache, row, limit, ...)` holds: row `row`'s own
    slots and its archive, at most `limit`."""
    archive = cache.archives[row]
    return min(limit, cache.lengths[row] - cache.recalled[row] + (len(archive) if archive is not None else 0))


@torch.no_grad()
def dense_row(cache: H2OCache, row: int, limit: int, room: int,
              into: H2OCache | None = None) -> tuple[H2OCache, torch.Tensor, torch.Tensor]:
    """Row `row`'s newest `limit` tokens per layer and KV head, its own slots and its archive (not the
    window's copies of archived ones), as a 1-row cache of the same model that evicts nothing before
    `room` more tokens: in the order of the text, token i at slot and position i (the cache's own
    rolling, so a prompt shorter than the model's positions is read where it stood). Returns the
    cache, the origins [L, H_kv, n] of its slots and which of them the row holds only in its archive
    (bool, the same shape). It takes n + room tokens of the cache's layout, for as long as it is held.
    into: an empty cache of that size (`dense_config` at `dense_size` + `room` tokens: a `StaticDecoder`'s,
    whose steps are then the look's) that becomes the row, so the row is not built once more to be
    copied there; else a new one."""
    buffers = cache.buffers()
    r, n = cache.recalled[row], cache.lengths[row]
    archive = cache.archives[row]
    m = len(archive) if archive is not None else 0
    stored = archive.storage() if m else None
    newest = dense_size(cache, row, limit)
    if into is None:
        into = H2OCache(cache.spec, dense_config(cache.config, newest + room))
        into.reserve(1, newest + room)
    elif into.batch_size or into.config.recalls or into.config.budget < newest + room:
        raise ValueError(f"a dense row of {newest} + {room} tokens needs an empty cache of that budget without recall")
    into.add_rows(1)
    dense = into.buffers()
    device = buffers.keys.device
    layers, heads = buffers.origins.shape[0], buffers.origins.shape[2]
    origins = torch.empty(layers, heads, newest, dtype=torch.int64, device=device)
    archived = torch.empty(origins.shape, dtype=torch.bool, device=device)
    for layer in range(layers):  # a layer at a time: what is copied on the way is one layer's
        keys, values = buffers.keys[layer, row, :, r:n], buffers.values[layer, row, :, r:n]
        held = buffers.origins[layer, row, :, r:n]
        if m:
            keys = torch.cat([keys, stored["keys"][layer, :, :m].to(device, keys.dtype)], 1)
            values = torch.cat([values, stored["values"][layer, :, :m].to(device, values.dtype)], 1)
            held = torch.cat([held, stored["origins"][layer, :, :m].to(device)], 1)
        order = held.topk(newest, dim=-1).indices.flip(-1)  # the newest, oldest first
        origins[layer] = held.gather(1, order)
        archived[layer] = order >= n - r
        at = order[..., None].expand(*order.shape, keys.shape[-1])
        torch.gather(keys, 1, at, out=dense.keys[layer, 0, :, :newest])
        torch.gather(values, 1, at, out=dense.values[layer, 0, :, :newest])
    dense.origins[:, 0, :, :newest] = origins
    dense.scores[:, 0].zero_()
    cos, sin = cache.spec.rope.get(newest)
    rotate_into(dense.rotated[:, 0, :, :newest], dense.keys[:, 0, :, :newest], cos, sin)
    into.lengths, into.seen = [newest], [cache.seen[row]]
    return into, origins, archived


def _dense_look(generator, cache: H2OCache, row: int, tail: list[int], start: int, end: int, look: int,
                limit: int, decoder=None) -> torch.Tensor:
    """`gains` by the attention of a look on `dense_row` (step 1 of the module's account), fp64. decoder:
    a `StaticDecoder` whose packed matrices the look's fast steps read (else `generator.step`)."""
    room = len(tail) + look + 1
    fast = None
    if decoder is not None:  # the steps on the fast path: ~5x faster than the transformers path's at 4k
        from h2o_cache.quantized import EXACT
        from h2o_cache.static import StaticDecoder

        exact = decoder.native is not None and decoder.native.activations == EXACT
        config = dense_config(cache.config, dense_size(cache, row, limit) + room)
        # one look of a size of its own: no CUDA graph worth capturing
        fast = StaticDecoder(generator.model, config, 1, cuda_graphs=False, exact=exact, share=decoder)
    dense, origins, archived = dense_row(cache, row, limit, room, None if fast is None else fast.cache)
    n = origins.shape[2]
    logits = generator._prefill(dense, [tail])[0]
    if fast is not None:
        def step(token: int) -> torch.Tensor:
            dense.pending[0] = [token]
            return fast.step()[0]
    else:
        def step(token: int) -> torch.Tensor:
            return generator.step(dense, [[token]])[0]
    before = dense.buffers().scores[:, 0, :, :n].clone()  # [L, H_kv, n] fp32: attention summed so far
    first = total = None
    for _ in range(look):
        token = int(logits.argmax())
        if token in generator.eos_token_ids:
            break
        logits = step(token)
        now = dense.buffers().scores[:, 0, :, :n].clone()
        drawn, before = now - before, now  # this step's attention, per slot and head
        if first is None:
            first, total = drawn, torch.zeros_like(drawn)
        else:
            total += (drawn - FIRST_TIMES * first).clamp_(min=0)
    out = torch.zeros(end - start, dtype=torch.float64)
    if total is None:
        return out
    inside = archived & (origins >= start) & (origins < end)
    out.index_add_(0, (origins[inside] - start).cpu(), total[inside].double().cpu())
    out[out < KEEP_SHARE * out.max()] = 0
    return out


def _look(generator, twin: H2OCache, tail: list[int], start: int, end: int, look: int, decoder) -> torch.Tensor:
    """`gains` through the windows of the row's copy `twin`."""
    logits = generator._prefill(twin, [tail])[0]
    base = held_counts(twin, start, end)
    total = torch.zeros_like(base)
    if decoder is not None:
        if decoder.cache.batch_size:
            raise ValueError("the look's decoder must hold no rows")
        decoder.cache.extend(twin, move=True)
        twin = decoder.cache
    try:
        for step in range(look):
            token = int(logits.argmax())
            if token in generator.eos_token_ids:
                break
            if decoder is None:
                logits = generator.step(twin, [[token]])[0]
            else:
                twin.pending[0] = [token]
                logits = decoder.step()[0]
            held = held_counts(twin, start, end)
            if step == 0:  # what a decode step's choice holds before the reply has said anything
                base = torch.maximum(base, held)
            else:
                total += (held - base).clamp_(min=0)
    finally:
        if decoder is not None:
            decoder.cache.pop(0)
    return total


def passages(score: torch.Tensor, limit: int, before: int = SPAN_BEFORE, after: int = SPAN_AFTER) -> list[tuple[int, int]]:
    """Spans [a, b) of indices into `score`, ascending and disjoint: the indices of highest score (> 0)
    in turn, each widened to `before` before and `after` after it and merged with the spans it touches,
    until they cover `limit` indices or no index scores (step 2)."""
    spans: list[tuple[int, int]] = []
    n = score.numel()
    order = torch.argsort(score, descending=True, stable=True).tolist()
    values = score.tolist()
    for at in order:
        if values[at] <= 0 or sum(b - a for a, b in spans) >= limit:
            break
        if any(a <= at < b for a, b in spans):
            continue
        spans.append((max(0, at - before), min(n, at + after + 1)))
        spans.sort()
        merged: list[tuple[int, int]] = []
        for a, b in spans:
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        spans = merged
    return spans


def finished(spans: list[tuple[int, int]], text: Sequence[int], ends: Callable[[int], bool],
             most: int = SNAP, back: int = 0) -> list[tuple[int, int]]:
    """`spans` ([a, b) into `text`, ascending, disjoint), each run on to just past the first of its next
    `most` tokens that `ends` (a sentence or a line), where one does, and started just after the last of
    its `back` tokens before it that does (or at the text's start, where that is within reach); merged
    where they then touch."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        for at in range(b - 1, min(len(text), b - 1 + most + 1)):
            if ends(text[at]):
                b = at + 1
                break
        for at in range(a - 1, a - 2 - back, -1):
            if at < 0 or ends(text[at]):
                a = at + 1
                break
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def excerpt(generator, cache: H2OCache, row: int, text: Sequence[int], start: int, tail: list[int],
            separator: list[int], decoder=None) -> list[int]:
    """The tokens to feed row `row` before `tail` (steps 1 and 2): `text[i]` is the token at position
    start + i of the row, up to the position the tail starts at (the row's `seen`); [] where no
    position gained. The row is left as it was; decoder: as `gains`."""
    config = cache.config
    end = cache.seen[row]
    if end - start != len(text):
        raise ValueError(f"the text covers {len(text)} positions, the row's turn {end - start}")
    score = gains(generator, cache, row, tail, start, end, config.recall_reread_look, decoder)
    spans = passages(score, config.recall_reread)
    if not spans:
        return []
    spans = finished(spans, text, generator.sentence_ends().__contains__, SNAP, SNAP)
    out = list(separator)
    for a, b in spans:
        out += list(text[a:b]) + list(separator)
    return out


def looker(model, config, share=None, exact: bool = False):
    """A `StaticDecoder` of one row for the looks of caches of `config` (the fast step: the server's), or
    None where they do not re-read or the model takes no fast step. share: a decoder of the same model
    whose packed matrices it reads too; exact: as `StaticDecoder`'s."""
    from h2o_cache.hf import UnsupportedModelError
    from h2o_cache.static import StaticDecoder

    if not (config.recalls and config.recall_reread and config.rolling):
        return None
    try:
        return StaticDecoder(model, config, 1, exact=exact, share=share)
    except (ValueError, UnsupportedModelError):
        return None
