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

MEGATRON_INT8_NORM_KERNEL (read at construction): `auto` (the default, as above), `torch` (torch's kernels
everywhere), `triton` (the Triton kernel at every width; for A/B timing).
"""
from __future__ import annotations


import torch

from ..dispatch import ENV_NORM_KERNEL, env_choice
from .backend import triton_available, triton_runs_on

TRITON_MAX_WIDTH = 512


class _TritonRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        from ..kernels.rms_norm import triton_rms_norm_forward

        y, rstd = triton_rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        from ..kernels.rms_norm import triton_rms_norm_backward

        x, weight, rstd = ctx.saved_tensors
        dx, dw = triton_rms_norm_backward(dy, x, weight, rstd)
        return dx, dw, None


def norm_kernel_choice() -> str:
    return env_choice(ENV_NORM_KERNEL)


class FusedRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm over the last dimension whose CUDA forward and backward are one Triton kernel each
    where torch's are slow (`use_triton`: rows of at most TRITON_MAX_WIDTH, per MEGATRON_INT8_NORM_KERNEL)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"FusedRMSNorm normalizes the last dimension only, got {self.normalized_shape}")
        choice = norm_kernel_choice()
        self.use_triton = choice == "triton" or (choice == "auto" and self.normalized_shape[0] <= TRITON_MAX_WIDTH)

    def runs_triton(self, x: torch.Tensor) -> bool:
        """Whether the forward of input x runs the Triton kernels (see the class docstring)."""
        weight = self.weight
        return (self.use_triton and weight is not None and x.dtype == weight.dtype and triton_runs_on(x.device)
                and triton_available())

    def eps_for(self, x: torch.Tensor) -> float:
        """The epsilon applied to input x: torch.nn.RMSNorm's default (x's dtype's) when none was set."""
        return self.eps if self.eps is not None else torch.finfo(x.dtype).eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.runs_triton(x):
            if x.shape[-1] != self.weight.shape[0]:
                raise ValueError(f"FusedRMSNorm({self.weight.shape[0]}): input of shape {tuple(x.shape)}")
            return _TritonRMSNorm.apply(x, self.weight, self.eps_for(x))
        return super().forward(x)
