"""training.memory's weight-cache figure: what the cache holds per INT8 linear under each recipe."""
import dataclasses

import torch
from mcore_helpers import single_process_megatron, tiny_config

from megatron_int8 import Int8Recipe
from megatron_int8.megatron.layers import Int8ColumnParallelLinear
from megatron_int8.training.memory import weight_cache_bytes


def test_weight_cache_bytes_follow_the_recipe():
    """Q(W) for fprop and Q(W)^T for dgrad, one byte per weight each; --int8-no-dgrad-weight-cache keeps Q(W)
    only; BF16 linears and a recipe without the cache hold nothing."""
    with single_process_megatron():
        config = tiny_config()

        def linear(**changes):
            return Int8ColumnParallelLinear(64, 96, config=config, init_method=torch.nn.init.zeros_, bias=False,
                                            recipe=dataclasses.replace(Int8Recipe(), **changes))

        numel = 64 * 96
        assert weight_cache_bytes([linear()]) == 2 * numel
        assert weight_cache_bytes([linear(cache_dgrad_weight=False)]) == numel
        assert weight_cache_bytes([linear(cache_weights=False)]) == 0
        assert weight_cache_bytes([linear(dgrad=False)]) == numel
