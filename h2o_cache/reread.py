"""Re-reading: the passages a reply will answer from, fed again just before the question.

A fact said once in a long prompt can be brought back into the recall window (`h2o_cache.recall`) and
still not be read: the window is per layer and head and swings with every query, and a small model
reads a phrase recalled into a few heads' windows, at a step chosen by the step before, far worse than
the same phrase said again right before the question (RESULTS.md, "Re-reading"). So, after a turn's
body is fed and before its tail (the probe, where the question usually is):

1. On a copy of the row (`H2OCache.copy`), the tail is fed and the reply's first `recall_reread_look`
   tokens are decoded greedily. Each of those steps chooses its window by its own queries, and the
   reply's opening ("The access code for the north gate is") points at the fact as the question alone
   does not. Each position of the turn's text gains, at each step of the look after its first, the
   number of windows (layers x KV heads) that hold it, less the most that held it when the tail alone
   had chosen or at the look's first step. What every query keeps (the first tokens) cancels, and so
   do the blocks a decode step's choice holds before the reply has said anything: a decode step
   chooses by other means than a prompt's chunk, and the blocks it favours whatever it is asked took
   the excerpt's room from all but the first of several facts one reply names (RESULTS.md, "Re-reading").
2. The positions that gained most, each widened to `SPAN_BEFORE` tokens before and `SPAN_AFTER` after
   it, merged where they touch, up to `recall_reread` tokens, are the excerpt: their tokens in the
   order of the text, a separator (a blank line) before and after each passage.
3. The row itself, which the look left as it was, is then fed the excerpt as part of the body, and then
   the tail: the question follows the passages it is about.

The excerpt is fed like any text (it is scored, evicted and archived as the prompt is) and changes the
tokens the cache has seen: a server keeps it in the row's token ids, so positions still name tokens.
It costs the tail once more, `recall_reread_look` decode steps on the copy and the excerpt's prefill,
and runs only for a turn whose body is longer than the budget (only then was any of it evicted).
"""

from __future__ import annotations

from typing import Sequence

import torch

from h2o_cache.cache import H2OCache

SPAN_BEFORE = 8  # tokens of the text before a chosen position that its passage starts with
SPAN_AFTER = 16  # tokens after it (a fact usually follows the words that point at it: "... is 482913")


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
    """[end - start] int64: per position of the text in [start, end), the windows that hold it over
    steps 2..`look` of a greedy look after `tail`, beyond the most that held it after the tail alone or
    after the look's first step (step 1 of the module's account). Runs on a copy of `row` whose archive
    borrows the row's storage (`Archive.lend`); `cache` is left as it was. decoder: a `StaticDecoder`
    with no rows, to take the look's steps (the fast step) instead of `generator.step`."""
    twin = cache.copy(row, lend=True)
    lent = twin.archives[0]
    try:
        return _look(generator, twin, tail, start, end, look, decoder)
    finally:
        if lent is not None:
            lent.give_back()


def _look(generator, twin: H2OCache, tail: list[int], start: int, end: int, look: int, decoder) -> torch.Tensor:
    """`gains` on the row's copy `twin`."""
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
