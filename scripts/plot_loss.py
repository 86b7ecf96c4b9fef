#!/usr/bin/env python3
"""Plot training (and validation) loss from one or more trainer JSONL logs into a PNG.

    python3 scripts/plot_loss.py runs/tiny/train_log.jsonl --output runs/tiny/loss.png
    python3 scripts/plot_loss.py bf16/train_log.jsonl int8/train_log.jsonl --labels BF16 INT8 --output cmp.png \\
        --summary cmp.md     # + markdown tables: last-100 mean training loss, final validation loss, gaps
                             #   (at the last iteration both runs reached); and each run's training-loss gap
                             #   per tenth of the run
"""
import argparse
import gzip
import json
import os
import sys


def open_log(path):
    """A trainer JSONL log for reading as text, gzipped (.gz: the kept logs of benchmarks/results/) or not."""
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def log_records(path):
    """(line number, record) for the records of a trainer JSONL log, without a last line cut short (a run killed
    while writing it, or a log read while it is written); any other line that is not a JSON object is an error
    naming it."""
    with open_log(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                if not line.endswith("\n") and not f.read(1):  # the last line, cut short
                    return
                raise ValueError(f"{path}:{number}: not JSON ({err})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: a JSON {type(record).__name__}, not a record (an object)")
            yield number, record


def read_series(path, *keys):
    """[{iteration: value}] for each per-step key of a trainer JSONL log, in one pass (None values dropped;
    later lines win: resumed runs)."""
    series = [{} for _ in keys]
    for _, record in log_records(path):
        for key, values in zip(keys, series):
            if record.get(key) is not None and "iteration" in record:
                values[record["iteration"]] = record[key]
    return series


def smooth(values, window):
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def relative_gap(value, reference) -> str:
    """value's gap to reference in percent; none to a reference loss of 0, which gives no scale."""
    return f"{100 * (value / reference - 1):+.2f}%" if reference else "n/a (reference 0)"


def output_problem(path: str):
    """Why a file cannot be written at `path`, else None; its missing folders are made, so that a script checks its
    outputs before its work rather than fail on one after it."""
    if os.path.isdir(path):
        return f"{path} is a folder: give a file name"
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except FileExistsError:
        return f"{path}: {folder} is a file, not a folder"
    except OSError as err:  # a file further up, no permission
        return f"{path}: cannot make its folder {folder} ({err.strerror})"
    return None


def summary_table(runs, window=100) -> str:
    """Markdown: per run, the mean training loss of the last `window` iterations and the final validation loss, each
    with its relative gap to the first run (the reference). A run that ends at another iteration than the reference
    is compared with it where both reached, as convergence_report.py does (a run ahead would be compared at a later,
    lower point of its curve): its row says where, and shows its losses there."""
    reference_label, reference_train, reference_valid = runs[0]
    rows, any_cut = [], False
    for label, train, valid in runs:
        last, shared = max(train), sorted(set(train) & set(reference_train))[-window:]
        cut = last != max(reference_train)
        any_cut |= cut
        iterations = f"{last} (compared at {shared[-1]})" if cut and shared else str(last)
        mean = mean_over(train, shared or sorted(train)[-window:])  # disjoint logs: no gap
        gap = relative_gap(mean, mean_over(reference_train, shared)) if shared else "n/a (no iteration in common)"
        evaluated = max(set(valid) & set(reference_valid), default=None)
        if evaluated is None:
            valid_cell = f"{valid[max(valid)] if valid else float('nan'):.4f}"
            valid_gap = "n/a (no common evaluation)"
        else:
            valid_cell = f"{valid[evaluated]:.4f}"
            if evaluated != max(valid) or evaluated != max(reference_valid):
                valid_cell += f" (at {evaluated})"
            valid_gap = relative_gap(valid[evaluated], reference_valid[evaluated])
        rows.append(f"| {label} | {iterations} | {mean:.4f} | {gap} | {valid_cell} | {valid_gap} |")
    header = (f"| run | iterations | training loss (mean of last {window}) | gap | final validation loss | gap |\n"
              "|---|---|---|---|---|---|")
    note = (f"\n\nA run that ends at another iteration than {reference_label} is compared with it at the last "
            f"iteration both reached: the training loss over the same last {window} iterations, the validation loss at "
            "the last evaluation both have.") if any_cut else ""
    return "\n".join([header] + rows) + note


def mean_over(series, steps) -> float:
    return sum(series[s] for s in steps) / len(steps)


def window_gaps(runs, parts=10) -> str:
    """Markdown: each run's mean training loss over each tenth of the run (iterations the reference logged too)
    against the reference's over the same iterations: whether a gap is steady, growing or one span's swing, which
    a last-100 mean cannot tell (another seed's last 100 batches alone moved it 1.4%: docs/convergence.md, sec. 8)."""
    _, reference, _ = runs[0]
    steps = sorted(reference)
    bounds = [steps[len(steps) * i // parts] for i in range(parts)] + [steps[-1] + 1]
    spans = list(zip(bounds[:-1], bounds[1:]))
    header = ("| run | " + " | ".join(f"{lo}-{hi - 1}" for lo, hi in spans) + " |\n|" + "---|" * (parts + 1))
    rows = []
    for label, train, _ in runs[1:]:
        cells = []
        for lo, hi in spans:
            shared = [s for s in steps if lo <= s < hi and s in train]
            if not shared:
                cells.append("-")
                continue
            ref = sum(reference[s] for s in shared) / len(shared)
            cells.append(relative_gap(sum(train[s] for s in shared) / len(shared), ref))
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join([header] + rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", help="train_log.jsonl files")
    parser.add_argument("--labels", nargs="*", default=None, help="one legend label per log")
    parser.add_argument("--output", required=True,
                        help="PNG to write (.png is added to a name without an extension; .pdf, .svg also work)")
    parser.add_argument("--smooth", type=int, default=10, help="moving-average window (iterations)")
    parser.add_argument("--title", default="Training loss")
    parser.add_argument("--summary", default=None, help="also write a markdown summary table here")
    args = parser.parse_args(argv)
    labels = args.labels or [os.path.basename(os.path.dirname(os.path.abspath(p))) or p for p in args.logs]
    if len(labels) != len(args.logs):
        parser.error("--labels needs one label per log")
    if args.smooth < 1:
        parser.error(f"--smooth must be at least 1 (iterations), got {args.smooth}")
    for flag, path in (("--output", args.output), ("--summary", args.summary)):
        problem = path and output_problem(path)
        if problem:
            parser.error(f"{flag} {problem}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        print("error: plotting needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 1
    extension = os.path.splitext(args.output)[1].lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if not extension:  # matplotlib would add .png itself: the name printed is the file written
        args.output += ".png"
    elif extension[1:] not in formats:
        parser.error(f"--output {args.output}: matplotlib cannot write {extension} files: end the name in .png, or "
                     f"another of its formats ({', '.join(sorted(formats))})")

    figure, axis = plt.subplots(figsize=(8, 5))
    runs = []
    for path, label in zip(args.logs, labels):
        try:
            train, valid = read_series(path, "lm_loss", "valid_lm_loss")
        except (OSError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        if not train:
            print(f"error: {path} has no training loss records", file=sys.stderr)
            return 1
        runs.append((label, train, valid))
        steps = sorted(train)
        values = [train[s] for s in steps]
        line, = axis.plot(steps, values, alpha=0.3, linewidth=0.8)
        axis.plot(steps, smooth(values, args.smooth), color=line.get_color(), label=f"{label} (train)")
        if valid:
            axis.plot(sorted(valid), [valid[s] for s in sorted(valid)], "o--", color=line.get_color(),
                      label=f"{label} (validation)")
        print(f"{label}: iterations {steps[0]}-{steps[-1]}, loss {values[0]:.3f} -> {values[-1]:.3f}"
              + (f", validation {valid[max(valid)]:.3f}" if valid else ""))
    axis.set_xlabel("iteration")
    axis.set_ylabel("lm loss")
    axis.set_title(args.title)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")
    if args.summary:
        with open(args.summary, "w", encoding="utf-8") as f:
            f.write(summary_table(runs) + "\n")
            if len(runs) > 1:
                f.write(f"\nTraining-loss gap to {runs[0][0]}, per tenth of the run (mean over each span's "
                        "iterations):\n\n" + window_gaps(runs) + "\n")
        print(f"wrote {args.summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
