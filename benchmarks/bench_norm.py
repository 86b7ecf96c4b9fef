"""RMSNorm forward + backward: torch.nn.RMSNorm's CUDA kernels vs megatron_int8.ops.rms_norm's Triton kernel.

One row per norm of a layer at one micro-batch: the hidden norms (input and pre-MLP) and Qwen3's q/k head
norms (k a strided slice of the fused qkv output, as megatron passes it). Two timings per kernel kind:
GPU time (the kernels' own durations under torch.profiler, what a CUDA-graphed step pays) and wall time
per eager step (CUDA events over back-to-back steps: includes the host time when that is longer, which
is what an eager step pays when it is host-bound). GB/s counts the least an RMSNorm moves per GPU time:
read x and write y forward; read x and dy and write dx backward.

    python benchmarks/bench_norm.py            # seq 4096 x micro-batch 2, bf16
"""
from __future__ import annotations

import os

import torch
from torch.profiler import ProfilerActivity, profile

from common import record_tables, time_ms, token_args  # noqa: E402

SHAPES = {  # name: (heads or None for a hidden norm, width, query heads + 2 key/value heads of the qkv output)
    "hidden 4096 (Llama2-7B, Llama3.1-8B, Qwen3-8B)": (None, 4096, None),
    "hidden 5120 (Llama2-13B)": (None, 5120, None),
    "hidden 2560 (Qwen3-4B)": (None, 2560, None),
    "Qwen3 q heads 32 x 128": (32, 128, None),
    "Qwen3 k heads 8 x 128 (slice of qkv)": (8, 128, 48),
}


def gpu_ms(fn, steps: int = 5) -> float:
    """Kernel time per call of fn (the sum of the GPU kernels' durations), after a warm-up. Only CUDA
    activity is recorded, so every event is a kernel, memset or copy on the GPU."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    if total_us <= 0:
        raise RuntimeError("bench_norm.py: the profiler recorded no GPU time")
    return total_us / steps / 1e3


def main(argv=None) -> None:
    opts = token_args(__doc__, "bench_norm.py", argv)
    from megatron_int8.ops.rms_norm import FusedRMSNorm

    T = opts.seq * opts.micro_batch
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {opts.seq} x {opts.micro_batch} tokens, "
             "bf16, forward + backward", "",
             "| norm | GPU ms torch | GPU ms Triton | GPU speedup | GB/s torch / Triton | eager wall ms torch / Triton |",
             "|---|---|---|---|---|---|"]
    print("\n".join(lines))
    for name, (heads, width, qkv_heads) in SHAPES.items():
        if qkv_heads:
            x = torch.randn(T, qkv_heads, width, device="cuda", dtype=torch.bfloat16)[:, 32:32 + heads]
        else:
            x = torch.randn((T, heads, width) if heads else (T, width), device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16)
        gpu, wall = [], []
        for kind in ("torch", "triton"):
            norm = FusedRMSNorm(width, eps=1e-6, device="cuda", dtype=torch.bfloat16)
            norm.use_triton = kind == "triton"

            def step():
                leaf = x.detach().requires_grad_(True)
                norm(leaf).backward(dy)

            wall.append(time_ms(step, 5, opts.iters))
            gpu.append(gpu_ms(step))
        moved = 5 * x.numel() * 2
        row = (f"| {name} | {gpu[0]:.3f} | {gpu[1]:.3f} | {gpu[0] / gpu[1]:.2f}x | "
               f"{moved / gpu[0] / 1e6:.0f} / {moved / gpu[1] / 1e6:.0f} | {wall[0]:.3f} / {wall[1]:.3f} |")
        lines.append(row)
        print(row, flush=True)
    record_tables("norm", "\n".join(lines))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_norm.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
