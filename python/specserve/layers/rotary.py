"""Rotary position embeddings (non-interleaved halves, as Llama and Qwen use)."""

from __future__ import annotations

import math

import torch

from specserve.config import RopeConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


def rope_inv_freq(rope: RopeConfig, head_dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rot_dim // 2]`` and the cos/sin scale for a rope config."""
    if rope.rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope.rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if rope.rope_type == "proportional":
        return _proportional_inv_freq(rope, head_dim), 1.0
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (rope.theta**exponent)  # [dim // 2]
    scale = 1.0
    if rope.rope_type == "linear":
        inv_freq = inv_freq / float(rope.get("factor"))
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(rope, inv_freq)
    elif rope.rope_type == "yarn":
        inv_freq, scale = _yarn_inv_freq(rope, dim, max_position)
    return inv_freq, scale


def _proportional_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Gemma 4's global layers: the first ``partial_rotary_factor`` of each
    half-head pair rotates, at the frequencies of the whole head (exponents
    over ``head_dim``); the rest stays put (frequency 0). ``[head_dim // 2]``."""
    angles = int(float(rope.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    exponent = torch.arange(0, 2 * angles, 2, dtype=torch.int64, device="cpu").float() / head_dim
    rotated = 1.0 / (rope.theta**exponent)
    still = torch.zeros(head_dim // 2 - angles, device="cpu")
    return torch.cat([rotated, still]) / float(rope.get("factor", 1.0))


def _llama3_inv_freq(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    # Long wavelengths are divided by ``factor``, short ones kept, and the band
    # between the two thresholds blends both.
    factor = float(rope.get("factor"))
    low_ff = float(rope.get("low_freq_factor", 1.0))
    high_ff = float(rope.get("high_freq_factor", 4.0))
    old_ctx = float(rope.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = old_ctx / low_ff
    high_wavelen = old_ctx / high_ff
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(rope: RopeConfig, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    base = rope.theta
    old_ctx = rope.get("original_max_position_embeddings") or max_position
    factor = rope.get("factor") or max_position / old_ctx

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = rope.get("attention_factor")
    if attn_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attn_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(rope.get("beta_fast") or 32)
    high = correction_dim(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the un-interpolated frequency per dimension
    return interpolation * (1 - keep) + extrapolation * keep, float(attn_factor)


class RotaryEmbedding:
    """Applies RoPE from a cos/sin table covering positions ``[0, max_position)``.

    Not an ``nn.Module`` buffer on purpose: the table is derived state, moved to
    the device of the first input instead of being loaded. The engine rejects
    requests longer than the context length, so positions never exceed it.
    """

    def __init__(
        self, rope: RopeConfig, head_dim: int, max_position: int, extra_positions: int = 0
    ) -> None:
        """``extra_positions``: table rows past ``max_position`` (the frequencies
        still follow ``max_position``), for a drafter's block past the context end."""
        self.inv_freq, self.scale = rope_inv_freq(rope, head_dim, max_position)
        self.rot_dim = 2 * self.inv_freq.numel()
        self.head_dim = head_dim
        self._cos_sin: torch.Tensor | None = None  # [rows, 2 * rot_dim]: cos | sin
        # Explicitly on the CPU: models are built on "meta".
        self._reserve(max_position + extra_positions, torch.device("cpu"))

    def _reserve(self, length: int, device: torch.device) -> None:
        pos = torch.arange(length, dtype=torch.float32, device="cpu")
        freqs = pos[:, None] * self.inv_freq[None, :]  # [length, rot_dim // 2]
        cos, sin = freqs.cos(), freqs.sin()
        # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: one roll instead of
        # a split, a negation and a concatenation.
        table = torch.cat([cos, cos, -sin, sin], dim=-1).mul_(self.scale)
        self._cos_sin = table.to(device)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, rot_dim]`` at ``positions [T]`` in ``dtype``:
        looked up once per forward, shared by every layer."""
        assert self._cos_sin is not None
        if self._cos_sin.device != positions.device:
            self._cos_sin = self._cos_sin.to(positions.device)
        cos_sin = self._cos_sin[positions].unsqueeze(1).to(dtype)  # [T, 1, 2 * rot_dim]
        cos, sin = cos_sin.chunk(2, dim=-1)
        return cos, sin

    def rotate(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x [T, heads, D]`` (q and k heads alike) rotated by ``at(positions)``."""
        cos, sin = cos_sin
        half = self.rot_dim // 2
        if self.rot_dim == x.shape[-1]:
            return x * cos + x.roll(half, dims=-1) * sin
        rot, rest = x[..., : self.rot_dim], x[..., self.rot_dim :]
        return torch.cat([rot * cos + rot.roll(half, dims=-1) * sin, rest], dim=-1)

    def __call__(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotates ``x [T, heads, D]`` at ``positions [T]``."""
        return self.rotate(x, self.at(positions, x.dtype))
