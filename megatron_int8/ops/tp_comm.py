"""Tensor-parallel communication inside the linear, as megatron-core's
`linear_with_grad_accumulation_and_async_allreduce` does it: sequence-parallel all-gather and reduce-scatter
(optionally pipelined with the GEMMs), and the INT8 all-gather of a quantized input."""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from ..recipe import Int8Recipe
from ..reference import TOKEN_PAD, QTensor, handle_nonfinite, nan_as_inf, pad_columns
from .backend import quantize_kwargs

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


def start_all_gather_dim0(x: torch.Tensor, group):
    """(the [world * rows, ...] all-gather of x along dim 0, its pending work): wait() before reading it."""
    world = torch.distributed.get_world_size(group)
    out = torch.empty((x.shape[0] * world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, torch.distributed.all_gather_into_tensor(out, x.contiguous(), group=group, async_op=True)


def all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    out, work = start_all_gather_dim0(x, group)
    work.wait()
    return out


def _other_rows(world: int, rank: int, rows: int) -> List[slice]:
    """The other ranks' rows of a [world * rows, ...] tensor gathered along dim 0, in rank order, as at most
    two contiguous ranges (before and after this rank's)."""
    return [r for r in (slice(0, rank * rows), slice((rank + 1) * rows, world * rows)) if r.start < r.stop]


def gather_pipelined(local: torch.Tensor, group, rows_gemm, out: torch.Tensor) -> torch.Tensor:
    """All-gather `local` [m, K] along dim 0 and run `rows_gemm(x_rows, out_rows)` over all of it, into the
    matching rows of `out`: this rank's rows from `local` while the gather runs, then the other ranks'.
    Returns the gathered [world * m, K] tensor."""
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    m = local.shape[0]
    gathered, work = start_all_gather_dim0(local, group)
    rows_gemm(local, out[rank * m:(rank + 1) * m])
    work.wait()
    for rows in _other_rows(world, rank, m):
        rows_gemm(gathered[rows], out[rows])
    return gathered


def reduce_scatter_pipelined(total_rows: int, group, rows_gemm, shape, dtype, device) -> torch.Tensor:
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


def group_amax(x: torch.Tensor, dim: Optional[int], group) -> torch.Tensor:
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


def gather_quantized_input(input, backend, recipe: Int8Recipe, group, wgrad_int8: bool):
    """Sequence parallelism with the INT8 all-gather: (Q(all-gather(X)) for fprop, the local shard of the
    wgrad operand for backward to all-gather, or None), with the scales of the gathered tensor, so the
    INT8 values are identical to quantizing a BF16 gather, at half its bytes. Tensorwise: one amax
    all-reduced over the group; the shard kept is Q(X_local). Row-wise: Q(X)'s per-token scales are local
    (gathered with the data), Q(X^T)'s per-channel amax is all-reduced; the shard kept is Q(X_local^T)."""
    x_local = input.reshape(-1, input.shape[-1])
    kw = quantize_kwargs(recipe, "fprop input")
    if recipe.granularity == "tensor":
        q_local, _ = backend.quantize(x_local, rowwise=True, columnwise=False,
                                      amax=group_amax(x_local, None, group), **kw)
        q_total = QTensor(all_gather_dim0(q_local.data, group), q_local.scale, "tensor", recipe.block_size)
        return q_total, (q_local if wgrad_int8 else None)
    col_amax = group_amax(x_local, 0, group) if wgrad_int8 else None
    # the per-token scales are local: check them once gathered, so that every rank raises together
    # (a rank raising alone before the all-gather would leave the others waiting in it)
    q_local, qt_local = backend.quantize(x_local, rowwise=True, columnwise=wgrad_int8, columnwise_amax=col_amax,
                                         **dict(kw, check_finite="off"))
    q_total = QTensor(all_gather_dim0(q_local.data, group), all_gather_dim0(q_local.scale, group), "row",
                      recipe.block_size)
    handle_nonfinite(q_total.scale, "fprop input", recipe.check_finite)
    return q_total, qt_local


def wgrad_operand_from_shards(gathered, scale, granularity: str, world: int, block_size: int) -> QTensor:
    """Q(X_total)^T [C, R] from backward's all-gather of the saved shards: tensorwise, Q(X_local) rows
    (transposed here); row-wise, each rank's Q(X_local^T) [C, R_local] (interleaved into [C, R] here).
    The token axis is padded to TOKEN_PAD, as the output gradient's is."""
    if granularity == "tensor":
        q = QTensor(gathered, scale, "tensor", block_size).transposed()
    else:
        C = gathered.shape[0] // world
        q = QTensor(gathered.view(world, C, -1).permute(1, 0, 2).reshape(C, -1), scale, "row", block_size)
    return pad_columns(q, TOKEN_PAD)
