"""SwiGLU for megatron-core's dense MLP: one Triton kernel each way on CUDA, handing maxima to the INT8 linears.

In a Qwen3-4B layer the two largest tensors the INT8 linears quantize are SwiGLU's: its output (fc2's
input, 8192 x 9728 per micro-batch) and its input gradient (fc1's output gradient, 8192 x 19456). Row-wise
quantization reads such a tensor twice, once for its row and column maxima and once to round it. Here the
kernel that writes the tensor also writes its maxima (`emit_maxima`), attached to it with
`reference.attach_maxima`; the INT8 linear finds them (`reference.known_maxima`) and reads the tensor once.

megatron's MLP calls the module in `MLPSubmodules.activation_func` when `config.use_te_activation_func` is
set (a name from Transformer Engine, whose modules fill that slot otherwise); the INT8 spec puts `SwiGLU`
there and the trainer sets the flag for dense SwiGLU models, BF16 runs included, so both precisions run the
same activation kernels. Without the flag megatron applies its own SwiGLU and nothing changes.

`weighted_swiglu` is the same with one weight per row, the router probability: megatron's weighted SwiGLU
for MoE experts, which the grouped experts (megatron_int8.megatron.experts) run in both precisions.

Numerics: fp32 math, one rounding to the input's dtype, forward and backward, as megatron's fused
(torch.compile'd) SwiGLU. On CPU, or without Triton, `swiglu_reference` computes the same with PyTorch ops.

`int8_copy` (the recipe's `int8_swiglu_input`): backward needs a and b; instead of x (the fc1 output, 2F
values per token in BF16: the largest tensor a layer keeps for backward) SwiGLU then keeps x's INT8 copy,
each half quantized in 1 x 128 blocks (reference.quantize's block granularity): 2F + 8 ceil(F/128) bytes per
token instead of 4F. The forward output is computed from x itself; backward differentiates at the
dequantized values, each within half a step (its block's amax / 254) of x. The forward kernel writes the
copy while it reads x, the backward kernel dequantizes it while it reads it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import triton_available, triton_runs_on
from ..recipe import INT8_COPY_BLOCK
from ..reference import QTensor, attach_maxima, dequantize, quantize

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    """silu(a) * b for x = [a | b] (halves of the last dimension), in fp32, rounded once to x's dtype.
    Differentiable through PyTorch's autograd (which keeps fp32 copies for backward; `swiglu` keeps x)."""
    a, b = _halves(x)
    return (F.silu(a) * b).to(x.dtype)


def _kernels_run_on(x: torch.Tensor) -> bool:
    """Whether the Triton kernels take x (its dtype, its device, Triton installed)."""
    return x.dtype in _KERNEL_DTYPES and triton_runs_on(x.device) and triton_available()


def _halves(x: torch.Tensor):
    """(a, b) in fp32 for x = [a | b]; x's last dimension must be even."""
    if not x.is_floating_point():  # the fp32 result was cast back to x's dtype: integers truncated it
        raise TypeError(f"swiglu: x must be floating point, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dimension of x must be even (two halves), got shape {tuple(x.shape)}")
    return x.float().chunk(2, dim=-1)


class _TritonSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, emit_maxima: bool, int8_copy: bool):
        from ..kernels.swiglu import triton_swiglu_forward, triton_swiglu_forward_int8_copy

        if int8_copy:
            y, rows, cols, q, scales = triton_swiglu_forward_int8_copy(x, INT8_COPY_BLOCK, emit_maxima)
            ctx.save_for_backward(q, scales)
        else:
            y, rows, cols = triton_swiglu_forward(x, emit_maxima)
            ctx.save_for_backward(x)
        ctx.emit_maxima, ctx.int8_copy = emit_maxima, int8_copy
        return attach_maxima(y, rows, cols) if emit_maxima else y

    @staticmethod
    def backward(ctx, dy):
        from ..kernels.swiglu import triton_swiglu_backward, triton_swiglu_backward_int8_copy

        if ctx.int8_copy:
            q, scales = ctx.saved_tensors
            dx, rows, cols = triton_swiglu_backward_int8_copy(dy, q, scales, INT8_COPY_BLOCK, ctx.emit_maxima)
        else:
            (x,) = ctx.saved_tensors
            dx, rows, cols = triton_swiglu_backward(dy, x, ctx.emit_maxima)
        return (attach_maxima(dx, rows, cols) if ctx.emit_maxima else dx), None, None


def int8_copy_of_halves(x: torch.Tensor, block: int = INT8_COPY_BLOCK):
    """(q, scales) of x [..., 2F]: each half quantized in 1 x `block` blocks (reference.quantize), q [R, 2F] int8
    and scales [R, 2 ceil(F/block)] fp32, a's first: the reference of the Triton forward's INT8 copy."""
    a, b = x.reshape(-1, x.shape[-1]).chunk(2, dim=-1)
    qa, qb = (quantize(h, "block", block_size=block, name="swiglu input", check_finite="off") for h in (a, b))
    return torch.cat([qa.data, qb.data], 1), torch.cat([qa.scale, qb.scale], 1)


def dequantize_halves(q: torch.Tensor, scales: torch.Tensor, block: int = INT8_COPY_BLOCK) -> torch.Tensor:
    """fp32 [R, 2F] of an INT8 copy made by `int8_copy_of_halves` (q * scale, as the backward kernel computes)."""
    F, nb = q.shape[-1] // 2, scales.shape[-1] // 2
    return torch.cat([dequantize(QTensor(q[:, i * F:(i + 1) * F], scales[:, i * nb:(i + 1) * nb], "block", block))
                      for i in (0, 1)], 1)


class _ReferenceSwiGLU(torch.autograd.Function):
    """The PyTorch SwiGLU (fp32 math, as swiglu_reference) keeping for backward what the Triton path keeps: x, or
    its INT8 copy (so that CPU measurements of saved bytes hold for GPU runs)."""

    @staticmethod
    def forward(ctx, x, int8_copy: bool):
        _halves(x)  # checks the shape
        ctx.save_for_backward(*(int8_copy_of_halves(x) if int8_copy else (x,)))
        ctx.shape = x.shape
        return swiglu_reference(x)

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        x = dequantize_halves(*saved).view(ctx.shape) if len(saved) == 2 else saved[0].float()
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            a, b = x.chunk(2, dim=-1)
            (dx,) = torch.autograd.grad(F.silu(a) * b, x, dy.float())
        return dx.to(dy.dtype), None


def swiglu(x: torch.Tensor, emit_maxima: bool = False, int8_copy: bool = False) -> torch.Tensor:
    """silu(a) * b for x = [a | b] (halves of the last dimension); the Triton kernels where they run.
    `emit_maxima`: attach the output's and the input gradient's row/column maxima (reference.known_maxima).
    `int8_copy`: keep x's INT8 copy (1 x 128 blocks) for backward instead of x (the module docstring)."""
    if _kernels_run_on(x):
        # the kernels check x's shape, as the reference does
        return _TritonSwiGLU.apply(x, bool(emit_maxima), bool(int8_copy))
    if x.requires_grad:
        return _ReferenceSwiGLU.apply(x, bool(int8_copy))
    return swiglu_reference(x)


def weighted_swiglu_reference(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """silu(a) * b * probs (one weight per row, as megatron's weighted SwiGLU for MoE experts), in fp32,
    rounded once to x's dtype. Differentiable through PyTorch's autograd (x and probs)."""
    if tuple(probs.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"weighted swiglu: probs {tuple(probs.shape)} must match x's rows {tuple(x.shape[:-1])}")
    a, b = _halves(x)
    return (F.silu(a) * b * probs.float().unsqueeze(-1)).to(x.dtype)


class _TritonWeightedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs):
        from ..kernels.swiglu import triton_swiglu_forward

        y, _, _ = triton_swiglu_forward(x, probs=probs)
        ctx.save_for_backward(x, probs)
        return y

    @staticmethod
    def backward(ctx, dy):
        from ..kernels.swiglu import triton_weighted_swiglu_backward

        x, probs = ctx.saved_tensors
        dx, dprobs = triton_weighted_swiglu_backward(dy, x, probs)
        return dx, (dprobs if ctx.needs_input_grad[1] else None)


def weighted_swiglu(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """silu(a) * b * probs for x = [a | b] and one weight per row (the router probability of the token-expert
    pair): megatron's weighted SwiGLU for MoE experts, one Triton kernel each way where they run. Both x's and
    probs' gradients flow; probs' is the fp32 row sum of silu(a) b dy, rounded once to probs' dtype."""
    if _kernels_run_on(x) and probs.is_floating_point():
        return _TritonWeightedSwiGLU.apply(x, probs)  # the kernels check the shapes
    return weighted_swiglu_reference(x, probs)


class SwiGLU(torch.nn.Module):
    """megatron MLP's activation module for SwiGLU (`MLPSubmodules.activation_func`): built by megatron with
    `config=`; `emit_maxima` (spec param) when the linears around it quantize row- or tensor-wise; `int8_copy`
    (spec param, the recipe's int8_swiglu_input) to keep its input for backward in INT8."""

    def __init__(self, config=None, emit_maxima: bool = False, int8_copy: bool = False):
        super().__init__()
        if config is not None:
            if not config.gated_linear_unit or config.activation_func is not F.silu:
                raise ValueError("SwiGLU: config must have gated_linear_unit=True and activation_func=F.silu, got "
                                 f"{config.gated_linear_unit} and {getattr(config.activation_func, '__name__', '?')}")
            if getattr(config, "activation_func_clamp_value", None) is not None or \
                    getattr(config, "glu_linear_offset", 0.0) != 0.0:
                raise ValueError("SwiGLU: activation_func_clamp_value / glu_linear_offset are not supported")
        self.emit_maxima = bool(emit_maxima)
        self.int8_copy = bool(int8_copy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.emit_maxima, self.int8_copy)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """No state: megatron's MLP asks each child for its sharded state dict when a checkpoint is saved."""
        return {}

    def extra_repr(self) -> str:
        return f"emit_maxima={self.emit_maxima}, int8_copy={self.int8_copy}"
