"""Which implementation runs: every MEGATRON_INT8_* environment variable, validated in one place.

Each variable has a fixed set of values and a default (the first). `import megatron_int8` checks every
MEGATRON_INT8_* variable set (validate_environment): a value outside its set, or a name this package does
not read, raises one ValueError naming the variable, the value and what is accepted, before any model is
built, on every device. Each variable is read again where its choice is made (env_choice), so a test that
sets one later is checked there too.

What a user needs each one for:
- MEGATRON_INT8_BACKEND: run the PyTorch reference where the Triton kernels would run (or the reverse),
  without editing the recipe in code: bisecting a numerical difference, or a Triton that does not work here.
- MEGATRON_INT8_GEMM_KERNEL: one GEMM route per architecture. "hopper": the Hopper kernels only, without
  timing them against the portable one (the CUDA sm_90a kernel where nvcc builds it, else Triton's TMA kernel
  and the Gluon kernel); it raises where no Hopper kernel takes a GEMM. "portable": the pointer kernel that
  every other GPU runs, the escape hatch should a Hopper kernel misbehave with a driver or Triton version.
  "auto" (the default): per shape, the fastest of the candidates that apply (docs/kernels.md, "Dispatch").
- MEGATRON_INT8_GEMM_AUTOTUNE: "0" launches one fixed tile per GEMM instead of tuning each new shape: a short
  run (the GPU test suite, a smoke test) does not spend minutes compiling and timing candidate tiles.
- MEGATRON_INT8_DIRECT_LAUNCH: "0" sends every Triton launch through triton's own JITFunction.run, the escape
  hatch should a Triton version change the compiled-kernel interface that kernels/launch.py calls directly.
- MEGATRON_INT8_NORM_KERNEL: "torch" keeps torch's RMSNorm kernels where the fused Triton one would run (the
  same escape hatch, for the norm); "triton" runs the Triton one at every width, to time one against the other
  (ops/rms_norm.py).
- MEGATRON_INT8_DISTOPT_FORMAT: the distributed optimizer's checkpoint format; "dp_reshardable" writes what an
  older reader, or one that must not reshard, expects (training/checkpoint.py).
- MEGATRON_INT8_SHAPE_POLICY: which linears run in INT8, overriding the recipe from a launch script.
- MEGATRON_INT8_CACHE: where nvcc's build of the CUDA GEMM is kept (a directory; default ~/.cache/megatron_int8),
  for a read-only home or a shared cache.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from .recipe import BACKENDS, Int8Recipe

ENV_BACKEND = "MEGATRON_INT8_BACKEND"  # overrides Int8Recipe.backend
ENV_GEMM_KERNEL = "MEGATRON_INT8_GEMM_KERNEL"  # the GEMM route (docs/kernels.md)
ENV_GEMM_AUTOTUNE = "MEGATRON_INT8_GEMM_AUTOTUNE"  # "0": one fixed tile per GEMM, no tuning
ENV_NORM_KERNEL = "MEGATRON_INT8_NORM_KERNEL"  # the RMSNorm's CUDA implementation
ENV_DIRECT_LAUNCH = "MEGATRON_INT8_DIRECT_LAUNCH"  # "0": launch Triton kernels through triton's own path
ENV_DISTOPT_FORMAT = "MEGATRON_INT8_DISTOPT_FORMAT"  # the distributed optimizer's checkpoint format
ENV_SHAPE_POLICY = "MEGATRON_INT8_SHAPE_POLICY"  # overrides Int8Recipe.shape_policy ("recipe": no override)
ENV_BUILD_CACHE = "MEGATRON_INT8_CACHE"  # where nvcc's build of the CUDA GEMM is kept (a path)
PREFIX = "MEGATRON_INT8_"

CHOICES = {
    ENV_BACKEND: BACKENDS,
    ENV_GEMM_KERNEL: ("auto", "hopper", "portable"),
    ENV_GEMM_AUTOTUNE: ("1", "0"),
    ENV_NORM_KERNEL: ("auto", "torch", "triton"),
    ENV_DIRECT_LAUNCH: ("1", "0"),
    ENV_DISTOPT_FORMAT: ("fully_reshardable", "dp_reshardable"),
    ENV_SHAPE_POLICY: ("recipe", "int8", "auto"),
}
# variables that earlier versions read, with what replaced them: a stale launch script fails with the fix
REMOVED = {
    "MEGATRON_INT8_GEMM_TMA_VARIANT": "the Triton TMA kernel has one configuration now (kernels/int8_gemm.TMA_TILE)",
}
RENAMED_GEMM_KERNELS = {"cuda": "hopper", "tma": "hopper", "plain": "portable"}


def _choice_problem(name: str, value: str):
    """Why `value` of variable `name` is refused, or None."""
    choices = CHOICES[name]
    if value in choices:
        return None
    hint = ""
    if name == ENV_GEMM_KERNEL and value in RENAMED_GEMM_KERNELS:
        hint = f" ({value!r} is now {RENAMED_GEMM_KERNELS[value]!r})"
    return f"{name}={value!r}: expected one of {', '.join(choices)}{hint}"


def env_choice(name: str) -> str:
    """The value of MEGATRON_INT8_* variable `name` (its first choice when unset or empty)."""
    value = os.environ.get(name, "").strip() or CHOICES[name][0]
    problem = _choice_problem(name, value)
    if problem:
        raise ValueError(problem)
    return value


def environment_problems(environ=None) -> list:
    """One line per MEGATRON_INT8_* variable in `environ` (default os.environ) that this package would refuse."""
    environ = os.environ if environ is None else environ
    problems = []
    for name in sorted(k for k in environ if k.startswith(PREFIX)):
        value = environ[name].strip()
        if name in CHOICES:
            problem = value and _choice_problem(name, value)
        elif name == ENV_BUILD_CACHE:
            problem = value and os.path.exists(value) and not os.path.isdir(value) and (
                f"{name}={value!r}: expected a directory (nvcc's build cache), found a file")
        elif name in REMOVED:
            problem = f"{name}={value!r}: no longer read: {REMOVED[name]}; unset it"
        else:
            known = ", ".join(sorted([*CHOICES, ENV_BUILD_CACHE]))
            problem = f"{name}={value!r}: not a variable of megatron_int8 (it reads {known})"
        if problem:
            problems.append(problem)
    return problems


def validate_environment(environ=None) -> None:
    """Raise one ValueError listing every MEGATRON_INT8_* variable that is set to something refused."""
    problems = environment_problems(environ)
    if problems:
        raise ValueError("megatron_int8: " + "; ".join(problems))


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
        raise ValueError(_choice_problem(ENV_BACKEND, choice))
    if choice == "auto":
        return "triton" if device.type == "cuda" and usable else "reference"
    if choice == "triton":
        if not usable:
            raise ImportError("INT8 backend 'triton' requested but " + (
                "triton is not installed" if triton_usable is None else "this package's Triton kernels do not import"))
        if not triton_runs_on(device):
            raise ValueError(f"INT8 backend 'triton' needs a CUDA tensor (or TRITON_INTERPRET=1), got {device}")
    return choice
