"""RMSNorm with a Triton kernel on CUDA, for both precisions' norms when Transformer Engine is absent.

torch's fused RMSNorm kernels are fast over a hidden size but give every row a block of its own: over
Qwen3's 128-wide q/k heads they move 750 GB/s forward+backward, and their weight-gradient reduction over
65,536 rows of k takes 194 us for 16 MB of input (docs/history.md, 2026-11-22). Those norms
then cost ~0.75 ms per layer and micro-batch, in BF16 and INT8 alike. Over a hidden size (2560-5120)
torch's kernels already run at 2-3 TB/s, and a Python autograd Function would only add host time to
eager steps. `FusedRMSNorm` is `torch.nn.RMSNorm` (same parameter, state-dict key `weight`, same
numerics: fp32 math, one rounding) whose forward runs kernels/rms_norm.py on CUDA for rows of at most
`TRITON_MAX_WIDTH` elements. Elsewhere (wider rows, CPU, mixed input/weight dtypes, no affine weight) it
is torch's own forward.

`int8_copy` (the recipe's int8_norm_input, for the layers' hidden-size norms): backward keeps x's INT8 copy in
1 x 128 blocks (reference.quantize's block granularity) and forward's fp32 rstd instead of x: W + 4 ceil(W/128)
+ 4 instead of 2W bytes per row. On CUDA the Triton kernels then run at every width: the forward writes the
copy while it reads x, the backward dequantizes it while it reads it. Elsewhere, and with
MEGATRON_INT8_NORM_KERNEL=torch, a PyTorch reference does the same.

MEGATRON_INT8_NORM_KERNEL (read at construction): `auto` (the default, as above), `torch` (torch's kernels
everywhere), `triton` (the Triton kernel at every width; for A/B timing).
"""
from __future__ import annotations


import torch

import torch.nn.functional as F

from ..dispatch import ENV_NORM_KERNEL, env_choice
from ..recipe import INT8_COPY_BLOCK
from ..reference import QTensor, dequantize, quantize
from .backend import triton_available, triton_runs_on

TRITON_MAX_WIDTH = 512


class _TritonRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, int8_block: int):
        from ..kernels.rms_norm import triton_rms_norm_forward

        y, rstd, *copy = triton_rms_norm_forward(x, weight, eps, int8_block)
        ctx.save_for_backward(*(copy or (x,)), weight, rstd)
        ctx.int8_block = int8_block
        return y

    @staticmethod
    def backward(ctx, dy):
        from ..kernels.rms_norm import triton_rms_norm_backward

        if ctx.int8_block:
            q, scales, weight, rstd = ctx.saved_tensors
            dx, dw = triton_rms_norm_backward(dy, q, weight, rstd, int8_copy=(scales, ctx.int8_block))
        else:
            x, weight, rstd = ctx.saved_tensors
            dx, dw = triton_rms_norm_backward(dy, x, weight, rstd)
        return dx, dw, None, None


class _ReferenceInt8CopyRMSNorm(torch.autograd.Function):
    """torch's RMSNorm forward; backward from x's INT8 copy (1 x 128 blocks) and the fp32 rstd of x, in fp32:
    g = dy w (dy without an affine weight), dx = rstd (g - xhat mean(g xhat)), dw = sum over rows of dy xhat,
    xhat = x_copy rstd."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        W = x.shape[-1]
        rows = x.reshape(-1, W).float()
        copy = quantize(rows, "block", block_size=INT8_COPY_BLOCK, name="norm input", check_finite="off")
        rstd = torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(copy.data, copy.scale, weight, rstd)
        return F.rms_norm(x, (W,), weight, eps)

    @staticmethod
    def backward(ctx, dy):
        q, scales, weight, rstd = ctx.saved_tensors
        xhat = dequantize(QTensor(q, scales, "block", INT8_COPY_BLOCK)) * rstd
        dy_rows = dy.reshape(q.shape).float()
        g = dy_rows if weight is None else dy_rows * weight.float()
        dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        dw = None if weight is None else (dy_rows * xhat).sum(0).to(weight.dtype)
        return dx.view(dy.shape).to(dy.dtype), dw, None


def norm_kernel_choice() -> str:
    return env_choice(ENV_NORM_KERNEL)


class FusedRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm over the last dimension whose CUDA forward and backward are one Triton kernel each
    where torch's are slow (`use_triton`: rows of at most TRITON_MAX_WIDTH, or every width with `int8_copy`, per
    MEGATRON_INT8_NORM_KERNEL).
    `int8_copy`: keep x's INT8 copy for backward instead of x (the module docstring)."""

    def __init__(self, *args, int8_copy: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.int8_copy = bool(int8_copy)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"FusedRMSNorm normalizes the last dimension only, got {self.normalized_shape}")
        choice = norm_kernel_choice()
        self.use_triton = choice == "triton" or (
            choice == "auto" and (self.normalized_shape[0] <= TRITON_MAX_WIDTH or self.int8_copy))

    def runs_triton(self, x: torch.Tensor) -> bool:
        """Whether the forward of input x runs the Triton kernels (see the class docstring)."""
        weight = self.weight
        return (self.use_triton and weight is not None and x.dtype == weight.dtype
                and triton_runs_on(x.device) and triton_available())

    def eps_for(self, x: torch.Tensor) -> float:
        """The epsilon applied to input x: torch.nn.RMSNorm's default (x's dtype's) when none was set."""
        return self.eps if self.eps is not None else torch.finfo(x.dtype).eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight_grad = self.weight is not None and self.weight.requires_grad  # elementwise_affine=False: no weight
        copy = self.int8_copy and torch.is_grad_enabled() and (x.requires_grad or weight_grad)
        if self.runs_triton(x):
            if x.shape[-1] != self.weight.shape[0]:
                raise ValueError(f"FusedRMSNorm({self.weight.shape[0]}): input of shape {tuple(x.shape)}")
            return _TritonRMSNorm.apply(x, self.weight, self.eps_for(x), INT8_COPY_BLOCK if copy else 0)
        if copy:
            return _ReferenceInt8CopyRMSNorm.apply(x, self.weight, self.eps_for(x))
        return super().forward(x)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", int8_copy=True" if self.int8_copy else "")
