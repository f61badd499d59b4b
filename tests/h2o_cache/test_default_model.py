"""The cache on the real default model (SmolLM2-135M-Instruct: 30 layers, 9 query / 3 KV heads)."""

import pytest
import torch
from transformers import DynamicCache

from h2o_cache import CacheConfig, Generator, SamplingParams
from tests.conftest import shared_data

pytestmark = pytest.mark.model


def chat_turn(tokenizer, question):
    return tokenizer.encode(
        f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )


def test_gqa_model_matches_plain_transformers_when_budget_covers_everything(default_model):
    model, tokenizer = default_model
    gen = Generator(model, tokenizer, CacheConfig(policy="h2o", budget=512, prefill_chunk=16))
    prompt = gen.encode_chat([{"role": "user", "content": "Name three primary colors."}])
    [out] = gen.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))
    cache, ids, expected = DynamicCache(config=model.config), torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(24):
            expected.append(int(model(ids, past_key_values=cache, logits_to_keep=1).logits[0, -1].argmax()))
            ids = torch.tensor([expected[-1:]])
    assert out.token_ids == expected


@pytest.mark.slow
def test_20k_tokens_at_budget_256_in_bounded_memory_and_still_answering(default_model):
    """20k tokens is far past the model's 8192 positions; rolling keeps RoPE within the budget."""
    model, tokenizer = default_model
    text = tokenizer.encode(shared_data("botchan.txt").read_text())[:20_000]
    gen = Generator(model, tokenizer, CacheConfig(policy="h2o", budget=256, prefill_chunk=512))
    cache = gen.new_cache(1)
    allocated = []
    for start in range(0, len(text), 2_000):
        gen.prefill(cache, [text[start:start + 2_000]])
        allocated.append(cache.allocated_bytes())
        assert cache.lengths == [240]  # evicted down to budget - slack after each chunk
    assert len(set(allocated)) == 1, "the cache must not grow with the sequence"
    # keys, rotated keys, values (fp32), fp32 scores and int64 origins for budget + one prefill chunk, nothing more
    assert allocated[0] == 30 * 3 * (256 + 512) * (3 * 64 * 4 + 4 + 8)  # keys, rotated, values; score; origin

    [answer] = gen.generate([chat_turn(tokenizer, "What is the capital of France?")], SamplingParams(max_new_tokens=12), cache)
    assert "Paris" in answer.text
    params = SamplingParams(max_new_tokens=160, temperature=0.8, top_p=0.95, seed=0)
    [story] = gen.generate([chat_turn(tokenizer, "Tell me a story about a cat.")], params, cache)
    assert cache.seen[0] > 20_000 + 160 and cache.lengths[0] <= 256
    assert len(story.token_ids) >= 40
    distinct = len(set(story.token_ids)) / len(story.token_ids)
    assert distinct > 0.3, f"degenerate repetition: {story.text!r}"
