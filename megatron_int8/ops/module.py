"""INT8 training for any PyTorch model: `Int8Linear` and `convert_to_int8_training`, after torchao's
`convert_to_float8_training`.

`convert_to_int8_training(model)` swaps, in place, every `nn.Linear` the filter accepts for an `Int8Linear`
that holds the *same* Parameter objects: parameter names, state-dict keys and an optimizer built before or
after the conversion are all unchanged. `Int8Linear.forward` is `int8_linear`, so it runs eager,
CUDA-graphed and under torch.compile(fullgraph=True) (ops/library.py).

Default filter (`keep_high_precision`): embeddings are not nn.Linear and stay as they are; the output head
stays high precision, recognised as a linear whose weight is an nn.Embedding's (tied), or whose name ends in
one of OUTPUT_HEAD_NAMES (lm_head, output, output_layer), or the last linear whose out_features is an
embedding's vocabulary size; linears with a dimension that is not a multiple of 16 stay too (the GEMM kernels'
alignment; e.g. an MoE router with 8 experts). A `module_filter_fn(module, fqn) -> bool` replaces the
default (True: convert); combine it with `keep_high_precision` to keep the head rule.

A linear converted already takes the recipe of a later call that selects it. Weight edits through `.data` outside a
torch.optim optimizer are not seen by the weight cache (ops/weight_cache.py): invalidate_weight_caches() after them.
Activation checkpointing (torch.utils.checkpoint, reentrant or not) works.

Data parallelism: DDP works unchanged (the linears' parameters are ordinary Parameters). FSDP2
(`fully_shard`) works: int8_linear sees the unsharded weight FSDP2 all-gathers for the forward and again
for the backward; the weight cache then re-quantizes in backward wherever the all-gathered storage moved
(correct, one extra weight quantization). The cache keeps each weight's INT8 copies (2 bytes per parameter
of the *unsharded* weight) between steps, which undoes part of what FSDP2 saves: under FSDP2 prefer
`Int8Recipe(cache_weights=False)` (each weight is then quantized in forward and again in backward). Not
supported: DTensor weights in the linear itself (tensor
parallelism through DTensor / `parallelize_module`): Int8Linear raises a TypeError for them.
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
from torch import nn

from ..recipe import DEFAULT_RECIPE, Int8Recipe
from .linear import int8_linear
from .shape_policy import describe_precision

__all__ = ["Int8Linear", "OUTPUT_HEAD_NAMES", "convert_to_int8_training", "keep_high_precision"]

OUTPUT_HEAD_NAMES = ("lm_head", "output", "output_layer")
ALIGNMENT = 16


class Int8Linear(nn.Linear):
    """nn.Linear whose three GEMMs run in INT8 (`int8_linear`), with nn.Linear's parameters and state dict."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 recipe: Optional[Int8Recipe] = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = _checked(recipe)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Optional[Int8Recipe] = None) -> "Int8Linear":
        """An Int8Linear sharing `linear`'s Parameter objects (and its hooks: the module is re-classed, not
        copied, so nothing registered on it is lost)."""
        if type(linear) is not nn.Linear:
            raise TypeError(f"Int8Linear.from_linear needs an nn.Linear, got {type(linear).__name__}")
        recipe = _checked(recipe)
        linear.__class__ = cls
        linear.recipe = recipe
        return linear

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _is_dtensor(self.weight):
            raise TypeError("Int8Linear: DTensor weights (tensor parallelism through DTensor) are not supported; "
                            "FSDP2 (fully_shard) hands the linear unsharded weights and works")
        return int8_linear(input, self.weight, self.bias, self.recipe)

    @property
    def precision(self) -> str:
        """"int8", or under shape_policy "auto" what was measured for this weight's shape so far."""
        return describe_precision(self.recipe, self.weight)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.describe()}, precision={self.precision}"


def _checked(recipe: Optional[Int8Recipe]) -> Int8Recipe:
    if recipe is not None and not isinstance(recipe, Int8Recipe):
        raise TypeError(f"recipe must be an Int8Recipe, got {type(recipe).__name__}")
    return recipe or DEFAULT_RECIPE


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def keep_high_precision(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """The default filter for `model`: True for the linears to convert (see the module docstring)."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    tied = {id(e.weight) for e in embeddings}
    vocab_sizes = {e.num_embeddings for e in embeddings}
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    vocab_heads = [name for name, m in linears if m.out_features in vocab_sizes]
    last_vocab_head = vocab_heads[-1] if vocab_heads else None

    def accept(module: nn.Module, fqn: str) -> bool:
        if id(module.weight) in tied or fqn.rsplit(".", 1)[-1] in OUTPUT_HEAD_NAMES or fqn == last_vocab_head:
            return False
        return module.in_features % ALIGNMENT == 0 and module.out_features % ALIGNMENT == 0

    return accept


def convert_to_int8_training(model: nn.Module, recipe: Optional[Int8Recipe] = None,
                             module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None) -> nn.Module:
    """Swap `model`'s nn.Linear modules for Int8Linear in place (same Parameters); returns `model`. Subclasses
    of nn.Linear keep their own forward and stay as they are, named in a warning.

    `module_filter_fn(module, fqn)`: True converts that linear; None uses `keep_high_precision(model)`.
    Call it before wrapping the model in DDP / FSDP2 and before torch.compile."""
    recipe = _checked(recipe)
    if recipe.int8_attention:
        raise ValueError("convert_to_int8_training converts linears only: recipe.int8_attention=True would be ignored; "
                         "call megatron_int8.ops.int8_attention.int8_attention from the model's attention, or use "
                         "the megatron-core specs (--int8-attention)")
    others = [name for name in ("int8_swiglu_input", "int8_norm_input") if getattr(recipe, name)]
    if others:
        raise ValueError(f"convert_to_int8_training converts linears only: recipe.{' and '.join(others)}=True would be "
                         "ignored (they keep the SwiGLU's or the norms' inputs in INT8 in the megatron-core specs: "
                         "--int8-swiglu-input, --int8-norm-input)")
    accept = module_filter_fn if module_filter_fn is not None else keep_high_precision(model)
    if isinstance(model, nn.Linear):
        raise TypeError("convert_to_int8_training converts a model's linears; for one nn.Linear use "
                        "Int8Linear.from_linear")
    subclasses = []
    for fqn, module in list(model.named_modules()):
        if type(module) is nn.Linear and accept(module, fqn):
            Int8Linear.from_linear(module, recipe)
        elif isinstance(module, Int8Linear) and accept(module, fqn):  # converted before: this call's recipe now
            module.recipe = recipe
        elif isinstance(module, nn.Linear) and accept(module, fqn):
            subclasses.append(f"{fqn} ({type(module).__name__})")
    if subclasses:  # re-classing one would replace its own forward; skipping it unnamed looked like a conversion
        warnings.warn(f"convert_to_int8_training left {len(subclasses)} subclass(es) of nn.Linear in high precision, "
                      f"since converting would drop their own forward: {', '.join(subclasses[:5])}"
                      f"{', ...' if len(subclasses) > 5 else ''}; call int8_linear in their forward to make them INT8",
                      stacklevel=2)
    return model
