"""Rotary position embedding helpers for position rolling.

With rolling, keys are cached *before* RoPE and rotated to their slot positions on every read;
`unrotate` recovers the pre-RoPE key from the rotated one the model hands the cache.
cos/sin follow transformers' convention: [..., D] with the two halves repeated, possibly
multiplied by the rope type's attention scaling.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, D]; cos, sin: broadcastable to x."""
    return x * cos + rotate_half(x) * sin


def rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """out = rotate(x, cos, sin) without full-size temporaries: the hot path of re-rotation.

    Assumes transformers' layout, where cos and sin repeat the same half twice.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[..., :half].to(x.dtype), sin[..., :half].to(x.dtype)
    torch.mul(x1, c, out=out[..., :half])
    out[..., :half].addcmul_(x2, s, value=-1)
    torch.mul(x2, c, out=out[..., half:])
    out[..., half:].addcmul_(x1, s)


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of `rotate`, exact for any scaling s of cos = s cos t, sin = s sin t; norm: cos * cos + sin *
    sin where the caller has it."""
    return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin if norm is None else norm)


class RopeTable:
    """cos/sin for positions 0..n-1, computed by the model's own rotary embedding and grown on demand.

    rope_fn(positions [1, N], int64 or float) -> (cos, sin), each [1, N, D]; frequencies [D/2]
    (transformers' `inv_freq`) and scale (its attention scaling) where the angles are position x
    frequency (not a dynamic RoPE), for `at` and the kernels that place recalled keys; `placeable`
    says whether those kernels can (frequencies known and each <= 1), decided once.
    """

    def __init__(self, rope_fn, device: torch.device, frequencies: torch.Tensor | None = None, scale: float = 1.0):
        self._rope_fn = rope_fn
        self._device = device
        self.frequencies = None if frequencies is None else frequencies.float().to(device)
        self._placeable: bool | None = None
        self._scale = scale
        self.cos = torch.empty(0, 0, device=device)
        self.sin = torch.empty(0, 0, device=device)

    @property
    def placeable(self) -> bool:
        """Whether the frequencies are known and each <= 1; decided at the first question (a read from
        the device, which a CPU kernel asking is on)."""
        if self._placeable is None:
            self._placeable = self.frequencies is not None and bool((self.frequencies.abs() <= 1).all())
        return self._placeable

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin at any positions, fractional ones too ([...] -> [..., D] fp32 each): RoPE's angles
        are position x frequency, so a position between two slots turns a key between their angles."""
        if self.frequencies is None:  # the model's own function at the float positions
            cos, sin = self._rope_fn(positions.reshape(1, -1).float())
            return cos[0].float().view(*positions.shape, -1), sin[0].float().view(*positions.shape, -1)
        angles = positions.float()[..., None] * self.frequencies  # half the angles, repeated
        cos, sin = angles.cos() * self._scale, angles.sin() * self._scale
        return torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)

    def get(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, D] fp32 each."""
        if self.cos.shape[0] < n:
            size = max(n, 2 * self.cos.shape[0])
            positions = torch.arange(size, device=self._device)[None]
            cos, sin = self._rope_fn(positions)
            self.cos, self.sin = cos[0].float(), sin[0].float()
        return self.cos[:n], self.sin[:n]
