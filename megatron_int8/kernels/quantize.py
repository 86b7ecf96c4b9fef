"""Triton INT8 quantization: amax, scale, round, clamp, and the fused quantize+transpose.

Contract (identical to megatron_int8.reference, see its docstring): an operand x [R, C] has its contraction
axis last. `rowwise` returns Q(x) [R, C], `columnwise` returns Q(x^T) [C, R] (or [C, R'], R zero-padded up
to a multiple of `columnwise_pad`), both K-major as Hopper's INT8
tensor cores need. scale = amax / 127 in fp32 (IEEE division, at least ref.MIN_SCALE, 1.0 for an all-zero group,
NaN for a group holding Inf/NaN), q = clamp(round_half_even(x_fp32 * (1 / scale)), -127, 127) with an IEEE-correct
reciprocal per scale (`tl.math.div_rn`) and an fp32 multiply per element, so the int8 data and the scales
are bit-identical to the PyTorch reference.

Launches per `triton_quantize` call (the small linears are CPU-launch-bound, so every launch counts):
- tensor granularity: 2 (1 with a given `amax`). `_amax_kernel` reads x once and writes <= 1024 partial
  maxima (no atomics, so no zero-initialised buffer and no memset; each program walks a tall strip of
  rows, `_amax_rows_per_program`); `_quantize_kernel` reads x again, and every program reduces the
  partials itself (4 KB from L2), so there is no separate "finalize" launch.
- row granularity: 2 and a memset (1 launch with the maxima of every requested output given:
  `rowwise_amax` for Q(x), `columnwise_amax` for Q(x^T), e.g. from the kernel that wrote x): a memset of
  the maxima buffer, then `_amax_kernel` folds each strip's row and column maxima into it by atomic max
  (int32 compares of non-negative floats: exact), then `_quantize_kernel`. This replaced partial maxima
  reduced by a third kernel (2026-11-23: the amax part 6-31% faster on an H100, docs/benchmarks.md);
  before that, each 64 x 64 quantize tile reduced ~12 KB of partials for its 8 KB of data. With
  `columnwise_segments` (MoE experts) the same launches: the amax programs take strips of exactly
  SEGMENT_ALIGN rows (one segment each) and fold their column maxima into their segment's row of [E, C]
  maxima.
- block granularity: 1. `_quantize_block_kernel` computes each group's scale inside its tile.
- check_finite: "deferred" (default): the quantize programs that store the scales also store NaN into the
  name's device slot when a scale is NaN (no launch of its own); "immediate": one small reduction and the
  host sync that reads it; "off": nothing. Any Inf/NaN element makes its groups' scales NaN (a NaN amax
  is mapped to inf), so one scale array tells.
Allocations: the int8 outputs, one scale buffer (tensorwise: shared with the partials, a few KB, kept
alive with the scale; row: the row and column scales, with the maxima in a second, zeroed buffer freed on
return); no host sync (segments: their strip table, `Segments.strip_experts`, is copied to the device once
per routing).

Quantize+transpose: Q(x) and Q(x)^T come from the same tile of x, read once. Q(x^T) is rounded from the
transposed 16-bit tile (`tl.trans`, a shared-memory layout change), which measured 10-15% faster on an
H100 than transposing the int8 result; stochastic rounding still transposes the int8 result, as its
draws are laid out like x. The tile is 64 x 128 on 4 warps (tile shapes: see the constants below).

Stochastic rounding: floor(v + u), u ~ U[0, 1). One Philox call (`tl.rand4x`) yields 4 draws, used for 4
adjacent columns (element (r, c) takes draw c % 4 of the call at counter r * ceil(C/4) + c // 4), which
cuts the Philox work 4x compared with one call per element (`tl.rand`). The draws are keyed by the
element's position in x, so Q(x) and Q(x)^T share them (Q(x)^T is then exactly the transpose of Q(x)).
Tiles narrower than 4 columns (only tiny block-granularity tensors) fall back to one call per element.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import triton
import triton.language as tl

from .. import reference as ref
from ._tl import ROUND_MAGIC, SEGMENT_ALIGN, atomic_max_of, max_keep_nan, max_to_inf, strip_program, strip_step
from .launch import ARG, INTERPRETING, LaunchCache, PlanCache, cdiv, next_pow2

MIN_SCALE = tl.constexpr(ref.MIN_SCALE)


# modes of _quantize_block_kernel
_MODE_TILE2D, _MODE_1XB = 2, 3


# ------------------------------------------------------------------------------------------ helpers
@triton.jit
def _abs_max(x, axis):
    """max |x| along `axis` (None: all), +inf where that slice holds an Inf or NaN."""
    return max_to_inf(tl.abs(x), axis)


@triton.jit
def _scale_from_amax(amax):
    """max(amax/127 (IEEE division), MIN_SCALE); 1.0 for amax == 0; NaN for a non-finite amax."""
    s = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)), MIN_SCALE)
    s = tl.where(amax > 0, s, 1.0)
    return tl.where(amax < float("inf"), s, float("nan"))


@triton.jit
def _flag_nonfinite(flag_ptr, flag_idx, scales):
    """Deferred finite check of a vector of scales: NaN into the slot when any is NaN (its group held
    Inf/NaN). Nothing is stored otherwise, so a slot stays NaN until the host reads and resets it.
    (A scalar scale s does the same with tl.store(flag_ptr + flag_idx, s, mask=s != s).)"""
    n_bad = tl.sum((scales != scales).to(tl.int32), axis=0)
    tl.store(flag_ptr + flag_idx, float("nan"), mask=n_bad > 0)


@triton.jit
def _uniform_tile(seed, offs_r, lin, col0, C4, TC: tl.constexpr, FOUR: tl.constexpr):
    """U[0, 1) for a tile of TC columns whose first column is col0 (a multiple of 4 when FOUR).

    FOUR: one Philox call per 4 columns (counter r * C4 + c // 4, draw c % 4), the 4 draws interleaved
    back into columns; else one call per element (counter = lin, the element index)."""
    if FOUR:
        cnt = offs_r[:, None] * C4 + (col0 // 4 + tl.arange(0, TC // 4))[None, :]
        u0, u1, u2, u3 = tl.rand4x(seed, cnt)
        # interleave(interleave(u0, u2), interleave(u1, u3)): column 4j + k holds u_k[j]
        return tl.interleave(tl.interleave(u0, u2), tl.interleave(u1, u3))
    else:
        return tl.rand(seed, lin)


@triton.jit
def _round_to_int8(v):
    """int8 round(v), half to even, of fp32 values with |v| <= 127: adding 1.5 * 2^23 makes the sum's ulp 1, so the
    add rounds v, and the sum's bits are 0x4B400000 + round(v): its low byte is round(v) as an int8. That skips the
    subtraction and the float-to-int conversion (16 per clock per SM on Hopper, against 128 adds), which kept the
    both-axes pass compute-bound on an H200 (Nsight Compute, 2026-11-22)."""
    return (v + ROUND_MAGIC).to(tl.int32, bitcast=True).to(tl.int8)


@triton.jit
def _round_clamp(x, s, u, STOCHASTIC: tl.constexpr):
    """int8 clamp(round(x * (1 / s))), half-to-even or floor(v + u) when stochastic. 1 / s is one IEEE
    division per scale (s is a scalar or a broadcast row/column of scales), then one multiply per element."""
    v = x * tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    v = tl.where(v == v, v, 0.0)  # NaN: non-finite scale (or 0/0), whose scale marks it NaN anyway
    # clamp before rounding: the bounds are integers and rounding is monotone, so the result is the same
    v = tl.minimum(tl.maximum(v, -127.0), 127.0)
    if STOCHASTIC:
        return tl.minimum(tl.floor(v + u), 127.0).to(tl.int8)
    return _round_to_int8(v)


@triton.jit
def _round_clamp_transposed(x_in, x, s_x, s_t, u, STOCHASTIC: tl.constexpr):
    """Q(x^T)'s tile, [TC, TR], of a [TR, TC] tile of x (x_in as loaded, x in fp32): s_x / s_t are its
    scales broadcast in x's / x^T's layout. Rounding to nearest transposes the 16-bit source tile and
    rounds in Q(x^T)'s layout: the quantize pass ran 10-15% faster on an H100 than with the int8 result
    transposed (docs/history.md, 2026-11-21). Stochastic rounding rounds in x's layout, where its
    draws are, and transposes the int8 result."""
    if STOCHASTIC:
        return tl.trans(_round_clamp(x, s_x, u, True))
    else:
        return _round_clamp(tl.trans(x_in).to(tl.float32), s_t, u, False)


@triton.jit
def _tile_uniforms(seed, offs_r, offs_c, col0, C, TR: tl.constexpr, TC: tl.constexpr,
                   STOCHASTIC: tl.constexpr, FOUR: tl.constexpr):
    """The tile's random draws (a dummy scalar when rounding to nearest)."""
    if STOCHASTIC:
        lin = offs_r[:, None] * C + offs_c[None, :]
        return _uniform_tile(seed, offs_r, lin, col0, (C + 3) // 4, TC, FOUR)
    else:
        return 0.0


# ------------------------------------------------------------------------- tensor / row granularity
@triton.jit
def _amax_kernel(
    x_ptr, R, C, stride_xr, stride_xc,
    ptile_ptr,  # TILE_MAX: [n_rs * n_ct] partial maxima
    rmax_ptr, cmax_ptr,  # ROW_MAX: row maxima [R]; COL_MAX: column maxima [C] (SEG: [E, C]); zeroed
    strip_ptr,  # SEG: the segment owning each SEGMENT_ALIGN strip of rows (RB == SEGMENT_ALIGN)
    RB,  # rows per program (a multiple of TR)
    TR: tl.constexpr, TC: tl.constexpr,
    TILE_MAX: tl.constexpr, ROW_MAX: tl.constexpr, COL_MAX: tl.constexpr, SEG: tl.constexpr,
):
    """Program (i, j) reads rows [i*RB, (i+1)*RB) x columns [j*TC, (j+1)*TC) of x in TR-row steps. Tensorwise
    it writes ptile[i, j], max |x| of its block (<= 1024 partials, which each quantize program reduces).
    Row granularity it folds each step's row maxima into rmax and, once per strip, its column maxima into
    cmax (SEG: the strip's segment's row of cmax), by atomic max: the maxima are final when the launch
    ends, with no reduce launch (one memset of R + C words instead). Maxima accumulate elementwise in the
    loop and are reduced after it (a loop-carried reduction trips triton 3.6's OptimizeThreadLocality
    pass). The loop is software-pipelined (loads of the next steps in flight while one is reduced): with 4
    warps per program, the row-wise both-axes quantize ran 2-16% faster on an H100 (docs/history.md,
    2026-11-22)."""
    rs, ct, n_ct, offs_c, mask_c = strip_program(C, TC)
    acc = tl.zeros((TR, TC), tl.float32)
    for r0 in tl.range(0, RB, TR, num_stages=3):
        offs_r, mask_r, mask = strip_step(rs, RB, r0, R, mask_c, TR)
        x = tl.load(x_ptr + offs_r[:, None].to(tl.int64) * stride_xr + offs_c[None, :] * stride_xc,
                    mask=mask, other=0.0)
        a = tl.abs(x.to(tl.float32))
        if ROW_MAX:
            atomic_max_of(rmax_ptr + offs_r, max_to_inf(a, 1), mask_r)
        if TILE_MAX or COL_MAX:
            acc = max_keep_nan(acc, a)
    if COL_MAX:
        if SEG:
            cmax_ptr += tl.load(strip_ptr + rs).to(tl.int64) * C
        atomic_max_of(cmax_ptr + offs_c, max_to_inf(acc, 0), mask_c)
    if TILE_MAX:  # ptile [n_rs * n_ct]
        tl.store(ptile_ptr + rs * n_ct + ct, max_to_inf(acc, None))


@triton.jit(do_not_specialize=["seed"])  # a new seed per call: no recompiles, and BoundLaunch needs it
def _quantize_kernel(
    x_ptr, R, C, stride_xr, stride_xc,
    q_ptr, qt_ptr,  # Q(x) [R, C] and Q(x^T) [C, RP], contiguous
    RP,  # row length of Q(x^T): R, or R zero-padded (rows of x past R read as 0 and store 0)
    s_ptr, st_ptr,  # scales written here: [] (tensor, both point to it) or [R] and [C] (row)
    a_ptr, at_ptr,  # tensor: n_a partial maxima (both point to them); row: row maxima [R], column maxima [C]
    n_a, seed,  # row granularity: n_a = the number of column scales, C (SEG: E * C)
    strip_ptr,  # SEG: the segment owning each SEGMENT_ALIGN strip of rows
    flag_ptr, flag_idx,  # FLAG: the deferred finite check's slot, set to NaN when a scale is NaN
    TR: tl.constexpr, TC: tl.constexpr, BP: tl.constexpr,  # register tile; tensorwise partials BP at a time
    SB: tl.constexpr,  # row granularity: scales stored per scale program
    TENSOR: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
    STOCHASTIC: tl.constexpr, FOUR: tl.constexpr, SEG: tl.constexpr, FLAG: tl.constexpr,
):
    """One [TR, TC] tile of x -> Q(x) and/or Q(x)^T. A 1-D grid, column tiles fastest: a wave of programs
    reads whole bands of rows (measured 1-3% faster than row tiles fastest). Each program turns the amax
    of its tensor / rows / columns into scales, so the scales need no launch of their own. Tensorwise,
    each program first reduces the <= 1024 partials itself (4 KB from L2): cheaper than a reduce launch
    (measured 75 vs 79 us for 8192 x 4096 on an H200).
    The programs past the tiles store the scales: tensorwise one; row granularity SB at a time, row
    scales then column scales. Stored by the tiles of row 0 / column 0 instead, they cost every tile of
    the row-wise pass 8-9% on an H200 (docs/history.md, 2026-11-22).
    SEG (columnwise_segments): the column maxima and Q(x^T)'s scales are [E, C] (an empty segment's maxima
    stay 0: scale 1); the tile (TR divides SEGMENT_ALIGN, so its rows belong to one segment) takes its
    segment's row of the maxima.
    FLAG: the programs that store the scales also flag a NaN among them: the row scales and the column
    scales. Either would do for x's own maxima, but a given amax may hold an Inf/NaN that x does not."""
    n_ct = tl.cdiv(C, TC)
    n_tiles = tl.cdiv(RP, TR) * n_ct
    if tl.program_id(0) >= n_tiles:  # the scale programs
        j = tl.program_id(0) - n_tiles
        if TENSOR:
            s = _tensor_scale(a_ptr, n_a, BP)
            tl.store(s_ptr, s)
            if FLAG:
                tl.store(flag_ptr + flag_idx, s, mask=s != s)
        else:
            if ROW:
                _store_scales(j, R, a_ptr, s_ptr, flag_ptr, flag_idx, SB, FLAG)
                j -= tl.cdiv(R, SB)
            if COL:
                _store_scales(j, n_a, at_ptr, st_ptr, flag_ptr, flag_idx, SB, FLAG)
    else:
        _quantize_tile(x_ptr, R, C, stride_xr, stride_xc, q_ptr, qt_ptr, RP, a_ptr, at_ptr, n_a, seed, strip_ptr,
                       n_ct, TR, TC, BP, TENSOR, ROW, COL, STOCHASTIC, FOUR, SEG)


@triton.jit
def _tensor_scale(a_ptr, n_a, BP: tl.constexpr):
    """The tensorwise scale from the n_a partial maxima, reduced BP at a time."""
    acc = tl.zeros((BP,), tl.float32)
    for j0 in range(0, n_a, BP):
        offs_p = j0 + tl.arange(0, BP)
        acc = tl.maximum(acc, tl.load(a_ptr + offs_p, mask=offs_p < n_a, other=0.0))
    return _scale_from_amax(tl.max(acc, axis=0))


@triton.jit
def _store_scales(j, n, a_ptr, s_ptr, flag_ptr, flag_idx, SB: tl.constexpr, FLAG: tl.constexpr):
    """Block j of SB scales of n, from their maxima (nothing when j is out of range)."""
    offs = j * SB + tl.arange(0, SB)
    m = (offs >= 0) & (offs < n)
    s = _scale_from_amax(tl.load(a_ptr + offs, mask=m, other=0.0))  # masked lanes: scale 1, never flagged
    tl.store(s_ptr + offs, s, mask=m)
    if FLAG:
        _flag_nonfinite(flag_ptr, flag_idx, s)


@triton.jit
def _quantize_tile(x_ptr, R, C, stride_xr, stride_xc, q_ptr, qt_ptr, RP, a_ptr, at_ptr, n_a, seed, strip_ptr, n_ct,
                   TR: tl.constexpr, TC: tl.constexpr, BP: tl.constexpr, TENSOR: tl.constexpr, ROW: tl.constexpr,
                   COL: tl.constexpr, STOCHASTIC: tl.constexpr, FOUR: tl.constexpr, SEG: tl.constexpr):
    """_quantize_kernel's tile program."""
    rt = tl.program_id(0) // n_ct
    ct = tl.program_id(0) % n_ct
    offs_r = rt * TR + tl.arange(0, TR)
    offs_c = ct * TC + tl.arange(0, TC)
    mask_r = offs_r < R
    mask_c = offs_c < C
    mask = mask_r[:, None] & mask_c[None, :]
    x_in = tl.load(x_ptr + offs_r[:, None].to(tl.int64) * stride_xr + offs_c[None, :] * stride_xc, mask=mask,
                   other=0.0)
    x = x_in.to(tl.float32)
    u = _tile_uniforms(seed, offs_r, offs_c, ct * TC, C, TR, TC, STOCHASTIC, FOUR)
    q_offs = offs_r[:, None].to(tl.int64) * C + offs_c[None, :]
    qt_offs = offs_c[:, None].to(tl.int64) * RP + offs_r[None, :]
    mask_t = mask_c[:, None] & (offs_r < RP)[None, :]

    if TENSOR:
        s = _tensor_scale(a_ptr, n_a, BP)
        if ROW:
            tl.store(q_ptr + q_offs, _round_clamp(x, s, u, STOCHASTIC), mask=mask)
        if COL:
            tl.store(qt_ptr + qt_offs, _round_clamp_transposed(x_in, x, s, s, u, STOCHASTIC), mask=mask_t)
    else:
        if ROW:
            s_r = _scale_from_amax(tl.load(a_ptr + offs_r, mask=mask_r, other=0.0))
            q = _round_clamp(x, s_r[:, None], u, STOCHASTIC)
            tl.store(q_ptr + q_offs, q, mask=mask)
        if COL:
            if SEG:
                at_ptr += tl.load(strip_ptr + (rt * TR) // SEGMENT_ALIGN).to(tl.int64) * C
            s_c = _scale_from_amax(tl.load(at_ptr + offs_c, mask=mask_c, other=0.0))
            tl.store(qt_ptr + qt_offs, _round_clamp_transposed(x_in, x, s_c[None, :], s_c[:, None], u, STOCHASTIC),
                     mask=mask_t)


# ----------------------------------------------------------------------------------- block granularity
@triton.jit(do_not_specialize=["seed"])  # a new seed per call: no recompiles, and BoundLaunch needs it
def _quantize_block_kernel(
    x_ptr, R, C, stride_xr, stride_xc,
    q_ptr, qt_ptr,  # Q(x) [R, C] and Q(x^T) [C, RP], contiguous
    RP,  # row length of Q(x^T) (R, or R zero-padded)
    s_ptr, st_ptr,  # block scales of Q(x) and of Q(x^T), written
    ss_r, ss_c, sts_r, sts_c,  # strides of the 2-D block-scale arrays
    GR, GC,  # rows / columns covered by one program (the block size, or several rows of 1 x B groups)
    seed,
    flag_ptr, flag_idx,  # FLAG: the deferred finite check's slot, set to NaN when a scale is NaN
    TR: tl.constexpr, TC: tl.constexpr,  # power-of-two register tile >= (GR, GC)
    MODE: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, STOCHASTIC: tl.constexpr, FOUR: tl.constexpr,
    FLAG: tl.constexpr,
):
    """Single pass: scales computed inside the tile. MODE 2: one scale per BxB weight tile, stored for Q(x)
    and transposed for Q(x^T). MODE 3: 1xB groups, row maxima for Q(x) and column maxima for Q(x^T),
    both from one read."""
    rt = tl.program_id(0)
    ct = tl.program_id(1)
    ir = tl.arange(0, TR)
    ic = tl.arange(0, TC)
    offs_r = rt * GR + ir
    offs_c = ct * GC + ic
    mask_r = (ir < GR) & (offs_r < R)
    mask_c = (ic < GC) & (offs_c < C)
    mask = mask_r[:, None] & mask_c[None, :]
    x_in = tl.load(x_ptr + offs_r[:, None].to(tl.int64) * stride_xr + offs_c[None, :] * stride_xc, mask=mask,
                   other=0.0)
    x = x_in.to(tl.float32)
    u = _tile_uniforms(seed, offs_r, offs_c, ct * GC, C, TR, TC, STOCHASTIC, FOUR)
    q_offs = offs_r[:, None].to(tl.int64) * C + offs_c[None, :]
    qt_offs = offs_c[:, None].to(tl.int64) * RP + offs_r[None, :]
    mask_t = mask_c[:, None] & ((ir < GR) & (offs_r < RP))[None, :]

    if MODE == 2:  # BxB tile: one scale for the tile, transposed for Q(x^T)
        amax = _abs_max(x, None)
        s = _scale_from_amax(amax)
        if FLAG:
            tl.store(flag_ptr + flag_idx, s, mask=s != s)
        if ROW:
            tl.store(s_ptr + rt * ss_r + ct * ss_c, s)
            tl.store(q_ptr + q_offs, _round_clamp(x, s, u, STOCHASTIC), mask=mask)
        if COL:
            tl.store(st_ptr + ct * sts_r + rt * sts_c, s)
            tl.store(qt_ptr + qt_offs, _round_clamp_transposed(x_in, x, s, s, u, STOCHASTIC), mask=mask_t)
    else:
        if ROW:  # 1 x GC groups: row maxima inside the tile
            s_r = _scale_from_amax(_abs_max(x, 1))
            tl.store(s_ptr + offs_r.to(tl.int64) * ss_r + ct * ss_c, s_r, mask=mask_r)
            if FLAG:
                _flag_nonfinite(flag_ptr, flag_idx, s_r)
            q = _round_clamp(x, s_r[:, None], u, STOCHASTIC)
            tl.store(q_ptr + q_offs, q, mask=mask)
        if COL:  # GR x 1 groups of x = 1 x GR groups of x^T: column maxima inside the tile
            s_c = _scale_from_amax(_abs_max(x, 0))
            tl.store(st_ptr + offs_c.to(tl.int64) * sts_r + rt * sts_c, s_c, mask=mask_c)
            if FLAG and not ROW:
                _flag_nonfinite(flag_ptr, flag_idx, s_c)
            tl.store(qt_ptr + qt_offs, _round_clamp_transposed(x_in, x, s_c[None, :], s_c[:, None], u, STOCHASTIC),
                     mask=mask_t)


# ------------------------------------------------------------------------------------------- host side
_AMAX, _QUANTIZE, _QUANTIZE_BLOCK = map(LaunchCache, (_amax_kernel, _quantize_kernel, _quantize_block_kernel))


# Tile shapes. The interpreter runs numpy per program: small tiles keep CPU tests quick and exercise
# multi-tile reductions, multi-step amax strips and ragged edges on tiny inputs.
if INTERPRETING:
    _AMAX_TILE, _Q_TILE, _Q_TILE_T = (8, 16), (16, 32), (16, 16)
    _MAX_STRIPS, _WARPS, _BLOCK_ROWS, _SCALE_BLOCK = 3, 4, 4, 16
    _AMAX_WARPS = _Q_T_WARPS = _WARPS
else:
    # amax: 64 x 128 register tile, strips of rows, 4 warps; quantize: 16 x 256 (one output, 512 B bf16 rows) or
    # 64 x 128 with 4 warps (both outputs). On an H200 (2026-11-22),
    # once the scale stores had left the tiles, 64 x 128 ran the both-axes pass 2-6% faster than 64 x 64 and
    # the amax tile 64 x 128 took 2-17% off the amax pass against 32 x 256 (docs/benchmarks.md).
    _AMAX_TILE, _Q_TILE, _Q_TILE_T = (64, 128), (16, 256), (64, 128)
    _MAX_STRIPS, _WARPS, _BLOCK_ROWS, _SCALE_BLOCK = 32, 8, 4096, 1024
    _AMAX_WARPS, _Q_T_WARPS = 4, 4  # the amax pass's and the both-axes quantize tile's (tuned apart)
_MAX_TILE_PARTIALS = 1024  # tensorwise: partials that each quantize program reduces


def _amax_rows_per_program(R: int, n_ct: int, tensor: bool) -> int:
    """Rows per amax program: enough programs to fill the GPU, few enough tensorwise partials to reduce
    cheaply (row granularity: few column atomics), and at least two steps each where x has the rows, so
    the pipelined loop has a load to overlap (2048 x 28672 row-wise: 64 -> 48 us on an H100, 2026-11-23)."""
    TR = _AMAX_TILE[0]
    n_rt = cdiv(R, TR)
    strips = min(_MAX_STRIPS, n_rt // 2)
    if tensor:
        strips = min(strips, _MAX_TILE_PARTIALS // n_ct)
    return cdiv(n_rt, max(1, strips)) * TR


def _seed(stochastic: bool) -> int:
    # drawn from torch's CPU generator: reproducible under torch.manual_seed, and no device sync
    return int(torch.randint(0, 2**31 - 1, (1,)).item()) if stochastic else 0


def _four(TC: int, GC: int, n_ct: int) -> bool:
    """4 draws per Philox call need tile columns in whole groups of 4 starting at multiples of 4."""
    return TC % 4 == 0 and (GC % 4 == 0 or n_ct == 1)


_PLANS = PlanCache(1024)  # call signature -> run(x, amax, columnwise_amax, segments, rowwise_amax, out); see _plan


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
    check_finite: str = "deferred",
    amax: Optional[torch.Tensor] = None,
    columnwise_pad: int = 1,
    columnwise_amax: Optional[torch.Tensor] = None,
    columnwise_segments: Optional[ref.Segments] = None,
    rowwise_amax: Optional[torch.Tensor] = None,
    out: Optional[Tuple[Optional[ref.QTensor], Optional[ref.QTensor]]] = None,
) -> Tuple[Optional[ref.QTensor], Optional[ref.QTensor]]:
    """Same contract as ReferenceBackend.quantize: (Q(x) [R, C] or None, Q(x^T) [C, R'] or None).

    `amax` (tensorwise only): a precomputed amax (e.g. reduced over the tensor-parallel group) replacing
    x's own; it then stands in for the partials, so the amax launch is skipped. `columnwise_pad`: R' is R
    rounded up to a multiple of it; the kernels store the zero columns along with the data.
    `columnwise_amax` (row-wise only): x's per-column amax [C] for Q(x^T)'s scales; it stands in for the
    column maxima, so the amax launch only computes row maxima (none when Q(x) is not requested).
    `rowwise_amax` (row-wise only): x's per-row amax [R] for Q(x)'s scales, likewise. With both given (or
    one given and only its output requested) x is read once: a single quantize launch.
    `columnwise_segments` (row-wise only, MoE experts): Q(x^T) gets scales [E, C], each over one segment's
    rows, in the same launches and passes over x: each amax program (one SEGMENT_ALIGN strip of rows)
    folds its column maxima into its segment's row of [E, C] maxima, and each quantize tile (inside one
    strip) takes its segment's maxima.
    `out` (row-wise only): destinations for Q(x) / Q(x^T) and their scales (reference.check_quantize_out).

    Host cost: the arguments are checked, and the grids, buffer sizes and launches worked out, once per
    plan key (x's shape, strides, dtype and 16-byte alignment, the options, the given amaxes' shapes, the
    number of segments, the destinations' 16-byte alignment); a call with a known key allocates the outputs
    and calls the bound launches (launch.BoundLaunch). Segments and destinations, which change from call to
    call (every MoE routing), are checked on every call."""
    if columnwise_segments is not None:
        ref.check_segments(x, granularity, columnwise_segments, columnwise_amax, columnwise_pad)
    if out is not None:
        ref.check_quantize_out(x, granularity, rowwise, columnwise, columnwise_pad, columnwise_segments, out)
    # the argument types too: the checks reject e.g. a bool or float pad, and a known plan skips them
    key = (x.device, x.dtype, x.shape, x.stride(), x.data_ptr() % 16 == 0, granularity, block_size,
           type(block_size), weight, rowwise, columnwise, stochastic, name, check_finite,
           None if amax is None else amax.shape, columnwise_pad, type(columnwise_pad),
           None if columnwise_amax is None else columnwise_amax.shape,
           None if columnwise_segments is None else columnwise_segments.num_segments,
           None if rowwise_amax is None else rowwise_amax.shape, _out_alignment(out))
    plan = _PLANS.get(key)
    if plan is None:
        ref.check_quantize_args(x, granularity, amax, columnwise_pad, block_size, columnwise_amax, rowwise_amax)
        plan = _plan(x, granularity, int(block_size), weight, rowwise, columnwise, stochastic, name, check_finite,
                     amax is not None, columnwise_pad, columnwise and columnwise_amax is not None,
                     columnwise_segments.num_segments if columnwise and columnwise_segments is not None else None,
                     rowwise and rowwise_amax is not None)
        _PLANS.put(key, plan)
    if not columnwise:  # checked above; only Q(x^T) uses them
        columnwise_amax = columnwise_segments = None
    if not rowwise:  # likewise, only Q(x) uses it
        rowwise_amax = None
    return plan(x, amax, columnwise_amax, columnwise_segments, rowwise_amax, out)


def _out_alignment(out) -> Optional[tuple]:
    """What Triton specializes on in `out`'s tensors (16-byte alignment), for the plan key: a bound launch
    must get pointers aligned like its first call's."""
    if out is None:
        return None
    return tuple(None if d is None else (d.data.data_ptr() % 16 == 0, d.scale.data_ptr() % 16 == 0) for d in out)


def _plan(x, granularity, block_size, weight, rowwise, columnwise, stochastic, name, check_finite, given_amax,
          columnwise_pad, given_col, n_segments, given_row) -> Callable:
    """`run(x, amax, columnwise_amax, segments, rowwise_amax, out) -> (row, col)` for every x of this plan key
    (`n_segments`: the number of segments of a segmented Q(x^T), else None; `out` is row-wise only)."""
    R, C = x.shape
    if not (rowwise or columnwise):
        return lambda *_: (None, None)
    if R == 0 or C == 0 or not x.is_floating_point():  # degenerate: nothing for a kernel to do
        from ..reference import ReferenceBackend

        def reference(x, amax, columnwise_amax, segments, rowwise_amax, out):
            return ReferenceBackend().quantize(
                x, granularity=granularity, block_size=block_size, weight=weight, rowwise=rowwise,
                columnwise=columnwise, stochastic=stochastic, name=name, check_finite=check_finite, amax=amax,
                columnwise_pad=columnwise_pad, columnwise_amax=columnwise_amax, columnwise_segments=segments,
                rowwise_amax=rowwise_amax, out=out)
        return reference
    RP = ref.padded_length(R, columnwise_pad) if columnwise else R  # Q(x^T)'s row length
    if granularity == "block":
        return _block_plan(x, block_size, weight, rowwise, columnwise, stochastic, name, check_finite, RP)
    if granularity == "tensor":
        return _tensor_plan(x, block_size, rowwise, columnwise, stochastic, name, check_finite, given_amax, RP)
    return _row_plan(x, block_size, rowwise, columnwise, stochastic, name, check_finite, RP, given_col, n_segments,
                     given_row)


def _finite_slot(check_finite: str, device, name: str) -> Tuple[bool, int]:
    """(FLAG, slot index) of a quantize launch. With check_finite="deferred" the kernel records a NaN
    scale itself (FLAG): its scales cover every element, so it needs no launches of its own. Otherwise the
    caller calls ref.handle_nonfinite. The slot tensor itself is fetched per call (`_slots`): it is
    reallocated when a new name needs a slot."""
    if check_finite == "deferred":
        return True, ref.nonfinite_slot(device, name)[1]
    return False, 0


def _slots(flag: bool, device, name: str, dummy: torch.Tensor) -> torch.Tensor:
    return ref.nonfinite_slot(device, name)[0] if flag else dummy


def _int8_outputs(R: int, C: int, RP: int, rowwise: bool, columnwise: bool, device, out=None):
    """(Q(x) or None, Q(x^T) or None, and the two pointers for the kernels: an output not requested is
    stood in for by the other, which the kernel then does not store to). `out`'s destinations are used
    where given."""
    row_out, col_out = out if out is not None else (None, None)
    q = (row_out.data if row_out is not None else torch.empty((R, C), dtype=torch.int8, device=device)
         ) if rowwise else None
    qt = (col_out.data if col_out is not None else torch.empty((C, RP), dtype=torch.int8, device=device)
          ) if columnwise else None
    q_arg = q if q is not None else qt
    return q, qt, q_arg, qt if qt is not None else q_arg


def _common_meta(R: int, C: int, RP: int, tensor: bool, rowwise: bool, columnwise: bool, stochastic: bool,
                 n_col_scales: int = 0):
    """(grid, constexprs) of _quantize_kernel for tensor / row granularity, with the programs that store the
    scales: one for the tensor's; row granularity's for the row scales (rowwise) and the n_col_scales
    column scales (columnwise)."""
    TR, TC = _Q_TILE_T if columnwise else _Q_TILE
    n_scale_programs = 1 if tensor else cdiv(R, _SCALE_BLOCK) * rowwise + cdiv(n_col_scales, _SCALE_BLOCK) * columnwise
    grid = (cdiv(RP, TR) * cdiv(C, TC) + n_scale_programs,)
    return grid, dict(TR=TR, TC=TC, SB=_SCALE_BLOCK, TENSOR=tensor, ROW=rowwise, COL=columnwise,
                      STOCHASTIC=stochastic, FOUR=_four(TC, TC, cdiv(C, TC)),
                      num_warps=_Q_T_WARPS if columnwise else _WARPS)


def _tensor_plan(x, block_size, rowwise, columnwise, stochastic, name, check_finite, given_amax, RP):
    R, C = x.shape
    dev = x.device
    sx_r, sx_c = x.stride()
    grid_q, common = _common_meta(R, C, RP, True, rowwise, columnwise, stochastic)
    ATR, ATC = _AMAX_TILE
    n_ct = cdiv(C, ATC)
    if given_amax:  # the given amax is the single "partial": no amax launch
        n_p = 1
    else:
        RB = _amax_rows_per_program(R, n_ct, True)
        n_p = cdiv(R, RB) * n_ct
        amax_launch = _AMAX.prepare((cdiv(R, RB), n_ct), (ARG, R, C, sx_r, sx_c, ARG, ARG, ARG, ARG, RB), TR=ATR,
                                    TC=ATC, TILE_MAX=True, ROW_MAX=False, COL_MAX=False, SEG=False,
                                    num_warps=_AMAX_WARPS)
    flag, slot = _finite_slot(check_finite, dev, name)
    BP = 2 if INTERPRETING else min(next_pow2(n_p), _MAX_TILE_PARTIALS)  # the interpreter loops over them
    quantize = _QUANTIZE.prepare(grid_q, (ARG, R, C, sx_r, sx_c, ARG, ARG, RP, ARG, ARG, ARG, ARG, n_p, ARG, ARG,
                                          ARG, slot), BP=BP, SEG=False, FLAG=flag, **common)

    def run(x, amax, columnwise_amax, segments, rowwise_amax, out):  # out: row-wise only (never given here)
        q, qt, q_arg, qt_arg = _int8_outputs(R, C, RP, rowwise, columnwise, dev)
        if given_amax:
            scale = torch.empty((), dtype=torch.float32, device=dev)
            # NaN -> inf: the kernel's max-reduction would drop a NaN, inf gives the NaN scale
            parts = ref.nan_as_inf(amax.reshape(1).to(device=dev, dtype=torch.float32))
        else:
            buf = torch.empty(1 + n_p, dtype=torch.float32, device=dev)  # [scale, partials...]
            scale, parts = buf[0], buf[1:]
            amax_launch(x, parts, parts, parts, parts)
        quantize(x, q_arg, qt_arg, scale, scale, parts, parts, _seed(stochastic), parts,
                 _slots(flag, dev, name, parts))
        if not flag:
            ref.handle_nonfinite(scale, name, check_finite)
        return (ref.QTensor(q, scale, "tensor", block_size) if rowwise else None,
                ref.QTensor(qt, scale, "tensor", block_size) if columnwise else None)
    return run


def _row_plan(x, block_size, rowwise, columnwise, stochastic, name, check_finite, RP, given_col, n_segments,
              given_row):
    """Row granularity: scales per row of x (rowwise) and per column of x (columnwise; per segment too with
    segments: [E, C]), in one buffer; the maxima the amax launch folds atomically, in a second one zeroed by
    one memset and freed when the call returns. A given row / column amax stands in for that axis's maxima;
    with nothing left to compute, the memset and the amax launch are skipped."""
    R, C = x.shape
    dev = x.device
    sx_r, sx_c = x.stride()
    segs = n_segments is not None  # segments come with Q(x^T) only (triton_quantize)
    n_seg = n_segments if segs else 1
    grid_q, common = _common_meta(R, C, RP, False, rowwise, columnwise, stochastic, n_col_scales=n_seg * C)
    n_scales = R * rowwise + n_seg * C * columnwise
    row_maxima = rowwise and not given_row
    col_maxima = columnwise and not given_col
    amax_first = row_maxima or col_maxima
    if amax_first:
        ATR, ATC = _AMAX_TILE
        RB = ref.SEGMENT_ALIGN if segs else _amax_rows_per_program(R, cdiv(C, ATC), False)
        n_row = R * row_maxima  # [row maxima, column maxima (per segment)]
        n_maxima = n_row + n_seg * C * col_maxima
        amax_launch = _AMAX.prepare((cdiv(R, RB), cdiv(C, ATC)), (ARG, R, C, sx_r, sx_c, ARG, ARG, ARG, ARG, RB),
                                    TR=ATR, TC=ATC, TILE_MAX=False, ROW_MAX=row_maxima, COL_MAX=col_maxima,
                                    SEG=segs, num_warps=_AMAX_WARPS)
    # the kernel flags every scale array it stores: a given amax may hold an Inf/NaN that x does not (another
    # rank's rows), so the row scales alone would not tell
    flag, slot = _finite_slot(check_finite, dev, name)
    quantize = _QUANTIZE.prepare(grid_q, (ARG, R, C, sx_r, sx_c, ARG, ARG, RP, ARG, ARG, ARG, ARG, n_seg * C, ARG,
                                          ARG, ARG, slot), BP=1, SEG=segs, FLAG=flag, **common)

    def run(x, amax, columnwise_amax, segments, rowwise_amax, out):
        q, qt, q_arg, qt_arg = _int8_outputs(R, C, RP, rowwise, columnwise, dev, out)
        if out is None:  # both scale arrays in one buffer
            scales = torch.empty(n_scales, dtype=torch.float32, device=dev)
            s_row = scales[:R] if rowwise else None
            s_col = scales[R * rowwise:] if columnwise else None
            if segs:
                s_col = s_col.view(n_seg, C)
        else:  # into the given destinations (never segmented); a scale array not given gets its own buffer
            s_row = (out[0].scale if out[0] is not None else torch.empty(R, dtype=torch.float32, device=dev)
                     ) if rowwise else None
            s_col = (out[1].scale if out[1] is not None else torch.empty(C, dtype=torch.float32, device=dev)
                     ) if columnwise else None
            scales = s_row if s_row is not None else s_col
        a_row = a_col = strips = scales  # placeholders for pointers a launch does not read
        if segments is not None:
            strips = segments.strip_experts(dev)
        if amax_first:
            maxima = torch.zeros(n_maxima, dtype=torch.float32, device=dev)
            if row_maxima:
                a_row = maxima[:R]
            if col_maxima:
                a_col = maxima[n_row:]
            amax_launch(x, maxima, a_row, a_col, strips)
        # given maxima are loaded as they are: _scale_from_amax turns a NaN (like an inf) into a NaN scale
        if given_row:
            a_row = rowwise_amax.to(device=dev, dtype=torch.float32).contiguous()
        if given_col:
            a_col = columnwise_amax.to(device=dev, dtype=torch.float32).contiguous()
        quantize(x, q_arg, qt_arg, s_row if rowwise else s_col,
                 s_col if columnwise else s_row, a_row, a_col, _seed(stochastic), strips,
                 _slots(flag, dev, name, scales))
        if not flag and (given_row or given_col):  # a given amax may hold what x does not: check both arrays
            for s in (s_row, s_col):
                if s is not None:
                    ref.handle_nonfinite(s, name, check_finite)
        elif not flag:  # the smaller scale array: a non-finite element poisons its row's and its column's scale
            ref.handle_nonfinite(s_row if s_col is None or (s_row is not None and R <= s_col.numel()) else s_col,
                                 name, check_finite)
        return (ref.QTensor(q, s_row, "row", block_size) if rowwise else None,
                ref.QTensor(qt, s_col, "row", block_size) if columnwise else None)
    return run


def _block_plan(x, B, weight, rowwise, columnwise, stochastic, name, check_finite, RP):
    """Block granularity: one launch, scales computed inside each tile. 128 x 128 tiles run 16 warps: with 8,
    the 1xB both-axes variant needs ~230 registers per thread (and spills with stochastic rounding)."""
    R, C = x.shape
    dev = x.device
    nbr, nbc = cdiv(R, B), cdiv(C, B)
    if weight:
        GR, GC, mode = B, B, _MODE_TILE2D
        s_shape, st_shape = (nbr, nbc), (nbc, nbr)
    else:
        mode = _MODE_1XB
        if rowwise and columnwise:
            GR, GC = B, B
        elif rowwise:
            GR, GC = max(1, min(R, _BLOCK_ROWS // next_pow2(B))), B
        else:
            GR, GC = B, max(1, min(C, _BLOCK_ROWS // next_pow2(B)))
        s_shape, st_shape = (R, nbc), (C, nbr)
    # the scale strides are those of the contiguous arrays allocated per call
    sd_shape = s_shape if rowwise else st_shape
    std_shape = st_shape if columnwise else s_shape
    grid = (cdiv(RP, GR), cdiv(C, GC))
    TR, TC = next_pow2(GR), next_pow2(GC)
    flag, slot = _finite_slot(check_finite, dev, name)
    quantize = _QUANTIZE_BLOCK.prepare(
        grid, (ARG, R, C, x.stride(0), x.stride(1), ARG, ARG, RP, ARG, ARG, sd_shape[1], 1, std_shape[1], 1, GR,
               GC, ARG, ARG, slot),
        TR=TR, TC=TC, MODE=mode, ROW=rowwise, COL=columnwise, STOCHASTIC=stochastic,
        FOUR=_four(TC, GC, grid[1]), FLAG=flag, num_warps=_WARPS if TR * TC < 16384 or INTERPRETING else 16)

    def run(x, amax, columnwise_amax, segments, rowwise_amax, out):  # out: row-wise only (never given here)
        q, qt, q_arg, qt_arg = _int8_outputs(R, C, RP, rowwise, columnwise, dev)
        s = torch.empty(s_shape, dtype=torch.float32, device=dev) if rowwise else None
        st = torch.empty(st_shape, dtype=torch.float32, device=dev) if columnwise else None
        sd = s if s is not None else st
        quantize(x, q_arg, qt_arg, sd, st if st is not None else sd, _seed(stochastic),
                 _slots(flag, dev, name, sd))
        if not flag:  # one array suffices: a non-finite element poisons a group of Q(x) and one of Q(x^T) alike
            ref.handle_nonfinite(sd, name, check_finite)
        return (ref.QTensor(q, s, "block", B, weight) if rowwise else None,
                ref.QTensor(qt, st, "block", B, weight) if columnwise else None)
    return run
