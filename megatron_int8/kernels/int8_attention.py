"""Triton INT8 attention (causal or not, GQA), forward and backward; the contract is ops/int8_attention.py's.

Products and scales (the module docstring of ops/int8_attention.py says why):
    forward   S = Q K^T   by the scores: BF16 (default) or INT8     O = P V     INT8, P with the fixed scale
                                                                               1/127, V per (head, block, channel)
    backward  S = Q K^T   as forward, dP = dO V^T BF16,             dV = P^T dO INT8, P^T per (key, query tile),
              dS = P (dP - delta)                                               dO per (head, block, channel)
              dK = dS^T Q INT8, dS^T per (key, query tile), Q per (head, block, channel)
              dQ = dS K   INT8, dS per (query, key tile), K per (head, block, channel)
The scores multiply Q and smoothed K in the per-token layout [S, D]: BF16 values with unit scales, written by
PyTorch, in 16-bit products with fp32 sums (scores="bf16", SCORES_BF16), or INT8 per token that the quantize
pass writes (scores="int8").
An INT8 operand on the contraction side of a product is stored transposed, [D, S] with S contiguous: Hopper's
INT8 tensor-core instruction (wgmma) takes both operands K-major only. So the quantize pass writes Q and K per
block and channel [D, S] for dQ and dK (and, with INT8 scores, per token [S, D] too) and V, dO once ([D, S], per
block and channel).
Each INT8 product accumulates in int32 over one tile and is dequantized once per tile into an fp32 accumulator:
the tiles divide the scale block, so an operand's scale is constant along the tile's contraction axis.
Softmax in base 2 (scores times log2(e)), online over key tiles in fp32; lse is kept in base 2 for backward.

Programs: `_quantize_kernel` (one per head and block of tokens), `_attn_fwd_kernel` (one per head and query tile),
`_attn_bwd_dkdv_kernel` (one per key/value head and key tile: it walks the query tiles of every query head of
its group, so GQA needs no atomics), `_attn_bwd_dq_kernel` (one per query head and query tile). Their grids put
the heads on the first axis, which the GPU dispatches first, so causal programs start longest first across all
heads (the last query tiles, or the first key tiles), and the last to start are the shortest.
Numerics match the PyTorch path of ops/int8_attention.py up to fp32 rounding (exp2 against exp, the order of
the scale products), which can move a quantized P or dS by one step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import INTERPRETING, LaunchCache, cdiv
from .quantize import _abs_max, _round_clamp, _round_to_int8, _scale_from_amax

LOG2E = 1.4426950408889634
ROW_AMAX_FLOOR = tl.constexpr(2.0 ** -100)  # as ops/int8_attention.ROW_AMAX_FLOOR: rows below it quantize to 0


def warps_for(tile: int) -> int:
    """Warps of a launch whose tile's leading side is `tile` (8 for 128-row tiles, else 4)."""
    return 8 if tile >= 128 else 4


@triton.jit
def _quantize_rows(x):
    """(int8 tile, fp32 row scales) of a tile quantized per row: scale = max(amax, ROW_AMAX_FLOOR) / 127 (IEEE
    division)."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), ROW_AMAX_FLOOR)
    s = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    return _round_clamp(x, s[:, None], 0, False), s


@triton.jit
def _dot_16bit(a, b, UPCAST: tl.constexpr):
    """a @ b of 16-bit tiles with fp32 accumulation (dP = dO V^T). UPCAST: in fp32, exactly the same products,
    for the interpreter, whose BF16 tl.dot returns garbage (triton 3.9, TRITON_INTERPRET=1)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _score_dot(a, b, SCORES_BF16: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b of score operands in fp32: INT8 tiles with int32 sums, or 16-bit tiles (SCORES_BF16)."""
    if SCORES_BF16:
        return _dot_16bit(a, b, UPCAST)
    return tl.dot(a, b, out_dtype=tl.int32).to(tl.float32)


@triton.jit
def _quantize_kernel(
    x_ptr, sx_b, sx_h, sx_s,  # input [B, H, S, D], last stride 1
    mean_ptr,  # [B * H, D] fp32, subtracted when MEAN
    rows_ptr, rows_scale_ptr,  # [B * H, S, D] int8 and [B * H, S] fp32 per token, when ROWS
    t_ptr, t_scale_ptr,  # [B * H, D, SP] int8 (SP = S padded to BLOCK) and [B * H, NB, D] fp32
    o_ptr, so_b, so_h, so_s, delta_ptr,  # with DELTA: O [B, H, S, D] and rowsum(x * O) [B * H, S] fp32
    H, S, SP, NB,
    D: tl.constexpr, BLOCK: tl.constexpr,
    MEAN: tl.constexpr, ROWS: tl.constexpr, DELTA: tl.constexpr,
):
    """Program (block of BLOCK tokens, b * H + h): x - mean quantized per token into [S, D] (ROWS) and per block
    and channel into the transposed [D, SP] layout; with DELTA also rowsum(x * O)."""
    blk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_s = blk * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    mask_s = offs_s < S
    x = tl.load(x_ptr + b * sx_b + h * sx_h + offs_s[:, None].to(tl.int64) * sx_s + offs_d[None, :],
                mask=mask_s[:, None], other=0.0).to(tl.float32)
    if MEAN:
        x = x - tl.load(mean_ptr + bh * D + offs_d)[None, :]
        x = tl.where(mask_s[:, None], x, 0.0)
    if DELTA:
        o = tl.load(o_ptr + b * so_b + h * so_h + offs_s[:, None].to(tl.int64) * so_s + offs_d[None, :],
                    mask=mask_s[:, None], other=0.0).to(tl.float32)
        tl.store(delta_ptr + bh * S + offs_s, tl.sum(x * o, axis=1), mask=mask_s)
    if ROWS:
        q, s = _quantize_rows(x)
        tl.store(rows_ptr + (bh * S + offs_s[:, None]) * D + offs_d[None, :], q, mask=mask_s[:, None])
        tl.store(rows_scale_ptr + bh * S + offs_s, s, mask=mask_s)
    st = _scale_from_amax(_abs_max(x, 0))  # [D]; NaN for a channel holding Inf/NaN (tl.max may drop a NaN)
    tl.store(t_scale_ptr + (bh * NB + blk) * D + offs_d, st)
    qt = _round_clamp(x, st[None, :], 0, False)
    tl.store(t_ptr + (bh * D + offs_d[:, None]) * SP + offs_s[None, :], tl.trans(qt))  # padding tokens hold zeros


@triton.jit
def _key_tile_scores(q, q_scale, offs_m, n0, k_ptr, ks_ptr, bhk, Sk, D: tl.constexpr, BLOCK_N: tl.constexpr,
                     MASK: tl.constexpr, CAUSAL: tl.constexpr, SCORES_BF16: tl.constexpr, UPCAST: tl.constexpr):
    """(S, offs_n) of the key tile at n0: the dequantized scores of a query tile, -inf past Sk and above the
    diagonal where MASK (the tile crosses either), so that exp2 makes their probabilities exactly 0. The forward
    and the dQ program share it."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k_rows = (bhk * Sk + offs_n[:, None]) * D + tl.arange(0, D)[None, :]
    if MASK:
        mask_n = offs_n < Sk
        k = tl.load(k_ptr + k_rows, mask=mask_n[:, None], other=0)
        k_scale = tl.load(ks_ptr + bhk * Sk + offs_n, mask=mask_n, other=0.0)
    else:
        k = tl.load(k_ptr + k_rows)
        k_scale = tl.load(ks_ptr + bhk * Sk + offs_n)
    s = _score_dot(q, tl.trans(k), SCORES_BF16, UPCAST) * (q_scale[:, None] * k_scale[None, :])
    if MASK:
        valid = mask_n[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(valid, s, float("-inf"))
    return s, offs_n


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, q_scale, offs_m, n0, k_ptr, ks_ptr, vt_ptr, vs_ptr, bhk, Sk, SkP, NBk,
              D: tl.constexpr, BLOCK_N: tl.constexpr, QBLOCK: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
              SCORES_BF16: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile of the forward's online softmax. MASK: the tile crosses the diagonal or the last key."""
    offs_d = tl.arange(0, D)
    s, offs_n = _key_tile_scores(q, q_scale, offs_m, n0, k_ptr, ks_ptr, bhk, Sk, D, BLOCK_N, MASK, CAUSAL,
                                 SCORES_BF16, UPCAST)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p8 = _round_to_int8(p * 127.0)  # p <= 1 (0 where masked): the fixed scale 1/127 needs no row maximum
    vt = tl.load(vt_ptr + (bhk * D + offs_d[:, None]) * SkP + offs_n[None, :])  # zeros past Sk
    v_scale = tl.load(vs_ptr + (bhk * NBk + n0 // QBLOCK) * D + offs_d) * (1.0 / 127.0)  # with P's scale
    pv = tl.dot(p8, tl.trans(vt), out_dtype=tl.int32).to(tl.float32)
    acc = acc * alpha[:, None] + pv * v_scale[None, :]
    return acc, l_i, m_new


@triton.jit
def _attn_fwd_kernel(
    q_ptr, qs_ptr, k_ptr, ks_ptr,  # per token [BH, Sq, D], [BHk, Sk, D] (INT8, or BF16 with SCORES_BF16) and
                                   # their scales [BH, Sq], [BHk, Sk] (ones with BF16)
    vt_ptr, vs_ptr,  # V^T INT8 [BHk, D, SkP], scales [BHk, NBk, D]
    o_ptr, lse_ptr,  # O [B, H, Sq, D] contiguous (output dtype), lse2 [BH, Sq] fp32
    H, GROUP, Sq, Sk, SkP, NBk, qk_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QBLOCK: tl.constexpr, CAUSAL: tl.constexpr,
    SCORES_BF16: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program (b * H + h, query tile): online softmax over the key tiles, S by the scores (SCORES_BF16: BF16,
    else INT8) and P V in INT8. Causal programs
    start with the last query tiles (the longest rows), and only tiles that cross the diagonal or the last key
    are masked."""
    pid = tl.program_id(1)
    m0 = (tl.num_programs(1) - 1 - pid if CAUSAL else pid) * BLOCK_M
    bh = tl.program_id(0).to(tl.int64)
    bhk = bh // H * (H // GROUP) + bh % H // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    mask_m = offs_m < Sq
    q = tl.load(q_ptr + (bh * Sq + offs_m[:, None]) * D + offs_d[None, :], mask=mask_m[:, None], other=0)
    q_scale = tl.load(qs_ptr + bh * Sq + offs_m, mask=mask_m, other=0.0) * qk_scale

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    full = Sk // BLOCK_N * BLOCK_N  # the key tiles that hold no key past Sk
    if CAUSAL:
        mid = tl.minimum(m0 // BLOCK_N * BLOCK_N, full)  # the tiles below every query of this tile
        hi = tl.minimum(Sk, m0 + BLOCK_M)
    else:
        mid = full
        hi = Sk
    for n0 in range(0, mid, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, q_scale, offs_m, n0, k_ptr, ks_ptr, vt_ptr, vs_ptr, bhk, Sk, SkP,
                                  NBk, D, BLOCK_N, QBLOCK, False, CAUSAL, SCORES_BF16, UPCAST)
    for n0 in range(mid, hi, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, q_scale, offs_m, n0, k_ptr, ks_ptr, vt_ptr, vs_ptr, bhk, Sk, SkP,
                                  NBk, D, BLOCK_N, QBLOCK, True, CAUSAL, SCORES_BF16, UPCAST)
    o = acc / l_i[:, None]
    tl.store(o_ptr + (bh * Sq + offs_m[:, None]) * D + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=mask_m[:, None])
    tl.store(lse_ptr + bh * Sq + offs_m, m_i + tl.log2(l_i), mask=mask_m)


@triton.jit
def _dkdv_tile(dk, dv, k, k_scale, v, offs_n, m0, bh, b, h, q_ptr, qs_ptr, qt_ptr, qts_ptr, do_ptr, sdo_b, sdo_h,
               sdo_s, dot_ptr, dots_ptr, lse_ptr, delta_ptr, Sq, SqP, NBq,
               D: tl.constexpr, BLOCK_M: tl.constexpr, QBLOCK: tl.constexpr, CAUSAL: tl.constexpr,
               SCORES_BF16: tl.constexpr, UPCAST: tl.constexpr):
    """One query tile of a dK/dV program, masked past Sq and above the diagonal whether or not it crosses them:
    one code path for every tile needs fewer registers than separate masked and unmasked loops (sm_90a spills
    1.6 -> 0.5 KB per thread at 64 x 128 tiles) and runs faster (docs/benchmarks.md). (Keys past Sk need no mask:
    their rows are quantized on their own and never stored.)"""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    mask_m = offs_m < Sq
    q = tl.load(q_ptr + (bh * Sq + offs_m[:, None]) * D + offs_d[None, :], mask=mask_m[:, None], other=0)
    q_scale = tl.load(qs_ptr + bh * Sq + offs_m, mask=mask_m, other=0.0)
    lse = tl.load(lse_ptr + bh * Sq + offs_m, mask=mask_m, other=0.0)
    delta = tl.load(delta_ptr + bh * Sq + offs_m, mask=mask_m, other=0.0)
    do = tl.load(do_ptr + b * sdo_b + h * sdo_h + offs_m[:, None].to(tl.int64) * sdo_s + offs_d[None, :],
                 mask=mask_m[:, None], other=0.0)
    st = _score_dot(k, tl.trans(q), SCORES_BF16, UPCAST) * (k_scale[:, None] * q_scale[None, :])
    pt = tl.exp2(st - lse[None, :])
    valid = mask_m[None, :]
    if CAUSAL:
        valid = valid & (offs_n[:, None] <= offs_m[None, :])
    pt = tl.where(valid, pt, 0.0)
    dst = pt * (_dot_16bit(v, tl.trans(do), UPCAST) - delta[None, :])

    blk = m0 // QBLOCK
    pt8, pt_scale = _quantize_rows(pt)
    dot = tl.load(dot_ptr + (bh * D + offs_d[:, None]) * SqP + offs_m[None, :])  # zeros past Sq
    do_scale = tl.load(dots_ptr + (bh * NBq + blk) * D + offs_d)
    dv += tl.dot(pt8, tl.trans(dot), out_dtype=tl.int32).to(tl.float32) * pt_scale[:, None] * do_scale[None, :]
    dst8, dst_scale = _quantize_rows(dst)
    qt = tl.load(qt_ptr + (bh * D + offs_d[:, None]) * SqP + offs_m[None, :])
    qt_scale = tl.load(qts_ptr + (bh * NBq + blk) * D + offs_d)
    dk += tl.dot(dst8, tl.trans(qt), out_dtype=tl.int32).to(tl.float32) * dst_scale[:, None] * qt_scale[None, :]
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, qs_ptr, k_ptr, ks_ptr,  # per-token INT8 Q, K and scales (as the forward)
    qt_ptr, qts_ptr,  # per-block Q^T INT8 [BH, D, SqP], scales [BH, NBq, D]
    v_ptr, sv_b, sv_h, sv_s,  # V [B, Hk, Sk, D] (16-bit, last stride 1)
    do_ptr, sdo_b, sdo_h, sdo_s,  # dO [B, H, Sq, D] (16-bit, last stride 1)
    dot_ptr, dots_ptr,  # dO^T INT8 [BH, D, SqP], scales [BH, NBq, D]
    lse_ptr, delta_ptr,  # [BH, Sq] fp32
    dk_ptr, dv_ptr,  # [B, Hk, Sk, D] contiguous, in K's and V's dtypes
    HK, GROUP, Sq, Sk, SqP, NBq, qk_scale, sm_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QBLOCK: tl.constexpr, CAUSAL: tl.constexpr,
    SCORES_BF16: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program (b * Hk + hk, key tile): dK and dV of its keys, over the query tiles of the group's query heads
    (causal: from the tile that holds its first key on)."""
    n0 = tl.program_id(1) * BLOCK_N
    bhk = tl.program_id(0).to(tl.int64)
    b = bhk // HK
    hk = bhk % HK
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    mask_n = offs_n < Sk
    k = tl.load(k_ptr + (bhk * Sk + offs_n[:, None]) * D + offs_d[None, :], mask=mask_n[:, None], other=0)
    k_scale = tl.load(ks_ptr + bhk * Sk + offs_n, mask=mask_n, other=0.0) * qk_scale
    v = tl.load(v_ptr + b * sv_b + hk * sv_h + offs_n[:, None].to(tl.int64) * sv_s + offs_d[None, :],
                mask=mask_n[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    lo = n0 // BLOCK_M * BLOCK_M if CAUSAL else 0
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * HK * GROUP + h
        for m0 in range(lo, Sq, BLOCK_M):
            dk, dv = _dkdv_tile(dk, dv, k, k_scale, v, offs_n, m0, bh, b, h, q_ptr, qs_ptr, qt_ptr, qts_ptr, do_ptr,
                                sdo_b, sdo_h, sdo_s, dot_ptr, dots_ptr, lse_ptr, delta_ptr, Sq, SqP, NBq,
                                D, BLOCK_M, QBLOCK, CAUSAL, SCORES_BF16, UPCAST)
    out = (bhk * Sk + offs_n[:, None]) * D + offs_d[None, :]
    tl.store(dk_ptr + out, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=mask_n[:, None])
    tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=mask_n[:, None])


@triton.jit
def _dq_tile(dq, q, q_scale, do, lse, delta, offs_m, n0, k_ptr, ks_ptr, kt_ptr, kts_ptr, v_ptr, sv_b, sv_h, sv_s,
             b, hk, bhk, Sk, SkP, NBk, D: tl.constexpr, BLOCK_N: tl.constexpr, QBLOCK: tl.constexpr,
             MASK: tl.constexpr, CAUSAL: tl.constexpr, SCORES_BF16: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile of a dQ program. MASK: the tile crosses the diagonal or the last key. (Queries past Sq need no
    mask: their dO and delta are zero, so is their dS, and they are never stored.)"""
    offs_d = tl.arange(0, D)
    s, offs_n = _key_tile_scores(q, q_scale, offs_m, n0, k_ptr, ks_ptr, bhk, Sk, D, BLOCK_N, MASK, CAUSAL,
                                 SCORES_BF16, UPCAST)
    v_rows = b * sv_b + hk * sv_h + offs_n[:, None].to(tl.int64) * sv_s + offs_d[None, :]
    if MASK:
        v = tl.load(v_ptr + v_rows, mask=(offs_n < Sk)[:, None], other=0.0)
    else:
        v = tl.load(v_ptr + v_rows)
    p = tl.exp2(s - lse[:, None])
    ds8, ds_scale = _quantize_rows(p * (_dot_16bit(do, tl.trans(v), UPCAST) - delta[:, None]))
    kt = tl.load(kt_ptr + (bhk * D + offs_d[:, None]) * SkP + offs_n[None, :])  # zeros past Sk
    kt_scale = tl.load(kts_ptr + (bhk * NBk + n0 // QBLOCK) * D + offs_d)
    return dq + tl.dot(ds8, tl.trans(kt), out_dtype=tl.int32).to(tl.float32) * ds_scale[:, None] * kt_scale[None, :]


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, qs_ptr, k_ptr, ks_ptr,  # per-token INT8 Q, K and scales (as the forward)
    kt_ptr, kts_ptr,  # per-block K^T INT8 [BHk, D, SkP], scales [BHk, NBk, D]
    v_ptr, sv_b, sv_h, sv_s,  # V [B, Hk, Sk, D] (16-bit, last stride 1)
    do_ptr, sdo_b, sdo_h, sdo_s,  # dO [B, H, Sq, D] (16-bit, last stride 1)
    lse_ptr, delta_ptr,  # [BH, Sq] fp32
    dq_ptr,  # [B, H, Sq, D] contiguous, in Q's dtype
    H, GROUP, Sq, Sk, SkP, NBk, qk_scale, sm_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QBLOCK: tl.constexpr, CAUSAL: tl.constexpr,
    SCORES_BF16: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program (b * H + h, query tile): dQ of its queries, over the key tiles (masked as the forward's)."""
    pid = tl.program_id(1)
    m0 = (tl.num_programs(1) - 1 - pid if CAUSAL else pid) * BLOCK_M
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    hk = bh % H // GROUP
    bhk = b * (H // GROUP) + hk
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    mask_m = offs_m < Sq
    q = tl.load(q_ptr + (bh * Sq + offs_m[:, None]) * D + offs_d[None, :], mask=mask_m[:, None], other=0)
    q_scale = tl.load(qs_ptr + bh * Sq + offs_m, mask=mask_m, other=0.0) * qk_scale
    do = tl.load(do_ptr + b * sdo_b + bh % H * sdo_h + offs_m[:, None].to(tl.int64) * sdo_s + offs_d[None, :],
                 mask=mask_m[:, None], other=0.0)
    lse = tl.load(lse_ptr + bh * Sq + offs_m, mask=mask_m, other=0.0)
    delta = tl.load(delta_ptr + bh * Sq + offs_m, mask=mask_m, other=0.0)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    full = Sk // BLOCK_N * BLOCK_N
    if CAUSAL:
        mid = tl.minimum(m0 // BLOCK_N * BLOCK_N, full)
        hi = tl.minimum(Sk, m0 + BLOCK_M)
    else:
        mid = full
        hi = Sk
    for n0 in range(0, mid, BLOCK_N):
        dq = _dq_tile(dq, q, q_scale, do, lse, delta, offs_m, n0, k_ptr, ks_ptr, kt_ptr, kts_ptr, v_ptr, sv_b, sv_h,
                      sv_s, b, hk, bhk, Sk, SkP, NBk, D, BLOCK_N, QBLOCK, False, CAUSAL, SCORES_BF16, UPCAST)
    for n0 in range(mid, hi, BLOCK_N):
        dq = _dq_tile(dq, q, q_scale, do, lse, delta, offs_m, n0, k_ptr, ks_ptr, kt_ptr, kts_ptr, v_ptr, sv_b, sv_h,
                      sv_s, b, hk, bhk, Sk, SkP, NBk, D, BLOCK_N, QBLOCK, True, CAUSAL, SCORES_BF16, UPCAST)
    tl.store(dq_ptr + (bh * Sq + offs_m[:, None]) * D + offs_d[None, :], (dq * sm_scale).to(dq_ptr.dtype.element_ty),
             mask=mask_m[:, None])


_QUANTIZE = LaunchCache(_quantize_kernel)
_FWD = LaunchCache(_attn_fwd_kernel)
_BWD_DKDV = LaunchCache(_attn_bwd_dkdv_kernel)
_BWD_DQ = LaunchCache(_attn_bwd_dq_kernel)


def _last_stride_one(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _quantize(x, block, *, mean=None, rows=False, o=None):
    """The quantize pass over x [B, H, S, D]: (rows int8, rows scales, transposed int8, its scales, delta);
    entries a mode does not write are None."""
    B, H, S, D = x.shape
    nb = cdiv(S, block)
    dev = x.device
    rows_q = torch.empty((B * H, S, D), dtype=torch.int8, device=dev) if rows else None
    rows_s = torch.empty((B * H, S), dtype=torch.float32, device=dev) if rows else None
    t_q = torch.empty((B * H, D, nb * block), dtype=torch.int8, device=dev)
    t_s = torch.empty((B * H, nb, D), dtype=torch.float32, device=dev)
    delta = torch.empty((B * H, S), dtype=torch.float32, device=dev) if o is not None else None
    dummy = t_s
    _QUANTIZE.launch((nb, B * H),
                     x, x.stride(0), x.stride(1), x.stride(2),
                     mean if mean is not None else dummy,
                     rows_q if rows else t_q, rows_s if rows else dummy,
                     t_q, t_s,
                     o if o is not None else x, *(o.stride()[:3] if o is not None else (0, 0, 0)),
                     delta if o is not None else dummy,
                     H, S, nb * block, nb,
                     D=D, BLOCK=block, MEAN=mean is not None, ROWS=rows, DELTA=o is not None,
                     num_warps=8)
    return rows_q, rows_s, t_q, t_s, delta


def triton_attention_forward(q, k, v, causal: bool, sm_scale: float, cfg):
    """(O [B, H, Sq, D] in q's dtype, the tensors backward needs). Shapes are checked by ops/int8_attention."""
    q, k, v = _last_stride_one(q), _last_stride_one(k), _last_stride_one(v)
    B, H, Sq, D = q.shape
    Hk, Sk = k.shape[1], k.shape[2]
    mean = k.mean(dim=2, dtype=torch.float32).reshape(B * Hk, D)
    scores_bf16 = cfg.scores == "bf16"
    q8, q_s, qt8, qt_s, _ = _quantize(q, cfg.block, rows=not scores_bf16)
    k8, k_s, kt8, kt_s, _ = _quantize(k, cfg.block, mean=mean, rows=not scores_bf16)
    if scores_bf16:  # the scores' operands: BF16 Q and smoothed K per token, unit scales, written contiguous in the
        # copy itself (the kernels read them without strides; Megatron's [s, b, h, d] views are strided, and
        # `.to(memory_format=...)` returns such a view unchanged when it is BF16 already)
        q8 = torch.empty((B, H, Sq, D), dtype=torch.bfloat16, device=q.device).copy_(q).view(B * H, Sq, D)
        k8 = torch.empty((B, Hk, Sk, D), dtype=torch.bfloat16, device=q.device)
        k8 = k8.copy_(k.float() - mean.view(B, Hk, 1, D)).view(B * Hk, Sk, D)
        q_s = torch.ones((B * H, Sq), dtype=torch.float32, device=q.device)
        k_s = torch.ones((B * Hk, Sk), dtype=torch.float32, device=q.device)
    _, _, vt8, vt_s, _ = _quantize(v, cfg.block)
    o = torch.empty((B, H, Sq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B * H, Sq), dtype=torch.float32, device=q.device)
    _FWD.launch((B * H, cdiv(Sq, cfg.fwd_block_m)),
                q8, q_s, k8, k_s, vt8, vt_s, o, lse,
                H, H // Hk, Sq, Sk, vt8.shape[2], vt_s.shape[1], sm_scale * LOG2E,
                D=D, BLOCK_M=cfg.fwd_block_m, BLOCK_N=cfg.fwd_block_n, QBLOCK=cfg.block, CAUSAL=bool(causal),
                SCORES_BF16=scores_bf16, UPCAST=INTERPRETING, num_warps=warps_for(cfg.fwd_block_m))
    return o, (q8, q_s, k8, k_s, qt8, qt_s, kt8, kt_s, lse)


def triton_attention_backward(do, o, v, saved, causal: bool, sm_scale: float, cfg, q_shape, q_dtype, k_shape,
                              k_dtype):
    """(dQ, dK, dV) in the inputs' dtypes, from dO and what triton_attention_forward saved."""
    q8, q_s, k8, k_s, qt8, qt_s, kt8, kt_s, lse = saved
    do, v = _last_stride_one(do), _last_stride_one(v)
    B, H, Sq, D = q_shape
    Hk, Sk = k_shape[1], k_shape[2]
    _, _, dot8, dot_s, delta = _quantize(do, cfg.block, o=o)
    dq = torch.empty(q_shape, dtype=q_dtype, device=do.device)
    dk = torch.empty(k_shape, dtype=k_dtype, device=do.device)
    dv = torch.empty(k_shape, dtype=v.dtype, device=do.device)
    qk_scale = sm_scale * LOG2E
    _BWD_DKDV.launch((B * Hk, cdiv(Sk, cfg.bwd_block_n)),
                     q8, q_s, k8, k_s, qt8, qt_s, v, *v.stride()[:3], do, *do.stride()[:3], dot8, dot_s, lse, delta,
                     dk, dv, Hk, H // Hk, Sq, Sk, qt8.shape[2], qt_s.shape[1], qk_scale, sm_scale,
                     D=D, BLOCK_M=cfg.bwd_block_m, BLOCK_N=cfg.bwd_block_n, QBLOCK=cfg.block, CAUSAL=bool(causal),
                     SCORES_BF16=cfg.scores == "bf16", UPCAST=INTERPRETING,
                     num_warps=warps_for(cfg.bwd_block_n))
    _BWD_DQ.launch((B * H, cdiv(Sq, cfg.dq_block_m)),
                   q8, q_s, k8, k_s, kt8, kt_s, v, *v.stride()[:3], do, *do.stride()[:3], lse, delta, dq,
                   H, H // Hk, Sq, Sk, kt8.shape[2], kt_s.shape[1], qk_scale, sm_scale,
                   D=D, BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, QBLOCK=cfg.block, CAUSAL=bool(causal),
                   SCORES_BF16=cfg.scores == "bf16", UPCAST=INTERPRETING,
                   num_warps=warps_for(cfg.dq_block_m))
    return dq, dk, dv
