"""bf16 prefill products: only multi-token inputs change, within bf16's rounding, and only while enabled."""

import pytest
import torch

from h2o_cache import CacheConfig, Generator
from h2o_cache.prefill_products import apply_prefill_dtype, native_bf16, prefill_dtype, use_bf16_prefill
from tests.conftest import ByteTokenizer, tiny_llama

ZEN5 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 vaes\n"
AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"


def test_native_bf16_is_read_from_the_cpu_flags():
    assert native_bf16(ZEN5) and native_bf16(ZEN5.replace("avx512_bf16", "amx_bf16 amx_tile"))
    assert not native_bf16(AVX2_ONLY) and not native_bf16("")


def test_auto_keeps_the_models_dtype_without_native_bf16(monkeypatch):
    from h2o_cache import prefill_products

    model = tiny_llama()
    monkeypatch.setattr(prefill_products, "native_bf16", lambda: False)
    assert prefill_dtype("auto", model) == torch.float32
    monkeypatch.setattr(prefill_products, "native_bf16", lambda: True)
    assert prefill_dtype("auto", model) == torch.bfloat16
    assert prefill_dtype("float32", model) == torch.float32
    with pytest.raises(ValueError, match="prefill dtype"):
        prefill_dtype("int4", model)


def test_prefill_logits_move_by_bf16_rounding_and_one_token_steps_not_at_all():
    reference, model = tiny_llama(seed=3), tiny_llama(seed=3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    switch = use_bf16_prefill(model)
    assert switch.layers and model.state_dict().keys() == state.keys()  # the bf16 copies are not saved
    attention = model.get_decoder().layers[0].self_attn
    assert not any(hasattr(getattr(attention, name), "bf16_weight")
                   for name in ("q_proj", "k_proj", "v_proj", "o_proj"))  # the attention's stay fp32
    assert len(switch.layers) == 3 * len(model.get_decoder().layers)
    prompt = [[(7 * i) % 120 + 3 for i in range(40)]]
    outputs = {}
    for name, m in (("fp32", reference), ("bf16", model)):
        gen = Generator(m, ByteTokenizer(), CacheConfig(policy="h2o", budget=24, prefill_chunk=16))
        cache = gen.new_cache(1)
        prefilled = gen.prefill(cache, prompt)
        outputs[name] = prefilled, [gen.step(cache, [[t]]) for t in (5, 9, 11)]
    (p32, steps32), (p16, steps16) = outputs["fp32"], outputs["bf16"]
    assert not torch.equal(p32, p16)  # the bf16 path ran
    torch.testing.assert_close(p16, p32, atol=2e-2, rtol=2e-2)
    for step16, step32 in zip(steps16, steps32):  # the same products, over keys the prefill wrote
        torch.testing.assert_close(step16, step32, atol=2e-2, rtol=2e-2)


def test_a_disabled_switch_gives_the_fp32_model_bit_for_bit():
    reference, model = tiny_llama(seed=4), tiny_llama(seed=4)
    switch = use_bf16_prefill(model)
    switch.enabled = False
    prompt = [[(5 * i) % 120 + 3 for i in range(33)]]
    logits = []
    for m in (reference, model):
        gen = Generator(m, ByteTokenizer(), CacheConfig(policy="h2o", budget=20, prefill_chunk=8))
        logits.append(gen.prefill(gen.new_cache(1), prompt))
    assert torch.equal(logits[0], logits[1])


def test_one_token_rows_take_the_fp32_product_exactly():
    model = tiny_llama(seed=5)
    linear = model.get_decoder().layers[0].mlp.up_proj
    x = torch.randn(3, 1, linear.in_features)
    before = linear(x)
    use_bf16_prefill(model)
    assert torch.equal(linear(x), before)
    many = torch.randn(1, 6, linear.in_features)
    assert linear(many).dtype == torch.float32
    assert not torch.equal(linear(many), torch.nn.functional.linear(many, linear.weight))


def test_apply_gives_only_an_fp32_model_told_bf16_the_switch():
    assert apply_prefill_dtype(tiny_llama(), "float32") is None
    assert apply_prefill_dtype(tiny_llama().to(torch.bfloat16), "bfloat16") is None
    switch = apply_prefill_dtype(tiny_llama(), "bfloat16")
    assert switch is not None and switch.enabled and switch.layers
