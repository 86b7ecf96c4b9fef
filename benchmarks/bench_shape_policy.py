"""Int8Recipe(shape_policy="auto") over bench_kernels' shape sweep plus small linears: per shape, what the
first-use timing measured (INT8 and BF16 fwd+bwd, eager, weight quantized in every call), what auto chose,
and auto's own fwd+bwd against BF16 nn.Linear (target: >= 1.0x everywhere).

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_shape_policy.py [--iters 30] [--rounds 5]

Auto and BF16 are timed in alternation, `--rounds` times each, and the speed is the median of the rounds' ratios:
at the small shapes a step is bound by host time, and single timings there spread by about 10%.

Appends to benchmarks/results/shape_policy_v2.csv ($OUT/shape_policy_v2.csv on the GPU machine). About 2 minutes on
an H100.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import common  # noqa: F401  (puts the repository on sys.path)
from common import append_results, time_ms

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
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    opts = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_shape_policy.py needs a CUDA GPU")
    auto = Int8Recipe(shape_policy="auto")
    lines = ["| model | linear | tokens, in -> out | timed INT8 ms | timed BF16 ms | auto runs | auto / BF16 |",
             "|---|---|---|---|---|---|---|"]
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
        rounds = [(time_ms(step(lambda: int8_linear(x, w, None, auto)), warmup=3, iters=opts.iters),
                   time_ms(step(lambda: F.linear(x, w)), warmup=3, iters=opts.iters)) for _ in range(opts.rounds)]
        auto_ms = statistics.median(a for a, _ in rounds)
        bf16_ms = statistics.median(b for _, b in rounds)
        speed = statistics.median(b / a for a, b in rounds)
        lines.append(f"| {model} | {name} | {tok}, {fin} -> {fout} | {decision.int8_ms:.3f} | {decision.hp_ms:.3f} "
                     f"| {decision.precision} | {speed:.3f}x |")
        rows.append({"model": model, "linear": name, "tokens": tok, "in": fin, "out": fout,
                     "timed_int8_ms": round(decision.int8_ms, 4), "timed_bf16_ms": round(decision.hp_ms, 4),
                     "auto_runs": decision.precision, "auto_ms": round(auto_ms, 4), "bf16_ms": round(bf16_ms, 4),
                     "auto_vs_bf16": round(speed, 4)})
        print(lines[-1], flush=True)
    print(f"\nshape_policy='auto', eager fwd+bwd, {torch.cuda.get_device_name()}\n" + "\n".join(lines))
    append_results("shape_policy_v2", rows)


if __name__ == "__main__":
    main()
