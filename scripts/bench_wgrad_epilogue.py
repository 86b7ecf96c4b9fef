"""Benchmark the wgrad GEMM that accumulates into fp32 main_grad (gradient-accumulation fusion) on one
Hopper GPU: INT8 epilogue variants against BF16's ways of doing the same; one markdown table.

    PYTHONUNBUFFERED=1 python3 scripts/bench_wgrad_epilogue.py [--out FILE]

wgrad: main_grad[N_out, N_in] += dY^T @ X, a GEMM of M = N_out, N = N_in over K = the tokens. Shapes:
Llama2-7B's four linears at 8192 tokens (a micro-batch of 2 x 4096) and Mixtral-8x7B's fc1/fc2 for one
expert's ~1024 routed tokens. Columns:
- BF16 mm + add_: torch.mm to a bf16 gradient, then main_grad.add_ (megatron-core without apex: the
  gradient hook adds param.grad into main_grad);
- BF16 addmm fp32: torch.addmm(main_grad, dY^T, X, out_dtype=float32) written back into main_grad (cuBLAS
  with an fp32 C and beta = 1, as apex's fused_weight_gradient_mlp_cuda); n/a where torch lacks it;
- INT8 pointer 128x128: the persistent TMA kernel with the masked pointer epilogue (load main_grad's tile
  into registers, add, store), the untuned fp32 tile before the TMA reduce-add;
- INT8 reduce 128x128 / 128x256 / 256x128: the TMA reduce-add epilogue (in two column halves where the
  fp32 tile is over 64 KB);
- INT8 tuned: triton_gemm(accumulate_into=...) as the INT8 linears call it (autotuned, cached dispatch);
- INT8 untuned: triton_gemm(autotune=False), as the MoE experts call it.
Operands are row-wise quantized (the default recipe) outside the timing. TOP/s = 2 * M * N * K / time,
medians of triton.testing.do_bench (which flushes L2 before each call), after one untimed call.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_int8.kernels import int8_gemm as G  # noqa: E402
from megatron_int8.kernels import triton_gemm, triton_quantize  # noqa: E402

qref = importlib.import_module("megatron_int8.reference")

# (label, M = out features, N = in features, K = tokens)
SHAPES = [
    ("Llama2-7B qkv", 12288, 4096, 8192),
    ("Llama2-7B proj", 4096, 4096, 8192),
    ("Llama2-7B fc1", 22016, 4096, 8192),
    ("Llama2-7B fc2", 4096, 11008, 8192),
    ("Mixtral expert fc1", 28672, 4096, 1024),
    ("Mixtral expert fc2", 4096, 14336, 1024),
]
INT8_TILES = [("pointer 128x128", 128, 128, False), ("reduce 128x128", 128, 128, True),
              ("reduce 128x256", 128, 256, True), ("reduce 256x128", 256, 128, True)]


def bench(fn) -> float:
    fn()
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def quantized_pair(M: int, N: int, K: int):
    """Row-wise Q(dY^T) [M, K] and Q(X^T) [N, K] from bf16 data with an outlier channel."""
    g = torch.randn(M, K, device="cuda")
    x = torch.randn(N, K, device="cuda")
    x[5] *= 30
    kw = dict(granularity="row", block_size=128, check_finite="off", weight=False, rowwise=True, columnwise=False)
    return triton_quantize(g.bfloat16(), **kw)[0], triton_quantize(x.bfloat16(), **kw)[0], g.bfloat16(), x.bfloat16()


def bf16_addmm_fp32(gt, x, main):
    torch.addmm(main, gt, x, out_dtype=torch.float32, out=main)


def row(label, M, N, K, notes) -> str:
    qa, qb, g, x = quantized_pair(M, N, K)
    main = torch.zeros(M, N, device="cuda")
    gt, xt = g, x.t()  # dY^T [M, K] @ X [K, N]
    fns = {
        "bf16 mm + add_": lambda: main.add_(torch.mm(gt, xt)),
        "bf16 addmm fp32": lambda: bf16_addmm_fp32(gt, xt, main),
        **{f"int8 {name}": (lambda bm=bm, bn=bn, c=c: G.launch_tma_tile(qa, qb, main, block_m=bm, block_n=bn,
                                                                        accumulate=True, c_tma=c))
           for name, bm, bn, c in INT8_TILES},
        "int8 tuned": lambda: triton_gemm(qa, qb, out_dtype=torch.float32, accumulate_into=main),
        "int8 untuned": lambda: triton_gemm(qa, qb, out_dtype=torch.float32, accumulate_into=main, autotune=False),
    }
    times = {}
    for col, fn in fns.items():
        try:
            times[col] = bench(fn)
        except Exception as exc:  # noqa: BLE001  (addmm's out_dtype may be missing; a tile may not fit)
            times[col] = float("nan")
            notes.append(f"{label}, {col}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    # the fused result must be right: one fresh accumulation through each INT8 path against the reference
    # (the same fp32 operations; the pointer epilogue may contract the last multiply and add into an FMA)
    want = qref.gemm(qa, qb, out_dtype=torch.float32, accumulate_into=torch.ones(M, N, device="cuda"))
    for name, bm, bn, c in INT8_TILES:
        got = torch.ones(M, N, device="cuda")
        G.launch_tma_tile(qa, qb, got, block_m=bm, block_n=bn, accumulate=True, c_tma=c)
        err = ((got - want).abs() / (want.abs() + 1)).max().item()
        if not torch.equal(got, want):
            notes.append(f"{label}, int8 {name}: not bit-identical to the reference, max relative error {err:.2g}"
                         + (" (BEYOND fp32 rounding)" if err > 2.0 ** -21 else ""))
    tops = {c: 2.0 * M * N * K / (t * 1e-3) / 1e12 for c, t in times.items()}
    best_bf16 = min(t for c, t in times.items() if c.startswith("bf16") and t == t)
    cells = " | ".join("n/a" if v != v else f"{v:.0f}" for v in tops.values())
    ratio = lambda c: "n/a" if times[c] != times[c] else f"{best_bf16 / times[c]:.2f}x"  # noqa: E731
    del qa, qb, g, x, main
    torch.cuda.empty_cache()
    return f"| {label} | {M}, {N}, {K} | {cells} | {ratio('int8 tuned')} | {ratio('int8 untuned')} |"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="also write the table to this file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("bench_wgrad_epilogue.py needs a Hopper (sm_90) GPU")
    cols = ["BF16 mm + add_", "BF16 addmm fp32"] + [f"INT8 {n}" for n, *_ in INT8_TILES] + ["INT8 tuned", "INT8 untuned"]
    head = [f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}", "",
            "TFLOP/s (BF16) and TOP/s (INT8), wgrad accumulated into fp32 main_grad", "",
            "| GEMM | M, N, K | " + " | ".join(cols) + " | INT8 tuned vs best BF16 | INT8 untuned vs best BF16 |",
            "|---|---|" + "---|" * (len(cols) + 2)]
    print("\n".join(head), flush=True)
    notes, rows = [], []
    for label, M, N, K in SHAPES:
        rows.append(row(label, M, N, K, notes))
        print(rows[-1], flush=True)
    tail = [""] + [f"- {n}" for n in notes]
    print("\n".join(tail))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(head + rows + tail) + "\n")


if __name__ == "__main__":
    main()
