"""AdamW over compressed states: the state formats and the fused step's PyTorch reference.

One step reads a parameter's master weight, gradient and two moments, and writes them back with the
model's (bf16) parameter. Every state may be stored smaller than fp32:

Master weight, one of
  the fp32 parameter itself     megatron's mixed-precision optimizer hands the optimizer fp32 main params;
  an fp32 tensor                the step writes the bf16 parameter, round to nearest even;
  a remainder (int16)           the fp32 master is the bf16 parameter's 16 bits followed by these 16 low
                                bits: exact, 2 bytes instead of 4 (`split_remainder`, `merge_remainder`).
                                The bf16 half is the master rounded to nearest with ties away from zero,
                                so the int16 holds the signed difference; it differs from a plain bf16
                                cast only on exact ties.
Moments (exp_avg, exp_avg_sq), each fp32, bf16 (round to nearest even) or INT8 (`BlockQuantized`):
  - blocks of QBLOCK = 128 consecutive elements of the flat tensor, one fp32 scale per block
    (0.03 B per element);
  - the scale is a power of two: the smallest 2^k with amax / 2^k < 128 (exp_avg, codes -127..127) or
    < 256 (exp_avg_sq, codes 0..255), read off amax's exponent bits. A power of two makes dequantization
    exact, so dequantizing a block and quantizing it again gives the same codes and scale bit for bit: a
    checkpoint stores the moments dequantized to fp32 (megatron's own layout, so every checkpoint format
    and resharding works as for fp32 states), and a resume is still exact;
  - values round to nearest even, so a code is within half a step of the value, except the block's
    largest values when amax / 2^k lies in (127, 128) (or (255, 256)), which clamp: within one step;
  - exp_avg_sq is stored as sqrt(v): the square root halves the dynamic range a block must span (255
    levels of sqrt(v) are 65025 of v), and the step needs sqrt(v) anyway;
  - sqrt(v) never rounds to code 0 in a block with a nonzero value: a small v stored as 0 would turn
    that element's step into m / eps. The floor of one step only shrinks such steps.
  The step updates the moments in fp32 and uses those values for the parameter update; only what is
  stored between steps is quantized.

The arithmetic, the same in `adamw_step_reference` and the Triton kernel (kernels/adamw.py), in fp32:
  p = p * (1 - lr wd);  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
  p = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)          bc_i = 1 - b_i^step
with the scalars (1 - lr wd, 1 - b1, ...) rounded to fp32 once, on the host, from float64.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..reference import cdiv

QBLOCK = 128
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
# codes' largest magnitude, and the exponent offset that puts amax / scale in [2^(bits-1), 2^bits)
_SIGNED = (127, 6)      # amax / scale in [64, 128)
_UNSIGNED = (255, 7)    # amax / scale in [128, 256)
_EXPONENT_MASK = 0x7F800000
_MIN_NORMAL_BITS = 1 << 23


@dataclass
class BlockQuantized:
    """An INT8 moment: codes (int8 for exp_avg; uint8 of sqrt(v) for exp_avg_sq) and one power-of-two fp32
    scale per QBLOCK elements of the flat tensor."""
    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def is_sqrt(self) -> bool:
        return self.codes.dtype == torch.uint8

    def numel(self) -> int:
        return self.codes.numel()

    @classmethod
    def zeros(cls, numel: int, sqrt: bool, device) -> "BlockQuantized":
        codes = torch.zeros(numel, dtype=torch.uint8 if sqrt else torch.int8, device=device)
        scales = torch.full((cdiv(numel, QBLOCK),), 2.0 ** -126, dtype=torch.float32, device=device)
        return cls(codes, scales)

    @classmethod
    def quantize(cls, values: torch.Tensor, sqrt: bool) -> "BlockQuantized":
        """The INT8 form of fp32 `values` (v itself for exp_avg_sq: its square root is taken here)."""
        flat = values.detach().reshape(-1).float()
        if not torch.isfinite(flat).all():
            raise ValueError("an optimizer moment to quantize holds Inf or NaN")
        if sqrt:
            if (flat < 0).any():
                raise ValueError("exp_avg_sq to quantize holds negative values")
            flat = flat.double().sqrt().float()
        codes, scales = quantize_blocks(flat, sqrt)
        return cls(codes, scales)

    def dequantize(self) -> torch.Tensor:
        """fp32 values, flat (v itself for exp_avg_sq: the square of the stored root, exact)."""
        values = dequantize_blocks(self.codes, self.scales)
        return values * values if self.is_sqrt else values

    def copy_(self, other: "BlockQuantized") -> "BlockQuantized":
        self.codes.copy_(other.codes)
        self.scales.copy_(other.scales)
        return self


Moment = Union[torch.Tensor, BlockQuantized]


def _padded_blocks(flat: torch.Tensor) -> torch.Tensor:
    pad = (-flat.numel()) % QBLOCK
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, QBLOCK)


def block_scales(amax: torch.Tensor, sqrt: bool) -> torch.Tensor:
    """The power-of-two scale of each block from its amax (fp32, >= 0): the smallest 2^k with amax / 2^k
    below 128 (256 for sqrt(v)), taken from amax's exponent field; at least 2^-126 (all-zero blocks too)."""
    offset = (_UNSIGNED if sqrt else _SIGNED)[1]
    bits = (amax.view(torch.int32) & _EXPONENT_MASK) - (offset << 23)
    return bits.clamp(min=_MIN_NORMAL_BITS).view(torch.float32)


def quantize_blocks(flat: torch.Tensor, sqrt: bool):
    """(codes, scales) of a flat fp32 tensor: round to nearest even of x / scale, clamped; sqrt: uint8 codes
    of non-negative values, never 0 where the block's amax is not 0."""
    qmax = (_UNSIGNED if sqrt else _SIGNED)[0]
    blocks = _padded_blocks(flat)
    amax = blocks.abs().amax(dim=1)
    scales = block_scales(amax, sqrt)
    inverse = ((254 << 23) - scales.view(torch.int32)).view(torch.float32)  # 1 / scale, exact
    scaled = torch.round(blocks * inverse[:, None])
    if sqrt:
        floor = (amax > 0).to(torch.float32)[:, None]
        codes = torch.maximum(scaled.clamp(max=qmax), floor).to(torch.uint8)
    else:
        codes = scaled.clamp(-qmax, qmax).to(torch.int8)
    return codes.view(-1)[: flat.numel()].contiguous(), scales


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    blocks = _padded_blocks(codes.to(torch.float32))
    return (blocks * scales[:, None]).view(-1)[: codes.numel()]


# --- master-weight remainders -------------------------------------------------------------------------------

def split_remainder(master: torch.Tensor):
    """(bf16 high half, int16 remainder) of fp32 `master`, with merge_remainder(*split_remainder(x)) == x
    bit for bit. The high half is rounded to nearest (ties away from zero), the remainder is the signed rest."""
    if master.dtype != torch.float32:
        raise TypeError(f"split_remainder needs an fp32 master weight, got {master.dtype}")
    bits = master.view(torch.int32)
    remainder = ((bits & 0xFFFF) ^ 0x8000) - 0x8000  # the low 16 bits, sign-extended
    high = (bits - remainder) >> 16
    return high.to(torch.int16).view(torch.bfloat16), remainder.to(torch.int16)


def merge_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master weight of a bf16 parameter and its int16 remainder."""
    if param.dtype != torch.bfloat16 or remainder.dtype != torch.int16:
        raise TypeError(f"merge_remainder needs a bf16 parameter and an int16 remainder, got {param.dtype} and "
                        f"{remainder.dtype}")
    bits = (param.view(torch.int16).to(torch.int32) << 16) + remainder.to(torch.int32)
    return bits.view(torch.float32)


# --- the moments' storage -----------------------------------------------------------------------------------

def new_moment(numel: int, dtype: str, sqrt: bool, device) -> Moment:
    """A zero moment of `numel` elements stored as `dtype` ('fp32', 'bf16' or 'int8')."""
    if dtype == "int8":
        return BlockQuantized.zeros(numel, sqrt, device)
    return torch.zeros(numel, dtype=STATE_DTYPES[dtype], device=device)


def moment_to_fp32(moment: Moment) -> torch.Tensor:
    """A moment's values, flat fp32 (a new tensor)."""
    if isinstance(moment, BlockQuantized):
        return moment.dequantize()
    return moment.detach().reshape(-1).to(torch.float32, copy=True)


def store_moment(moment: Moment, values: torch.Tensor) -> None:
    """Write fp32 `values` (any shape with the moment's numel) into a moment, in its format."""
    if values.numel() != moment.numel():
        raise ValueError(f"optimizer state of {values.numel()} elements for a moment of {moment.numel()}")
    if isinstance(moment, BlockQuantized):
        moment.copy_(BlockQuantized.quantize(values, moment.is_sqrt))
    else:
        moment.copy_(values.detach().reshape(-1))


# --- the step -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AdamWScalars:
    """One step's scalars, rounded to fp32 once from float64 (the reference and the kernel read these)."""
    decay: float        # 1 - lr * weight_decay
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    step_size: float    # lr / (1 - beta1^step)
    inv_sqrt_bc2: float  # 1 / sqrt(1 - beta2^step)
    eps: float

    @classmethod
    def of(cls, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int):
        if step < 1:
            raise ValueError(f"AdamW step count must be >= 1, got {step}")
        f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
        bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
        return cls(f32(1.0 - lr * weight_decay), f32(beta1), f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2),
                   f32(lr / bc1), f32(1.0 / math.sqrt(bc2)), f32(eps))


def adamw_step_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: Moment, exp_avg_sq: Moment,
                         scalars: AdamWScalars, master: Optional[torch.Tensor] = None) -> None:
    """One AdamW step in place, in fp32, on flat tensors of one numel.

    param: the fp32 master itself (master None), or the bf16 parameter the step writes (master an fp32
    tensor, or the int16 remainder of the master whose high half is `param`). grad: fp32 or bf16."""
    s = {k: torch.tensor(v, dtype=torch.float32) for k, v in scalars.__dict__.items()}
    if master is None:
        weight = param.float()
    elif master.dtype == torch.int16:
        weight = merge_remainder(param, master)
    else:
        weight = master.clone()
    g = grad.float()
    m = s["beta1"] * moment_to_fp32(exp_avg) + s["one_minus_beta1"] * g
    v = s["beta2"] * moment_to_fp32(exp_avg_sq) + s["one_minus_beta2"] * (g * g)
    root = v.double().sqrt().float()  # correctly rounded, as the kernel's sqrt_rn (torch's fp32 sqrt on CPU is not)
    denom = root * s["inv_sqrt_bc2"] + s["eps"]
    weight = weight * s["decay"] - s["step_size"] * (m / denom)
    if master is None:
        param.copy_(weight)
    elif master.dtype == torch.int16:
        high, remainder = split_remainder(weight)
        param.copy_(high)
        master.copy_(remainder)
    else:
        master.copy_(weight)
        param.copy_(weight)  # round to nearest even
    for moment, values in ((exp_avg, m), (exp_avg_sq, v)):
        if isinstance(moment, BlockQuantized):  # v from its root: sqrt(v) was computed once
            codes, scales = quantize_blocks(root if moment.is_sqrt else values, moment.is_sqrt)
            moment.codes.copy_(codes)
            moment.scales.copy_(scales)
        else:
            moment.copy_(values)


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: Moment, exp_avg_sq: Moment,
               scalars: AdamWScalars, master: Optional[torch.Tensor] = None) -> None:
    """`adamw_step_reference`'s step, as one Triton kernel on CUDA (or under TRITON_INTERPRET=1) where triton
    is installed; the reference elsewhere."""
    from ..dispatch import triton_installed, triton_runs_on

    if triton_runs_on(param.device) and triton_installed():
        from ..kernels.adamw import triton_adamw_step

        def parts(moment):
            if isinstance(moment, BlockQuantized):
                return moment.codes, moment.scales
            return moment, None

        triton_adamw_step(param, grad, *parts(exp_avg), *parts(exp_avg_sq), master, **scalars.__dict__)
    else:
        adamw_step_reference(param, grad, exp_avg, exp_avg_sq, scalars, master)
