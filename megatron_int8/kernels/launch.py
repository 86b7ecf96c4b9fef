"""Launching compiled Triton kernels without `JITFunction.run`'s per-call work.

On every launch `JITFunction.run` binds the arguments, specializes each one (integer divisibility, pointer
alignment), formats a cache key string and checks the kernel's globals: tens of microseconds of Python,
nine times per INT8 linear fwd+bwd. Under tensor parallelism 4 the GPU waits for exactly that host time
(docs/history.md, 2026-11-21). A `LaunchCache` keeps the CompiledKernel that `JITFunction.run`
returned for one launch signature, and later launches with the same signature call it directly.

The signature is everything compilation depends on, or finer: the current device; what Triton
specializes each runtime argument on (`_arg_signature`: a tensor's dtype and 16-byte alignment, an
integer's being 1, its divisibility by 16 and its width); the keyword arguments (constexprs and launch
options) with their values. tests/training/test_launch.py checks `_arg_signature` against Triton's own
specialization on the installed version. A launch whose signature was not seen yet goes through
`JITFunction.run`, which compiles or finds the kernel as usual.

`DIRECT = False` (or MEGATRON_INT8_DIRECT_LAUNCH=0) sends every launch through `JITFunction.run`: for
A/B timing, and as an escape hatch should a Triton version change its CompiledKernel launch interface.
Under TRITON_INTERPRET=1 there is nothing compiled to call, so every launch goes through the interpreter.

`LaunchCache.prepare` goes one step further for call sites that repeat one launch many times (a quantize
or GEMM of one shape, every micro-batch): a `BoundLaunch` fixes the grid, the keywords and every argument
but the per-call ones (the tensors, marked `ARG`), so after its first launch a call builds no key at all.
Its owner's plan key must then fix what the signature holds for those tensors (dtype, 16-byte alignment).
"""
from __future__ import annotations

import collections
import functools
import os
from typing import Any, Dict, Tuple

import torch

from ..dispatch import ENV_DIRECT_LAUNCH, env_flag
from ..reference import cdiv  # noqa: F401  (the kernels' grids take it from here)

DIRECT = env_flag(ENV_DIRECT_LAUNCH)
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # read once: triton decides at import too
# a safety net: integers are keyed by class, not value, so signatures are few, but nothing else bounds them
MAX_SIGNATURES = 4096


def _arg_signature(value) -> Any:
    """What Triton (3.6) specializes a runtime argument on, or finer: a tensor's dtype and 16-byte
    alignment; an integer's being 1, its divisibility by 16 and its width (i32 / i64 / u64)."""
    kind = type(value)
    if kind is int:
        return value == 1, value % 16 == 0, -2**31 <= value < 2**31, value < 2**63
    if kind is bool:
        return bool, value
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, int):  # an int subclass (bool cannot be subclassed)
        return _arg_signature(int(value))
    if isinstance(value, float) or value is None:
        return type(value)
    raise TypeError(f"LaunchCache: unsupported kernel argument of type {type(value).__name__}")


@functools.lru_cache(maxsize=None)
def num_sms(device) -> int:
    """Multiprocessors of a CUDA device (a torch.device or an index): persistent grids are sized by it."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def capability(device: torch.device) -> tuple:
    """(major, minor) compute capability of a CUDA device: which GEMM kernels may run there."""
    return torch.cuda.get_device_capability(device)


def device_index(device: torch.device) -> int:
    """The index of a CUDA torch.device (the current device's for a bare "cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


def next_pow2(n: int) -> int:
    """The smallest power of two >= max(n, 1) (triton.next_power_of_2 without its call overhead)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def _grid3(grid: tuple) -> tuple:
    return grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1


class _PerCall:
    def __repr__(self) -> str:
        return "ARG"


ARG = _PerCall()  # marks a BoundLaunch argument that is passed on every call


class LaunchCache:
    """`cache.launch(grid, *args, **kwargs)` launches `kernel[grid](*args, **kwargs)`.

    `args` are the kernel's leading runtime arguments, positionally; `kwargs` name its constexprs and
    launch options (num_warps, num_stages). The keywords' order is part of the signature: call sites that
    order them differently get entries of their own, each correct."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._compiled: Dict[tuple, Tuple[Any, tuple]] = {}

    def launch(self, grid: tuple, *args, **kwargs) -> None:
        if not DIRECT or INTERPRETING:
            self.kernel[grid](*args, **kwargs)
            return
        (compiled, trailing), launched = self._entry(grid, args, kwargs)
        if not launched:
            compiled[_grid3(grid)](*args, *trailing)

    def _entry(self, grid: tuple, args, kwargs: dict) -> Tuple[Tuple[Any, tuple], bool]:
        """((compiled kernel, trailing parameter values) of this signature, launched): a new signature is
        launched here, once, through JITFunction.run (which compiles or finds the kernel)."""
        key = self._key(args, kwargs)
        entry = self._compiled.get(key)
        if entry is not None:
            return entry, False
        compiled = self.kernel[grid](*args, **kwargs)
        if len(self._compiled) >= MAX_SIGNATURES:
            self._compiled.clear()
        entry = self._compiled[key] = (compiled, self._trailing_values(len(args), kwargs))
        return entry, True

    def prepare(self, grid: tuple, template: tuple, **kwargs) -> "BoundLaunch":
        """A BoundLaunch of `kernel[grid](*template, **kwargs)` whose ARG entries are given per call."""
        return BoundLaunch(self, grid, template, kwargs)

    @staticmethod
    def _key(args, kwargs: dict) -> tuple:
        return torch.cuda.current_device(), tuple(map(_arg_signature, args)), tuple(kwargs.items())

    def _trailing_values(self, n_args: int, kwargs: dict) -> tuple:
        """The kernel's parameters after the positional ones, in order (keyword or default), as the
        compiled launcher takes every parameter, constexprs included. Called after the JIT launch with
        the same arguments succeeded, so none is missing."""
        return tuple(kwargs[p.name] if p.name in kwargs else p.default for p in self.kernel.params[n_args:])

    def __len__(self) -> int:
        return len(self._compiled)


class BoundLaunch:
    """`bound(*values)`: the prepared launch with its ARG entries replaced by `values`, in order.

    The first call launches through the LaunchCache (compiling, or finding the kernel of this signature);
    later calls go to that compiled kernel with no signature check (while DIRECT is on). So every call must
    pass values that Triton specializes like the first call's: tensors of the same dtypes and 16-byte
    alignment, integers that are `do_not_specialize` parameters (a random seed). Call sites hold one per
    plan key, and the key fixes exactly that."""

    __slots__ = ("_cache", "_grid", "_head", "_template", "_slots", "_kwargs", "_run")

    def __init__(self, cache: LaunchCache, grid: tuple, template: tuple, kwargs: dict):
        self._cache, self._grid, self._kwargs = cache, grid, kwargs
        self._head = tuple(template)
        self._template = list(template)  # + the kernel's trailing parameters once bound
        self._slots = tuple(i for i, v in enumerate(template) if v is ARG)
        self._run = None

    def __call__(self, *values) -> None:
        if len(values) != len(self._slots):
            raise TypeError(f"BoundLaunch: {len(self._slots)} per-call arguments expected, got {len(values)}")
        run = self._run  # read first: binding sets the template before the runner (autograd's thread)
        bound = run is not None and DIRECT
        args = list(self._template if bound else self._head)
        for i, v in zip(self._slots, values):
            args[i] = v
        if bound:
            run(*args)
            return
        if not DIRECT or INTERPRETING:  # switched off (also at runtime, for A/B timing) or interpreted
            self._cache.launch(self._grid, *args, **self._kwargs)
            return
        (compiled, trailing), launched = self._cache._entry(self._grid, args, self._kwargs)
        run = compiled[_grid3(self._grid)]
        if not launched:
            run(*args, *trailing)
        self._template = [*self._head, *trailing]
        self._run = run


class PlanCache:
    """Call plans by signature, the least recently used dropped beyond `size`: MoE experts make a new
    signature with almost every routing, while the dense layers' plans are used every micro-batch."""

    def __init__(self, size: int):
        self.size = size
        self._plans: "collections.OrderedDict[tuple, Any]" = collections.OrderedDict()

    def get(self, key: tuple):
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
        return plan

    def put(self, key: tuple, plan) -> None:
        self._plans[key] = plan
        if len(self._plans) > self.size:
            self._plans.popitem(last=False)

    def __len__(self) -> int:
        return len(self._plans)
