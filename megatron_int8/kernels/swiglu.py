"""Triton SwiGLU: forward and backward in one pass each, optionally with the maxima of what they write.

x [R, 2F] holds the two halves a = x[:, :F], b = x[:, F:] (megatron's fc1 output, chunked on the last
dimension); every row stride is allowed, the last stride must be 1.
    forward   y = silu(a) b                                  y [R, F]
    backward  da = dy b s (1 + a (1 - s)),  db = dy a s       dx = [da | db] [R, 2F], s = sigmoid(a)
fp32 math, one rounding to x's dtype, as megatron's fused SwiGLU (torch.compile) does.

WEIGHTED (MoE experts, megatron's weighted SwiGLU): each row r carries the router probability p[r],
    forward   y = silu(a) b p
    backward  dx as above with dy p in place of dy;  dp[r] = sum over the row of silu(a) b dy
The row sums are written as partial sums per column block, [n_ct, R] fp32, added up by one torch.sum.

INT8_COPY (the recipe's int8_swiglu_input): the forward kernel also writes x's INT8 copy for backward, each
half quantized in 1 x TC blocks along its columns (TC = the block size, 128 in training): q [R, 2F] int8 and
scales [R, 2 NB] fp32, NB = ceil(F / TC), a's blocks first. The quantization is reference.quantize's (block
granularity: scale = amax / 127 (at least 2^-126), 1 for an all-zero block, NaN for one holding Inf/NaN; round half
to even), so backward, which then reads q and the scales in place of x (dequantized in fp32, q * scale), needs half
x's bytes.

MAXIMA: the kernel also writes the per-row and per-column maxima of |output| (of the rounded values, Inf/NaN
as inf), folded by atomic max into one zeroed buffer as kernels/quantize's amax pass does. The INT8 linear
that quantizes y (fc2's input) or dx
(fc1's output gradient) row-wise then skips its own amax pass over a tensor of 8192 x 9728 or
8192 x 19456 elements in a Qwen3-4B layer (megatron_int8.ops.swiglu hands the maxima over).

Each program walks a strip of RB rows of a TC-column block in TR-row steps (software-pipelined), so its
column maxima accumulate in registers and are folded in once per strip, as the amax pass does.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .launch import INTERPRETING, LaunchCache, cdiv
from ._tl import atomic_max_of, max_keep_nan, max_to_inf, strip_program, strip_step
from .quantize import _round_clamp, _scale_from_amax


@triton.jit
def _store_int8_blocks(v, mask, mask_r, q_ptrs, s_ptrs):
    """Quantize a [TR, TC] fp32 tile (masked lanes 0) as one 1 x TC block per row: the int8 values to q_ptrs
    [TR, TC], the scales to s_ptrs [TR]."""
    scale = _scale_from_amax(max_to_inf(tl.abs(v), 1))
    tl.store(q_ptrs, _round_clamp(v, scale[:, None], 0.0, False), mask=mask)
    tl.store(s_ptrs, scale, mask=mask_r)


@triton.jit
def _swiglu_fwd_kernel(
    x_ptr, stride_xr,  # [R, 2F], last stride 1
    y_ptr,  # [R, F], contiguous
    rmax_ptr, cmax_ptr,  # MAXIMA: [R] and [F] maxima of |y|, zeroed
    p_ptr,  # WEIGHTED: [R] row weights (router probabilities)
    q_ptr, qs_ptr,  # INT8_COPY: x's INT8 copy [R, 2F] and its 1 x TC block scales [R, 2 NB]
    R, F, RB,
    TR: tl.constexpr, TC: tl.constexpr, STAGES: tl.constexpr, MAXIMA: tl.constexpr, WEIGHTED: tl.constexpr,
    INT8_COPY: tl.constexpr,
):
    rs, ct, n_ct, offs_c, mask_c = strip_program(F, TC)
    acc = tl.zeros((TR, TC), tl.float32)
    for r0 in tl.range(0, RB, TR, num_stages=STAGES):
        offs_r, mask_r, mask = strip_step(rs, RB, r0, R, mask_c, TR)
        src = x_ptr + offs_r[:, None].to(tl.int64) * stride_xr + offs_c[None, :]
        a = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(src + F, mask=mask, other=0.0).to(tl.float32)
        if INT8_COPY:
            q_dst = q_ptr + offs_r[:, None].to(tl.int64) * (2 * F) + offs_c[None, :]
            s_dst = qs_ptr + offs_r.to(tl.int64) * (2 * n_ct) + ct
            _store_int8_blocks(a, mask, mask_r, q_dst, s_dst)
            _store_int8_blocks(b, mask, mask_r, q_dst + F, s_dst + n_ct)
        y = a * tl.sigmoid(a) * b
        if WEIGHTED:
            y = y * tl.load(p_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)[:, None]
        y = y.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs_r[:, None].to(tl.int64) * F + offs_c[None, :], y, mask=mask)
        if MAXIMA:
            m = tl.abs(y.to(tl.float32))  # masked lanes hold silu(0) * 0 = 0
            atomic_max_of(rmax_ptr + offs_r, max_to_inf(m, 1), mask_r)
            acc = max_keep_nan(acc, m)
    if MAXIMA:
        atomic_max_of(cmax_ptr + offs_c, max_to_inf(acc, 0), mask_c)


@triton.jit
def _swiglu_bwd_kernel(
    g_ptr, stride_gr,  # dy [R, F], last stride 1
    x_ptr, stride_xr,  # forward input [R, 2F], last stride 1; INT8_COPY: its INT8 copy (stride 2F)
    dx_ptr,  # [R, 2F], contiguous
    rmax_ptr, cmax_ptr,  # MAXIMA: [R] and [2F] maxima of |dx|, zeroed
    p_ptr, dp_ptr,  # WEIGHTED: [R] row weights; [n_ct, R] fp32 partial sums of their gradient
    qs_ptr,  # INT8_COPY: the INT8 copy's 1 x TC block scales [R, 2 NB]
    R, F, RB,
    TR: tl.constexpr, TC: tl.constexpr, STAGES: tl.constexpr, MAXIMA: tl.constexpr, WEIGHTED: tl.constexpr,
    INT8_COPY: tl.constexpr,
):
    rs, ct, n_ct, offs_c, mask_c = strip_program(F, TC)
    acc_a = tl.zeros((TR, TC), tl.float32)
    acc_b = tl.zeros((TR, TC), tl.float32)
    for r0 in tl.range(0, RB, TR, num_stages=STAGES):
        offs_r, mask_r, mask = strip_step(rs, RB, r0, R, mask_c, TR)
        rows = offs_r[:, None].to(tl.int64)
        g = tl.load(g_ptr + rows * stride_gr + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
        src = x_ptr + rows * stride_xr + offs_c[None, :]
        a = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(src + F, mask=mask, other=0.0).to(tl.float32)
        if INT8_COPY:  # q * scale in fp32, as reference.dequantize
            scales = qs_ptr + offs_r.to(tl.int64) * (2 * n_ct) + ct
            a = a * tl.load(scales, mask=mask_r, other=0.0)[:, None]
            b = b * tl.load(scales + n_ct, mask=mask_r, other=0.0)[:, None]
        s = tl.sigmoid(a)
        if WEIGHTED:  # masked lanes: a = 0 adds nothing to the row sums
            tl.store(dp_ptr + ct.to(tl.int64) * R + offs_r, tl.sum(a * s * b * g, 1), mask=mask_r)
            g = g * tl.load(p_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)[:, None]
        da = (g * b * s * (1.0 + a * (1.0 - s))).to(dx_ptr.dtype.element_ty)
        db = (g * a * s).to(dx_ptr.dtype.element_ty)
        dst = dx_ptr + rows * (2 * F) + offs_c[None, :]
        tl.store(dst, da, mask=mask)
        tl.store(dst + F, db, mask=mask)
        if MAXIMA:
            ma = tl.abs(da.to(tl.float32))
            mb = tl.abs(db.to(tl.float32))
            atomic_max_of(rmax_ptr + offs_r, tl.maximum(max_to_inf(ma, 1), max_to_inf(mb, 1)), mask_r)
            acc_a = max_keep_nan(acc_a, ma)
            acc_b = max_keep_nan(acc_b, mb)
    if MAXIMA:
        atomic_max_of(cmax_ptr + offs_c, max_to_inf(acc_a, 0), mask_c)
        atomic_max_of(cmax_ptr + F + offs_c, max_to_inf(acc_b, 0), mask_c)


_FWD = LaunchCache(_swiglu_fwd_kernel)
_BWD = LaunchCache(_swiglu_bwd_kernel)

# register tile (rows x columns of y), warps and pipeline stages; strips of rows per column block, at most.
# 16 x 128 on 4 warps: of eleven tiles timed on an H200 (docs/history.md, 2026-11-22), the fastest with
# maxima at F = 9728, 11008 and 14336 (Qwen3-4B fwd + bwd 358 us for 8192 rows, against 402 us for the
# 32 x 256 tile on 8 warps chosen on an H100 on 2026-11-22), and level with it without maxima.
# The interpreter runs numpy per program: small tiles keep CPU tests quick and exercise multi-step strips.
if INTERPRETING:
    _TILE, _WARPS, _STAGES, _MAX_STRIPS = (4, 16), 4, 1, 3
else:
    _TILE, _WARPS, _STAGES, _MAX_STRIPS = (16, 128), 4, 3, 32


def _strips(R: int, F: int, TR: int, TC: int) -> Tuple[int, int, int]:
    """(rows per program RB, row strips n_rs, column blocks n_ct): few strips, so few column atomics."""
    n_rt = cdiv(R, TR)
    strips = max(1, min(_MAX_STRIPS, n_rt))
    RB = cdiv(n_rt, strips) * TR
    return RB, cdiv(R, RB), cdiv(F, TC)


def _launch(cache: LaunchCache, lead: tuple, weights: tuple, R: int, F: int, C: int, maxima: bool, device,
            tile: Optional[tuple] = None,
            int8_copy: tuple = ()) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Launch one pass over [R, F] with C output columns; (row maxima [R], column maxima [C]) if `maxima`.
    `weights`: the WEIGHTED pointers (forward: p; backward: p and dp's partial sums), or () for plain SwiGLU.
    `int8_copy`: the INT8_COPY pointers (forward: q and its scales, written; backward: the scales), or ()."""
    TR, TC = tile or _TILE
    RB, n_rs, n_ct = _strips(R, F, TR, TC)
    rmax, cmax = _zeroed_maxima(R, C, device, maxima)
    stand_in = lead[0]  # for the pointers of a mode that is off: never touched
    forward = cache is _FWD
    cache.launch((n_rs, n_ct), *lead, rmax if maxima else stand_in, cmax if maxima else stand_in,
                 *(weights or (stand_in,) * (1 if forward else 2)), *(int8_copy or (stand_in,) * (2 if forward else 1)),
                 R, F, RB, TR=TR, TC=TC, STAGES=_STAGES, MAXIMA=maxima, WEIGHTED=bool(weights),
                 INT8_COPY=bool(int8_copy), num_warps=_WARPS)
    return rmax, cmax


def _zeroed_maxima(R: int, C: int, device, maxima: bool):
    """(row maxima [R], column maxima [C]) views of one zeroed buffer for the kernels to fold into (an empty
    output keeps the zeros: an all-zero group's scale is 1), or None, None."""
    if not maxima:
        return None, None
    zeros = torch.zeros(R + C, dtype=torch.float32, device=device)
    return zeros[:R], zeros[R:]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, last dimension] with the last stride 1: a view where the leading dimensions merge."""
    t2 = t.reshape(math.prod(t.shape[:-1]), t.shape[-1])  # not -1: a last dimension of 0 leaves it ambiguous
    return t2 if t2.stride(1) == 1 else t2.contiguous()


def _check(x: torch.Tensor) -> int:
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dimension of x must be even (two halves), got shape {tuple(x.shape)}")
    return x.shape[-1] // 2


def _row_weights(probs: Optional[torch.Tensor], x: torch.Tensor) -> Optional[torch.Tensor]:
    """The router probabilities as a contiguous [R] vector, checked against x [..., 2F]."""
    if probs is None:
        return None
    if tuple(probs.shape) != tuple(x.shape[:-1]) or not probs.is_floating_point() or probs.device != x.device:
        raise ValueError(f"weighted swiglu: probs must be floating point of shape {tuple(x.shape[:-1])} on "
                         f"{x.device}, got {probs.dtype} {tuple(probs.shape)} on {probs.device}")
    return probs.reshape(-1).contiguous()


def triton_swiglu_forward(x: torch.Tensor, maxima: bool = False, probs: Optional[torch.Tensor] = None):
    """(y, row maxima [R] or None, column maxima [F] or None) of x [..., 2F]; y [..., F] contiguous,
    R = rows of y. `probs` [...]: each row's weight (the weighted SwiGLU)."""
    return _forward(x, maxima, probs, None)[:3]


def triton_swiglu_forward_int8_copy(x: torch.Tensor, block: int, maxima: bool = False):
    """(y, row maxima or None, column maxima or None, q, scales): triton_swiglu_forward's results plus x's INT8
    copy for backward, q (x's shape, int8, contiguous) with each half's 1 x `block` scales [R, 2 ceil(F/block)]
    (reference.quantize's block quantization of a = x[..., :F] and of b = x[..., F:], side by side)."""
    return _forward(x, maxima, None, _check_block(block))


def _check_block(block: int) -> int:
    if block < 16 or block & (block - 1):
        raise ValueError(f"swiglu: the INT8 copy's block size must be a power of two >= 16, got {block}")
    return block


def _block_tile(block: Optional[int]) -> Optional[tuple]:
    """The register tile of a launch that writes or reads the INT8 copy: one column block of the program = one
    quantization block of each half (None: the default tile)."""
    return None if block is None else (_TILE[0], block)


def _forward(x, maxima, probs, block):
    F = _check(x)
    p = _row_weights(probs, x)
    x2 = _rows(x)
    R = x2.shape[0]
    y = torch.empty((*x.shape[:-1], F), dtype=x.dtype, device=x.device)
    copy = ()
    if block is not None:
        copy = (torch.empty(x.shape, dtype=torch.int8, device=x.device),
                torch.empty((R, 2 * cdiv(F, block)), dtype=torch.float32, device=x.device))
    if y.numel() == 0:
        return (y, *_zeroed_maxima(R, F, x.device, maxima), *copy)
    rows, cols = _launch(_FWD, (x2, x2.stride(0), y), () if p is None else (p,), R, F, F, maxima, x.device,
                         _block_tile(block), copy)
    return (y, rows, cols, *copy)


def _backward(dy, x, maxima, probs, block=None, copy_scales=None):
    """(dx, row maxima, column maxima, dprobs) for the backward entry points; None where not asked for. With
    `copy_scales`, x is the INT8 copy (forward's q) and these its scales per `block` columns."""
    tile = _block_tile(block)
    F = _check(x)
    if dy.shape != (*x.shape[:-1], F):
        raise ValueError(f"swiglu backward: dy {tuple(dy.shape)} does not match x {tuple(x.shape)}")
    p = _row_weights(probs, x)
    x2, dy2 = _rows(x), _rows(dy)
    R = x2.shape[0]
    dx = torch.empty(x.shape, dtype=dy.dtype if copy_scales is not None else x.dtype, device=x.device)
    if dx.numel() == 0:
        dp = None if p is None else torch.zeros_like(probs)
        return (dx, *_zeroed_maxima(R, 2 * F, x.device, maxima), dp)
    partial_dp = None if p is None else torch.empty((_strips(R, F, *(tile or _TILE))[2], R), dtype=torch.float32,
                                                    device=x.device)
    rows, cols = _launch(_BWD, (dy2, dy2.stride(0), x2, x2.stride(0), dx), () if p is None else (p, partial_dp),
                         R, F, 2 * F, maxima, x.device, tile, () if copy_scales is None else (copy_scales,))
    dp = None if p is None else partial_dp.sum(0).to(probs.dtype).view(probs.shape)
    return dx, rows, cols, dp


def triton_swiglu_backward(dy: torch.Tensor, x: torch.Tensor, maxima: bool = False):
    """(dx, row maxima [R] or None, column maxima [2F] or None) for dy [..., F] and x [..., 2F]; dx of x's
    shape, contiguous."""
    return _backward(dy, x, maxima, None)[:3]


def triton_swiglu_backward_int8_copy(dy: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                                     maxima: bool = False):
    """triton_swiglu_backward from x's INT8 copy (triton_swiglu_forward_int8_copy's q and scales) instead of x,
    dequantized in the kernel; dx of q's shape in dy's dtype."""
    F = _check(q)
    R = math.prod(q.shape[:-1])
    if q.dtype != torch.int8 or not q.is_contiguous() or scales.shape != (R, 2 * cdiv(F, _check_block(block))) \
            or scales.dtype != torch.float32 or scales.device != q.device:
        raise ValueError(f"swiglu backward: q must be a contiguous int8 tensor [..., 2F] with fp32 scales "
                         f"[{R}, {2 * cdiv(F, block)}], got {q.dtype} {tuple(q.shape)} and {scales.dtype} "
                         f"{tuple(scales.shape)}")
    return _backward(dy, q, maxima, None, block, scales)[:3]


def triton_weighted_swiglu_backward(dy: torch.Tensor, x: torch.Tensor, probs: torch.Tensor):
    """(dx, dprobs) of the weighted SwiGLU y = silu(a) b probs: dx as x, contiguous; dprobs as probs (the row
    sums in fp32, rounded once to probs' dtype)."""
    dx, _, _, dp = _backward(dy, x, False, probs)
    return dx, dp
