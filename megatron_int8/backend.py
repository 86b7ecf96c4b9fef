"""Backend dispatch: one place decides whether quantize/GEMM run in PyTorch or in Triton.

A backend offers two calls with identical contracts (see quantize.py for conventions):
  quantize(x2d, *, granularity, block_size, weight, rowwise, columnwise, stochastic, name, check_finite,
           amax=None, columnwise_pad=1, columnwise_amax=None, columnwise_segments=None, rowwise_amax=None)
      -> (Q(x) as [R, C] or None, Q(x^T) as [C, R'] or None)
      (`amax`: tensorwise only, a precomputed amax, e.g. reduced over the tensor-parallel group;
      `columnwise_pad`: R' = R rounded up to a multiple of it, the extra columns of Q(x^T) zero, so that
      a GEMM contracting over R (wgrad) gets 16-byte aligned rows; see quantize.pad_columns;
      `columnwise_amax`: row-wise only, x's per-column amax [C] for Q(x^T)'s scales, e.g. reduced over
      the tensor-parallel group, while Q(x) keeps its own per-row scales (unless `rowwise_amax` is given);
      `rowwise_amax`: row-wise only, x's per-row amax [R] for Q(x)'s scales, e.g. computed by the kernel
      that wrote x (see quantize.known_maxima): with both given, x is read once;
      `columnwise_segments`: row-wise only, a quantize.Segments layout of x's rows (MoE experts): Q(x^T)
      gets one scale per column per segment, [E, C], see quantize.quantize_segment_columns;
      `out`: row-wise only, (QTensor or None, QTensor or None) to write Q(x) / Q(x^T) and their scales into,
      e.g. an expert's slot of a stacked weight, which saves the copy; see quantize.check_quantize_out)
  gemm(a, b, *, out_dtype, bias=None, accumulate_into=None, autotune=True, out=None) -> dequant(a @ b^T) [+ bias]
      (`autotune`: a hint for kernels with tunable tiles; the result is the same either way; `out`: a
      contiguous [M, N] tensor to write, e.g. a row range of a larger output)
  grouped_gemm(a, b, segments, *, out_dtype) -> per segment e, dequant(a_e @ b[e]^T) in a's rows of e
      (MoE experts: a row-wise [R, K] in the segments' layout, b stacked [E, N, K] with scales [E, N])
`rowwise` is the operand contracted over its columns, `columnwise` the one contracted over its rows;
a kernel may produce both in one pass (fused cast-transpose).
"""
from __future__ import annotations

import functools
import importlib.util
import os
from typing import Optional, Tuple

import torch

from . import quantize as ref
from .recipe import BACKENDS, Int8Recipe

ENV_BACKEND = "MEGATRON_INT8_BACKEND"


class ReferenceBackend:
    """PyTorch ops; INT8 products through torch._int_mm (exact INT32 accumulation on CPU and CUDA)."""

    name = "reference"

    def quantize(
        self,
        x: torch.Tensor,
        *,
        granularity: str,
        block_size: int,
        weight: bool,
        rowwise: bool,
        columnwise: bool,
        stochastic: bool = False,
        name: str = "tensor",
        check_finite: str = "deferred",
        amax: Optional[torch.Tensor] = None,
        columnwise_pad: int = 1,
        columnwise_amax: Optional[torch.Tensor] = None,
        columnwise_segments: Optional[ref.Segments] = None,
        rowwise_amax: Optional[torch.Tensor] = None,
        out: Optional[Tuple[Optional[ref.QTensor], Optional[ref.QTensor]]] = None,
    ) -> Tuple[Optional[ref.QTensor], Optional[ref.QTensor]]:
        ref.check_quantize_args(x, granularity, amax, columnwise_pad, block_size, columnwise_amax, rowwise_amax)
        if columnwise_segments is not None:
            ref.check_segments(x, granularity, columnwise_segments, columnwise_amax, columnwise_pad)
        if out is not None:
            ref.check_quantize_out(x, granularity, rowwise, columnwise, columnwise_pad, columnwise_segments, out)
        tile2d = weight and granularity == "block"
        kw = dict(block_size=block_size, stochastic=stochastic, name=name, check_finite=check_finite, amax=amax)
        row = col = None
        if rowwise:
            row = ref.quantize(x, granularity, tile2d=tile2d,
                               **dict(kw, amax=rowwise_amax if rowwise_amax is not None else amax))
        if columnwise and columnwise_segments is not None:  # aligned rows: no padding needed
            col = ref.quantize_segment_columns(x, columnwise_segments, **kw)
        elif columnwise:
            if row is not None and (granularity == "tensor" or tile2d):
                col = row.transposed()  # same scales: a byte transpose, identical rounding
            else:
                col = ref.quantize(x.t(), granularity, tile2d=tile2d,
                                   **dict(kw, amax=columnwise_amax if columnwise_amax is not None else amax))
            col = ref.pad_columns(col, columnwise_pad)
        if out is not None:
            row, col = (r if dest is None else ref.write_into(r, dest) for r, dest in zip((row, col), out))
        return row, col

    def gemm(self, a, b, *, out_dtype, bias=None, accumulate_into=None, autotune=True, out=None):
        return ref.gemm(a, b, out_dtype=out_dtype, bias=bias, accumulate_into=accumulate_into, out=out)

    def grouped_gemm(self, a, b, segments, *, out_dtype):
        return ref.grouped_gemm(a, b, segments, out_dtype=out_dtype)


class TritonBackend:
    """Triton kernels from megatron_int8.kernels (CUDA, or CPU under TRITON_INTERPRET=1)."""

    name = "triton"

    def __init__(self):
        from . import kernels  # imported lazily: triton is optional

        self._quantize = kernels.triton_quantize
        self._gemm = kernels.triton_gemm
        self._grouped_gemm = kernels.triton_grouped_gemm

    def quantize(self, x, **kwargs):
        return self._quantize(x, **kwargs)

    def gemm(self, a, b, *, out_dtype, bias=None, accumulate_into=None, autotune=True, out=None):
        return self._gemm(a, b, out_dtype=out_dtype, bias=bias, accumulate_into=accumulate_into, autotune=autotune,
                          out=out)

    def grouped_gemm(self, a, b, segments, *, out_dtype):
        return self._grouped_gemm(a, b, segments, out_dtype=out_dtype)


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        from . import kernels  # noqa: F401
    except ImportError:
        return False
    return True


def triton_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _instance(name: str):
    return ReferenceBackend() if name == "reference" else TritonBackend()


def resolve_backend_name(device: torch.device, recipe: Int8Recipe) -> str:
    """The backend a recipe runs with on a device; MEGATRON_INT8_BACKEND overrides the recipe."""
    choice = os.environ.get(ENV_BACKEND) or recipe.backend
    if choice not in BACKENDS:
        raise ValueError(f"{ENV_BACKEND}={choice!r}: expected one of {BACKENDS}")
    if choice == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "reference"
    if choice == "triton":
        if not triton_available():
            raise ImportError("INT8 backend 'triton' requested but triton (or megatron_int8.kernels) is not importable")
        if not triton_runs_on(device):
            raise ValueError(f"INT8 backend 'triton' needs a CUDA tensor (or TRITON_INTERPRET=1), got {device}")
    return choice


def get_backend(device: torch.device, recipe: Int8Recipe):
    return _instance(resolve_backend_name(device, recipe))
