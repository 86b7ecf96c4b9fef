#!/usr/bin/env python3
"""End-to-end training throughput, INT8 vs BF16 (and the FP8 peer), for the six model configs, with the
project's trainer.

For every model and precision it runs `python -m megatron_int8.pretrain --config configs/<model>.yaml`
on mock data (one GPU: TP=PP=EP=1) at two depths, takes the median step time after warm-up, and
fits t(L) = a + b*L (a: embedding, output layer, optimizer overhead; b: one transformer layer). Where
the full model does not fit, the full-depth time a + b*num_layers is reported as a *projection*, labelled
so. Prints one markdown table (also written to --out / $OUT/bench_e2e.md). With --fp8-peer every model
also runs with `--fp8-peer RECIPE` (torchao float8 linears, same model; needs torchao and an FP8 GPU):
the table gains FP8 tok/s and FP8/BF16 speedups; where FP8 fails, its columns say n/a and the reason
is printed.

    python benchmarks/bench_e2e.py --models llama2_7b qwen3_4b --depths 2 4 --iters 12
    # one model per GPU at a time on a several-GPU host (each run still uses one GPU):
    python benchmarks/bench_e2e.py --gpus 0 1 2
    # with the FP8 peer (torchao float8 tensorwise) as a third precision
    python benchmarks/bench_e2e.py --models llama2_7b qwen3_4b --fp8-peer
    # several GPUs, full depth, a parallel layout (the scale-out runs):
    python benchmarks/bench_e2e.py --models llama2_13b --nproc 4 --full-depth --iters 50 \
        --layout "--tensor-model-parallel-size 4 --sequence-parallel --use-distributed-optimizer"
    # an 80 GB card emulated on a larger one (each trainer process capped before it allocates; memory_cap.py)
    python benchmarks/bench_e2e.py --models qwen3_4b --full-depth --memory-cap-gib 79
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import common
from common import (add_data_arguments, check_timed_iterations, describe_data, full_depth, global_batch, output_file,
                    positive_int, run_trainer)

MODELS = ("llama2_7b", "llama2_13b", "llama3.1_8b", "qwen3_4b", "qwen3_8b", "mixtral_8x7b_8l")
# End-to-end INT8/BF16 speedups reported by the base paper on its accelerator.
PAPER_SPEEDUP = {"llama2_7b": 1.21, "llama2_13b": 1.16, "llama3.1_8b": 1.17, "qwen3_4b": 1.07,
                 "qwen3_8b": 1.20, "mixtral_8x7b_8l": 1.12}

def config_name(name: str) -> str:
    if not os.path.exists(os.path.join(common.ROOT, "configs", f"{name}.yaml")):
        raise argparse.ArgumentTypeError(f"no configs/{name}.yaml")
    return name


# options that take a string of trainer flags as their one value
FLAG_STRING_OPTIONS = ("--layout", "--int8-extra", "--bf16-extra")


def attach_flag_strings(argv: list) -> list:
    """`--int8-extra --int8-swiglu-input` as `--int8-extra=--int8-swiglu-input`: argparse would read a value that
    is one trainer flag as an option of its own and stop with "expected one argument". --extra's tail is left as
    it is (its flags are the trainer's)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--extra":
            return out + argv[i:]
        if argv[i] in FLAG_STRING_OPTIONS and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def parse_args(argv=None):
    argv = attach_flag_strings(sys.argv[1:] if argv is None else list(argv))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), type=config_name, metavar="MODEL",
                   help=f"configs/MODEL.yaml (default: the six models, {' '.join(MODELS)}); a config without "
                        "vocab_size (convergence_350m) needs --extra --vocab-size V")
    p.add_argument("--depths", nargs=2, type=positive_int, default=[2, 4], metavar=("L1", "L2"),
                   help="Two depths to measure (Mixtral uses half of each, at least 1).")
    p.add_argument("--iters", type=int, default=12, help="Training iterations per run.")
    p.add_argument("--warmup", type=int, default=4, help="Iterations excluded from the timing.")
    p.add_argument("--seq-length", type=positive_int, default=4096)
    p.add_argument("--micro-batch-size", type=positive_int, default=1)
    p.add_argument("--nproc", type=positive_int, default=1, help="GPUs (torchrun processes)")
    p.add_argument("--grad-accum", type=positive_int, default=8,
                   help="micro-batches per step per GPU: global batch = micro x nproc x this. Pretraining steps "
                        "hold many micro-batches, so the optimizer step is amortized as in a real run")
    p.add_argument("--layout", default=None,
                   help="parallel-layout flags replacing the single-GPU TP=PP=EP=1 overrides (with --nproc)")
    p.add_argument("--full-depth", action="store_true", help="measure only the config's own depth (no projection)")
    p.add_argument("--gpus", nargs="+", default=None, metavar="INDEX",
                   help="single-GPU runs only: measure several models at once, each on its own GPU of these "
                        "(a model's runs stay on one GPU, one after another; models start in --models order)")
    p.add_argument("--fp8-peer", nargs="?", const="tensorwise", default=None, choices=("tensorwise", "rowwise"),
                   help="also run every model with --fp8-peer RECIPE (default recipe: tensorwise)")
    p.add_argument("--memory-cap-gib", type=float, default=None, metavar="GIB",
                   help="cap every trainer process's CUDA memory at GIB GiB before it allocates "
                        "(torch.cuda.set_per_process_memory_fraction; 79 emulates an 80 GB card); rows go to "
                        "results/e2e_capped.csv")
    p.add_argument("--fp8-compile", action="store_true",
                   help="FP8 runs with --fp8-peer-compile (torch.compile'd casts + GEMMs)")
    add_data_arguments(p)
    p.add_argument("--out", default=None, help="Markdown output file, or a directory to write bench_e2e.md into (default: $OUT).")
    p.add_argument("--int8-extra", default="",
                   help="trainer flags for the INT8 runs only, as one string (e.g. \"--int8-swiglu-input\")")
    p.add_argument("--bf16-extra", default="",
                   help="trainer flags for the BF16 runs only, as one string (e.g. a recomputation BF16 needs to fit)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="Further trainer flags for every run (e.g. --int8-granularity row).")
    opts = p.parse_args(argv)
    check_timed_iterations(p, opts)
    if opts.gpus and opts.nproc > 1:
        p.error("--gpus runs single-GPU models side by side; with --nproc > 1 leave it out")
    if opts.fp8_compile and not opts.fp8_peer:
        p.error("--fp8-compile applies to the FP8 runs: give --fp8-peer too")
    if opts.memory_cap_gib is not None and not opts.memory_cap_gib > 0:
        p.error(f"--memory-cap-gib must be a positive number of GiB, got {opts.memory_cap_gib}")
    if opts.out and not os.path.isdir(opts.out):
        try:  # checked now, not after the first model's runs
            output_file(opts.out)
        except argparse.ArgumentTypeError as err:
            p.error(f"--out {opts.out}: {err}")
    return opts


def project(t1: float, t2: float, l1: int, l2: int, full: int) -> float:
    """Full-depth step time from two depths; NaN when timing noise hides the per-layer cost."""
    per_layer = (t2 - t1) / (l2 - l1)
    return t1 + per_layer * (full - l1) if per_layer > 0 else float("nan")


def depths_of(model: str, opts):
    """(shallow, deep) depths measured for a model, each at most its full depth."""
    full = full_depth(model)
    depths = opts.depths if not model.startswith("mixtral") else [max(1, d // 2) for d in opts.depths]
    if opts.full_depth:
        depths = [full]
    l1, deep = min(min(d, full) for d in depths), max(min(d, full) for d in depths)
    if l1 == deep < full:
        raise SystemExit(f"{model}: two different depths are needed to project to {full} layers")
    return l1, deep


def precisions(opts):
    return ("bf16", "int8", "fp8") if getattr(opts, "fp8_peer", None) else ("bf16", "int8")


def measure_model(model: str, opts, env=None) -> dict:
    """BF16 and INT8 (and FP8) at both depths; one table row (full depth projected where not measured).
    A failed FP8 run leaves the row without FP8 numbers (`fp8_error`); BF16 or INT8 failing fails the model."""
    full, (l1, deep) = full_depth(model), depths_of(model, opts)
    tokens = opts.seq_length * global_batch(opts)
    res = {}
    row = {"model": model, "measured": ",".join(map(str, sorted({l1, deep}))), "full": full}
    for p in precisions(opts):
        for l in {l1, deep}:
            try:
                res[(p, l)] = run_trainer(model, l, p == "int8", opts, env, fp8=opts.fp8_peer if p == "fp8" else None)
            except RuntimeError as err:
                if p != "fp8":
                    raise
                print(f"  {model}: FP8 peer failed, its columns stay empty: {err}", flush=True)
                row["fp8_error"] = str(err)
                break
    for p in precisions(opts):
        if f"{p}_error" in row:
            continue
        row[f"{p}_tok_s"] = tokens / res[(p, deep)]["step_s"]
        if deep == full:
            row[f"{p}_full_tok_s"], row["projected"] = row[f"{p}_tok_s"], False
        else:
            row[f"{p}_full_tok_s"] = tokens / project(res[(p, l1)]["step_s"], res[(p, deep)]["step_s"], l1, deep, full)
            row["projected"] = True
        row[f"{p}_peak_gb"] = res[(p, deep)]["peak_gb"]
        row[f"{p}_resident_gb"] = res[(p, deep)]["resident_gb"]
        row[f"{p}_loss"] = res[(p, deep)]["loss"]
    row["runs"] = {f"{p} L={l}": r for (p, l), r in res.items()}  # every step's loss, for the JSON record
    return row


def main(argv=None):
    opts = parse_args(argv)
    for model in opts.models:
        depths_of(model, opts)  # fail before any run
    out = opts.out or os.environ.get("OUT")
    if out and os.path.isdir(out):
        out = os.path.join(out, "bench_e2e.md")
    rows, failed = {}, []
    publishing = threading.Lock()  # with --gpus, models finish on several threads

    def measure_and_publish(model, env=None):
        """Measure one model and rewrite the table with every model finished so far (a call cut short
        keeps them); a failed model is reported and the others go on."""
        try:
            row = measure_model(model, opts, env)
        except RuntimeError as err:
            print(f"  {model}: {err}", flush=True)
            with publishing:
                failed.append(model)
            return
        with publishing:
            rows[model] = row
            common.append_results(results_name(opts), [csv_row(row, opts)])
            if out:
                done = [rows[m] for m in opts.models if m in rows]
                with open(out, "w", encoding="utf-8") as f:
                    f.write(format_table(done, opts) + "\n")
                with open(os.path.splitext(out)[0] + ".json", "w", encoding="utf-8") as f:
                    json.dump(done, f, indent=1)

    if opts.gpus:
        free = queue.Queue()
        for gpu in opts.gpus:
            free.put(gpu)

        def on_a_free_gpu(model):
            gpu = free.get()
            try:
                measure_and_publish(model, dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu)))
            finally:
                free.put(gpu)

        with ThreadPoolExecutor(len(opts.gpus)) as pool:
            list(pool.map(on_a_free_gpu, opts.models))
    else:
        for model in opts.models:
            measure_and_publish(model)
    print(format_table([rows[m] for m in opts.models if m in rows], opts))
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


def results_name(opts) -> str:
    """The results CSV (benchmarks/results/NAME.csv): memory-capped runs keep a file of their own, with the cap."""
    return ("e2e_fp8" if opts.fp8_peer else "e2e") + ("_capped" if opts.memory_cap_gib else "")


def csv_row(row: dict, opts) -> dict:
    """A model's figures as one flat CSV row, with the run's settings."""
    settings = dict(seq=opts.seq_length, micro_batch=opts.micro_batch_size, global_batch=global_batch(opts),
                    nproc=opts.nproc, layout=opts.layout or "", data=describe_data(opts), iters=opts.iters,
                    extra=" ".join(opts.extra), int8_extra=opts.int8_extra,
                    bf16_extra=opts.bf16_extra)
    if opts.memory_cap_gib:
        settings["memory_cap_gib"] = opts.memory_cap_gib
    columns = ["model", "measured", "full", "projected"] + [f"{p}_{figure}" for p in precisions(opts)
                                                            for figure in ("tok_s", "full_tok_s", "peak_gb",
                                                                           "resident_gb", "loss")]
    figures = {k: row.get(k, "") for k in columns}  # a failed FP8 run leaves its cells empty
    return {**{k: (round(v, 4) if isinstance(v, float) else v) for k, v in figures.items()}, **settings}


def step_memory(row: dict, precision: str) -> float:
    """Peak less the memory held between steps: what one step adds (activations, gradients in flight,
    temporaries). Weights, gradients, optimizer states and INT8 weight caches stay between steps."""
    return row[f"{precision}_peak_gb"] - row[f"{precision}_resident_gb"]


def format_table(rows, opts) -> str:
    gpus = f"{opts.nproc} GPU{'s' if opts.nproc > 1 else ''}" + (f" ({opts.layout})" if opts.layout else "")
    if getattr(opts, "gpus", None):
        gpus += f" per run, models run concurrently on GPUs {' '.join(map(str, opts.gpus))}"
    if getattr(opts, "memory_cap_gib", None):
        gpus += f", each process capped at {opts.memory_cap_gib:g} GiB"
    lines = [f"seq {opts.seq_length}, micro-batch {opts.micro_batch_size}, global batch {global_batch(opts)}, {gpus}, "
             f"{describe_data(opts)}, {opts.iters} iterations "
             f"({opts.warmup} warm-up); tok/s at the deeper measured depth; full depth is *projected* from the two "
             "depths where marked (P)",
             ""]
    fp8 = "fp8" in precisions(opts)
    if not fp8:
        lines += ["| model | layers measured / full | BF16 tok/s | INT8 tok/s | speedup (measured) | speedup full depth "
                  "| paper | peak GB BF16 / INT8 | INT8/BF16 memory | between steps GB BF16 / INT8 "
                  "| INT8/BF16 above between steps | loss BF16 / INT8 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    else:
        lines[0] += f"; FP8: the FP8 peer (torchao float8 {opts.fp8_peer}{', compiled' if opts.fp8_compile else ''})"
        lines += ["| model | layers measured / full | BF16 tok/s | INT8 tok/s | FP8 tok/s | INT8 speedup (measured) "
                  "| INT8 speedup full depth | FP8/BF16 (measured) | FP8/BF16 full depth | paper (INT8) "
                  "| peak GB BF16 / INT8 / FP8 | INT8/BF16 memory | between steps GB BF16 / INT8 / FP8 "
                  "| INT8/BF16 above between steps | loss BF16 / INT8 / FP8 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        projected = " (P)" if r["projected"] else ""
        full_speedup = r["int8_full_tok_s"] / r["bf16_full_tok_s"]
        cells = [r["model"], f"{r['measured']} / {r['full']}", f"{r['bf16_tok_s']:.0f}", f"{r['int8_tok_s']:.0f}"]
        has_fp8 = fp8 and "fp8_tok_s" in r
        if fp8:
            cells.append(f"{r['fp8_tok_s']:.0f}" if has_fp8 else "n/a")
        cells += [f"{r['int8_tok_s'] / r['bf16_tok_s']:.3f}x", f"{full_speedup:.3f}x{projected}"]
        if fp8:
            cells += [f"{r['fp8_tok_s'] / r['bf16_tok_s']:.3f}x" if has_fp8 else "n/a",
                      f"{r['fp8_full_tok_s'] / r['bf16_full_tok_s']:.3f}x{projected}" if has_fp8 else "n/a"]
        peaks = f"{r['bf16_peak_gb']:.1f} / {r['int8_peak_gb']:.1f}"
        residents = f"{r['bf16_resident_gb']:.1f} / {r['int8_resident_gb']:.1f}"
        loss = f"{r['bf16_loss']:.3f} / {r['int8_loss']:.3f}"
        if fp8:
            peaks += f" / {r['fp8_peak_gb']:.1f}" if has_fp8 else " / n/a"
            residents += f" / {r['fp8_resident_gb']:.1f}" if has_fp8 else " / n/a"
            loss += f" / {r['fp8_loss']:.3f}" if has_fp8 else " / n/a"
        paper = PAPER_SPEEDUP.get(r["model"])
        cells += [f"{paper:.2f}x" if paper else "n/a", peaks, f"{r['int8_peak_gb'] / r['bf16_peak_gb']:.2f}",
                  residents, f"{step_memory(r, 'int8') / step_memory(r, 'bf16'):.2f}", loss]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
