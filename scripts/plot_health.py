#!/usr/bin/env python3
"""Plot the INT8 health statistics of a run (the trainer's JSONL log with --int8-stats-interval) into a PNG.

One panel per statistic, one line per linear: by default the GEMMs' sampled relative errors and
underflows and the operands' crest factors; the fallback moves as vertical lines. docs/numerics.md says
how to read them.

    python3 scripts/plot_health.py runs/x/train_log.jsonl --output runs/x/health.png
    python3 scripts/plot_health.py LOG --stats fprop/rel_err x/kurtosis --linears 'layer1[0-2]\\.' --top 6 \\
        --output health.png
"""
import argparse
import math
import re
import sys

from plot_loss import log_records, output_problem

DEFAULT_STATS = ("fprop/rel_err", "dgrad/rel_err", "wgrad/rel_err", "fprop/underflow", "dgrad/underflow",
                 "wgrad/underflow", "x/crest", "w/crest", "dy/crest")
PREFIX = "int8_health/"


def read_health(path):
    """({linear: {stat: [(iteration, value)]}}, [fallback events]); later lines win (a resumed run rewrites
    the iterations after its checkpoint). A health record without the keys the trainer writes is an error naming
    its line."""
    by_iteration, events = {}, {}
    for number, record in log_records(path):
        try:
            if "int8_health" in record:
                by_iteration[record["iteration"]] = record["int8_health"]
            if "int8_fallback" in record:
                event = record["int8_fallback"]
                events[(event["iteration"], event["linear"], event["gemm"])] = event
        except KeyError as err:
            raise ValueError(f"{path}:{number}: a health record without {err}") from None
    series = {}
    for iteration in sorted(by_iteration):
        for name, value in by_iteration[iteration].items():
            if not name.startswith(PREFIX):
                continue
            linear, stat = name[len(PREFIX):].split("/", 1)
            series.setdefault(linear, {}).setdefault(stat, []).append((iteration, value))
    return series, [events[k] for k in sorted(events)]


def worst_linears(series, stat, top):
    """The `top` linears with the largest last value of `stat`."""
    last = [(points[-1][1], linear) for linear, stats in series.items() if (points := stats.get(stat))]
    return [linear for _, linear in sorted(last, reverse=True)[:top]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", help="train_log.jsonl of a run with --int8-stats-interval")
    parser.add_argument("--output", required=True, help="PNG to write")
    parser.add_argument("--stats", nargs="+", default=list(DEFAULT_STATS),
                        help="statistics to draw, as <operand or GEMM>/<stat> (default: %(default)s)")
    parser.add_argument("--linears", default=None, help="regular expression the linears' names must match")
    parser.add_argument("--top", type=int, default=8,
                        help="per panel, the linears with the largest last value (default: %(default)s)")
    opts = parser.parse_args(argv)
    if opts.top < 1:
        parser.error(f"--top must be at least 1 (linears per panel), got {opts.top}")
    try:
        pattern = re.compile(opts.linears or "")
    except re.error as err:
        parser.error(f"--linears {opts.linears!r}: not a regular expression ({err})")
    problem = output_problem(opts.output)
    if problem:
        parser.error(f"--output {problem}")
    try:
        series, events = read_health(opts.log)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    series = {k: v for k, v in series.items() if pattern.search(k)}
    if not series:
        print(f"{opts.log}: no int8_health records" + (f" for linears matching {opts.linears!r}" if opts.linears
                                                        else " (was the run started with --int8-stats-interval?)"),
              file=sys.stderr)
        return 1
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(3, len(opts.stats))
    rows = math.ceil(len(opts.stats) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.6 * rows), sharex=True, squeeze=False)
    for ax, stat in zip(axes.flat, opts.stats):
        for linear in worst_linears(series, stat, opts.top):
            ax.plot(*zip(*series[linear][stat]), marker=".", markersize=3, linewidth=1, label=linear)
        gemm = stat.split("/")[0]
        for event in events:
            if event["gemm"] == gemm and event["linear"] in series:
                ax.axvline(event["iteration"], color="gray", linestyle="--", linewidth=0.8)
        ax.set_title(stat)
        if not ax.lines:  # no linear recorded this statistic (a log of other statistics, or none yet)
            ax.text(0.5, 0.5, "no records", ha="center", va="center", transform=ax.transAxes, color="gray")
            continue
        if stat.endswith(("rel_err", "crest", "kurtosis", "amax")):
            ax.set_yscale("log")
        ax.legend(fontsize=6)
    for ax in axes[-1]:
        ax.set_xlabel("iteration")
    for ax in list(axes.flat)[len(opts.stats):]:
        ax.set_visible(False)
    fig.suptitle(f"INT8 health: {opts.log} (dashed: fallback of that GEMM)", fontsize=9)
    fig.tight_layout()
    fig.savefig(opts.output, dpi=110)
    print(f"wrote {opts.output}: {len(series)} linears, {len(events)} fallback moves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
