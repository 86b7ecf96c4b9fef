"""RMSNorm forward + backward: torch.nn.RMSNorm's CUDA kernels vs megatron_int8.rms_norm's Triton kernel.

One row per norm of a layer at one micro-batch: the hidden norms (input and pre-MLP) and Qwen3's q/k head
norms (k a strided slice of the fused qkv output, as megatron passes it). The GB/s column counts the
least an RMSNorm moves: read x and write y forward; read x and dy and write dx backward.

    python scripts/bench_norm.py            # seq 4096 x micro-batch 2, bf16
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = {  # name: (heads or None for a hidden norm, width, query heads + 2 key/value heads of the qkv output)
    "hidden 4096 (Llama2-7B, Llama3.1-8B, Qwen3-8B)": (None, 4096, None),
    "hidden 5120 (Llama2-13B)": (None, 5120, None),
    "hidden 2560 (Qwen3-4B)": (None, 2560, None),
    "Qwen3 q heads 32 x 128": (32, 128, None),
    "Qwen3 k heads 8 x 128 (slice of qkv)": (8, 128, 48),
}


def time_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--iters", type=int, default=50)
    opts = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_norm.py needs a CUDA GPU")
    from megatron_int8.rms_norm import FusedRMSNorm

    T = opts.seq * opts.micro_batch
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {opts.seq} x {opts.micro_batch} tokens, "
             "bf16, forward + backward", "",
             "| norm | torch ms | Triton ms | speedup | torch GB/s | Triton GB/s |", "|---|---|---|---|---|---|"]
    print("\n".join(lines))
    for name, (heads, width, qkv_heads) in SHAPES.items():
        if qkv_heads:
            x = torch.randn(T, qkv_heads, width, device="cuda", dtype=torch.bfloat16)[:, 32:32 + heads]
        else:
            x = torch.randn((T, heads, width) if heads else (T, width), device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16)
        times = []
        for kind in ("torch", "triton"):
            norm = FusedRMSNorm(width, eps=1e-6, device="cuda", dtype=torch.bfloat16)
            norm.use_triton = kind == "triton"

            def step():
                leaf = x.detach().requires_grad_(True)
                norm(leaf).backward(dy)

            times.append(time_ms(step, 5, opts.iters))
        moved = 5 * x.numel() * 2
        row = (f"| {name} | {times[0]:.3f} | {times[1]:.3f} | {times[0] / times[1]:.2f}x | "
               f"{moved / times[0] / 1e6:.0f} | {moved / times[1] / 1e6:.0f} |")
        lines.append(row)
        print(row, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_norm.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
