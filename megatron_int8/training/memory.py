"""Bytes per parameter of what stays in memory between steps, printed at start so a user can plan a run.

Per state, from the arguments and this rank's model: the model weight (bf16 or fp32), megatron's fp32
main_grad (the DDP grad buffer, grad_reduce_in_fp32), the master weight (megatron's fp32 main param, the
precision-aware optimizer's fp32 master or its int16 remainder; none for fp32 training, whose parameter
is the master), Adam's two moments (fp32 4, bf16 2, int8 1 + a 4-byte scale per 128), and the INT8
weight cache (Q(W) and Q(W)^T, one byte each per INT8-linear parameter, averaged over all parameters).
The distributed optimizer shards the master weight and the moments over the data-parallel ranks, expert
parameters under expert parallelism over the expert-data-parallel ranks (DP / EP); the rows average the two.
Activations and temporaries come on top; the logs' peak memory measures them.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from ..ops.adamw import QBLOCK

STATE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / QBLOCK}


def weight_cache_bytes(modules) -> int:
    """Bytes the INT8 weight cache holds for these modules' INT8 linears (Q(W) for fprop, Q(W)^T for dgrad unless
    cache_dgrad_weight is off, which experts that run grouped do not honour: they keep both)."""
    from ..megatron.layers import Int8LinearMixin
    from ..ops.grouped_linear import grouped_recipe_problem

    total = 0
    for module in modules:
        if isinstance(module, Int8LinearMixin) and module.int8 and module.int8_recipe.cache_weights:
            recipe = module.int8_recipe
            grouped = (getattr(module, "is_expert", False) and module.config.moe_grouped_gemm
                       and grouped_recipe_problem(recipe) is None)  # grouped experts keep Q(W)^T regardless
            dgrad_cached = recipe.cache_dgrad_weight or grouped
            per_element = int(recipe.fprop) + int(recipe.dgrad and dgrad_cached)
            total += sum(p.numel() for p in module.parameters(recurse=False) if p.dim() == 2) * per_element
    return total


def optimizer_shards(args, models) -> Tuple[int, Optional[int], float]:
    """(dense shards, expert shards or None without expert-parallel parameters, mean shards per parameter) of the
    optimizer's state on this rank: with the distributed optimizer, DP for dense parameters and DP / EP for expert
    ones (megatron marks those allreduce=False under expert parallelism; they are reduced and sharded over the
    expert-data-parallel group)."""
    counts = [0, 0]
    for model in models:
        for p in model.parameters():
            counts[not getattr(p, "allreduce", True)] += p.numel()
    dense = args.data_parallel_size if args.use_distributed_optimizer else 1
    if not counts[1]:
        return dense, None, float(dense)
    expert = max(dense // args.expert_model_parallel_size, 1)
    return dense, expert, sum(counts) / (counts[0] / dense + counts[1] / expert)


def bytes_per_parameter(args, models) -> Tuple[int, List[Tuple[str, float]]]:
    """(parameters on this rank, [(state, bytes per parameter)...]) for `models` (unwrapped chunks)."""
    numel = sum(p.numel() for model in models for p in model.parameters())
    shards = optimizer_shards(args, models)[2]
    precise = getattr(args, "use_precision_aware_optimizer", False)
    rows = [("bf16 weight" if args.bf16 else "fp32 weight", 2.0 if args.bf16 else 4.0), ("main_grad (fp32)", 4.0)]
    if args.bf16:
        if precise and args.store_param_remainders:
            rows.append(("master weight (int16 remainder)", 2.0 / shards))
        else:
            rows.append(("master weight (fp32)", 4.0 / shards))
    if args.optimizer == "adam":
        for name in ("exp_avg", "exp_avg_sq"):
            dtype = getattr(args, f"{name}_dtype") if precise else "fp32"
            rows.append((f"{name} ({dtype})", STATE_BYTES[dtype] / shards))
    elif args.sgd_momentum:
        rows.append(("momentum (fp32)", 4.0 / shards))
    cache = weight_cache_bytes(m for model in models for m in model.modules())
    if cache:
        rows.append(("INT8 weight cache", cache / max(numel, 1)))
    return numel, rows


def format_bytes_per_parameter(args, models) -> str:
    numel, rows = bytes_per_parameter(args, models)
    total = sum(value for _, value in rows)
    dense, expert, _ = optimizer_shards(args, models)
    where = f", optimizer states sharded over {dense} data-parallel ranks" if dense > 1 else ""
    if expert is not None and expert != dense:
        where += f" (expert parameters over {expert})"
    body = " | ".join(f"{name} {value:.2f}" for name, value in rows)
    return (f"memory per parameter (bytes, {numel / 1e6:.2f} M parameters on this rank{where}): {body} | "
            f"total {total:.2f} = {total * numel / 2**30:.2f} GiB between steps, before activations")
