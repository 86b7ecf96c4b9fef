#!/usr/bin/env python3
"""Kernels for an Nsight Compute profile: the tensorwise quantize (plain and with transpose) of one
Llama2-7B activation and the fprop/dgrad/wgrad INT8 GEMMs of its fc1, each launched once inside a
cudaProfilerStart/Stop range after a warm-up (compilation and autotuning stay outside the profile).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section MemoryWorkloadAnalysis python3 scripts/ncu_profile.py
Without ncu it prints each kernel's time, so the same script shows what the profile covers."""
import argparse

import torch
import triton.testing

from megatron_int8.kernels import triton_gemm, triton_quantize


def _quantize(x, columnwise, stochastic=False):
    return triton_quantize(x, granularity="tensor", block_size=128, weight=False, rowwise=True,
                           columnwise=columnwise, stochastic=stochastic, check_finite="off")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=11008)
    args = p.parse_args()
    t, h, f = args.tokens, args.hidden, args.ffn
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(f, h, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(t, f, device="cuda", dtype=torch.bfloat16) * 1e-3
    qx, qxt = _quantize(x, columnwise=True)
    qw, qwt = _quantize(w, columnwise=True)
    qdy, qdyt = _quantize(dy, columnwise=True, stochastic=True)
    main_grad = torch.zeros(f, h, device="cuda", dtype=torch.float32)
    work = {
        "quantize x (Q only)": lambda: _quantize(x, columnwise=False),
        "quantize x (Q and Q^T)": lambda: _quantize(x, columnwise=True),
        "copy x (reference)": lambda: x.clone(),
        "fprop gemm x @ w^T": lambda: triton_gemm(qx, qw, out_dtype=torch.bfloat16),
        "dgrad gemm dy @ w": lambda: triton_gemm(qdy, qwt, out_dtype=torch.bfloat16),
        "wgrad gemm dy^T @ x into main_grad": lambda: triton_gemm(qdyt, qxt, accumulate_into=main_grad),
        "bf16 fprop matmul (reference)": lambda: x @ w.t(),
    }
    for name, fn in work.items():  # warm-up: compile, autotune, and a timing outside the profile
        us = triton.testing.do_bench(fn, return_mode="median") * 1e3
        print(f"{name:38s} {us:8.1f} us", flush=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in work.values():
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
