"""Triton rotary position embedding: one read of q (or k), one write, for forward and backward.

x [S, B, H, D] (any strides, the last one 1), cos and sin [S, B', ROT] fp32 tables (B' = 1 or B),
ROT = 2 * HALF <= D, non-interleaved halves as megatron's `_rotate_half`:
    forward  o1 = x1 cos1 - x2 sin1,  o2 = x2 cos2 + x1 sin2
    backward the transpose of that map: g1 cos1 + g2 sin2, g2 cos2 - g1 sin1
with x1 = x[..., :HALF], x2 = x[..., HALF:ROT]; x[..., ROT:] passes through. Products and sums in fp32,
one rounding to the output dtype. The output is contiguous [S, B, H, D].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import LaunchCache, cdiv, next_pow2


@triton.jit
def _rope_kernel(
    x_ptr, sx_s, sx_b, sx_h,  # input [S, B, H, D], last stride 1
    cos_ptr, sin_ptr, sf_s, sf_b,  # tables [S, B', ROT], last stride 1; sf_b = 0 when B' = 1
    out_ptr,  # contiguous [S, B, H, D]
    B, H, D, HALF, N_PASS,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    INVERSE: tl.constexpr, PASS: tl.constexpr,
):
    """Program (s * B + b, head block): BLOCK_H heads of one token, their cos/sin row loaded once."""
    row = tl.program_id(0).to(tl.int64)
    s = row // B
    b = row % B
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_h = offs_h < H
    mask_d = offs_d < HALF
    mask = mask_h[:, None] & mask_d[None, :]

    f = s * sf_s + b * sf_b + offs_d
    c1 = tl.load(cos_ptr + f, mask=mask_d, other=0.0)[None, :]
    c2 = tl.load(cos_ptr + f + HALF, mask=mask_d, other=0.0)[None, :]
    s1 = tl.load(sin_ptr + f, mask=mask_d, other=0.0)[None, :]
    s2 = tl.load(sin_ptr + f + HALF, mask=mask_d, other=0.0)[None, :]

    xp = x_ptr + s * sx_s + b * sx_b + offs_h[:, None].to(tl.int64) * sx_h
    x1 = tl.load(xp + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if INVERSE:
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    op = out_ptr + (row * H + offs_h[:, None]) * D
    tl.store(op + offs_d[None, :], o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(op + HALF + offs_d[None, :], o2.to(out_ptr.dtype.element_ty), mask=mask)
    if PASS:  # the dimensions past ROT are copied
        offs_p = tl.arange(0, BLOCK_PASS)
        mask_p = mask_h[:, None] & (offs_p < N_PASS)[None, :]
        tail = tl.load(xp + 2 * HALF + offs_p[None, :], mask=mask_p)
        tl.store(op + 2 * HALF + offs_p[None, :], tail, mask=mask_p)


_ROPE = LaunchCache(_rope_kernel)


def _heads_per_program(H: int, block_half: int) -> int:
    """The power of two of heads per program that wastes the fewest masked lanes (20 heads: 4, not 32),
    the largest among equals, at most ~4K elements of each half per program."""
    options = [1 << i for i in range(max(1, 4096 // block_half).bit_length()) if (1 << i) <= next_pow2(H)]
    return min(options, key=lambda bh: (cdiv(H, bh) * bh, -bh))


def triton_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """The rotation of x [S, B, H, D] by the tables cos, sin [S, B', ROT] (fp32, contiguous), or its
    transpose (`inverse`, for backward). Shapes are checked by the caller (megatron_int8.ops.rope)."""
    S, B, H, D = x.shape
    half = cos.shape[-1] // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((S, B, H, D), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    n_pass = D - 2 * half
    block_half = next_pow2(half)
    block_h = _heads_per_program(H, block_half)
    _ROPE.launch((S * B, cdiv(H, block_h)),
                 x, x.stride(0), x.stride(1), x.stride(2),
                 cos, sin, cos.stride(0), cos.stride(1) if cos.shape[1] > 1 else 0,
                 out, B, H, D, half, n_pass,
                 BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_PASS=next_pow2(n_pass),
                 INVERSE=bool(inverse), PASS=n_pass > 0, num_warps=4)
    return out
