"""Fused rotary position embedding for megatron-core without Transformer Engine.

Unfused, megatron-core rotates q and k with about ten elementwise launches each way (chunk, neg, cat,
two bf16 multiplies, an add; backward the same). In a Llama2-13B TP 2 step on H200s they took ~1 ms
per layer and micro-batch, as much as the quantization of all four INT8 linears (docs/history.md,
2026-11-22), a cost that BF16 and INT8 pay alike. With `config.apply_rope_fusion`, megatron calls
`rope_utils.fused_apply_rotary_pos_emb`, which only Transformer Engine provides: `install()` puts
`fused_rope` there when TE is absent. On CUDA one Triton kernel (kernels/rope.py) reads q (or k) once
and writes the result, and backward applies the transposed rotation; elsewhere, and for interleaved
rotary dimensions, `rope_reference` computes the same fp32 math with PyTorch ops.

Numerics: cos and sin in fp32 (megatron's unfused path rounds them to bf16 first), products and sums in
fp32, one rounding to the input dtype, as Transformer Engine's fused RoPE does.
"""
from __future__ import annotations

import torch

from .backend import triton_available, triton_runs_on


def _check(t: torch.Tensor, freqs: torch.Tensor) -> None:
    if t.dim() != 4:
        raise ValueError(f"fused_rope: t must be [s, b, h, d], got shape {tuple(t.shape)}")
    if freqs.dim() != 4 or freqs.shape[0] != t.shape[0] or freqs.shape[1] not in (1, t.shape[1]) or freqs.shape[2] != 1:
        raise ValueError(f"fused_rope: freqs must be [s, 1 or b, 1, rot] for t {tuple(t.shape)}, "
                         f"got {tuple(freqs.shape)}")
    rot = freqs.shape[-1]
    if rot % 2 or rot > t.shape[-1]:
        raise ValueError(f"fused_rope: the rotary dimension {rot} must be even and <= the head dimension "
                         f"{t.shape[-1]}")


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """[-x2, x1] of the two halves, or of each (even, odd) pair when interleaved."""
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """t rotated by the angles freqs ([s, 1 or b, 1, rot]; dimensions past rot pass through), in fp32,
    rounded once to t's dtype. Differentiable through PyTorch's autograd."""
    _check(t, freqs)
    rot = freqs.shape[-1]
    x = t[..., :rot].float()
    f = freqs.float()
    out = x * torch.cos(f) + _rotate(x, interleaved) * torch.sin(f)
    return torch.cat((out.to(t.dtype), t[..., rot:]), dim=-1)


class _TritonRoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs):
        from ..kernels.rope import triton_rope

        f = freqs.detach().float().squeeze(2)
        cos, sin = torch.cos(f).contiguous(), torch.sin(f).contiguous()
        ctx.save_for_backward(cos, sin)
        return triton_rope(t, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, grad):
        from ..kernels.rope import triton_rope

        cos, sin = ctx.saved_tensors
        return triton_rope(grad, cos, sin, inverse=True), None


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Transformer Engine's `fused_apply_rotary_pos_emb(t, freqs, interleaved=...)` contract for the sbhd
    layout: t [s, b, h, d], freqs [s, 1 or b, 1, rot] in radians; returns a new contiguous tensor.
    Gradients flow to t only (megatron's freqs are not trained)."""
    _check(t, freqs)
    if not interleaved and triton_runs_on(t.device) and triton_available():
        return _TritonRoPE.apply(t, freqs)
    return rope_reference(t, freqs, interleaved)


def install() -> bool:
    """Make megatron-core's `apply_rope_fusion` path call `fused_rope` where Transformer Engine does not
    provide the fused kernel. Returns whether `fused_rope` is (now) megatron's; TE's stays when present.
    Call it before building a TransformerConfig with apply_rope_fusion=True (its checks look for it)."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_rope
    return rope_utils.fused_apply_rotary_pos_emb is fused_rope
