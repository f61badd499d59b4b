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
