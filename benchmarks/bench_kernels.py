"""Benchmark the INT8 kernels on one Hopper GPU and print markdown tables.

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_kernels.py [--quick] [--no-compile] [--out DIR]

--quick: Llama2-7B's four linears only (GEMMs and fwd+bwd) plus the quantize table, no torch.compile
section: a few minutes, for a check after a kernel change.

1. GEMMs: fprop, dgrad and wgrad of every linear of Llama2-7B, Llama3.1-8B, Qwen3-4B and Mixtral-8x7B
   (8192 tokens; Mixtral's attention equals Llama3.1-8B's, so only its expert MLP is listed, at the
   8192 * top-2 / 8 = 2048 tokens an expert sees on average): BF16 torch.matmul, our Triton INT8 GEMM with
   fused dequant (tensorwise), torch._int_mm + eager dequant, FP8 torch._scaled_mm (tensorwise), in TFLOP/s
   (TOP/s), and ours / BF16.
1b. Block-scale GEMMs (the block recipe: 1 x B scales along K, B x B weight tiles) of Llama2-7B's and Qwen3-4B's
   linears (--quick: Llama2-7B's) on Hopper's block kernel (the default route) at B = 128, 256 and 512, and at 128 on
   the portable kernel (MEGATRON_INT8_GEMM_KERNEL=portable, autotuned), in TOP/s beside the default recipe's
   row-scale GEMMs; wgrad adds into an fp32 main_grad as in training, fprop and dgrad write bf16.
2. Quantize kernels on an 8192 x 4096 bf16 activation: GB/s by the minimal-bytes model (read the input
   once, write each int8 output once) next to a device-to-device copy's GB/s (read + write).
   Also each of a current-scaling call's two kernels on its own: the quantize pass with the maxima given
   (x read once), as the linear runs it after a producer that wrote the maxima (SwiGLU) or with a TP
   group's amax, and the amax pass (the whole call less that pass; it only reads x).
3. A whole linear, fwd + bwd, all quantization included: ours (the default recipe) vs BF16 nn.Linear vs
   torchao's int8_mixed_precision_training. Table 1: every call is a new optimizer step, so the weights are
   quantized in every call (as in training without gradient accumulation), eager and CUDA-graphed (GPU time
   only, as in the trainer's graphed steps); also the recipe without the weight cache, which quantizes the
   weight in forward and again in backward instead of keeping Q(W^T). Table 2: a training step of 4
   micro-batches, graphed: the weights are quantized once per step (torchao re-quantizes them every call
   by design). torch.compile on a subset.
Medians of triton.testing.do_bench (which also flushes L2 before each call), inputs rotated among several
copies. Tables also go to $OUT/bench_kernels.md (or --out).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import triton

import common  # noqa: E402  (puts the repository on sys.path)

from megatron_int8 import Int8Recipe, int8_linear, invalidate_weight_caches  # noqa: E402
from megatron_int8.reference import ReferenceBackend  # noqa: E402
from megatron_int8.kernels import triton_gemm, triton_quantize  # noqa: E402

import importlib  # noqa: E402

qref = importlib.import_module("megatron_int8.reference")
REF = ReferenceBackend()
T = 8192
MICRO_BATCHES = 4  # table 2's training step

# (model, linear, in_features, out_features, tokens)
LINEARS = [
    ("Llama2-7B", "qkv", 4096, 3 * 4096, T),
    ("Llama2-7B", "proj", 4096, 4096, T),
    ("Llama2-7B", "fc1", 4096, 2 * 11008, T),
    ("Llama2-7B", "fc2", 11008, 4096, T),
    ("Llama3.1-8B", "qkv", 4096, 4096 + 2 * 8 * 128, T),
    ("Llama3.1-8B", "proj", 4096, 4096, T),
    ("Llama3.1-8B", "fc1", 4096, 2 * 14336, T),
    ("Llama3.1-8B", "fc2", 14336, 4096, T),
    ("Qwen3-4B", "qkv", 2560, 32 * 128 + 2 * 8 * 128, T),
    ("Qwen3-4B", "proj", 32 * 128, 2560, T),
    ("Qwen3-4B", "fc1", 2560, 2 * 9728, T),
    ("Qwen3-4B", "fc2", 9728, 2560, T),
    ("Mixtral-8x7B", "expert fc1", 4096, 2 * 14336, T * 2 // 8),
    ("Mixtral-8x7B", "expert fc2", 14336, 4096, T * 2 // 8),
]


bench = common.median_ms


def rotating(make, n):
    """n independent copies of inputs; each call of the returned getter hands out the next one."""
    sets = [make() for _ in range(n)]
    state = {"i": 0}

    def get():
        state["i"] = (state["i"] + 1) % n
        return sets[state["i"]]

    return get


def data(R, C, dtype=torch.bfloat16):
    x = torch.randn(R, C, device="cuda")
    x[:, 5] *= 30  # outlier channel
    return x.to(dtype)


def n_copies(nbytes):
    return max(2, min(4, int(3 * 60e6 // max(nbytes, 1)) + 1))


# ---------------------------------------------------------------------------------------------- GEMMs
def _gemm_operands(M, N, K, granularity, wgrad, block_size=128):
    """Operands as a training step quantizes them: a token-major activation or gradient (a; wgrad: Q(dy^T)), and a
    weight (b; block scales: B x B tiles) or, for wgrad, Q(x^T) (1 x B blocks along the tokens)."""
    qa, _ = REF.quantize(data(M, K), granularity=granularity, block_size=block_size, weight=False, rowwise=True,
                         columnwise=False)
    qb, _ = REF.quantize(data(N, K), granularity=granularity, block_size=block_size, weight=not wgrad, rowwise=True,
                         columnwise=False)
    return qa, qb


def _time_gemm(qs, M, N, wgrad, kernel):
    """Median ms of triton_gemm through MEGATRON_INT8_GEMM_KERNEL=`kernel` (tuning, if any, before the timing):
    a bf16 output, or wgrad's fp32 accumulation into a main_grad."""
    before = os.environ.get("MEGATRON_INT8_GEMM_KERNEL")
    os.environ["MEGATRON_INT8_GEMM_KERNEL"] = kernel
    try:
        if wgrad:
            main = torch.zeros(M, N, device="cuda")
            fn = lambda: triton_gemm(*qs(), out_dtype=torch.float32, accumulate_into=main)  # noqa: E731
        else:
            fn = lambda: triton_gemm(*qs(), out_dtype=torch.bfloat16)  # noqa: E731
        fn()
        return bench(fn)
    finally:
        if before is None:
            del os.environ["MEGATRON_INT8_GEMM_KERNEL"]
        else:
            os.environ["MEGATRON_INT8_GEMM_KERNEL"] = before


def block_gemm_table(quick):
    """The block recipe's GEMMs (1 x B scales, B x B weight tiles) on their Hopper kernel (the default route) at
    block sizes 128, 256 and 512 ("-" where the block does not divide K: the portable kernel would take it), and at
    128 on the portable kernel (autotuned), against the default recipe's row-scale GEMMs (the default route)."""
    variants = (("row", "row", 128, "auto"), ("block", "block", 128, "auto"), ("block 256", "block", 256, "auto"),
                ("block 512", "block", 512, "auto"), ("portable", "block", 128, "portable"))
    lines = ["| model | GEMM | M, N, K | row scales TOP/s | block 128 TOP/s | block 256 TOP/s | block 512 TOP/s | "
             "block 128, portable kernel TOP/s | block 128 / row | block 512 / row |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    linears = LINEARS[:4] if quick else LINEARS[:4] + LINEARS[8:12]  # Llama2-7B (and Qwen3-4B)
    for model, name, fin, fout, tok in linears:
        for gemm, (M, N, K) in (("fprop", (tok, fout, fin)), ("dgrad", (tok, fin, fout)), ("wgrad", (fout, fin, tok))):
            wgrad = gemm == "wgrad"
            n = n_copies(M * K + N * K)
            tops = {}
            for label, granularity, B, kernel in variants:
                if B > 128 and K % B:  # the portable kernel would take it: not this column's kernel
                    tops[label] = float("nan")
                    continue
                qs = rotating(lambda: _gemm_operands(M, N, K, granularity, wgrad, B), n)
                tops[label] = 2.0 * M * N * K / (_time_gemm(qs, M, N, wgrad, kernel) * 1e-3) / 1e12
                del qs
                torch.cuda.empty_cache()
            ratios.append(tops["block"] / tops["row"])
            cells = " | ".join("-" if tops[v[0]] != tops[v[0]] else f"{tops[v[0]]:.0f}" for v in variants)
            r512 = tops["block 512"] / tops["row"]
            lines.append(f"| {model} | {name} {gemm} | {M}, {N}, {K} | {cells} | {ratios[-1]:.2f}x | "
                         + ("- |" if r512 != r512 else f"{r512:.2f}x |"))
            print(lines[-1], flush=True)
    return lines, ratios


def gemm_row(M, N, K, cache):
    key = (M, N, K)
    if key in cache:
        return cache[key]
    flops = 2.0 * M * N * K
    n = n_copies(M * K + N * K)
    bf = rotating(lambda: (data(M, K), data(N, K)), n)
    t_bf16 = bench(lambda: (lambda a, b: torch.matmul(a, b.t()))(*bf()))

    def mk_q():
        qa, _ = REF.quantize(data(M, K), granularity="tensor", block_size=128, weight=False, rowwise=True,
                             columnwise=False)
        qb, _ = REF.quantize(data(N, K), granularity="tensor", block_size=128, weight=True, rowwise=True,
                             columnwise=False)
        return qa, qb

    qs = rotating(mk_q, n)
    triton_gemm(*qs(), out_dtype=torch.bfloat16)  # autotune outside the timing
    t_ours = bench(lambda: triton_gemm(*qs(), out_dtype=torch.bfloat16))
    t_intmm = bench(lambda: qref.gemm(*qs(), out_dtype=torch.bfloat16))

    def mk_f8():
        a, b = data(M, K), data(N, K)
        sa = (a.abs().amax().float() / 448).reshape(())
        sb = (b.abs().amax().float() / 448).reshape(())
        return (a.float() / sa).to(torch.float8_e4m3fn), (b.float() / sb).to(torch.float8_e4m3fn), sa, sb

    try:
        f8 = rotating(mk_f8, n)
        t_fp8 = bench(lambda: (lambda a, b, sa, sb: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb,
                                                                     out_dtype=torch.bfloat16))(*f8()))
    except Exception as e:  # noqa: BLE001
        print(f"FP8 _scaled_mm failed for {key}: {e}")
        t_fp8 = float("nan")
    res = {k: flops / (t * 1e-3) / 1e12 for k, t in
           (("bf16", t_bf16), ("ours", t_ours), ("intmm", t_intmm), ("fp8", t_fp8))}
    from megatron_int8.kernels import int8_gemm as G
    shape = G.dispatch_buckets(M, N, K)
    res["kernel"] = ("cuda" if G.CHOSEN.get((M, N, K)) == "cuda" else
                     ",".join(sorted({f.kernel for k, f in G._fast.items() if k[:3] == shape})) or "plain")
    cache[key] = res
    torch.cuda.empty_cache()
    return res


def gemm_table(quick):
    rows, ratios, cache = [], [], {}
    lines = ["| model | GEMM | M, N, K | BF16 TFLOP/s | ours INT8 + fused dequant TOP/s | _int_mm + dequant TOP/s |"
             " FP8 _scaled_mm TFLOP/s | ours / BF16 | our kernel |", "|---|---|---|---|---|---|---|---|---|"]
    linears = LINEARS[:4] if quick else LINEARS  # quick: Llama2-7B
    for model, name, fin, fout, tok in linears:
        for gemm, (M, N, K) in (("fprop", (tok, fout, fin)), ("dgrad", (tok, fin, fout)), ("wgrad", (fout, fin, tok))):
            r = gemm_row(M, N, K, cache)
            ratio = r["ours"] / r["bf16"]
            ratios.append(ratio)
            lines.append(f"| {model} | {name} {gemm} | {M}, {N}, {K} | {r['bf16']:.0f} | {r['ours']:.0f} | "
                         f"{r['intmm']:.0f} | {r['fp8']:.0f} | {ratio:.2f}x | {r['kernel']} |")
            print(lines[-1], flush=True)
            rows.append((model, name, gemm, r))
    return lines, ratios


# -------------------------------------------------------------------------------------------- quantize
def quantize_table(R=8192, C=4096):
    """Each quantize call as the linear makes it (amax pass, then the quantize pass), and its quantize pass
    alone with the maxima given, as when the producer of x wrote them (SwiGLU) or the TP group's amax is
    passed in: then x is read once. The difference of the two is the amax pass (x read once more)."""
    lines = [f"| quantize kernel ({R} x {C} bf16 in) | outputs | us | GB/s (minimal bytes) | % of D2D copy |"
             " quantize pass alone (maxima given) us | quantize pass % of copy | amax pass us (the rest) |"
             " amax pass % of copy |"
             " eager reference us |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    n = 3
    xs = rotating(lambda: data(R, C), n)
    dsts = rotating(lambda: torch.empty(R, C, dtype=torch.bfloat16, device="cuda"), n)
    t_copy = bench(lambda: dsts().copy_(xs()))
    copy_gbs = 4.0 * R * C / (t_copy * 1e-3) / 1e9
    lines.append(f"| device-to-device copy | bf16 | {t_copy * 1e3:.0f} | {copy_gbs:.0f} | 100% | | | | | |")
    fracs, fracs_given, fracs_amax = [], [], []
    cases = [
        ("tensorwise quantize", "tensor", False, True, False, False),
        ("tensorwise quantize+transpose", "tensor", False, True, True, False),
        ("tensorwise quantize+transpose, stochastic", "tensor", False, True, True, True),
        ("row-wise (per token)", "row", False, True, False, False),
        ("row-wise both axes (Q(x), Q(x^T))", "row", False, True, True, False),
        ("block 1x128 both axes", "block", False, True, True, False),
        ("block 128x128 (weight) quantize+transpose", "block", True, True, True, False),
    ]
    # one shared x for the maxima-given timings: the maxima belong to it
    x1 = data(R, C)
    a1 = x1.float().abs()
    maxima = {"tensor": dict(amax=a1.amax()), "row": dict(rowwise_amax=a1.amax(1), columnwise_amax=a1.amax(0))}
    del a1
    for label, g, w, rw, cw, sr in cases:
        kw = dict(granularity=g, block_size=128, weight=w, rowwise=rw, columnwise=cw, stochastic=sr,
                  check_finite="off")
        triton_quantize(xs(), **kw)
        t = bench(lambda: triton_quantize(xs(), **kw))
        t_ref = bench(lambda: REF.quantize(xs(), **kw), rep=30)
        outs = int(rw) + int(cw)
        nbytes = R * C * (2 + outs)
        gbs = nbytes / (t * 1e-3) / 1e9
        fracs.append((label, gbs / copy_gbs))
        if g in maxima:  # block scales come from the tile itself: one pass already
            kw_given = {**kw, **maxima[g]}
            if not cw:
                kw_given.pop("columnwise_amax", None)
            triton_quantize(x1, **kw_given)
            t_given = bench(lambda: triton_quantize(x1, **kw_given))
            frac = nbytes / (t_given * 1e-3) / 1e9 / copy_gbs
            fracs_given.append((label, frac))
            t_amax = t - t_given  # reads x once: 2 bytes per element
            frac_amax = 2 * R * C / (t_amax * 1e-3) / 1e9 / copy_gbs
            fracs_amax.append((label, frac_amax))
            given = f"{t_given * 1e3:.0f} | {100 * frac:.0f}% | {t_amax * 1e3:.0f} | {100 * frac_amax:.0f}%"
        else:
            given = "(one pass) | | | "
        lines.append(f"| {label} | {outs} x int8 | {t * 1e3:.0f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% | {given} | "
                     f"{t_ref * 1e3:.0f} |")
        print(lines[-1], flush=True)
    # what the finite check adds: a device-side flag update (deferred), a host sync (immediate)
    for mode, what in (("deferred", "device flag"), ("immediate", "host sync")):
        kw = dict(granularity="tensor", block_size=128, weight=False, rowwise=True, columnwise=True,
                  check_finite=mode)
        t = bench(lambda: triton_quantize(xs(), **kw))
        lines.append(f"| tensorwise quantize+transpose, check_finite={mode} ({what}) | 2 x int8 | {t * 1e3:.0f} | "
                     f"{R * C * 4 / (t * 1e-3) / 1e9:.0f} | {100 * R * C * 4 / (t * 1e-3) / 1e9 / copy_gbs:.0f}% | | | | | |")
    return lines, fracs, fracs_given, fracs_amax


def graphed(step, what):
    """`step` captured in a CUDA graph after a warm-up on a side stream: its replay, or None (and why) if the
    capture fails. Graphed, a step costs its GPU time only, as in the trainer's graphed steps."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph.replay
    except Exception as e:  # noqa: BLE001
        print(f"CUDA graph capture of {what} failed: {type(e).__name__}: {e}")
        return None


# ------------------------------------------------------------------------------------------ fwd + bwd
def linear_table(quick):
    """Eager (host time included: each call launches ~11 kernels through Python) and CUDA-graphed (GPU time
    only) fwd+bwd of one linear."""
    try:
        from torchao.prototype.quantized_training import Int8MixedPrecisionTrainingConfig
        from torchao.quantization import quantize_
    except Exception as e:  # noqa: BLE001
        print(f"torchao unavailable: {e}")
        Int8MixedPrecisionTrainingConfig = quantize_ = None
    lines = ["| model | linear | tokens, in -> out | eager: BF16 nn.Linear ms | eager: ours ms | eager: torchao int8 ms |"
             " graphed: BF16 ms | graphed: ours ms | graphed: ours, no weight cache, ms | graphed: torchao ms |"
             " ours / BF16 eager | ours / BF16 graphed | torchao / ours eager | torchao / ours graphed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    step_lines = ["| model | linear | tokens, in -> out | BF16 ms | ours ms | torchao ms | ours / BF16 | torchao / ours |",
                  "|---|---|---|---|---|---|---|---|"]
    ratios, vs_ao, ratios_g, vs_ao_g, ratios_s, vs_ao_s = [], [], [], [], [], []
    linears = LINEARS[:4] if quick else LINEARS  # quick: Llama2-7B
    nan = float("nan")
    for model, name, fin, fout, tok in linears:
        x = data(tok, fin).requires_grad_(True)
        dy = data(tok, fout)
        lin = torch.nn.Linear(fin, fout, bias=False, device="cuda", dtype=torch.bfloat16)

        def step_bf16():
            x.grad = lin.weight.grad = None
            lin(x).backward(dy)

        w = lin.weight
        r_default = Int8Recipe(backend="triton")  # as a user gets it: weights cached within an optimizer step
        r_nocache = Int8Recipe(backend="triton", cache_weights=False)

        def step_ours(recipe=r_default):
            x.grad = w.grad = None
            int8_linear(x, w, None, recipe).backward(dy)

        def new_step_ours():
            """Table 1: every call is a new optimizer step (what the optimizer's post-step hook does)."""
            invalidate_weight_caches()
            step_ours()

        def training_step(micro_batch):
            """Table 2: one optimizer step's micro-batches (weights unchanged within it)."""
            def run():
                invalidate_weight_caches()  # as the optimizer step does: the first micro-batch re-quantizes
                for _ in range(MICRO_BATCHES):
                    micro_batch()
            return run

        t_bf16 = bench(step_bf16, rep=100)
        new_step_ours()
        t_default = bench(new_step_ours, rep=100)
        g_bf16, g_ours = graphed(step_bf16, "BF16"), graphed(new_step_ours, "ours")
        g_nocache = graphed(lambda: step_ours(r_nocache), "ours, no weight cache")
        tg_bf16 = bench(g_bf16, rep=100) if g_bf16 else nan
        tg_ours = bench(g_ours, rep=100) if g_ours else nan
        tg_nocache = bench(g_nocache, rep=100) if g_nocache else nan
        s_bf16, s_ours = graphed(training_step(step_bf16), "BF16 step"), graphed(training_step(step_ours), "ours step")
        ts_bf16 = bench(s_bf16, rep=100) / MICRO_BATCHES if s_bf16 else nan
        ts_ours = bench(s_ours, rep=100) / MICRO_BATCHES if s_ours else nan
        t_ao = tg_ao = ts_ao = nan
        if quantize_ is not None:
            try:
                ao = torch.nn.Sequential(torch.nn.Linear(fin, fout, bias=False, device="cuda", dtype=torch.bfloat16))
                quantize_(ao, Int8MixedPrecisionTrainingConfig())

                def step_ao():
                    x.grad = ao[0].weight.grad = None
                    ao(x).backward(dy)

                step_ao()
                t_ao = bench(step_ao, rep=100)
                g_ao = graphed(step_ao, "torchao")
                tg_ao = bench(g_ao, rep=100) if g_ao else nan
                s_ao = graphed(training_step(step_ao), "torchao step")
                ts_ao = bench(s_ao, rep=100) / MICRO_BATCHES if s_ao else nan
            except Exception as e:  # noqa: BLE001
                print(f"torchao failed on {model} {name}: {type(e).__name__}: {e}")
        # the default recipe, as a user gets it
        ratios.append(t_bf16 / t_default)
        vs_ao.append(t_ao / t_default)
        ratios_g.append(tg_bf16 / tg_ours)
        vs_ao_g.append(tg_ao / tg_ours)
        ratios_s.append(ts_bf16 / ts_ours)
        vs_ao_s.append(ts_ao / ts_ours)

        def f(t):
            return "n/a" if t != t else f"{t:.2f}"

        lines.append(f"| {model} | {name} | {tok}, {fin} -> {fout} | {t_bf16:.2f} | {t_default:.2f} | {f(t_ao)} | "
                     f"{f(tg_bf16)} | {f(tg_ours)} | {f(tg_nocache)} | {f(tg_ao)} | {f(ratios[-1])}x | "
                     f"{f(ratios_g[-1])}x | {f(vs_ao[-1])}x | {f(vs_ao_g[-1])}x |")
        print(lines[-1], flush=True)
        step_lines.append(f"| {model} | {name} | {tok}, {fin} -> {fout} | {f(ts_bf16)} | {f(ts_ours)} | {f(ts_ao)} | "
                          f"{f(ratios_s[-1])}x | {f(vs_ao_s[-1])}x |")
        print(step_lines[-1], flush=True)
        del x, dy, lin
        g_bf16 = g_ours = g_nocache = g_ao = s_bf16 = s_ours = s_ao = None
        torch.cuda.empty_cache()
    return lines, step_lines, (ratios, vs_ao), (ratios_g, vs_ao_g), (ratios_s, vs_ao_s)


def compiled_table(subset):
    """torchao's INT8 training under torch.compile (compiles take a minute each: a subset only)."""
    from torchao.prototype.quantized_training import Int8MixedPrecisionTrainingConfig
    from torchao.quantization import quantize_

    lines = ["| model | linear | torchao int8 + torch.compile ms | ours ms | torchao compiled / ours |",
             "|---|---|---|---|---|"]
    vs = []
    for model, name, fin, fout, tok in LINEARS:
        if (model, name) not in subset:
            continue
        x = data(tok, fin).requires_grad_(True)
        dy = data(tok, fout)
        ao = torch.nn.Sequential(torch.nn.Linear(fin, fout, bias=False, device="cuda", dtype=torch.bfloat16))
        quantize_(ao, Int8MixedPrecisionTrainingConfig())
        aoc = torch.compile(ao)
        # a plain bf16 weight (ao[0].weight is torchao's tensor subclass after quantize_)
        w = (torch.randn(fout, fin, device="cuda") * 0.02).bfloat16().requires_grad_(True)
        recipe = Int8Recipe(backend="triton", cache_weights=False)

        def step_aoc():
            x.grad = ao[0].weight.grad = None
            aoc(x).backward(dy)

        def step_ours():
            x.grad = w.grad = None
            int8_linear(x, w, None, recipe).backward(dy)

        t0 = time.time()
        step_aoc()
        step_aoc()
        print(f"  torch.compile of torchao {model} {name}: {time.time() - t0:.0f} s", flush=True)
        t_aoc = bench(step_aoc, rep=100)
        t_ours = bench(step_ours, rep=100)
        vs.append(t_aoc / t_ours)
        lines.append(f"| {model} | {name} | {t_aoc:.2f} | {t_ours:.2f} | {t_aoc / t_ours:.2f}x |")
        print(lines[-1], flush=True)
    return lines, vs


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--skip", default="", help="comma list of sections to skip: gemm,blockgemm,quantize,linear,compile")
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args(argv)
    common.require_cuda(__file__)
    skip = set(filter(None, args.skip.split(",")))
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    head = [f"# INT8 kernel benchmark: {dev}, torch {torch.__version__}, triton {triton.__version__}, "
            f"{datetime.date.today().isoformat()}", ""]
    out = list(head)
    summary = []
    t0 = time.time()
    if "gemm" not in skip:
        lines, ratios = gemm_table(args.quick)
        out += ["## GEMMs (tensorwise scales, bf16 output)", ""] + lines + [""]
        summary.append(f"GEMM ours/BF16: median {statistics.median(ratios):.2f}x, min {min(ratios):.2f}x, "
                       f"max {max(ratios):.2f}x (target >= 1.8x)")
        print(f"[gemm section {time.time() - t0:.0f} s]", flush=True)
        _write(args.out, out, summary)
    if "blockgemm" not in skip:
        lines, ratios = block_gemm_table(args.quick)
        out += ["## Block-scale GEMMs (the block recipe) against row-scale ones", ""] + lines + [""]
        summary.append(f"block-scale GEMM (block size 128) / row-scale GEMM: median {statistics.median(ratios):.2f}x, "
                       f"min {min(ratios):.2f}x, max {max(ratios):.2f}x")
        print(f"[blockgemm section {time.time() - t0:.0f} s]", flush=True)
        _write(args.out, out, summary)
    if "quantize" not in skip:
        lines, fracs, fracs_given, fracs_amax = quantize_table()
        out += ["## Quantize kernels", ""] + lines + [""]
        for what, fr in (("whole call (amax pass + quantize pass), minimal bytes", fracs),
                         ("quantize pass alone, maxima given", fracs_given),
                         ("amax pass alone (reads x)", fracs_amax)):
            summary.append(f"quantize GB/s vs D2D copy, {what}: median {100 * statistics.median(f for _, f in fr):.0f}% "
                           "(target >= 85%); " + ", ".join(f"{label}: {100 * f:.0f}%" for label, f in fr))
        print(f"[quantize section {time.time() - t0:.0f} s]", flush=True)
        _write(args.out, out, summary)
    if "linear" not in skip:
        lines, step_lines, eager, graph, step = linear_table(args.quick)
        out += ["## Linear fwd+bwd, table 1: all quantization included, every call a new optimizer step (weights "
                "quantized in every call)", ""]
        out += lines + [""]
        out += [f"## Linear fwd+bwd, table 2: a training step of {MICRO_BATCHES} micro-batches, CUDA-graphed, ms per "
                "micro-batch (ours: weights quantized once per step; torchao re-quantizes them every call)", ""]
        out += step_lines + [""]
        for what, (ratios, vs_ao) in (("eager, weights quantized in every call", eager),
                                      ("CUDA-graphed, weights quantized in every call", graph),
                                      (f"CUDA-graphed, a step of {MICRO_BATCHES} micro-batches", step)):
            good = [v for v in ratios if v == v]
            good_ao = [v for v in vs_ao if v == v]
            summary.append(
                f"linear fwd+bwd ours (default recipe)/BF16, {what}: median "
                f"{statistics.median(good) if good else float('nan'):.2f}x, min {min(good, default=float('nan')):.2f}x "
                f"(target >= 1.6x); torchao / ours: min {min(good_ao, default=float('nan')):.2f}x "
                "(target > 1 at every shape)")
        print(f"[linear section {time.time() - t0:.0f} s]", flush=True)
        _write(args.out, out, summary)
    if "compile" not in skip and not args.no_compile and not args.quick:
        try:
            lines, vs = compiled_table({("Llama3.1-8B", "fc1"), ("Llama3.1-8B", "fc2")})
            out += ["## torchao INT8 with torch.compile (subset)", ""] + lines + [""]
            summary.append(f"torchao compiled / ours: {', '.join(f'{v:.2f}x' for v in vs)}")
        except Exception as e:  # noqa: BLE001
            print(f"torch.compile section failed: {type(e).__name__}: {e}")
        print(f"[compile section {time.time() - t0:.0f} s]", flush=True)
    text = _write(args.out, out, summary)
    common.record_tables("kernels", text)
    print("\n" + text, flush=True)


def _write(out_dir, out, summary):
    """The tables so far plus the summary, to DIR/bench_kernels.md (rewritten after every section)."""
    text = "\n".join(out + ["## Summary", ""] + [f"- {s}" for s in summary] + [""])
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench_kernels.md"), "w") as fh:
            fh.write(text)
    return text


if __name__ == "__main__":
    main()
