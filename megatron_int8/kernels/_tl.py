"""Triton helpers that several kernel files share (amax reductions, the amax pass's strip layout)."""
import triton
import triton.language as tl

from .. import reference as ref

SEGMENT_ALIGN = tl.constexpr(ref.SEGMENT_ALIGN)  # MoE segments' row alignment, for the kernels
# 1.5 * 2^23: for |x| < 2^22, x + M rounds x to the nearest integer (ties to even) in the sum's low mantissa bits
ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def max_keep_nan(a, b):
    """max(a, b), NaN if either is NaN (PTX max.NaN): a NaN cannot vanish from a max-reduction."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def max_to_inf(m, axis):
    """max of |x| values m along `axis` (None: all), +inf where that slice holds an Inf or NaN: amax = inf
    marks every non-finite group. NaN is kept by the max and mapped once per reduced value, not per element
    (a select per element less)."""
    r = tl.reduce(m, axis, max_keep_nan)
    return tl.where(r == r, r, float("inf"))


@triton.jit
def strip_program(C, TC: tl.constexpr):
    """(row strip rs, column block ct, column blocks n_ct, the block's columns, their mask) of a program on
    the 2-D grid (row strips, column blocks) that the amax pass and the kernels writing maxima in its layout
    share."""
    rs = tl.program_id(0)
    ct = tl.program_id(1)
    offs_c = ct * TC + tl.arange(0, TC)
    return rs, ct, tl.num_programs(1), offs_c, offs_c < C


@triton.jit
def strip_step(rs, RB, r0, R, mask_c, TR: tl.constexpr):
    """(rows, their mask, the tile's mask) of step r0 of row strip rs (RB rows per strip), for programs that walk
    a strip of rows of one column block (mask_c): the amax pass and the kernels that write maxima in its layout."""
    offs_r = rs * RB + r0 + tl.arange(0, TR)
    mask_r = offs_r < R
    return offs_r, mask_r, mask_r[:, None] & mask_c[None, :]


@triton.jit
def atomic_max_of(ptr, values, mask):
    """Atomic max of non-negative fp32 values (Inf/NaN already mapped to inf) into a buffer that started at
    zero. Their int32 bit patterns order like the floats, so one integer atomic per value does it."""
    tl.atomic_max(ptr.to(tl.pointer_type(tl.int32)), values.to(tl.int32, bitcast=True), mask=mask, sem="relaxed")
