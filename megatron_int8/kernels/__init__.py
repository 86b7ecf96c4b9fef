"""Triton kernels of the INT8 backend (`backend.TritonBackend` calls these entry points).

- `triton_quantize`: same contract as `ReferenceBackend.quantize` (kernels in kernels/quantize.py);
- `triton_gemm`: same contract as `ReferenceBackend.gemm` (kernels in kernels/int8_gemm.py);
- `triton_grouped_gemm`: same contract as `ReferenceBackend.grouped_gemm` (MoE experts: the same kernels
  in their grouped mode, one launch for all experts).
All run on CUDA, or on CPU under TRITON_INTERPRET=1 (set before triton is first imported).
Importing this package raises ImportError when triton is missing (backend.triton_available checks that).
"""
from .int8_gemm import triton_gemm, triton_grouped_gemm
from .quantize import triton_quantize

__all__ = ["triton_gemm", "triton_grouped_gemm", "triton_quantize"]
