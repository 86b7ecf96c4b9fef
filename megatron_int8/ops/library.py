"""The backend's quantize and GEMM steps as torch.library custom ops, so that torch.compile traces
`int8_linear` (forward and backward) into one graph with no breaks.

The ops are registered with `torch.library.Library` (define, one CompositeExplicitAutograd implementation,
register_fake), not with the `@torch.library.custom_op` decorator: the decorator's Python autograd and
redispatch layers cost 50-120 us of host time per call on an H200 host, the Library op 6-15 us
(docs/benchmarks.md, "Drop-in op"), and a linear's forward and backward make five calls. None of
the ops needs an autograd formula: they run inside int8_linear's autograd.Function.

Under Dynamo, `int8_linear` runs with `traced_backend(...)`, a `TracedBackend`: the same contract as
reference.ReferenceBackend / kernels.TritonBackend, each call one of the ops below, whose real
implementation calls the eager backend (so compiled and eager results are the same bits) and whose fake
implementation gives the output shapes (the contract's, in reference.py's docstring). Eager calls never
come here: they keep the direct backend calls, with no dispatcher overhead (the eager launch path is
host-bound).

The weight cache (weight_cache.py) keys on the weight's storage and version counter, which Dynamo cannot
guard on. Under compile the cache lookup moves *inside* an op: `megatron_int8::weight_gemm` takes the
high-precision weight and looks Q(W) / Q(W)^T up (or quantizes it) when the graph runs, so compiled
graphs keep quantizing each weight once per change, like eager. (Returning the cached INT8 tensors from an
op instead would hand the compiler buffers it believes it owns and may reuse.)

Under mode="reduce-overhead" (CUDA graphs recorded by torch.compile) the recorded call quantizes the weight
without the cache (see weight_gemm_op), so every replay quantizes it once more.

Not supported under compile, with a clear error at trace time: GEMMs into given destinations (`out=`,
`accumulate_into=`, i.e. gradient-accumulation fusion and the pipelined TP overlap) and segmented (MoE)
quantization. Tensor-parallel options (TPOptions) are not tested under compile. These serve the megatron-core
layers, which run eager (and CUDA-graphed).
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional, Tuple

import torch

from ..dispatch import resolve_backend_name
from ..recipe import Int8Recipe
from ..reference import QTensor, cdiv, padded_length
from .backend import backend_instance
from .weight_cache import quantized_weight

# Dynamo traces backend.quantize_kwargs (an lru_cache of a pure function of the recipe) through its cache,
# and says so once per call site, in every compiled program: the result is the same either way
warnings.filterwarnings("ignore", message=r"Dynamo detected a call to a `functools\.lru_cache`-wrapped function "
                        r"at '(linear|weight_cache)\.py:")


def traced_backend(device: torch.device, recipe: Int8Recipe) -> "TracedBackend":
    """What int8_linear runs with while Dynamo traces it, behind the custom ops: get_backend's choice, except that
    "auto" takes triton being installed for the kernels importing (Dynamo reads that module constant; where they
    do not import, the Triton backend's construction says why)."""
    return TracedBackend(resolve_backend_name(device, recipe))


def _owned(t: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """t, or a copy where it shares storage with another output: an op's outputs must not alias each other
    (the Triton kernels keep a call's row and column scales in one buffer; tensorwise, one scale serves both,
    and a one-row operand's byte transpose is a view of Q(x))."""
    if any(o.numel() and o.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for o in others):
        return t.clone()
    return t


def _quantize(x: torch.Tensor, backend: str, granularity: str, block_size: int, weight: bool, rowwise: bool,
              columnwise: bool, stochastic: bool, name: str, check_finite: str,
              columnwise_pad: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Q(x), its scales, Q(x^T), its scales) as backend.quantize gives them; empty where not requested."""
    row, col = backend_instance(backend).quantize(
        x, granularity=granularity, block_size=block_size, weight=weight, rowwise=rowwise, columnwise=columnwise,
        stochastic=stochastic, name=name, check_finite=check_finite, columnwise_pad=columnwise_pad)
    empty = x.new_empty(0, dtype=torch.int8), x.new_empty(0, dtype=torch.float32)
    row_data, row_scale = (row.data, row.scale) if row is not None else empty
    col_data, col_scale = (col.data, col.scale) if col is not None else empty
    return row_data, row_scale, _owned(col_data, row_data), _owned(col_scale, row_scale)


def scale_shape(rows, cols, granularity: str, block_size: int, tile2d: bool) -> tuple:
    """The shape of the scales of a quantized [rows, cols] operand (reference.py's conventions)."""
    if granularity == "tensor":
        return ()
    if granularity == "row":
        return (rows,)
    return (cdiv(rows, block_size) if tile2d else rows, cdiv(cols, block_size))


def _quantize_fake(x, backend, granularity, block_size, weight, rowwise, columnwise, stochastic, name, check_finite,
                   columnwise_pad):
    R, C = x.shape
    tile2d = weight and granularity == "block"
    empty = x.new_empty(0, dtype=torch.int8), x.new_empty(0, dtype=torch.float32)
    scales = functools.partial(x.new_empty, dtype=torch.float32)
    row = ((x.new_empty((R, C), dtype=torch.int8), scales(scale_shape(R, C, granularity, block_size, tile2d)))
           if rowwise else empty)
    # Q(x^T) quantizes x^T [C, R]; its padded columns carry no scales
    col = ((x.new_empty((C, padded_length(R, columnwise_pad)), dtype=torch.int8),
            scales(scale_shape(C, R, granularity, block_size, tile2d))) if columnwise else empty)
    return (*row, *col)


def _gemm(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor, backend: str,
          granularity: str, block_size: int, a_tile2d: bool, b_tile2d: bool, out_dtype: torch.dtype,
          bias: Optional[torch.Tensor], autotune: bool) -> torch.Tensor:
    """dequant(a @ b^T) [+ bias] as backend.gemm computes it."""
    a = QTensor(a_data, a_scale, granularity, block_size, a_tile2d)
    b = QTensor(b_data, b_scale, granularity, block_size, b_tile2d)
    return backend_instance(backend).gemm(a, b, out_dtype=out_dtype, bias=bias, autotune=autotune)


def _gemm_fake(a_data, a_scale, b_data, b_scale, backend, granularity, block_size, a_tile2d, b_tile2d, out_dtype, bias,
               autotune):
    return a_data.new_empty((a_data.shape[0], b_data.shape[0]), dtype=out_dtype)


@functools.lru_cache(maxsize=None)
def _weight_recipe(granularity: str, block_size: int, check_finite: str, cache_weights: bool,
                   cache_dgrad_weight: bool, fprop: bool, dgrad: bool) -> Int8Recipe:
    """The recipe fields the weight cache reads, rebuilt from an op's arguments (once per combination)."""
    return Int8Recipe(granularity=granularity, block_size=block_size, check_finite=check_finite,
                      cache_weights=cache_weights, cache_dgrad_weight=cache_dgrad_weight, fprop=fprop, dgrad=dgrad)


def _weight_gemm(a_data: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, transposed: bool, backend: str,
                 granularity: str, block_size: int, check_finite: str, cache_weights: bool, cache_dgrad_weight: bool,
                 fprop: bool, dgrad: bool, out_dtype: torch.dtype, bias: Optional[torch.Tensor],
                 autotune: bool) -> torch.Tensor:
    """dequant(a @ Q(W)^T) (fprop) or, `transposed`, dequant(a @ Q(W^T)^T) (dgrad), with Q(W) from the
    weight cache: looked up when the graph runs, not when it is traced. While a CUDA graph records this call
    (torch.compile's mode="reduce-overhead"), the weight is quantized without the cache, so that every replay
    quantizes the weight it then holds: a cache hit would record no quantization and replay a stale Q(W)."""
    capturing = weight.is_cuda and torch.cuda.is_current_stream_capturing()
    recipe = _weight_recipe(granularity, block_size, check_finite, cache_weights and not capturing,
                            cache_dgrad_weight, fprop, dgrad)
    eager = backend_instance(backend)
    row, col = quantized_weight(weight, eager, recipe, rowwise=not transposed, columnwise=transposed)
    a = QTensor(a_data, a_scale, granularity, block_size)
    return eager.gemm(a, col if transposed else row, out_dtype=out_dtype, bias=bias, autotune=autotune)


def _weight_gemm_fake(a_data, a_scale, weight, transposed, backend, granularity, block_size, check_finite,
                      cache_weights, cache_dgrad_weight, fprop, dgrad, out_dtype, bias, autotune):
    return a_data.new_empty((a_data.shape[0], weight.shape[0 if not transposed else 1]), dtype=out_dtype)


_LIB = torch.library.Library("megatron_int8", "DEF")


def _define(schema: str, impl, fake) -> torch._ops.OpOverload:
    """Register megatron_int8::<op> with one implementation for every device (it dispatches on its `backend`
    argument) and a fake one; returns the op."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"megatron_int8::{name}", fake, lib=_LIB)
    return getattr(torch.ops.megatron_int8, name).default


quantize_op = _define(
    "quantize(Tensor x, str backend, str granularity, int block_size, bool weight, bool rowwise, bool columnwise, "
    "bool stochastic, str name, str check_finite, int columnwise_pad) -> (Tensor, Tensor, Tensor, Tensor)",
    _quantize, _quantize_fake)
gemm_op = _define(
    "gemm(Tensor a_data, Tensor a_scale, Tensor b_data, Tensor b_scale, str backend, str granularity, "
    "int block_size, bool a_tile2d, bool b_tile2d, ScalarType out_dtype, Tensor? bias, bool autotune) -> Tensor",
    _gemm, _gemm_fake)
weight_gemm_op = _define(
    "weight_gemm(Tensor a_data, Tensor a_scale, Tensor weight, bool transposed, str backend, str granularity, "
    "int block_size, str check_finite, bool cache_weights, bool cache_dgrad_weight, bool fprop, bool dgrad, "
    "ScalarType out_dtype, Tensor? bias, bool autotune) -> Tensor",
    _weight_gemm, _weight_gemm_fake)


class _DeferredWeight:
    """Q(W) or Q(W)^T under compile: the weight itself, quantized (through the cache) by weight_gemm when
    the graph runs."""

    def __init__(self, weight: torch.Tensor, recipe: Int8Recipe, transposed: bool):
        self.weight, self.recipe, self.transposed = weight, recipe, transposed


def _unsupported(what: str):
    return NotImplementedError(f"int8_linear under torch.compile: {what} is not supported (it serves the "
                               "megatron-core layers, which run eager)")


class TracedBackend:
    """The backend contract (reference.ReferenceBackend's docstring) through the custom ops, for Dynamo."""

    name = "traced"  # what weight_cache.quantized_weight recognises

    def __init__(self, eager_name: str):
        self.eager_name = eager_name

    def weight_operands(self, weight: torch.Tensor, recipe: Int8Recipe, rowwise: bool, columnwise: bool):
        """What weight_cache.quantized_weight returns under compile: placeholders weight_gemm resolves."""
        return (_DeferredWeight(weight, recipe, False) if rowwise else None,
                _DeferredWeight(weight, recipe, True) if columnwise else None)

    def quantize(self, x, *, granularity, block_size, weight, rowwise, columnwise, stochastic=False, name="tensor",
                 check_finite="deferred", columnwise_pad=1, **given):
        if any(v is not None for v in given.values()):
            raise _unsupported("quantizing with " + ", ".join(k for k, v in given.items() if v is not None))
        rd, rs, cd, cs = quantize_op(x, self.eager_name, granularity, block_size, weight, rowwise, columnwise,
                                     stochastic, name, check_finite, columnwise_pad)
        tile2d = weight and granularity == "block"
        return (QTensor(rd, rs, granularity, block_size, tile2d) if rowwise else None,
                QTensor(cd, cs, granularity, block_size, tile2d) if columnwise else None)

    def gemm(self, a, b, *, out_dtype, bias=None, accumulate_into=None, autotune=True, out=None):
        if accumulate_into is not None or out is not None:
            raise _unsupported("a GEMM into a given destination (accumulate_into / out)")
        if isinstance(b, _DeferredWeight):
            r = b.recipe
            return weight_gemm_op(a.data, a.scale, b.weight, b.transposed, self.eager_name, r.granularity,
                                  r.block_size, r.check_finite, r.cache_weights, r.cache_dgrad_weight, r.fprop,
                                  r.dgrad, out_dtype, bias, autotune)
        return gemm_op(a.data, a.scale, b.data, b.scale, self.eager_name, a.granularity, a.block_size, a.tile2d,
                       b.tile2d, out_dtype, bias, autotune)

    def grouped_gemm(self, a, b, segments, *, out_dtype):
        raise _unsupported("the grouped (MoE) GEMM")
