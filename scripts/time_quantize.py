#!/usr/bin/env python3
"""Quick GPU timing of the tensorwise quantize kernels on one activation shape (median us, % of copy)."""
import sys

import torch
import triton.testing

from megatron_int8.kernels import triton_quantize


def main(rows=8192, cols=4096):
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    copy_us = triton.testing.do_bench(lambda: x.clone(), return_mode="median") * 1e3
    print(f"{rows}x{cols} bf16: device-to-device copy {copy_us:.0f} us")
    for label, kw in (("quantize", dict(rowwise=True, columnwise=False)),
                      ("quantize+transpose", dict(rowwise=True, columnwise=True))):
        us = triton.testing.do_bench(lambda: triton_quantize(x, granularity="tensor", block_size=128, weight=False,
                                                             check_finite="off", **kw), return_mode="median") * 1e3
        minimal = x.numel() * (2 + (2 if kw["columnwise"] else 1))
        print(f"  {label:20s} {us:6.0f} us  {minimal / us / 1e3:6.0f} GB/s (minimal bytes)  "
              f"{copy_us * minimal / (4 * x.numel()) / us:.0%} of copy")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:3]))
