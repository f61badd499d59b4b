"""Per-sequence sampling: greedy, temperature, top-k, top-p, seed, penalties and logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class Sample:
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


class Sampler:
    """Sampling state of one sequence: its random generator and the counts its penalties need."""

    def __init__(self, params: SamplingParams, device: torch.device):
        self.params = params
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()
        self.counts: dict[int, int] = {}

    def __call__(self, logits: torch.Tensor) -> Sample:
        """logits: [V] fp32 for this sequence's next token."""
        p = self.params
        if self.counts and (p.presence_penalty or p.frequency_penalty):
            ids = torch.tensor(list(self.counts), device=logits.device)
            counts = torch.tensor(list(self.counts.values()), device=logits.device, dtype=logits.dtype)
            logits = logits.clone()
            logits[ids] -= p.presence_penalty + p.frequency_penalty * counts
        if p.temperature == 0:
            token = int(logits.argmax())
        else:
            token = self._draw(logits)
        self.counts[token] = self.counts.get(token, 0) + 1
        if p.logprobs is None:
            return Sample(token)
        logprobs = logits.log_softmax(dim=-1)
        top = []
        if p.logprobs > 0:
            values, ids = logprobs.topk(p.logprobs)
            top = list(zip(ids.tolist(), values.tolist()))
        return Sample(token, float(logprobs[token]), top)

    def _draw(self, logits: torch.Tensor) -> int:
        p = self.params
        logits = logits / p.temperature
        if p.top_k:
            kth = logits.topk(min(p.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1:
            sorted_logits, order = logits.sort(descending=True)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            # Drop a token once the mass before it already reaches top_p; the best token always stays.
            drop = cumulative - sorted_logits.softmax(dim=-1) >= p.top_p
            logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
