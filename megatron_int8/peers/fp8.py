"""FP8 peer for the INT8-vs-BF16 benchmarks: megatron-core linears whose GEMMs run through torchao float8.

`Fp8ColumnParallelLinear` / `Fp8RowParallelLinear` change only `_forward_impl`, as the INT8 layers in
`layers.py` do: weight allocation and init, `gather_output`, `skip_bias_add`, expert flags and the
(sharded) state dict stay megatron's, so parameter names and checkpoints equal the BF16 layers'.
The local GEMM is torchao's `matmul_with_hp_or_float8_args` (what `torchao.float8.Float8Linear` runs):
dynamic scaling of input, weight and output gradient on every call, and fprop, dgrad and wgrad as
`torch._scaled_mm` FP8 GEMMs; activations are saved for backward in high precision (as torchao does).

Recipes (torchao's `Float8LinearConfig.from_recipe_name`):
  tensorwise  (the default `Float8LinearConfig()`): one scale per tensor; e4m3 for input and weight,
              e5m2 for the output gradient; fast accumulation in fprop.
  rowwise     one scale per row along the contraction axis, rounded down to a power of two; e4m3 for
              all three operands.

Scope: a one-GPU benchmark peer. Tensor-parallel size 1 only (TP>1 or sequence parallelism raise a
ValueError when the layer is built); expert linears (Mixtral's SequentialMLP) are supported with
expert-TP 1: their varying token counts are zero-padded to the multiple of 16 that `_scaled_mm` needs in
the wgrad contraction, and an expert that gets no token runs a plain (empty) linear.

Gradients: the weight gets an ordinary `weight.grad`, for any `gradient_accumulation_fusion` setting
(the flag is accepted without apex, and ignored). The layer never touches `main_grad` nor sets
`grad_added_to_main_grad`, so megatron's DDP backward hook adds `weight.grad` to `main_grad` exactly
once per micro-batch.

torchao is imported when the first layer is built (ImportError naming the fix if it is missing);
FP8 GEMMs need a CUDA GPU of compute capability >= 8.9 (RuntimeError otherwise). `emulate=True` runs
torchao's emulation instead (dequantize, then an fp32 matmul): any device, for tests, never for timing.
`compile=True` wraps each dense layer's cast + GEMM in `torch.compile` (fuses the casts, as torchao
recommends for speed; static shapes, one compilation per distinct linear shape, shared by the layers);
expert layers stay eager (their token counts change every step).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.utils import get_pg_size

from ..megatron.compat import check_linear_gemm_options
from ..megatron.layers import config_without_apex_check
from ..megatron.policy import FP8_RECIPES
from ..megatron.spec import register_peer_linears

MIN_COMPUTE_CAPABILITY = (8, 9)
TORCHAO_TESTED = "0.18.0"
_ALIGN = 16  # torch._scaled_mm: both dims of the second operand and the contraction dim multiples of 16


class _Torchao:
    """The torchao float8 pieces this module uses (resolved once, on first use)."""

    def __init__(self):
        try:
            from torchao.float8.config import Float8LinearConfig
            from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
            from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
        except ImportError as err:
            raise ImportError(
                "the FP8 peer (--fp8-peer, megatron_int8.peers.fp8) runs its GEMMs through torchao's float8 "
                f"training and needs torchao (tested with torchao=={TORCHAO_TESTED}): "
                f"pip install torchao=={TORCHAO_TESTED}  [import failed: {err}]") from err
        self.Float8LinearConfig = Float8LinearConfig
        self.matmul = matmul_with_hp_or_float8_args
        self.LinearMMConfig = LinearMMConfig
        self.ScaledMMConfig = ScaledMMConfig


@functools.lru_cache(maxsize=None)
def torchao_float8() -> _Torchao:
    """torchao's float8 API; raises ImportError with the install command when torchao is missing."""
    return _Torchao()


def check_fp8_device(device: Optional[torch.device] = None) -> None:
    """Raise RuntimeError unless `device` (default: the current CUDA device) can run FP8 GEMMs."""
    if not torch.cuda.is_available():
        raise RuntimeError("the FP8 peer needs a CUDA GPU of compute capability >= 8.9 (Ada, Hopper or newer) "
                           "for torch._scaled_mm; CUDA is not available here")
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_COMPUTE_CAPABILITY:
        raise RuntimeError(
            f"the FP8 peer needs compute capability >= 8.9 (Ada, Hopper or newer); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")


def fp8_unavailable_reason() -> Optional[str]:
    """Why FP8 peer layers cannot run here (missing torchao, no suitable GPU), or None if they can."""
    try:
        torchao_float8()
        check_fp8_device()
    except (ImportError, RuntimeError) as err:
        return str(err)
    return None


@functools.lru_cache(maxsize=None)
def _configs(recipe: str, emulate: bool):
    """torchao's config for `recipe` and its per-GEMM matmul configs, unpadded and padded (shared by all layers)."""
    ao = torchao_float8()
    config = ao.Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)

    def mm_configs(pad: bool):
        return ao.LinearMMConfig(*(
            ao.ScaledMMConfig(emulate, gemm.use_fast_accum, False, pad)
            for gemm in (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)))

    return config, {False: mm_configs(False), True: mm_configs(True)}


@functools.lru_cache(maxsize=None)
def _matmul_fn(recipe: str, emulate: bool, pad: bool, compiled: bool):
    """`f(input, weight) = input @ weight.T` through torchao float8 (one function per variant, so that a
    compiled one is shared by every layer of the model)."""
    ao = torchao_float8()
    config, mm = _configs(recipe, emulate)
    mm_config, matmul = mm[pad], ao.matmul

    def fp8_matmul(input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return matmul.apply(input, weight.t(), mm_config, config)

    return torch.compile(fp8_matmul, dynamic=False) if compiled else fp8_matmul


def _check_scope(cls_name: str, config, is_expert: bool, kwargs) -> None:
    """The FP8 peer is a TP=1 layer: reject what it does not implement before any weight is allocated."""
    tp = config.tensor_model_parallel_size
    if is_expert and config.expert_tensor_parallel_size is not None:
        tp = config.expert_tensor_parallel_size
    if tp > 1:
        raise ValueError(f"{cls_name}: the FP8 peer supports tensor-parallel size 1 only, got "
                         f"{'expert_' if is_expert else ''}tensor_parallel_size {tp}")
    if config.sequence_parallel:
        raise ValueError(f"{cls_name}: the FP8 peer does not support sequence parallelism (it runs at TP=1)")
    if config.defer_embedding_wgrad_compute or kwargs.get("grad_output_buffer") is not None \
            or kwargs.get("embedding_activation_buffer") is not None:
        raise NotImplementedError(f"{cls_name}: defer_embedding_wgrad_compute (grad_output_buffer) is not supported")


class Fp8LinearMixin:
    """torchao float8 construction checks and `_forward_impl`, shared by the column- and row-parallel
    layers (listed before the megatron base class, whose __init__ follows in the MRO)."""

    fp8_recipe: str
    fp8_emulate: bool
    fp8_compile: bool

    def __init__(self, input_size: int, output_size: int, *, config, init_method, fp8_recipe: str = "tensorwise",
                 emulate: bool = False, compile: bool = False, **kwargs):
        _validate_recipe(type(self).__name__, fp8_recipe)
        _check_scope(type(self).__name__, config, kwargs.get("is_expert", False), kwargs)
        torchao_float8()
        if not emulate:
            check_fp8_device()
        super().__init__(input_size, output_size, config=config_without_apex_check(config),
                         init_method=init_method, **kwargs)
        self._finish_fp8_init(config, fp8_recipe, emulate, compile)

    def _finish_fp8_init(self, config, fp8_recipe: str, emulate: bool, compile: bool) -> None:
        name = type(self).__name__
        if get_pg_size(self.tp_group) > 1:  # e.g. an expert-TP group wider than the config says
            raise ValueError(f"{name}: the FP8 peer supports tensor-parallel size 1 only, "
                             f"got a TP group of {get_pg_size(self.tp_group)}")
        self.config = config
        # Kept for megatron's forward (which passes it back to _forward_impl); the FP8 GEMM always
        # returns weight.grad, which megatron's DDP hook adds to main_grad.
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.fp8_recipe = fp8_recipe
        self.fp8_emulate = bool(emulate)
        self.fp8_compile = bool(compile) and not getattr(self, "is_expert", False)
        if not emulate:
            sizes = {"input": self.weight.shape[1], "output": self.weight.shape[0]} if self.weight is not None else {}
            odd = {k: v for k, v in sizes.items() if v % _ALIGN}
            if odd:
                raise ValueError(f"{name}: torch._scaled_mm needs {_ALIGN}-aligned feature sizes, got {odd}")

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
        """`newer_options`: keywords that later megatron-core versions pass (compat.LINEAR_GEMM_OPTIONS, e.g. 0.19's
        gtp_remat_size), each taken only at its "off" value, as the INT8 layers do."""
        # gradient_accumulation_fusion is ignored on purpose (module docstring): weight.grad, never main_grad.
        name = type(self).__name__
        check_linear_gemm_options(name, newer_options)
        if grad_output_buffer is not None:
            raise NotImplementedError(f"{name}: grad_output_buffer (deferred wgrad) is not supported")
        if allreduce_dgrad or sequence_parallel:
            raise ValueError(f"{name}: the FP8 peer runs at tensor-parallel size 1 only")
        if not self.fp8_emulate and input.device.type != "cuda":
            raise RuntimeError(f"{name}: FP8 GEMMs run on CUDA; got an input on {input.device} "
                               "(emulate=True runs torchao's emulation on other devices)")
        tokens = input.numel() // max(input.shape[-1], 1)
        if tokens == 0:  # an expert that got no token: amax of an empty tensor is undefined
            output = F.linear(input, weight)
        else:
            pad = tokens % _ALIGN != 0  # the wgrad contraction runs over tokens
            output = _matmul_fn(self.fp8_recipe, self.fp8_emulate, pad, self.fp8_compile and not pad)(input, weight)
        if bias is not None:
            output = output + bias.to(output.dtype)
        return output


def _validate_recipe(cls_name: str, fp8_recipe: str) -> None:
    if fp8_recipe not in FP8_RECIPES:
        raise ValueError(f"{cls_name}: fp8_recipe must be one of {FP8_RECIPES}, got {fp8_recipe!r}")


class Fp8ColumnParallelLinear(Fp8LinearMixin, ColumnParallelLinear):
    """ColumnParallelLinear whose GEMMs run in FP8 through torchao. Extra keywords: `fp8_recipe`
    ('tensorwise' or 'rowwise'), `emulate` (tests), `compile`."""


class Fp8RowParallelLinear(Fp8LinearMixin, RowParallelLinear):
    """RowParallelLinear whose GEMMs run in FP8 through torchao. Extra keywords: `fp8_recipe`
    ('tensorwise' or 'rowwise'), `emulate` (tests), `compile`."""


register_peer_linears("fp8", Fp8ColumnParallelLinear, Fp8RowParallelLinear)
