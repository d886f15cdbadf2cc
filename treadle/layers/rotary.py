"""Rotary position embedding (rotate-half layout, as Hugging Face Llama), with
linear and llama3 frequency scaling. cos/sin are computed exactly as transformers
does (float32 outer product of positions and inverse frequencies)."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from treadle.config import RopeScaling
from treadle.kernels import ops
from treadle.layers.fused import fused_ops_enabled, triton_ops


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by factor, blend in between
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_plain(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place oracle, exactly as Hugging Face Llama."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_in_place(
    x: torch.Tensor,  # [num_tokens, heads, head_dim], any row stride
    cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    sin: torch.Tensor,
) -> None:
    """x1, x2 = halves of each head:  x1 <- x1*cos - x2*sin,  x2 <- x2*cos + x1*sin
    (the same products and sums as the plain version, so the same bits)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    x1_sin = x1 * sin
    x1.mul_(cos).sub_(x2 * sin)
    x2.mul_(cos).add_(x1_sin)


def joint_view(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one [num_tokens, num_heads + num_kv_heads, head_dim] view when k's
    heads directly follow q's in memory (as when both are split from one qkv row)::

        qkv row:  | q heads ...... | k heads .. | v heads .. |
                  '---- one view: rotated with one set of calls ----'
    """
    d = q.shape[-1]
    if (
        q.dtype != k.dtype
        or q.shape[0] != k.shape[0]
        or q.stride() != (q.stride(0), d, 1)
        or k.stride() != (q.stride(0), d, 1)
        or k.data_ptr() != q.data_ptr() + q.shape[1] * d * q.element_size()
    ):
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], d), q.stride())


class RotaryEmbedding(nn.Module):
    cos_sin: torch.Tensor  # buffer registered in __init__

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None,
        fused: bool | None = None,
    ) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # [max_positions, head_dim]: cos of each frequency, then sin (the halves of the
        # Hugging Face [freqs, freqs] tables, which repeat; one table instead of two)
        self.register_buffer("cos_sin", torch.cat((freqs.cos(), freqs.sin()), -1), persistent=False)
        self.fused = fused_ops_enabled() if fused is None else fused

    def _one_call(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> Callable[..., None] | None:
        """The in-place RoPE of one call for these tensors: the C kernel (float32 on the CPU), the
        Triton one (CUDA), or None (torch's calls below)."""
        if not self.fused or positions.dtype != torch.int64:
            return None
        if ops.usable(q, k, self.cos_sin):
            return ops.rope_
        gpu = triton_ops(q)
        return gpu.rope_ if gpu is not None and k.stride(-1) == 1 else None

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q, k). With fused ops on, q and k are rotated in place and returned."""
        one_call = self._one_call(q, k, positions)
        if one_call is not None:
            qk = joint_view(q, k)
            parts = (q, k) if qk is None else (qk,)
            if all(x.stride(1) == x.shape[-1] for x in parts):  # heads contiguous in each row
                for x in parts:
                    one_call(x, self.cos_sin, positions.contiguous())
                return q, k
        half = q.shape[-1] // 2
        cs = self.cos_sin.index_select(0, positions).to(q.dtype).unsqueeze(1)  # [T, 1, head_dim]
        cos, sin = cs[..., :half], cs[..., half:]
        if not self.fused:
            return apply_rotary_plain(q, k, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
        qk = joint_view(q, k)
        if qk is not None:
            rotate_in_place(qk, cos, sin)
        else:
            rotate_in_place(q, cos, sin)
            rotate_in_place(k, cos, sin)
        return q, k
