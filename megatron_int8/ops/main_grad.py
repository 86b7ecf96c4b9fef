"""Megatron's gradient-accumulation fusion: weight gradients added into the fp32 `weight.main_grad`."""
from __future__ import annotations

from typing import Optional

import torch

def hp_wgrad_into(main_grad: torch.Tensor, g2d: torch.Tensor, x2d: torch.Tensor) -> None:
    """main_grad += g2d^T x2d, what APEX's fused wgrad does: on CUDA one cuBLAS GEMM that accumulates the 16-bit
    operands' product into the fp32 main_grad in place (no 16-bit gradient written, read and added); elsewhere
    the product in main_grad's dtype, then added: the arithmetic of megatron's unfused route, bit for bit (an
    addmm_ into main_grad rounds differently once the GEMM splits its K = tokens, from 1024 tokens on MKL)."""
    fused = (main_grad.is_cuda and main_grad.dtype == torch.float32 and main_grad.is_contiguous()
             and g2d.dtype in (torch.bfloat16, torch.float16))
    if fused:
        torch.addmm(main_grad, g2d.t(), x2d, torch.float32, out=main_grad)
    else:
        main_grad.add_(g2d.t().to(main_grad.dtype) @ x2d.to(main_grad.dtype))


def main_grad_placeholder(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """Megatron's contract once wgrad went into main_grad: a dummy grad plus grad_added_to_main_grad."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(weight.main_grad.shape, dtype=weight.dtype, device=weight.device)
