"""Triton RMSNorm: forward and backward in one pass over the rows each, any row width.

x is viewed as [N, H, W] rows of width W (the last stride 1, any strides for N and H), so that a head
slice of a fused qkv output (Qwen3's k, [s, b, groups, 128]) is normalized in place of a copy. Each
program takes BLOCK_R rows at once: torch's kernels give a 128-wide row a block of its own and run 4x
slower per byte there than over a 4096-wide row (docs/history.md, 2026-11-22).

    forward   r = 1 / sqrt(mean(x^2) + eps),  y = x r w           (fp32 math, one rounding of y)
    backward  g = dy w,  dx = r (g - x r mean(g x r)),  dw = sum over rows of dy x r
The weight gradient is summed per program in fp32 over a contiguous run of rows, then the per-program
partial sums by a second, small launch (`_sum_rows_kernel`): no atomics, the same order every run. dx can be
written into a strided destination (a head slice of a fused QKV gradient), so that no cat gathers it.

INT8_COPY (the recipe's int8_norm_input): the forward also writes x's INT8 copy for backward, each row in 1 x QB
blocks (reference.quantize's block granularity, QB = 128 in training): q [R, W] int8 and scales [R, ceil(W/QB)]
fp32; the backward then reads q and the scales in place of x (x = q * scale in fp32) with forward's rstd.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import LaunchCache, cdiv, device_index, next_pow2, num_sms
from ._tl import atomic_max_of, max_keep_nan, max_to_inf
from .quantize import _round_clamp, _scale_from_amax


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, sx_n, sx_h,  # input [N, H, W], last stride 1
    w_ptr, y_ptr, rstd_ptr,  # weight [W]; contiguous output [N * H, W]; fp32 1/rms per row
    q_ptr, qs_ptr,  # INT8_COPY: x's copy [N * H, W] int8 and its 1 x QB block scales [N * H, NB]
    R, H, W, eps, NB,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, INT8_COPY: tl.constexpr, QB: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_W)
    mask_r = rows < R
    mask = mask_r[:, None] & (cols < W)[None, :]
    src = (rows // H) * sx_n + (rows % H) * sx_h
    x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / W + eps)
    w = tl.load(w_ptr + cols, mask=cols < W, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + rows[:, None] * W + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=mask_r)
    if INT8_COPY:  # masked lanes are 0: a block past W gets scale 1 and is not stored
        blocks = tl.reshape(x, (BLOCK_R, BLOCK_W // QB, QB))
        scale = _scale_from_amax(max_to_inf(tl.abs(blocks), 2))
        q = tl.reshape(_round_clamp(blocks, scale[:, :, None], 0.0, False), (BLOCK_R, BLOCK_W))
        tl.store(q_ptr + rows[:, None] * W + cols[None, :], q, mask=mask)
        bcols = tl.arange(0, BLOCK_W // QB)
        tl.store(qs_ptr + rows[:, None] * NB + bcols[None, :], scale, mask=mask_r[:, None] & (bcols < NB)[None, :])


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, sdy_n, sdy_h,  # output gradient [N, H, W], last stride 1
    x_ptr, sx_n, sx_h,  # forward input [N, H, W], last stride 1
    w_ptr, rstd_ptr,
    dx_ptr, sdx_n, sdx_h,  # input gradient [N, H, W], last stride 1
    dw_part_ptr,  # fp32 [programs, W]
    amax_ptr,  # AMAX: fp32 max |dx| (as stored; Inf/NaN as inf) folded into it by atomic max
    qs_ptr,  # INT8_COPY: x_ptr is x's INT8 copy [R, W] (contiguous), these its 1 x QB block scales [R, NB]
    R, H, W, ROWS_PER_PROGRAM, NB,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, AMAX: tl.constexpr, INT8_COPY: tl.constexpr, QB: tl.constexpr,
):
    """Program p: rows [p * ROWS_PER_PROGRAM, (p + 1) * ROWS_PER_PROGRAM), BLOCK_R at a time. AMAX: max |dx|
    for a tensorwise quantization of a gradient that holds dx, so that it skips its own amax pass."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_W)
    mask_c = cols < W
    w = tl.load(w_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_R, BLOCK_W), dtype=tl.float32)
    dx_max = tl.zeros((BLOCK_R, BLOCK_W), dtype=tl.float32)
    first = pid.to(tl.int64) * ROWS_PER_PROGRAM
    end = tl.minimum(first + ROWS_PER_PROGRAM, R)
    for start in range(first, end, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        mask_r = rows < end
        mask = mask_r[:, None] & mask_c[None, :]
        n, h = rows // H, rows % H
        x = tl.load(x_ptr + (n * sx_n + h * sx_h)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if INT8_COPY:  # q * scale in fp32, as reference.dequantize
            bcols = tl.arange(0, BLOCK_W // QB)
            scale = tl.load(qs_ptr + rows[:, None] * NB + bcols[None, :], mask=mask_r[:, None] & (bcols < NB)[None, :],
                            other=0.0)
            x = tl.reshape(tl.reshape(x, (BLOCK_R, BLOCK_W // QB, QB)) * scale[:, :, None], (BLOCK_R, BLOCK_W))
        dy = tl.load(dy_ptr + (n * sdy_n + h * sdy_h)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=mask_r, other=0.0)
        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * xhat, axis=1) / W
        dx = (g - xhat * c[:, None]) * rstd[:, None]
        dx = dx.to(dx_ptr.dtype.element_ty)
        tl.store(dx_ptr + (n * sdx_n + h * sdx_h)[:, None] + cols[None, :], dx, mask=mask)
        dw += dy * xhat
        if AMAX:  # of the stored values; NaN kept (a plain max would drop it), mapped to inf below
            dx_max = max_keep_nan(dx_max, tl.abs(dx.to(tl.float32)))
    tl.store(dw_part_ptr + pid * W + cols, tl.sum(dw, axis=0), mask=mask_c)
    if AMAX:
        atomic_max_of(amax_ptr, max_to_inf(dx_max, None), None)


@triton.jit
def _sum_rows_kernel(part_ptr, out_ptr, P, W, BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr):
    """out[c] = sum over p of part[p, c] (fp32 [P, W] contiguous), in out's dtype; program j takes BLOCK_W
    columns and walks the P rows in order."""
    cols = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask_c = cols < W
    acc = tl.zeros((BLOCK_P, BLOCK_W), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        acc += tl.load(part_ptr + rows[:, None] * W + cols[None, :], mask=(rows < P)[:, None] & mask_c[None, :],
                       other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=mask_c)


_FWD = LaunchCache(_rms_norm_fwd_kernel)
_BWD = LaunchCache(_rms_norm_bwd_kernel)
_SUM = LaunchCache(_sum_rows_kernel)
_TILE = 4096  # elements per program and step (at least): 16 fp32 values per thread at 8 warps
_WARPS = 8
_SUM_COLUMNS = 32  # columns per program of the weight-gradient sum


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [N, H, W] with the last stride 1: a view where the leading dimensions merge, else a copy."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(1)
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def _rows_in_place(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A destination `t` (shape and dtype of `like`, last stride 1) as the [N, H, W] view that _rows gives
    `like`; a ValueError where that would need a copy, since the kernel must write t itself."""
    if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device or t.stride(-1) != 1:
        raise ValueError(f"rms_norm: a dx destination {tuple(t.shape)} {t.dtype} (strides {t.stride()}) for an "
                         f"input {tuple(like.shape)} {like.dtype}")
    try:
        return t.view(_rows(like).shape)
    except RuntimeError as e:
        raise ValueError(f"rms_norm: the dx destination's strides {t.stride()} do not merge into rows") from e


def _blocks(W: int) -> tuple:
    """(rows, padded width) per program and step: whole rows, about _TILE elements."""
    block_w = next_pow2(W)
    return max(1, _TILE // block_w), block_w


def _max_backward_programs(index: int) -> int:
    """Four programs per SM of CUDA device `index`: enough to hide load latency, few enough that the
    weight-gradient partial sums stay small."""
    return 4 * num_sms(index)


def triton_rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, int8_block: int = 0):
    """(y, rstd): y of x's shape and dtype, contiguous; rstd fp32, one per row (x.numel() // W). `int8_block`:
    (y, rstd, q, scales) with x's INT8 copy in 1 x int8_block blocks (q of x's shape, scales [rows, NB])."""
    W = x.shape[-1]
    x3 = _rows(x)
    N, H = x3.shape[0], x3.shape[1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(N * H, dtype=torch.float32, device=x.device)
    block_r, block_w = _blocks(W)
    copy = ()
    if int8_block:
        _check_int8_block(int8_block, block_w)
        copy = (torch.empty(x.shape, dtype=torch.int8, device=x.device),
                torch.empty((N * H, cdiv(W, int8_block)), dtype=torch.float32, device=x.device))
    if y.numel() == 0:
        return (y, rstd, *copy)
    _FWD.launch((cdiv(N * H, block_r),), x3, x3.stride(0), x3.stride(1), weight, y, rstd, *(copy or (y, y)),
                N * H, H, W, float(eps), copy[1].shape[1] if copy else 1, BLOCK_R=block_r, BLOCK_W=block_w,
                INT8_COPY=bool(copy), QB=int8_block or 1, num_warps=_WARPS)
    return (y, rstd, *copy)


def _check_int8_block(block: int, block_w: int) -> None:
    if block < 16 or block & (block - 1) or block > block_w:
        raise ValueError(f"rms_norm: the INT8 copy's block must be a power of two >= 16 and at most the padded row "
                         f"width {block_w}, got {block}")


def triton_rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                              dx: torch.Tensor = None, amax: torch.Tensor = None, int8_copy: tuple = ()):
    """(dx, dw): dx of x's shape and dtype, contiguous, or written into the given `dx` (any strides that merge
    into rows like x's, e.g. a head slice of a fused QKV gradient); dw of weight's dtype. `amax`: a 1-element
    fp32 tensor, zero or holding a max of other values, into which max |dx| is folded (Inf/NaN as inf).
    `int8_copy`: (scales, block) when x is forward's INT8 copy q; dx then has dy's dtype."""
    W = x.shape[-1]
    x3, dy3 = _rows(x), _rows(dy)
    R, H = x3.shape[0] * x3.shape[1], x3.shape[1]
    scales, qb = int8_copy or (None, 0)
    if int8_copy:
        _check_int8_block(qb, next_pow2(W))
        if x.dtype != torch.int8 or not x.is_contiguous() or scales.shape != (R, cdiv(W, qb)) \
                or scales.dtype != torch.float32:
            raise ValueError(f"rms_norm backward: an INT8 copy must be contiguous int8 with fp32 scales [{R}, "
                             f"{cdiv(W, qb)}], got {x.dtype} {tuple(x.shape)} and {scales.dtype} {tuple(scales.shape)}")
        if dx is not None:  # x is q (contiguous): dx is a new contiguous tensor of dy's dtype
            raise ValueError("rms_norm backward: no dx destination with an INT8 copy")
        dx = torch.empty(x.shape, dtype=dy.dtype, device=x.device)
        dx3 = dx.view(x3.shape)
    else:
        if dx is None:
            dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dx3 = _rows_in_place(dx, x)
    if dx.numel() == 0:
        return dx, torch.zeros_like(weight)
    block_r, block_w = _blocks(W)
    if x.device.type == "cuda":
        max_programs = _max_backward_programs(device_index(x.device))
    else:  # the interpreter: a few programs, so that each loops over several row blocks
        max_programs = 4
    rows_per_program = cdiv(cdiv(R, min(max_programs, cdiv(R, block_r))), block_r) * block_r
    programs = cdiv(R, rows_per_program)
    dw_part = torch.empty((programs, W), dtype=torch.float32, device=x.device)
    if amax is not None and (amax.dtype != torch.float32 or amax.numel() != 1 or amax.device != x.device):
        raise ValueError(f"rms_norm: amax must be one float32 element on {x.device}, got {tuple(amax.shape)} "
                         f"{amax.dtype} on {amax.device}")
    _BWD.launch((programs,), dy3, dy3.stride(0), dy3.stride(1), x3, x3.stride(0), x3.stride(1), weight, rstd,
                dx3, dx3.stride(0), dx3.stride(1), dw_part, dw_part if amax is None else amax,
                dw_part if scales is None else scales, R, H, W, rows_per_program, scales.shape[1] if int8_copy else 1,
                BLOCK_R=block_r, BLOCK_W=block_w, AMAX=amax is not None, INT8_COPY=bool(int8_copy), QB=qb or 1,
                num_warps=_WARPS)
    dw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    sum_w = min(block_w, _SUM_COLUMNS)
    _SUM.launch((cdiv(W, sum_w),), dw_part, dw, programs, W, BLOCK_P=max(1, _TILE // sum_w), BLOCK_W=sum_w,
                num_warps=4)
    return dx, dw
