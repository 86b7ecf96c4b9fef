"""The backend object a recipe runs with on a device: the PyTorch reference or the Triton kernels."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..dispatch import ENV_BACKEND, resolve_backend_name, triton_installed, triton_runs_on
from ..recipe import Int8Recipe
from ..reference import ReferenceBackend

__all__ = ["backend_instance", "get_backend", "kernels_import_problem", "quantize_kwargs", "triton_available",
           "triton_runs_on"]


@functools.lru_cache(maxsize=None)
def kernels_import_problem() -> Optional[str]:
    """None where triton is installed and this package's kernels import with it, else what stops them."""
    if not triton_installed():
        return "triton is not installed"
    try:
        from .. import kernels  # noqa: F401
    except ImportError as error:
        import triton

        return f"megatron_int8.kernels does not import with triton {triton.__version__}: {error}"
    return None


def triton_available() -> bool:
    """triton is installed and this package's kernels import with it."""
    return kernels_import_problem() is None


_USE_REFERENCE = f"; {ENV_BACKEND}=reference (or Int8Recipe(backend='reference')) runs the PyTorch reference"


@functools.lru_cache(maxsize=None)
def backend_instance(name: str):
    """The eager backend object named `name` ("reference" or "triton"), one per process."""
    if name == "reference":
        return ReferenceBackend()
    if not triton_available():
        raise ImportError(f"INT8 backend 'triton': {kernels_import_problem()}{_USE_REFERENCE}")
    from ..kernels import TritonBackend

    return TritonBackend()


def get_backend(device: torch.device, recipe: Int8Recipe):
    """The backend `recipe` runs with on `device` (under torch.compile: library.traced_backend)."""
    try:
        name = resolve_backend_name(device, recipe, triton_available())
    except ImportError:  # 'triton' asked for where the kernels cannot run: say why
        raise ImportError(f"INT8 backend 'triton' requested: {kernels_import_problem()}{_USE_REFERENCE}") from None
    return backend_instance(name)


@functools.lru_cache(maxsize=None)  # recipes are frozen and few: one dict each, shared (callers never mutate it)
def quantize_kwargs(recipe: Int8Recipe, name: str, stochastic: bool = False, weight: bool = False) -> dict:
    """backend.quantize's keywords for an operand (`name` appears in non-finite errors) under a recipe."""
    return dict(granularity=recipe.granularity, block_size=recipe.block_size, weight=weight,
                stochastic=stochastic, name=name, check_finite=recipe.check_finite)
