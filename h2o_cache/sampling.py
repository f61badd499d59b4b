"""Per-sequence sampling: greedy, temperature, top-k, top-p, min-p, seed, penalties, logit bias and logprobs."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Iterable

import torch


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
    """

    def __init__(self, params: SamplingParams, prompt: Iterable[int] = ()):
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.draws = 0
        self.counts: dict[int, int] = {}
        self.prompt: set[int] = set(prompt) if params.repetition_penalty != 1 else set()

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


_MASK64 = (1 << 64) - 1


@torch.no_grad()
def sample(logits: torch.Tensor, samplers: list[Sampler]) -> list[Sample]:
    """Next token of every row in one set of batched ops and one device-to-host copy.

    logits: [B, V] (any float dtype, any device); row b follows samplers[b]. Penalties apply to the
    logits before everything else; logprobs are of the penalized logits, before temperature.
    """
    logits = logits.float()
    device, vocab = logits.device, logits.shape[-1]
    params = [s.params for s in samplers]
    logits = _biased(_penalized(_repetition_penalized(logits, samplers), samplers), samplers)
    tokens = logits.argmax(dim=-1)
    if any(p.temperature > 0 for p in params):
        tokens = torch.where(_column(device, [p.temperature for p in params]) > 0, _draw(logits, samplers)[:, None],
                             tokens[:, None])[:, 0]
    token_ids = tokens.tolist()
    for sampler, token in zip(samplers, token_ids):
        sampler.counts[token] = sampler.counts.get(token, 0) + 1
    if all(p.logprobs is None for p in params):
        return [Sample(t) for t in token_ids]
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    k = min(max(p.logprobs or 0 for p in params), vocab)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], tokens[:, None][:, :0])
    top = [list(zip(ids, values)) for ids, values in zip(top_ids.tolist(), top_values.tolist())]
    return [
        Sample(t) if p.logprobs is None else Sample(t, lp, row[:p.logprobs])
        for t, p, lp, row in zip(token_ids, params, chosen, top)
    ]


def _column(device: torch.device, values: list[float]) -> torch.Tensor:
    """[B, 1] fp32 on device from a host list (one upload)."""
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)[:, None]


def _penalized(logits: torch.Tensor, samplers: list[Sampler]) -> torch.Tensor:
    rows, ids, amounts = [], [], []
    for row, s in enumerate(samplers):
        p = s.params
        if p.presence_penalty or p.frequency_penalty:
            for token, count in s.counts.items():
                rows.append(row)
                ids.append(token)
                amounts.append(p.presence_penalty + p.frequency_penalty * count)
    if not rows:
        return logits
    index = torch.tensor([rows, ids]).to(logits.device, non_blocking=True)
    return logits.index_put((index[0], index[1]), -_column(logits.device, amounts)[:, 0], accumulate=True)


def _repetition_penalized(logits: torch.Tensor, samplers: list[Sampler]) -> torch.Tensor:
    """Every token a row has seen (prompt or reply) gets its logit divided by the row's penalty if
    positive, multiplied if negative."""
    rows, ids, amounts = [], [], []
    for row, s in enumerate(samplers):
        if s.params.repetition_penalty != 1:
            seen = s.prompt.union(s.counts)
            rows += [row] * len(seen)
            ids += seen
            amounts += [s.params.repetition_penalty] * len(seen)
    if not rows:
        return logits
    index = torch.tensor([rows, ids]).to(logits.device, non_blocking=True)
    penalty = _column(logits.device, amounts)[:, 0]
    values = logits[index[0], index[1]]
    return logits.index_put((index[0], index[1]), torch.where(values > 0, values / penalty, values * penalty))


def _biased(logits: torch.Tensor, samplers: list[Sampler]) -> torch.Tensor:
    rows, ids, amounts = [], [], []
    for row, s in enumerate(samplers):
        for token, amount in s.params.logit_bias:
            rows.append(row)
            ids.append(token)
            amounts.append(amount)
    if not rows:
        return logits
    index = torch.tensor([rows, ids]).to(logits.device, non_blocking=True)
    return logits.index_put((index[0], index[1]), _column(logits.device, amounts)[:, 0], accumulate=True)


def _draw(logits: torch.Tensor, samplers: list[Sampler]) -> torch.Tensor:
    """Sample [B] token ids by inverse CDF with each row's own uniform; top-k then top-p as before."""
    params = [s.params for s in samplers]
    vocab = logits.shape[-1]
    # temperature, top_p, top_k (0: all), uniform, min_p: one upload
    table = torch.tensor(
        [[p.temperature or 1.0, p.top_p, min(p.top_k or vocab, vocab), s.uniform(), p.min_p]
         for p, s in zip(params, samplers)],
        dtype=torch.float64,
    ).to(logits.device, non_blocking=True)
    scaled = logits / table[:, :1].float()
    if any(p.min_p > 0 for p in params):
        # log p(token) < log(min_p) + log p(best)  <=>  scaled < log(min_p) + max(scaled)
        floor = table[:, 4:5].float().log() + scaled.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    if any(p.top_k or p.top_p < 1 for p in params):
        ranked, order = scaled.sort(dim=-1, descending=True)
        kth = ranked.gather(1, table[:, 2:3].long() - 1)
        ranked = ranked.masked_fill(ranked < kth, float("-inf"))
        if any(p.top_p < 1 for p in params):
            probs = ranked.softmax(dim=-1)
            # Drop a token once the mass before it already reaches top_p; the best token always stays.
            top_p = table[:, 1:2].float()
            drop = (probs.cumsum(dim=-1) - probs >= top_p) & (top_p < 1)
            ranked = ranked.masked_fill(drop, float("-inf"))
        scaled = scaled.scatter(1, order, ranked)
    cdf = scaled.softmax(dim=-1).cumsum(dim=-1)
    target = table[:, 3:4].float() * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=vocab - 1)
