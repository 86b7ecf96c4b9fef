"""The Smooth-SwiGLU-style guard (Int8Recipe.smooth_swiglu) for the linear after a SwiGLU (the MLP's fc2).

Over long runs, SwiGLU's gate and up weights can align so that a few channels of its output grow 10-1000x
(Fishman et al., ICLR 2025, "Scaling FP8 training to trillion-token LLMs", whose Smooth-SwiGLU rescales those
channels without changing the function). Under per-token INT8 scales such a channel sets every token's
scale, and the other channels fall below half a step. Here fprop computes (X diag(1/s)) (W diag(s))^T, which
equals X W^T, with per-channel factors s that share the magnitude between X's channels and W's columns.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def smooth_scales(x_col_amax: torch.Tensor, w_col_amax: torch.Tensor) -> torch.Tensor:
    """Per-channel factors s (powers of two, fp32 [K]) that move the magnitude of an activation's outlier
    channels into the weight's columns: fprop computes (X diag(1/s)) (W diag(s))^T = X W^T, with
    s_k ~ sqrt(amax X[:, k] / amax W[:, k]) (SmoothQuant's balance, alpha = 1/2). Powers of two keep both
    scalings exact in floating point; channels where either amax is 0 (or not finite) keep s = 1."""
    xa, wa = x_col_amax.float(), w_col_amax.float()
    usable = (xa > 0) & (wa > 0) & torch.isfinite(xa) & torch.isfinite(wa)
    ratio = torch.where(usable, xa / torch.where(usable, wa, torch.ones_like(wa)), torch.ones_like(xa))
    return torch.exp2(torch.round(0.5 * torch.log2(ratio)))


def smoothed_fprop_operands(x2d: torch.Tensor, weight: torch.Tensor,
                            x_col_amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(X diag(1/s), W diag(s)) in their own dtypes, with s = `smooth_scales` (`x_col_amax`: X's column
    maxima when already known, e.g. from the SwiGLU kernel)."""
    if x_col_amax is None:
        x_col_amax = x2d.detach().abs().amax(dim=0)
    s = smooth_scales(x_col_amax, weight.detach().abs().amax(dim=0))
    return x2d * (1.0 / s).to(x2d.dtype), weight * s.to(weight.dtype)
