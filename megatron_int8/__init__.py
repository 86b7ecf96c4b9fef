"""megatron-int8: INT8 linear layers for pretraining LLMs with megatron-core.

The core (recipe, quantization, the INT8 autograd linear) imports without megatron-core or triton;
the megatron-core layers and specs live in `megatron_int8.megatron.layers` / `megatron_int8.megatron.spec`.
"""
from .dispatch import validate_environment

validate_environment()  # every MEGATRON_INT8_* variable, before anything is built (dispatch.py)

from .ops.linear import TPOptions, int8_linear, invalidate_weight_caches  # noqa: E402
from .ops.module import Int8Linear, convert_to_int8_training  # noqa: E402
from .reference import NonFiniteError, QTensor, dequantize, quantize, raise_if_nonfinite  # noqa: E402
from .recipe import DEFAULT_RECIPE, Int8Recipe  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_RECIPE",
    "Int8Linear",
    "Int8Recipe",
    "NonFiniteError",
    "QTensor",
    "TPOptions",
    "convert_to_int8_training",
    "dequantize",
    "int8_linear",
    "invalidate_weight_caches",
    "quantize",
    "raise_if_nonfinite",
]
