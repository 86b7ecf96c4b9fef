#!/usr/bin/env python3
"""Quick GPU timing of the tensorwise and row-wise quantize kernels on one activation shape: median us and
% of a device-to-device copy (minimal-bytes model: read x once, write each int8 output once), as a
markdown table. `--compare FILE` also times another version of megatron_int8/kernels/quantize.py (e.g.
`git show HEAD~1:megatron_int8/kernels/quantize.py > /tmp/prev.py`) in the same process, for an A/B.

    python scripts/time_quantize.py --rows 8192 --cols 4096 --compare /tmp/prev.py
"""
import argparse
import importlib.util

import torch
import triton.testing

from megatron_int8.kernels import triton_quantize

CASES = (  # label, granularity, rowwise, columnwise
    ("tensorwise Q(x)", "tensor", True, False),
    ("tensorwise Q(x), Q(x^T)", "tensor", True, True),
    ("row-wise Q(x)", "row", True, False),
    ("row-wise Q(x), Q(x^T) (the linear's default)", "row", True, True),
)


def load_version(path: str):
    spec = importlib.util.spec_from_file_location("quantize_compared", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.triton_quantize


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--compare", metavar="FILE", help="another kernels/quantize.py to time next to this one")
    args = p.parse_args(argv)
    versions = [("this", triton_quantize)] + ([("compared", load_version(args.compare))] if args.compare else [])
    x = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16)
    x[7, 11] = 300.0  # an outlier, as activations have
    copy_us = triton.testing.do_bench(lambda: x.clone(), return_mode="median") * 1e3
    print(f"{args.rows} x {args.cols} bf16; device-to-device copy {copy_us:.0f} us; check_finite off\n")
    print("| kernel | " + " | ".join(f"{name} us | {name} % of copy" for name, _ in versions) + " |")
    print("|---|" + "---|---|" * len(versions))
    for label, granularity, rowwise, columnwise in CASES:
        minimal = x.numel() * (2 + int(rowwise) + int(columnwise))
        cells = []
        for _, fn in versions:
            us = triton.testing.do_bench(
                lambda: fn(x, granularity=granularity, block_size=128, weight=False, rowwise=rowwise,
                           columnwise=columnwise, check_finite="off"), return_mode="median") * 1e3
            cells.append(f"{us:.0f} | {copy_us * minimal / (4 * x.numel()) / us:.0%}")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
