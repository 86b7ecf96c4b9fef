"""Let megatron-core's optimizer stack run on a CPU-only torch build.

`get_megatron_optimizer`, the distributed optimizer, gradient clipping, the grad scaler and the
pipeline schedules create tensors with a hard-coded `device="cuda"` and check parameter types
against `"torch.cuda.FloatTensor"`. On a machine without CUDA this trainer therefore rewrites those
literals to their CPU equivalents while the few affected megatron modules are imported, so CI runs
the same optimizer, clipping and checkpoint code as a GPU run (`megatron_int8.megatron.compat` covers the
model side). It must be installed before anything imports megatron, and does nothing with CUDA.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import re
import sys

import torch

REWRITTEN_MODULES = frozenset({
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",
    "megatron.core.pipeline_parallel.schedules",
})
_REWRITES = [
    (re.compile(r"""device=(['"])cuda\1"""), "device='cpu'"),
    (re.compile(r"""(['"])torch\.cuda\.(FloatTensor|HalfTensor|BFloat16Tensor)\1"""), r"'torch.\2'"),
    (re.compile(r"""\.cuda\(torch\.cuda\.current_device\(\)\)"""), ".cpu()"),
    (re.compile(r"""\.cuda\(\)"""), ".cpu()"),
]


class _CpuSourceLoader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname):
        source = self.get_data(self.path).decode("utf-8")
        for pattern, replacement in _REWRITES:
            source = pattern.sub(replacement, source)
        return compile(source, self.path, "exec", dont_inherit=True)


class _CpuRewriteFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in REWRITTEN_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.origin and spec.origin.endswith(".py"):
                    spec.loader = _CpuSourceLoader(fullname, spec.origin)
                return spec
        return None


def install_cpu_optimizer_support() -> bool:
    """Install the rewrite on a CPU-only machine; returns whether it is active.

    Raises if megatron's optimizer modules were already imported unrewritten (call it first).
    """
    if torch.cuda.is_available():
        return False
    if any(isinstance(f, _CpuRewriteFinder) for f in sys.meta_path):
        return True
    already = sorted(m for m in REWRITTEN_MODULES if m in sys.modules)
    if already:
        raise RuntimeError(f"install_cpu_optimizer_support() must run before megatron is imported; "
                           f"already imported: {already}")
    sys.meta_path.insert(0, _CpuRewriteFinder())
    return True


def training_device() -> torch.device:
    """The device this process trains on: its current CUDA device, or the CPU on a CPU-only build."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
