#!/usr/bin/env python3
"""What INT8 health statistics cost end to end (issue #47's target: <= 1% at --int8-stats-interval 100).

One trainer run per mode (eager, and CUDA-graphed with --graphed) with statistics every --interval steps
and a log line every step (so each statistics step also pays its log line's read-out). From the JSONL step
times after --warmup: a normal step's time (the median of the steps without statistics), the extra time of
a statistics step (their mean minus that), and the overhead at interval N = extra / (N x normal step).
Prints a markdown table and appends rows to benchmarks/results/bench_health_overhead.csv ($OUT on the GPU
machine). Needs megatron-core (the trainer).

--probe-only times one probe alone instead (no trainer): the statistics of one probed forward and backward
(LinearProbe.observe_forward + ForwardRecord.observe_backward, read back to the host) of a [tokens, K] x
[K, N] BF16 linear, on any device; the median of --repeats after one warm-up, appended to
benchmarks/results/bench_health_probe.csv (a CPU run's row only to $OUT).

    python benchmarks/bench_health_overhead.py --model llama2_7b --layers 4 --graphed
    python benchmarks/bench_health_overhead.py --probe-only --probe-shape 8192 4096 11008 --device cpu
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import common
from common import BENCH_OVERRIDES, MOCK_DATA, PARALLEL_OVERRIDES, ROOT


def time_probe(opts) -> dict:
    """Seconds of one probe's forward and backward statistics on random BF16 operands with outliers."""
    import time

    import torch

    from megatron_int8.ops.health import LinearProbe
    from megatron_int8.recipe import Int8Recipe

    tokens, k, n = opts.probe_shape
    device = torch.device(opts.device)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, k, device=device, generator=g).to(torch.bfloat16)
    x[:, :4] *= 100.0  # a few outlier channels, as the SwiGLU output has
    w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(torch.bfloat16)
    dy = (torch.randn(tokens, n, device=device, generator=g) * 1e-3).to(torch.bfloat16)
    recipe = Int8Recipe(granularity=opts.granularity)
    seconds = []
    for _ in range(opts.repeats + 1):
        probe = LinearProbe()
        probe.arm()
        start = time.perf_counter()
        probe.observe_forward(x, w, recipe).observe_backward(dy, w)
        probe.take()[0].tolist()  # the read-out waits for the device
        seconds.append(time.perf_counter() - start)
    return {"device": str(device), "shape": f"{tokens}x{k}x{n}", "granularity": opts.granularity,
            "probe_ms": round(statistics.median(seconds[1:]) * 1e3, 2)}


def run(opts, graphed: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = [sys.executable, "-m", "megatron_int8.pretrain", "--config",
               os.path.join(ROOT, "configs", f"{opts.model}.yaml"), *MOCK_DATA, "--num-layers", str(opts.layers),
               "--train-iters", str(opts.iters), "--seq-length", str(opts.seq_length), "--micro-batch-size",
               str(opts.micro_batch_size), "--global-batch-size", str(opts.micro_batch_size * opts.grad_accum),
               "--log-interval", "1", "--eval-iters", "0", "--log-jsonl", log, "--bf16", "--int8-linear",
               "--int8-stats-interval", str(opts.interval), *BENCH_OVERRIDES, *PARALLEL_OVERRIDES]
        if graphed:
            cmd += ["--cuda-graph-impl", "local"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise RuntimeError(f"trainer failed ({'graphed' if graphed else 'eager'}, exit {proc.returncode})")
        with open(log, encoding="utf-8") as f:
            times = {r["iteration"]: r["step_time_s"] for r in map(json.loads, f) if "step_time_s" in r}
    timed = {i: t for i, t in times.items() if i > opts.warmup}
    stats_steps = [t for i, t in timed.items() if i % opts.interval == 0]
    normal = statistics.median(t for i, t in timed.items() if i % opts.interval)
    if not stats_steps:
        raise RuntimeError(f"no statistics step after warm-up: raise --iters above {opts.warmup + opts.interval}")
    extra = statistics.mean(stats_steps) - normal
    return {"model": opts.model, "layers": opts.layers, "mode": "graphed" if graphed else "eager",
            "normal_step_ms": round(normal * 1e3, 2), "stats_step_extra_ms": round(extra * 1e3, 2),
            "stats_steps": len(stats_steps), "overhead_at_100_pct": round(100 * extra / (100 * normal), 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama2_7b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--warmup", type=int, default=8, help="iterations left out (autotuning, graph capture)")
    p.add_argument("--interval", type=common.positive_int, default=10,
                   help="--int8-stats-interval of the measured runs")
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--graphed", action="store_true", help="also measure with --cuda-graph-impl local")
    p.add_argument("--probe-only", action="store_true", help="time one probe alone (see above)")
    p.add_argument("--probe-shape", type=common.positive_int, nargs=3, default=[8192, 4096, 11008],
                   metavar=("TOKENS", "K", "N"))
    p.add_argument("--granularity", choices=("tensor", "row", "block"), default="row")
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=common.positive_int, default=3)
    opts = p.parse_args(argv)
    first = (max(opts.warmup, 0) // opts.interval + 1) * opts.interval  # the first statistics step timed
    if not opts.probe_only and (opts.warmup < 0 or opts.interval < 2 or opts.iters < max(first, opts.warmup + 2)):
        p.error(f"--iters {opts.iters} after --warmup {opts.warmup} must time a statistics step (iteration {first}, "
                f"a multiple of --interval {opts.interval}) and a step without one (--interval >= 2): the trainer "
                "runs would end without them")
    if opts.probe_only:
        r = time_probe(opts)
        print(f"one probe (forward + backward statistics), {r['shape']} {r['granularity']} on {r['device']}: "
              f"{r['probe_ms']} ms")
        common.append_results("bench_health_probe", [r], smoke=not r["device"].startswith("cuda"))
        return 0
    rows = [run(opts, graphed) for graphed in ([False, True] if opts.graphed else [False])]
    print("| model | layers | mode | normal step (ms) | statistics step: extra (ms) | steps | overhead at interval 100 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['layers']} | {r['mode']} | {r['normal_step_ms']} | {r['stats_step_extra_ms']} | "
              f"{r['stats_steps']} | {r['overhead_at_100_pct']}% |")
    common.append_results("bench_health_overhead", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
