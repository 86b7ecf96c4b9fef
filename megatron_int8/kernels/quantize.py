"""Triton INT8 quantization: amax, scale, round, clamp, and the fused quantize+transpose.

Contract (identical to megatron_int8.quantize, see its docstring): an operand x [R, C] has its contraction
axis last. `rowwise` returns Q(x) [R, C], `columnwise` returns Q(x^T) [C, R], both K-major as Hopper's INT8
tensor cores need. scale = amax / 127 in fp32 (IEEE division, 1.0 for an all-zero group, NaN for a group
holding Inf/NaN), q = clamp(round_half_even(x_fp32 / scale), -127, 127) with an IEEE-correct division
(`tl.math.div_rn`), so the int8 data and the scales are bit-identical to the PyTorch reference.

Kernels
- `_amax_partials_kernel` (tensor and row granularity): one read of x in [TR, TC] tiles; writes each
  tile's max |x| and/or each row's / column's max over the tile. No atomics: the partial maxima are reduced
  by `_finalize_kernel` (a tiny second pass that also computes the scales).
- `_quantize_tile_kernel`: one read of x in tiles; writes Q(x) and/or Q(x)^T from the same registers
  (the transposed store goes through shared memory via `tl.trans`, so both stores are coalesced). Modes:
  tensorwise scale given, per-row/per-column scale vectors given, or scales computed inside the tile for
  the block recipe (BxB weight tiles: one scale, stored for Q(x) and transposed for Q(x)^T; 1xB tiles:
  row maxima for Q(x) and column maxima for Q(x^T), both from one read). The block recipe is therefore a
  single pass over x; tensor and row granularity need two (amax, then quantize).
- Stochastic rounding: floor(v + u), u ~ U[0, 1) from Philox (`tl.rand`) keyed by the element's index
  in x, so Q(x) and Q(x)^T share their random draws (Q(x)^T is then exactly the transpose of Q(x)).
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

import importlib

# the module, not the `quantize` function that megatron_int8/__init__ re-exports under the same name
ref = importlib.import_module("megatron_int8.quantize")

QMAX = 127.0
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# tile modes of _quantize_tile_kernel
_MODE_TENSOR, _MODE_VECTORS, _MODE_TILE2D, _MODE_1XB = 0, 1, 2, 3


@triton.jit
def _abs_nonfinite_to_inf(x):
    """|x| with NaN mapped to +inf, so a max-reduction turns any Inf/NaN into amax = inf."""
    a = tl.abs(x)
    return tl.where(a == a, a, float("inf"))


@triton.jit
def _scale_from_amax(amax):
    """amax/127 (IEEE division); 1.0 for amax == 0; NaN for a non-finite amax."""
    s = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    s = tl.where(amax > 0, s, 1.0)
    return tl.where(amax < float("inf"), s, float("nan"))


@triton.jit
def _round_clamp(x, s, offs, seed, STOCHASTIC: tl.constexpr):
    """int8 clamp(round(x / s)); x / s is IEEE division; half-to-even or stochastic rounding."""
    v = tl.math.div_rn(x, s)
    v = tl.where(v == v, v, 0.0)  # NaN: non-finite scale (or 0/0), whose scale marks it NaN anyway
    # clamp before rounding: the bounds are integers and rounding is monotone, so the result is the same
    v = tl.minimum(tl.maximum(v, -127.0), 127.0)
    if STOCHASTIC:
        u = tl.rand(seed, offs)
        v = tl.minimum(tl.floor(v + u), 127.0)
    else:
        # round half to even: adding 1.5 * 2^23 leaves no fraction bits in fp32 (|v| <= 127)
        v = (v + 12582912.0) - 12582912.0
    return v.to(tl.int8)


@triton.jit
def _amax_partials_kernel(
    x_ptr, R, C, stride_xr, stride_xc,
    ptile_ptr, prow_ptr, pcol_ptr,
    TR: tl.constexpr, TC: tl.constexpr,
    TILE_MAX: tl.constexpr, ROW_MAX: tl.constexpr, COL_MAX: tl.constexpr,
):
    rt = tl.program_id(0)
    ct = tl.program_id(1)
    n_ct = tl.num_programs(1)
    offs_r = rt * TR + tl.arange(0, TR)
    offs_c = ct * TC + tl.arange(0, TC)
    mask_r = offs_r < R
    mask_c = offs_c < C
    mask = mask_r[:, None] & mask_c[None, :]
    x = tl.load(x_ptr + offs_r[:, None].to(tl.int64) * stride_xr + offs_c[None, :] * stride_xc, mask=mask, other=0.0)
    a = _abs_nonfinite_to_inf(x.to(tl.float32))
    if TILE_MAX:
        tl.store(ptile_ptr + rt * n_ct + ct, tl.max(tl.max(a, axis=1), axis=0))
    if ROW_MAX:  # prow [R, n_ct]
        tl.store(prow_ptr + offs_r.to(tl.int64) * n_ct + ct, tl.max(a, axis=1), mask=mask_r)
    if COL_MAX:  # pcol [n_rt, C]
        tl.store(pcol_ptr + rt.to(tl.int64) * C + offs_c, tl.max(a, axis=0), mask=mask_c)


@triton.jit
def _finalize_kernel(
    p_ptr, amax_ptr, scale_ptr, n_out, n_red, stride_out, stride_red,
    BO: tl.constexpr, BRED: tl.constexpr,
):
    """amax[i] = max_j p[i, j] (p addressed through strides), scale[i] = scale_from_amax(amax[i])."""
    offs_o = tl.program_id(0) * BO + tl.arange(0, BO)
    mask_o = offs_o < n_out
    # elementwise maxima in the loop, one reduction after it (a reduction inside the loop trips
    # triton 3.6's OptimizeThreadLocality pass)
    acc = tl.zeros((BO, BRED), tl.float32)
    for j0 in range(0, n_red, BRED):
        offs_j = j0 + tl.arange(0, BRED)
        m = mask_o[:, None] & (offs_j < n_red)[None, :]
        p = tl.load(p_ptr + offs_o[:, None].to(tl.int64) * stride_out + offs_j[None, :] * stride_red, mask=m, other=0.0)
        acc = tl.maximum(acc, p)
    amax = tl.max(acc, axis=1)
    tl.store(amax_ptr + offs_o, amax, mask=mask_o)
    tl.store(scale_ptr + offs_o, _scale_from_amax(amax), mask=mask_o)


@triton.jit
def _quantize_tile_kernel(
    x_ptr, R, C, stride_xr, stride_xc,
    q_ptr, qt_ptr,  # Q(x) [R, C] and Q(x^T) [C, R], contiguous
    s_ptr, st_ptr,  # scales of Q(x) and of Q(x^T) (read in modes 0/1, written in modes 2/3)
    ss_r, ss_c, sts_r, sts_c,  # strides of the 2-D block-scale arrays (modes 2/3)
    GR, GC,  # rows / columns covered by one program (the block size in modes 2/3)
    seed,
    TR: tl.constexpr, TC: tl.constexpr,  # power-of-two register tile >= (GR, GC)
    MODE: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, STOCHASTIC: tl.constexpr,
):
    rt = tl.program_id(0)
    ct = tl.program_id(1)
    ir = tl.arange(0, TR)
    ic = tl.arange(0, TC)
    offs_r = rt * GR + ir
    offs_c = ct * GC + ic
    mask_r = (ir < GR) & (offs_r < R)
    mask_c = (ic < GC) & (offs_c < C)
    mask = mask_r[:, None] & mask_c[None, :]
    x = tl.load(x_ptr + offs_r[:, None].to(tl.int64) * stride_xr + offs_c[None, :] * stride_xc, mask=mask, other=0.0)
    x = x.to(tl.float32)
    lin = offs_r[:, None] * C + offs_c[None, :]  # element index in x: the random stream's counter
    q_offs = offs_r[:, None].to(tl.int64) * C + offs_c[None, :]
    qt_offs = offs_c[:, None].to(tl.int64) * R + offs_r[None, :]
    mask_t = mask_c[:, None] & mask_r[None, :]

    if MODE == 0:  # one tensorwise scale, already computed
        s = tl.load(s_ptr)
        q = _round_clamp(x, s, lin, seed, STOCHASTIC)
        if ROW:
            tl.store(q_ptr + q_offs, q, mask=mask)
        if COL:
            tl.store(qt_ptr + qt_offs, tl.trans(q), mask=mask_t)
    elif MODE == 2:  # BxB tile: one scale for the tile, transposed for Q(x^T)
        amax = tl.max(tl.max(_abs_nonfinite_to_inf(x), axis=1), axis=0)
        s = _scale_from_amax(amax)
        q = _round_clamp(x, s, lin, seed, STOCHASTIC)
        if ROW:
            tl.store(s_ptr + rt * ss_r + ct * ss_c, s)
            tl.store(q_ptr + q_offs, q, mask=mask)
        if COL:
            tl.store(st_ptr + ct * sts_r + rt * sts_c, s)
            tl.store(qt_ptr + qt_offs, tl.trans(q), mask=mask_t)
    else:
        if ROW:
            if MODE == 1:
                s_r = tl.load(s_ptr + offs_r, mask=mask_r, other=1.0)
            else:  # 1 x GC groups: row maxima inside the tile
                s_r = _scale_from_amax(tl.max(_abs_nonfinite_to_inf(x), axis=1))
                tl.store(s_ptr + offs_r.to(tl.int64) * ss_r + ct * ss_c, s_r, mask=mask_r)
            q = _round_clamp(x, s_r[:, None], lin, seed, STOCHASTIC)
            tl.store(q_ptr + q_offs, q, mask=mask)
        if COL:
            if MODE == 1:
                s_c = tl.load(st_ptr + offs_c, mask=mask_c, other=1.0)
            else:  # GR x 1 groups of x = 1 x GR groups of x^T: column maxima inside the tile
                s_c = _scale_from_amax(tl.max(_abs_nonfinite_to_inf(x), axis=0))
                tl.store(st_ptr + offs_c.to(tl.int64) * sts_r + rt * sts_c, s_c, mask=mask_c)
            qc = _round_clamp(x, s_c[None, :], lin, seed, STOCHASTIC)
            tl.store(qt_ptr + qt_offs, tl.trans(qc), mask=mask_t)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


# Tile shapes. The interpreter runs numpy per program: small tiles keep CPU tests quick and exercise
# multi-tile reductions and ragged edges on tiny inputs.
if _INTERPRET:
    _AMAX_TILE, _Q_TILE, _Q_TILE_T, _FIN = (16, 32), (16, 32), (16, 16), (16, 16)
    _WARPS = 4
else:
    _AMAX_TILE, _Q_TILE, _Q_TILE_T, _FIN = (32, 256), (16, 256), (64, 64), (32, 128)
    _WARPS = 8


def _finalize(p: torch.Tensor, n_out: int, n_red: int, stride_out: int, stride_red: int):
    amax = torch.empty(n_out, dtype=torch.float32, device=p.device)
    scale = torch.empty_like(amax)
    BO, BRED = _FIN
    if n_out == 1:
        BO, BRED = 2, max(BRED, min(_pow2(n_red), 1024 if not _INTERPRET else 64))
    _finalize_kernel[(_cdiv(n_out, BO),)](p, amax, scale, n_out, n_red, stride_out, stride_red,
                                         BO=BO, BRED=BRED, num_warps=4)
    return amax, scale


def _raise_if_nonfinite(bad: torch.Tensor, name: str, amax: Optional[torch.Tensor] = None) -> None:
    if bool(bad):  # the one host sync of check_finite=True
        shown = amax.max().item() if amax is not None else float("inf")
        raise ref.NonFiniteError(f"INT8 quantization: {name} contains Inf or NaN (amax={shown})")


def _seed(stochastic: bool) -> int:
    # drawn from torch's CPU generator: reproducible under torch.manual_seed, and no device sync
    return int(torch.randint(0, 2**31 - 1, (1,)).item()) if stochastic else 0


def triton_quantize(
    x: torch.Tensor,
    *,
    granularity: str,
    block_size: int,
    weight: bool,
    rowwise: bool,
    columnwise: bool,
    stochastic: bool = False,
    name: str = "tensor",
    check_finite: bool = True,
) -> Tuple[Optional[ref.QTensor], Optional[ref.QTensor]]:
    """Same contract as ReferenceBackend.quantize: (Q(x) [R, C] or None, Q(x^T) [C, R] or None)."""
    if x.dim() != 2:
        raise ValueError(f"quantize expects a 2-D [rows, contraction] tensor, got shape {tuple(x.shape)}")
    if granularity not in ("tensor", "row", "block"):
        raise ValueError(f"unknown granularity {granularity!r}")
    if not (rowwise or columnwise):
        return None, None
    R, C = x.shape
    tile2d = weight and granularity == "block"
    if R == 0 or C == 0 or not x.is_floating_point():  # degenerate: nothing for a kernel to do
        from ..backend import ReferenceBackend
        return ReferenceBackend().quantize(x, granularity=granularity, block_size=block_size, weight=weight,
                                           rowwise=rowwise, columnwise=columnwise, stochastic=stochastic,
                                           name=name, check_finite=check_finite)
    dev = x.device
    q = torch.empty((R, C), dtype=torch.int8, device=dev) if rowwise else None
    qt = torch.empty((C, R), dtype=torch.int8, device=dev) if columnwise else None
    dummy = q if q is not None else qt
    seed = _seed(stochastic)
    sx_r, sx_c = x.stride()
    common = dict(ROW=rowwise, COL=columnwise, STOCHASTIC=stochastic, num_warps=_WARPS)

    if granularity in ("tensor", "row"):
        TR, TC = _AMAX_TILE
        n_rt, n_ct = _cdiv(R, TR), _cdiv(C, TC)
        tensor = granularity == "tensor"
        ptile = torch.empty(n_rt * n_ct if tensor else 1, dtype=torch.float32, device=dev)
        prow = torch.empty((R, n_ct) if (not tensor and rowwise) else (1,), dtype=torch.float32, device=dev)
        pcol = torch.empty((n_rt, C) if (not tensor and columnwise) else (1,), dtype=torch.float32, device=dev)
        _amax_partials_kernel[(n_rt, n_ct)](
            x, R, C, sx_r, sx_c, ptile, prow, pcol, TR=TR, TC=TC,
            TILE_MAX=tensor, ROW_MAX=not tensor and rowwise, COL_MAX=not tensor and columnwise,
            num_warps=_WARPS)
        if tensor:
            amax, scale = _finalize(ptile, 1, ptile.numel(), 0, 1)
            amax, scale = amax.reshape(()), scale.reshape(())
            s_row = s_col = scale
            amaxes = [amax]
        else:
            s_row = s_col = None
            amaxes = []
            if rowwise:
                a_r, s_row = _finalize(prow, R, n_ct, n_ct, 1)
                amaxes.append(a_r)
            if columnwise:
                a_c, s_col = _finalize(pcol, C, n_rt, 1, C)
                amaxes.append(a_c)
        TR, TC = _Q_TILE_T if columnwise else _Q_TILE
        _quantize_tile_kernel[(_cdiv(R, TR), _cdiv(C, TC))](
            x, R, C, sx_r, sx_c, q if q is not None else dummy, qt if qt is not None else dummy,
            s_row if s_row is not None else s_col, s_col if s_col is not None else s_row,
            0, 0, 0, 0, TR, TC, seed, TR=TR, TC=TC,
            MODE=_MODE_TENSOR if tensor else _MODE_VECTORS, **common)
        if check_finite:
            bad = torch.stack([(~torch.isfinite(a)).any() for a in amaxes]).any()
            _raise_if_nonfinite(bad, name, torch.cat([a.reshape(-1) for a in amaxes]))
        row = ref.QTensor(q, s_row, granularity, block_size) if rowwise else None
        col = ref.QTensor(qt, s_col, granularity, block_size) if columnwise else None
        return row, col

    # block granularity: single pass, scales computed inside each tile
    B = int(block_size)
    nbr, nbc = _cdiv(R, B), _cdiv(C, B)
    if tile2d:
        GR, GC, mode = B, B, _MODE_TILE2D
        s = torch.empty((nbr, nbc), dtype=torch.float32, device=dev) if rowwise else None
        st = torch.empty((nbc, nbr), dtype=torch.float32, device=dev) if columnwise else None
    else:
        mode = _MODE_1XB
        if rowwise and columnwise:
            GR, GC = B, B
        elif rowwise:
            GR, GC = max(1, min(R, (4 if _INTERPRET else 4096) // _pow2(B))), B
        else:
            GR, GC = B, max(1, min(C, (4 if _INTERPRET else 4096) // _pow2(B)))
        s = torch.empty((R, nbc), dtype=torch.float32, device=dev) if rowwise else None
        st = torch.empty((C, nbr), dtype=torch.float32, device=dev) if columnwise else None
    sd = s if s is not None else st
    std = st if st is not None else s
    _quantize_tile_kernel[(_cdiv(R, GR), _cdiv(C, GC))](
        x, R, C, sx_r, sx_c, q if q is not None else dummy, qt if qt is not None else dummy,
        sd, std, sd.stride(0), sd.stride(1), std.stride(0), std.stride(1), GR, GC, seed,
        TR=_pow2(GR), TC=_pow2(GC), MODE=mode, **common)
    if check_finite:
        bad = torch.stack([torch.isnan(t).any() for t in (s, st) if t is not None]).any()
        _raise_if_nonfinite(bad, name)
    row = ref.QTensor(q, s, "block", B, tile2d) if rowwise else None
    col = ref.QTensor(qt, st, "block", B, tile2d) if columnwise else None
    return row, col
