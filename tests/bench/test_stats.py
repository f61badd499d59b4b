import torch

from h2o_cache.bench.stats import mean_difference, ratio_of_sums_difference


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
