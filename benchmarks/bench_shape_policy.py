"""Int8Recipe(shape_policy="auto") over bench_kernels' shape sweep plus small linears: per shape, what the
first-use timing measured (INT8 and BF16 fwd+bwd, eager, weight quantized in every call), what auto chose,
and auto's own fwd+bwd against BF16 nn.Linear (target: >= 1.0x everywhere).

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_shape_policy.py [--iters 30] [--rounds 7]

Each round times BF16, auto, BF16 again; the speed is the median over `--rounds` rounds of auto's time against the
mean of its two BF16 neighbours. Where auto runs BF16 the GPU work is the same, and at the small shapes a step is
bound by host time, whose timings spread by 10% and more: the "BF16 A/A" column is the median of the two BF16
timings' ratio minus one, in either direction, i.e. how far apart two timings of the same thing were.

Appends to benchmarks/results/shape_policy_v2.csv ($OUT/shape_policy_v2.csv on the GPU machine). About 2 minutes on
an H100.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import common  # noqa: F401  (puts the repository on sys.path)
from common import append_results, positive_int, require_cuda, time_ms

from bench_kernels import LINEARS  # noqa: E402
from megatron_int8 import Int8Recipe, int8_linear  # noqa: E402
from megatron_int8.ops import shape_policy  # noqa: E402

# small linears where INT8 has lost eager (issue #49): Qwen3-4B's attention projection at 8192 tokens and a
# 1024-wide, 4-layer model as in the upstream Megatron-LM smoke test
SMALL = [("Qwen3-4B", "proj", 4096, 2560, 8192), ("smoke-1024", "qkv", 1024, 3 * 1024, 8192),
         ("smoke-1024", "proj", 1024, 1024, 8192), ("smoke-1024", "fc1", 1024, 2 * 4096, 8192),
         ("smoke-1024", "fc2", 4096, 1024, 8192)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=positive_int, default=30)
    p.add_argument("--rounds", type=int, default=7)
    opts = p.parse_args(argv)
    require_cuda(__file__)
    auto = Int8Recipe(shape_policy="auto")
    lines = ["| model | linear | tokens, in -> out | timed INT8 ms | timed BF16 ms | auto runs | auto / BF16 "
             "| BF16 A/A |", "|---|---|---|---|---|---|---|---|"]
    rows = []
    for model, name, fin, fout, tok in LINEARS + SMALL:
        x = torch.randn(tok, fin, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(fout, fin, device="cuda", dtype=torch.bfloat16) * fin ** -0.5).requires_grad_(True)
        dy = torch.randn(tok, fout, device="cuda", dtype=torch.bfloat16)

        def step(linear):
            def run():
                linear().backward(dy)
                x.grad = w.grad = None
            return run

        step(lambda: int8_linear(x, w, None, auto))()  # the first call measures and decides
        decision = next(d for d in shape_policy.decisions() if (d.tokens, d.in_features, d.out_features)
                        == (tok, fin, fout))
        bf16, run_auto = step(lambda: F.linear(x, w)), step(lambda: int8_linear(x, w, None, auto))
        rounds = [tuple(time_ms(f, warmup=3, iters=opts.iters) for f in (bf16, run_auto, bf16))
                  for _ in range(opts.rounds)]
        auto_ms = statistics.median(a for _, a, _ in rounds)
        bf16_ms = statistics.median([r[0] for r in rounds] + [r[2] for r in rounds])
        speed = statistics.median((b + b2) / 2 / a for b, a, b2 in rounds)
        spread = statistics.median(abs(b2 / b - 1) for b, _, b2 in rounds)
        lines.append(f"| {model} | {name} | {tok}, {fin} -> {fout} | {decision.int8_ms:.3f} | {decision.hp_ms:.3f} "
                     f"| {decision.precision} | {speed:.3f}x | {spread:.1%} |")
        rows.append({"model": model, "linear": name, "tokens": tok, "in": fin, "out": fout,
                     "timed_int8_ms": round(decision.int8_ms, 4), "timed_bf16_ms": round(decision.hp_ms, 4),
                     "auto_runs": decision.precision, "auto_ms": round(auto_ms, 4), "bf16_ms": round(bf16_ms, 4),
                     "auto_vs_bf16": round(speed, 4), "bf16_aa_spread": round(spread, 4)})
        print(lines[-1], flush=True)
    print(f"\nshape_policy='auto', eager fwd+bwd, {torch.cuda.get_device_name()}\n" + "\n".join(lines))
    append_results("shape_policy_v2", rows)


if __name__ == "__main__":
    main()
