"""Issue #51's convergence run, on CPU: the ~350M config builds a model of that size through the trainer's own code,
scripts/convergence_report.py reads two real trainer logs (a BF16 and an INT8 run with health statistics and
fallback moves) into the gap table, the 1% check, spikes and the PNG, and scripts/convergence_4gpu.sh's `status`
mode collects a finished pair of runs into $OUT and refuses an empty run directory with a clear message."""
import gzip
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

import pytest
from free_ports import free_port_pair
from repo_paths import CONFIGS, ROOT, SCRIPTS
from test_training import SMALL_MODEL, _run

sys.path.insert(0, SCRIPTS)
import convergence_report  # noqa: E402

SCRIPT = os.path.join(ROOT, "scripts", "convergence_4gpu.sh")

ITERATIONS, GLOBAL_BATCH, SEQ = 40, 4, 64
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--micro-batch-size", "2",
        "--global-batch-size", str(GLOBAL_BATCH), "--eval-interval", "10", "--train-iters", str(ITERATIONS)]


def test_config_builds_a_350m_llama_for_300m_tokens():
    """configs/convergence_350m.yaml at 2 data-parallel ranks with the 8192-token vocabulary: the model the trainer
    builds (on the meta device) has the parameters the architecture's arithmetic gives, 330-370M, and the schedule
    trains >= 300M tokens with an evaluation every 5% of the run."""
    import torch
    from mcore_helpers import single_process_megatron

    from megatron_int8.megatron.cli import policy_from_args
    from megatron_int8.training.args import parse_args, validate_args
    from megatron_int8.training.model import build_config, build_model, unwrap

    args = validate_args(parse_args(["--config", os.path.join(CONFIGS, "convergence_350m.yaml"), "--mock-data",
                                     "--tokenizer-type", "NullTokenizer", "--vocab-size", "8192"]), world_size=2)
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size) == (24, 1024, 3584)
    assert (args.num_attention_heads, args.num_query_groups, args.kv_channels, args.seq_length) == (16, 4, 64, 2048)
    assert args.swiglu and args.normalization == "RMSNorm" and args.position_embedding_type == "rope"
    assert args.untie_embeddings_and_output_weights and args.bf16 and not args.add_bias_linear
    assert args.data_parallel_size == 2 and args.global_batch_size // (2 * args.micro_batch_size) == 4
    assert args.train_iters * args.global_batch_size * args.seq_length >= 300e6
    assert args.eval_interval * 20 == args.train_iters and args.lr_decay_style == "cosine"
    with single_process_megatron():
        config = build_config(args, log=lambda message: None)
        with torch.device("meta"):
            model = unwrap(build_model(args, config, policy_from_args(args), 8192, log=lambda message: None))[0]
        built = sum(p.numel() for p in model.parameters())
    h, q, kv, ffn, vocab = 1024, 16 * 64, 4 * 64, 3584, 8192
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * ffn + 2 * h  # QKV, output projection, SwiGLU, two RMSNorms
    assert built == 24 * per_layer + 2 * vocab * h + h  # + embedding, untied output layer, final norm
    assert 330e6 <= built <= 370e6, built


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """A BF16 and an INT8 run of the tiny model on mock data (same seed), logged as the trainer logs; the INT8 run
    with health statistics every 5 iterations and thresholds that every GEMM crosses, so fallback moves happen."""
    root = tmp_path_factory.mktemp("convergence")
    forced_fallback = ["--int8-linear", "--int8-stats-interval", "5", "--int8-auto-fallback",
                       "--int8-fallback-max-rel-err", "1e-9", "--int8-fallback-patience", "4"]
    for name, flags in (("bf16", []), ("int8", forced_fallback)):
        _run([sys.executable, "-m", "megatron_int8.pretrain", "--config", os.path.join(CONFIGS, "tiny.yaml"),
              *SMALL_MODEL, *MOCK, "--log-jsonl", str(root / f"{name}.jsonl"), *flags])
    (root / "run.yaml").write_text(f"train_iters: {ITERATIONS}\nglobal_batch_size: {GLOBAL_BATCH}\nseq_length: {SEQ}\n")
    return root


def records(path, key):
    with open(path) as f:
        return [r for r in map(json.loads, f) if key in r]


def edited(src, dst, iteration, key, factor):
    """A copy of a log with one record's `key` at `iteration` multiplied by `factor`."""
    with open(src) as f, open(dst, "w") as out:
        for record in map(json.loads, f):
            if record.get("iteration") == iteration and key in record:
                record[key] *= factor
            out.write(json.dumps(record) + "\n")
    return str(dst)


def report(logs, out, bf16=None, int8=None, *extra):
    assert convergence_report.main(["report", "--bf16", bf16 or str(logs / "bf16.jsonl"), "--int8",
                                    int8 or str(logs / "int8.jsonl"), "--config", str(logs / "run.yaml"),
                                    "--output-dir", str(out), *extra]) == 0
    return (out / "convergence.md").read_text()


@pytest.mark.slow
def test_report_of_two_real_logs(logs, tmp_path):
    bf16_valid = {r["iteration"]: r["valid_lm_loss"] for r in records(logs / "bf16.jsonl", "valid_lm_loss")}
    int8_valid = {r["iteration"]: r["valid_lm_loss"] for r in records(logs / "int8.jsonl", "valid_lm_loss")}
    assert sorted(bf16_valid) == sorted(int8_valid) == [10, 20, 30, 40]
    summary = report(logs, tmp_path / "a")
    for it in (10, 20, 30, 40):  # the gap table: every evaluation, the gap from the logged losses
        gap = 100 * (int8_valid[it] / bf16_valid[it] - 1)
        assert (f"| {it} | {it * GLOBAL_BATCH * SEQ / 1e6:.1f}M | {bf16_valid[it]:.4f} | {int8_valid[it]:.4f} | "
                f"{gap:+.2f}% |") in summary
    assert "Check (gap <= 1% at every evaluation after the first 10% of the run): **met**" in summary
    assert f"At the end (iteration {ITERATIONS}): gap" in summary
    assert "- BF16: 0 spike(s)" in summary and "- INT8: 0 spike(s)" in summary
    assert "| 1-4 | " in summary and "| 37-40 | " in summary  # gradient norms over ten spans of the run
    assert "INT8 / BF16: " in summary and "Not one schedule" not in summary and "two jobs" not in summary
    recorded = report(logs, tmp_path / "recorded", None, None, "--other-recorded", "earlier/int8.jsonl.gz")
    assert "- INT8: iteration 40 of 40 (0.0M of 0.0M tokens); recorded by an earlier job: `earlier/int8.jsonl.gz`" \
        in recorded
    assert re.search(r"^INT8 / BF16: \d+\.\d{3}x \(two jobs: compare speeds on one machine", recorded, re.M), recorded
    recorded_bf16 = report(logs, tmp_path / "recorded_bf16", None, None, "--bf16-recorded", "earlier/bf16.jsonl.gz")
    assert "- BF16: iteration 40 of 40 (0.0M of 0.0M tokens); recorded by an earlier job: `earlier/bf16.jsonl.gz`" \
        in recorded_bf16 and "- INT8: iteration 40 of 40 (0.0M of 0.0M tokens)\n" in recorded_bf16
    assert re.search(r"^INT8 / BF16: \d+\.\d{3}x \(two jobs", recorded_bf16, re.M), recorded_bf16
    # health: the statistics at every check (5, 10, ..., 40) and the fallback moves the thresholds forced
    assert "| statistic | it 5 | it 10 | it 15 | it 20 | it 25 | it 30 | it 35 | it 40 |" in summary
    assert "| fprop/rel_err | " in summary and "| wgrad/underflow | " in summary
    events = records(logs / "int8.jsonl", "int8_fallback")
    assert events and f"{len(events)} move(s):" in summary
    first = events[0]["int8_fallback"]
    assert f"| {first['iteration']} | {first['linear']} | {first['gemm']} | {first['change']} |" in summary
    for png in ("convergence.png", "health.png"):
        assert (tmp_path / "a" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # an INT8 loss spike (x1.5 at iteration 30) that BF16 does not have, and a 2% gap at the evaluation of 20
    other_schedule = edited(logs / "int8.jsonl", tmp_path / "lr.jsonl", 25, "lr", 1.01)
    lr_25 = {r["iteration"]: r["lr"] for r in records(logs / "bf16.jsonl", "lr")}[25]
    assert (f"**Not one schedule**: the learning rates differ from iteration 25 (BF16 {lr_25:.6g}, INT8 "
            f"{lr_25 * 1.01:.6g})") in report(logs, tmp_path / "lr", None, other_schedule)
    spiked = edited(logs / "int8.jsonl", tmp_path / "spiked.jsonl", 30, "lm_loss", 1.5)
    worse = edited(spiked, tmp_path / "worse.jsonl", 20, "valid_lm_loss", 1.02)
    summary = report(logs, tmp_path / "b", None, worse, "--spike-window", "10")
    assert "- INT8: 1 spike(s): 30 (" in summary and "- BF16: 0 spike(s)" in summary
    int8_train = {r["iteration"]: r["lm_loss"] for r in records(logs / "int8.jsonl", "lm_loss")}
    bf16_train = {r["iteration"]: r["lm_loss"] for r in records(logs / "bf16.jsonl", "lm_loss")}
    int8_ratio = 1.5 * int8_train[30] / statistics.fmean(int8_train[it] for it in range(20, 30))
    bf16_ratio = bf16_train[30] / statistics.fmean(bf16_train[it] for it in range(20, 30))
    assert ("- INT8 spikes with no BF16 spike within 5 iterations: 1 (value over its trailing level): "
            f"30 ({int8_ratio:.3f}x; BF16 {bf16_ratio:.3f}x)") in summary
    gap = 100 * (int8_valid[20] * 1.02 / bf16_valid[20] - 1)
    assert f"**not met** at iteration 20 ({gap:+.2f}%)." in summary
    assert "below BF16 (a lead" not in summary
    # INT8 2% below BF16 at 30: the check is met (it judges a trailing gap), and the report names the lead
    ahead = edited(logs / "int8.jsonl", tmp_path / "ahead.jsonl", 30, "valid_lm_loss", 0.98)
    summary = report(logs, tmp_path / "l", None, ahead)
    lead = 100 * (int8_valid[30] * 0.98 / bf16_valid[30] - 1)
    assert "**met** (largest" in summary
    assert (f"INT8 is more than 1% below BF16 (a lead: the check judges only a trailing gap) at 1 evaluation(s): "
            f"30 ({lead:+.2f}%); the widest {lead:+.2f}% at iteration 30.") in summary
    # a gradient-norm spike (x5 at iteration 35) that BF16 does not have, listed apart from the loss spikes
    kicked = edited(logs / "int8.jsonl", tmp_path / "kicked.jsonl", 35, "grad_norm", 5.0)
    summary = report(logs, tmp_path / "k", None, kicked, "--spike-window", "10")
    int8_norms = {r["iteration"]: r["grad_norm"] for r in records(logs / "int8.jsonl", "grad_norm")}
    median = statistics.median(int8_norms[it] for it in range(25, 35))
    assert f"- INT8: 1 spike(s): 35 ({5 * int8_norms[35]:.2f} vs {median:.2f})" in summary
    bf16_norms = {r["iteration"]: r["grad_norm"] for r in records(logs / "bf16.jsonl", "grad_norm")}
    bf16_ratio = bf16_norms[35] / statistics.median(bf16_norms[it] for it in range(25, 35))
    assert ("- INT8 spikes with no BF16 spike within 5 iterations: 1 (value over its trailing level): "
            f"35 ({5 * int8_norms[35] / median:.3f}x; BF16 {bf16_ratio:.3f}x)") in summary
    assert "- BF16 spikes with no INT8 spike within 5 iterations: 0" in summary
    # the same spike in both runs is not INT8's
    both = edited(logs / "bf16.jsonl", tmp_path / "both.jsonl", 30, "lm_loss", 1.5)
    summary = report(logs, tmp_path / "c", both, spiked, "--spike-window", "10")
    assert "- INT8 spikes with no BF16 spike within 5 iterations: 0" in summary

    # runs still in progress: of 200 iterations, the check judges the evaluations after 20 (30 and 40) ...
    summary = report(logs, tmp_path / "d", None, worse, "--train-iters", "200")
    assert "iteration 40 of 200" in summary and "**not finished**" in summary
    assert "**met** (largest" in summary and "The runs have not finished" in summary
    # one run ahead of the other: the losses and spikes are compared up to the iteration both reached
    with open(logs / "int8.jsonl") as f, open(tmp_path / "behind.jsonl", "w") as out:
        out.writelines(line for line in f if json.loads(line).get("iteration", 0) <= 25)
    summary = report(logs, tmp_path / "f", None, str(tmp_path / "behind.jsonl"), "--train-iters", "200")
    assert "Both runs up to iteration 25, the last one both reached" in summary
    assert f"| BF16 | 25 | {sum(bf16_train[i] for i in range(1, 26)) / 25:.4f} | +0.00% |" in summary
    assert "| INT8 | 25 | " in summary and "iteration 40 of 200" in summary
    # ... of 400, none (the first 10% is 40 iterations)
    summary = report(logs, tmp_path / "e", None, None, "--train-iters", "400")
    assert "**not judged yet**" in summary

    # a noise-floor pair: two BF16 runs under their own names, no health section to read
    other = edited(logs / "bf16.jsonl", tmp_path / "init2.jsonl", 20, "valid_lm_loss", 1.03)
    summary = report(logs, tmp_path / "g", None, other, "--labels", "BF16", "BF16, init 2")
    assert summary.startswith("# BF16, init 2 vs BF16 convergence")
    assert "| iteration | tokens | BF16 | BF16, init 2 | gap |" in summary and "INT8" not in summary.split("## INT8")[0]
    assert "**not met** at iteration 20 (+3.00%)" in summary
    assert "- BF16, init 2 spikes with no BF16 spike within 5 iterations: 0" in summary
    assert "No `int8_health` records in the BF16, init 2 log" in summary
    assert not (tmp_path / "g" / "health.png").exists()
    assert convergence_report.main(["report", "--bf16", other, "--int8", other, "--config", str(logs / "run.yaml"),
                                    "--output-dir", str(tmp_path / "h"), "--labels", "BF16", "BF16"]) == 1

    # the INT8 pair beside that noise floor: its gap column, and where INT8's gap is the wider of the two
    noise = edited(edited(logs / "bf16.jsonl", tmp_path / "n1.jsonl", 20, "valid_lm_loss", 1.03),
                   tmp_path / "noise.jsonl", 30, "valid_lm_loss", 0.999)
    summary = report(logs, tmp_path / "i", None, None, "--noise-floor", str(logs / "bf16.jsonl"), noise)
    assert "| iteration | tokens | BF16 | INT8 | gap | noise floor gap |" in summary
    assert f"| {int8_valid[20] / bf16_valid[20] * 100 - 100:+.2f}% | +3.00% |" in summary
    beyond = [it for it in (10, 20, 30, 40)
              if abs(int8_valid[it] / bf16_valid[it] - 1) > abs({20: 0.03, 30: -0.001}.get(it, 0.0))]
    assert (f"Noise floor, after the first 10%: its largest gap is +3.00% (iteration 20); the gap is larger in "
            f"magnitude than the noise floor's at {len(beyond)} of 4 evaluations") in summary

    # a noise-floor pair of its own (another machine's token stream): its gap is to its own reference, not to --bf16
    own_ref = edited(logs / "bf16.jsonl", tmp_path / "own_ref.jsonl", 30, "valid_lm_loss", 1.5)
    own_other = edited(logs / "bf16.jsonl", tmp_path / "own_other.jsonl", 20, "valid_lm_loss", 0.98)
    summary = report(logs, tmp_path / "j", None, None, "--noise-floor", own_ref, own_other)
    assert "| -2.00% |" in summary and f"| {-1 / 3 * 100:+.2f}% |" in summary and "+3.00%" not in summary
    assert "(`own_other.jsonl` against `own_ref.jsonl`)" in summary


def test_loss_spikes_follow_their_definition():
    """A step more than 10% above the mean of the 5 before it; the first 5 steps are not judged, and a spike
    raises the mean that the next steps are judged against."""
    losses = {it: 2.0 for it in range(1, 21)}
    losses.update({3: 5.0, 8: 2.19, 12: 2.3, 16: 2.24})  # 8: 2.19 / mean(5, 2, 2, 2, 2) = 0.84
    spikes, means = convergence_report.loss_spikes(losses, threshold=0.10, window=5)
    assert [(it, round(mean, 3)) for it, _, mean in spikes] == [(12, 2.038)]  # 2.3 / 2.038 = 1.129; 16: 1.087
    assert convergence_report.unmatched_spikes(spikes, [(14, 2.5, 2.0)], tolerance=2) == []
    assert convergence_report.unmatched_spikes(spikes, [(15, 2.5, 2.0)], tolerance=2) == spikes
    # the trailing mean at every step, as the unmatched spikes are shown: at 16, 2.24 / mean(2.3, 2, 2, 2, 2)
    assert losses[16] / means[16] == pytest.approx(2.24 / 2.06, rel=1e-12)
    assert 5 not in means  # fewer than 5 steps before it
    assert 21 not in means  # not logged
    assert sorted(means) == list(range(6, 21))


def test_grad_norm_spikes_follow_their_definition():
    """A step above 3x the median of the 5 before it; the first 5 steps are not judged, and a median, unlike a
    mean, barely moves for one large norm in its window (step 2's 9.0, step 9's 1.25)."""
    norms = {it: 0.4 + 0.01 * (it % 3) for it in range(1, 21)}  # 0.41, 0.42, 0.40, ...
    norms.update({2: 9.0, 9: 1.25, 10: 1.3, 14: 1.2})
    spikes, _ = convergence_report.grad_norm_spikes(norms, factor=3.0, window=5)
    # 9: 1.25 / 0.41 = 3.05; 10: 1.3 / 0.42 = 3.10; 14: 1.2 / 0.42 = 2.86 is not one
    assert [(it, round(median, 2)) for it, _, median in spikes] == [(9, 0.41), (10, 0.42)]
    assert convergence_report.unmatched_spikes(spikes, [(12, 2.0, 0.4)], tolerance=2) == [spikes[0]]


def test_schedule_mismatch_names_the_first_differing_step():
    lr = {1: 1.5e-5, 2: 3.0e-5, 3: 4.5e-5}
    assert convergence_report.schedule_mismatch(lr, dict(lr)) is None
    assert convergence_report.schedule_mismatch(lr, {**lr, 2: 3.0e-5 * (1 + 1e-9)}) is None  # rounding, not a schedule
    assert convergence_report.schedule_mismatch(lr, {**lr, 2: 3.3e-5, 3: 5e-5}) == (2, 3.0e-5, 3.3e-5)
    assert convergence_report.schedule_mismatch(lr, {4: 1.0}) is None  # no common step: nothing to compare


def test_window_means_end_a_begun_span_at_its_last_step():
    """Equal spans of the run; the span a run has only begun is labelled with the steps it holds, so that a table
    over two runs cut to their common part does not name iterations neither reached."""
    series = {1: 1.0, 2: 3.0, 5: 2.0, 6: 4.0, 7: 6.0}
    assert convergence_report.window_means(series, 10, 2) == [(1, 5, 2.0), (6, 7, 5.0)]
    assert convergence_report.window_means({**series, 10: 8.0}, 10, 2) == [(1, 5, 2.0), (6, 10, 6.0)]


def test_the_script_parses_and_status_needs_a_started_run(tmp_path):
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0
    env = dict(os.environ, RUN_DIR=str(tmp_path / "nothing"))
    result = subprocess.run(["bash", SCRIPT, "status", "300"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    assert "nothing started in" in result.stderr and "convergence_4gpu.sh start" in result.stderr
    result = subprocess.run(["bash", SCRIPT, "status", "soon"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 1 and "status takes a number of seconds" in result.stderr
    result = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 2 and "usage:" in result.stderr
    env["POLL_S"] = "0"
    result = subprocess.run(["bash", SCRIPT, "status", "300"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 2 and "POLL_S is a whole number of seconds >= 1, got '0'" in result.stderr


@pytest.mark.slow
def test_status_collects_finished_runs_into_out(logs, tmp_path):
    """Two runs whose checkpoints reached the last iteration: `status` returns at once, prints their progress and
    the report's verdicts, and leaves at most 8 files in $OUT (what comes back from a device call)."""
    run_dir, out = tmp_path / "runs", tmp_path / "out"
    out.mkdir()
    for name in ("bf16", "int8"):
        (run_dir / name / "ckpt").mkdir(parents=True)
        (run_dir / name / "ckpt" / "latest_checkpointed_iteration.txt").write_text(str(ITERATIONS))
        shutil.copy(logs / f"{name}.jsonl", run_dir / f"{name}.jsonl")
        (run_dir / f"{name}.log").write_text(f"{name} trainer output\n")
    shutil.copy(logs / "bf16.jsonl", run_dir / "bf16_init2.jsonl")  # a noise-floor run of this RUN_DIR
    (run_dir / "pipeline.log").write_text("== launching\n")
    (run_dir / "pipeline.rc").write_text("0\n")
    env = dict(os.environ, RUN_DIR=str(run_dir), OUT=str(out), CONFIG=str(logs / "run.yaml"), PYTHON=sys.executable)
    result = subprocess.run(["bash", SCRIPT, "status", "300"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"bf16 [finished]: iteration {ITERATIONS}/{ITERATIONS}" in result.stdout
    assert "Check (gap <= 1%" in result.stdout and "both runs finished" in result.stdout
    assert "Noise floor, after the first 10%: its largest gap is +0.00%" in result.stdout
    files = sorted(os.listdir(out))
    assert files == ["bf16.jsonl", "convergence.md", "convergence.png", "health.png", "int8.jsonl", "logs.tar.gz"]
    listed = subprocess.run(["tar", "-tzf", str(out / "logs.tar.gz")], capture_output=True, text=True).stdout.split()
    assert sorted(listed) == ["bf16.log", "int8.log", "pipeline.log"]


@pytest.mark.slow
def test_start_and_status_of_a_noise_floor_pair_on_cpu(tmp_path):
    """`start` on a CPU (MIN_GPUS=0, the tiny model) with SECOND=bf16_init2: the data build, both runs (BF16, and
    BF16 with --seed + 1 on the same --data-seed), then `status` collects the report, which a later `status`
    without SECOND still makes for this pair, with the records a resumed run set aside."""
    run_dir, out = tmp_path / "runs", tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, RUN_DIR=str(run_dir), OUT=str(out), PYTHON=sys.executable, MIN_GPUS="0",
               PORT_BASE=str(free_port_pair()), POLL_S="2",
               CONFIG=os.path.join(CONFIGS, "tiny.yaml"), GRAPHS="none", CORPUS_MB="0.5", VOCAB="400",
               WORKERS="2", TRAIN_ITERS="4", SECOND="bf16_init2",
               EXTRA_FLAGS="--num-layers 1 --lr-warmup-iters 1 --eval-interval 2 --eval-iters 1 --save-interval 2 "
               "--split 90,10,0")
    started = subprocess.run(["bash", SCRIPT, "start"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stdout + started.stderr
    result = subprocess.run(["bash", SCRIPT, "status", "400"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=450)
    assert result.returncode == 0, result.stdout + result.stderr + (run_dir / "pipeline.log").read_text()
    assert "both runs finished" in result.stdout and "- BF16, init seed 2: iteration 4 of 4" in result.stdout
    pipeline = (run_dir / "pipeline.log").read_text()
    assert "== launching bf16_init2 on GPUs 2,3: " in pipeline and "--seed 1235 --data-seed 1234" in pipeline
    assert "--seed" not in pipeline.split("== launching bf16 on GPUs 0,1: ")[1].splitlines()[0]
    first = {name: records(run_dir / f"{name}.jsonl", "lm_loss")[0]["lm_loss"] for name in ("bf16", "bf16_init2")}
    assert first["bf16"] != first["bf16_init2"]  # another initialization
    assert (out / "convergence.md").read_text().startswith("# BF16, init seed 2 vs BF16 convergence")
    assert sorted(os.listdir(out)) == ["bf16.jsonl", "bf16_init2.jsonl", "convergence.md", "convergence.png",
                                       "corpus.json", "logs.tar.gz"]

    (run_dir / "bf16_init2.jsonl.after-2").write_text("{}\n")
    del env["SECOND"]
    result = subprocess.run(["bash", SCRIPT, "status"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "bf16_init2 [finished]" in result.stdout, result.stdout + result.stderr
    listed = subprocess.run(["tar", "-tzf", str(out / "logs.tar.gz")], capture_output=True, text=True).stdout.split()
    assert sorted(listed) == ["bf16.log", "bf16_init2.jsonl.after-2", "bf16_init2.log", "pipeline.log",
                              "tokenizer/spm.model"]

    # TOKENIZER: another RUN_DIR on the same corpus reuses this tokenizer, so it reads the same token stream (its
    # runs are made to fail at once: only the data build matters here)
    tokenizer, stats = run_dir / "tokenizer" / "spm.model", json.loads((run_dir / "corpus.json").read_text())
    assert stats["tokenizer_sha256"] == hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    again = tmp_path / "again"
    again.mkdir()
    shutil.copy(run_dir / "corpus.jsonl", again / "corpus.jsonl")
    env.update(RUN_DIR=str(again), TOKENIZER=str(tokenizer), EXTRA_FLAGS="--not-a-trainer-flag")
    started = subprocess.run(["bash", SCRIPT, "start"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stdout + started.stderr
    for _ in range(240):
        if (again / "pipeline.rc").exists():
            break
        time.sleep(0.5)
    pipeline = (again / "pipeline.log").read_text()
    assert "training a SentencePiece" not in pipeline and "== indexed dataset" in pipeline, pipeline
    assert json.loads((again / "corpus.json").read_text())["tokens_sha256"] == stats["tokens_sha256"], pipeline


@pytest.mark.slow
def test_one_gpu_per_run_stops_at_stop_at_and_continues(tmp_path):
    """GPUS_PER_RUN=1 (a 2-GPU machine: BF16 on GPU 0, INT8 on GPU 1, one process each) with STOP_AT=2 of 4: both
    runs stop at iteration 2 with a checkpoint, on the 4-iteration schedule, and `status` says how to continue; a
    later `start` with STOP_AT=4 resumes both from there to the end without repeating a step."""
    run_dir, out = tmp_path / "runs", tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, RUN_DIR=str(run_dir), OUT=str(out), PYTHON=sys.executable, MIN_GPUS="0",
               PORT_BASE=str(free_port_pair()), POLL_S="2",
               CONFIG=os.path.join(CONFIGS, "tiny.yaml"), GRAPHS="none", CORPUS_MB="0.5", VOCAB="400",
               WORKERS="2", TRAIN_ITERS="4", GPUS_PER_RUN="1", STOP_AT="2",
               EXTRA_FLAGS="--num-layers 1 --lr-warmup-iters 1 --eval-interval 2 --eval-iters 1 --save-interval 3 "
               "--split 90,10,0")

    def follow(what):
        started = subprocess.run(["bash", SCRIPT, "start"], cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=60)
        assert started.returncode == 0, started.stdout + started.stderr
        result = subprocess.run(["bash", SCRIPT, "status", "400"], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=450)
        assert result.returncode == 0, result.stdout + result.stderr + (run_dir / "pipeline.log").read_text()
        assert what in result.stdout, result.stdout
        return result.stdout

    stdout = follow("both runs stopped at iteration 2 of 4")
    assert "bf16 [stopped at 2]: iteration 2/4" in stdout and "int8 [stopped at 2]" in stdout
    assert "STOP_AT=4 bash scripts/convergence_4gpu.sh start" in stdout
    assert "## Throughput (1 GPU per run, data parallel)" in (out / "convergence.md").read_text()
    pipeline = (run_dir / "pipeline.log").read_text()
    assert "== launching bf16 on GPUs 0: " in pipeline and "== launching int8 on GPUs 1: " in pipeline
    assert pipeline.count("--exit-interval 2") == 2
    for name in ("bf16", "int8"):
        assert (run_dir / name / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
        assert "DP 1" in (run_dir / f"{name}.log").read_text()
    lr_at_2 = {r["iteration"]: r["lr"] for r in records(run_dir / "bf16.jsonl", "lr")}[2]

    env["STOP_AT"] = "4"  # kept in RUN_DIR otherwise: a bare `start` would leave the stopped runs alone
    first_flags = env.pop("EXTRA_FLAGS")  # kept in RUN_DIR by the first `start`: the continued runs get them again
    follow("both runs finished")
    pipeline = (run_dir / "pipeline.log").read_text()
    assert pipeline.count("--exit-interval") == 2  # only the first launches stop early
    assert pipeline.count(first_flags) == 4, pipeline
    for name in ("bf16", "int8"):
        steps = [r["iteration"] for r in records(run_dir / f"{name}.jsonl", "lm_loss")]
        assert steps == [1, 2, 3, 4], steps
    lrs = {r["iteration"]: r["lr"] for r in records(run_dir / "bf16.jsonl", "lr")}
    assert lrs[2] == lr_at_2 and lrs[4] < lrs[3] < lrs[2]  # one cosine schedule over the 4 iterations

    env["EXTRA_FLAGS"] = first_flags.replace("--eval-interval 2", "--eval-interval 3")  # a partner on other flags
    started = subprocess.run(["bash", SCRIPT, "start"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert started.returncode == 1 and "EXTRA_FLAGS='" in started.stderr, started.stdout + started.stderr
    assert f"differs from '{first_flags}', which the runs of" in started.stderr


@pytest.mark.slow
@pytest.mark.timeout(1200)  # four runs and three data builds: 4 minutes on 2 idle cores, 12 beside a busy CI
def test_one_run_against_a_recorded_pair(tmp_path):
    """REFERENCE_PAIR (a 1-GPU machine): `start` runs only SECOND=int8_attention, on GPU 0, and `status` compares its
    validation losses with the pair's rows of a results CSV. TOKENS_SHA256 stops the launch where the token stream
    built differs from the reference's, and lets it through where it matches. REFERENCE_PAIR= then forgets the pair:
    BF16 runs beside the finished run. Then RECORDED_LOG: BF16 alone, in another RUN_DIR, beside that run's log."""
    run_dir, out = tmp_path / "runs", tmp_path / "out"
    out.mkdir()
    pair = "bf16 vs int8 tiny one GPU each"
    header = "date,commit,gpu,torch,triton,command,pair,mode,iteration,tokens_m,reference_valid,other_valid,gap_pct\n"
    recorded = {2: (6.0, 6.06), 4: (5.0, 4.95)}  # the reference and its INT8, at the run's evaluations
    csv_path = tmp_path / "convergence.csv"
    csv_path.write_text(header + "".join(f"2026-11-28,abc1234,GPU,2.11,3.6,cmd,{pair},graphed,{it},0.0,{b},{i},0\n"
                                         for it, (b, i) in recorded.items()))
    env = dict(os.environ, RUN_DIR=str(run_dir), OUT=str(out), PYTHON=sys.executable, MIN_GPUS="0",
               PORT_BASE=str(free_port_pair()), POLL_S="2", REFERENCE_CSV=str(csv_path), REFERENCE_PAIR=pair,
               SECOND="int8_attention", TOKENS_SHA256="0" * 64, INT8_FLAGS="--int8-stats-interval 2",
               CONFIG=os.path.join(CONFIGS, "tiny.yaml"), GRAPHS="none", CORPUS_MB="0.5", VOCAB="400",
               WORKERS="2", TRAIN_ITERS="4", GPUS_PER_RUN="1",
               EXTRA_FLAGS="--num-layers 1 --lr-warmup-iters 1 --eval-interval 2 --eval-iters 1 --split 90,10,0")

    def call(*args, timeout=450):
        return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)

    def run_to_end(directory):
        """`start`, then `status` until the runs end: status's output and the pipeline log, after they succeeded."""
        assert call("start").returncode == 0
        result = call("status", "400")
        pipeline = (directory / "pipeline.log").read_text()
        assert result.returncode == 0, result.stdout + result.stderr + pipeline
        return result.stdout, pipeline

    assert call("start").returncode == 0
    result = call("status", "300")
    assert result.returncode == 1, result.stdout + result.stderr
    pipeline = (run_dir / "pipeline.log").read_text()
    assert "not " + "0" * 64 + " (TOKENS_SHA256)" in pipeline and "nothing launched" in pipeline, pipeline
    assert "== launching" not in pipeline

    built = hashlib.sha256((run_dir / "data" / "corpus_text_document.bin").read_bytes()).hexdigest()
    env["TOKENS_SHA256"] = built[:12]
    stdout, pipeline = run_to_end(run_dir)
    assert "the run finished: the report (against_reference.md" in stdout, stdout
    assert f"== token stream: SHA-256 {built}" in pipeline
    assert "== launching int8_attention on GPUs 0: " in pipeline and "--int8-attention" in pipeline
    assert "== launching bf16" not in pipeline and not (run_dir / "bf16.jsonl").exists()
    valid = {r["iteration"]: r["valid_lm_loss"] for r in records(run_dir / "int8_attention.jsonl", "valid_lm_loss")}
    assert sorted(valid) == [2, 4]
    summary = (out / "against_reference.md").read_text()
    assert summary.startswith(f"# INT8 + INT8 attention against the recorded pair `{pair}`")
    assert "2026-11-28, abc1234, GPU" in summary
    for it, (b, i) in recorded.items():  # each row: the recorded losses, this run's, and the gaps from them
        row = next(line for line in summary.splitlines() if line.startswith(f"| {it} |"))
        assert f"| {b:.4f} | {i:.4f} | {valid[it]:.4f} | {100 * (valid[it] / b - 1):+.2f}% | " \
               f"{100 * (i / b - 1):+.2f}% | {100 * (valid[it] / i - 1):+.2f}% |" in row, row
    verdict = "met" if 100 * (valid[4] / 5.0 - 1) <= 1.0 else "not met"
    assert f"Check (gap <= 1% at every evaluation after the first 10% of the run): **{verdict}**" in summary
    assert "## INT8 health" in summary and "No `int8_health` records" not in summary
    assert sorted(os.listdir(out)) == ["against_reference.md", "corpus.json", "health.png", "int8_attention.jsonl",
                                       "logs.tar.gz"]

    # REFERENCE_PAIR= (set empty) forgets the pair kept in RUN_DIR: BF16 then runs beside the finished lone run
    env["REFERENCE_PAIR"] = ""
    stdout, pipeline = run_to_end(run_dir)
    assert "both runs finished" in stdout, stdout
    assert "== launching bf16 on GPUs 0: " in pipeline and pipeline.count("== launching int8_attention") == 1
    assert (out / "convergence.md").read_text().startswith("# INT8 + INT8 attention vs BF16 convergence")

    def beside_recorded(var, partner, partner_dir, lone, title):
        """`var` (RECORDED_LOG or RECORDED_BF16_LOG) set to the gzipped log of `partner` from `partner_dir`: `lone`
        trains alone in a RUN_DIR of its own, on GPU 0, and the two-run report names the recorded log and sets the
        two runs' validation losses side by side. Returns the lone run's directory and the report's text."""
        recorded_log = tmp_path / f"{partner}.jsonl.gz"
        recorded_log.write_bytes(gzip.compress((partner_dir / f"{partner}.jsonl").read_bytes()))
        lone_dir, lone_out = tmp_path / f"{lone}_beside", tmp_path / f"out_{lone}"
        lone_out.mkdir()
        for name in ("REFERENCE_PAIR", "RECORDED_LOG", "RECORDED_BF16_LOG"):
            env.pop(name, None)
        env.update({"RUN_DIR": str(lone_dir), "OUT": str(lone_out), var: str(recorded_log),
                    "PORT_BASE": str(free_port_pair())})
        stdout, pipeline = run_to_end(lone_dir)
        assert "the run finished: the report (convergence.md" in stdout, stdout
        assert f"== token stream: SHA-256 {built}" in pipeline
        assert f"== launching {lone} on GPUs 0: " in pipeline and f"== launching {partner}" not in pipeline
        assert (lone_dir / f"{partner}.jsonl").read_bytes() == (partner_dir / f"{partner}.jsonl").read_bytes()
        summary = (lone_out / "convergence.md").read_text()
        assert summary.startswith(f"# {title} convergence")
        assert f"recorded by an earlier job: `{recorded_log}`" in summary
        reference_dir, other = (lone_dir, partner) if lone == "bf16" else (partner_dir, lone)
        bf16 = {r["iteration"]: r["valid_lm_loss"] for r in records(reference_dir / "bf16.jsonl", "valid_lm_loss")}
        second = {r["iteration"]: r["valid_lm_loss"] for r in records(lone_dir / f"{other}.jsonl", "valid_lm_loss")}
        for it in (2, 4):
            row = next(line for line in summary.splitlines() if line.startswith(f"| {it} |"))
            assert f"| {bf16[it]:.4f} | {second[it]:.4f} | {100 * (second[it] / bf16[it] - 1):+.2f}% |" in row
        assert sorted(os.listdir(lone_out)) == sorted([f"{lone}.jsonl", "convergence.md", "convergence.png",
                                                       "corpus.json", "health.png", "logs.tar.gz"])
        return lone_dir, summary

    # RECORDED_LOG, the mirror: BF16 alone in another RUN_DIR, beside this run's log (gzipped, as the repository keeps
    # such logs), on the same token stream
    env["TOKENIZER"] = str(run_dir / "tokenizer" / "spm.model")
    bf16_dir, _ = beside_recorded("RECORDED_LOG", "int8_attention", run_dir, "bf16", "INT8 + INT8 attention vs BF16")
    # RECORDED_BF16_LOG, the other way round: INT8 alone in a third RUN_DIR, beside the BF16 run just made
    env["SECOND"] = "int8"
    _, summary = beside_recorded("RECORDED_BF16_LOG", "bf16", bf16_dir, "int8", "INT8 vs BF16")
    assert "## INT8 health" in summary


def test_recorded_log_refuses_what_it_cannot_pair(tmp_path):
    """RECORDED_LOG with REFERENCE_PAIR or RECORDED_BF16_LOG (each runs another precision alone), a missing file, a
    RUN_DIR that trained the partner itself, and a log of the wrong precision are refused before anything starts."""
    def start(**extra):
        env = dict(os.environ, RUN_DIR=str(tmp_path / "r"), PYTHON=sys.executable, MIN_GPUS="0")
        env.update(extra)
        return subprocess.run(["bash", SCRIPT, "start"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=60)

    for pair in ({"RECORDED_LOG": "x.jsonl", "REFERENCE_PAIR": "p"},
                 {"RECORDED_LOG": "x.jsonl", "RECORDED_BF16_LOG": "y.jsonl"},
                 {"RECORDED_BF16_LOG": "y.jsonl", "REFERENCE_PAIR": "p"}):
        both = start(**pair)
        assert both.returncode == 2 and "give one of them" in both.stderr, both.stderr
    missing = start(RECORDED_LOG=str(tmp_path / "none.jsonl.gz"))
    assert missing.returncode == 1 and "RECORDED_LOG: no file" in missing.stderr, missing.stderr
    log = tmp_path / "int8.jsonl"
    log.write_text(json.dumps({"iteration": 1, "lm_loss": 5.0}) + "\n")
    (tmp_path / "r" / "int8" / "ckpt").mkdir(parents=True)
    own = start(RECORDED_LOG=str(log), SECOND="int8")
    assert own.returncode == 1 and "holds a int8 run of its own" in own.stderr, own.stderr
    assert not (tmp_path / "r" / "pipeline.log").exists()
    # a log of the other precision (or of no training step) in place of the partner's: named, nothing started
    bf16_log, int8_log = tmp_path / "b.jsonl", tmp_path / "i.jsonl.gz"
    bf16_log.write_text(json.dumps({"iteration": 1, "lm_loss": 5.0, "int8": False}) + "\n")
    int8_log.write_bytes(gzip.compress((json.dumps({"iteration": 1, "lm_loss": 5.0, "int8": True}) + "\n").encode()))
    for extra, message in (
            ({"RECORDED_LOG": str(bf16_log)}, "is the log of a BF16 run, not of int8_attention (RECORDED_LOG is"),
            ({"RECORDED_BF16_LOG": str(int8_log)}, "is the log of a INT8 run, not of bf16 (RECORDED_LOG is SECOND's"),
            ({"RECORDED_BF16_LOG": str(log)}, "is no training run's log (no \"int8\" record), not of bf16")):
        wrong = start(RUN_DIR=str(tmp_path / "w"), SECOND="int8_attention", **extra)
        assert wrong.returncode == 1 and message in wrong.stderr, (extra, wrong.stderr)
        assert not (tmp_path / "w" / "pipeline.log").exists()


@pytest.mark.parametrize("command", ["report", "corpus", "progress", "against-csv"])
def test_a_missing_config_or_no_train_iters_is_a_usage_error(tmp_path, capsys, command):
    """Before any log is read: a --config that is not there, and a --train-iters of 0 (which fell back to the
    YAML's)."""
    (tmp_path / "run.yaml").write_text("train_iters: 4\nglobal_batch_size: 4\nseq_length: 64\n")
    rest = {"report": ["--bf16", "b", "--int8", "i", "--output-dir", "o"], "progress": ["--log", "l"],
            "corpus": ["--corpus", "c", "--prefix", "p", "--output", "o"],
            "against-csv": ["--log", "l", "--csv", "c", "--pair", "p"]}[command]
    for extra, said in (([], f"--config: no file {tmp_path / 'missing.yaml'}"),
                        (["--train-iters", "0"], "--train-iters must be >= 1, got 0")):
        config = tmp_path / ("run.yaml" if extra else "missing.yaml")
        with pytest.raises(SystemExit) as exit_info:
            convergence_report.main([command, *rest, "--config", str(config), *extra])
        assert exit_info.value.code == 2 and said in capsys.readouterr().err


def test_bad_inputs_are_named_before_any_log_is_read(tmp_path, capsys):
    """Each gave a traceback (KeyError, ParserError, IsADirectoryError, FileExistsError, AssertionError) or a
    "0 GPU per run" table."""
    good = tmp_path / "run.yaml"
    good.write_text("train_iters: 4\nglobal_batch_size: 4\nseq_length: 64\n")
    (tmp_path / "no_batch.yaml").write_text("train_iters: 4\nseq_length: 64\n")
    (tmp_path / "broken.yaml").write_text(": : :\n\t- x")
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"iteration": 1, "lm_loss": 5.0}) + "\n")
    (tmp_path / "a_file").write_text("x")
    report = ["report", "--bf16", str(log), "--int8", str(log)]
    for argv, said in (
            ([*report, "--config", str(tmp_path / "no_batch.yaml"), "--output-dir", str(tmp_path / "o")],
             "no_batch.yaml: it sets no global_batch_size"),
            ([*report, "--config", str(tmp_path / "broken.yaml"), "--output-dir", str(tmp_path / "o")],
             "broken.yaml: not a readable YAML file (ParserError)"),
            (["report", "--bf16", str(log), "--int8", str(tmp_path), "--config", str(good), "--output-dir",
              str(tmp_path / "o")], f"--int8 {tmp_path}: a folder, not a file"),
            ([*report, "--config", str(good), "--output-dir", str(tmp_path / "a_file")], "a_file is a file: give a"),
            ([*report, "--config", str(good), "--output-dir", str(tmp_path / "o"), "--gpus-per-run", "0"],
             "--gpus-per-run must be >= 1"),
            (["corpus", "--corpus", str(log), "--prefix", str(tmp_path / "none"), "--config", str(good), "--output",
              str(tmp_path / "c.json")], "no indexed dataset there")):
        with pytest.raises(SystemExit) as exit_info:
            convergence_report.main(argv)
        assert exit_info.value.code == 2 and said in capsys.readouterr().err, argv


def test_against_csv_names_a_missing_pair(tmp_path):
    csv_path = tmp_path / "c.csv"
    csv_path.write_text("date,commit,gpu,torch,triton,command,pair,mode,iteration,tokens_m,reference_valid,"
                        "other_valid,gap_pct\n")
    log = tmp_path / "run.jsonl"
    log.write_text(json.dumps({"iteration": 1, "lm_loss": 5.0}) + "\n")
    (tmp_path / "run.yaml").write_text("train_iters: 4\nglobal_batch_size: 4\nseq_length: 64\n")
    assert convergence_report.main(["against-csv", "--log", str(log), "--csv", str(csv_path), "--pair", "nope",
                                    "--config", str(tmp_path / "run.yaml")]) == 1
    env = dict(os.environ, RUN_DIR=str(tmp_path / "r"), REFERENCE_CSV=str(csv_path), REFERENCE_PAIR="nope")
    result = subprocess.run(["bash", SCRIPT, "start"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "no pair 'nope' in" in result.stderr, result.stderr


def test_against_csv_labels_the_pair_by_its_name(tmp_path, capsys):
    """The recorded pair's runs are read from its name: INT8 + INT8 attention beside BF16 is not labelled INT8, INT8
    as the reference is not labelled BF16; a name of no known runs is refused unless --reference-labels names them.
    Every pair recorded in the repository's CSV can be named."""
    import csv

    assert convergence_report.pair_labels("bf16 vs int8 + int8 attention lr 1.5e-4 (two jobs)") == \
        ("BF16", "INT8 + INT8 attention")
    assert convergence_report.pair_labels("int8 vs int8 + int8 attention") == ("INT8", "INT8 + INT8 attention")
    assert convergence_report.pair_labels("bf16 vs bf16 init seed 2 lr 1.5e-4") == ("BF16", "BF16, init seed 2")
    assert convergence_report.pair_labels("bf16 vs int8x") is None
    assert convergence_report.pair_labels("fp8 vs int8") is None
    with open(os.path.join(ROOT, "benchmarks", "results", "convergence_350m.csv"), encoding="utf-8") as f:
        assert all(convergence_report.pair_labels(row["pair"]) for row in csv.DictReader(f))

    header = "date,commit,gpu,torch,triton,command,pair,mode,iteration,tokens_m,reference_valid,other_valid,gap_pct\n"
    log = tmp_path / "run.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in
                           ({"iteration": 1, "lm_loss": 5.0}, {"iteration": 2, "valid_lm_loss": 4.1})))
    (tmp_path / "run.yaml").write_text("train_iters: 2\nglobal_batch_size: 4\nseq_length: 64\n")
    for pair, extra, columns in (("int8 vs int8 + int8 attention x", [], "| INT8 | INT8 + INT8 attention | INT8 |"),
                                 ("mine vs yours", ["--reference-labels", "A", "B"], "| A | B | INT8 |")):
        csv_path = tmp_path / "c.csv"
        csv_path.write_text(header + f"2026-12-03,abc1234,GPU,2.11,3.6,cmd,{pair},graphed,2,0.0,4.0,4.2,+5.00\n")
        argv = ["against-csv", "--log", str(log), "--csv", str(csv_path), "--pair", pair, "--label", "INT8",
                "--config", str(tmp_path / "run.yaml")]
        assert convergence_report.main(argv + extra) == 0
        table = capsys.readouterr().out
        assert f"| iteration | tokens {columns}" in table
        assert "| 2 | 0.0M | 4.0000 | 4.2000 | 4.1000 | +2.50% |" in table
    assert convergence_report.main(argv) == 1  # "mine vs yours" without --reference-labels
    assert "does not begin '<run> vs <run>'" in capsys.readouterr().err


def test_corpus_statistics_count_what_the_trainer_reads(tmp_path):
    """`corpus` on a small indexed dataset: every document's tokens are its SentencePiece ids plus one EOD, the
    training split is megatron's first 90% of the documents, epochs = tokens trained / training-split tokens."""
    import sentencepiece as spm

    corpus = tmp_path / "corpus.jsonl"
    _run([sys.executable, "scripts/prepare_tiny_corpus.py", "--output", str(corpus), "--max-mb", "0.3"])
    _run([sys.executable, "scripts/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(tmp_path / "c"),
          "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(tmp_path / "spm.model"),
          "--train-sentencepiece", "400"])
    config = tmp_path / "run.yaml"
    config.write_text('train_iters: 10\nglobal_batch_size: 4\nseq_length: 64\nsplit: "90,10,0"\n')
    assert convergence_report.main(["corpus", "--corpus", str(corpus), "--prefix", str(tmp_path / "c_text_document"),
                                    "--config", str(config), "--vocab-size", "400", "--tokenizer-model",
                                    str(tmp_path / "spm.model"), "--output", str(tmp_path / "stats.json")]) == 0
    stats = json.loads((tmp_path / "stats.json").read_text())
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    processor = spm.SentencePieceProcessor(model_file=str(tmp_path / "spm.model"))
    ids = [processor.encode(text) + [processor.eos_id()] for text in texts]
    train_documents = round(0.9 * len(texts))
    assert stats["documents"] == stats["indexed_documents"] == len(texts)
    assert stats["corpus_mb"] == pytest.approx(sum(len(t.encode()) for t in texts) / 2**20)
    assert stats["tokens"] == sum(map(len, ids))
    assert stats["train_tokens"] == sum(map(len, ids[:train_documents]))
    assert stats["valid_tokens"] == stats["tokens"] - stats["train_tokens"] > 0
    assert stats["distinct_token_ids"] == len({i for doc in ids for i in doc}) and stats["vocab_size"] == 400
    assert stats["tokens_trained"] == 10 * 4 * 64
    assert stats["epochs"] == pytest.approx(2560 / stats["train_tokens"])
    bin_path = tmp_path / "c_text_document.bin"
    assert stats["text_sha256"] == hashlib.sha256(corpus.read_bytes()).hexdigest()
    assert stats["tokens_sha256"] == hashlib.sha256(bin_path.read_bytes()).hexdigest()
    assert stats["tokenizer_sha256"] == hashlib.sha256((tmp_path / "spm.model").read_bytes()).hexdigest()
    assert (f"of the tokens {stats['tokens_sha256'][:12]}, of the tokenizer {stats['tokenizer_sha256'][:12]}."
            in convergence_report.corpus_sentence(stats))


@pytest.mark.parametrize("flag, value", [("--max-mb", "0"), ("--max-mb", "inf"), ("--max-mb", "nan"),
                                         ("--max-file-kb", "0")])
def test_corpus_sizes_that_are_not_positive_are_refused(tmp_path, flag, value):
    """--max-mb 0 wrote a one-document corpus with exit 0, inf raised OverflowError, --max-file-kb 0 found no source."""
    result = subprocess.run([sys.executable, os.path.join(SCRIPTS, "prepare_tiny_corpus.py"), "--output",
                             str(tmp_path / "c.jsonl"), f"{flag}={value}"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"{flag} must be a positive number, got {float(value)}" in result.stderr
    assert not (tmp_path / "c.jsonl").exists()


def test_corpus_of_all_sources_with_docs(tmp_path, monkeypatch):
    """prepare_tiny_corpus --source all --docs: the standard library's files, then site-packages' (not twice),
    .py sources with .rst/.md documentation, tests and other files skipped."""
    import sysconfig

    import prepare_tiny_corpus

    stdlib, purelib = tmp_path / "lib", tmp_path / "lib" / "site-packages"
    files = {stdlib / "os.py": "import sys\n", stdlib / "README.rst": "The library.\n",
             stdlib / "tests" / "t.py": "x\n",
             purelib / "pkg" / "a.py": "a = 1\n", purelib / "pkg" / "guide.md": "# Guide\n",
             purelib / "pkg" / "data.txt": "1 2 3\n"}
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(stdlib), "purelib": str(purelib)})
    for flags, expected in (([], ["os.py", "pkg/a.py"]),
                            (["--docs"], ["README.rst", "os.py", "pkg/a.py", "pkg/guide.md"])):
        out = tmp_path / "corpus.jsonl"
        assert prepare_tiny_corpus.main(["--source", "all", "--output", str(out), *flags]) == 0
        assert [json.loads(line)["path"] for line in out.read_text().splitlines()] == expected
