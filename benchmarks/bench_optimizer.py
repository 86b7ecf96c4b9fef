#!/usr/bin/env python3
"""Optimizer step time on one GPU: the precision-aware AdamW's fused Triton step (megatron_int8.ops.adamw)
against torch's fused AdamW, for a few parameter counts. Prints a markdown table and appends it to
benchmarks/results/optimizer.csv ($OUT/optimizer.csv on the GPU machine) with its provenance.

Each row steps parameters of `--tensor-numel` elements each (the last one ragged) summing to the count:
  torch fused AdamW   fp32 master params and moments, torch.optim.AdamW(fused=True), then the copy of the
                      masters into the bf16 params that megatron's mixed-precision optimizer does: what the
                      trainer runs today without the flags
  ours <m>/<v> <w>    PrecisionAwareAdamW with master weights: bf16 params, fp32 gradients (decoupled_grad,
                      as megatron's distributed optimizer hands them), moments in m / v, master fp32 or as a
                      remainder; one kernel per parameter writes the bf16 param itself
Columns: mean step time over --iters steps after --warmup, the bytes each step reads and writes per
parameter, the resulting bandwidth, and the optimizer-held bytes per parameter (master + moments).

    python benchmarks/bench_optimizer.py                         # 0.1, 0.5, 1 and 2 billion parameters
    python benchmarks/bench_optimizer.py --params 1e8 1e9 --iters 50
"""
from __future__ import annotations

import argparse

import torch

from common import positive_int, record_tables, require_cuda, time_ms  # noqa: E402  (first: puts the repository on sys.path)
from megatron_int8.megatron.optimizer import PrecisionAwareAdamW  # noqa: E402
from megatron_int8.training.memory import STATE_BYTES  # noqa: E402

HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# (label, exp_avg dtype, exp_avg_sq dtype, remainders)
OURS = [("ours fp32/fp32, fp32 master", "fp32", "fp32", False),
        ("ours bf16/bf16, remainder", "bf16", "bf16", True),
        ("ours int8/int8, fp32 master", "int8", "int8", False),
        ("ours int8/int8, remainder", "int8", "int8", True)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", nargs="+", type=float, default=[1e8, 5e8, 1e9, 2e9])
    p.add_argument("--tensor-numel", type=int, default=4096 * 4096, help="elements per parameter tensor")
    p.add_argument("--iters", type=positive_int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    return p.parse_args(argv)


def _sizes(total: int, per_tensor: int) -> list:
    sizes = [per_tensor] * (total // per_tensor)
    if total % per_tensor:
        sizes.append(total % per_tensor + 13)  # ragged: not a multiple of the 128-element blocks
    return sizes


def bench_torch(sizes, iters, warmup):
    masters = [torch.nn.Parameter(torch.randn(n, device="cuda") * 0.02) for n in sizes]
    models = [m.detach().bfloat16() for m in masters]
    for m in masters:
        m.grad = torch.randn_like(m) * 1e-3
    opt = torch.optim.AdamW(masters, fused=True, **HYPER)

    def step():
        opt.step()
        torch._foreach_copy_(models, masters)

    ms = time_ms(step, warmup, iters)
    # reads: master, grad, 2 moments (16 B); writes: master, 2 moments (12 B); copy: read 4, write 2
    return ms, 34, 12


def bench_ours(sizes, iters, warmup, m_dtype, v_dtype, remainders):
    params = [(torch.randn(n, device="cuda") * 0.02).bfloat16() for n in sizes]
    for p in params:
        p.decoupled_grad = torch.randn(p.numel(), device="cuda") * 1e-3
    opt = PrecisionAwareAdamW(params, lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"],
                              weight_decay=HYPER["weight_decay"], exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype,
                              master_weights=True, store_param_remainders=remainders, use_decoupled_grad=True)
    ms = time_ms(opt.step, warmup, iters)
    held = (2 if remainders else 4) + STATE_BYTES[m_dtype] + STATE_BYTES[v_dtype]
    moved = 4 + 2 * held + (4 if remainders else 2)  # grad; states read and written; the bf16 param
    return ms, moved, held


def main(argv=None):
    opts = parse_args(argv)
    require_cuda(__file__)
    rows = []
    for count in opts.params:
        total = int(count)
        sizes = _sizes(total, opts.tensor_numel)
        cases = [("torch fused AdamW + bf16 copy", lambda: bench_torch(sizes, opts.iters, opts.warmup))]
        cases += [(label, lambda m=m, v=v, r=r: bench_ours(sizes, opts.iters, opts.warmup, m, v, r))
                  for label, m, v, r in OURS]
        baseline = None
        for label, run in cases:
            torch.cuda.empty_cache()
            ms, moved, held = run()
            baseline = baseline or ms
            rows.append((f"{total / 1e9:g}B", label, ms, baseline / ms, moved, moved * total / ms / 1e6, held))
            torch.cuda.synchronize()
    lines = [f"Optimizer step, {torch.cuda.get_device_name()}, torch {torch.__version__}, tensors of "
             f"{opts.tensor_numel} elements, mean of {opts.iters} steps", "",
             "| params | optimizer | ms/step | speedup vs torch | B moved/param | GB/s | B held/param |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {c} | {label} | {ms:.2f} | {speed:.2f}x | {moved:.2f} | {bw:.0f} | {held:.2f} |"
              for c, label, ms, speed, moved, bw, held in rows]
    text = "\n".join(lines)
    print(text)
    record_tables("optimizer", text)


if __name__ == "__main__":
    main()
