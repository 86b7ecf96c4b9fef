"""Triton kernels of the INT8 backend, and `TritonBackend`, their entry point for the ops.

- `triton_quantize`: same contract as `reference.ReferenceBackend.quantize` (kernels in kernels/quantize.py);
- `triton_gemm`: same contract as `ReferenceBackend.gemm` (kernels in kernels/int8_gemm.py);
- `triton_grouped_gemm`: same contract as `ReferenceBackend.grouped_gemm` (MoE experts: the same kernels
  in their grouped mode, one launch for all experts).
All run on CUDA, or on CPU under TRITON_INTERPRET=1 (set before triton is first imported).
Importing this package raises ImportError when triton is missing (ops.backend.triton_available checks that).
"""
from .int8_gemm import triton_gemm, triton_grouped_gemm
from .quantize import triton_quantize

__all__ = ["TritonBackend", "triton_gemm", "triton_grouped_gemm", "triton_quantize"]


class TritonBackend:
    """The Triton kernels behind the backend contract (CUDA, or CPU under TRITON_INTERPRET=1)."""

    name = "triton"

    def quantize(self, x, **kwargs):
        return triton_quantize(x, **kwargs)

    def gemm(self, a, b, *, out_dtype, bias=None, accumulate_into=None, autotune=True, out=None):
        return triton_gemm(a, b, out_dtype=out_dtype, bias=bias, accumulate_into=accumulate_into, autotune=autotune,
                           out=out)

    def grouped_gemm(self, a, b, segments, *, out_dtype):
        return triton_grouped_gemm(a, b, segments, out_dtype=out_dtype)
