"""Which linears of a GPT model run in INT8, with which recipe (flags: cli.py; the table: precision_table.py),
and where the recipe's INT8 attention runs.

Layer indexes are global and 0-based, as in megatron's `is_first_last_bf16_layer`, so a policy means
the same thing under any pipeline / virtual-pipeline split.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from ..recipe import GEMMS, Int8Recipe

FP8_RECIPES = ("tensorwise", "rowwise")  # torchao float8 recipes of the FP8 peer (peers/fp8.py)
LINEAR_SUBMODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
EXPERT_GROUPS = ("experts", "shared_experts")  # every linear of the routed / shared experts
BF16_MODULE_NAMES = LINEAR_SUBMODULES + EXPERT_GROUPS
INT8_ATTENTION_HEAD_DIMS = (64, 128)  # the head dims ops.int8_attention's kernels are tested at on the GPU


@dataclasses.dataclass(frozen=True)
class Int8Policy:
    """Per-linear INT8 decision for the transformer layers (embedding, output layer, router: always BF16).

    enabled: False builds the BF16 baseline (same attention and norm modules, high-precision linears).
    first_last_layers_bf16: keep the first `num_layers_at_start_in_bf16` and last
        `num_layers_at_end_in_bf16` transformer layers entirely in BF16.
    bf16_modules: submodule names kept in BF16 in every layer: any of linear_qkv, linear_proj,
        linear_fc1, linear_fc2 (dense, routed and shared experts alike), or `experts` /
        `shared_experts` (all linears of the routed / shared experts).
    fp8_peer: None, or a torchao float8 recipe ("tensorwise" or "rowwise"): the benchmarks' FP8 peer,
        every transformer-layer linear in FP8 (`peers/fp8.py`; needs `enabled=False`; the INT8 recipe
        and layer selection above do not apply to it). Embedding, output layer, router stay BF16.
    fp8_compile: with fp8_peer, torch.compile each dense FP8 linear's casts + GEMM.

    INT8 attention (the recipe's int8_attention) runs in exactly the layers that `layer_in_int8` names: the
    BF16 baseline and the first / last layers kept in BF16 keep BF16 attention too, so such a layer is BF16
    throughout. `bf16_modules` names linears and leaves a layer's attention as it is.
    """

    enabled: bool = True
    recipe: Int8Recipe = Int8Recipe()
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    bf16_modules: Tuple[str, ...] = ()
    fp8_peer: Optional[str] = None
    fp8_compile: bool = False

    def __post_init__(self):
        object.__setattr__(self, "bf16_modules", tuple(self.bf16_modules))
        if self.fp8_peer is not None:
            if self.fp8_peer not in FP8_RECIPES:
                raise ValueError(f"Int8Policy.fp8_peer must be None or one of {FP8_RECIPES}, got {self.fp8_peer!r}")
            if self.enabled:
                raise ValueError("INT8 linears and the FP8 peer are mutually exclusive "
                                 "(--int8-linear / --fp8-peer): pick one")
        if not isinstance(self.recipe, Int8Recipe):
            raise TypeError(f"Int8Policy.recipe must be an Int8Recipe, got {type(self.recipe).__name__}")
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"Int8Policy.{name} must be a non-negative int, got {value!r}")
        unknown = [m for m in self.bf16_modules if m not in BF16_MODULE_NAMES]
        if unknown:
            raise ValueError(f"Int8Policy.bf16_modules: unknown {unknown}; expected names from {BF16_MODULE_NAMES}")

    def check_num_layers(self, num_layers: int) -> None:
        """Raise if first/last BF16 would leave no INT8 layer (a silent BF16 run)."""
        if self.enabled and self.first_last_layers_bf16:
            if self.num_layers_at_start_in_bf16 + self.num_layers_at_end_in_bf16 >= num_layers:
                raise ValueError(
                    f"INT8 policy: {self.num_layers_at_start_in_bf16} first + {self.num_layers_at_end_in_bf16} "
                    f"last BF16 layers leave no INT8 layer out of {num_layers}")

    def layer_in_int8(self, layer_index: int, num_layers: int) -> bool:
        """Whether transformer layer `layer_index` (global, 0-based) uses INT8 at all."""
        if not self.enabled:
            return False
        if self.first_last_layers_bf16:
            if layer_index < self.num_layers_at_start_in_bf16:
                return False
            if layer_index >= num_layers - self.num_layers_at_end_in_bf16:
                return False
        return True

    def keeps_in_bf16(self, submodule: str, expert_group: Optional[str] = None) -> bool:
        """Whether `bf16_modules` names this linear (or its expert group)."""
        return submodule in self.bf16_modules or expert_group in self.bf16_modules

    def describe(self) -> str:
        if self.fp8_peer is not None:
            compiled = ", torch.compile" if self.fp8_compile else ", eager"
            return f"INT8 off; FP8 peer: {describe_fp8_recipe(self.fp8_peer)}{compiled}"
        if not self.enabled:
            return "INT8 off (BF16 baseline)"
        parts = [self.recipe.describe()]
        if self.first_last_layers_bf16:
            parts.append(f"first {self.num_layers_at_start_in_bf16} / last {self.num_layers_at_end_in_bf16} layers BF16")
        if self.bf16_modules:
            parts.append("BF16 modules: " + ",".join(self.bf16_modules))
        return "; ".join(parts)


def int8_attention_problems(head_dim: int, attention_dropout: float,
                            reset_attention_mask: bool = False) -> List[Tuple[str, str]]:
    """What INT8 attention (ops.int8_attention) cannot serve in a layer of this head dim and attention dropout:
    (the setting, "head_dim", "attention_dropout" or "reset_attention_mask"; why, naming its flag), empty when it
    serves it. The trainer's
    start-up checks (training/validation.py) and the layer (megatron.attention.SDPAttention) ask it, so both
    refuse the same settings."""
    problems = []
    if head_dim not in INT8_ATTENTION_HEAD_DIMS:
        served = " or ".join(map(str, INT8_ATTENTION_HEAD_DIMS))
        problems.append(("head_dim", f"head dim {head_dim} (--kv-channels, or --hidden-size / --num-attention-heads): "
                                     f"the INT8 attention kernels take {served}"))
    if attention_dropout:
        problems.append(("attention_dropout",
                         f"attention dropout {attention_dropout}: INT8 attention has none; give --attention-dropout 0"))
    if reset_attention_mask:
        problems.append(("reset_attention_mask", "--reset-attention-mask: document masks are not supported (INT8 "
                                                 "attention is causal over the whole sequence)"))
    return problems


def describe_fp8_recipe(recipe: str) -> str:
    """The FP8 peer's recipe in one line, for logs and the precision table."""
    formats = "e4m3 x/w, e5m2 grad" if recipe == "tensorwise" else "e4m3, power-of-2 scales"
    return f"torchao float8 {recipe} ({formats})"
