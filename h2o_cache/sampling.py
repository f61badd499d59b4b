"""Per-sequence sampling: greedy, temperature, top-k, top-p, min-p, seed, penalties, logit bias and logprobs."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import torch

from h2o_cache.transfer import upload


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its next tokens. temperature 0 means greedy."""

    max_new_tokens: int = 256
    min_new_tokens: int = 0  # no end token (EOS, stop_token_ids) sampled before this many tokens
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # CTRL's: a seen token's logit divided by it (multiplied when negative)
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest (when sampling)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, amount added to its logit)
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's plus the top k

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens = {self.max_new_tokens}], "
                             f"got {self.min_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


@dataclass
class Sample:
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


class Sampler:
    """Sampling state of one sequence: its random stream and the token counts its penalties need.

    The random stream is a counter-based hash of (seed, draws so far), so a row draws the same
    numbers whatever batch it is sampled in, and sampling needs no device generator (none can live
    in a CUDA graph or follow a row from batch to batch).

    prompt: the tokens the sequence was given, which `repetition_penalty` counts as seen (as
    transformers and vLLM do); kept only when that penalty is on.
    ends: the model's end tokens (EOS), which with `stop_token_ids` are held back (their logits -inf)
    until `min_new_tokens` tokens have been sampled (vLLM's min_tokens); `sampled` counts them.
    history: with a penalty on, [2, V] int32 on the logits' device (allocated at the first sample):
    row 0 counts each token sampled so far, row 1 marks the prompt's tokens. It stays on the device,
    so a step's penalties cost the same however long the reply is.
    """

    def __init__(self, params: SamplingParams, prompt: Iterable[int] = (), ends: Iterable[int] = ()):
        self.params = params
        self.sampled = 0
        self.held_back = tuple(sorted({*ends, *params.stop_token_ids})) if params.min_new_tokens else ()
        self.seed = (params.seed if params.seed is not None else secrets.randbits(63)) & _MASK64
        self.draws = 0
        self.penalized = bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1)
        self.prompt: set[int] = set(prompt) if params.repetition_penalty != 1 else set()
        self.history: torch.Tensor | None = None
        p = params
        self.fields = (p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty,
                       p.repetition_penalty, -1 if p.logprobs is None else p.logprobs, 0.0)  # its row of the table

    def __call__(self, logits: torch.Tensor) -> Sample:
        """logits: [V] fp32 for this sequence's next token."""
        return sample(logits[None], [self])[0]

    def _allocate_history(self, vocab: int, device: torch.device) -> None:
        self.history = torch.zeros(2, vocab, dtype=torch.int32, device=device)
        if self.prompt:
            self.history[1].index_fill_(0, upload(sorted(self.prompt), device), 1)


_MASK64 = (1 << 64) - 1
# Columns of the table of per-row fields a step uploads once (`Sampler.fields`, the row's uniform last).
_TEMPERATURE, _TOP_P, _TOP_K, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION, _LOGPROBS, _UNIFORM = range(9)


def uniforms(samplers: list[Sampler]) -> np.ndarray:
    """Each sampler's next number in [0, 1) of its own stream, splitmix64 of (seed, draws so far),
    for all of them at once (uint64 arithmetic wraps as the hash wants)."""
    for s in samplers:
        s.draws += 1
    z = np.array([s.seed for s in samplers], dtype=np.uint64) + \
        np.array([s.draws for s in samplers], dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return ((z ^ (z >> np.uint64(31))) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@torch.no_grad()
def sample(logits: torch.Tensor, samplers: list[Sampler]) -> list[Sample]:
    """Next token of every row in one set of batched ops and one device-to-host copy.

    logits: [B, V] (any float dtype, any device); row b follows samplers[b]. Penalties apply to the
    logits before everything else; logprobs are of the penalized logits, before temperature.
    The host's work per row is reading its fields, drawing its uniform and making its `Sample`;
    which features the batch needs is read off the table of fields, and the rows' token histories
    stay on the device.
    """
    logits = logits.float()
    device, vocab = logits.device, logits.shape[-1]
    host = torch.tensor([s.fields for s in samplers], dtype=torch.float64)  # [B, 9]
    drawing = bool(host[:, _TEMPERATURE].gt(0).any())
    if drawing:  # every row draws, so that a row's stream does not depend on its batch
        host[:, _UNIFORM] = torch.from_numpy(uniforms(samplers))
    table = upload(host, device, torch.float64)
    penalized = [s for s in samplers if s.penalized]
    history = None
    if penalized:
        for s in penalized:
            if s.history is None:
                s._allocate_history(vocab, device)
        blank = torch.zeros(2, vocab, dtype=torch.int32, device=device)
        history = torch.stack([s.history if s.penalized else blank for s in samplers])  # [B, 2, V]
        logits = _penalized(logits, history, table)
    logits = _biased(logits, samplers)
    for s in samplers:
        s.sampled += 1
    tokens = logits.argmax(dim=-1)
    if drawing:
        tokens = torch.where(table[:, _TEMPERATURE] > 0, _draw(logits, host, table), tokens)
    if history is not None:
        generated = history[:, 0]
        generated.scatter_add_(1, tokens[:, None], torch.ones_like(generated[:, :1]))
        torch._foreach_copy_([s.history for s in penalized],
                             [row for row, s in zip(history.unbind(0), samplers) if s.penalized])
    k = min(int(host[:, _LOGPROBS].max()), vocab)
    if k < 0:  # no row asked for logprobs
        return [Sample(t) for t in tokens.cpu().tolist()]
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])
    top_values, top_ids = logprobs.topk(k, dim=-1)
    # one download: token ids (exact in float64), the chosen logprob, the top ids and their logprobs
    packed = torch.cat([tokens[:, None].double(), chosen.double(), top_ids.double(), top_values.double()], dim=1)
    out = []
    for s, row in zip(samplers, packed.cpu().tolist()):
        token, wanted = int(row[0]), s.params.logprobs
        if wanted is None:
            out.append(Sample(token))
        else:
            top = [(int(i), v) for i, v in zip(row[2:2 + wanted], row[2 + k:2 + k + wanted])]
            out.append(Sample(token, row[1], top))
    return out


def _penalized(logits: torch.Tensor, history: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """CTRL's repetition penalty over every token a row has seen (prompt or reply): its logit divided
    by the row's penalty if positive, multiplied if not; then OpenAI's presence and frequency
    penalties over the reply's tokens: presence + frequency x count subtracted.
    history: [B, 2, V] int32 (`Sampler.history`); table: the step's [B, 8] float64 fields."""
    generated = history[:, 0]
    repetition = table[:, _REPETITION:_REPETITION + 1].float()
    seen = (generated + history[:, 1] > 0) & (repetition != 1)
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    amount = table[:, _PRESENCE:_PRESENCE + 1] * (generated > 0) + table[:, _FREQUENCY:_FREQUENCY + 1] * generated
    return logits - amount.float()  # the amount in float64 then rounded once, as a host-computed one would be


def _biased(logits: torch.Tensor, samplers: list[Sampler]) -> torch.Tensor:
    """The rows' logit_bias added, and -inf at the end tokens a row holds back (`min_new_tokens`)."""
    rows, ids, amounts = [], [], []
    for row, s in enumerate(samplers):
        for token, amount in s.params.logit_bias:
            rows.append(row)
            ids.append(token)
            amounts.append(amount)
        if s.sampled < s.params.min_new_tokens:
            rows += [row] * len(s.held_back)
            ids += s.held_back
            amounts += [float("-inf")] * len(s.held_back)
    if not rows:
        return logits
    index = upload([rows, ids], logits.device)
    return logits.index_put((index[0], index[1]), upload(amounts, logits.device, torch.float32), accumulate=True)


def _draw(logits: torch.Tensor, host: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Sample [B] token ids by inverse CDF with each row's own uniform; top-k then top-p as before.
    host, table: the step's fields on the host (which features any row uses) and on the device."""
    vocab = logits.shape[-1]
    temperature = table[:, _TEMPERATURE:_TEMPERATURE + 1].float()
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)  # greedy rows: drawn but not taken
    if host[:, _MIN_P].gt(0).any():
        # log p(token) < log(min_p) + log p(best)  <=>  scaled < log(min_p) + max(scaled)
        floor = table[:, _MIN_P:_MIN_P + 1].float().log() + scaled.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    top_p_on = host[:, _TOP_P].lt(1).any()
    if top_p_on or host[:, _TOP_K].gt(0).any():
        ranked, order = scaled.sort(dim=-1, descending=True)
        top_k = table[:, _TOP_K:_TOP_K + 1].long()
        kth = ranked.gather(1, torch.where(top_k > 0, top_k, vocab).clamp_(max=vocab) - 1)  # top_k 0: all
        ranked = ranked.masked_fill(ranked < kth, float("-inf"))
        if top_p_on:
            probs = ranked.softmax(dim=-1)
            # Drop a token once the mass before it already reaches top_p; the best token always stays.
            top_p = table[:, _TOP_P:_TOP_P + 1].float()
            drop = (probs.cumsum(dim=-1) - probs >= top_p) & (top_p < 1)
            ranked = ranked.masked_fill(drop, float("-inf"))
        scaled = scaled.scatter(1, order, ranked)
    probs = scaled.softmax(dim=-1)
    return inverse_cdf(probs, probs.cumsum(dim=-1), table[:, _UNIFORM:_UNIFORM + 1].float())


def inverse_cdf(probs: torch.Tensor, cdf: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token of each row whose CDF interval holds uniform x total mass: [B] int64.

    probs, cdf: [B, V] fp32, cdf the cumsum of probs; uniform: [B, 1] in [0, 1).
    CUDA's fp32 cumsum is not guaranteed monotonic (its parallel scan sums prefixes in different
    orders), and a binary search over a CDF that dips or rises across a run of filtered-out tokens can
    stop in that run. The search runs over the CDF's running maximum, and a token of zero probability
    is replaced by the nearest allowed token before it (the first allowed one if none is).
    """
    vocab = probs.shape[-1]
    cdf = cdf.cummax(dim=-1).values
    picked = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).clamp_(max=vocab - 1)  # [B, 1]
    allowed = probs > 0
    slots = torch.arange(vocab, device=probs.device)
    allowed_before = torch.where(allowed, slots, -1).cummax(dim=-1).values.gather(1, picked)[:, 0]
    return torch.where(allowed_before < 0, allowed.int().argmax(dim=-1), allowed_before)
