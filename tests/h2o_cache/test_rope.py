import torch

from h2o_cache.rope import rotate, rotate_into, unrotate


def test_unrotate_inverts_rotate_even_with_attention_scaling():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 8)
    angles = torch.randn(7, 4)
    scale = 1.3
    cos = torch.cat([angles.cos(), angles.cos()], -1) * scale
    sin = torch.cat([angles.sin(), angles.sin()], -1) * scale
    assert torch.allclose(unrotate(rotate(x, cos, sin), cos, sin), x, atol=1e-6)


def test_rotation_by_slot_keeps_only_relative_positions():
    # <R(m) q, R(n) k> depends on m - n only: the basis of position rolling.
    torch.manual_seed(0)
    q, k = torch.randn(8), torch.randn(8)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2) / 8))

    def table(p):
        angles = p * inv_freq
        return torch.cat([angles.cos()] * 2), torch.cat([angles.sin()] * 2)

    far = (rotate(q, *table(9000)) * rotate(k, *table(8990))).sum()
    near = (rotate(q, *table(10)) * rotate(k, *table(0))).sum()
    assert torch.allclose(far, near, atol=1e-3)


def test_rotate_into_matches_rotate_and_writes_in_place():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 5, 8)
    angles = torch.randn(5, 4)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    buffer = torch.zeros(2, 3, 9, 8)
    rotate_into(buffer[:, :, :5], x, cos, sin)
    assert torch.allclose(buffer[:, :, :5], rotate(x, cos, sin), atol=1e-6)
    assert buffer[:, :, 5:].abs().sum() == 0


def test_rope_table_at_fractional_positions_with_and_without_frequencies():
    """`RopeTable.at`: from the model's frequencies (position x frequency) and, without them (a dynamic
    RoPE), from the model's own function at float positions: the same cos/sin, equal to the table's at
    whole positions and between a slot's and the next one's angles at a fraction."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from h2o_cache.rope import RopeTable

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                         rope_scaling={"rope_type": "linear", "factor": 2.0})
    rotary = LlamaRotaryEmbedding(config)
    dummy = torch.empty(0)

    def rope_fn(positions):
        return rotary(dummy, positions)

    known = RopeTable(rope_fn, torch.device("cpu"), rotary.inv_freq, rotary.attention_scaling)
    derived = RopeTable(rope_fn, torch.device("cpu"))
    positions = torch.tensor([[0.0, 3.0, 3.25], [17.5, 40.0, 99.9]])
    cos, sin = known.at(positions)
    assert cos.shape == sin.shape == (2, 3, 16)
    torch.testing.assert_close(derived.at(positions)[0], cos, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(derived.at(positions)[1], sin, rtol=1e-5, atol=1e-6)
    table_cos, table_sin = known.get(41)
    torch.testing.assert_close(cos[1, 1], table_cos[40], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin[0, 1], table_sin[3], rtol=1e-6, atol=1e-6)
    angle = 3.25 * rotary.inv_freq  # linear scaling: inv_freq already divided by the factor
    torch.testing.assert_close(cos[0, 2], torch.cat([angle.cos()] * 2), rtol=1e-6, atol=1e-6)
