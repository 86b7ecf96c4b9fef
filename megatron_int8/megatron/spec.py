"""GPT layer and block specs with INT8 linears, mirroring megatron-core's local spec.

Only the four linears of a transformer layer (linear_qkv, linear_proj, linear_fc1, linear_fc2, also
inside routed and shared experts) change class; the embedding, the output layer and the MoE router
are built by GPTModel / MoELayer outside the spec and stay BF16. Attention (megatron's SelfAttention
with an in-place query norm, over SDPA, or TE's core attention when Transformer Engine is installed)
and the norms (SP-capable torch norms, or TENorm) are the same for the INT8, the BF16 baseline and the
FP8 peer spec (torchao float8 linears, `peers/fp8.py`), so they differ only in the linears; unless the
recipe asks for INT8 attention (int8_attention), which the INT8 layers then run (SDPAttention's INT8 path).
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Dict, Optional, Tuple

from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType, LayerType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import L2Norm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from ..ops.swiglu import SwiGLU
from ..recipe import DEFAULT_RECIPE, Int8Recipe
from .attention import QueryNormInPlaceSelfAttention, SDPAttention
from .compat import SequenceParallelNorm, apply_no_te_compat, experts_spec
from .experts import Int8GroupedMLP
from .layers import Int8ColumnParallelLinear, Int8RowParallelLinear
from .policy import Int8Policy

if HAVE_TE:
    from megatron.core.extensions.transformer_engine import TEDotProductAttention, TENorm

_INT8_LINEARS = (Int8ColumnParallelLinear, Int8RowParallelLinear)


# (column-parallel, row-parallel) linear classes of the benchmark peers, by name; a peer registers its own on
# import (peers/fp8.py: "fp8"), so this module never imports a peer
PEER_LINEARS: Dict[str, Tuple[type, type]] = {}


def register_peer_linears(name: str, column: type, row: type) -> None:
    PEER_LINEARS[name] = (column, row)


class Int8SpecProvider(LocalSpecProvider):
    """megatron's local backend with INT8 linears (or, with `int8=False`, the same classes in high
    precision), SDPA / TE attention and SP-capable norms.

    `fp8_recipe` ("tensorwise" / "rowwise") picks the FP8 peer's linear classes (torchao float8)
    instead, `fp8_compile` their torch.compile option; `recipe` and `int8` then do not apply.
    Everything else is the same spec.
    """

    def __init__(self, recipe: Optional[Int8Recipe] = None, int8: bool = True, fp8_recipe: Optional[str] = None,
                 fp8_compile: bool = False):
        self.recipe = recipe or DEFAULT_RECIPE
        self.int8 = int8
        self.fp8_recipe = fp8_recipe
        self.fp8_compile = fp8_compile

    def _linear(self, column: bool) -> ModuleSpec:
        if self.fp8_recipe is not None:
            if "fp8" not in PEER_LINEARS:
                raise RuntimeError("an FP8 peer spec needs the peer's linears: `import megatron_int8.peers.fp8` "
                                   "registers them")
            cls = PEER_LINEARS["fp8"][0 if column else 1]
            return ModuleSpec(module=cls, params={"fp8_recipe": self.fp8_recipe, "compile": self.fp8_compile})
        cls = Int8ColumnParallelLinear if column else Int8RowParallelLinear
        return ModuleSpec(module=cls, params={"recipe": self.recipe, "int8": self.int8})

    def column_parallel_linear(self) -> ModuleSpec:
        return self._linear(column=True)

    def row_parallel_linear(self) -> ModuleSpec:
        return self._linear(column=False)

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        """TENorm with Transformer Engine, else torch RMSNorm/LayerNorm (per config.normalization)
        that also accepts sequence parallelism."""
        return TENorm if HAVE_TE else SequenceParallelNorm

    def hidden_norm(self, rms_norm: bool = False):
        """The layer's input and pre-MLP norm: `layer_norm`'s, keeping its input's INT8 copy for backward in INT8
        layers under the recipe's int8_norm_input (megatron_int8.ops.rms_norm)."""
        norm = self.layer_norm(rms_norm=rms_norm)
        if not (self.fp8_recipe is None and self.int8 and self.recipe.any_int8 and self.recipe.int8_norm_input):
            return norm
        if norm is not SequenceParallelNorm:
            raise ValueError("--int8-norm-input needs this package's RMSNorm, not Transformer Engine's TENorm (which "
                             "the spec takes where Transformer Engine is installed): drop --int8-norm-input, or run "
                             "where Transformer Engine is not installed")
        return ModuleSpec(module=SequenceParallelNorm, params={"int8_copy": True})

    def core_attention(self):
        """TEDotProductAttention with Transformer Engine, else SDPAttention; in an INT8 layer whose recipe asks for
        INT8 attention (int8_attention), SDPAttention running it, Transformer Engine or not (a builder: megatron
        calls the core attention's class with its own keywords)."""
        if self.fp8_recipe is None and self.int8 and self.recipe.int8_attention:
            return functools.partial(SDPAttention, recipe=self.recipe)
        return TEDotProductAttention if HAVE_TE else SDPAttention

    def activation_func(self) -> ModuleSpec:
        """The dense MLP's SwiGLU module, used where `config.use_te_activation_func` is set (megatron_int8.ops.swiglu):
        it hands its outputs' maxima to INT8 linears that quantize row- or tensor-wise, and keeps its input in
        INT8 under the recipe's int8_swiglu_input."""
        int8 = self.fp8_recipe is None and self.int8 and self.recipe.any_int8
        emit = int8 and self.recipe.granularity in ("row", "tensor")
        return ModuleSpec(module=SwiGLU, params={"emit_maxima": emit,
                                                 "int8_copy": int8 and self.recipe.int8_swiglu_input})

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool = False):
        """Experts over this backend's linears (LocalSpecProvider hard-codes BF16 ones), in the form the installed
        megatron-core asks for (`compat.experts_spec`).

        `moe_grouped_gemm` with INT8 or BF16 experts: `Int8GroupedMLP` (SequentialMLP's modules and
        checkpoints; grouped INT8 quantization and GEMMs, or grouped BF16 GEMMs for the baseline).
        Otherwise SequentialMLP, one GEMM per local expert: FP8 experts have no grouped GEMM here, and say so.
        """
        submodules = MLPSubmodules(linear_fc1=self.column_parallel_linear(), linear_fc2=self.row_parallel_linear(),
                                   activation_func=self.activation_func())
        module = SequentialMLP
        if moe_use_grouped_gemm or moe_use_legacy_grouped_gemm:
            if self.fp8_recipe is None:
                module = Int8GroupedMLP
            else:
                warnings.warn("megatron-int8: moe_grouped_gemm has no FP8 grouped GEMM here; "
                              "experts run as SequentialMLP with FP8 linears")
        return experts_spec(module, submodules)


def get_gpt_int8_layer_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    normalization: Optional[str] = "RMSNorm",
    qk_l2_norm: Optional[bool] = False,
    *,
    recipe: Optional[Int8Recipe] = None,
    int8: bool = True,
    fp8_recipe: Optional[str] = None,
    fp8_compile: bool = False,
) -> ModuleSpec:
    """A GPT TransformerLayer spec like megatron's `get_gpt_layer_local_spec`, with INT8 linears.

    `int8=False` gives the BF16 baseline layer (same attention and norms); `fp8_recipe` the FP8
    peer's layer (torchao float8 linears, `fp8_compile`: torch.compile them; `recipe` / `int8`
    ignored). Dense MLPs keep `module=MLP` (TransformerLayer passes the TP group only to exactly
    MLP). Norm modules follow
    `config.normalization` (as megatron's torch norm does); `normalization` is accepted for
    signature parity. Pass arguments by keyword.
    """
    if num_experts:
        apply_no_te_compat()
    backend = Int8SpecProvider(recipe=recipe, int8=int8, fp8_recipe=fp8_recipe, fp8_compile=fp8_compile)
    norm = backend.hidden_norm(rms_norm=normalization == "RMSNorm")
    qk_norm = L2Norm if qk_l2_norm else (backend.layer_norm(rms_norm=normalization == "RMSNorm", for_qk=True)
                                         if qk_layernorm else IdentityOp)
    # dense MLPs carry the SwiGLU module; megatron's MLP uses it only under config.use_te_activation_func
    mlp = get_mlp_module_spec_for_backend(backend=backend, num_experts=num_experts,
                                          moe_grouped_gemm=moe_grouped_gemm,
                                          use_te_activation_func=num_experts is None)
    # Same checkpoint keys as megatron's specs: norms are stored where TE fuses them into the
    # following linear. MoE layers, as in the TE spec, keep a separate pre-MLP norm.
    keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    if num_experts is None:
        keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=QueryNormInPlaceSelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=backend.column_parallel_linear(),
                    core_attention=backend.core_attention(),
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys_map,
        ),
    )


def _keep_in_bf16(spec, policy: Int8Policy, name: str = "", expert_group: Optional[str] = None):
    """Copy of a spec tree where the INT8 linears named in `policy.bf16_modules` get `int8=False`; an MLP
    whose fc1 and fc2 both end up BF16 gets a SwiGLU that writes no maxima (no linear would read them) and
    keeps its input in BF16."""
    if isinstance(spec, functools.partial) and "submodules" in spec.keywords:  # a builder (megatron-core >= 0.17)
        submodules = _keep_in_bf16(spec.keywords["submodules"], policy, name, expert_group)
        return functools.partial(spec.func, *spec.args, **{**spec.keywords, "submodules": submodules})
    if isinstance(spec, ModuleSpec):
        if spec.module in _INT8_LINEARS and policy.keeps_in_bf16(name, expert_group):
            return dataclasses.replace(spec, params={**spec.params, "int8": False})
        if spec.submodules is None:
            return spec
        return dataclasses.replace(spec, submodules=_keep_in_bf16(spec.submodules, policy, name, expert_group))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {}
        for field in dataclasses.fields(spec):
            group = field.name if field.name in ("experts", "shared_experts") else expert_group
            changes[field.name] = _keep_in_bf16(getattr(spec, field.name), policy, field.name, group)
        activation = changes.get("activation_func")
        if isinstance(activation, ModuleSpec) and activation.module is SwiGLU and not any(
                changes[fc].params.get("int8", True) for fc in ("linear_fc1", "linear_fc2")
                if isinstance(changes.get(fc), ModuleSpec)):
            changes["activation_func"] = dataclasses.replace(activation, params={**activation.params,
                                                                                 "emit_maxima": False,
                                                                                 "int8_copy": False})
        return dataclasses.replace(spec, **changes)
    return spec


def _moe_layer_pattern(config: TransformerConfig):
    """1 for MoE layers, 0 for dense ones, per global layer (megatron's moe_layer_freq rules)."""
    if not config.num_moe_experts:
        return [0] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    if isinstance(freq, list) and len(freq) == config.num_layers:
        return list(freq)
    raise ValueError(f"invalid moe_layer_freq {freq!r} for {config.num_layers} layers")


def get_gpt_int8_layer_specs(
    config: TransformerConfig,
    policy: Int8Policy,
    *,
    normalization: Optional[str] = None,
    qk_layernorm: Optional[bool] = None,
    qk_l2_norm: bool = False,
):
    """One layer spec per global layer (index 0 .. num_layers-1), precision per `policy`. The norms follow
    `config.normalization`: a `normalization` that differs is an error, not ignored."""
    policy.check_num_layers(config.num_layers)
    if normalization is not None and normalization != config.normalization:
        raise ValueError(f"normalization={normalization!r}: the layers' norms follow config.normalization "
                         f"({config.normalization!r}); set it there")
    if policy.enabled and policy.recipe.int8_swiglu_input and not (
            config.use_te_activation_func and config.gated_linear_unit and not config.num_moe_experts):
        raise ValueError("--int8-swiglu-input keeps the input of megatron_int8's SwiGLU module, which megatron runs "
                         "only in dense SwiGLU MLPs with config.use_te_activation_func (the trainer sets it unless "
                         "--no-fused-swiglu; upstream Megatron-LM: --use-te-activation-func); this model has none")
    normalization = normalization or config.normalization
    qk_layernorm = config.qk_layernorm if qk_layernorm is None else qk_layernorm
    specs = []
    for index, is_moe in enumerate(_moe_layer_pattern(config)):
        spec = get_gpt_int8_layer_spec(
            num_experts=config.num_moe_experts if is_moe else None,
            moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=qk_layernorm,
            normalization=normalization,
            qk_l2_norm=qk_l2_norm,
            recipe=policy.recipe,
            int8=policy.layer_in_int8(index, config.num_layers),
            fp8_recipe=policy.fp8_peer,
            fp8_compile=policy.fp8_compile,
        )
        if policy.bf16_modules:
            spec = _keep_in_bf16(spec, policy)
        specs.append(spec)
    return specs


def get_gpt_int8_block_spec(
    config: TransformerConfig,
    policy: Int8Policy,
    *,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
    normalization: Optional[str] = None,
    qk_layernorm: Optional[bool] = None,
    qk_l2_norm: bool = False,
) -> TransformerBlockSubmodules:
    """The decoder block of this pipeline stage (and virtual stage): like megatron's
    `get_gpt_decoder_block_spec`, with a per-layer precision policy and an explicit final norm.

    `normalization` / `qk_layernorm` default to the config's. With `policy.enabled=False` this is
    the BF16 baseline (same attention and norms); with `policy.fp8_peer` set, the FP8 peer
    (`Int8Policy(enabled=False, fp8_peer="tensorwise")`).
    """
    layer_specs = get_gpt_int8_layer_specs(config, policy, normalization=normalization,
                                           qk_layernorm=qk_layernorm, qk_l2_norm=qk_l2_norm)
    if config.pipeline_model_parallel_layout is not None:
        layout = config.pipeline_model_parallel_layout
        assert isinstance(layout, PipelineParallelLayerLayout)
        local_ids = layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank)
        local_specs = [layer_specs[i] for i in local_ids]
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        local_specs = layer_specs[offset: offset + count]
    final_norm = Int8SpecProvider().layer_norm(rms_norm=(normalization or config.normalization) == "RMSNorm")
    return TransformerBlockSubmodules(layer_specs=local_specs, layer_norm=final_norm)
