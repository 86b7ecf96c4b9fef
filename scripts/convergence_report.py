#!/usr/bin/env python3
"""INT8 vs BF16 convergence at a larger scale (issue #51): the report of two runs, and the corpus's statistics.

    # one PNG (training and validation loss of both, the gap, gradient norms, tokens/s), a markdown summary and
    # the INT8 run's health plot, from the trainer's JSONL logs (R = runs/convergence):
    python3 scripts/convergence_report.py report --bf16 R/bf16.jsonl --int8 R/int8.jsonl \\
        --config configs/convergence_350m.yaml --output-dir R/report [--corpus-stats R/corpus.json]
    # corpus bytes, documents, tokens of each split, distinct token ids, the epochs a run takes, SHA-256 of the
    # text and of the tokens:
    python3 scripts/convergence_report.py corpus --corpus R/corpus.jsonl --prefix R/data/corpus_text_document \\
        --config configs/convergence_350m.yaml --output R/corpus.json
    # the noise floor: the same report over two BF16 runs that differ only in --seed (same --data-seed):
    python3 scripts/convergence_report.py report --bf16 R/bf16.jsonl --int8 R/bf16_init2.jsonl \\
        --labels BF16 "BF16, init 2" --config configs/convergence_350m.yaml --output-dir R/report
    # ... and beside the INT8 pair: add --noise-floor R/bf16.jsonl R/bf16_init2.jsonl to the first command
    # one run of a 1-GPU machine against a pair an earlier job recorded on the same token stream (validation
    # losses at the same iterations; convergence_4gpu.sh with REFERENCE_PAIR runs it):
    python3 scripts/convergence_report.py against-csv --log R/int8_attention.jsonl \\
        --csv benchmarks/results/convergence_350m.csv --pair "<the pair column>" \\
        --config configs/convergence_350m.yaml --output R/report/against_reference.md
    # BF16 of this job beside a run an earlier job recorded (convergence_4gpu.sh with RECORDED_LOG): `report` as
    # above with --other-recorded <that log>, named in the summary, its throughput ratio labelled as one of two jobs
    # (--bf16-recorded the other way round: a run of this job beside BF16 of an earlier one, RECORDED_BF16_LOG)
    # one line on a run in progress (scripts/convergence_4gpu.sh status prints it):
    python3 scripts/convergence_report.py progress --log R/int8.jsonl --config configs/convergence_350m.yaml

Both work on runs still in progress: the summary says how far each run is, and a check that needs evaluations
the runs have not reached yet says so instead of passing.

Definitions (the summary repeats them):
- gap = INT8 / BF16 - 1 of the validation loss at the same iteration (same data seed, so the same batches);
- the parity check: gap <= --gap-limit (1%) at every evaluation after the first --settle (10%) of the run; it
  judges INT8 trailing, and the summary lists apart the evaluations where INT8 leads by more than the limit;
- a loss spike: a step whose training loss exceeds the mean of the --spike-window steps before it by more than
  --spike-threshold (10%); a spike the other run does not have: none of the other's within --spike-match iterations;
- a gradient-norm spike: a step whose gradient norm exceeds --grad-spike-factor (3) times the median of the
  --spike-window steps before it, matched between the runs in the same way. Clipping bounds the step's size, not
  its direction, so such a step can move a run off its course for a while without any loss spike.
"""
import argparse
import hashlib
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling scripts below
from plot_health import main as plot_health, read_health, worst_linears  # noqa: E402
from plot_loss import output_problem, read_series, smooth, summary_table  # noqa: E402

HEALTH_STATS = ("fprop/rel_err", "dgrad/rel_err", "wgrad/rel_err", "fprop/underflow", "dgrad/underflow",
                "wgrad/underflow")
LABELS = ("BF16", "INT8")
# the runs a results CSV's `pair` column names ("<reference> vs <other> <schedule>"), longest first
RUN_NAMES = (("int8 + int8 attention", "INT8 + INT8 attention"), ("bf16 init seed 2", "BF16, init seed 2"),
             ("int8", "INT8"), ("bf16", "BF16"))


def _config_problem(config_path, train_iters):
    """Why the run's YAML cannot give the schedule (run_schedule's keys), else None."""
    import yaml

    try:
        with open(config_path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        return f"not a readable YAML file ({type(err).__name__})"
    if not isinstance(config, dict):
        return "not a YAML mapping of settings"
    missing = [key for key in ("train_iters", "global_batch_size", "seq_length")
               if key not in config and not (key == "train_iters" and train_iters)]
    return f"it sets no {', '.join(missing)}" if missing else None


def run_schedule(config_path, train_iters=None):
    """(train_iters, tokens per iteration) from the run's YAML (train_iters overridable, as on the command line)."""
    import yaml

    with open(config_path, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    return int(train_iters or config["train_iters"]), int(config["global_batch_size"]) * int(config["seq_length"])


def validation_gaps(bf16_valid, int8_valid):
    """[(iteration, bf16 loss, int8 loss, gap in %)] at the evaluations both runs have."""
    return [(it, bf16_valid[it], int8_valid[it], 100.0 * (int8_valid[it] / bf16_valid[it] - 1.0))
            for it in sorted(set(bf16_valid) & set(int8_valid))]


def schedule_mismatch(reference_lr, other_lr, rel=1e-6):
    """(iteration, reference lr, other lr) where the two runs' learning rates first differ, or None: a pair whose
    schedules differ (another --train-iters, --lr or warm-up) is no comparison of precisions."""
    for it in sorted(set(reference_lr) & set(other_lr)):
        a, b = reference_lr[it], other_lr[it]
        if abs(a - b) > rel * max(abs(a), abs(b)):
            return it, a, b
    return None


def parity_check(gaps, train_iters, limit_percent=1.0, settle=0.1):
    """(judged, failing, leading) rows of `gaps`: the evaluations after settle x train_iters, those whose gap
    exceeds the limit (the check fails), and those more than the limit below zero (a lead, which the check does
    not fail but which says the runs drifted apart as far)."""
    judged = [row for row in gaps if row[0] > settle * train_iters]
    return (judged, [row for row in judged if row[3] > limit_percent],
            [row for row in judged if row[3] < -limit_percent])


def check_line(judged, failing, limit_percent, settle, train_iters):
    """The parity check's verdict on parity_check's rows: not judged yet, met (with the largest gap), or not met."""
    rule = f"gap <= {limit_percent:g}% at every evaluation after the first {settle:.0%} of the run"
    if not judged:
        return f"Check ({rule}): **not judged yet**, no common evaluation after iteration {settle * train_iters:.0f}."
    if not failing:
        worst = max(judged, key=lambda g: g[3])
        return f"Check ({rule}): **met** (largest {worst[3]:+.2f}% at iteration {worst[0]})."
    return f"Check ({rule}): **not met** at " + ", ".join(f"iteration {it} ({g:+.2f}%)"
                                                          for it, _, _, g in failing) + "."


def lead_summary(leading, limit_percent, other, ref):
    """A line naming the evaluations where `other` leads `ref` by more than the limit (none without such a lead)."""
    if not leading:
        return []
    widest = min(leading, key=lambda row: row[3])
    return [f"{other} is more than {limit_percent:g}% below {ref} (a lead: the check judges only a trailing gap) at "
            f"{len(leading)} evaluation(s): " + ", ".join(f"{it} ({g:+.2f}%)" for it, _, _, g in leading)
            + f"; the widest {widest[3]:+.2f}% at iteration {widest[0]}."]


def noise_summary(gaps, noise_at, train_iters, settle):
    """Lines comparing the gap with the noise floor's at the judged evaluations (none without a noise floor)."""
    judged = [(it, g) for it, _, _, g in gaps if it > settle * train_iters and it in noise_at]
    if not judged:
        return []
    widest = max(judged, key=lambda row: abs(noise_at[row[0]]))
    beyond = [it for it, g in judged if abs(g) > abs(noise_at[it])]
    return [f"Noise floor, after the first {settle:.0%}: its largest gap is {noise_at[widest[0]]:+.2f}% (iteration "
            f"{widest[0]}); the gap is larger in magnitude than the noise floor's at {len(beyond)} of {len(judged)} "
            "evaluations" + (": " + ", ".join(map(str, beyond)) if beyond else "") + "."]


def trailing_levels(series, window, level):
    """{iteration: `level` (a mean or a median) of the `window` logged steps before it}; the first `window` steps
    have none."""
    steps = sorted(series)
    return {steps[k]: level([series[it] for it in steps[k - window:k]]) for k in range(window, len(steps))}


def trailing_spikes(series, levels, factor):
    """[(iteration, value, trailing level)]: steps whose value exceeds `factor` times their trailing level."""
    return [(it, series[it], trailing) for it, trailing in levels.items() if series[it] > factor * trailing]


def loss_spikes(train, threshold=0.10, window=50):
    """(spikes, trailing levels): steps whose loss exceeds the mean of the `window` steps before them by more than
    `threshold` (a fraction), and that mean at every step."""
    levels = trailing_levels(train, window, statistics.fmean)
    return trailing_spikes(train, levels, 1.0 + threshold), levels


def grad_norm_spikes(norms, factor=3.0, window=50):
    """(spikes, trailing levels): steps whose gradient norm exceeds `factor` times the median of the `window` steps
    before them, and that median at every step: a median, so that one large norm (28.9 against 0.6 in the 344M run)
    does not lift the level and hide the burst after it."""
    levels = trailing_levels(norms, window, statistics.median)
    return trailing_spikes(norms, levels, factor), levels


def unmatched_spikes(spikes, reference, tolerance):
    """The spikes of `spikes` with no spike of `reference` within `tolerance` iterations."""
    seen = [it for it, _, _ in reference]
    return [s for s in spikes if not any(abs(s[0] - it) <= tolerance for it in seen)]


def spike_lines(found, series, labels, tolerance, digits, listed=10):
    """Markdown lines: each run's spikes (iteration, value vs its trailing level), then, each way, the spikes of
    one run with none of the other's within `tolerance` iterations, each with both runs' value over their trailing
    level at that step: a step where the other run rose almost as far is a threshold apart, not a spike of one run
    alone. `found`: {label: (spikes, trailing levels)} of `series`: {label: {iteration: value}}."""
    spikes = {label: found[label][0] for label in labels}

    def ratio(label, it):
        trailing = found[label][1].get(it)
        return f"{series[label][it] / trailing:.3f}x" if trailing else "not judged"

    lines = []
    for label in labels:
        shown = ", ".join(f"{it} ({value:.{digits}f} vs {level:.{digits}f})"
                          for it, value, level in spikes[label][:listed])
        lines.append(f"- {label}: {len(spikes[label])} spike(s)" + (f": {shown}" if shown else "")
                     + (" ..." if len(spikes[label]) > listed else ""))
    for label, reference in (labels[::-1], labels):
        alone = unmatched_spikes(spikes[label], spikes[reference], tolerance)
        shown = ", ".join(f"{it} ({ratio(label, it)}; {reference} {ratio(reference, it)})" for it, _, _ in alone[:20])
        lines.append(f"- {label} spikes with no {reference} spike within {tolerance} iterations: {len(alone)}"
                     + (f" (value over its trailing level): {shown}" if alone else ""))
    return lines


def window_means(series, train_iters, windows):
    """[(first, last, mean of the values logged in [first, last])] over `windows` equal spans of the run;
    spans the run has not reached are left out, and a span it has only begun ends at its last logged iteration."""
    span = max(1, math.ceil(train_iters / windows))
    rows = []
    for first in range(1, train_iters + 1, span):
        logged = {it: v for it, v in series.items() if first <= it <= min(first + span - 1, train_iters)}
        if logged:
            last = min(first + span - 1, train_iters) if max(series) > first + span - 1 else max(logged)
            rows.append((first, last, sum(logged.values()) / len(logged)))
    return rows


def throughput(tokens_per_s, skip=10):
    """Median tokens/s over the logged steps after the first `skip` (start-up, compilation), or None."""
    values = [tokens_per_s[it] for it in sorted(tokens_per_s)[skip:]]
    return statistics.median(values) if values else None


def check_columns(series, columns=8):
    """Up to `columns` evenly spaced iterations of the statistics checks (the first and the last among them)."""
    checks = sorted({it for stats in series.values() for points in stats.values() for it, _ in points})
    if len(checks) <= columns:
        return checks
    return [checks[round(k * (len(checks) - 1) / (columns - 1))] for k in range(columns)]


def largest_at(series, stat, iterations):
    """Per iteration, (the largest value of `stat` over the linears, the linear with it); None where unmeasured."""
    largest = dict.fromkeys(iterations)
    for linear, stats in series.items():
        for it, value in stats.get(stat, []):
            if it in largest and value == value and (largest[it] is None or value > largest[it][0]):
                largest[it] = (value, linear)
    return [largest[it] for it in iterations]


def _fmt(value, digits=4):
    return "n/a" if value is None else f"{value:.{digits}f}"


def health_plot(log, output_dir):
    """health.png in output_dir from a run's health records (scripts/plot_health.py); None where it has none."""
    path = os.path.join(output_dir, "health.png")
    return path if plot_health([log, "--output", path]) == 0 else None


def health_section(int8_log, health_png, label="INT8"):
    """Markdown of the INT8 run's health records and fallback events (plot_health's readers)."""
    series, events = read_health(int8_log)
    lines = [f"## INT8 health (the {label} run's --int8-stats-interval records)", ""]
    if not series:
        return lines + [f"No `int8_health` records in the {label} log (was it an INT8 run with "
                        "--int8-stats-interval?).", ""]
    iterations = check_columns(series)
    lines += [f"{len(series)} INT8 linears. The largest value over the linears at evenly spaced checks, and the "
              "linear with it at the last:", "",
              "| statistic | " + " | ".join(f"it {it}" for it in iterations) + " | worst linear at the end |",
              "|---" * (len(iterations) + 2) + "|"]
    for stat in HEALTH_STATS:
        largest = largest_at(series, stat, iterations)
        if any(largest):
            lines.append(f"| {stat} | " + " | ".join("n/a" if v is None else f"{v[0]:.3g}" for v in largest)
                         + f" | {largest[-1][1] if largest[-1] else 'n/a'} |")
    lines += ["", "The three worst linears at the last check, with their largest value over the run:", "",
              "| statistic | linear | last | largest over the run |", "|---|---|---|---|"]
    for stat in HEALTH_STATS:
        for linear in worst_linears(series, stat, 3):
            points = series[linear][stat]
            lines.append(f"| {stat} | {linear} | {points[-1][1]:.3g} | {max(v for _, v in points):.3g} |")
    if health_png:
        lines += ["", f"Every linear's statistics over time: `{os.path.basename(health_png)}` "
                      "(scripts/plot_health.py, the 8 worst per panel)."]
    lines += ["", "## Automatic fallback", ""]
    if not events:
        lines.append("No `int8_fallback` event: no GEMM crossed its threshold on enough consecutive checks.")
    else:
        lines += [f"{len(events)} move(s):", "", "| iteration | linear | GEMM | change | reason |",
                  "|---|---|---|---|---|"]
        lines += [f"| {e['iteration']} | {e['linear']} | {e['gemm']} | {e['change']} | {e['reason']} |" for e in events]
    return lines + [""]


def plot(runs, gaps, train_iters, settle, limit, output, noise_gaps=()):
    """One PNG: training (smoothed) and validation loss, the gap (and the noise floor's), gradient norms and
    tokens/s of both runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    (loss_ax, gap_ax), (norm_ax, speed_ax) = axes
    low, high = math.inf, -math.inf
    for (label, data), color in zip(runs, ("tab:blue", "tab:red")):
        steps = sorted(data["train"])
        curve = smooth([data["train"][s] for s in steps], 20)
        loss_ax.plot(steps, curve, color=color, label=f"{label} training (mean of 20)")
        valid = data["valid"]
        if valid:
            loss_ax.plot(sorted(valid), [valid[s] for s in sorted(valid)], "o--", color=color, markersize=4,
                         label=f"{label} validation")
        low, high = min([low, *curve, *valid.values()]), max(high, max(curve))
        for ax, key, window in ((norm_ax, "grad_norm", 20), (speed_ax, "tokens_per_s", 20)):
            points = sorted(data[key])
            if points:
                ax.plot(points, smooth([data[key][s] for s in points], window), color=color, label=label)
    if math.isfinite(low):
        loss_ax.set_ylim(low * 0.97, min(high, 2.0 * low))
    loss_ax.set_title("lm loss")
    bf16_train, int8_train = runs[0][1]["train"], runs[1][1]["train"]
    common = sorted(set(bf16_train) & set(int8_train))
    if common:
        ratio = smooth([int8_train[s] for s in common], 50)
        reference = smooth([bf16_train[s] for s in common], 50)
        gap_ax.plot(common, [100 * (a / b - 1) for a, b in zip(ratio, reference)], color="gray",
                    label="training loss (means of 50)")
    if gaps:
        gap_ax.plot([g[0] for g in gaps], [g[3] for g in gaps], "o-", color="black", label="validation loss")
    if noise_gaps:
        gap_ax.plot([g[0] for g in noise_gaps], [g[3] for g in noise_gaps], "s--", color="tab:purple", markersize=4,
                    label=f"noise floor: {runs[0][0]} from another init (validation)")
    gap_ax.axhline(0, color="gray", linewidth=0.8)
    for bound in (limit, -limit):
        gap_ax.axhline(bound, color="tab:green", linestyle=":", linewidth=1)
    gap_ax.axvline(settle * train_iters, color="tab:green", linestyle="--", linewidth=0.8,
                   label=f"{settle:.0%} of the run")
    gap_ax.set_title(f"gap {runs[1][0]} / {runs[0][0]} - 1 (%)")
    norm_ax.set_yscale("log")
    norm_ax.set_title("gradient norm (mean of 20)")
    speed_ax.set_title("tokens/s per run (mean of 20 steps)")
    for ax in axes.flat:
        ax.set_xlabel("iteration")
        ax.set_xlim(0, train_iters)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(output, dpi=110)
    plt.close(figure)


def report(opts) -> int:
    train_iters, tokens_per_iteration = run_schedule(opts.config, opts.train_iters)
    runs = []
    ref, other = opts.labels
    if ref == other:
        print(f"error: --labels needs two different names, got {ref!r} twice", file=sys.stderr)
        return 1
    missing = [path for path in (opts.bf16, opts.int8, *(opts.noise_floor or ())) if not os.path.exists(path)]
    if missing:
        print(f"error: no log {missing[0]}", file=sys.stderr)
        return 1
    for label, path in zip(opts.labels, (opts.bf16, opts.int8)):
        keys = ("train", "valid", "grad_norm", "tokens_per_s", "step_time_s", "lr")
        data = dict(zip(keys, read_series(path, "lm_loss", "valid_lm_loss", *keys[2:])))
        if not data["train"]:
            print(f"error: {path} has no training loss records yet", file=sys.stderr)
            return 1
        runs.append((label, data))
    (_, bf16), (_, int8) = runs
    gaps = validation_gaps(bf16["valid"], int8["valid"])
    judged, failing, leading = parity_check(gaps, train_iters, opts.gap_limit, opts.settle)
    noise_gaps = []
    if opts.noise_floor:
        noise_ref, noise_other = (read_series(path, "valid_lm_loss")[0] for path in opts.noise_floor)
        noise_gaps = validation_gaps(noise_ref, noise_other)
    os.makedirs(opts.output_dir, exist_ok=True)
    png = os.path.join(opts.output_dir, "convergence.png")
    plot(runs, gaps, train_iters, opts.settle, opts.gap_limit, png, noise_gaps)
    health_png = health_plot(opts.int8, opts.output_dir)

    done = {label: max(data["train"]) for label, data in runs}
    recorded = {ref: opts.bf16_recorded, other: opts.other_recorded}  # logs an earlier job recorded
    lines = [f"# {other} vs {ref} convergence: `{os.path.basename(opts.config)}`", ""]
    for label, last in done.items():
        lines.append(f"- {label}: iteration {last} of {train_iters} ({last * tokens_per_iteration / 1e6:.1f}M of "
                     f"{train_iters * tokens_per_iteration / 1e6:.1f}M tokens)" + ("" if last >= train_iters else
                                                                                    ", **not finished**")
                     + (f"; recorded by an earlier job: `{recorded[label]}`" if recorded[label] else ""))
    mismatch = schedule_mismatch(bf16["lr"], int8["lr"])
    if mismatch:
        it, a, b = mismatch
        lines += ["", f"**Not one schedule**: the learning rates differ from iteration {it} ({ref} {a:.6g}, {other} "
                      f"{b:.6g}), so the gaps below compare runs trained differently, not two precisions (compare "
                      "their --train-iters, --lr, --min-lr and warm-up)."]
    if opts.corpus_stats and os.path.exists(opts.corpus_stats):
        with open(opts.corpus_stats, encoding="utf-8") as f:
            lines += ["", "Corpus: " + corpus_sentence(json.load(f))]
    # a run ahead of the other would be compared at a later, lower point of its curve: cut both to the common part
    common_last = min(done.values())
    upto = {label: {key: {it: v for it, v in data[key].items() if it <= common_last}
                    for key in ("train", "valid", "grad_norm")}
            for label, data in runs}
    lines += ["", f"![curves]({os.path.basename(png)})", "", "## Loss", ""]
    if len(set(done.values())) > 1:
        lines += [f"Both runs up to iteration {common_last}, the last one both reached (the losses and spikes below).",
                  ""]
    lines += [summary_table([(label, upto[label]["train"], upto[label]["valid"]) for label, _ in runs]), "",
              "## Validation gap at every evaluation", "",
              f"gap = {other} / {ref} - 1 of the validation loss at the same iteration (one data seed: the same "
              "batches)." + (" Noise floor: the same gap of {} from another initialization (`{}` against `{}`).".format(
                                 ref, *(os.path.basename(path) for path in reversed(opts.noise_floor)))
                             if noise_gaps else ""), ""]
    noise_at = {it: g for it, _, _, g in noise_gaps}
    lines += [f"| iteration | tokens | {ref} | {other} | gap |" + (" noise floor gap |" if noise_gaps else ""),
              "|---" * (5 + bool(noise_gaps)) + "|"]
    for it, b, i, g in gaps:
        noise = (f" {noise_at[it]:+.2f}% |" if it in noise_at else " n/a |") if noise_gaps else ""
        lines.append(f"| {it} | {it * tokens_per_iteration / 1e6:.1f}M | {b:.4f} | {i:.4f} | {g:+.2f}% |" + noise)
    lines += ["", check_line(judged, failing, opts.gap_limit, opts.settle, train_iters)]
    lines += lead_summary(leading, opts.gap_limit, other, ref)
    lines += noise_summary(gaps, noise_at, train_iters, opts.settle)
    if gaps and gaps[-1][0] >= train_iters:
        lines.append(f"At the end (iteration {gaps[-1][0]}): gap {gaps[-1][3]:+.2f}%.")
    elif gaps:
        lines.append(f"The runs have not finished: the last common evaluation is at iteration {gaps[-1][0]} "
                     f"({gaps[-1][3]:+.2f}%).")

    loss = {label: loss_spikes(upto[label]["train"], opts.spike_threshold, opts.spike_window) for label in opts.labels}
    lines += ["", "## Loss spikes", "",
              f"A spike: a step's training loss more than {opts.spike_threshold:.0%} above the mean of the "
              f"{opts.spike_window} steps before it.", ""]
    lines += spike_lines(loss, {label: upto[label]["train"] for label in opts.labels}, opts.labels, opts.spike_match,
                         digits=3)
    norms = {label: grad_norm_spikes(upto[label]["grad_norm"], opts.grad_spike_factor, opts.spike_window)
             for label in opts.labels}
    lines += ["", "## Gradient-norm spikes", "",
              f"A step whose gradient norm exceeds {opts.grad_spike_factor:g}x the median of the {opts.spike_window} "
              "steps before it (clipping bounds its size, not its direction).", ""]
    lines += spike_lines(norms, {label: upto[label]["grad_norm"] for label in opts.labels}, opts.labels,
                         opts.spike_match, digits=2)

    lines += ["", "## Gradient norms (mean over each span)", "", f"| iterations | {ref} | {other} | {other} / {ref} |",
              "|---|---|---|---|"]
    # up to the common iteration, as the losses: a span one run has only begun would compare other steps
    reference_norms, other_norms = (upto[label]["grad_norm"] for label in opts.labels)
    int8_means = {(a, b): m for a, b, m in window_means(other_norms, train_iters, opts.windows)}
    for first, last, mean in window_means(reference_norms, train_iters, opts.windows):
        other_mean = int8_means.get((first, last))
        lines.append(f"| {first}-{last} | {mean:.3f} | {_fmt(other_mean, 3)} | "
                     f"{_fmt(other_mean / mean if other_mean is not None else None, 3)} |")

    gpus = f"{opts.gpus_per_run} GPU{'s' if opts.gpus_per_run > 1 else ''}"
    lines += ["", f"## Throughput ({gpus} per run, data parallel)", "",
              "| run | tokens/s (median step after the first 10) | training time (sum of step times) |",
              "|---|---|---|"]
    speeds = {}
    for label, data in runs:
        speeds[label] = throughput(data["tokens_per_s"])
        seconds = sum(data["step_time_s"].values())
        lines.append(f"| {label} | {_fmt(speeds[label], 0)} | {seconds / 60:.1f} min |")
    if speeds[ref] and speeds[other]:
        lines.append(f"\n{other} / {ref}: {speeds[other] / speeds[ref]:.3f}x" +
                     (" (two jobs: compare speeds on one machine before reading this as a speed-up)."
                      if opts.other_recorded or opts.bf16_recorded else "."))
    lines += [""] + health_section(opts.int8, health_png, other)
    summary = os.path.join(opts.output_dir, "convergence.md")
    with open(summary, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {png}, {summary}" + (f", {health_png}" if health_png else ""))
    return 0


def recorded_pair(csv_path, pair):
    """The evaluations of one pair recorded in a results CSV (benchmarks/results/convergence_350m.csv's columns):
    ({iteration: reference validation loss}, {iteration: the other run's}, the rows' (date, commit, gpu))."""
    import csv

    reference, other, origin = {}, {}, set()
    with open(csv_path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            if row["pair"] == pair:
                it = int(row["iteration"])
                reference[it], other[it] = float(row["reference_valid"]), float(row["other_valid"])
                origin.add((row["date"], row["commit"], row["gpu"]))
    return reference, other, sorted(origin)


def pair_labels(pair):
    """(reference, other): the labels of the two runs a results CSV's `pair` names, so that a recorded pair of
    INT8 attention, or of INT8 against INT8 attention, is not labelled BF16 vs INT8; None where the name does not
    begin "<run> vs <run>"."""
    reference, vs, rest = pair.partition(" vs ")
    names = dict(RUN_NAMES)
    if not vs or reference not in names:
        return None
    return next(((names[reference], label) for name, label in RUN_NAMES
                 if rest == name or rest.startswith(name + " ")), None)


def against_csv(opts) -> int:
    """One run (a 1-GPU machine's) against a pair recorded by an earlier job on the same token stream: its
    validation loss beside the pair's at each evaluation, the parity check against the pair's reference, and the
    run's throughput and health."""
    train_iters, tokens_per_iteration = run_schedule(opts.config, opts.train_iters)
    if not os.path.exists(opts.log):
        print(f"error: no log {opts.log}", file=sys.stderr)
        return 1
    reference, recorded, origin = recorded_pair(opts.csv, opts.pair)
    if not reference:
        print(f"error: no pair {opts.pair!r} in {opts.csv}", file=sys.stderr)
        return 1
    train, valid, speed = read_series(opts.log, "lm_loss", "valid_lm_loss", "tokens_per_s")
    if not train:
        print(f"error: {opts.log} has no training loss records yet", file=sys.stderr)
        return 1
    labels = opts.reference_labels or pair_labels(opts.pair)
    if labels is None:
        print(f"error: the pair {opts.pair!r} does not begin '<run> vs <run>' with runs named as in "
              f"{[name for name, _ in RUN_NAMES]}: give its runs' labels with --reference-labels", file=sys.stderr)
        return 1
    ref, other = labels
    label = opts.label
    gaps = validation_gaps(reference, valid)
    judged, failing, leading = parity_check(gaps, train_iters, opts.gap_limit, opts.settle)
    last = max(train)
    lines = [f"# {label} against the recorded pair `{opts.pair}`: `{os.path.basename(opts.config)}`", "",
             f"The pair's rows in `{os.path.basename(opts.csv)}`: "
             + "; ".join(f"{date}, {commit}, {gpu}" for date, commit, gpu in origin)
             + f". This run: iteration {last} of {train_iters} ({last * tokens_per_iteration / 1e6:.1f}M tokens)"
             + ("." if last >= train_iters else ", **not finished**."),
             "", f"gap = {label} / {ref} - 1 of the validation loss at the same iteration (the same batches where "
                 f"the token stream is the pair's); {other}'s gap is the pair's own.", "",
             f"| iteration | tokens | {ref} | {other} | {label} | gap | {other}'s gap | {label} / {other} - 1 |",
             "|---" * 8 + "|"]
    for it, b, x, g in gaps:
        y = recorded.get(it)
        lines.append(f"| {it} | {it * tokens_per_iteration / 1e6:.1f}M | {b:.4f} | {_fmt(y)} | {x:.4f} | {g:+.2f}% | "
                     + (f"{100 * (y / b - 1):+.2f}% | {100 * (x / y - 1):+.2f}% |" if y else "n/a | n/a |"))
    lines += ["", check_line(judged, failing, opts.gap_limit, opts.settle, train_iters)]
    lines += lead_summary(leading, opts.gap_limit, label, ref)
    if gaps and gaps[-1][0] >= train_iters:
        lines.append(f"At the end (iteration {gaps[-1][0]}): gap {gaps[-1][3]:+.2f}%.")
    median = throughput(speed)
    lines += ["", f"Throughput: {_fmt(median, 0)} tokens/s (median step after the first 10; {label}, this job).", ""]
    health_png = health_plot(opts.log, os.path.dirname(os.path.abspath(opts.output))) if opts.output else None
    lines += health_section(opts.log, health_png, label)
    if opts.output:
        with open(opts.output, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def progress(opts) -> int:
    """One line on a run in progress: last iteration, loss, last validation, recent tokens/s, time left."""
    train_iters, tokens_per_iteration = run_schedule(opts.config, opts.train_iters)
    if not os.path.exists(opts.log):
        print("no log yet")
        return 0
    train, valid, speed, step = read_series(opts.log, "lm_loss", "valid_lm_loss", "tokens_per_s", "step_time_s")
    if not train:
        print("no training step logged yet")
        return 0
    last = max(train)
    recent = sorted(train)[-20:]
    speeds, steps = [speed[it] for it in recent if it in speed], [step[it] for it in recent if it in step]
    stop_at = min(opts.stop_at or train_iters, train_iters)
    line = (f"iteration {last}/{train_iters} ({last * tokens_per_iteration / 1e6:.1f}M tokens), loss {train[last]:.4f}"
            + (f", validation {valid[max(valid)]:.4f} at {max(valid)}" if valid else ""))
    if speeds and steps:
        left = max(0, stop_at - last) * sum(steps) / len(steps)
        line += (f", {sum(speeds) / len(speeds):.0f} tokens/s (last 20 steps), steps left"
                 + (f" to the stop at {stop_at}" if stop_at < train_iters else "") + f" {left / 60:.1f} min")
    print(line)
    return 0


def corpus_sentence(stats):
    return (f"{stats['corpus_mb']:.1f} MB of text in {stats['documents']} files, {stats['tokens'] / 1e6:.1f}M tokens "
            f"({stats['train_tokens'] / 1e6:.1f}M in the training split, {stats['valid_tokens'] / 1e6:.2f}M held out "
            f"for validation), {stats['distinct_token_ids']} distinct token ids of {stats['vocab_size']}; a run of "
            f"{stats['tokens_trained'] / 1e6:.1f}M tokens takes {stats['epochs']:.2f} epochs of the training split."
            + (f" SHA-256 of the text {stats['text_sha256'][:12]}, of the tokens {stats['tokens_sha256'][:12]}"
               + (f", of the tokenizer {stats['tokenizer_sha256'][:12]}" if "tokenizer_sha256" in stats else "") + "."
               if "tokens_sha256" in stats else ""))


def file_sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def corpus(opts) -> int:
    """Counts the corpus as the trainer reads it: megatron's GPTDataset splits the documents by --split in
    order (the first 98% train), so a split's tokens are its documents' lengths in the indexed dataset."""
    import numpy
    import yaml
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                       parse_and_normalize_split)
    from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path

    text_bytes = documents = 0
    with open(opts.corpus, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                text_bytes += len(json.loads(line)["text"].encode("utf-8"))
                documents += 1
    dataset = IndexedDataset(opts.prefix)
    per_document = dataset.sequence_lengths.astype(numpy.int64)  # preprocess_data writes one sequence per document
    with open(opts.config, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    # megatron's rule (BlendedMegatronDatasetBuilder): split k holds documents [round(a * n), round(b * n))
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(str(config.get("split", "969, 30, 1"))))
    n = len(per_document)
    tokens_of = [0 if bounds is None else int(per_document[int(round(bounds[0] * n)):int(round(bounds[1] * n))].sum())
                 for bounds in matrix]
    train_iters, tokens_per_iteration = run_schedule(opts.config, opts.train_iters)
    vocab = int(opts.vocab_size) if opts.vocab_size else None
    tokens = numpy.memmap(get_bin_path(opts.prefix), dtype=dataset.index.dtype, mode="r")  # the tokens, back to back
    counts = numpy.zeros(1, dtype=numpy.int64)
    for start in range(0, len(tokens), 1 << 26):  # in chunks: bincount widens its input to int64
        chunk = numpy.bincount(tokens[start:start + (1 << 26)])
        counts = numpy.pad(counts, (0, max(0, len(chunk) - len(counts))))
        counts[:len(chunk)] += chunk
    stats = {"corpus_mb": text_bytes / 2**20, "documents": documents, "indexed_documents": n,
             "tokens": int(per_document.sum()), "train_tokens": tokens_of[0], "valid_tokens": tokens_of[1],
             "distinct_token_ids": int(numpy.count_nonzero(counts)), "vocab_size": vocab or len(counts),
             "tokens_trained": train_iters * tokens_per_iteration,
             # two runs saw the same data only if both match
             "text_sha256": file_sha256(opts.corpus), "tokens_sha256": file_sha256(get_bin_path(opts.prefix))}
    if opts.tokenizer_model:
        stats["tokenizer_sha256"] = file_sha256(opts.tokenizer_model)
    stats["epochs"] = stats["tokens_trained"] / stats["train_tokens"]
    with open(opts.output, "w", encoding="utf-8") as f:
        json.dump(stats, f, indent=1)
    print("corpus: " + corpus_sentence(stats))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rep = commands.add_parser("report", help="PNG + markdown summary of a BF16 and an INT8 run")
    rep.add_argument("--bf16", required=True, help="the BF16 run's JSONL log (the reference)")
    rep.add_argument("--int8", required=True,
                     help="the INT8 run's JSONL log (with int8_health records), or any run compared with the reference")
    rep.add_argument("--labels", nargs=2, default=list(LABELS), metavar=("REFERENCE", "OTHER"),
                     help="the two runs' names in the summary and the PNG (default: %(default)s); e.g. BF16 "
                          "'BF16 (init seed 2)' for a noise-floor pair")
    rep.add_argument("--config", required=True, help="the runs' YAML (train_iters, global batch, sequence length)")
    rep.add_argument("--train-iters", type=int, default=None, help="the runs' --train-iters, where not the YAML's")
    rep.add_argument("--output-dir", required=True, help="where convergence.png, convergence.md, health.png go")
    rep.add_argument("--noise-floor", nargs=2, default=None, metavar=("REFERENCE", "LOG"),
                     help="a noise-floor pair: a run of the reference precision (--bf16 itself, or one of another "
                          "machine's token stream) and one from another initialization on its batches (--seed "
                          "changed, --data-seed kept): their gap, beside the other run's")
    rep.add_argument("--corpus-stats", default=None, help="the JSON of the `corpus` command, quoted in the summary")
    rep.add_argument("--gpus-per-run", type=int, default=2, help="GPUs each run trained on, for the throughput table")
    rep.add_argument("--other-recorded", default=None, metavar="LOG",
                     help="where --int8 came from when an earlier job recorded it (named in the summary; the "
                          "throughput ratio is then one of two jobs)")
    rep.add_argument("--bf16-recorded", default=None, metavar="LOG",
                     help="where --bf16 came from when an earlier job recorded it (as --other-recorded)")
    rep.add_argument("--gap-limit", type=float, default=1.0, help="validation gap limit in %% (default: %(default)s)")
    rep.add_argument("--settle", type=float, default=0.1,
                     help="fraction of the run before the gap is judged (default: %(default)s)")
    rep.add_argument("--spike-threshold", type=float, default=0.10,
                     help="a spike: loss above the trailing mean by more than this fraction (default: %(default)s)")
    rep.add_argument("--spike-window", type=int, default=50,
                     help="trailing steps a loss or gradient-norm spike is judged against (default: %(default)s)")
    rep.add_argument("--grad-spike-factor", type=float, default=3.0,
                     help="a gradient-norm spike: norm above this multiple of the trailing median "
                          "(default: %(default)s)")
    rep.add_argument("--spike-match", type=int, default=5,
                     help="a spike of one run this close (iterations) matches one of the other (default: %(default)s)")
    rep.add_argument("--windows", type=int, default=10, help="spans of the gradient-norm table (default: %(default)s)")
    cor = commands.add_parser("corpus", help="corpus bytes, tokens per split, distinct token ids, epochs of a run")
    cor.add_argument("--corpus", required=True, help="the JSONL corpus (scripts/prepare_tiny_corpus.py)")
    cor.add_argument("--prefix", required=True, help="the indexed dataset's prefix (..._text_document)")
    cor.add_argument("--config", required=True, help="the run's YAML (split, train_iters, batch, sequence length)")
    cor.add_argument("--train-iters", type=int, default=None)
    cor.add_argument("--vocab-size", type=int, default=None, help="the tokenizer's vocabulary, for the summary")
    cor.add_argument("--tokenizer-model", default=None, help="the tokenizer file, whose SHA-256 the JSON records")
    cor.add_argument("--output", required=True, help="JSON to write")
    pro = commands.add_parser("progress", help="one line on a run in progress (its JSONL log)")
    pro.add_argument("--log", required=True)
    pro.add_argument("--config", required=True)
    pro.add_argument("--train-iters", type=int, default=None)
    pro.add_argument("--stop-at", type=int, default=None, help="the iteration where the run stops (STOP_AT)")
    csv_cmd = commands.add_parser("against-csv",
                                  help="one run against a pair recorded in a results CSV (a 1-GPU machine's run)")
    csv_cmd.add_argument("--log", required=True, help="the run's JSONL log")
    csv_cmd.add_argument("--csv", required=True, help="the results CSV (benchmarks/results/convergence_350m.csv)")
    csv_cmd.add_argument("--pair", required=True, help="the recorded pair: its `pair` column, exactly")
    csv_cmd.add_argument("--label", default="INT8 + INT8 attention", help="the run's name (default: %(default)s)")
    csv_cmd.add_argument("--reference-labels", nargs=2, default=None, metavar=("REFERENCE", "OTHER"),
                         help="the recorded pair's two runs (default: read from the pair's name, e.g. 'bf16 vs int8 "
                              "+ int8 attention ...' -> BF16, INT8 + INT8 attention)")
    csv_cmd.add_argument("--config", required=True, help="the run's YAML (train_iters, global batch, sequence length)")
    csv_cmd.add_argument("--train-iters", type=int, default=None, help="the run's --train-iters, where not the YAML's")
    csv_cmd.add_argument("--output", default=None, help="markdown to write (health.png beside it)")
    csv_cmd.add_argument("--gap-limit", type=float, default=1.0,
                         help="validation gap limit in %% (default: %(default)s)")
    csv_cmd.add_argument("--settle", type=float, default=0.1,
                         help="fraction of the run before the gap is judged (default: %(default)s)")
    opts = parser.parse_args(argv)
    if not os.path.isfile(opts.config):  # every command reads its schedule from it
        parser.error(f"--config: no file {opts.config}")
    if opts.train_iters is not None and opts.train_iters < 1:  # 0 would fall back to the YAML's silently
        parser.error(f"--train-iters must be >= 1, got {opts.train_iters}")
    problem = _config_problem(opts.config, opts.train_iters)
    if problem:
        parser.error(f"--config {opts.config}: {problem}")
    inputs = {"report": ("bf16", "int8", "noise_floor"), "against-csv": ("log", "csv"), "progress": ("log",),
              "corpus": ("corpus", "tokenizer_model")}[opts.command]
    for name in inputs:
        paths = getattr(opts, name)
        for path in paths if isinstance(paths, list) else [paths]:
            if path is not None and not os.path.isfile(path):
                parser.error(f"--{name.replace('_', '-')} {path}: " + ("a folder, not a file" if os.path.isdir(path)
                                                                        else "no such file"))
    if opts.command == "corpus" and not all(os.path.isfile(opts.prefix + ext) for ext in (".bin", ".idx")):
        parser.error(f"--prefix {opts.prefix}: no indexed dataset there ({opts.prefix}.bin and .idx)")
    if opts.command == "report" and os.path.exists(opts.output_dir) and not os.path.isdir(opts.output_dir):
        parser.error(f"--output-dir {opts.output_dir} is a file: give a folder")
    output = getattr(opts, "output", None) or (os.path.join(opts.output_dir, "convergence.md")
                                               if opts.command == "report" else None)
    problem = output and output_problem(output)  # makes the missing folders
    if problem:
        parser.error(f"--output{'-dir' if opts.command == 'report' else ''} {problem}")
    if opts.command == "progress":
        return progress(opts)
    if opts.command == "report":
        if opts.gpus_per_run < 1 or opts.spike_match < 0:
            parser.error("--gpus-per-run must be >= 1 and --spike-match >= 0")
        if opts.corpus_stats and not os.path.isfile(opts.corpus_stats):
            print(f"note: --corpus-stats {opts.corpus_stats} does not exist: the summary has no corpus line",
                  file=sys.stderr)
        for name in ("spike_threshold", "settle"):
            if not 0 < getattr(opts, name) < 1:
                parser.error(f"--{name.replace('_', '-')} must be in (0, 1)")
        if opts.spike_window < 1 or opts.windows < 1 or opts.gap_limit <= 0 or opts.grad_spike_factor <= 1:
            parser.error("--spike-window and --windows must be >= 1, --gap-limit > 0, --grad-spike-factor > 1")
        return report(opts)
    if opts.command == "against-csv":
        if not 0 < opts.settle < 1 or opts.gap_limit <= 0:
            parser.error("--settle must be in (0, 1) and --gap-limit > 0")
        return against_csv(opts)
    return corpus(opts)


if __name__ == "__main__":
    sys.exit(main())
