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


def old_penalized(logits: torch.Tensor, params: list[SamplingParams], prompts: list[set[int]],
                  counts: list[dict[int, int]]) -> torch.Tensor:
    """The rule as it was written before the histories moved to the device: Python lists over every
    token each row has seen, every step."""
    logits = logits.clone()
    for row, (p, prompt, count) in enumerate(zip(params, prompts, counts)):
        if p.repetition_penalty != 1:
            for token in prompt | set(count):
                penalty = torch.tensor(p.repetition_penalty, dtype=torch.float32)
                value = logits[row, token]
                logits[row, token] = value / penalty if value > 0 else value * penalty
        if p.presence_penalty or p.frequency_penalty:
            for token, n in count.items():
                logits[row, token] += -torch.tensor(p.presence_penalty + p.frequency_penalty * n, dtype=torch.float32)
    return logits


def test_penalties_from_device_histories_equal_the_host_rule_bit_for_bit():
    from h2o_cache.sampling import _penalized, sample

    generator = torch.Generator().manual_seed(0)
    vocab, rows = 40, 6
    params = [SamplingParams(temperature=1.0, seed=row, presence_penalty=[0.0, 0.7, -0.3][row % 3],
                             frequency_penalty=[0.0, 0.25, 1.1][row // 2 % 3],
                             repetition_penalty=[1.0, 1.3, 0.8][(row + 1) % 3]) for row in range(rows)]
    prompts = [set(torch.randint(vocab, (5,), generator=generator).tolist()) for _ in range(rows)]
    samplers = [Sampler(p, prompt) for p, prompt in zip(params, prompts)]
    counts: list[dict[int, int]] = [{} for _ in range(rows)]
    for _ in range(30):
        logits = torch.randn(rows, vocab, generator=generator) * 3
        expected = old_penalized(logits, params, [s.prompt for s in samplers], counts)
        table = torch.tensor([s.fields for s in samplers], dtype=torch.float64)
        for s in samplers:
            if s.history is None:
                s._allocate_history(vocab, logits.device)
        history = torch.stack([s.history for s in samplers])
        assert torch.equal(_penalized(logits, history, table), expected)
        for count, drawn in zip(counts, sample(logits, samplers)):
            count[drawn.token] = count.get(drawn.token, 0) + 1
    assert all(s.history[0].sum() == 30 for s in samplers)


def test_a_cdf_that_is_not_monotonic_never_yields_a_filtered_token():
    """CUDA's parallel cumsum can dip, or rise across tokens of zero probability; the search must
    still land on an allowed token, the one whose interval holds the target."""
    from h2o_cache.sampling import inverse_cdf

    probs = torch.tensor([[0.3, 0.0, 0.0, 0.7], [0.5, 0.0, 0.2, 0.3], [0.0, 0.0, 0.4, 0.6]])
    cdf = torch.tensor([[0.3, 0.30001, 0.30002, 1.0],  # rises across filtered tokens 1, 2
                        [0.5, 0.49998, 0.7, 1.0],  # dips after token 0
                        [1e-6, 2e-6, 0.4, 1.0]])  # rises before the first allowed token
    uniform = torch.tensor([[0.300005], [0.49999], [0.0000015]])
    tokens = inverse_cdf(probs, cdf, uniform)
    assert probs.gather(1, tokens[:, None]).gt(0).all(), tokens
    assert tokens.tolist() == [0, 0, 2]


def splitmix64(seed: int, draw: int) -> float:
    mask = (1 << 64) - 1
    z = (seed + draw * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


def test_every_row_draws_the_next_number_of_its_own_splitmix64_stream_whatever_its_batch():
    from h2o_cache.sampling import uniforms

    seeds = [0, 42, -7, 2**63 - 1, 2**70 + 5]
    samplers = [Sampler(SamplingParams(temperature=1.0, seed=seed)) for seed in seeds]
    for draw in range(1, 4):
        assert uniforms(samplers).tolist() == [splitmix64(seed, draw) for seed in seeds]
    assert uniforms(samplers[1:2]).tolist() == [splitmix64(42, 4)]


def test_min_new_tokens_holds_the_end_tokens_back_until_then_greedy_sampled_and_in_a_batch():
    from h2o_cache.sampling import sample

    ends = [1]  # token 1 is the likeliest: the end token a reply would stop at
    params = SamplingParams(min_new_tokens=3, stop_token_ids=(2,))
    sampler = Sampler(params, ends=ends)
    assert [sampler(LOGITS).token for _ in range(4)] == [4, 4, 4, 1]  # 1 and the stop id 2 held back thrice
    drawn = Sampler(SamplingParams(temperature=1.0, seed=0, min_new_tokens=50, max_new_tokens=50), ends=ends)
    assert 1 not in [drawn(LOGITS).token for _ in range(50)] and 1 in [drawn(LOGITS).token for _ in range(50)]
    logged = Sampler(SamplingParams(min_new_tokens=1, logprobs=2), ends=ends)(LOGITS)
    held = LOGITS.clone()
    held[1] = float("-inf")  # the logprobs are of the logits with the held-back token at -inf
    assert logged.token == 2 and logged.logprob == pytest.approx(held.log_softmax(-1)[2].item())
    assert [t for t, _ in logged.top_logprobs] == [2, 4]
    batch = [Sampler(SamplingParams(min_new_tokens=1), ends=ends), Sampler(SamplingParams(), ends=ends)]
    assert [s.token for s in sample(LOGITS.repeat(2, 1), batch)] == [2, 1]  # only the first row holds 1 back
    assert [s.token for s in sample(LOGITS.repeat(2, 1), batch)] == [1, 1]


@pytest.mark.parametrize("kwargs", [{"min_new_tokens": -1}, {"min_new_tokens": 5, "max_new_tokens": 4}])
def test_min_new_tokens_out_of_range_is_refused(kwargs):
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(**kwargs)
