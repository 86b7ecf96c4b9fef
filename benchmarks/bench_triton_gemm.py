"""The Triton INT8 GEMMs against the CUDA sm_90a kernel on bench_kernels.py's 42 GEMMs (one Hopper GPU).

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_triton_gemm.py [--variants base,flat,...] [--no-tuned] [--no-wgrad]

Per GEMM (tensorwise scales, bf16 output, as bench_kernels' GEMM table), TOP/s of:
- cuda: the CUDA kernel (MEGATRON_INT8_GEMM_KERNEL=cuda), the reference of every ratio;
- plain, tuned: the pointer kernel autotuned (MEGATRON_INT8_GEMM_KERNEL=plain, what a GPU without the CUDA kernel
  runs; issue #50's "Triton only");
- tma, tuned: the persistent TMA kernel autotuned over its config list (MEGATRON_INT8_GEMM_KERNEL=tma);
- each TMA variant (MEGATRON_INT8_GEMM_TMA_VARIANT, int8_gemm.TMA_VARIANTS), a fixed configuration.
Every Triton output is compared with the CUDA kernel's (both are bit-identical to the reference backend): the
`mismatches` column counts the GEMMs where one differs. Then the wgrads (Llama/Qwen/Mixtral, 14) again into an fp32
main_grad (accumulate_into: the TMA reduce-add epilogue), the way training runs them.
Summary: per kernel the median, min and max of its speed / the CUDA kernel's, and "best variant per GEMM" (what a
per-shape table of the fixed variants would reach). Medians of triton.testing.do_bench (L2 flushed before each
call), inputs rotated among copies. Tables to $OUT/bench_triton_gemm.md and, through common.record_tables, to
results/triton_gemm_*.csv.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import time

import torch
import triton

import common  # puts the repository on sys.path
from bench_kernels import LINEARS, bench, data, n_copies, rotating

from megatron_int8.dispatch import CHOICES, ENV_GEMM_KERNEL, ENV_GEMM_TMA_VARIANT
from megatron_int8.kernels import int8_gemm as G
from megatron_int8.reference import ReferenceBackend

REF = ReferenceBackend()


def gemms():
    """(label, M, N, K) of bench_kernels' GEMM table: fprop, dgrad and wgrad of every linear."""
    out = []
    for model, name, fin, fout, tok in LINEARS:
        for gemm, (M, N, K) in (("fprop", (tok, fout, fin)), ("dgrad", (tok, fin, fout)), ("wgrad", (fout, fin, tok))):
            out.append((f"{model} {name} {gemm}", M, N, K))
    return out


def kernels(variants, tuned):
    """name -> the environment that selects it (MEGATRON_INT8_GEMM_KERNEL, MEGATRON_INT8_GEMM_TMA_VARIANT, autotune)."""
    table = {"cuda": ("cuda", "base", False)}
    if tuned:
        table["plain, tuned"] = ("plain", "base", True)
        table["tma, tuned"] = ("tma", "base", True)
    for v in variants:
        table[f"tma {v}"] = ("tma", v, False)
    return table


_AS_LAUNCHED = {k: os.environ.get(k) for k in (ENV_GEMM_KERNEL, ENV_GEMM_TMA_VARIANT)}


def _set_env(env: dict) -> None:
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def as_launched():
    """The kernel switches as the benchmark was launched (select() changes them), so that the results' recorded
    command is the one that ran."""
    current = {k: os.environ.get(k) for k in _AS_LAUNCHED}
    _set_env(_AS_LAUNCHED)
    try:
        yield
    finally:
        _set_env(current)


def select(selection) -> bool:
    """Set the kernel's environment (read by triton_gemm's plan key); returns its autotune flag."""
    kernel, variant, autotune = selection
    os.environ[ENV_GEMM_KERNEL], os.environ[ENV_GEMM_TMA_VARIANT] = kernel, variant
    return autotune


def destination(main) -> dict:
    """triton_gemm's output keywords: added into a copy of the fp32 `main` (a wgrad into main_grad), or bf16."""
    return dict(out_dtype=torch.float32, accumulate_into=main.clone()) if main is not None else dict(
        out_dtype=torch.bfloat16)


def operands(M, N, K):
    """Tensorwise Q(a) [M, K] and Q(b) [N, K] of fresh bf16 data with an outlier channel."""
    kw = dict(granularity="tensor", block_size=128, rowwise=True, columnwise=False)
    return REF.quantize(data(M, K), weight=False, **kw)[0], REF.quantize(data(N, K), weight=True, **kw)[0]


def warm_up(table):
    """Compile (and tune) every kernel once on a 256^3 GEMM, which Triton specializes as the benchmark's GEMMs
    (integers and strides divisible by 16, K a multiple of 128, no tile pruned): fills Triton's on-disk cache."""
    for accumulate in (False, True):
        for name, sel in table.items():
            if accumulate and "tuned" in name:
                continue
            autotune = select(sel)
            main = torch.zeros(256, 256, device="cuda") if accumulate else None
            try:
                G.triton_gemm(*operands(256, 256, 256), autotune=autotune, **destination(main))
            except Exception as e:  # noqa: BLE001  (the benchmark itself reports it)
                print(f"warm-up of {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    torch.cuda.synchronize()


def measure(M, N, K, table, accumulate):
    """{kernel: TOP/s}, and the kernels whose output differs from the CUDA kernel's."""
    n = n_copies(M * K + N * K)
    qs = rotating(lambda: operands(M, N, K), n)
    main = torch.randn(M, N, device="cuda") if accumulate else None
    flops = 2.0 * M * N * K
    speeds, outputs, differ = {}, {}, []
    for name, sel in table.items():
        autotune = select(sel)
        kw = destination(main)
        qa, qb = qs()
        try:
            out = G.triton_gemm(qa, qb, autotune=autotune, **kw)  # compiles, and tunes the tuned ones
        except Exception as e:  # noqa: BLE001  (e.g. a variant out of shared memory: the others still run)
            if name == "cuda":
                raise
            print(f"{name} failed on {M} x {N} x {K}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            speeds[name] = float("nan")
            differ.append(f"{name} (failed)")
            continue
        if accumulate:
            kw["accumulate_into"] = main.clone()  # timed calls keep adding into it
        t = bench(lambda: G.triton_gemm(*qs(), autotune=autotune, **kw))
        outputs[name] = (qa, qb, out)
        speeds[name] = flops / (t * 1e-3) / 1e12
    # the same operands through the CUDA kernel: every output must be identical
    select(table["cuda"])
    for name, (qa, qb, out) in outputs.items():
        kw = destination(main)
        if name != "cuda" and not torch.equal(out, G.triton_gemm(qa, qb, **kw)):
            differ.append(name)
    torch.cuda.empty_cache()
    return speeds, differ


def table_for(title, rows, names):
    lines = [f"## {title}", "", "| GEMM | M, N, K | " + " | ".join(f"{n} TOP/s" for n in names) + " | "
             + " | ".join(f"{n} / cuda" for n in names[1:]) + " | best variant | mismatches |",
             "|" + "---|" * (2 * len(names) + 3)]
    for label, (M, N, K), speeds, differ in rows:
        variants = {n: s for n, s in speeds.items() if n.startswith("tma ") and "tuned" not in n and s == s}
        best = max(variants, key=variants.get) if variants else ""
        lines.append(f"| {label} | {M}, {N}, {K} | " + " | ".join(f"{speeds[n]:.0f}" for n in names) + " | "
                     + " | ".join(f"{speeds[n] / speeds['cuda']:.3f}" for n in names[1:])
                     + f" | {best} | {', '.join(differ) or 'none'} |")
    return lines


def summary_for(title, rows, names):
    lines = [f"## {title}", "", "| kernel | median speed / cuda | min | max | median TOP/s | GEMMs failed |",
             "|---|---|---|---|---|---|"]
    nan = float("nan")

    def stats(values):
        ok = [v for v in values if v == v]
        return (statistics.median(ok), min(ok), max(ok)) if ok else (nan, nan, nan)

    for n in names[1:]:
        med, lo, hi = stats([s[n] / s["cuda"] for _, _, s, _ in rows])
        failed = sum(s[n] != s[n] for _, _, s, _ in rows)
        lines.append(f"| {n} | {med:.3f} | {lo:.3f} | {hi:.3f} | {stats([s[n] for _, _, s, _ in rows])[0]:.0f} | "
                     f"{failed} |")
    variant_names = [n for n in names if n.startswith("tma ") and "tuned" not in n]
    if variant_names:
        med, lo, hi = stats([max((s[n] for n in variant_names if s[n] == s[n]), default=nan) / s["cuda"]
                             for _, _, s, _ in rows])
        lines.append(f"| best variant per GEMM | {med:.3f} | {lo:.3f} | {hi:.3f} | | |")
    lines.append(f"| cuda | 1.000 | | | {statistics.median(s['cuda'] for _, _, s, _ in rows):.0f} | 0 |")
    return lines


def run_section(title, summary_title, shapes, table, accumulate, t0):
    """Measure every (label, M, N, K) of `shapes` (each distinct shape once) and return its markdown lines."""
    seen, rows = {}, []
    for label, M, N, K in shapes:
        if (M, N, K) not in seen:
            seen[(M, N, K)] = measure(M, N, K, table, accumulate)
        speeds, differ = seen[(M, N, K)]
        rows.append((label, (M, N, K), speeds, differ))
        print(f"{label:32s} {M:6d} {N:6d} {K:6d} " + " ".join(f"{n}={s:.0f}" for n, s in speeds.items())
              + (f" MISMATCH {differ}" if differ else "") + f" [{time.time() - t0:.0f} s]", flush=True)
    names = list(table)
    return table_for(title, rows, names) + [""] + summary_for(summary_title, rows, names) + [""]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(CHOICES[ENV_GEMM_TMA_VARIANT]))
    p.add_argument("--no-tuned", action="store_true", help="skip the autotuned plain and TMA kernels")
    p.add_argument("--no-wgrad", action="store_true", help="skip the fp32 main_grad table")
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--warmup", action="store_true", help="only compile every kernel (warm_up), then exit")
    opts = p.parse_args()
    variants = [v for v in opts.variants.split(",") if v]
    unknown = set(variants) - set(CHOICES[ENV_GEMM_TMA_VARIANT])
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}: choose from {CHOICES[ENV_GEMM_TMA_VARIANT]}")
    if not torch.cuda.is_available() or not G.sm90_gemm.available():
        raise SystemExit("needs a Hopper GPU with the CUDA kernel available (nvcc): "
                         f"{G.sm90_gemm.unavailable_reason() if torch.cuda.is_available() else 'no CUDA'}")
    torch.manual_seed(0)
    table = kernels(variants, not opts.no_tuned)
    if opts.warmup:
        warm_up(table)
        print(f"[warm-up done: {len(table)} kernels]", flush=True)
        return
    out = [f"# Triton INT8 GEMMs vs the CUDA kernel: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
           f"triton {triton.__version__}, {datetime.date.today().isoformat()}", ""]
    t0 = time.time()
    section = run_section("GEMMs, bf16 output (tensorwise scales)", "Summary, bf16 output: speed / the CUDA kernel's",
                          gemms(), table, False, t0)
    out += section
    _write(opts.out, out, section)  # kept should the wgrad section run out of time
    if not opts.no_wgrad:
        section = run_section("Wgrads into an fp32 main_grad (accumulate_into)",
                              "Summary, wgrads into main_grad: speed / the CUDA kernel's",
                              [g for g in gemms() if g[0].endswith("wgrad")],
                              {n: sel for n, sel in table.items() if "tuned" not in n}, True, t0)
        out += section
        _write(opts.out, out, section)
    print("\n" + "\n".join(out), flush=True)


def _write(out_dir, out, section):
    """All tables so far to DIR/bench_triton_gemm.md; the new section's tables to the results CSVs."""
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench_triton_gemm.md"), "w") as fh:
            fh.write("\n".join(out))
    with as_launched():
        common.record_tables("triton_gemm", "\n".join(section))


if __name__ == "__main__":
    main()
