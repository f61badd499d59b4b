"""Per-sequence sampling: greedy, temperature, top-k, top-p, min-p, seed, penalties, logit bias and logprobs."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Iterable

import torch

from h2o_cache.transfer import upload


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its next tokens. temperature 0 means greedy."""

    max_new_tokens: int = 256
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
    history: with a penalty on, [2, V] int32 on the logits' device (allocated at the first sample):
    row 0 counts each token sampled so far, row 1 marks the prompt's tokens. It stays on the device,
    so a step's penalties cost the same however long the reply is.
    """

    def __init__(self, params: SamplingParams, prompt: Iterable[int] = ()):
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.draws = 0
        self.penalized = bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1)
        self.prompt: set[int] = set(prompt) if params.repetition_penalty != 1 else set()
        self.history: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor) -> Sample:
        """logits: [V] fp32 for this sequence's next token."""
        return sample(logits[None], [self])[0]

    def uniform(self) -> float:
        """The next number in [0, 1) of this sequence's stream (splitmix64 of seed and counter)."""
        self.draws += 1
        z = (self.seed + self.draws * 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return ((z ^ (z >> 31)) >> 11) / float(1 << 53)

    def _history(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self.history is None:
            self.history = torch.zeros(2, vocab, dtype=torch.int32, device=device)
            if self.prompt:
                ids = upload(sorted(self.prompt), device)
                self.history[1].index_fill_(0, ids, 1)
        return self.history


_MASK64 = (1 << 64) - 1
# Columns of the per-row table a step uploads once: what every row's sampling fields need on the device.
_TEMPERATURE, _TOP_P, _TOP_K, _UNIFORM, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION = range(8)


@torch.no_grad()
def sample(logits: torch.Tensor, samplers: list[Sampler]) -> list[Sample]:
    """Next token of every row in one set of batched ops and one device-to-host copy.

    logits: [B, V] (any float dtype, any device); row b follows samplers[b]. Penalties apply to the
    logits before everything else; logprobs are of the penalized logits, before temperature.
    The host work is one pass over the rows (their fields, and a uniform each when any row samples);
    the rows' token histories stay on the device.
    """
    logits = logits.float()
    device, vocab = logits.device, logits.shape[-1]
    params = [s.params for s in samplers]
    drawing = any(p.temperature > 0 for p in params)
    table = upload(
        [[p.temperature, p.top_p, min(p.top_k or vocab, vocab), s.uniform() if drawing else 0.0, p.min_p,
          p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p, s in zip(params, samplers)],
        device, torch.float64,
    )  # [B, 8]
    penalized = [s for s in samplers if s.penalized]
    history = None
    if penalized:
        blank = torch.zeros(2, vocab, dtype=torch.int32, device=device)
        history = torch.stack([s._history(vocab, device) if s.penalized else blank for s in samplers])  # [B, 2, V]
        logits = _penalized(logits, history, table)
    logits = _biased(logits, samplers)
    tokens = logits.argmax(dim=-1)
    if drawing:
        tokens = torch.where(table[:, _TEMPERATURE] > 0, _draw(logits, params, table), tokens)
    if history is not None:
        generated = history[:, 0]
        generated.scatter_add_(1, tokens[:, None], torch.ones_like(generated[:, :1]))
        torch._foreach_copy_([s.history for s in penalized],
                             [row for row, s in zip(history.unbind(0), samplers) if s.penalized])
    if all(p.logprobs is None for p in params):
        return [Sample(t) for t in tokens.cpu().tolist()]
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])
    k = min(max(p.logprobs or 0 for p in params), vocab)
    top_values, top_ids = logprobs.topk(k, dim=-1)
    # one download: token ids (exact in float64), the chosen logprob, the top ids and their logprobs
    packed = torch.cat([tokens[:, None].double(), chosen.double(), top_ids.double(), top_values.double()], dim=1)
    out = []
    for p, row in zip(params, packed.cpu().tolist()):
        token = int(row[0])
        if p.logprobs is None:
            out.append(Sample(token))
        else:
            top = [(int(i), v) for i, v in zip(row[2:2 + k], row[2 + k:])]
            out.append(Sample(token, row[1], top[:p.logprobs]))
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
    rows, ids, amounts = [], [], []
    for row, s in enumerate(samplers):
        for token, amount in s.params.logit_bias:
            rows.append(row)
            ids.append(token)
            amounts.append(amount)
    if not rows:
        return logits
    index = upload([rows, ids], logits.device)
    return logits.index_put((index[0], index[1]), upload(amounts, logits.device, torch.float32), accumulate=True)


def _draw(logits: torch.Tensor, params: list[SamplingParams], table: torch.Tensor) -> torch.Tensor:
    """Sample [B] token ids by inverse CDF with each row's own uniform; top-k then top-p as before."""
    temperature = table[:, _TEMPERATURE:_TEMPERATURE + 1].float()
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)  # greedy rows: drawn but not taken
    if any(p.min_p > 0 for p in params):
        # log p(token) < log(min_p) + log p(best)  <=>  scaled < log(min_p) + max(scaled)
        floor = table[:, _MIN_P:_MIN_P + 1].float().log() + scaled.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    if any(p.top_k or p.top_p < 1 for p in params):
        ranked, order = scaled.sort(dim=-1, descending=True)
        kth = ranked.gather(1, table[:, _TOP_K:_TOP_K + 1].long() - 1)
        ranked = ranked.masked_fill(ranked < kth, float("-inf"))
        if any(p.top_p < 1 for p in params):
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
