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


def test_logit_bias_shifts_a_token_in_greedy_and_sampled_choice():
    assert set(draws(SamplingParams(temperature=0, logit_bias=((3, 100.0),)), 5)) == {3}
    assert 1 not in draws(SamplingParams(temperature=1.0, logit_bias=((1, -100.0),), seed=0))


def test_min_p_drops_the_unlikely_tokens_only_when_sampling():
    # p(2) / p(1) = e^-0.1 ~ 0.9, p(4) / p(1) = e^-2 ~ 0.14
    assert set(draws(SamplingParams(temperature=1.0, min_p=0.5, seed=0))) == {1, 2}
    assert 4 in draws(SamplingParams(temperature=1.0, min_p=0.1, seed=0), 400)


def test_repetition_penalty_counts_the_prompt_and_the_reply():
    params = SamplingParams(repetition_penalty=10.0)
    assert Sampler(params, prompt=[1])(LOGITS).token == 2  # 3.0 / 10 < 2.9
    sampler = Sampler(params)
    assert [sampler(LOGITS).token for _ in range(3)] == [1, 2, 4]
    negative = torch.tensor([-1.0, -1.5, -5.0])
    assert Sampler(SamplingParams(repetition_penalty=2.0), prompt=[0])(negative).token == 1  # -1 * 2 < -1.5


def test_rows_keep_their_own_sampling_fields_in_one_batch():
    from h2o_cache.sampling import sample

    samplers = [Sampler(SamplingParams(logit_bias=((0, 50.0),))), Sampler(SamplingParams()),
                Sampler(SamplingParams(repetition_penalty=10.0), prompt=[1])]
    assert [s.token for s in sample(LOGITS.repeat(3, 1), samplers)] == [0, 1, 2]


@pytest.mark.parametrize("kwargs", [{"min_p": 1.5}, {"repetition_penalty": 0}])
def test_out_of_range_new_fields_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
