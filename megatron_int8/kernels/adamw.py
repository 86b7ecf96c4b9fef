"""Triton AdamW over compressed states: one kernel reads and writes everything a parameter's step touches.

The formats and the arithmetic are megatron_int8/ops/adamw.py's (its `adamw_step_reference` is the
specification). Each program owns QB blocks of QBLOCK = 128 consecutive elements, a [QB, 128] tile:
  1. load the master weight: the fp32 parameter, an fp32 master, or the bf16 parameter with its int16
     remainder (merged by integer ops: (bf16 bits << 16) + remainder);
  2. dequantize the moments (codes * power-of-two scale; exp_avg_sq's codes are sqrt(v));
  3. the AdamW update in fp32;
  4. requantize: each block's amax, its power-of-two scale from amax's exponent bits, round to nearest
     even (the 1.5 * 2^23 trick, exact below 2^22), clamp;
  5. write the master (or remainder) and the bf16 parameter.
The kernel launches with fp contraction off and IEEE square root and division, so on a GPU it computes
the reference's fp32 operations one by one (no FMA), as the interpreter does.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._tl import ROUND_MAGIC
from .launch import LaunchCache, cdiv

QBLOCK = 128
BLOCKS_PER_PROGRAM = 8
# kinds of a moment's storage and of the master weight (constexprs)
FP32, BF16, INT8 = 0, 1, 2
PARAM_IS_MASTER, MASTER_FP32, MASTER_REMAINDER = 0, 1, 2


@triton.jit
def _dequantize(codes_ptr, scales_ptr, offs, mask, block_ids, bmask, KIND: tl.constexpr):
    if KIND == 2:
        scale = tl.load(scales_ptr + block_ids, mask=bmask, other=0.0)
        return tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.float32) * scale[:, None]
    else:
        return tl.load(codes_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_quantized(codes_ptr, scales_ptr, values, offs, mask, block_ids, bmask, KIND: tl.constexpr,
                     SQRT: tl.constexpr):
    """values: [QB, QBLOCK] fp32 (sqrt(v) when SQRT), masked lanes 0."""
    if KIND == 2:
        amax = tl.max(tl.abs(values), axis=1)
        exponent = amax.to(tl.int32, bitcast=True) & 0x7F800000
        if SQRT:  # amax / scale in [128, 256)
            scale_bits = exponent - (7 << 23)
        else:  # amax / scale in [64, 128)
            scale_bits = exponent - (6 << 23)
        scale_bits = tl.maximum(scale_bits, 1 << 23)
        scale = scale_bits.to(tl.float32, bitcast=True)
        inverse = ((254 << 23) - scale_bits).to(tl.float32, bitcast=True)
        scaled = values * inverse[:, None]
        rounded = (scaled + ROUND_MAGIC) - ROUND_MAGIC
        if SQRT:
            floor = tl.where(amax > 0.0, 1.0, 0.0)
            codes = tl.maximum(tl.minimum(rounded, 255.0), floor[:, None]).to(tl.uint8)
        else:
            codes = tl.minimum(tl.maximum(rounded, -127.0), 127.0).to(tl.int8)
        tl.store(codes_ptr + offs, codes, mask=mask)
        tl.store(scales_ptr + block_ids, scale, mask=bmask)
    else:
        tl.store(codes_ptr + offs, values.to(codes_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_kernel(
    param_ptr, grad_ptr, master_ptr,
    m_ptr, m_scales_ptr, v_ptr, v_scales_ptr,
    n,
    decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_sqrt_bc2, eps,
    QB: tl.constexpr, QBLOCK_: tl.constexpr,
    MASTER: tl.constexpr, M_KIND: tl.constexpr, V_KIND: tl.constexpr,
):
    pid = tl.program_id(0)
    block_ids = pid * QB + tl.arange(0, QB)
    offs = block_ids.to(tl.int64)[:, None] * QBLOCK_ + tl.arange(0, QBLOCK_)[None, :]
    mask = offs < n
    bmask = block_ids.to(tl.int64) * QBLOCK_ < n

    if MASTER == 2:
        high = tl.load(param_ptr + offs, mask=mask, other=0.0).to(tl.int16, bitcast=True).to(tl.int32)
        low = tl.load(master_ptr + offs, mask=mask, other=0).to(tl.int32)
        weight = ((high << 16) + low).to(tl.float32, bitcast=True)
    elif MASTER == 1:
        weight = tl.load(master_ptr + offs, mask=mask, other=0.0)
    else:
        weight = tl.load(param_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    m = beta1 * _dequantize(m_ptr, m_scales_ptr, offs, mask, block_ids, bmask, M_KIND) + one_minus_beta1 * g
    if V_KIND == 2:
        root_old = _dequantize(v_ptr, v_scales_ptr, offs, mask, block_ids, bmask, V_KIND)
        v_old = root_old * root_old
    else:
        v_old = _dequantize(v_ptr, v_scales_ptr, offs, mask, block_ids, bmask, V_KIND)
    v = beta2 * v_old + one_minus_beta2 * (g * g)
    root = tl.sqrt_rn(v)
    denom = root * inv_sqrt_bc2 + eps
    weight = weight * decay - step_size * tl.div_rn(m, denom)
    weight = tl.where(mask, weight, 0.0)

    if MASTER == 2:
        bits = weight.to(tl.int32, bitcast=True)
        remainder = ((bits & 0xFFFF) ^ 0x8000) - 0x8000
        high_out = ((bits - remainder) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        tl.store(param_ptr + offs, high_out, mask=mask)
        tl.store(master_ptr + offs, remainder.to(tl.int16), mask=mask)
    elif MASTER == 1:
        tl.store(master_ptr + offs, weight, mask=mask)
        tl.store(param_ptr + offs, weight.to(param_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(param_ptr + offs, weight.to(param_ptr.dtype.element_ty), mask=mask)

    _store_quantized(m_ptr, m_scales_ptr, tl.where(mask, m, 0.0), offs, mask, block_ids, bmask, M_KIND, False)
    if V_KIND == 2:
        _store_quantized(v_ptr, v_scales_ptr, tl.where(mask, root, 0.0), offs, mask, block_ids, bmask, V_KIND, True)
    else:
        _store_quantized(v_ptr, v_scales_ptr, v, offs, mask, block_ids, bmask, V_KIND, False)


_LAUNCH = LaunchCache(_adamw_kernel)


def _kind(tensor: torch.Tensor, scales: Optional[torch.Tensor]) -> int:
    if scales is not None:
        return INT8
    return {torch.float32: FP32, torch.bfloat16: BF16}[tensor.dtype]


def triton_adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_scales: Optional[torch.Tensor], exp_avg_sq: torch.Tensor,
                      exp_avg_sq_scales: Optional[torch.Tensor], master: Optional[torch.Tensor], *,
                      decay: float, beta1: float, one_minus_beta1: float, beta2: float, one_minus_beta2: float,
                      step_size: float, inv_sqrt_bc2: float, eps: float) -> None:
    """One AdamW step in place on contiguous flat tensors of one numel (see ops/adamw.py for the formats):
    INT8 moments pass their codes and scales, fp32/bf16 moments the tensor and None."""
    n = param.numel()
    tensors = [param, grad, exp_avg, exp_avg_sq] + ([master] if master is not None else [])
    if any(t.numel() != n or not t.is_contiguous() for t in tensors):
        raise ValueError("triton_adamw_step needs contiguous tensors of one numel")
    if master is None:
        kind = PARAM_IS_MASTER
    else:
        kind = MASTER_REMAINDER if master.dtype == torch.int16 else MASTER_FP32
    if n == 0:
        return
    dummy = param  # never read: the kernel touches scales only for INT8 moments
    _LAUNCH.launch(
        (cdiv(n, QBLOCK * BLOCKS_PER_PROGRAM),),
        param, grad, master if master is not None else dummy,
        exp_avg, exp_avg_scales if exp_avg_scales is not None else dummy,
        exp_avg_sq, exp_avg_sq_scales if exp_avg_sq_scales is not None else dummy,
        n, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_sqrt_bc2, eps,
        QB=BLOCKS_PER_PROGRAM, QBLOCK_=QBLOCK, MASTER=kind, M_KIND=_kind(exp_avg, exp_avg_scales),
        V_KIND=_kind(exp_avg_sq, exp_avg_sq_scales), enable_fp_fusion=False, num_warps=4,
    )
