"""The INT8 linear autograd function: fprop, dgrad and wgrad as INT8 x INT8 -> INT32 GEMMs.

Also carries the tensor-parallel behaviour of megatron-core's
`linear_with_grad_accumulation_and_async_allreduce` (sequence-parallel all-gather / reduce-scatter,
async all-reduce of the input gradient, accumulation into `weight.main_grad`), so the Megatron layers
only have to call it.

Memory: for backward it keeps Q(X)^T (int8, already laid out for the wgrad GEMM) and its scale, never the
high-precision input, unless wgrad runs in high precision. Under sequence parallelism with the INT8
all-gather it keeps only the local shard (tensorwise Q(X_local), row-wise Q(X_local^T) with the group's
per-channel scales) and all-gathers it again (INT8) while dgrad runs.
Weights: Q(W) and Q(W)^T are cached per weight tensor until the weight changes. A change is seen through
torch's version counter, a new storage, or any optimizer step (a global torch.optim step hook), because
Megatron's optimizers write parameters through `.data`, which the version counter does not see.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

from .backend import get_backend
from .quantize import KnownMaxima, QTensor, handle_nonfinite, known_maxima, nan_as_inf, pad_columns
from .recipe import DEFAULT_RECIPE, HIGH_PRECISION, Int8Recipe

_weight_generation = 0
# wgrad contracts over tokens: Q(X)^T and Q(dY)^T get their token axis zero-padded to a multiple of 16, so
# an MoE expert's arbitrary token count still gives 16-byte aligned rows (see quantize.pad_columns)
TOKEN_PAD = 16


def invalidate_weight_caches(*_args) -> None:
    """Force every cached weight quantization to be recomputed (call after non-optimizer weight edits)."""
    global _weight_generation
    _weight_generation += 1


register_optimizer_step_post_hook(invalidate_weight_caches)


@dataclasses.dataclass
class _CachedWeight:
    key: tuple
    row: Optional[QTensor]
    col: Optional[QTensor]


_CACHE_ATTR = "_megatron_int8_quantized"  # stored on the weight tensor itself, so it dies with it


def weight_version_key(weight: torch.Tensor) -> tuple:
    """What identifies a weight's current values: its storage and version, and the optimizer-step generation."""
    return (_weight_generation, weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape))


def weight_cache_key(weight: torch.Tensor, recipe: Int8Recipe, backend) -> tuple:
    """What a cached quantization of `weight` depends on: its current values (`weight_version_key`) and the
    recipe's quantization settings."""
    return weight_version_key(weight) + (recipe.granularity, recipe.block_size, recipe.check_finite, backend.name)


def quantized_weight(weight: torch.Tensor, backend, recipe: Int8Recipe, *, rowwise: bool, columnwise: bool):
    """(Q(W) [N,K], Q(W)^T [K,N]) as requested; cached while the weight is unchanged."""
    kw = _quantize_kwargs(recipe, "weight", weight=True)
    if not recipe.cache_weights:
        return backend.quantize(weight.detach(), rowwise=rowwise, columnwise=columnwise, **kw)
    key = weight_cache_key(weight, recipe, backend)
    entry = getattr(weight, _CACHE_ATTR, None)
    if entry is None or entry.key != key or (rowwise and entry.row is None) or (columnwise and entry.col is None):
        # Quantize every form this recipe will use, in one pass, so later micro-batches only read.
        row, col = backend.quantize(weight.detach(), rowwise=rowwise or recipe.fprop,
                                    columnwise=columnwise or recipe.dgrad, **kw)
        entry = _CachedWeight(key, row, col)
        setattr(weight, _CACHE_ATTR, entry)
    return entry.row, entry.col


@dataclasses.dataclass(frozen=True)
class TPOptions:
    """Tensor-parallel communication done inside the linear, as in megatron-core.

    `overlap_ag` / `overlap_rs` pipeline the sequence-parallel collectives with the GEMMs, as megatron's
    `tp_comm_overlap_ag` / `_rs` do with Transformer Engine: an all-gather runs asynchronously while the
    rows this rank already holds are computed, then the other ranks' rows; the output reduce-scatter
    computes the other ranks' rows first and exchanges them (one all-to-all) while this rank's own rows
    are computed, then adds what it received. Same results, with the communication hidden behind GEMMs.
    """

    group: Optional[torch.distributed.ProcessGroup] = None
    sequence_parallel: bool = False  # column-parallel: all-gather the input along dim 0; reduce-scatter its gradient
    scatter_output: bool = False  # row-parallel under SP: reduce-scatter the output (dim 0); all-gather its gradient
    allreduce_dgrad: bool = False  # all-reduce the input gradient (column-parallel without SP)
    gradient_accumulation_fusion: bool = False  # accumulate wgrad into weight.main_grad
    overlap_ag: bool = False  # pipeline the input all-gather (forward) and the output-gradient all-gather (backward)
    overlap_rs: bool = False  # pipeline the output reduce-scatter (forward)

    def __post_init__(self):
        if sum((self.sequence_parallel, self.scatter_output, self.allreduce_dgrad)) > 1:
            raise ValueError("TPOptions: sequence_parallel, scatter_output and allreduce_dgrad are mutually exclusive")


def _start_all_gather_dim0(x: torch.Tensor, group):
    """(the [world * rows, ...] all-gather of x along dim 0, its pending work): wait() before reading it."""
    world = torch.distributed.get_world_size(group)
    out = torch.empty((x.shape[0] * world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, torch.distributed.all_gather_into_tensor(out, x.contiguous(), group=group, async_op=True)


def _all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    out, work = _start_all_gather_dim0(x, group)
    work.wait()
    return out


def _other_rows(world: int, rank: int, rows: int) -> List[slice]:
    """The other ranks' rows of a [world * rows, ...] tensor gathered along dim 0, in rank order, as at most
    two contiguous ranges (before and after this rank's)."""
    return [r for r in (slice(0, rank * rows), slice((rank + 1) * rows, world * rows)) if r.start < r.stop]


def _gather_pipelined(local: torch.Tensor, group, rows_gemm, out: torch.Tensor) -> torch.Tensor:
    """All-gather `local` [m, K] along dim 0 and run `rows_gemm(x_rows, out_rows)` over all of it, into the
    matching rows of `out`: this rank's rows from `local` while the gather runs, then the other ranks'.
    Returns the gathered [world * m, K] tensor."""
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    m = local.shape[0]
    gathered, work = _start_all_gather_dim0(local, group)
    rows_gemm(local, out[rank * m:(rank + 1) * m])
    work.wait()
    for rows in _other_rows(world, rank, m):
        rows_gemm(gathered[rows], out[rows])
    return gathered


def _reduce_scatter_pipelined(total_rows: int, group, rows_gemm, shape, dtype, device) -> torch.Tensor:
    """This rank's rows of the sum over the group of a [total_rows, N] partial product that `rows_gemm(rows,
    out_rows)` computes range by range: the other ranks' rows first, sent (one all-to-all) while this rank's
    own rows are computed; then the received partials are added (in fp32 beyond two ranks)."""
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    m = total_rows // world
    send = torch.empty(((world - 1) * m,) + tuple(shape), dtype=dtype, device=device)
    start = 0
    for rows in _other_rows(world, rank, m):
        n = rows.stop - rows.start
        rows_gemm(rows, send[start:start + n])
        start += n
    recv = torch.empty_like(send)
    splits = [0 if r == rank else m for r in range(world)]
    work = torch.distributed.all_to_all_single(recv, send, splits, splits, group=group, async_op=True)
    own = torch.empty((m,) + tuple(shape), dtype=dtype, device=device)
    rows_gemm(slice(rank * m, (rank + 1) * m), own)
    work.wait()
    if world == 2:
        return own.add_(recv)
    return (own.float() + recv.view(world - 1, m, *shape).float().sum(0)).to(dtype)


def _group_amax(x: torch.Tensor, dim: Optional[int], group) -> torch.Tensor:
    """max |x| over the tensor-parallel group: of the whole tensor ([1]) or per column (dim=0, [C]).
    One reduction pass, no |x| temporary (max is exact in any order); Inf/NaN become inf, which every MAX
    reduction keeps and the quantize kernels turn into NaN scales."""
    if x.numel():
        amax = torch.linalg.vector_norm(x, float("inf"), dim=dim, dtype=torch.float32).reshape(-1)
    else:
        amax = x.new_zeros(1 if dim is None else x.shape[1], dtype=torch.float32)
    amax = nan_as_inf(amax)
    torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
    return amax


def _gather_quantized_input(input, backend, recipe: Int8Recipe, group, wgrad_int8: bool):
    """Sequence parallelism with the INT8 all-gather: (Q(all-gather(X)) for fprop, the local shard of the
    wgrad operand for backward to all-gather, or None), with the scales of the gathered tensor, so the
    INT8 values are identical to quantizing a BF16 gather, at half its bytes. Tensorwise: one amax
    all-reduced over the group; the shard kept is Q(X_local). Row-wise: Q(X)'s per-token scales are local
    (gathered with the data), Q(X^T)'s per-channel amax is all-reduced; the shard kept is Q(X_local^T)."""
    x_local = input.reshape(-1, input.shape[-1])
    kw = _quantize_kwargs(recipe, "fprop input")
    if recipe.granularity == "tensor":
        q_local, _ = backend.quantize(x_local, rowwise=True, columnwise=False,
                                      amax=_group_amax(x_local, None, group), **kw)
        q_total = QTensor(_all_gather_dim0(q_local.data, group), q_local.scale, "tensor", recipe.block_size)
        return q_total, (q_local if wgrad_int8 else None)
    col_amax = _group_amax(x_local, 0, group) if wgrad_int8 else None
    # the per-token scales are local: check them once gathered, so that every rank raises together
    # (a rank raising alone before the all-gather would leave the others waiting in it)
    q_local, qt_local = backend.quantize(x_local, rowwise=True, columnwise=wgrad_int8, columnwise_amax=col_amax,
                                         **dict(kw, check_finite="off"))
    q_total = QTensor(_all_gather_dim0(q_local.data, group), _all_gather_dim0(q_local.scale, group), "row",
                      recipe.block_size)
    handle_nonfinite(q_total.scale, "fprop input", recipe.check_finite)
    return q_total, qt_local


def _wgrad_operand_from_shards(gathered, scale, granularity: str, world: int, block_size: int) -> QTensor:
    """Q(X_total)^T [C, R] from backward's all-gather of the saved shards: tensorwise, Q(X_local) rows
    (transposed here); row-wise, each rank's Q(X_local^T) [C, R_local] (interleaved into [C, R] here).
    The token axis is padded to TOKEN_PAD, as the output gradient's is."""
    if granularity == "tensor":
        q = QTensor(gathered, scale, "tensor", block_size).transposed()
    else:
        C = gathered.shape[0] // world
        q = QTensor(gathered.view(world, C, -1).permute(1, 0, 2).reshape(C, -1), scale, "row", block_size)
    return pad_columns(q, TOKEN_PAD)


def _given_maxima(known: Optional[KnownMaxima], recipe: Int8Recipe, rowwise: bool, columnwise: bool) -> dict:
    """backend.quantize's keywords that hand over maxima the producer of the operand computed (e.g.
    megatron_int8.swiglu's kernels), so that quantizing skips its amax pass; {} when there are none."""
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


@functools.lru_cache(maxsize=None)  # recipes are frozen and few: one dict each, shared (callers never mutate it)
def _quantize_kwargs(recipe: Int8Recipe, name: str, stochastic: bool = False, weight: bool = False) -> dict:
    return dict(granularity=recipe.granularity, block_size=recipe.block_size, weight=weight,
                stochastic=stochastic, name=name, check_finite=recipe.check_finite)


class _Int8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, recipe: Int8Recipe, tp: TPOptions):
        backend = get_backend(input.device, recipe) if recipe.any_int8 else None
        wgrad_int8 = recipe.wgrad and weight.requires_grad
        qx_row = qx_col = qx_local = out2d = None
        world = torch.distributed.get_world_size(tp.group) if tp.sequence_parallel or tp.scatter_output else 1
        total_shape = (input.shape[0] * world,) + tuple(input.shape[1:]) if tp.sequence_parallel else tuple(input.shape)
        x_kw = _quantize_kwargs(recipe, "fprop input")
        qw_row = (quantized_weight(weight, backend, recipe, rowwise=True, columnwise=False)[0]
                  if recipe.fprop else None)
        int8_gather = (tp.sequence_parallel and recipe.int8_all_gather and recipe.fprop
                       and recipe.granularity in ("tensor", "row"))
        if int8_gather:
            # X is never gathered in BF16; backward re-gathers the local INT8 shard for wgrad (as megatron
            # re-gathers the BF16 input), so only 1 byte per local element stays saved
            qx_row, qx_local = _gather_quantized_input(input, backend, recipe, tp.group, wgrad_int8)
        elif tp.sequence_parallel and tp.overlap_ag:
            x_local = input.reshape(-1, input.shape[-1])
            if not x_local.is_contiguous():
                x_local = x_local.contiguous()
            # tensorwise: every chunk needs the gathered tensor's amax, reduced before the gather starts (the
            # group's collectives run in order); row and block scales are per token, hence local
            amax = (_group_amax(x_local, None, tp.group)
                    if recipe.granularity == "tensor" and (recipe.fprop or wgrad_int8) else None)

            def fprop_rows(x_rows, out_rows):
                if recipe.fprop:
                    q, _ = backend.quantize(x_rows, rowwise=True, columnwise=False, amax=amax, **x_kw)
                    backend.gemm(q, qw_row, out_dtype=input.dtype, bias=bias, autotune=recipe.autotune, out=out_rows)
                else:
                    _hp_gemm_into(x_rows, weight, bias, out_rows)

            out2d = torch.empty((world * x_local.shape[0], weight.shape[0]), dtype=input.dtype, device=input.device)
            x2d = _gather_pipelined(x_local, tp.group, fprop_rows, out2d)
            if wgrad_int8:
                _, qx_col = backend.quantize(x2d, rowwise=False, columnwise=True, columnwise_pad=TOKEN_PAD,
                                             amax=amax, **x_kw)
        else:
            total = _all_gather_dim0(input, tp.group) if tp.sequence_parallel else input
            x2d = total.reshape(-1, total.shape[-1])
            if recipe.fprop or wgrad_int8:
                known = None if tp.sequence_parallel else known_maxima(input)  # a gathered X has its own
                qx_row, qx_col = backend.quantize(x2d, rowwise=recipe.fprop, columnwise=wgrad_int8,
                                                  columnwise_pad=TOKEN_PAD, **x_kw,
                                                  **_given_maxima(known, recipe, recipe.fprop, wgrad_int8))
        if out2d is None:  # not already computed while the input was gathered
            if tp.scatter_output:
                def partial_rows(rows, out_rows):
                    if recipe.fprop:
                        backend.gemm(qx_row.row_range(rows), qw_row, out_dtype=input.dtype, autotune=recipe.autotune,
                                     out=out_rows)
                    else:
                        _hp_gemm_into(x2d[rows], weight, None, out_rows)

                if tp.overlap_rs:
                    out2d = _reduce_scatter_pipelined(x2d.shape[0], tp.group, partial_rows, (weight.shape[0],),
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

        ctx.recipe, ctx.tp, ctx.backend = recipe, tp, backend
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
        weight = ctx.saved_tensors[0]
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g2d = grad_output.reshape(-1, grad_output.shape[-1])
        if not g2d.is_contiguous():
            g2d = g2d.contiguous()

        dgrad_int8, wgrad_int8 = need_dgrad and recipe.dgrad, need_wgrad and ctx.wgrad_int8
        g_kw = _quantize_kwargs(recipe, "output gradient", recipe.grad_rounding == "stochastic")
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
            local = ctx.saved_tensors[1]
            gathered, gather = _start_all_gather_dim0(local.reshape(-1, local.shape[-1]), tp.group)

        qg_col = dx = None
        if tp.scatter_output and tp.overlap_ag and need_dgrad:
            # row-parallel: the output gradient is all-gathered while this rank's rows run dgrad
            amax = (_group_amax(g2d, None, tp.group)
                    if recipe.granularity == "tensor" and (dgrad_int8 or wgrad_int8) else None)
            dx = torch.empty((g2d.shape[0] * torch.distributed.get_world_size(tp.group), weight.shape[1]),
                             dtype=ctx.input_dtype, device=g2d.device)
            g2d = _gather_pipelined(g2d, tp.group, functools.partial(dgrad_rows, amax=amax), dx)
            if wgrad_int8:
                _, qg_col = backend.quantize(g2d, rowwise=False, columnwise=True, columnwise_pad=TOKEN_PAD,
                                             amax=amax, **g_kw)
        else:
            if tp.scatter_output:
                g2d = _all_gather_dim0(g2d, tp.group)
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
                qx_col = _wgrad_operand_from_shards(gathered, ctx.saved_tensors[2], recipe.granularity,
                                                    torch.distributed.get_world_size(tp.group), recipe.block_size)
            elif wgrad_int8:
                g, bs, t2 = ctx.qx_meta
                qx_col = QTensor(ctx.saved_tensors[1], ctx.saved_tensors[2], g, bs, t2)
            if wgrad_int8:
                if main_grad is not None:
                    backend.gemm(qg_col, qx_col, out_dtype=torch.float32, accumulate_into=main_grad,
                                 autotune=recipe.autotune)
                else:
                    grad_weight = backend.gemm(qg_col, qx_col, out_dtype=weight.dtype, autotune=recipe.autotune)
            else:
                x = gathered if regather_hp else ctx.saved_tensors[1]
                x2d = x.reshape(-1, x.shape[-1]).to(g2d.dtype)
                if main_grad is not None:
                    hp_wgrad_into(main_grad, g2d, x2d)
                else:
                    grad_weight = (g2d.t() @ x2d).to(weight.dtype)
            if main_grad is not None:
                grad_weight = _main_grad_placeholder(weight)

        grad_bias = g2d.sum(dim=0).to(ctx.input_dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None


def _hp_gemm_into(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """out = x @ weight^T [+ bias] in x's precision, written in place (a row range of a larger output)."""
    w = weight.to(x.dtype).t()
    if bias is None:
        torch.mm(x, w, out=out)
    else:
        torch.addmm(bias.to(x.dtype), x, w, out=out)


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


def _main_grad_placeholder(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """Megatron's contract once wgrad went into main_grad: a dummy grad plus grad_added_to_main_grad."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(weight.main_grad.shape, dtype=weight.dtype, device=weight.device)


def int8_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    recipe: Optional[Int8Recipe] = None,
    *,
    tp: Optional[TPOptions] = None,
) -> torch.Tensor:
    """`torch.nn.functional.linear` with INT8 fprop/dgrad/wgrad: input [..., in], weight [out, in].

    The output has the input's dtype. `tp` adds megatron-core's tensor-parallel communication.
    """
    recipe = recipe or DEFAULT_RECIPE
    tp = tp or TPOptions()
    if weight.dim() != 2:
        raise ValueError(f"int8_linear: weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    if input.dim() < 1 or input.shape[-1] != weight.shape[1]:
        raise ValueError(f"int8_linear: input {tuple(input.shape)} does not match weight {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"int8_linear: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not input.is_floating_point():
        raise TypeError(f"int8_linear: input must be floating point, got {input.dtype}")
    if tp.scatter_output:
        world = torch.distributed.get_world_size(tp.group)
        if bias is not None:
            raise ValueError("int8_linear: with scatter_output, add the bias after the reduction (as megatron does)")
        if input.dim() < 2 or input.shape[0] % world:
            raise ValueError(f"int8_linear: scatter_output needs dim 0 of input {tuple(input.shape)} divisible by "
                             f"the tensor-parallel size {world}")
    if not recipe.any_int8:
        return _hp_linear_with_tp(input, weight, bias, tp)
    return _Int8LinearFunction.apply(input, weight, bias, recipe, tp)


def _hp_linear_with_tp(input, weight, bias, tp: TPOptions):
    """All three GEMMs in high precision: exactly F.linear, plus the TP communication when asked for."""
    if tp.group is None and not (tp.sequence_parallel or tp.scatter_output or tp.allreduce_dgrad
                                 or tp.gradient_accumulation_fusion):
        return F.linear(input, weight, bias)
    return _Int8LinearFunction.apply(input, weight, bias, HIGH_PRECISION, tp)
