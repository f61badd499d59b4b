"""Eviction policies. A policy is one function that ranks the evictable tokens of a cache.

The cache always keeps its sink tokens and its recent window; of the remaining tokens it keeps
the `heavy` ones with the highest priority. Adding a policy means writing one `priority` function
and registering it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# priority(scores, slots) -> [B, H_kv, N]: higher is kept first.
#   scores: [B, H_kv, N] fp32 accumulated attention per cached token (None unless needs_scores)
#   slots:  [N] int64 slot indices; slot order is arrival order, so a larger slot is more recent
PriorityFn = Callable[[torch.Tensor | None, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Policy:
    name: str
    priority: PriorityFn | None
    needs_scores: bool = False
    uses_heavy_hitters: bool = False
    default_sinks: int = 0
    description: str = ""

    @property
    def evicts(self) -> bool:
        return self.priority is not None


def _accumulated_attention(scores: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    assert scores is not None
    return scores


def _recency(scores: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    return slots.to(torch.float32)


POLICIES: dict[str, Policy] = {}


def register_policy(policy: Policy) -> Policy:
    POLICIES[policy.name] = policy
    return policy


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None


register_policy(Policy(
    "h2o", _accumulated_attention, needs_scores=True, uses_heavy_hitters=True,
    description="recent window + heavy hitters by accumulated attention (arXiv 2306.14048)",
))
register_policy(Policy(
    "streaming", _recency, default_sinks=4,
    description="attention sinks + recent window (StreamingLLM, arXiv 2309.17453)",
))
register_policy(Policy("local", _recency, description="recent window only"))
register_policy(Policy("full", None, description="no eviction (baseline)"))
