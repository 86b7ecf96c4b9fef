"""Triton cross entropy over (a tensor-parallel shard of) the vocabulary: one read of the logits forward,
one read and one write backward, never an fp32 copy of them.

Logits x [S, B, V] (bf16, fp16 or fp32; strides of S and B arbitrary, the last stride 1), this rank's
vocabulary being the global ids [vocab_start, vocab_start + V); targets t [S * B] int64 global ids.
Row r = s * B + b. All math in fp32.

Forward, one program per row, one pass over the row in chunks of BLOCK with an online max:
    m_0 = max(chunk_0),  l_0 = sum(exp(chunk_0 - m_0))
    m_k = max(m_{k-1}, max(chunk_k)),  l_k = l_{k-1} exp(m_{k-1} - m_k) + sum(exp(chunk_k - m_k))
giving the local max m, the local sum of exp(x - m) l, and x[r, t - vocab_start] when the target is local
(0 otherwise). With the whole vocabulary local (`FINISH`) the program also finishes the row:
    loss = log(l) - (x_t - m)   (log(l) alone when t is outside [0, V): megatron's semantics)
    lse  = m + log(l)
Under tensor parallelism the caller combines (m, l, x_t) over the ranks (megatron_int8.ops.cross_entropy).

Backward, program (row, chunk of BLOCK columns), with lse the global log-sum-exp of the row:
    grad[r, v] = g[r] * (exp(x[r, v] - lse[r]) - [v == t[r] - vocab_start])
in fp32, rounded once to the logits' dtype; g may be broadcast (strides 0), in any float dtype.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .launch import LaunchCache, cdiv, next_pow2

# Untuned defaults: 8 KB (bf16) per chunk, 16 elements per thread with 8 warps.
FORWARD_BLOCK = 4096
BACKWARD_BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _ce_forward_kernel(
    x_ptr, sx_s, sx_b,  # logits [S, B, V], last stride 1
    tgt_ptr,  # int64 [N] global target ids
    m_ptr, l_ptr, xt_ptr,  # fp32 [N] each: local max, local sum of exp(x - max), target logit (0 if not local)
    loss_ptr, lse_ptr,  # fp32 [N] each, written when FINISH
    B, V, vocab_start,
    BLOCK: tl.constexpr, FINISH: tl.constexpr,
):
    """Program r: row r in one pass (chunk 0 peeled: the loop carries fp32 scalars from the start). While
    the running max is -inf (-inf logits only so far) the exponents shift by 0, so that no -inf - -inf
    makes a NaN; megatron's max over the whole row has no such case."""
    row = tl.program_id(0).to(tl.int64)
    s = row // B
    b = row % B
    x_row = x_ptr + s * sx_s + b * sx_b
    offs = tl.arange(0, BLOCK)

    x = tl.load(x_row + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    acc = tl.sum(tl.exp(x - tl.where(m == -float("inf"), 0.0, m)), axis=0)
    for start in range(BLOCK, V, BLOCK):
        cols = start + offs
        x = tl.load(x_row + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)  # rows that start with -inf logits: no NaN
        acc = acc * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = m_new

    t = tl.load(tgt_ptr + row) - vocab_start
    hit = (t >= 0) & (t < V)
    xt = tl.load(x_row + tl.where(hit, t, 0), mask=hit, other=0.0).to(tl.float32)
    if FINISH:
        log_l = tl.log(acc)
        tl.store(loss_ptr + row, log_l - tl.where(hit, xt - m, 0.0))
        tl.store(lse_ptr + row, m + log_l)
    else:
        tl.store(m_ptr + row, m)
        tl.store(l_ptr + row, acc)
        tl.store(xt_ptr + row, xt)


@triton.jit
def _ce_backward_kernel(
    x_ptr, sx_s, sx_b,  # logits [S, B, V], last stride 1
    g_ptr, sg_s, sg_b,  # loss gradient [S, B], any strides (0 when broadcast)
    lse_ptr, tgt_ptr,  # fp32 [N] global log-sum-exp, int64 [N] global target ids
    out_ptr,  # contiguous [N, V], the logits' dtype
    B, V, vocab_start,
    BLOCK: tl.constexpr,
):
    """Program (r, c): columns [c * BLOCK, (c + 1) * BLOCK) of row r."""
    row = tl.program_id(0).to(tl.int64)
    s = row // B
    b = row % B
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    g = tl.load(g_ptr + s * sg_s + b * sg_b).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    t = tl.load(tgt_ptr + row) - vocab_start
    x = tl.load(x_ptr + s * sx_s + b * sx_b + cols, mask=mask, other=0.0).to(tl.float32)
    p = tl.exp(x - lse)
    p = tl.where(cols == t, p - 1.0, p)
    tl.store(out_ptr + row * V + cols, (p * g).to(out_ptr.dtype.element_ty), mask=mask)


_FORWARD = LaunchCache(_ce_forward_kernel)
_BACKWARD = LaunchCache(_ce_backward_kernel)


def _block(V: int, block: Optional[int], default: int) -> int:
    return next_pow2(min(V, block or default))


def triton_cross_entropy_forward(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, finish: bool,
    loss_shape: Optional[Tuple[int, ...]] = None, block: Optional[int] = None,
) -> Tuple[torch.Tensor, ...]:
    """Per-row statistics of logits [S, B, V] (last stride 1) for targets [S * B] (int64, contiguous).

    finish=True (the whole vocabulary is local, vocab_start 0): returns (loss, lse), fp32, loss
    contiguous of `loss_shape` (default [S * B]: a fresh tensor, not a view, as autograd wants a custom
    Function's outputs), lse [S * B]; loss = log-sum-exp - target logit (log(sum exp(x - max)) for a
    target outside [0, V)).
    finish=False: returns (m, l, xt), fp32 [S * B] each: local max, local sum of exp(x - m), target
    logit (0 where the target is not in [vocab_start, vocab_start + V)).
    `block` overrides the chunk size (rounded up to a power of two, at most next_pow2(V)), for tests.
    Shapes, dtypes and devices are checked by the caller (megatron_int8.ops.cross_entropy)."""
    S, B, V = logits.shape
    N = S * B
    new = functools.partial(torch.empty, dtype=torch.float32, device=logits.device)
    if finish:
        loss, lse = new(loss_shape if loss_shape is not None else (N,)), new(N)
        m = l_ = xt = lse  # not written by the FINISH variant
        outs = (loss, lse)
    else:
        m, l_, xt = new(N), new(N), new(N)
        loss = lse = m  # not written
        outs = (m, l_, xt)
    if N == 0:
        return outs
    _FORWARD.launch((N,), logits, logits.stride(0), logits.stride(1), target,
                    m, l_, xt, loss, lse, B, V, int(vocab_start),
                    BLOCK=_block(V, block, FORWARD_BLOCK), FINISH=bool(finish), num_warps=NUM_WARPS)
    return outs


def triton_cross_entropy_backward(
    logits: torch.Tensor, grad_loss: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, vocab_start: int,
    block: Optional[int] = None,
) -> torch.Tensor:
    """grad_logits [S, B, V] (contiguous, the logits' dtype) = grad_loss * (softmax - one-hot(target)).

    logits [S, B, V] (last stride 1), grad_loss [S, B] (any float dtype and strides, 0 included),
    lse [S * B] fp32 (the global log-sum-exp), target [S * B] int64 global ids (contiguous)."""
    S, B, V = logits.shape
    out = torch.empty((S, B, V), dtype=logits.dtype, device=logits.device)
    if out.numel() == 0:
        return out
    blk = _block(V, block, BACKWARD_BLOCK)
    _BACKWARD.launch((S * B, cdiv(V, blk)), logits, logits.stride(0), logits.stride(1),
                     grad_loss, grad_loss.stride(0), grad_loss.stride(1), lse, target, out,
                     B, V, int(vocab_start), BLOCK=blk, num_warps=NUM_WARPS)
    return out
