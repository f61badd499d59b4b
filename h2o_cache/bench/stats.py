"""Paired statistics for the quality benches: per-item differences with bootstrap confidence intervals.

Every configuration is run on the same items (articles, keys), so comparisons are paired: resampling
items with replacement keeps each item's two results together, which removes the item-to-item
variance that dominates unpaired means (some articles are simply harder than others).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Interval:
    """An estimate and its two-sided percentile-bootstrap interval."""

    value: float
    low: float
    high: float

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def __str__(self) -> str:
        return f"{self.value:+.4f} [{self.low:+.4f}, {self.high:+.4f}]"


def ratio_of_sums_difference(
    a: torch.Tensor, b: torch.Tensor, weights: torch.Tensor,
    resamples: int = 10_000, confidence: float = 0.95, seed: int = 0,
) -> Interval:
    """sum(a)/sum(w) - sum(b)/sum(w), with a paired bootstrap interval over items.

    a, b: [N] per-item totals (e.g. summed NLL of an article's reference tokens under two caches);
    weights: [N] per-item counts (its tokens). The estimate is the difference of token-weighted means,
    so a long article counts by its length, as in a corpus-level mean NLL per token.
    """
    a, b, weights = (t.double() for t in (a, b, weights))
    n = len(weights)
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(n, (resamples, n), generator=generator)  # [R, N] items of each resample
    diffs = ((a - b)[picks].sum(1) / weights[picks].sum(1))
    return Interval(float((a - b).sum() / weights.sum()), *_percentiles(diffs, confidence))


def mean_difference(a: torch.Tensor, b: torch.Tensor, **kwargs) -> Interval:
    """mean(a) - mean(b) over paired items (e.g. 0/1 accuracies), with a bootstrap interval."""
    return ratio_of_sums_difference(a, b, torch.ones(len(a)), **kwargs)


def median_interval(values, resamples: int = 10_000, confidence: float = 0.95, seed: int = 0) -> Interval:
    """The median of `values` (e.g. a timing bench's per-repetition ratios; the two middle values'
    mean where their count is even, as `statistics.median`), with a percentile-bootstrap interval
    over them: how far one run's median could move were its repetitions drawn again."""
    x = torch.as_tensor(list(values), dtype=torch.double)
    if x.numel() == 0:
        raise ValueError("the median of no values")
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(x.numel(), (resamples, x.numel()), generator=generator)
    medians = torch.quantile(x[picks], 0.5, dim=1)  # linear interpolation: the middle two's mean
    return Interval(float(torch.quantile(x, 0.5)), *_percentiles(medians, confidence))


def _percentiles(samples: torch.Tensor, confidence: float) -> list[float]:
    """The two-sided percentile-bootstrap bounds of `confidence` from a bootstrap's estimates (fp64)."""
    tail = (1 - confidence) / 2
    return torch.quantile(samples, torch.tensor([tail, 1 - tail], dtype=torch.double)).tolist()
