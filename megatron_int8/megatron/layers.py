"""megatron-core Column/RowParallelLinear with INT8 GEMMs.

The subclasses change only `_forward_impl`, the call megatron makes for the local GEMM: everything
around it (weight allocation and init, TP sharding, Row's output all-reduce / reduce-scatter,
`gather_output`, `skip_bias_add`, `is_expert` explicit expert communication, sharded state dicts)
stays megatron's, so parameter names and checkpoints are identical to the BF16 layers.
`int8_linear` carries the semantics of `linear_with_grad_accumulation_and_async_allreduce`: sequence-
parallel all-gather / reduce-scatter, async dgrad all-reduce, and wgrad accumulation into
`weight.main_grad` with `grad_added_to_main_grad`. Frozen weights get no wgrad (as in
`linear_with_frozen_weight`).

`config.gradient_accumulation_fusion` needs apex's fused_weight_gradient_mlp_cuda in megatron; here
the wgrad GEMM accumulates into main_grad itself, so these layers accept the flag without apex.

`config.tp_comm_overlap` (megatron's flag, which otherwise only Transformer Engine implements) pipelines
the sequence-parallel collectives with the GEMMs, in INT8 and high precision alike (see linear.TPOptions),
honouring `tp_comm_overlap_ag`, `tp_comm_overlap_rs` and `tp_comm_overlap_disable_qkv` / `_fc1`. The
row-parallel layer then does its output reduce-scatter inside the linear, so that layer overrides
`forward` as well: the one place megatron issues that collective.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import List, Optional

import torch
from megatron.core.tensor_parallel import layers as mcore_layers
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.utils import get_tensor_model_parallel_group_if_none

from ..ops.linear import TPOptions, int8_linear
from ..ops.shape_policy import describe_precision
from ..recipe import DEFAULT_RECIPE, HIGH_PRECISION, Int8Recipe
from .compat import check_linear_gemm_options

# How many times any INT8 linear's recipe was set: what derives from its linears' recipes (the grouped experts'
# grouped_problem) is worked out again only when this moved, not on every forward.
RECIPE_CHANGES = 0


def config_without_apex_check(config):
    """A shallow config copy that passes megatron's apex check for gradient_accumulation_fusion."""
    if config.gradient_accumulation_fusion and not mcore_layers._grad_accum_fusion_available:
        config = copy.copy(config)  # no __post_init__: only the constructor reads this copy
        config.gradient_accumulation_fusion = False
    return config


def run_forward_pre_hooks(module: torch.nn.Module, x: torch.Tensor) -> None:
    """The forward pre-hooks of a module whose parameters a fused op reads without calling it (the grouped
    experts' linears, the q/k norms of attention's fused split): megatron's DDP waits there for the parameter
    all-gather of the module's bucket (--overlap-param-gather), so without them the op would read weights that
    other ranks updated but this one never gathered. (Their return values, a replaced input, do not apply: the
    fused op takes its input whole.)"""
    for hook_id, hook in module._forward_pre_hooks.items():
        if hook_id in module._forward_pre_hooks_with_kwargs:
            hook(module, (x,), {})
        else:
            hook(module, (x,))


class Int8LinearMixin:
    """INT8 `_forward_impl` shared by the column- and row-parallel layers.

    `int8=False` keeps the layer high precision: megatron's own implementation, except that
    gradient-accumulation fusion without apex runs through `int8_linear`'s high-precision path.
    """

    int8: bool
    int8_built_recipe: Int8Recipe  # as built, before any fallback
    int8_probe = None  # an ops.health.LinearProbe while the trainer collects statistics

    def _finish_int8_init(self, config, recipe: Optional[Int8Recipe], int8: bool,
                          tp_comm_buffer_name: Optional[str] = None) -> None:
        if config.defer_embedding_wgrad_compute:
            raise NotImplementedError(
                f"{type(self).__name__}: defer_embedding_wgrad_compute (grad_output_buffer) is not supported; drop "
                "--defer-embedding-wgrad-compute")
        if recipe is not None and not isinstance(recipe, Int8Recipe):
            raise TypeError(f"{type(self).__name__}: recipe must be an Int8Recipe, got {type(recipe).__name__}")
        self.config = config
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.int8 = bool(int8)
        recipe = recipe or DEFAULT_RECIPE
        if getattr(self, "is_expert", False) and recipe.autotune:
            recipe = dataclasses.replace(recipe, autotune=False)  # token counts change with every routing
        if recipe.smooth_swiglu and (tp_comm_buffer_name != "fc2" or getattr(self, "is_expert", False)):
            # the guard is for a dense MLP's SwiGLU output only (experts' fc2 also names its buffer "fc2"; with the
            # guard there alone, fc1 and fc2 would differ and the experts could not run grouped)
            recipe = dataclasses.replace(recipe, smooth_swiglu=False)
        self.int8_recipe = self.int8_built_recipe = recipe
        disabled = {"qkv": config.tp_comm_overlap_disable_qkv, "fc1": config.tp_comm_overlap_disable_fc1}
        self.tp_comm_overlap = (config.tp_comm_overlap and config.sequence_parallel
                                and not disabled.get(tp_comm_buffer_name, False))

    @property
    def int8_recipe(self) -> Int8Recipe:
        """The recipe the layer runs; the trainer's auto fallback may replace it (training/health.py)."""
        return self._int8_recipe

    @int8_recipe.setter
    def int8_recipe(self, recipe: Int8Recipe) -> None:
        global RECIPE_CHANGES
        self._int8_recipe = recipe
        RECIPE_CHANGES += 1

    @property
    def precision(self) -> str:
        """shape_policy.describe_precision ("int8", or "int8/auto (...)"); "high" for an int8=False layer."""
        return describe_precision(self.int8_recipe, self.weight) if self.int8 else "high"

    @property
    def _linear_recipe(self) -> Int8Recipe:
        return self.int8_recipe if self.int8 else HIGH_PRECISION

    @property
    def takes_grad_output_amax(self) -> bool:
        """Whether this layer quantizes its output gradient tensorwise, so that an amax attached to that
        gradient (reference.attach_amax, e.g. by attention._SplitQKVNormed) spares it an amax pass."""
        recipe = self._linear_recipe
        return recipe.granularity == "tensor" and (recipe.dgrad or recipe.wgrad)

    def _forward_impl(
        self,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        gradient_accumulation_fusion: bool,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
        grad_output_buffer: Optional[List[torch.Tensor]] = None,
        wgrad_deferral_limit: Optional[int] = None,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        **newer_options,
    ) -> torch.Tensor:
        """`newer_options`: keywords that later megatron-core versions pass (compat.LINEAR_GEMM_OPTIONS); the
        high-precision path hands them on, the INT8 path accepts each only at its "off" value."""
        if grad_output_buffer is not None:
            raise NotImplementedError(f"{type(self).__name__}: grad_output_buffer (deferred wgrad) is not supported")
        fused_accumulation = gradient_accumulation_fusion and weight.requires_grad
        overlap_ag = self.tp_comm_overlap and sequence_parallel and self.config.tp_comm_overlap_ag
        if not (self.int8 or overlap_ag or (fused_accumulation and not mcore_layers._grad_accum_fusion_available)):
            return super()._forward_impl(
                input=input, weight=weight, bias=bias, gradient_accumulation_fusion=gradient_accumulation_fusion,
                allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel, tp_group=tp_group,
                **newer_options)
        check_linear_gemm_options(type(self).__name__, newer_options)
        if (sequence_parallel or allreduce_dgrad) and tp_group is None:
            tp_group = get_tensor_model_parallel_group_if_none(None)
        tp = TPOptions(group=tp_group, sequence_parallel=sequence_parallel, allreduce_dgrad=allreduce_dgrad,
                       gradient_accumulation_fusion=fused_accumulation, overlap_ag=overlap_ag)
        return int8_linear(input, weight, bias, self._linear_recipe, tp=tp, probe=self.int8_probe)


class Int8ColumnParallelLinear(Int8LinearMixin, ColumnParallelLinear):
    """ColumnParallelLinear with INT8 fprop/dgrad/wgrad. Extra keywords: `recipe`, `int8`."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method,
                 recipe: Optional[Int8Recipe] = None, int8: bool = True, **kwargs):
        if kwargs.get("grad_output_buffer") is not None or kwargs.get("embedding_activation_buffer") is not None:
            raise NotImplementedError(
                "Int8ColumnParallelLinear: grad_output_buffer / embedding_activation_buffer "
                "(defer_embedding_wgrad_compute) are not supported")
        super().__init__(input_size, output_size, config=config_without_apex_check(config),
                         init_method=init_method, **kwargs)
        self._finish_int8_init(config, recipe, int8, kwargs.get("tp_comm_buffer_name"))


def fuse_output_layer_wgrad(module: ColumnParallelLinear) -> Int8ColumnParallelLinear:
    """Turn megatron's own ColumnParallelLinear (GPTModel's output layer) into this package's high-precision
    layer in place, with gradient-accumulation fusion: its wgrad GEMM then adds into main_grad
    (ops.main_grad.hp_wgrad_into) instead of writing a [vocab, hidden] weight.grad that DDP's hook adds afterwards.
    The class changes, nothing else: parameters, state dict and forward values stay megatron's, and so does its
    communication (no tp_comm_overlap pipelining, which megatron's output layer does not do without TE)."""
    if type(module) is not ColumnParallelLinear:
        raise TypeError(f"fuse_output_layer_wgrad needs megatron's ColumnParallelLinear, got {type(module).__name__}")
    module.__class__ = Int8ColumnParallelLinear
    module._finish_int8_init(module.config, None, int8=False)
    module.tp_comm_overlap = False
    module.gradient_accumulation_fusion = True
    return module


class Int8RowParallelLinear(Int8LinearMixin, RowParallelLinear):
    """RowParallelLinear with INT8 fprop/dgrad/wgrad. Extra keywords: `recipe`, `int8`."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method,
                 recipe: Optional[Int8Recipe] = None, int8: bool = True, **kwargs):
        super().__init__(input_size, output_size, config=config_without_apex_check(config),
                         init_method=init_method, **kwargs)
        self._finish_int8_init(config, recipe, int8, kwargs.get("tp_comm_buffer_name"))

    def forward(self, input_):
        """megatron's forward, except under `tp_comm_overlap` with sequence parallelism: then the output
        reduce-scatter (and its backward all-gather) run inside the linear, pipelined with the GEMM. (Weights that
        megatron-core 0.19's GTP shards take megatron's forward, whose GEMM gathers them, or refuses them in INT8.)"""
        if not self.tp_comm_overlap or self.explicit_expert_comm or getattr(self, "gtp_remat_size", 1) > 1:
            return super().forward(input_)
        if self.config._cpu_offloading_context is not None:
            raise NotImplementedError("Int8RowParallelLinear: tp_comm_overlap with CPU offloading is not supported; "
                                      "drop --tp-comm-overlap or the CPU offloading")
        tp = TPOptions(group=self.tp_group, scatter_output=True,
                       gradient_accumulation_fusion=self.gradient_accumulation_fusion and self.weight.requires_grad,
                       overlap_ag=self.config.tp_comm_overlap_ag, overlap_rs=self.config.tp_comm_overlap_rs)
        output = int8_linear(input_, self.weight, None, self._linear_recipe, tp=tp, probe=self.int8_probe)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None
