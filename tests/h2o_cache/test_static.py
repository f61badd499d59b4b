"""The fast path (`StaticDecoder`) against the transformers path it must reproduce exactly."""

import random

import pytest
import torch

from h2o_cache import POLICIES, CacheConfig, Generator, StaticDecoder, UnsupportedModelError
from h2o_cache.static import buckets
from tests.conftest import ByteTokenizer, tiny_llama

EVICTING = [name for name, policy in POLICIES.items() if policy.evicts]


@pytest.fixture(scope="module")
def peaked_model():
    return tiny_llama(init_std=0.3)  # peaked attention and logits: real heavy hitters, no near-ties


def prefilled_row(gen: Generator, prompt: list[int], first_token: int):
    row = gen.new_cache(1)
    gen.prefill(row, [prompt])
    row.pending = [[first_token]]
    return row


def test_buckets_cover_every_batch_size():
    assert buckets(1) == [1] and buckets(8) == [1, 2, 4, 8] and buckets(12) == [1, 2, 4, 8, 12]


@pytest.mark.parametrize("policy", EVICTING)
def test_a_step_writes_the_same_cache_and_logits_as_the_transformers_path(peaked_model, policy):
    gen = Generator(peaked_model, ByteTokenizer(), CacheConfig(policy=policy, budget=20, evict_slack=3, prefill_chunk=8))
    decoder = StaticDecoder(peaked_model, gen.config, max_rows=4)
    eager = gen.new_cache(0)
    for n in (20, 7, 13):  # one row at the budget: the step evicts it
        row = prefilled_row(gen, list(range(3, 3 + n)), 5 + n)
        eager.extend(row)
        decoder.cache.extend(row)
    expected = gen.step(eager, eager.pending)
    logits = decoder.step()
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    fast = decoder.cache
    assert (fast.lengths, fast.seen) == (eager.lengths, eager.seen) and fast.lengths[0] == 17
    for mine, theirs in zip(fast.buffers().__dict__.values(), eager.buffers().__dict__.values()):
        if theirs is not None:
            for row, length in enumerate(eager.lengths):
                torch.testing.assert_close(mine[:, row, :, :length], theirs[:, row, :, :length], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("policy", EVICTING)
def test_greedy_tokens_equal_the_transformers_path_for_256_steps_with_rows_joining_and_leaving(peaked_model, policy):
    """An engine-like schedule: rows join and leave at random steps, batches are padded to buckets,
    and rows cross the budget at different steps."""
    config = CacheConfig(policy=policy, budget=24, prefill_chunk=8)
    gen = Generator(peaked_model, ByteTokenizer(), config)
    decoder = StaticDecoder(peaked_model, config, max_rows=6)
    eager, fast = gen.new_cache(0), decoder.cache
    rng = random.Random(0)
    names, tokens = [], {}  # row order (the same in both caches) and each row's tokens per path
    for step in range(256):
        if len(names) < 6 and rng.random() < 0.15:
            name = f"seq{step}"
            prompt = [rng.randrange(3, 128) for _ in range(rng.randrange(1, 40))]
            row = prefilled_row(gen, prompt, prompt[-1])
            eager.extend(row)
            fast.extend(row)
            names.append(name)
            tokens[name] = ([], [])
        if names and rng.random() < 0.05:
            leaving = rng.randrange(len(names))
            assert eager.pop(leaving).seen == fast.pop(leaving).seen
            names[leaving] = names[-1]
            names.pop()
        if not names:
            continue
        by_eager = gen.step(eager, eager.pending).argmax(dim=-1).tolist()
        by_fast = decoder.step().argmax(dim=-1).tolist()
        for name, e, f in zip(names, by_eager, by_fast):
            tokens[name][0].append(e)
            tokens[name][1].append(f)
        eager.pending = [[t] for t in by_eager]
        fast.pending = [[t] for t in by_fast]
        assert fast.lengths == eager.lengths and max(fast.lengths) <= config.budget
    assert sum(len(e) for e, _ in tokens.values()) > 500 and max(eager.seen) > 3 * config.budget
    for name, (by_eager, by_fast) in tokens.items():
        assert by_fast == by_eager, name


def test_a_row_decodes_the_same_alone_and_in_any_batch(peaked_model):
    config = CacheConfig(policy="h2o", budget=16, prefill_chunk=8)
    gen = Generator(peaked_model, ByteTokenizer(), config)
    prompt = list(range(10, 40))

    def run(others: int) -> list[int]:
        decoder = StaticDecoder(peaked_model, config, max_rows=8)
        for i in range(others):
            decoder.cache.extend(prefilled_row(gen, list(range(50 + i, 60 + 3 * i)), 9))
        decoder.cache.extend(prefilled_row(gen, prompt, 7))
        out = []
        for _ in range(40):
            next_tokens = decoder.step().argmax(dim=-1).tolist()
            decoder.cache.pending = [[t] for t in next_tokens]
            out.append(next_tokens[-1])
        return out

    alone = run(0)
    assert run(2) == alone and run(5) == alone


def test_a_step_needs_one_pending_token_per_row(peaked_model):
    config = CacheConfig(policy="h2o", budget=16)
    decoder = StaticDecoder(peaked_model, config, max_rows=2)
    with pytest.raises(ValueError, match="rows"):
        decoder.step()
    decoder.cache.extend(prefilled_row(Generator(peaked_model, ByteTokenizer(), config), [4, 5, 6], 7))
    decoder.cache.pending = [[]]
    with pytest.raises(ValueError, match="pending"):
        decoder.step()


@pytest.mark.parametrize("config", [CacheConfig(policy="full"), CacheConfig(policy="h2o", position_rolling=False)])
def test_caches_without_a_fixed_shape_and_bounded_positions_are_refused(peaked_model, config):
    with pytest.raises(ValueError, match="rolling"):
        StaticDecoder(peaked_model, config, max_rows=2)


def test_layers_that_are_not_llamas_are_refused():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    with pytest.raises(UnsupportedModelError, match="q_norm"):
        StaticDecoder(model, CacheConfig(policy="h2o", budget=16), max_rows=2)


def test_a_reallocated_cache_is_refused_rather_than_read_stale(peaked_model):
    config = CacheConfig(policy="h2o", budget=16)
    decoder = StaticDecoder(peaked_model, config, max_rows=1)
    row = prefilled_row(Generator(peaked_model, ByteTokenizer(), config), [4, 5, 6], 7)
    decoder.cache.extend(row)
    decoder.cache.extend(row)  # one row more than it was built for: the buffers move
    decoder.cache.pop(1)
    with pytest.raises(RuntimeError, match="reallocated"):
        decoder.step()


def test_fused_weights_share_the_models_storage_and_leave_its_outputs_unchanged():
    """q/k/v and gate/up stacked for the step are the model's own weights, not copies of them."""
    from h2o_cache.hf import decoder_weights

    model = tiny_llama(seed=3)
    ids = torch.tensor([[5, 9, 20, 7]])
    with torch.no_grad():
        before = model(ids).logits
    weights = decoder_weights(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    qkv, gate_up = weights.layers[0].qkv, weights.layers[0].gate_up
    assert qkv.data_ptr() == attn.q_proj.weight.data_ptr()
    assert attn.k_proj.weight.data_ptr() == qkv[attn.q_proj.out_features:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == gate_up[mlp.gate_proj.out_features:].data_ptr()
    assert decoder_weights(model).layers[0].qkv.data_ptr() == qkv.data_ptr()  # not stacked again
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
