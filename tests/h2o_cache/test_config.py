import pytest

from h2o_cache import CacheConfig


def test_h2o_splits_target_half_heavy_half_recent():
    config = CacheConfig(policy="h2o", budget=256)
    assert (config.target, config.heavy, config.recent, config.sinks) == (240, 120, 120, 0)


def test_slack_one_evicts_a_token_per_step_like_the_paper():
    config = CacheConfig(policy="h2o", budget=256, evict_slack=1)
    assert (config.target, config.heavy, config.recent) == (255, 127, 128)


def test_streaming_keeps_sinks_and_recent_only():
    config = CacheConfig(policy="streaming", budget=64)
    assert (config.target, config.heavy, config.recent, config.sinks) == (60, 0, 56, 4)


def test_local_is_recent_window_only():
    config = CacheConfig(policy="local", budget=64, evict_slack=1)
    assert (config.heavy, config.recent, config.sinks) == (0, 63, 0)


def test_full_never_evicts_or_rolls():
    config = CacheConfig(policy="full", budget=1)
    assert not config.evicts and not config.rolling


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"policy": "nope"}, "unknown policy 'nope'"),
        ({"budget": 32, "recent_window": 64}, "budget (32, evicting down to 30) is smaller than the recent window (64)"),
        ({"policy": "streaming", "budget": 8, "sink_tokens": 8}, "budget (8, evicting down to 7) is smaller"),
        ({"budget": 0}, "budget must be >= 1"),
        ({"heavy_ratio": 1.5}, "heavy_ratio must be within [0, 1]"),
        ({"budget": 16, "evict_slack": 16}, "evict_slack must be in [1, budget)"),
        ({"prefill_chunk": 0}, "prefill_chunk must be >= 1"),
        ({"recall_budget": 16, "recall_queries": 0}, "recall_queries must be >= 1 or None"),
        ({"recall_budget": 16, "recall_span": -1}, "recall_span must be >= 0"),
        ({"recall_budget": 16, "recall_digest": "median"}, "recall_digest must be 'centre' or 'mean' or 'minmax', got 'median'"),
        ({"recall_budget": 16, "recall_positions": "true"}, "recall_positions must be 'text' or 'rank', got 'true'"),
    ],
)
def test_bad_arguments_name_the_problem(kwargs, message):
    with pytest.raises(ValueError) as error:
        CacheConfig(**kwargs)
    assert message in str(error.value)
