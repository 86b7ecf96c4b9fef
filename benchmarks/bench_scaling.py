#!/usr/bin/env python3
"""Scale-out throughput, INT8 vs BF16, on several GPUs of one host (issue #7; docs/scaling.md).

Every layout trains its model at full depth through the project's trainer under torchrun (NCCL), on mock
data, once per variant: BF16 (the baseline), INT8 (`--int8-linear`, the default row-wise recipe), and for
the sequence-parallel Llama2-7B layouts also INT8 with `--int8-all-gather` and the tensorwise recipe
(scales with stochastic rounding of gradients) without and with it, which isolates the INT8 SP
all-gather (quantize each rank's shard with the group's scales, gather INT8) against the default BF16
gather. Each run is `benchmarks/bench_e2e.py`'s `run_trainer` (median step time after --warmup
iterations, loss, rank 0's peak memory, model TFLOP/s per GPU). Global batch = micro-batch x GPUs, so every
layout trains on the same tokens per iteration (seq x micro x GPUs) and data-parallel ranks accumulate.

After every run its result goes to RESULTS/<layout>__<variant>.json and the markdown table is rewritten,
so a device call cut short still returns what finished; `--deadline` keeps the whole call inside a time
limit (later runs get the time left, or are skipped and listed as such).

    python benchmarks/bench_scaling.py                                   # the 4-GPU layouts, 50 iterations
    python benchmarks/bench_scaling.py --layouts llama2_7b-tp2sp-dp2 --iters 60 --deadline 500
    python benchmarks/bench_scaling.py --smoke                           # CPU, gloo, 2 processes, tiny widths
    python benchmarks/bench_scaling.py --report DIR [DIR ...]            # one table from earlier calls' results

Outputs (default directory: $OUT, else runs/scaling): bench_scaling.md (the table), scaling_results/*.json.
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and CUDA_DEVICE_MAX_CONNECTIONS=1 are set for every
run (NVLink multicast off on the lent machines; megatron's TP/SP communication ordering).
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import re
import sys
import time

from common import (KILL_AFTER_S, record_tables, add_data_arguments, check_timed_iterations,  # noqa: E402
                    describe_data, full_depth, global_batch, model_config, run_trainer)

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
TENSORWISE = ["--int8-granularity", "tensor", "--int8-grad-rounding", "stochastic"]
VARIANTS = {  # name -> (label, INT8 linears, extra trainer flags)
    "bf16": ("BF16", False, []),
    "int8": ("INT8 (row-wise, the default)", True, []),
    "int8-int8ag": ("INT8 (row-wise), INT8 SP all-gather", True, ["--int8-all-gather"]),
    "int8-tensor": ("INT8 tensorwise + SR", True, TENSORWISE),
    "int8-tensor-int8ag": ("INT8 tensorwise + SR, INT8 SP all-gather", True, TENSORWISE + ["--int8-all-gather"]),
}
SP_VARIANTS = ("bf16", "int8", "int8-int8ag", "int8-tensor", "int8-tensor-int8ag")
# INT8-gather variant -> (the same recipe with the default BF16 gather, its name)
ALL_GATHER_PAIRS = {"int8-int8ag": ("int8", "row-wise"), "int8-tensor-int8ag": ("int8-tensor", "tensorwise + SR")}
# Tiny widths for --smoke (CPU): every model keeps its structure (GQA, MoE, untied, SwiGLU) at width 64.
SMOKE_MODEL = ["--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
               "--kv-channels", "16", "--moe-ffn-hidden-size", "128", "--max-position-embeddings", "64",
               "--num-workers", "0"]
SMOKE_GQA = ["--num-query-groups", "2"]  # for the models with grouped-query attention
SMOKE_MOCK_VOCAB = ["--vocab-size", "512"]  # a corpus brings its tokenizer's vocabulary
SMOKE_LAYERS, SMOKE_SEQ = 2, 64


@dataclasses.dataclass(frozen=True)
class Layout:
    model: str  # configs/<model>.yaml
    nproc: int
    flags: str  # every parallel size explicit: the YAMLs carry 8-GPU layouts
    title: str
    variants: tuple = ("bf16", "int8")
    smoke_flags: str = ""  # the same parallelism kinds on 2 CPU processes

    def accepts(self, variant: str) -> bool:
        """Its own variants; with sequence parallelism also every SP variant, when --variants names it."""
        return variant in self.variants or (variant in SP_VARIANTS and "--sequence-parallel" in self.flags)


def _sizes(tp=1, pp=1, ep=1):
    return (f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} "
            f"--expert-model-parallel-size {ep}")


LAYOUTS = {
    "llama2_7b-tp2sp-dp2": Layout(
        "llama2_7b", 4, _sizes(tp=2) + " --sequence-parallel --use-distributed-optimizer",
        "Llama2-7B, TP 2 + SP x DP 2, distributed optimizer", SP_VARIANTS,
        _sizes(tp=2) + " --sequence-parallel --use-distributed-optimizer"),
    "llama2_13b-tp4sp": Layout(
        "llama2_13b", 4, _sizes(tp=4) + " --sequence-parallel --use-distributed-optimizer",
        "Llama2-13B, TP 4 + SP, distributed optimizer", smoke_flags=_sizes(tp=2) + " --sequence-parallel --use-distributed-optimizer"),
    "mixtral_8x7b_8l-ep4": Layout(
        "mixtral_8x7b_8l", 4, _sizes(ep=4) + " --use-distributed-optimizer",
        "Mixtral-8x7B (8 layers), EP 4 x DP 4, distributed optimizer",
        smoke_flags=_sizes(ep=2) + " --use-distributed-optimizer"),
    # alternatives named in the issue (not run by default)
    "llama2_13b-tp2pp2": Layout(
        "llama2_13b", 4, _sizes(tp=2, pp=2) + " --sequence-parallel --use-distributed-optimizer",
        "Llama2-13B, TP 2 + SP x PP 2, distributed optimizer", smoke_flags=_sizes(pp=2) + " --use-distributed-optimizer"),
    "mixtral_8x7b_8l-ep2tp2": Layout(
        "mixtral_8x7b_8l", 4, _sizes(tp=2, ep=2) + " --sequence-parallel --use-distributed-optimizer",
        "Mixtral-8x7B (8 layers), EP 2 x TP 2 + SP, DP 2, distributed optimizer",
        smoke_flags=_sizes(tp=2) + " --sequence-parallel --use-distributed-optimizer"),
    # two GPUs (nvidia-h200-x2): the Llama2-7B SP layout and its all-gather comparison
    "llama2_7b-tp2sp": Layout(
        "llama2_7b", 2, _sizes(tp=2) + " --sequence-parallel --use-distributed-optimizer",
        "Llama2-7B, TP 2 + SP, distributed optimizer", SP_VARIANTS,
        _sizes(tp=2) + " --sequence-parallel --use-distributed-optimizer"),
}
DEFAULT_LAYOUTS = ["llama2_7b-tp2sp-dp2", "llama2_13b-tp4sp", "mixtral_8x7b_8l-ep4"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=None, choices=list(LAYOUTS),
                   help=f"default: {' '.join(DEFAULT_LAYOUTS)}")
    p.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS),
                   help="run only these variants of each layout (default: the layout's own list)")
    p.add_argument("--iters", type=int, default=50, help="training iterations per run")
    p.add_argument("--warmup", type=int, default=5, help="iterations excluded from the timing")
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per step per GPU (global batch = micro x GPUs x this); bench_e2e.py uses 8 "
                        "to amortize the optimizer step as pretraining does, 1 here keeps full-depth runs short")
    p.add_argument("--deadline", type=float, default=500,
                   help="seconds for all runs together; a run gets at most the time left")
    p.add_argument("--run-timeout", type=float, default=400, help="seconds for one run (ends a hung run)")
    p.add_argument("--min-run-s", type=float, default=60,
                   help="skip a run when less time than this (or than an earlier run of its layout took) is left, "
                        "after the SIGTERM grace")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, gloo, 2 processes, 2 layers of width 64, seq 64: checks the plumbing only")
    add_data_arguments(p)
    p.add_argument("--out-dir", default=None, help="default: $OUT, else runs/scaling")
    p.add_argument("--report", nargs="+", default=None, metavar="DIR",
                   help="no runs: one table from the results under these directories")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="further trainer flags for every run (e.g. --recompute-granularity selective)")
    opts = p.parse_args(argv)
    for d in opts.report or []:  # a misspelled directory must not replace the table with an empty one
        if not os.path.isdir(d):
            p.error(f"--report: no directory {d}")
        if not load_records([d]):
            p.error(f"--report: no results under {d} (scaling_results/*.json with a layout and a variant)")
    if opts.smoke:
        opts.iters, opts.warmup = min(opts.iters, 4), min(opts.warmup, 1)
    check_timed_iterations(p, opts)
    return opts


def describe_flags(flags: str) -> str:
    """'--tensor-model-parallel-size 2 ... --sequence-parallel' -> 'TP 2 + SP' (sizes above 1 only)."""
    words, parts = flags.split(), []
    for flag, short in (("--tensor-model-parallel-size", "TP"), ("--pipeline-model-parallel-size", "PP"),
                        ("--expert-model-parallel-size", "EP")):
        if flag in words and int(words[words.index(flag) + 1]) > 1:
            parts.append(f"{short} {words[words.index(flag) + 1]}" + (" + SP" if short == "TP" and
                                                                      "--sequence-parallel" in words else ""))
    if "--use-distributed-optimizer" in words:
        parts.append("distributed optimizer")
    return ", ".join(parts) or "DP only"


def run_options(layout: Layout, variant: str, opts, timeout: float) -> argparse.Namespace:
    """The options bench_e2e.run_trainer reads, for one run."""
    extra = list(VARIANTS[variant][2]) + list(opts.extra)
    if opts.smoke:
        gqa = SMOKE_GQA if model_config(layout.model).get("group_query_attention") else []
        extra = SMOKE_MODEL + gqa + (SMOKE_MOCK_VOCAB if opts.data_path is None else []) + extra
    return argparse.Namespace(
        layers=SMOKE_LAYERS if opts.smoke else full_depth(layout.model), nproc=2 if opts.smoke else layout.nproc, layout=layout.smoke_flags if opts.smoke else layout.flags,
        iters=opts.iters, warmup=opts.warmup, seq_length=SMOKE_SEQ if opts.smoke else opts.seq_length,
        micro_batch_size=opts.micro_batch_size, grad_accum=opts.grad_accum, extra=extra, run_timeout=timeout,
        smoke=opts.smoke, data_path=opts.data_path, tokenizer_model=opts.tokenizer_model)


def next_run_timeout(left: float, opts, walls_of_layout) -> tuple:
    """(timeout for the next run, None) or (None, why it is skipped). A run must end, SIGTERM grace included,
    before --deadline: a device command cut off at its own limit leaves a trainer in `timeout`'s process
    group running on the machine. It is skipped when less time is left than --min-run-s or than an earlier
    run of the same layout took."""
    budget = left - KILL_AFTER_S
    needed = max([opts.min_run_s, *walls_of_layout])
    if budget < needed:
        return None, f"{left:.0f} s left of --deadline, {needed + KILL_AFTER_S:.0f} s needed"
    return min(opts.run_timeout, budget), None


def measure(name: str, layout: Layout, variant: str, ropts) -> dict:
    """One run through bench_e2e.run_trainer; a failure is recorded, not raised."""
    layers = ropts.layers
    title = f"{layout.title} [smoke: {describe_flags(ropts.layout)}]" if ropts.smoke else layout.title
    record = {"layout": name, "title": title, "smoke": ropts.smoke, "model": layout.model, "variant": variant,
              "precision": VARIANTS[variant][0], "gpus": ropts.nproc, "layers": layers, "flags": ropts.layout,
              "extra": ropts.extra, "iters": ropts.iters, "warmup": ropts.warmup, "seq_length": ropts.seq_length,
              "micro_batch_size": ropts.micro_batch_size, "global_batch": global_batch(ropts),
              "tokens_per_iter": ropts.seq_length * global_batch(ropts), "data": describe_data(ropts)}
    print(f"== {name} {variant}: {ropts.nproc} processes, {layers} layers, {ropts.layout} {' '.join(ropts.extra)}",
          flush=True)
    try:
        result = run_trainer(layout.model, layers, VARIANTS[variant][1], ropts)
    except RuntimeError as err:
        record["error"] = str(err)
        print(f"   failed: {err}", flush=True)
        return record
    record.update(result)
    record["tokens_per_s"] = record["tokens_per_iter"] / result["step_s"]
    return record


def _fmt(value, spec):
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


LOSS_WINDOW = 10


def end_loss(record) -> float:
    """Mean loss of the last LOSS_WINDOW iterations (older results: the last iteration's loss)."""
    losses = record.get("losses") or [record.get("loss", float("nan"))]
    tail = losses[-LOSS_WINDOW:]
    return sum(tail) / len(tail)


def format_table(records) -> str:
    """One markdown table: every layout's variants, speedups against the layout's BF16 run."""
    order = {name: i for i, name in enumerate(LAYOUTS)}
    rank = {name: i for i, name in enumerate(VARIANTS)}  # variants of older calls (other names) go last
    records = sorted(records, key=lambda r: (order.get(r["layout"], 99), rank.get(r["variant"], len(rank))))
    bf16 = {r["layout"]: r for r in records if r["variant"] == "bf16" and "error" not in r and "skipped" not in r}
    first = next((r for r in records if "error" not in r and "skipped" not in r), records[0] if records else {})
    smoke = any(r.get("smoke") for r in records)
    lines = ["SMOKE RUN on CPU (gloo, 2 processes, 2 layers of width 64, the layouts reduced as marked): checks "
             "the plumbing, the numbers mean nothing", ""] if smoke else []
    lines += [f"seq {first.get('seq_length')}, micro-batch {first.get('micro_batch_size')}, global batch {first.get('global_batch')}, "
             f"{first.get('data', 'mock data')}, {first.get('iters')} iterations per run, median step time after "
             f"{first.get('warmup')} warm-up iterations; peak memory of rank 0; TFLOP/s: model FLOPs (the trainer's "
             f"formula) per GPU; loss: mean of the last {LOSS_WINDOW} iterations, gap relative to BF16's",
             "",
             "| layout | GPUs | precision | tokens/s | TFLOP/s/GPU | peak memory (GB) | loss at the end "
             "| loss gap | INT8/BF16 speedup |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "error" in r or "skipped" in r:
            code = re.search(r"\(exit (-?\d+)\)", r.get("error", ""))
            why = (f"skipped ({r['skipped']})" if "skipped" in r else
                   "failed (timed out)" if code and code.group(1) in ("124", "137") else
                   f"failed (exit {code.group(1)})" if code else "failed")
            lines.append(f"| {r['title']} | {r['gpus']} | {r['precision']} | {why} | | | | | |")
            continue
        base = bf16.get(r["layout"])
        speedup = "1.000x (baseline)" if r["variant"] == "bf16" else (
            f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}x" if base else "n/a (no BF16 run)")
        loss = end_loss(r)
        gap = ("" if r["variant"] == "bf16" else f"{100 * (loss / end_loss(base) - 1):+.2f}%" if base
               else "n/a (no BF16 run)")
        lines.append(f"| {r['title']} | {r['gpus']} | {r['precision']} | {r['tokens_per_s']:.0f} "
                     f"| {_fmt(r.get('tflops_per_gpu'), '.1f')} | {_fmt(r.get('peak_gb'), '.1f')} "
                     f"| {_fmt(loss, '.4f')} | {gap} | {speedup} |")
    done = {(r["layout"], r["variant"]): r for r in records if "error" not in r and "skipped" not in r}
    for (name, variant), r in done.items():
        pair = ALL_GATHER_PAIRS.get(variant)
        if pair and (name, pair[0]) in done:
            ratio = r["tokens_per_s"] / done[(name, pair[0])]["tokens_per_s"]
            lines += ["", f"{r['title']}: INT8 SP all-gather vs BF16 SP all-gather (both {pair[1]} INT8 "
                          f"linears): {ratio:.3f}x tokens/s"]
    return "\n".join(lines)


def load_records(dirs) -> list:
    records = {}
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "**", "*.json"), recursive=True)):
            with open(path, encoding="utf-8") as f:
                r = json.load(f)
            if isinstance(r, dict) and "layout" in r and "variant" in r:
                records[(r["layout"], r["variant"])] = r  # a later directory's result replaces an earlier one
    return list(records.values())


def main(argv=None):
    opts = parse_args(argv)
    os.environ.update(ENV)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    out_dir = opts.out_dir or os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "runs", "scaling")
    os.makedirs(out_dir, exist_ok=True)
    table_path = os.path.join(out_dir, "bench_scaling.md")
    if opts.report:
        table = format_table(load_records(opts.report))
        print(table)
        with open(table_path, "w", encoding="utf-8") as f:
            f.write(table + "\n")
        return 0
    if opts.smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path (gloo) even on a GPU machine
    results_dir = os.path.join(out_dir, "scaling_results")
    os.makedirs(results_dir, exist_ok=True)
    names = opts.layouts or DEFAULT_LAYOUTS
    if not opts.smoke:
        import torch

        gpus = torch.cuda.device_count()
        missing = [n for n in names if LAYOUTS[n].nproc > gpus]
        if missing:
            raise SystemExit(f"{gpus} GPU(s) visible; {', '.join(missing)} need(s) {LAYOUTS[missing[0]].nproc}")
    start, records, failures = time.time(), [], 0
    for name in names:
        layout = LAYOUTS[name]
        for variant in layout.variants if opts.variants is None else [v for v in opts.variants if layout.accepts(v)]:
            left = opts.deadline - (time.time() - start)
            walls = [r["wall_s"] for r in records if r["layout"] == name and "wall_s" in r]
            timeout, why = next_run_timeout(left, opts, walls)
            if timeout is None:
                ropts = run_options(layout, variant, opts, 0)
                title = f"{layout.title} [smoke: {describe_flags(ropts.layout)}]" if opts.smoke else layout.title
                record = {"layout": name, "title": title, "smoke": opts.smoke, "variant": variant,
                          "gpus": ropts.nproc, "precision": VARIANTS[variant][0], "skipped": why}
                print(f"== {name} {variant}: skipped, {why}", flush=True)
            else:
                record = measure(name, layout, variant, run_options(layout, variant, opts, timeout))
                failures += "error" in record
            records.append(record)
            with open(os.path.join(results_dir, f"{name}__{variant}.json"), "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1)
            table = format_table(records)
            with open(table_path, "w", encoding="utf-8") as f:
                f.write(table + "\n")
    if not opts.smoke:
        record_tables("scaling", table)
    print(table, flush=True)
    print(f"table: {table_path}; results: {results_dir}; {time.time() - start:.0f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
