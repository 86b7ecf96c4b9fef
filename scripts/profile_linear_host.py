"""Host (CPU) cost of one INT8 linear fwd+bwd against its GPU time, and where the host time goes.

    PYTHONUNBUFFERED=1 python3 scripts/profile_linear_host.py [--tokens 4096] [--profile-top 30]

Under tensor parallelism each rank's GEMMs shrink, while the Python work per linear call (quantize and
GEMM launches, argument checks, the autograd Function) stays: once it exceeds the GPU time, the GPU waits
for the host. Shapes: Llama2-13B's four linears per rank at TP 4 and TP 2, two at TP 1. Per shape and
precision:
- host ms: the Python loop of N fwd+bwd calls while the GPU is kept busy by a long sleep kernel queued
  first, so the host never waits for the device: enqueue time per call. On the lent H100 it has read
  above the synchronized wall time (up to 2x), so enqueueing behind a sleeping GPU costs extra there:
  for shapes whose GPU time is short, the wall time is the better measure of the host cost, and
  `pretrain --profile` the one for a whole training step;
- GPU ms: CUDA events around the same loop once the host runs ahead (sleep queued first);
- wall ms: the loop synchronized, nothing queued ahead: what a training step sees, max(host, GPU).
INT8 is int8_linear with the default recipe (weights cached, deferred finite check); BF16 is F.linear
under autograd. Then the host time of the pieces (one both-axes quantize, one GEMM launch) and cProfile
of INT8 calls on the TP 4 fc1 shape: the top functions by own time.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_int8 import DEFAULT_RECIPE, int8_linear  # noqa: E402
from megatron_int8.kernels import triton_gemm, triton_quantize  # noqa: E402

# (label, in features, out features) of Llama2-13B (hidden 5120, ffn 13824, 40 heads) per tensor-parallel rank
SHAPES = [
    ("TP4 qkv", 5120, 3840), ("TP4 proj", 1280, 5120), ("TP4 fc1", 5120, 6912), ("TP4 fc2", 3456, 5120),
    ("TP2 qkv", 5120, 7680), ("TP2 proj", 2560, 5120), ("TP2 fc1", 5120, 13824), ("TP2 fc2", 6912, 5120),
    ("TP1 qkv", 5120, 15360), ("TP1 fc1", 5120, 27648),
]


def make(tokens: int, n_in: int, n_out: int):
    x = torch.randn(tokens, n_in, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    w = (torch.randn(n_out, n_in, device="cuda") * 0.02).bfloat16().requires_grad_(True)
    dy = torch.randn(tokens, n_out, device="cuda", dtype=torch.bfloat16)
    return x, w, dy


def step(int8: bool, x, w, dy):
    y = int8_linear(x, w, None, DEFAULT_RECIPE) if int8 else F.linear(x, w)
    y.backward(dy)
    x.grad = w.grad = None


def measure(int8: bool, x, w, dy, n: int) -> tuple:
    for _ in range(3):
        step(int8, x, w, dy)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU work queued ahead: the loop below only enqueues
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(n):
        step(int8, x, w, dy)
    host = (time.perf_counter() - t0) / n * 1e3
    end.record()
    torch.cuda.synchronize()
    gpu = start.elapsed_time(end) / n
    t0 = time.perf_counter()
    for _ in range(n):
        step(int8, x, w, dy)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n * 1e3
    return host, gpu, wall


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--profile-top", type=int, default=30)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_linear_host.py needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {args.tokens} tokens; fwd+bwd per call\n")
    print("| linear | in, out | INT8 host ms | INT8 GPU ms | INT8 wall ms | BF16 host ms | BF16 GPU ms | BF16 wall ms "
          "| INT8 vs BF16 (wall) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, n_in, n_out in SHAPES:
        x, w, dy = make(args.tokens, n_in, n_out)
        i8 = measure(True, x, w, dy, args.iters)
        bf = measure(False, x, w, dy, args.iters)
        print(f"| {label} | {n_in}, {n_out} | " + " | ".join(f"{v:.3f}" for v in i8 + bf) + f" | {bf[2] / i8[2]:.2f}x |",
              flush=True)
        del x, w, dy
    x, w, dy = make(args.tokens, 5120, 6912)
    for _ in range(3):
        step(True, x, w, dy)
    qkw = dict(granularity="row", block_size=128, weight=False, rowwise=True, columnwise=True, columnwise_pad=16,
               check_finite=DEFAULT_RECIPE.check_finite)
    qx = triton_quantize(x.detach(), **qkw)[0]
    qw = triton_quantize(w.detach(), **dict(qkw, weight=True, columnwise=False))[0]
    pieces = {"quantize (both axes, 3 launches)": lambda: triton_quantize(x.detach(), **qkw),
              "GEMM (1 launch, tuned dispatch)": lambda: triton_gemm(qx, qw, out_dtype=torch.bfloat16)}
    for label, fn in pieces.items():
        fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9))
        t0 = time.perf_counter()
        for _ in range(args.iters):
            fn()
        print(f"host time of one {label}: {(time.perf_counter() - t0) / args.iters * 1e3:.3f} ms")
        torch.cuda.synchronize()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.iters):
        step(True, x, w, dy)
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile_top)
    print(f"\ncProfile, {args.iters} INT8 fwd+bwd calls (TP4 fc1 shape), by own time:\n{out.getvalue()}")


if __name__ == "__main__":
    main()
