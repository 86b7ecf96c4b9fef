"""Loading a checkpoint without running code from it.

A pickle can name any importable callable, which the unpickler then calls: a checkpoint from someone else
could run arbitrary code at `--load`. Every file of a checkpoint is therefore read through an allowlist:

  common.pt, rng/*.pt, the shards' tensors  torch.load(weights_only=True): tensors, plain Python values,
                                            and the types torch.serialization.add_safe_globals allows
                                            (here argparse.Namespace, the form of the saved arguments that
                                            upstream Megatron-LM reads)
  .metadata (torch.distributed.checkpoint)  plain pickle inside torch: checked first by an unpickler that
                                            resolves only torch.distributed.checkpoint's own record types,
                                            torch.Size, dtypes and layouts
  byte objects of the shards                torch loads them with weights_only=False; forced to True
                                            (TORCH_FORCE_WEIGHTS_ONLY_LOAD) while a checkpoint loads
"""
from __future__ import annotations

import argparse
import contextlib
import enum
import os
import pickle

import numpy as np
import torch

torch.serialization.add_safe_globals([argparse.Namespace])

# torch.distributed.checkpoint's record types: dataclasses and enums that only hold values
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem")
_TORCH_NAMES = {"Size", "device"}
_OTHER_GLOBALS = {("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("builtins", "set"),
                  ("builtins", "frozenset"), ("builtins", "slice")}
# numpy arrays as numpy pickles them: checkpoints of this package before the RNG state was stored as tensors
_NUMPY_ARRAY_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32)),
                        getattr(np, "_core", getattr(np, "core", None)).multiarray._reconstruct]


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file holds an object outside the allowlist."""


def _record_enum_member(owner, name: str):
    """`builtins.getattr` as some Python 3.11 releases pickle an enum member (`getattr(EnumClass, 'NAME')`, e.g.
    torch's `_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT` in every `.metadata`), allowed for the members of the
    record enums alone. (The pickle cannot have changed those members: BUILD on a class or a member is refused.)"""
    if isinstance(owner, enum.EnumMeta) and owner.__module__ in _DCP_MODULES and name in owner.__members__:
        return owner.__members__[name]
    raise UnsafeCheckpointError(f"builtins.getattr({getattr(owner, '__qualname__', type(owner).__name__)}, {name!r})")


class _RecordUnpickler(pickle._Unpickler):
    """The pure-Python unpickler, so that BUILD can be checked: a BUILD sets attributes on its target, and on a
    class or an enum member (objects the file did not create) it would change them for the load that follows
    this check (torch's own pickle.load), which could then reach other objects than the ones checked here."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def _load_build(self):
        target = self.stack[-2]
        if isinstance(target, (type, enum.Enum)):
            raise UnsafeCheckpointError(f"a BUILD that sets attributes on {getattr(target, '__qualname__', target)!r}")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build

    def find_class(self, module: str, name: str):
        value = None
        if (module, name) == ("builtins", "getattr"):
            value = _record_enum_member
        elif module in _DCP_MODULES:
            candidate = getattr(__import__(module, fromlist=[name]), name, None)
            # classes defined there only (no functions, nor what the module imports, e.g. pathlib.Path)
            if isinstance(candidate, type) and candidate.__module__ == module:
                value = candidate
        elif module == "torch" and (name in _TORCH_NAMES or isinstance(getattr(torch, name, None),
                                                                      (torch.dtype, torch.layout, torch.memory_format))):
            value = getattr(torch, name)
        elif (module, name) in _OTHER_GLOBALS:
            value = super().find_class(module, name)
        if value is None:
            raise UnsafeCheckpointError(f"{module}.{name}")
        return value


def check_dcp_metadata(directory: str) -> None:
    """Refuse a torch.distributed.checkpoint `.metadata` file that names anything but its record types."""
    path = os.path.join(directory, ".metadata")
    if not os.path.isfile(path):
        return  # megatron's loader names the missing file itself
    with open(path, "rb") as f:
        try:
            _RecordUnpickler(f).load()
        except UnsafeCheckpointError as err:
            raise UnsafeCheckpointError(
                f"{path} refers to {err}, which is not a checkpoint record type: refusing to load it (unpickling "
                "would run code the file names). Load only checkpoints you trust to come from this trainer.") from None


@contextlib.contextmanager
def weights_only_loading(directory: str):
    """While a checkpoint loads: its metadata checked, and every torch.load inside weights_only."""
    check_dcp_metadata(directory)
    saved = {name: os.environ.get(name) for name in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD",
                                                      "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    try:
        yield
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(f"{directory}: a file of this checkpoint holds an object outside the allowlist "
                                    f"of tensors and plain values; refusing to load it ({err})") from None
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def load_tensors_file(path: str, allow_numpy_arrays: bool = False):
    """torch.load with weights_only=True, failing with the file's name; numpy arrays only on request."""
    context = (torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS) if allow_numpy_arrays
               else contextlib.nullcontext())
    try:
        with context:
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(f"{path} holds an object outside the allowlist of tensors and plain values: "
                                    f"refusing to load it ({str(err).splitlines()[0]})") from None
