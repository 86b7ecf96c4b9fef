#!/usr/bin/env python3
"""Run a Python module with this process's CUDA memory capped, so that a smaller card is emulated on a larger one.

    python3 benchmarks/memory_cap.py GIB MODULE [ARGS...]     # e.g. 79 megatron_int8.pretrain --config ...

`torch.cuda.set_per_process_memory_fraction(GIB GiB / the device's memory)` on this process's device (LOCAL_RANK
under torchrun, else the current one) before anything is allocated, then MODULE runs as `python3 -m MODULE ARGS`
would. PyTorch's caching allocator then refuses (out of memory) any allocation that would take its reserved memory
past GIB: 79 GiB is what an 80 GB card (H100 / A100 80GB) leaves a process. bench_e2e.py --memory-cap-gib uses it.
"""
from __future__ import annotations

import os
import runpy
import sys

GIB = 1024 ** 3


def cap_fraction(cap_gib: float, total_bytes: int) -> float:
    """The fraction of a device of `total_bytes` that leaves `cap_gib` GiB; the cap must fit the device."""
    if not 0 < cap_gib * GIB <= total_bytes:
        raise ValueError(f"a cap of {cap_gib} GiB does not fit a device of {total_bytes / GIB:.1f} GiB")
    return cap_gib * GIB / total_bytes


def apply_cap(cap_gib: float) -> float:
    """Cap this process's CUDA allocations on its device at `cap_gib` GiB; returns the fraction set."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("memory_cap.py: no CUDA device to cap")
    device = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
    fraction = cap_fraction(cap_gib, torch.cuda.get_device_properties(device).total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    print(f"memory_cap.py: CUDA allocations on device {device} capped at {cap_gib} GiB ({fraction:.4f} of it)",
          flush=True)
    return fraction


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        raise SystemExit(__doc__)
    cap_gib, module, args = float(argv[0]), argv[1], argv[2:]
    apply_cap(cap_gib)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
