#!/usr/bin/env python3
"""Quick GPU timing of the quantize kernels (tensorwise, row-wise, block) on one activation shape: median
us and % of a device-to-device copy (minimal-bytes model: read x once, write each int8 output once), as a
markdown table. `--compare FILE` also times another version of megatron_int8/kernels/quantize.py (e.g.
`git show HEAD~1:megatron_int8/kernels/quantize.py > /tmp/prev.py`) in the same process, for an A/B, and
says whether both versions return identical int8 data and scales. do_bench clears the L2 cache before
each call (a 256 MB memset, whose dirty lines the timed kernels then write back), so these are cold-cache
times.

    python scripts/time_quantize.py --rows 8192 --cols 4096 --compare /tmp/prev.py
"""
import argparse
import importlib.util

import torch
import triton.testing

from megatron_int8.kernels import triton_quantize

CASES = (  # label, granularity, rowwise, columnwise, extra kwargs
    ("tensorwise Q(x)", "tensor", True, False, {}),
    ("tensorwise Q(x), Q(x^T)", "tensor", True, True, {}),
    ("tensorwise Q(x), Q(x^T), stochastic", "tensor", True, True, {"stochastic": True}),
    ("row-wise Q(x)", "row", True, False, {}),
    ("row-wise Q(x), Q(x^T) (the linear's default)", "row", True, True, {}),
    ("block 1x128 Q(x), Q(x^T)", "block", True, True, {}),
    ("block 128x128 (weight) Q(x), Q(x^T)", "block", True, True, {"weight": True}),
)


def load_version(path: str):
    """FILE as a module of megatron_int8.kernels, so that its relative imports resolve."""
    spec = importlib.util.spec_from_file_location("megatron_int8.kernels.quantize_compared", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.triton_quantize


def _same(a, b) -> bool:
    """Both versions' outputs (Q(x), Q(x^T)) hold identical int8 data and scales."""
    return all((p is None and q is None) or (torch.equal(p.data, q.data) and torch.equal(p.scale, q.scale))
               for p, q in zip(a, b))


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
    print("| kernel | " + " | ".join(f"{name} us | {name} % of copy" for name, _ in versions)
          + (" | identical outputs |" if len(versions) > 1 else " |"))
    print("|---|" + "---|---|" * len(versions) + ("---|" if len(versions) > 1 else ""))
    for label, granularity, rowwise, columnwise, extra in CASES:
        kwargs = {**dict(granularity=granularity, block_size=128, weight=False, rowwise=rowwise,
                         columnwise=columnwise, check_finite="off"), **extra}
        minimal = x.numel() * (2 + int(rowwise) + int(columnwise))
        cells = []
        for _, fn in versions:
            us = triton.testing.do_bench(lambda: fn(x, **kwargs), return_mode="median") * 1e3
            cells.append(f"{us:.0f} | {copy_us * minimal / (4 * x.numel()) / us:.0%}")
        if len(versions) > 1:  # stochastic rounding draws its seed from torch's generator: same seed for both
            outs = []
            for _, fn in versions:
                torch.manual_seed(1)
                outs.append(fn(x, **kwargs))
            cells.append("yes" if _same(*outs) else "**NO**")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
