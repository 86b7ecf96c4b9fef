"""The backend object a recipe runs with on a device: the PyTorch reference or the Triton kernels."""
from __future__ import annotations

import functools

import torch

from ..dispatch import resolve_backend_name, triton_installed, triton_runs_on
from ..recipe import Int8Recipe
from ..reference import ReferenceBackend

__all__ = ["backend_instance", "get_backend", "quantize_kwargs", "triton_available", "triton_runs_on"]


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """triton is installed and this package's kernels import with it."""
    if not triton_installed():
        return False
    try:
        from .. import kernels  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def backend_instance(name: str):
    """The eager backend object named `name` ("reference" or "triton"), one per process."""
    if name == "reference":
        return ReferenceBackend()
    if not triton_available():
        raise ImportError("INT8 backend 'triton' requested but megatron_int8.kernels does not import")
    from ..kernels import TritonBackend

    return TritonBackend()


def get_backend(device: torch.device, recipe: Int8Recipe):
    """The backend `recipe` runs with on `device` (under torch.compile: library.traced_backend)."""
    return backend_instance(resolve_backend_name(device, recipe, triton_available()))


@functools.lru_cache(maxsize=None)  # recipes are frozen and few: one dict each, shared (callers never mutate it)
def quantize_kwargs(recipe: Int8Recipe, name: str, stochastic: bool = False, weight: bool = False) -> dict:
    """backend.quantize's keywords for an operand (`name` appears in non-finite errors) under a recipe."""
    return dict(granularity=recipe.granularity, block_size=recipe.block_size, weight=weight,
                stochastic=stochastic, name=name, check_finite=recipe.check_finite)
