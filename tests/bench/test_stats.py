import statistics

import pytest
import torch

from h2o_cache.bench.stats import mean_difference, median_interval, ratio_of_sums_difference


def test_a_constant_shift_per_token_is_found_exactly_with_a_degenerate_interval():
    tokens = torch.tensor([10.0, 30.0, 20.0, 5.0])
    b = torch.tensor([12.0, 40.0, 21.0, 9.0])
    a = b + 0.5 * tokens  # 0.5 nats more on every token
    interval = ratio_of_sums_difference(a, b, tokens, resamples=500)
    assert abs(interval.value - 0.5) < 1e-12
    assert abs(interval.low - 0.5) < 1e-9 and abs(interval.high - 0.5) < 1e-9
    assert interval.excludes_zero


def test_pairing_removes_item_variance_that_an_unpaired_view_would_keep():
    generator = torch.Generator().manual_seed(1)
    difficulty = torch.rand(200, generator=generator) * 10  # items differ a lot
    noise = torch.randn(200, generator=generator) * 0.05
    a, b = difficulty + 0.1 + noise, difficulty
    interval = mean_difference(a, b)
    assert interval.low < 0.1 < interval.high
    assert interval.high - interval.low < 0.05  # far narrower than the spread of difficulty
    assert interval.excludes_zero


def test_no_difference_gives_an_interval_around_zero_and_is_seeded():
    generator = torch.Generator().manual_seed(2)
    a = torch.rand(100, generator=generator)
    b = a.flip(0)  # same values, paired differently: mean difference exactly 0
    first, second = mean_difference(a, b, seed=3), mean_difference(a, b, seed=3)
    assert first == second
    assert abs(first.value) < 1e-12 and first.low < 0 < first.high and not first.excludes_zero


def test_the_median_of_a_bench_s_ratios_comes_with_an_interval_that_holds_it_and_narrows_with_less_spread():
    ratios = [1.31, 1.22, 1.27, 1.40, 1.25, 1.29, 1.24, 1.33]  # an even count: the middle two's mean
    interval = median_interval(ratios, resamples=2000)
    assert interval.value == statistics.median(ratios)
    assert min(ratios) <= interval.low <= interval.value <= interval.high <= max(ratios)
    assert interval.low < 1.25 < interval.high  # this run does not resolve a 1.25 target
    assert median_interval(ratios, resamples=2000) == interval  # seeded
    tight = median_interval([1.27 + 0.001 * (i % 3) for i in range(9)], resamples=2000)
    assert tight.high - tight.low < 0.0021 < interval.high - interval.low
    constant = median_interval([1.1] * 5, resamples=100)
    assert constant.low == constant.value == constant.high == 1.1
    with pytest.raises(ValueError):
        median_interval([])
