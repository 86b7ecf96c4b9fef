"""INT8 health in the trainer on CPU (subprocesses, as a user runs it): statistics in the JSONL log and the log
line without changing training, automatic fallback with its log, precision table and checkpoint, a resumed run
that keeps the moves, and --int8-reset-fallback that drops them."""
import json
import os
import sys

import pytest
from free_ports import launcher
from repo_paths import CONFIGS
from test_training import SMALL_MODEL, _run

pytestmark = pytest.mark.slow
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--eval-iters", "0", "--log-interval", "3"]


def train(*flags, nproc=1):
    return _run(launcher(nproc) + ["-m", "megatron_int8.pretrain", "--config", os.path.join(CONFIGS, "tiny.yaml"),
                                   *SMALL_MODEL, *MOCK, *flags])


def records(path, key):
    with open(path) as f:
        return [r for r in map(json.loads, f) if key in r]


def test_statistics_fallback_and_resume(tmp_path):
    base = ["--int8-linear"]
    # statistics alone change nothing: the losses equal a run without them
    plain = train(*base, "--train-iters", "3", "--log-jsonl", str(tmp_path / "plain.jsonl"))
    # every GEMM "fails" a threshold of 1e-9: after 2 checks fprop goes to high precision, then dgrad, then wgrad
    out = train(*base, "--train-iters", "6", "--save", str(tmp_path / "a"), "--int8-stats-interval", "1",
                "--int8-auto-fallback", "--int8-fallback-max-rel-err", "1e-9", "--int8-fallback-patience", "2")
    log = tmp_path / "a" / "train_log.jsonl"
    assert [r["lm_loss"] for r in records(log, "lm_loss")][:3] == [r["lm_loss"] for r in
                                                                  records(tmp_path / "plain.jsonl", "lm_loss")]
    assert "int8 health" not in plain
    health = records(log, "int8_health")
    assert [r["iteration"] for r in health] == [1, 2, 3, 4, 5, 6]
    first = health[0]["int8_health"]
    for linear in ("layer1.self_attention.linear_qkv", "layer2.mlp.linear_fc2"):
        for stat in ("x/amax", "w/crest", "dy/kurtosis", "x/underflow", "dy/saturation", "fprop/rel_err",
                     "dgrad/rel_err", "wgrad/rel_err", "wgrad/underflow"):
            value = first[f"int8_health/{linear}/{stat}"]
            assert value >= 0 and value == value
        assert 1e-4 < first[f"int8_health/{linear}/fprop/rel_err"] < 0.2  # row-scaled INT8 of a fresh model
    assert "| int8 health (it 3, worst): fprop rel_err" in out
    events = [r["int8_fallback"] for r in records(log, "int8_fallback")]
    moved = {e["linear"] for e in events}
    assert len(moved) == 8  # 4 linears in each of 2 layers
    # decided at the log lines of iterations 3 and 6; check 3 (6) measured the linears before the move at 2 (5)
    assert sorted({(e["iteration"], e["gemm"]) for e in events}) == [(2, "fprop"), (5, "dgrad")]
    assert len(events) == 16
    assert "int8 fallback at iteration 2: layer1.mlp.linear_fc1 fprop: fprop -> high precision (rel_err" in out
    assert "(fallback it 2: fprop fprop -> high precision)" in out  # the precision table printed again
    assert "int8 fallback at iteration 5: layer2.mlp.linear_fc2 dgrad: dgrad -> high precision" in out

    resumed = train(*base, "--train-iters", "8", "--load", str(tmp_path / "a"), "--save", str(tmp_path / "b"))
    assert ("int8 fallback restored from the checkpoint: layer2.mlp.linear_fc2 runs row scales, "
            "fprop:hp/dgrad:hp/wgrad") in resumed
    # evaluation and inference run the moved GEMMs as training left them
    evaluated = train(*base, "--load", str(tmp_path / "a"), "--skip-train", "--eval-iters", "1")
    assert ("int8 fallback restored from the checkpoint: layer2.mlp.linear_fc2 runs row scales, "
            "fprop:hp/dgrad:hp/wgrad") in evaluated and "validation loss at iteration 6" in evaluated
    again = train(*base, "--train-iters", "9", "--load", str(tmp_path / "b"), "--int8-reset-fallback")
    assert "int8 fallback: --int8-reset-fallback: 8 module(s) back to their configured precision" in again
    assert "restored from the checkpoint" not in again


@pytest.mark.parametrize("flags, message", [
    (["--int8-auto-fallback"], "needs --int8-stats-interval"),
    (["--int8-stats-interval", "-1"], "must be >= 0"),
    (["--int8-stats-interval", "5", "--int8-fallback-max-underflow", "2"], "each in (0, 1], got"),
    (["--int8-stats-interval", "5", "--int8-fallback-max-underflow", "0.7", "0.9"], "or three (fprop dgrad wgrad)"),
])
def test_health_arguments_are_checked(flags, message):
    from megatron_int8.training.args import ArgumentError, parse_args, validate_args

    args = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                       "64", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
                       "--vocab-size", "128", "--int8-linear", *flags])
    with pytest.raises(ArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_args(args, 1)


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_statistics_under_sequence_parallelism_measure_every_gemm(tmp_path, granularity):
    """TP 2 + SP: every linear's three GEMMs are measured, wgrad's too (the probe pairs this rank's shard of the
    tokens with the same tokens' rows of the other operand), and statistics steps train exactly like plain ones."""
    flags = ["--int8-linear", "--int8-granularity", granularity, "--train-iters", "3", "--tensor-model-parallel-size",
             "2", "--sequence-parallel"]
    train(*flags, "--log-jsonl", str(tmp_path / "plain.jsonl"), nproc=2)
    train(*flags, "--log-jsonl", str(tmp_path / "stats.jsonl"), "--int8-stats-interval", "1", nproc=2)
    assert [r["lm_loss"] for r in records(tmp_path / "stats.jsonl", "lm_loss")] == [
        r["lm_loss"] for r in records(tmp_path / "plain.jsonl", "lm_loss")]
    health = records(tmp_path / "stats.jsonl", "int8_health")
    assert [r["iteration"] for r in health] == [1, 2, 3]
    for layer in (1, 2):
        for linear in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
            for stat in ("fprop/rel_err", "dgrad/rel_err", "wgrad/rel_err", "wgrad/underflow"):
                value = health[0]["int8_health"][f"int8_health/layer{layer}.{linear}/{stat}"]
                assert value >= 0 and value == value, (layer, linear, stat)
            assert health[0]["int8_health"][f"int8_health/layer{layer}.{linear}/wgrad/rel_err"] < 0.2


def test_a_save_between_log_lines_keeps_its_checks_and_inference_keeps_the_moves(tmp_path):
    """A checkpoint saved between log lines holds the checks armed since the last one, so a resume from it decides
    as the uninterrupted run does; generation on a checkpoint of a run resumed with --int8-reset-fallback keeps the
    moves made after the reset (the recorded flag was applied again at load and dropped them)."""
    flags = ["--int8-linear", "--int8-stats-interval", "1", "--int8-auto-fallback", "--int8-fallback-max-rel-err",
             "1e-9", "--int8-fallback-patience", "2", "--train-iters", "6", "--save-interval", "2"]
    train(*flags, "--save", str(tmp_path / "a"))
    resumed = train(*flags, "--load", str(tmp_path / "a"), "--ckpt-step", "2", "--save", str(tmp_path / "b"))
    assert "loaded checkpoint" in resumed

    def moves(run, after):
        return sorted((e["iteration"], e["linear"], e["gemm"]) for e in
                      (r["int8_fallback"] for r in records(tmp_path / run / "train_log.jsonl", "int8_fallback"))
                      if e["iteration"] > after)

    assert moves("a", 2) and moves("b", 2) == moves("a", 2)
    # the checks a save read between log lines still reach the next log line's summary
    out = train("--int8-linear", "--int8-stats-interval", "3", "--log-interval", "4", "--save-interval", "3",
                "--train-iters", "4", "--save", str(tmp_path / "d"))
    assert "| int8 health (it 3, worst): fprop rel_err" in out
    # reset at the load of iteration 2's checkpoint, moved again at 4 (patience 2): its checkpoint records the flag
    train(*flags[:-4], "--train-iters", "4", "--load", str(tmp_path / "a"), "--ckpt-step", "2", "--save",
          str(tmp_path / "c"), "--int8-reset-fallback")
    script = ("from megatron_int8.training.inference import load_for_inference\n"
              "from megatron_int8.training.health import int8_linears\n"
              f"model, args, _ = load_for_inference({str(tmp_path / 'c')!r}, log=print)\n"
              "print(sorted({m.int8_recipe.describe() for m in int8_linears(model).values()}))\n")
    out = _run([sys.executable, "-c", script])
    assert "back to their configured precision" not in out
    assert "['int8[row,fprop:hp/dgrad/wgrad]']" in out
