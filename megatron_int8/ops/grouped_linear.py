"""The INT8 linear of all local MoE experts at once: one autograd op instead of one per expert.

The input holds every expert's tokens, sorted by expert, each expert's rows starting at a multiple of
`SEGMENT_ALIGN` (zero rows between them), as described by a `Segments`:
- fprop: Q(X) row-wise once for all experts (per-token scales do not depend on the grouping), then one
  grouped GEMM against the experts' stacked Q(W) [E, N, K];
- dgrad: Q(dY) row-wise once, one grouped GEMM against the stacked Q(W)^T [E, K, N];
- wgrad: Q(dY^T) and Q(X^T) once each, with per-expert column scales (each expert's operands are
  quantized over its own tokens, exactly as a per-expert linear would), then one GEMM per expert on
  aligned column slices, accumulated into `main_grad` when gradient-accumulation fusion is on.
Every value equals what the per-expert INT8 linears compute: the zero rows change no amax and add
nothing to a contraction. Row granularity only: a tensorwise scale over all experts' tokens would not
be a per-expert one (`grouped_recipe_problem`).

Weights: the stacked Q(W) and Q(W)^T are cached on the first expert's weight until any expert weight
changes (the key of `weight_cache.weight_cache_key`, per weight), in place of the per-expert caches.

`grouped_hp_linear` is the same op in the input's precision (BF16 experts), so that the BF16 baseline's
experts run grouped too, as Transformer Engine's or megatron's GroupedMLP would run them, instead of
SequentialMLP's loop: fprop and dgrad as one `torch._grouped_mm` each over the experts' stacked weights
(cached per optimizer step like the INT8 stacks: 2 bytes per expert parameter in BF16), wgrad one GEMM per
expert into `main_grad`. Where `torch._grouped_mm` does not run (CPU, GPUs before Hopper, other dtypes)
each expert's rows take a plain matmul.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from .backend import get_backend, quantize_kwargs
from .main_grad import hp_wgrad_into, main_grad_placeholder
from .weight_cache import weight_cache_key, weight_version_key
from ..reference import QTensor, Segments, segment_operand
from ..recipe import Int8Recipe

_STACK_ATTR = "_megatron_int8_stacked"
_HP_STACK_ATTR = "_megatron_int8_stacked_hp"


def grouped_recipe_problem(recipe: Int8Recipe) -> Optional[str]:
    """Why `recipe` cannot run grouped (None if it can)."""
    if recipe.granularity != "row":
        return f"granularity {recipe.granularity!r} (grouped experts need 'row')"
    if not (recipe.fprop and recipe.dgrad and recipe.wgrad):
        return "a GEMM in high precision (grouped experts run all three in INT8)"
    return None


@dataclasses.dataclass
class _StackedWeights:
    key: tuple
    row: QTensor  # Q(W_e) stacked: data [E, N, K], scales [E, N]
    col: QTensor  # Q(W_e^T) stacked: data [E, K, N], scales [E, K]


def stacked_quantized_weights(weights: Sequence[torch.Tensor], backend, recipe: Int8Recipe):
    """(stacked Q(W), stacked Q(W)^T) of the experts' weights [N, K]; cached while none changes."""
    key = tuple(weight_cache_key(w, recipe, backend) for w in weights)
    entry = getattr(weights[0], _STACK_ATTR, None)
    if recipe.cache_weights and entry is not None and entry.key == key:
        return entry.row, entry.col
    E, (N, K) = len(weights), weights[0].shape
    dev = weights[0].device
    row = QTensor(torch.empty((E, N, K), dtype=torch.int8, device=dev),
                  torch.empty((E, N), dtype=torch.float32, device=dev), "row", recipe.block_size)
    col = QTensor(torch.empty((E, K, N), dtype=torch.int8, device=dev),
                  torch.empty((E, K), dtype=torch.float32, device=dev), "row", recipe.block_size)
    kw = quantize_kwargs(recipe, "weight", weight=True)
    for e, w in enumerate(weights):  # straight into expert e's slots: no per-expert temporaries, no copies
        backend.quantize(w.detach(), rowwise=True, columnwise=True, **kw,
                         out=(QTensor(row.data[e], row.scale[e], "row", recipe.block_size),
                              QTensor(col.data[e], col.scale[e], "row", recipe.block_size)))
    if recipe.cache_weights:
        setattr(weights[0], _STACK_ATTR, _StackedWeights(key, row, col))
    return row, col


class _GroupedInt8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, segments: Segments, recipe: Int8Recipe, fuse_wgrad: bool, *weights):
        backend = get_backend(x.device, recipe)
        wgrad = any(w.requires_grad for w in weights)
        qx_row, qx_col = backend.quantize(x, rowwise=True, columnwise=wgrad,
                                          columnwise_segments=segments if wgrad else None,
                                          **quantize_kwargs(recipe, "fprop input"))
        qw_row, _ = stacked_quantized_weights(weights, backend, recipe)
        out = backend.grouped_gemm(qx_row, qw_row, segments, out_dtype=x.dtype)
        ctx.segments, ctx.recipe, ctx.backend, ctx.fuse_wgrad = segments, recipe, backend, fuse_wgrad
        ctx.input_dtype = x.dtype
        ctx.qx_block_size = qx_row.block_size
        saved = (qx_col.data, qx_col.scale) if wgrad else ()
        ctx.save_for_backward(*weights, *saved)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        segments, recipe, backend = ctx.segments, ctx.recipe, ctx.backend
        E = segments.num_segments
        every = ctx.saved_tensors  # read once: non-reentrant activation checkpointing unpacks each tensor once
        weights, saved = every[:E], every[E:]
        need_dgrad = ctx.needs_input_grad[0]
        need_wgrad = [ctx.needs_input_grad[4 + e] for e in range(E)]
        g = grad_output.contiguous()
        qg_row, qg_col = backend.quantize(
            g, rowwise=need_dgrad, columnwise=any(need_wgrad),
            columnwise_segments=segments if any(need_wgrad) else None,
            **quantize_kwargs(recipe, "output gradient", recipe.grad_rounding == "stochastic"))
        grad_input = None
        if need_dgrad:
            _, qw_col = stacked_quantized_weights(weights, backend, recipe)
            grad_input = backend.grouped_gemm(qg_row, qw_col, segments, out_dtype=ctx.input_dtype)
        if any(need_wgrad):
            qx_col = QTensor(saved[0], saved[1], "row", ctx.qx_block_size)

        def wgrad(e, dtype, accumulate_into):
            return backend.gemm(segment_operand(qg_col, segments, e), segment_operand(qx_col, segments, e),
                                out_dtype=dtype, accumulate_into=accumulate_into, autotune=recipe.autotune)

        grad_weights = _expert_weight_grads(weights, need_wgrad, segments, ctx.fuse_wgrad, wgrad)
        return (grad_input, None, None, None, *grad_weights)


def _expert_weight_grads(weights, needed, segments: Segments, fuse_wgrad: bool, wgrad) -> list:
    """Each expert's weight gradient for autograd, from `wgrad(e, dtype, accumulate_into)`, which computes
    expert e's product over its aligned rows (as `dtype`, or added into `accumulate_into`): None where not
    needed; megatron's placeholder once added into main_grad (fuse_wgrad); zeros for an expert without
    tokens."""
    grads = []
    for e, (w, need) in enumerate(zip(weights, needed)):
        lo, hi = segments.bounds(e)
        main_grad = getattr(w, "main_grad", None) if fuse_wgrad else None
        if not need:
            grads.append(None)
        elif main_grad is not None:
            if hi > lo:
                wgrad(e, torch.float32, main_grad)
            grads.append(main_grad_placeholder(w))
        else:
            grads.append(wgrad(e, w.dtype, None) if hi > lo else torch.zeros_like(w))
    return grads


def stacked_weights(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The experts' weights [N, K] stacked as [E, N, K] in their dtype; cached while none changes."""
    key = tuple(weight_version_key(w) for w in weights)
    entry = getattr(weights[0], _HP_STACK_ATTR, None)
    if entry is None or entry[0] != key:
        entry = (key, torch.stack([w.detach() for w in weights]))
        setattr(weights[0], _HP_STACK_ATTR, entry)
    return entry[1]


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, segments: Segments, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of segment e of a [R, K] times b[e] [K, N] -> [R, N] (b may be a transposed view): one
    torch._grouped_mm in bf16 on the GPUs it serves (Hopper, datacenter Blackwell), else a matmul per
    segment."""
    if (a.is_cuda and a.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(a.device)[0] in (9, 10)):
        return torch._grouped_mm(a, b, offs=offsets)
    out = a.new_empty((a.shape[0], b.shape[-1]))
    for e in range(segments.num_segments):
        lo, hi = segments.bounds(e)
        torch.mm(a[lo:hi], b[e], out=out[lo:hi])
    return out


class _GroupedHpLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, segments: Segments, fuse_wgrad: bool, *weights):
        offsets = segments.ends(x.device)
        out = _grouped_mm(x, stacked_weights(weights).transpose(1, 2), segments, offsets)
        ctx.segments, ctx.fuse_wgrad, ctx.offsets = segments, fuse_wgrad, offsets
        ctx.save_for_backward(x, *weights)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        segments = ctx.segments
        x, *weights = ctx.saved_tensors
        g = grad_output.contiguous()
        grad_input = _grouped_mm(g, stacked_weights(weights), segments, ctx.offsets) if ctx.needs_input_grad[0] else None

        def wgrad(e, dtype, accumulate_into):
            lo, hi = segments.bounds(e)
            if accumulate_into is not None:
                return hp_wgrad_into(accumulate_into, g[lo:hi], x[lo:hi])
            return (g[lo:hi].t() @ x[lo:hi]).to(dtype)

        needed = ctx.needs_input_grad[3:]
        grad_weights = _expert_weight_grads(weights, needed, segments, ctx.fuse_wgrad, wgrad)
        return (grad_input, None, None, *grad_weights)


def _check_grouped_input(name: str, x: torch.Tensor, segments: Segments, weights: Sequence[torch.Tensor]) -> None:
    if len(weights) != segments.num_segments:
        raise ValueError(f"{name}: {len(weights)} weights for {segments.num_segments} segments")
    if x.dim() != 2 or x.shape[0] != segments.rows:
        raise ValueError(f"{name}: input {tuple(x.shape)} does not hold the segments' {segments.rows} rows")
    shape = tuple(weights[0].shape)
    if any(tuple(w.shape) != shape for w in weights) or len(shape) != 2 or shape[1] != x.shape[1]:
        raise ValueError(f"{name}: expert weights must all be [N, {x.shape[1]}], got {[tuple(w.shape) for w in weights]}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: input must be floating point, got {x.dtype}")


def grouped_hp_linear(x: torch.Tensor, segments: Segments, weights: Sequence[torch.Tensor], *,
                      fuse_wgrad: bool = False) -> torch.Tensor:
    """`grouped_int8_linear` in the input's precision: x [R, K] in the layout of `segments` -> [R, N], rows of
    expert e times weights[e]^T, for BF16 experts (see the module docstring)."""
    _check_grouped_input("grouped_hp_linear", x, segments, weights)
    if any(w.dtype != x.dtype for w in weights):
        raise TypeError(f"grouped_hp_linear: weights must have the input's dtype {x.dtype}")
    return _GroupedHpLinearFunction.apply(x, segments, fuse_wgrad, *weights)


def grouped_int8_linear(x: torch.Tensor, segments: Segments, weights: Sequence[torch.Tensor], recipe: Int8Recipe,
                        *, fuse_wgrad: bool = False) -> torch.Tensor:
    """x [R, K] in the layout of `segments` -> [R, N]: rows of expert e times weights[e]^T ([N, K]), INT8.

    `fuse_wgrad`: add each weight gradient into `weight.main_grad` (Megatron's gradient-accumulation
    fusion) and return megatron's placeholder gradient."""
    problem = grouped_recipe_problem(recipe)
    if problem:
        raise ValueError(f"grouped_int8_linear: {problem}")
    _check_grouped_input("grouped_int8_linear", x, segments, weights)
    return _GroupedInt8LinearFunction.apply(x, segments, recipe, fuse_wgrad, *weights)
