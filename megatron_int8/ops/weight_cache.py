"""INT8 weights cached per weight tensor until the weight changes.

Q(W) and Q(W)^T are kept on the weight tensor itself (so they die with it). A change is seen through torch's
version counter, a new storage, or any optimizer step (a global torch.optim step hook), because Megatron's
optimizers write parameters through `.data`, which the version counter does not see.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..recipe import Int8Recipe
from ..reference import QTensor
from .backend import quantize_kwargs

_weight_generation = 0


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
    """What a cached quantization of `weight` depends on: its current values (`weight_version_key`), how the
    recipe's numerics quantize a weight, and, of the execution options, only the finite check (it runs while
    quantizing: a weight quantized unchecked must not serve a recipe that raises on Inf/NaN)."""
    numerics = recipe.numerics
    return weight_version_key(weight) + (numerics.granularity, numerics.block_size, recipe.check_finite,
                                         backend.name)


def quantized_weight(weight: torch.Tensor, backend, recipe: Int8Recipe, *, rowwise: bool, columnwise: bool):
    """(Q(W) [N,K], Q(W)^T [K,N]) as requested; cached while the weight is unchanged. Under
    `recipe.cache_dgrad_weight=False` only Q(W) is cached and Q(W)^T is quantized for each request (one
    pass over W per micro-batch's dgrad, 1 byte per parameter less held between steps)."""
    kw = quantize_kwargs(recipe, "weight", weight=True)
    if not recipe.cache_weights:
        return backend.quantize(weight.detach(), rowwise=rowwise, columnwise=columnwise, **kw)
    fresh_col = None
    if columnwise and not recipe.cache_dgrad_weight:
        fresh_col = backend.quantize(weight.detach(), rowwise=False, columnwise=True, **kw)[1]
        if not rowwise:
            return None, fresh_col
        columnwise = False
    key = weight_cache_key(weight, recipe, backend)
    entry = getattr(weight, _CACHE_ATTR, None)
    if entry is None or entry.key != key or (rowwise and entry.row is None) or (columnwise and entry.col is None):
        # Quantize every form this recipe will use and cache, in one pass, so later micro-batches only read.
        row, col = backend.quantize(weight.detach(), rowwise=rowwise or recipe.fprop,
                                    columnwise=columnwise or (recipe.dgrad and recipe.cache_dgrad_weight), **kw)
        entry = _CachedWeight(key, row, col)
        setattr(weight, _CACHE_ATTR, entry)
    return entry.row, (fresh_col if fresh_col is not None else entry.col)
