"""What the benchmarks share: the repository on sys.path (the GPU machine runs them from a checkout, not
an install), CUDA timing, the trainer runs of the end-to-end benchmarks, and the results CSVs.

Every benchmark imports this module first (`import common`; a script's own folder is on sys.path).
Results: `append_results(name, rows)` adds machine-readable rows to benchmarks/results/<name>.csv (to
$OUT/<name>.csv where $OUT is set, as on the GPU machine) with the GPU, date, commit, software versions
and the command that produced them. Those CSVs are GPU measurements: the rows of a CPU or smoke run go only
where asked for ($OUT, or a directory the script takes). BENCH_COMMIT=<hash> names the commit where the
checkout's git metadata is stale (a copy of the working tree, as on the GPU machine).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PROVENANCE = ("date", "commit", "gpu", "torch", "triton", "command")


RECORDED_ENV = ("PYTORCH_CUDA_ALLOC_CONF",)  # beside MEGATRON_INT8_*: what provenance() puts before the command


def provenance() -> dict:
    """Where a measurement comes from: date, commit (with '+dirty' for uncommitted changes), GPU, versions,
    and the command line, after the settings in the environment that change what runs (MEGATRON_INT8_*,
    PYTORCH_CUDA_ALLOC_CONF)."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "-"

    def git(*args):
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    # a copy of a checkout (the GPU machine gets the working tree with stale git metadata) names its commit
    commit = os.environ.get("BENCH_COMMIT") or git("rev-parse", "--short", "HEAD") or "unknown"
    if "BENCH_COMMIT" not in os.environ and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"date": datetime.date.today().isoformat(), "commit": commit, "gpu": gpu,
            "torch": torch.__version__, "triton": triton_version,
            "command": " ".join([*(f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k in RECORDED_ENV
                                   or k.startswith("MEGATRON_INT8_")),
                                 *(shlex.quote(a) for a in ["python3", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])])}


def append_results(name: str, rows, directory: str = None, smoke: bool = False) -> str:
    """Append `rows` (dicts of one benchmark's figures) to <directory or benchmarks/results>/<name>.csv, each
    row prefixed with `provenance()`. A new file gets a header; an existing one must have the same columns
    (a changed benchmark writes a new file name rather than mixing layouts). Returns the path. The rows of a
    smoke run (`smoke`: on the CPU or at smoke size; any run where CUDA is missing) go only to `directory` or
    $OUT: without either they are not recorded (returns "")."""
    rows = [dict(r) for r in rows]
    if not rows:
        return ""
    # on the GPU machine $OUT is what comes back: the rows go there, to be appended to the repository's CSV
    directory = directory or os.environ.get("OUT")
    if not directory and (smoke or not torch.cuda.is_available()):
        print(f"{name}: rows not recorded, a CPU or smoke run (benchmarks/results holds GPU measurements; "
              "set $OUT to keep them)", file=sys.stderr)
        return ""
    origin = provenance()
    fields = list(PROVENANCE) + [k for k in rows[0] if k not in PROVENANCE]
    path = os.path.join(directory or RESULTS, f"{name}.csv")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    exists = os.path.exists(path) and os.path.getsize(path) > 0
    if exists:
        with open(path, newline="", encoding="utf-8") as f:
            header = next(csv.reader(f))
        if header != fields:
            raise ValueError(f"{path} has columns {header}, these rows have {fields}: write to a new file")
    with open(path, "a", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if not exists:
            writer.writeheader()
        for row in rows:
            writer.writerow({**origin, **row})
    return path


def markdown_tables(text: str):
    """(title, rows as dicts) of every markdown table in `text`; the title is the nearest non-table line
    above it ('' for none)."""
    tables, title, lines = [], "", text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("|") and i + 1 < len(lines) and set(lines[i + 1].strip()) <= set("|-: ") and "-" in lines[i + 1]:
            header = []
            for cell in (c.strip() for c in line.strip("|").split("|")):  # a repeated name gets " (2)", ...
                header.append(cell if cell not in header else f"{cell} ({sum(h.split(' (')[0] == cell for h in header) + 1})")
            rows, i = [], i + 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                rows.append(dict(zip(header, cells + [""] * (len(header) - len(cells)))))
                i += 1
            tables.append((title, rows))
            continue
        if line:
            title = line.lstrip("#").strip()
        i += 1
    return tables


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_")[:48]


def record_tables(name: str, text: str, directory: str = None, smoke: bool = False) -> list:
    """Append every markdown table of a benchmark's output to <results>/<name>[_<table title>].csv (see
    append_results, also for `smoke`); the table's title goes into the `table` column. Returns the paths
    written."""
    tables = markdown_tables(text)
    paths = []
    for title, rows in tables:
        csv_name = name if len(tables) == 1 else f"{name}_{slug(title) or len(paths)}"
        paths.append(append_results(csv_name, [{"table": title, **row} for row in rows], directory, smoke))
    return paths


def median_ms(fn, warmup: int = 15, rep: int = 60) -> float:
    """Median ms of fn over about `rep` ms of calls after `warmup` ms (triton.testing.do_bench, which flushes L2
    before each call)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def time_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def positive_int(text: str) -> int:
    """argparse type of a count or a size, an integer >= 1: a 0 would fail late, in a division or a reshape."""
    value = int(text)  # not an integer: argparse says "invalid positive_int value"
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def output_file(path: str) -> str:
    """argparse type of a file written after the measurements (--csv): checked to be writable before them."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"no directory {folder} to write {path} in")
    if os.path.isdir(path) or not os.access(path if os.path.exists(path) else folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{path} is not a writable file")
    return path


def require_cuda(script: str) -> None:
    """Exit with one line where no CUDA GPU is visible: a CPU-only torch fails later, in an assertion."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{os.path.basename(script)} needs a CUDA GPU")


def token_args(doc: str, script: str, argv=None) -> argparse.Namespace:
    """--seq, --micro-batch and --iters of the per-op benchmarks (this one, bench_norm.py); exits without CUDA."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--iters", type=int, default=50)
    opts = p.parse_args(argv)
    require_cuda(script)
    return opts


# ----------------------------------------------------------------------- trainer runs (end to end, scaling)
PEAK_MEMORY = re.compile(r"peak memory \(GB\): ([0-9.]+)")
RESIDENT_MEMORY = re.compile(r"memory between steps \(GB\): ([0-9.]+)")
# the trainer's log line: iteration time and model TFLOP/s per GPU over the same interval
ITERATION_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
TFLOPS = re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)")
BENCH_OVERRIDES = ["--lr-warmup-iters", "0"]
MOCK_DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer"]
PARALLEL_OVERRIDES = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                      "--expert-model-parallel-size", "1"]


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-path", default=None, metavar="PREFIX",
                   help="a tokenized corpus (PREFIX.bin/.idx, scripts/preprocess_data.py) instead of mock data")
    p.add_argument("--tokenizer-model", default=None, help="its SentencePiece model (with --data-path)")


def data_flags(opts) -> list:
    """Trainer flags for the training data: mock tokens, or a corpus with its SentencePiece tokenizer."""
    path = getattr(opts, "data_path", None)
    if path is None:
        return MOCK_DATA
    if not getattr(opts, "tokenizer_model", None):
        raise SystemExit("--data-path needs --tokenizer-model")
    return ["--data-path", path, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", opts.tokenizer_model]


def describe_data(opts) -> str:
    path = getattr(opts, "data_path", None)
    return f"corpus {os.path.basename(path)}" if path else "mock data"


def global_batch(opts) -> int:
    """micro x GPUs x micro-batches per step (`grad_accum`, 1 where a caller has none)."""
    return opts.micro_batch_size * opts.nproc * getattr(opts, "grad_accum", 1)


def check_timed_iterations(parser: argparse.ArgumentParser, opts) -> None:
    """A usage error unless --iters leaves iterations after --warmup: run_trainer times only those, and would
    find none after a whole run."""
    if opts.warmup < 0 or opts.iters <= opts.warmup:
        parser.error(f"--iters {opts.iters} must exceed --warmup {opts.warmup} (>= 0): only the iterations after "
                     "the warm-up are timed")


KILL_AFTER_S = 30  # a timed-out run gets this long to stop after SIGTERM before `timeout` kills it


def run_trainer(model: str, layers: int, int8: bool, opts, env=None, fp8: str = None) -> dict:
    """One trainer run; returns median step time (s), final loss and every step's loss, peak memory (GB,
    rank 0) and model TFLOP/s per GPU at the median step time. `opts.run_timeout` (seconds, optional) ends a hung run;
    `env`: the trainer's environment (default: this process's); `fp8`: a --fp8-peer recipe (with int8 False)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                    str(opts.nproc)] if opts.nproc > 1 else [sys.executable]
        layout = opts.layout.split() if opts.layout is not None else PARALLEL_OVERRIDES
        cap = getattr(opts, "memory_cap_gib", None)  # an 80 GB card emulated on a larger one (memory_cap.py)
        entry = [os.path.join(ROOT, "benchmarks", "memory_cap.py"), str(cap)] if cap else ["-m"]
        cmd = [*launcher, *entry, "megatron_int8.pretrain", "--config", os.path.join(ROOT, "configs", f"{model}.yaml"),
               *data_flags(opts), "--num-layers", str(layers), "--train-iters", str(opts.iters),
               "--seq-length", str(opts.seq_length), "--micro-batch-size", str(opts.micro_batch_size),
               "--global-batch-size", str(global_batch(opts)), "--log-interval", "1",
               "--eval-interval", str(10 * opts.iters), "--eval-iters", "0", "--log-jsonl", log, "--bf16",
               *BENCH_OVERRIDES, *layout, *opts.extra]
        if int8:
            cmd += ["--int8-linear", *getattr(opts, "int8_extra", "").split()]
        elif not fp8:
            cmd += getattr(opts, "bf16_extra", "").split()
        if fp8:
            cmd += ["--fp8-peer", fp8] + (["--fp8-peer-compile"] if getattr(opts, "fp8_compile", False) else [])
        if getattr(opts, "run_timeout", None):  # SIGTERM: torchrun passes it on to its workers
            cmd = ["timeout", "--kill-after", str(KILL_AFTER_S), str(int(opts.run_timeout)), *cmd]
        start = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise RuntimeError(f"trainer failed for {model} L={layers} int8={int8}{f' fp8={fp8}' if fp8 else ''} "
                               f"(exit {proc.returncode})")
        with open(log, encoding="utf-8") as f:
            steps = [json.loads(line) for line in f if '"lm_loss"' in line]
    timed = [s["step_time_s"] for s in steps[opts.warmup:]]
    if not timed:
        raise RuntimeError(f"{model}: no timed iterations (iters {opts.iters} <= warmup {opts.warmup})")
    peaks, residents = PEAK_MEMORY.findall(proc.stdout), RESIDENT_MEMORY.findall(proc.stdout)
    intervals, tflops = ITERATION_MS.findall(proc.stdout), TFLOPS.findall(proc.stdout)
    # model TFLOP per GPU and iteration (the trainer's formula, fixed for a run) over the median step time
    tflop_per_gpu = float(tflops[-1]) * float(intervals[-1]) / 1e3 if tflops and intervals else float("nan")
    result = {"step_s": statistics.median(timed), "loss": steps[-1]["lm_loss"],
              "losses": [round(s["lm_loss"], 5) for s in steps],
              "peak_gb": float(peaks[-1]) if peaks else float("nan"),
              "resident_gb": float(residents[-1]) if residents else float("nan"), "wall_s": time.time() - start}
    result["tflops_per_gpu"] = tflop_per_gpu / result["step_s"]
    where = f" [GPU {env['CUDA_VISIBLE_DEVICES']}]" if env and "CUDA_VISIBLE_DEVICES" in env else ""
    label = "int8" if int8 else ("fp8" if fp8 else "bf16")
    print(f"  {model:16s} L={layers:2d} {label}{where}: step {result['step_s'] * 1e3:8.1f} ms, "
          f"loss {result['loss']:.4f}, peak {result['peak_gb']:.1f} GB "
          f"({result['resident_gb']:.1f} GB between steps), run {result['wall_s']:.0f} s", flush=True)
    return result


def model_config(model: str) -> dict:
    """configs/{model}.yaml as a dict."""
    with open(os.path.join(ROOT, "configs", f"{model}.yaml"), encoding="utf-8") as f:
        return yaml.safe_load(f)


def full_depth(model: str) -> int:
    return int(model_config(model)["num_layers"])
