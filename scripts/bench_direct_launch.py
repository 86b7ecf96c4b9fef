"""INT8 linear fwd+bwd with the kernels launched through `kernels.launch.LaunchCache` (compiled kernels called
directly) against every launch going through `JITFunction.run`: the same results bit for bit, and the
wall time per call.

    PYTHONUNBUFFERED=1 python3 scripts/bench_direct_launch.py [--tokens 4096] [--iters 50] [--rounds 3]

1. Bit-exactness: y, dX and dW (or main_grad, with gradient-accumulation fusion) of both modes compared
   with torch.equal, for the tensor, row and block recipes, on a ragged shape, a 16-byte-misaligned input
   view, and Llama2-13B's TP 4 shapes; failures exit non-zero.
2. Timing: Llama2-13B's four linears per rank at TP 4 (where the GPU waits for the host, docs/scaling.md),
   default recipe; the two modes alternate, `--rounds` times `--iters` synchronized calls each; medians.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megatron_int8  # noqa: E402
from megatron_int8 import DEFAULT_RECIPE, Int8Recipe  # noqa: E402
from megatron_int8.kernels import launch  # noqa: E402
from profile_linear_host import SHAPES  # noqa: E402  (this script's directory is on sys.path)

TP4_SHAPES = [s for s in SHAPES if s[0].startswith("TP4")]


def fwd_bwd(x, w, dy, recipe, fused: bool, package=None):
    """y, dX and dW (or main_grad, zeroed first, with gradient-accumulation fusion) of one int8_linear call;
    `package`: another import of the package to call instead (scripts/ab_revision.py's base revision)."""
    pkg = package or megatron_int8
    x = x.detach().requires_grad_(True)
    if fused:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    w.grad = None
    y = pkg.int8_linear(x, w, None, recipe, tp=pkg.TPOptions(gradient_accumulation_fusion=fused))
    y.backward(dy)
    return y, x.grad, (w.main_grad if fused else w.grad)


def check_identical(label, x, w, dy, recipe, fused=False) -> bool:
    out = {}
    for direct in (True, False, True):  # direct twice: the first may compile through JITFunction.run
        launch.DIRECT = direct
        out[direct] = [t.clone() for t in fwd_bwd(x, w, dy, recipe, fused)]
    launch.DIRECT = True
    same = all(torch.equal(a, b) for a, b in zip(out[True], out[False]))
    print(f"  {label}: {'identical' if same else 'DIFFERENT'}", flush=True)
    return same


def make(tokens, n_in, n_out, offset=0):
    base = torch.randn(tokens * n_in + offset, device="cuda", dtype=torch.bfloat16)
    base[:: 997] *= 50  # outliers
    x = base[offset:].view(tokens, n_in)
    w = (torch.randn(n_out, n_in, device="cuda") * 0.02).bfloat16().requires_grad_(True)
    dy = torch.randn(tokens, n_out, device="cuda", dtype=torch.bfloat16)
    return x, w, dy


def timed(x, w, dy, iters: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fwd_bwd(x, w, dy, DEFAULT_RECIPE, False)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-checks", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_direct_launch.py needs a CUDA GPU")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; direct launch available: {launch.DIRECT}",
          flush=True)
    ok = True
    if not args.skip_checks:
        print("bit-exactness, LaunchCache vs JITFunction.run:")
        untuned = dict(autotune=False)
        for g in ("tensor", "row", "block"):
            ok &= check_identical(f"{g}, 1000 x 1544 -> 777", *make(1000, 1544, 777), Int8Recipe(granularity=g, **untuned))
        ok &= check_identical("row, misaligned input view", *make(512, 1024, 768, offset=3), Int8Recipe(**untuned))
        ok &= check_identical("row, fused into main_grad", *make(1000, 1536, 768), Int8Recipe(**untuned), fused=True)
        for label, n_in, n_out in TP4_SHAPES:
            ok &= check_identical(f"default recipe, {label}", *make(args.tokens, n_in, n_out), DEFAULT_RECIPE)
    print(f"\nwall ms per fwd+bwd, {args.tokens} tokens, default recipe; medians of {args.rounds} rounds x "
          f"{args.iters} calls\n")
    print("| linear | in, out | JITFunction.run | LaunchCache (direct) | saved per call |")
    print("|---|---|---|---|---|")
    for label, n_in, n_out in TP4_SHAPES:
        x, w, dy = make(args.tokens, n_in, n_out)
        times = {True: [], False: []}
        for direct in (True, False):
            launch.DIRECT = direct
            timed(x, w, dy, 3)
        for _ in range(args.rounds):
            for direct in (False, True):
                launch.DIRECT = direct
                times[direct].append(timed(x, w, dy, args.iters))
        launch.DIRECT = True
        jit, direct = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {label} | {n_in}, {n_out} | {jit:.3f} | {direct:.3f} | {jit - direct:.3f} ms ({1 - direct / jit:.0%}) |",
              flush=True)
    if not ok:
        sys.exit("LaunchCache results differ from JITFunction.run's")


if __name__ == "__main__":
    main()
