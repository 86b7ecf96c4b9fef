"""Which implementation runs: every MEGATRON_INT8_* environment variable, validated in one place.

Each variable has a fixed set of values and a default; a value outside the set raises ValueError naming
the variable, where the choice is read (at the first use of what it selects), so a typo never silently
falls back to a default.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from .recipe import BACKENDS, Int8Recipe

ENV_BACKEND = "MEGATRON_INT8_BACKEND"  # overrides Int8Recipe.backend
ENV_GEMM_KERNEL = "MEGATRON_INT8_GEMM_KERNEL"  # Hopper CUDA GEMM vs Triton's (docs/kernels.md)
ENV_GEMM_AUTOTUNE = "MEGATRON_INT8_GEMM_AUTOTUNE"  # "0": one fixed tile per GEMM, no tuning
ENV_GEMM_TMA_VARIANT = "MEGATRON_INT8_GEMM_TMA_VARIANT"  # the Triton TMA kernel's fixed configuration
ENV_NORM_KERNEL = "MEGATRON_INT8_NORM_KERNEL"  # the RMSNorm's CUDA implementation
ENV_DIRECT_LAUNCH = "MEGATRON_INT8_DIRECT_LAUNCH"  # "0": launch Triton kernels through triton's own path
ENV_DISTOPT_FORMAT = "MEGATRON_INT8_DISTOPT_FORMAT"  # the distributed optimizer's checkpoint format
ENV_SHAPE_POLICY = "MEGATRON_INT8_SHAPE_POLICY"  # overrides Int8Recipe.shape_policy ("recipe": no override)
ENV_BUILD_CACHE = "MEGATRON_INT8_CACHE"  # where nvcc's build of the CUDA GEMM is kept (a path)

CHOICES = {
    ENV_BACKEND: BACKENDS,
    # "auto": time the candidates once per shape (the CUDA sm_90a kernel where it applies, Triton's plain
    # and TMA kernels); "cuda": the CUDA kernel (an error where it does not apply); "plain"/"tma": that one
    ENV_GEMM_KERNEL: ("auto", "cuda", "plain", "tma"),
    ENV_GEMM_AUTOTUNE: ("1", "0"),
    # kernels.int8_gemm.TMA_VARIANTS: "base" keeps the TMA kernel's tuned list and its fixed tile; another name
    # is one fixed configuration wherever the TMA kernel runs (untuned launches, tma, and auto's TMA candidate).
    # Default "auto": duo, and the warp-specialized Gluon kernel where K > 4096 (the fastest pair on
    # bench_triton_gemm's 42 GEMMs, docs/kernels.md); "ws": the Gluon kernel wherever it applies
    ENV_GEMM_TMA_VARIANT: ("auto", "ws", "duo", "base", "flat", "s4", "w16", "duo8"),
    ENV_NORM_KERNEL: ("auto", "torch", "triton"),
    ENV_DIRECT_LAUNCH: ("1", "0"),
    ENV_DISTOPT_FORMAT: ("fully_reshardable", "dp_reshardable"),
    ENV_SHAPE_POLICY: ("recipe", "int8", "auto"),
}


def env_choice(name: str) -> str:
    """The value of MEGATRON_INT8_* variable `name` (its first choice when unset or empty)."""
    choices = CHOICES[name]
    value = os.environ.get(name, "").strip() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def env_flag(name: str) -> bool:
    """A "1"/"0" variable as a bool."""
    return env_choice(name) == "1"


def build_cache_dir(default: str) -> str:
    return os.environ.get(ENV_BUILD_CACHE) or default


# looked up once, at import (a module search, not an import): torch.compile traces the backend choice inside the
# linear's autograd.Function, where it cannot trace importlib, but reads a module constant
TRITON_FOUND = importlib.util.find_spec("triton") is not None


def triton_installed() -> bool:
    """triton is installed; whether this package's kernels import with it is ops.backend.triton_available's
    question (get_backend asks it before it hands out the Triton backend)."""
    return TRITON_FOUND


def triton_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend_name(device: torch.device, recipe: Int8Recipe, triton_usable: bool = None) -> str:
    """The backend a recipe runs with on a device; MEGATRON_INT8_BACKEND overrides the recipe. `triton_usable`:
    whether the Triton kernels import (default: whether triton is installed)."""
    usable = triton_installed() if triton_usable is None else triton_usable
    choice = os.environ.get(ENV_BACKEND, "").strip() or recipe.backend
    if choice not in BACKENDS:
        raise ValueError(f"{ENV_BACKEND}={choice!r}: expected one of {', '.join(BACKENDS)}")
    if choice == "auto":
        return "triton" if device.type == "cuda" and usable else "reference"
    if choice == "triton":
        if not usable:
            raise ImportError("INT8 backend 'triton' requested but triton is not importable")
        if not triton_runs_on(device):
            raise ValueError(f"INT8 backend 'triton' needs a CUDA tensor (or TRITON_INTERPRET=1), got {device}")
    return choice
