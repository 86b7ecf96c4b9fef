"""Benchmark Mixtral's expert GEMMs on one Hopper GPU, per-expert loops vs grouped launches; one markdown table.

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_moe_gemm.py [--quick] [--tokens 8192] [--out FILE]

Mixtral-8x7B's experts (hidden 4096, ffn 14336, SwiGLU): fc1 [T, 4096] -> [T, 28672], fc2 [T, 14336] ->
[T, 4096], with E = 8 local experts sharing `--tokens` routed tokens, mildly skewed (the counts of a
fixed-seed multinomial). One row per GEMM (fprop, dgrad, wgrad of fc1 and fc2; --quick: fc1 only):
- BF16 loop: torch.mm per expert on its slice of the token-sorted input;
- BF16 grouped: torch._grouped_mm, the cumulative token counts as int32 offsets (n/a, with the reason
  below the table, where it does not run);
- INT8 loop: what the per-expert INT8 linears run, triton_gemm(autotune=False) per expert on operands
  quantized per expert (Q(x_e) unpadded, Q(x_e^T) padded to 16 tokens);
- INT8 grouped: triton_grouped_gemm, one launch for all experts on the 128-row aligned layout (fprop,
  dgrad; on Hopper the CUDA kernel's grouped mode); wgrad: triton_gemm(autotune=False) per expert on the
  aligned column slices of the segmented Q(x^T) (quantize.segment_operand);
- INT8 grouped Triton (fprop, dgrad): the same launch kept on Triton's TMA kernel (the Hopper route with the CUDA
  kernel made unavailable: what a Hopper without nvcc runs, and what the grouped GEMMs ran before the CUDA mode).
The BF16 wgrads write bf16; the INT8 wgrads accumulate into fp32 main_grad buffers (Megatron's
gradient-accumulation fusion; row "wgrad, INT8 into main_grad") or write bf16 (row "wgrad, INT8 bf16
out"). Then one row per quantized tensor (--quick: fc1's input): the per-expert loop of row-wise
both-axes quantizes vs one segmented both-axes quantize (columnwise_segments) of the aligned layout.
TOP/s count the routed tokens' work, 2 * T * N * K, for every column (not the alignment rows); the
speedups are time ratios. Medians of triton.testing.do_bench, which flushes L2 before each call; the
first call of each variant (compilation) runs before the timing.
"""
from __future__ import annotations

import argparse
import importlib
import os

import torch
import triton

import common  # noqa: E402  (puts the repository on sys.path)

from megatron_int8.kernels import triton_gemm, triton_grouped_gemm, triton_quantize  # noqa: E402
from megatron_int8.dispatch import ENV_GEMM_KERNEL  # noqa: E402
from megatron_int8.kernels import sm90_gemm  # noqa: E402

qref = importlib.import_module("megatron_int8.reference")
QKW = dict(granularity="row", block_size=128, check_finite="off")
COLUMNS = ("bf16 loop", "bf16 grouped", "int8 loop", "int8 grouped", "int8 grouped triton")


def routing(tokens: int, experts: int, seed: int) -> list:
    """Token counts per expert: `tokens` draws from a fixed-seed, mildly uneven distribution."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(experts, generator=g) * 0.3, 0)
    picks = torch.multinomial(probs, tokens, replacement=True, generator=g)
    return torch.bincount(picks, minlength=experts).tolist()


def activation(rows: int, cols: int) -> torch.Tensor:
    x = torch.randn(rows, cols, device="cuda")
    x[:, 5] *= 30  # an outlier channel
    return x.bfloat16()


class Experts:
    """The token layouts of one routing: sorted and unpadded (the loops), and 128-row aligned (grouped)."""

    def __init__(self, counts):
        self.counts = counts
        self.seg = qref.Segments.for_counts(counts)
        ends = torch.tensor(counts).cumsum(0)
        self.bounds = [(int(e - c), int(e)) for c, e in zip(counts, ends)]  # unpadded [lo, hi) per expert
        self.offs = ends.to(device="cuda", dtype=torch.int32)  # torch._grouped_mm's offsets
        rows = torch.cat([torch.arange(a, a + c) for a, c in zip(self.seg.offsets, counts)])
        self.rows = rows.cuda()  # aligned row of each sorted token

    def aligned(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.seg.rows, x.shape[1], dtype=x.dtype, device=x.device)
        out[self.rows] = x
        return out

    def active(self):
        return [e for e, c in enumerate(self.counts) if c]


def bench(fn) -> float:
    fn()  # compile / first-call work outside the timing
    torch.cuda.synchronize()
    return common.median_ms(fn, warmup=10, rep=50)


def on_triton(fn):
    """fn run with the grouped GEMM kept on Triton's persistent TMA kernel: the Hopper route without the CUDA
    kernel (triton_grouped_gemm plans nothing, so it reads both at every call)."""
    def run():
        old, available = os.environ.get(ENV_GEMM_KERNEL), sm90_gemm.available
        os.environ[ENV_GEMM_KERNEL], sm90_gemm.available = "hopper", lambda: False
        try:
            return fn()
        finally:
            sm90_gemm.available = available
            if old is None:
                del os.environ[ENV_GEMM_KERNEL]
            else:
                os.environ[ENV_GEMM_KERNEL] = old
    return run


def quantize_both(x, **kw):
    return triton_quantize(x, weight=False, rowwise=True, columnwise=True, **QKW, **kw)


def stacked(qs):
    """[E, N, K] data and [E, N] scales from the experts' row-wise QTensors."""
    return qref.QTensor(torch.stack([q.data for q in qs]), torch.stack([q.scale for q in qs]), "row")


def quantize_weights(w: torch.Tensor):
    """Stacked Q(W_e) [E, N, K] and Q(W_e^T) [E, K, N], one expert at a time."""
    rows, cols = [], []
    for e in range(w.shape[0]):
        r, c = triton_quantize(w[e], weight=True, rowwise=True, columnwise=True, **QKW)
        rows.append(r)
        cols.append(c)
    return stacked(rows), stacked(cols)


def per_expert(q: qref.QTensor, e: int) -> qref.QTensor:
    return qref.QTensor(q.data[e], q.scale[e], "row")


def layer_rows(ex: Experts, name: str, n_in: int, n_out: int, notes: list, quantize_grad: bool):
    """Times fprop, dgrad and wgrad of one expert linear [n_out, n_in] for every column, and the quantize of
    its input (and of its output gradient); returns (GEMM rows, quantize rows). Failures go to `notes`."""
    E, T = len(ex.counts), sum(ex.counts)
    x, g = activation(T, n_in), activation(T, n_out)
    w = torch.randn(E, n_out, n_in, device="cuda", dtype=torch.bfloat16) * 0.02
    qw, qwt = quantize_weights(w)
    # INT8 loop operands: per expert, as the per-expert linears quantize them
    qx_e = [quantize_both(x[lo:hi], columnwise_pad=16) for lo, hi in ex.bounds]
    qg_e = [quantize_both(g[lo:hi], columnwise_pad=16) for lo, hi in ex.bounds]
    # INT8 grouped operands: one segmented quantize per tensor
    qx_r, qx_c = quantize_both(ex.aligned(x), columnwise_segments=ex.seg, columnwise_pad=16)
    qg_r, qg_c = quantize_both(ex.aligned(g), columnwise_segments=ex.seg, columnwise_pad=16)
    active = ex.active()
    bf16 = torch.bfloat16

    def mm_loop(a, b_of, out):
        for e in active:
            lo, hi = ex.bounds[e]
            torch.mm(a[lo:hi], b_of(e), out=out[lo:hi])

    def wgrad_loop(out):
        for e in active:
            lo, hi = ex.bounds[e]
            torch.mm(g[lo:hi].t(), x[lo:hi], out=out[e])

    def int8_wgrad(operands, main=None):
        for e in active:
            triton_gemm(*operands(e), out_dtype=bf16 if main is None else torch.float32,
                        accumulate_into=None if main is None else main[e], autotune=False)

    loop_ops = lambda e: (qg_e[e][1], qx_e[e][1])  # noqa: E731
    grouped_ops = lambda e: (qref.segment_operand(qg_c, ex.seg, e), qref.segment_operand(qx_c, ex.seg, e))  # noqa: E731

    y, dx = torch.empty(T, n_out, device="cuda", dtype=bf16), torch.empty(T, n_in, device="cuda", dtype=bf16)
    dw, main = torch.empty(E, n_out, n_in, device="cuda", dtype=bf16), torch.zeros(E, n_out, n_in, device="cuda")
    cases = [  # (GEMM, N, K, the BF16 loop's output, {column: fn})
        ("fprop", n_out, n_in, y, {
            "bf16 loop": lambda: mm_loop(x, lambda e: w[e].t(), y),
            "bf16 grouped": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=ex.offs),
            "int8 loop": lambda: [triton_gemm(qx_e[e][0], per_expert(qw, e), out_dtype=bf16, autotune=False)
                                  for e in active],
            "int8 grouped": lambda: triton_grouped_gemm(qx_r, qw, ex.seg, out_dtype=bf16),
            "int8 grouped triton": on_triton(lambda: triton_grouped_gemm(qx_r, qw, ex.seg, out_dtype=bf16))}),
        ("dgrad", n_in, n_out, dx, {
            "bf16 loop": lambda: mm_loop(g, lambda e: w[e], dx),
            "bf16 grouped": lambda: torch._grouped_mm(g, w, offs=ex.offs),
            "int8 loop": lambda: [triton_gemm(qg_e[e][0], per_expert(qwt, e), out_dtype=bf16, autotune=False)
                                  for e in active],
            "int8 grouped": lambda: triton_grouped_gemm(qg_r, qwt, ex.seg, out_dtype=bf16),
            "int8 grouped triton": on_triton(lambda: triton_grouped_gemm(qg_r, qwt, ex.seg, out_dtype=bf16))}),
        ("wgrad, INT8 into main_grad", n_out, n_in, dw, {
            "bf16 loop": lambda: wgrad_loop(dw),
            "bf16 grouped": lambda: torch._grouped_mm(g.t(), x, offs=ex.offs),
            "int8 loop": lambda: int8_wgrad(loop_ops, main),
            "int8 grouped": lambda: int8_wgrad(grouped_ops, main)}),
        ("wgrad, INT8 bf16 out", n_out, n_in, dw, {
            "bf16 loop": lambda: wgrad_loop(dw),
            "bf16 grouped": lambda: torch._grouped_mm(g.t(), x, offs=ex.offs),
            "int8 loop": lambda: int8_wgrad(loop_ops),
            "int8 grouped": lambda: int8_wgrad(grouped_ops)}),
    ]
    rows = []
    for gemm, N, K, loop_out, fns in cases:
        label = f"{name} {gemm}"
        times = {}
        for col in COLUMNS:  # the BF16 loop first: its output checks torch._grouped_mm's
            if col not in fns:  # the wgrads have no Triton-grouped variant
                times[col] = float("nan")
                continue
            try:
                if col == "bf16 grouped":
                    got = fns[col]().float()
                    err = ((got - loop_out.float()).norm() / loop_out.float().norm()).item()
                    del got
                    if not err < 1e-2:
                        raise RuntimeError(f"differs from the per-expert products (relative error {err:.3g})")
                times[col] = bench(fns[col])
            except Exception as exc:  # noqa: BLE001  (torch._grouped_mm may be missing or reject a layout)
                times[col] = float("nan")
                notes.append(f"{label}, {col}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            torch.cuda.empty_cache()
        rows.append(gemm_row(label, T, N, K, times))
    quant = [quantize_row(f"quantize {name} input [T, {n_in}]", ex, x)]
    if quantize_grad:
        quant.append(quantize_row(f"quantize {name} output grad [T, {n_out}]", ex, g))
    return rows, quant


def quantize_row(label: str, ex: Experts, x: torch.Tensor) -> str:
    """Row-wise both-axes quantize: per expert (unpadded slices) vs segmented (aligned layout)."""
    xa = ex.aligned(x)
    t_loop = bench(lambda: [quantize_both(x[lo:hi], columnwise_pad=16) for lo, hi in ex.bounds if hi > lo])
    t_seg = bench(lambda: quantize_both(xa, columnwise_segments=ex.seg, columnwise_pad=16))
    return (f"| {label} | - | - | - | {t_loop:.3f} | {t_seg:.3f} | - | - | - | - | - | - | - | - | - | "
            f"{t_loop / t_seg:.2f}x | - |")


def gemm_row(label: str, T: int, N: int, K: int, times: dict) -> str:
    tops = {c: 2.0 * T * N * K / (t * 1e-3) / 1e12 for c, t in times.items()}
    ms = " | ".join("n/a" if t != t else f"{t:.3f}" for t in times.values())
    rate = " | ".join("n/a" if v != v else f"{v:.0f}" for v in tops.values())
    ratio = lambda a, b: "n/a" if times[a] != times[a] or times[b] != times[b] else f"{times[a] / times[b]:.2f}x"  # noqa: E731
    return (f"| {label} | {N}, {K} | {ms} | {rate} | {ratio('bf16 loop', 'int8 loop')} | "
            f"{ratio('bf16 loop', 'int8 grouped')} | {ratio('bf16 grouped', 'int8 grouped')} | "
            f"{ratio('int8 loop', 'int8 grouped')} | {ratio('int8 grouped triton', 'int8 grouped')} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fc1's GEMMs and its input's quantize only")
    p.add_argument("--tokens", type=int, default=8192, help="routed tokens over all local experts")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--seed", type=int, default=0, help="of the routing")
    p.add_argument("--out", type=common.output_file, help="also write the table to this file")
    args = p.parse_args(argv)
    common.require_cuda(__file__)
    counts = routing(args.tokens, args.experts, args.seed)
    ex = Experts(counts)
    head = [f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}",
            f"{args.experts} experts, {args.tokens} routed tokens: {counts} ({ex.seg.rows} aligned rows)", "",
            "| GEMM | N, K | BF16 loop ms | BF16 grouped ms | INT8 loop ms | INT8 grouped ms "
            "| INT8 grouped Triton ms | BF16 loop TFLOP/s | BF16 grouped TFLOP/s | INT8 loop TOP/s "
            "| INT8 grouped TOP/s | INT8 grouped Triton TOP/s | INT8 loop vs BF16 loop | INT8 grouped vs BF16 loop "
            "| INT8 grouped vs BF16 grouped | INT8 grouped vs INT8 loop | INT8 grouped vs Triton grouped |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(head), flush=True)
    layers = [("fc1", args.hidden, 2 * args.ffn)] + ([] if args.quick else [("fc2", args.ffn, args.hidden)])
    notes, rows, quant = [], [], []
    for name, n_in, n_out in layers:
        r, q = layer_rows(ex, name, n_in, n_out, notes, quantize_grad=not args.quick)
        rows += r
        quant += q
        print("\n".join(r), flush=True)
        torch.cuda.empty_cache()
    print("\n".join(quant))
    lines = head + rows + quant + [""] + [f"- {n}" for n in notes]
    common.record_tables("moe_gemm", "\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    if notes:
        print("\n" + "\n".join(f"- {n}" for n in notes))


if __name__ == "__main__":
    main()
