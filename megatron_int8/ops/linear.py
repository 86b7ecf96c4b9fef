"""The INT8 linear autograd function: fprop, dgrad and wgrad as INT8 x INT8 -> INT32 GEMMs.

Also carries the tensor-parallel behaviour of megatron-core's
`linear_with_grad_accumulation_and_async_allreduce` (tp_comm.py: sequence-parallel all-gather /
reduce-scatter, async all-reduce of the input gradient; main_grad.py: accumulation into
`weight.main_grad`), so the Megatron layers only have to call it.

Memory: for backward it keeps Q(X)^T (int8, already laid out for the wgrad GEMM) and its scale, never the
high-precision input, unless wgrad runs in high precision. Under sequence parallelism with the INT8
all-gather it keeps only the local shard (tensorwise Q(X_local), row-wise Q(X_local^T) with the group's
per-channel scales) and all-gathers it again (INT8) while dgrad runs. Weights are quantized once per
change (weight_cache.py).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch.compiler import is_dynamo_compiling

from ..recipe import DEFAULT_RECIPE, HIGH_PRECISION, Int8Recipe
from ..reference import TOKEN_PAD, KnownMaxima, QTensor, known_maxima
from .backend import get_backend, quantize_kwargs
from .library import traced_backend
from .main_grad import hp_wgrad_into, main_grad_placeholder
from .shape_policy import auto_shapes, recipe_for_shape
from .smooth_swiglu import smoothed_fprop_operands
from .tp_comm import (TPOptions, all_gather_dim0, gather_pipelined, gather_quantized_input, group_amax,
                      reduce_scatter_pipelined, start_all_gather_dim0, wgrad_operand_from_shards)
from .weight_cache import invalidate_weight_caches, quantized_weight

__all__ = ["TPOptions", "int8_linear", "invalidate_weight_caches"]

_NO_TP = TPOptions()  # frozen: one instance serves every call without tensor parallelism


def _given_maxima(known: Optional[KnownMaxima], recipe: Int8Recipe, rowwise: bool, columnwise: bool) -> dict:
    """backend.quantize's keywords that hand over maxima the producer of the operand computed (e.g.
    megatron_int8.ops.swiglu's kernels), so that quantizing skips its amax pass; {} when there are none."""
    if known is None:
        return {}
    if recipe.granularity == "row" and known.rows is not None:
        return dict(rowwise_amax=known.rows if rowwise else None, columnwise_amax=known.cols if columnwise else None)
    if recipe.granularity == "tensor":
        if known.amax is not None:
            return dict(amax=known.amax)
        if known.cols is not None and known.cols.numel():
            return dict(amax=known.cols.amax())
    return {}


class _Int8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, recipe: Int8Recipe, tp: TPOptions, health=None, grad_enabled=True):
        backend = ((traced_backend if is_dynamo_compiling() else get_backend)(input.device, recipe)
                   if recipe.any_int8 else None)
        smooth = recipe.smooth_swiglu and recipe.fprop
        # Q(X)^T only where a backward will take it: not in evaluation, generation or a recompute's first forward
        wgrad_int8 = recipe.wgrad and weight.requires_grad and grad_enabled
        qx_row = qx_col = qx_local = out2d = None
        world = torch.distributed.get_world_size(tp.group) if tp.sequence_parallel or tp.scatter_output else 1
        total_shape = (input.shape[0] * world,) + tuple(input.shape[1:]) if tp.sequence_parallel else tuple(input.shape)
        x_kw = quantize_kwargs(recipe, "fprop input")
        qw_row = (quantized_weight(weight, backend, recipe, rowwise=True, columnwise=False)[0]
                  if recipe.fprop and not smooth else None)
        int8_gather = (tp.sequence_parallel and recipe.int8_all_gather and recipe.fprop
                       and recipe.granularity in ("tensor", "row"))
        if int8_gather:
            # X is never gathered in BF16; backward re-gathers the local INT8 shard for wgrad (as megatron
            # re-gathers the BF16 input), so only 1 byte per local element stays saved
            qx_row, qx_local = gather_quantized_input(input, backend, recipe, tp.group, wgrad_int8)
        elif tp.sequence_parallel and tp.overlap_ag:
            x_local = input.reshape(-1, input.shape[-1])
            if not x_local.is_contiguous():
                x_local = x_local.contiguous()
            # tensorwise: every chunk needs the gathered tensor's amax, reduced before the gather starts (the
            # group's collectives run in order); row and block scales are per token, hence local
            amax = (group_amax(x_local, None, tp.group)
                    if recipe.granularity == "tensor" and (recipe.fprop or wgrad_int8) else None)

            def fprop_rows(x_rows, out_rows):
                if recipe.fprop:
                    q, _ = backend.quantize(x_rows, rowwise=True, columnwise=False, amax=amax, **x_kw)
                    backend.gemm(q, qw_row, out_dtype=input.dtype, bias=bias, autotune=recipe.autotune, out=out_rows)
                else:
                    _hp_gemm_into(x_rows, weight, bias, out_rows)

            out2d = torch.empty((world * x_local.shape[0], weight.shape[0]), dtype=input.dtype, device=input.device)
            x2d = gather_pipelined(x_local, tp.group, fprop_rows, out2d)
            if wgrad_int8:
                _, qx_col = backend.quantize(x2d, rowwise=False, columnwise=True, columnwise_pad=TOKEN_PAD,
                                             amax=amax, **x_kw)
        else:
            total = all_gather_dim0(input, tp.group) if tp.sequence_parallel else input
            x2d = total.reshape(-1, total.shape[-1])
            known = None if tp.sequence_parallel else known_maxima(input)  # a gathered X has its own
            if (recipe.fprop and not smooth) or wgrad_int8:
                qx_row, qx_col = backend.quantize(x2d, rowwise=recipe.fprop and not smooth, columnwise=wgrad_int8,
                                                  columnwise_pad=TOKEN_PAD, **x_kw,
                                                  **_given_maxima(known, recipe, recipe.fprop and not smooth,
                                                                  wgrad_int8))
            if smooth:
                qx_row, qw_row = _smoothed_fprop_operands(x2d, weight, backend, recipe, known)
        if out2d is None:  # not already computed while the input was gathered
            if tp.scatter_output:
                def partial_rows(rows, out_rows):
                    if recipe.fprop:
                        backend.gemm(qx_row.row_range(rows), qw_row, out_dtype=input.dtype, autotune=recipe.autotune,
                                     out=out_rows)
                    else:
                        _hp_gemm_into(x2d[rows], weight, None, out_rows)

                if tp.overlap_rs:
                    out2d = reduce_scatter_pipelined(x2d.shape[0], tp.group, partial_rows, (weight.shape[0],),
                                                      input.dtype, input.device)
                else:
                    partial = torch.empty((x2d.shape[0], weight.shape[0]), dtype=input.dtype, device=input.device)
                    partial_rows(slice(0, x2d.shape[0]), partial)
                    out2d = torch.empty((x2d.shape[0] // world, weight.shape[0]), dtype=input.dtype,
                                        device=input.device)
                    torch.distributed.reduce_scatter_tensor(out2d, partial, group=tp.group)
            elif recipe.fprop:
                out2d = backend.gemm(qx_row, qw_row, out_dtype=input.dtype, bias=bias, autotune=recipe.autotune)
            else:
                out2d = F.linear(x2d, weight.to(x2d.dtype), None if bias is None else bias.to(x2d.dtype))

        ctx.recipe, ctx.tp, ctx.backend, ctx.health = recipe, tp, backend, health
        ctx.input_shape, ctx.input_dtype = tuple(input.shape), input.dtype
        ctx.total_shape = total_shape
        ctx.has_bias = bias is not None
        ctx.wgrad_int8 = wgrad_int8
        ctx.regather_int8 = qx_local is not None
        if ctx.regather_int8:
            ctx.save_for_backward(weight, qx_local.data, qx_local.scale)
        elif wgrad_int8:
            ctx.qx_meta = (qx_col.granularity, qx_col.block_size, qx_col.tile2d)
            ctx.save_for_backward(weight, qx_col.data, qx_col.scale)
        elif weight.requires_grad:
            ctx.save_for_backward(weight, input)  # high-precision wgrad needs X (re-gathered under SP)
        else:
            ctx.save_for_backward(weight)
        lead = (total_shape[0] // world,) + total_shape[1:-1] if tp.scatter_output else total_shape[:-1]
        # not a view for autograd (as torch.matmul's own reshape): a caller may modify the output in place,
        # as megatron's vocab-parallel cross entropy does with the output layer's logits
        return torch.ops.aten._unsafe_view(out2d, (*lead, weight.shape[0]))

    @staticmethod
    def backward(ctx, grad_output):
        recipe, tp, backend = ctx.recipe, ctx.tp, ctx.backend
        saved = ctx.saved_tensors  # read once: non-reentrant activation checkpointing unpacks each tensor once
        weight = saved[0]
        if ctx.health is not None:  # a statistics step (ops.health.ForwardRecord)
            ctx.health.observe_backward(grad_output, weight)
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g2d = grad_output.reshape(-1, grad_output.shape[-1])
        if not g2d.is_contiguous():
            g2d = g2d.contiguous()

        dgrad_int8, wgrad_int8 = need_dgrad and recipe.dgrad, need_wgrad and ctx.wgrad_int8
        g_kw = quantize_kwargs(recipe, "output gradient", recipe.grad_rounding == "stochastic")
        qw_col = (quantized_weight(weight, backend, recipe, rowwise=False, columnwise=True)[1]
                  if dgrad_int8 else None)

        def dgrad_rows(g_rows, out_rows, amax=None):
            if dgrad_int8:
                q, _ = backend.quantize(g_rows, rowwise=True, columnwise=False, amax=amax, **g_kw)
                backend.gemm(q, qw_col, out_dtype=ctx.input_dtype, autotune=recipe.autotune, out=out_rows)
            elif g_rows.dtype == out_rows.dtype:
                torch.mm(g_rows, weight.to(g_rows.dtype), out=out_rows)
            else:
                out_rows.copy_(g_rows @ weight.to(g_rows.dtype))

        # the input for wgrad, re-gathered under SP while dgrad runs: INT8 shards, or the saved BF16 input
        gather = None
        regather_hp = need_wgrad and not wgrad_int8 and tp.sequence_parallel
        if (wgrad_int8 and ctx.regather_int8) or regather_hp:
            local = saved[1]
            gathered, gather = start_all_gather_dim0(local.reshape(-1, local.shape[-1]), tp.group)

        qg_col = dx = None
        if tp.scatter_output and tp.overlap_ag and need_dgrad:
            # row-parallel: the output gradient is all-gathered while this rank's rows run dgrad
            amax = (group_amax(g2d, None, tp.group)
                    if recipe.granularity == "tensor" and (dgrad_int8 or wgrad_int8) else None)
            dx = torch.empty((g2d.shape[0] * torch.distributed.get_world_size(tp.group), weight.shape[1]),
                             dtype=ctx.input_dtype, device=g2d.device)
            g2d = gather_pipelined(g2d, tp.group, functools.partial(dgrad_rows, amax=amax), dx)
            if wgrad_int8:
                _, qg_col = backend.quantize(g2d, rowwise=False, columnwise=True, columnwise_pad=TOKEN_PAD,
                                             amax=amax, **g_kw)
        else:
            if tp.scatter_output:
                g2d = all_gather_dim0(g2d, tp.group)
            qg_row = None
            if dgrad_int8 or wgrad_int8:
                known = None if tp.scatter_output else known_maxima(grad_output)  # a gathered dY has its own
                qg_row, qg_col = backend.quantize(g2d, rowwise=dgrad_int8, columnwise=wgrad_int8,
                                                  columnwise_pad=TOKEN_PAD, **g_kw,
                                                  **_given_maxima(known, recipe, dgrad_int8, wgrad_int8))
            if dgrad_int8:
                dx = backend.gemm(qg_row, qw_col, out_dtype=ctx.input_dtype, autotune=recipe.autotune)
            elif need_dgrad:
                dx = (g2d @ weight.to(g2d.dtype)).to(ctx.input_dtype)

        grad_input = handle = None
        if need_dgrad:
            dx = dx.view(ctx.total_shape)
            if tp.sequence_parallel:
                grad_input = torch.empty(ctx.input_shape, dtype=dx.dtype, device=dx.device)
                handle = torch.distributed.reduce_scatter_tensor(grad_input, dx, group=tp.group, async_op=True)
            else:
                grad_input = dx
                if tp.allreduce_dgrad:
                    handle = torch.distributed.all_reduce(grad_input, group=tp.group, async_op=True)

        grad_weight = None
        if need_wgrad:
            main_grad = getattr(weight, "main_grad", None) if tp.gradient_accumulation_fusion else None
            if gather is not None:
                gather.wait()
            if wgrad_int8 and ctx.regather_int8:
                qx_col = wgrad_operand_from_shards(gathered, saved[2], recipe.granularity,
                                                    torch.distributed.get_world_size(tp.group), recipe.block_size)
            elif wgrad_int8:
                g, bs, t2 = ctx.qx_meta
                qx_col = QTensor(saved[1], saved[2], g, bs, t2)
            if wgrad_int8:
                if main_grad is not None:
                    backend.gemm(qg_col, qx_col, out_dtype=torch.float32, accumulate_into=main_grad,
                                 autotune=recipe.autotune)
                else:
                    grad_weight = backend.gemm(qg_col, qx_col, out_dtype=weight.dtype, autotune=recipe.autotune)
            else:
                x = gathered if regather_hp else saved[1]
                x2d = x.reshape(-1, x.shape[-1]).to(g2d.dtype)
                if main_grad is not None:
                    hp_wgrad_into(main_grad, g2d, x2d)
                else:
                    grad_weight = (g2d.t() @ x2d).to(weight.dtype)
            if main_grad is not None:
                grad_weight = main_grad_placeholder(weight)

        grad_bias = g2d.sum(dim=0).to(ctx.input_dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _hp_gemm_into(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """out = x @ weight^T [+ bias] in x's precision, written in place (a row range of a larger output)."""
    w = weight.to(x.dtype).t()
    if bias is None:
        torch.mm(x, w, out=out)
    else:
        torch.addmm(bias.to(x.dtype), x, w, out=out)


def int8_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    recipe: Optional[Int8Recipe] = None,
    *,
    tp: Optional[TPOptions] = None,
    probe=None,
) -> torch.Tensor:
    """`torch.nn.functional.linear` with INT8 fprop/dgrad/wgrad: input [..., in], weight [out, in].

    The output has the input's dtype. `tp` adds megatron-core's tensor-parallel communication. `probe`: an
    ops.health.LinearProbe; when armed, this call (if it records autograd) measures its quantization health.
    """
    recipe = recipe or DEFAULT_RECIPE
    tp = tp or _NO_TP
    if not isinstance(recipe, Int8Recipe):
        raise TypeError(f"int8_linear: recipe must be an Int8Recipe, got {type(recipe).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"int8_linear: weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    if weight.shape[1] == 0:  # nothing to quantize along the contraction: F.linear's zeros, not INT8 GEMMs
        raise ValueError(f"int8_linear: weight {tuple(weight.shape)} has no input features")
    if input.dim() < 1 or input.shape[-1] != weight.shape[1]:
        raise ValueError(f"int8_linear: input {tuple(input.shape)} does not match weight {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"int8_linear: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not input.is_floating_point():
        raise TypeError(f"int8_linear: input must be floating point, got {input.dtype}")
    for name, t in (("weight", weight), ("bias", bias)):
        # an integer weight (e.g. an already quantized one) was cast to the input's dtype without its scales
        if t is not None and not t.is_floating_point():
            raise TypeError(f"int8_linear: {name} must be floating point, got {t.dtype}")
        if t is not None and t.device != input.device:  # else a kernel fails on a pointer of the other device
            raise ValueError(f"int8_linear: {name} is on {t.device}, the input on {input.device}")
    if tp.scatter_output:
        world = torch.distributed.get_world_size(tp.group)
        if bias is not None:
            raise ValueError("int8_linear: with scatter_output, add the bias after the reduction (as megatron does)")
        if input.dim() < 2 or input.shape[0] % world:
            raise ValueError(f"int8_linear: scatter_output needs dim 0 of input {tuple(input.shape)} divisible by "
                             f"the tensor-parallel size {world}")
    if recipe.smooth_swiglu and recipe.fprop and (tp.sequence_parallel or (tp.overlap_ag and not tp.scatter_output)):
        # (a row-parallel scatter's overlap_ag gathers the output gradient, in backward: its input stays whole)
        raise ValueError("int8_linear: smooth_swiglu is for fc2, a row-parallel linear whose input is not "
                         "sequence-parallel; this call gathers its input")
    if auto_shapes(recipe):  # shape_policy "auto": high precision at the shapes where it was measured faster
        recipe = recipe_for_shape(recipe, input, weight, bias, tp, int8_linear)
    if not recipe.any_int8:
        return _hp_linear_with_tp(input, weight, bias, tp)
    health = (probe.observe_forward(input, weight, recipe, smooth=recipe.smooth_swiglu and recipe.fprop,
                                    input_group=tp.group if tp.sequence_parallel else None,
                                    grad_group=tp.group if tp.scatter_output else None)
              if probe is not None and probe.armed and torch.is_grad_enabled() and input.numel() else None)
    return _Int8LinearFunction.apply(input, weight, bias, recipe, tp, health, torch.is_grad_enabled())


def _smoothed_fprop_operands(x2d, weight, backend, recipe: Int8Recipe, known: Optional[KnownMaxima]):
    """(Q(X diag(1/s)), Q(W diag(s))) for the Smooth-SwiGLU guard (ops.smooth_swiglu), with X's column maxima
    from the SwiGLU kernel where it attached them. W's fprop form depends on s, so it is not cached."""
    cols = known.cols if known is not None else None
    xs, ws = smoothed_fprop_operands(x2d, weight.detach(), cols)
    qx, _ = backend.quantize(xs, rowwise=True, columnwise=False, **quantize_kwargs(recipe, "fprop input"))
    qw, _ = backend.quantize(ws, rowwise=True, columnwise=False, **quantize_kwargs(recipe, "weight", weight=True))
    return qx, qw


def _hp_linear_with_tp(input, weight, bias, tp: TPOptions):
    """All three GEMMs in high precision: exactly F.linear, plus the TP communication when asked for. A weight
    or bias of another dtype is cast to the input's, as the INT8 paths do (so that a fallback to high precision
    takes the same inputs)."""
    if tp.group is None and not (tp.sequence_parallel or tp.scatter_output or tp.allreduce_dgrad
                                 or tp.gradient_accumulation_fusion):
        return F.linear(input, weight.to(input.dtype), None if bias is None else bias.to(input.dtype))
    return _Int8LinearFunction.apply(input, weight, bias, HIGH_PRECISION, tp)
