import pytest
import torch

from h2o_cache import Sampler, SamplingParams

LOGITS = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])


def draws(params, n=200):
    sampler = Sampler(params)
    return [sampler(LOGITS).token for _ in range(n)]


def test_greedy_picks_argmax():
    assert set(draws(SamplingParams(temperature=0), 5)) == {1}


def test_seed_makes_sampling_reproducible():
    params = SamplingParams(temperature=1.0, seed=42)
    assert draws(params) == draws(params)
    assert draws(params) != draws(SamplingParams(temperature=1.0, seed=43))


def test_top_k_and_top_p_restrict_the_candidates():
    assert set(draws(SamplingParams(temperature=1.0, top_k=2, seed=0))) == {1, 2}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.01, seed=0))) == {1}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.7, seed=0))) == {1, 2}


def test_frequency_penalty_discourages_repeats():
    sampler = Sampler(SamplingParams(frequency_penalty=2.5))
    assert [sampler(LOGITS).token for _ in range(3)] == [1, 2, 4]


def test_logprobs_report_chosen_and_top_tokens():
    sample = Sampler(SamplingParams(logprobs=2))(LOGITS)
    expected = LOGITS.log_softmax(-1)
    assert sample.logprob == pytest.approx(expected[1].item())
    assert [t for t, _ in sample.top_logprobs] == [1, 2]


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"max_new_tokens": 0}])
def test_out_of_range_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
