import pytest
import torch
from transformers import DynamicCache

from h2o_cache import CacheConfig, Generator, SamplingParams, UnsupportedModelError, model_spec


def reference_greedy(model, prompt, n):
    """Plain transformers greedy decoding with a DynamicCache (no eviction, absolute positions)."""
    cache = DynamicCache(config=model.config)
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids, past_key_values=cache).logits[0, -1]
            out.append(int(logits.argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


@pytest.mark.parametrize("policy", ["h2o", "streaming", "local", "full"])
def test_budget_above_length_matches_transformers_generate(tiny_model, byte_tokenizer, policy):
    prompt = list(range(3, 40))
    gen = Generator(tiny_model, byte_tokenizer, CacheConfig(policy=policy, budget=128, prefill_chunk=16))
    [out] = gen.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert out.token_ids == reference_greedy(tiny_model, prompt, 30)
    assert out.finish_reason == "length"


def test_stops_at_eos_like_transformers_generate(tiny_model, byte_tokenizer):
    prompt = list(range(3, 40))
    reference = tiny_model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, pad_token_id=0)
    gen = Generator(tiny_model, byte_tokenizer, CacheConfig(policy="h2o", budget=128))
    [out] = gen.generate([prompt], SamplingParams(max_new_tokens=30))
    assert out.token_ids == reference[0, len(prompt):].tolist()


def test_continuing_a_sequence_equals_feeding_it_at_once(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer, CacheConfig(policy="full"))
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    cache = gen.new_cache(1)
    [first] = gen.generate([[5, 6, 7, 8]], params, cache)
    [second] = gen.generate([[9, 10, 11]], params, cache)
    assert cache.seen == [4 + 8 + 3 + 7] and cache.pending == [second.token_ids[-1:]]
    [at_once] = gen.generate([[5, 6, 7, 8] + first.token_ids + [9, 10, 11]], params)
    assert second.token_ids == at_once.token_ids


def test_batched_generation_equals_one_at_a_time_with_eviction(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer, CacheConfig(policy="h2o", budget=12, prefill_chunk=8))
    prompts = [list(range(3, 30)), [9, 8, 7], list(range(50, 70))]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (20, 5, 12)]
    batched = gen.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, batched):
        [alone] = gen.generate([prompt], p)
        assert out.token_ids == alone.token_ids and len(out.token_ids) == p.max_new_tokens


def test_sequences_run_far_past_the_trained_context_with_rolling(tiny_model, byte_tokenizer):
    """The tiny model has 256 positions; rolling keeps every RoPE position below the budget."""
    gen = Generator(tiny_model, byte_tokenizer, CacheConfig(policy="h2o", budget=32))
    cache = gen.new_cache(1)
    gen.prefill(cache, [list(range(3, 120)) * 5])
    [out] = gen.generate([[5]], SamplingParams(max_new_tokens=100, ignore_eos=True), cache)
    assert cache.seen == [585 + 1 + 99] and cache.lengths[0] <= 32 and len(out.token_ids) == 100


def test_stop_string_ends_generation_and_is_not_returned(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer, CacheConfig(policy="full"))
    [free] = gen.generate([[5, 6, 7]], SamplingParams(max_new_tokens=20, ignore_eos=True))
    stop = free.text[5:7]
    [stopped] = gen.generate([[5, 6, 7]], SamplingParams(max_new_tokens=20, ignore_eos=True, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[:free.text.index(stop)]


def test_eos_stops_with_reason_stop(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer, CacheConfig(policy="full"))
    [free] = gen.generate([[5, 6, 7]], SamplingParams(max_new_tokens=10, ignore_eos=True))
    stop = free.token_ids[3]
    [out] = gen.generate([[5, 6, 7]], SamplingParams(max_new_tokens=10, stop_token_ids=(stop,)))
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:free.token_ids.index(stop) + 1]


def test_min_new_tokens_holds_the_model_s_end_token_back_until_then(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer, CacheConfig(policy="full"))
    [eos] = gen.eos_token_ids
    ending = SamplingParams(max_new_tokens=10, logit_bias=((eos, 100.0),))  # the end token, likeliest everywhere
    [out] = gen.generate([[5, 6, 7]], ending)
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    [held] = gen.generate([[5, 6, 7]], SamplingParams(max_new_tokens=10, min_new_tokens=4, logit_bias=((eos, 100.0),)))
    assert len(held.token_ids) == 5 and eos not in held.token_ids[:4] and held.token_ids[4] == eos
    assert held.finish_reason == "stop"


def test_non_rope_models_are_refused_by_name():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel is not a decoder with rotary position"):
        model_spec(model)
