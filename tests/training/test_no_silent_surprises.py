"""Issue #66, from the user's command line: a resume follows the schedule flags given now, every bad input fails
before the model is built in one line naming the value and the fix, evaluation scores the same batches each
time, and a start prints no warning a user cannot act on. Trainer calls run its `main(argv)` in-process where
they fail before the model is built, and as subprocesses where they train."""
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import yaml
from repo_paths import ROOT, SCRIPTS
from test_training import SMALL_MODEL, data  # noqa: F401  (`data`: fixture)

from megatron_int8.training.args import build_parser
from megatron_int8.training.errors import ArgumentError

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
# a user's environment: Python's default warning filters (no PYTHONWARNINGS=ignore), CPU
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"} | {"CUDA_VISIBLE_DEVICES": ""}


def _argv(data, *flags):
    return ["--config", TINY, "--data-path", data["prefix"], "--tokenizer-model", data["tokenizer"],
            "--data-cache-path", data["cache"], *SMALL_MODEL, "--micro-batch-size", "2", "--global-batch-size", "4",
            "--int8-linear", *flags]


def _train(data, *flags):
    result = subprocess.run([sys.executable, "-m", "megatron_int8.pretrain", *_argv(data, *flags)], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-5000:]}"
    return result


def _refused(capsys, argv, command=("-m", "megatron_int8.pretrain")) -> str:
    """The one-line error of a run that stops before it builds the model (a fresh process: megatron's CPU support
    must be installed before megatron is imported, which other tests in the same pytest process may have done)."""
    result = subprocess.run([sys.executable, *command, *argv], cwd=ROOT, env=ENV, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "model:" not in result.stdout, "the model was built before the error"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def _log(path, key):
    with open(path) as f:
        return {r["iteration"]: r[key] for r in map(json.loads, f) if key in r}


def _warnings(stderr: str) -> list:
    return [line for line in stderr.splitlines() if "Warning" in line]


@pytest.fixture(scope="module")
def interrupted(data, tmp_path_factory):
    """The docs' interrupt-and-extend workflow: --save and --load the same (new) folder, --train-iters 20 stopped
    by --exit-interval at 6, then resumed with a longer --train-iters, a new peak and final LR and a new Adam
    beta2."""
    save = tmp_path_factory.mktemp("extend") / "ckpt"
    common = ["--save", str(save), "--load", str(save), "--lr-warmup-iters", "2", "--eval-interval", "3",
              "--log-interval", "1"]
    first = _train(data, *common, "--train-iters", "20", "--exit-interval", "6")
    second = _train(data, *common, "--train-iters", "40", "--lr", "1e-3", "--min-lr", "1e-4", "--exit-interval", "12",
                    "--adam-beta2", "0.98")
    return {"save": save, "first": first, "second": second}


@pytest.mark.slow
def test_resume_follows_the_schedule_flags_given_now(interrupted):
    assert "no checkpoint in" in interrupted["first"].stdout and "starting from iteration 0" in interrupted["first"].stdout
    out = interrupted["second"].stdout
    assert "LR schedule: this run's flags, not the checkpoint's (--lr 0.002 -> 0.001; --min-lr 0.0002 -> 0.0001" in out
    assert "--train-iters 20 -> 40" in out
    # the loaded param groups carried the checkpoint's betas; they take this run's
    assert "optimizer: this run's flags, not the checkpoint's (--adam-beta2 0.95 -> 0.98); now betas (0.9, 0.98)" in out
    lr = _log(interrupted["save"] / "train_log.jsonl", "lr")
    for iteration in (7, 12):  # the new cosine: warm-up 2, decay over 40 iterations, 1e-3 -> 1e-4
        expected = 1e-4 + 0.5 * (1 + math.cos(math.pi * (iteration - 2) / (40 - 2))) * (1e-3 - 1e-4)
        assert lr[iteration] == pytest.approx(expected, rel=1e-9), iteration


@pytest.mark.slow
def test_validation_loss_in_the_log_equals_skip_train_and_another_split_is_refused(data, interrupted, capsys,
                                                                                   tmp_path):
    """Training evaluated at iterations 3 and 6 (and 9, 12 after the resume): each evaluation scores the same
    batches, so --skip-train on the checkpoint of iteration 6 (--ckpt-step) and of 12 gives the logged losses,
    the latter from a config without train_iters (an evaluation has no schedule)."""
    save = str(interrupted["save"])
    logged = _log(interrupted["save"] / "train_log.jsonl", "valid_lm_loss")
    assert sorted(logged) == [3, 6, 9, 12]
    with open(TINY) as f:
        config = {k: v for k, v in yaml.safe_load(f).items() if k != "train_iters"}
    (tmp_path / "no_iters.yaml").write_text(yaml.safe_dump(config))
    for step in (["--ckpt-step", "6"], ["--config", str(tmp_path / "no_iters.yaml")]):
        out = _train(data, "--skip-train", "--load", save, "--eval-iters", "2", *step).stdout
        iteration = 6 if step[0] == "--ckpt-step" else 12
        line = next(x for x in out.splitlines() if x.startswith(f" validation loss at iteration {iteration} "))
        assert f"lm loss: {logged[iteration]:.6E}" in line
    message = _refused(capsys, _argv(data, "--skip-train", "--load", save, "--split", "90,5,5"))
    assert "--split '90,5,5' is not the '98,2,0' the checkpoint trained with" in message
    assert "evaluate with --split '98,2,0'" in message


@pytest.mark.slow
def test_no_warnings_at_start_or_on_load(interrupted):
    for run in ("first", "second"):
        assert _warnings(interrupted[run].stderr) == [], interrupted[run].stderr[-3000:]


def test_load_of_a_folder_without_a_checkpoint_is_an_error(data, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    message = _refused(capsys, _argv(data, "--train-iters", "4", "--load", str(empty)))
    assert f"--load {empty}: no checkpoint there" in message
    one = tmp_path / "runs" / "iter_0000010"
    one.mkdir(parents=True)
    message = _refused(capsys, _argv(data, "--train-iters", "4", "--load", str(one), "--save", str(tmp_path / "new")))
    assert f"--load {one} is one checkpoint's folder" in message and f"--load {tmp_path / 'runs'}" in message


def test_a_negative_ckpt_step_is_named_with_the_saved_iterations(tmp_path):
    """--ckpt-step -1 said "iter_-000001 is missing", as if such a checkpoint could exist."""
    from megatron_int8.training.checkpoint import CheckpointError, latest_checkpoint_dir

    for iteration in (6, 12):
        (tmp_path / f"iter_{iteration:07d}").mkdir()
    with pytest.raises(CheckpointError, match=r"--ckpt-step -1: iterations count from 0 \(saved iterations under .*: "
                                              r"6, 12\)"):
        latest_checkpoint_dir(str(tmp_path), -1)


def _load_script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.slow
def test_a_truncated_shard_is_named_with_the_previous_iteration(data, interrupted, tmp_path, capsys):
    damaged = tmp_path / "ckpt"
    shutil.copytree(interrupted["save"], damaged)
    shard = sorted((damaged / "iter_0000012").glob("*.distcp"))[-1]  # megatron-core 0.16 writes two, 0.19 one
    os.truncate(shard, shard.stat().st_size // 3)
    expected = f"{shard} is truncated"
    message = _refused(capsys, _argv(data, "--skip-train", "--load", str(damaged)))
    assert expected in message and "--ckpt-step 6" in message
    message = _refused(capsys, ["--load", str(damaged), "--prompt", "def f"], (os.path.join(SCRIPTS, "generate.py"),))
    assert expected in message and "--ckpt-step 6" in message


@pytest.mark.slow
def test_a_missing_rng_file_is_named_before_the_model(data, interrupted, tmp_path, capsys):
    """This rank's RNG file is checked once the process groups exist and before the build (it was named only when
    the checkpoint loaded, after the model and optimizer were built)."""
    damaged = tmp_path / "ckpt"
    shutil.copytree(interrupted["save"], damaged)
    rng = damaged / "iter_0000012" / "rng" / "rank_00000.pt"
    rng.unlink()
    message = _refused(capsys, _argv(data, "--load", str(damaged), "--train-iters", "40"))
    assert f"{rng} is missing (this rank's RNG states)" in message, message
    assert "--no-load-rng resumes without them" in message and "--ckpt-step 6" in message, message


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["metadata.json emptied", "metadata.json removed", "common.pt emptied"])
def test_a_damaged_format_record_is_named_with_the_previous_iteration(data, interrupted, tmp_path, capsys, damage):
    """The files beside the shards: an empty or missing metadata.json once stopped the start with a JSONDecodeError
    or megatron's "is not a distributed checkpoint" traceback, naming no file."""
    damaged = tmp_path / "ckpt"
    shutil.copytree(interrupted["save"], damaged)
    name, how = damage.split()
    path = damaged / "iter_0000012" / name
    if not path.exists():  # megatron-core 0.19 keeps the common state inside the shards
        pytest.skip(f"no {name} in this megatron-core's checkpoints")
    if how == "removed":
        path.unlink()
    else:
        os.truncate(path, 0)
    message = _refused(capsys, _argv(data, "--skip-train", "--load", str(damaged)))
    assert f"error: {path} " in message and "the checkpoint is damaged" in message and "--ckpt-step 6" in message


_RECORD_FSYNCS = """
import atexit, json, os, runpy, sys
events, real_fsync, real_replace = [], os.fsync, os.replace
def fsync(fd):
    events.append(["fsync", os.readlink(f"/proc/self/fd/{fd}")])
    return real_fsync(fd)
def replace(src, dst, **kwargs):
    events.append(["replace", os.path.abspath(src), os.path.abspath(dst)])
    return real_replace(src, dst, **kwargs)
if __name__ == "__main__":  # not in the processes megatron's checkpoint writer spawns (they import this file)
    os.fsync, os.replace = fsync, replace
    atexit.register(lambda: open(os.environ["FSYNC_EVENTS"], "w").write(json.dumps(events)))
    sys.argv[0] = "pretrain"
    runpy.run_module("megatron_int8.pretrain", run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names fsync'd files through /proc")
def test_a_checkpoint_is_on_the_disk_before_the_tracker_names_it(data, tmp_path):
    """Every file and folder of the checkpoint is fsync'd before its folder gets its name and before the tracker
    names it (megatron fsyncs its shards and their index only: common.pt, metadata.json, the RNG files and the
    folders were left to the page cache, so a power loss could leave the tracker naming empty files while retention
    had already deleted the previous checkpoint)."""
    wrapper, events_file, save = tmp_path / "record.py", tmp_path / "events.json", tmp_path / "ckpt"
    wrapper.write_text(_RECORD_FSYNCS)
    result = subprocess.run([sys.executable, str(wrapper), *_argv(data, "--train-iters", "2", "--lr-warmup-iters", "0",
                                                                 "--save", str(save))],
                            cwd=ROOT, env=ENV | {"FSYNC_EVENTS": str(events_file)}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    events = json.loads(events_file.read_text())
    final, tracker = save / "iter_0000002", str(save / "latest_checkpointed_iteration.txt")
    named = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == tracker)
    renamed = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(final))
    tmp = events[renamed][1]
    synced = {e[1] for e in events[:renamed] if e[0] == "fsync"}
    on_disk = {os.path.join(folder, name) for folder, _, names in os.walk(final) for name in names} | {
        folder for folder, _, _ in os.walk(final)}
    missing = sorted(p for p in on_disk if tmp + p[len(str(final)):] not in synced)
    assert not missing, missing
    assert ["fsync", str(save)] in events[renamed:named], "the rename into iter_0000002 was not made durable"
    assert ["fsync", str(save)] in events[named:], "the tracker's rename was not made durable"


def test_tokenizer_folder_and_jsonl_are_diagnosed(data, tmp_path, capsys):
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    shutil.copy(data["tokenizer"], folder / "spm.model")
    message = _refused(capsys, _argv(data, "--train-iters", "4", "--tokenizer-model", str(folder)))
    assert "is a directory; give the SentencePiece model in it" in message
    assert f"--tokenizer-model {folder / 'spm.model'}" in message and "Hugging Face" not in message
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "def f(x):\\n    return x\\n"}\n{"text": "class A:\\n    pass\\n"}\n')
    for kind in ("SentencePieceTokenizer", "HuggingFaceTokenizer"):
        message = _refused(capsys, _argv(data, "--train-iters", "4", "--tokenizer-model", str(corpus),
                                         "--tokenizer-type", kind))
        assert "is a JSON-lines file (a corpus?), not a tokenizer" in message


def test_bad_values_fail_before_the_model_in_one_line(data, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [
        (["--lr=-1e-3"], "--lr -0.001: must be >= 0"),
        (["--save", str(a_file)], f"--save {a_file} is a file; it takes a directory"),
        (["--log-jsonl", str(tmp_path)], f"--log-jsonl {tmp_path} is a directory; it takes a file name"),
    ]
    for flags, expected in cases:
        assert expected in _refused(capsys, _argv(data, "--train-iters", "4", *flags))
    # the config's warm-up (30) against a short run: the message says where the 30 came from
    argv = _argv(data, "--train-iters", "20")
    at = argv.index("--lr-warmup-iters")  # SMALL_MODEL's: without it, the YAML's 30 holds
    message = _refused(capsys, argv[:at] + argv[at + 2:])
    assert f"--lr-warmup-iters 30 (from --config {TINY}) must be below --train-iters 20" in message
    assert "give --lr-warmup-iters below 20" in message


@pytest.mark.slow
def test_an_exit_between_log_lines_prints_its_iteration_and_checks_its_health(data, tmp_path):
    """--exit-interval 3 with --log-interval 10: the run's last iteration gets its console line and its INT8
    health check, as --train-iters' last does (they were skipped)."""
    out = _train(data, "--train-iters", "8", "--exit-interval", "3", "--log-interval", "10", "--int8-stats-interval",
                 "1", "--save", str(tmp_path / "ckpt"), "--lr-warmup-iters", "1", "--log-jsonl",
                 str(tmp_path / "log.jsonl")).stdout
    assert " iteration        3/       8 |" in out and "exiting at iteration 3 (--exit-interval 3)" in out
    assert "int8 health (it 3, worst)" in out
    assert sorted(_log(tmp_path / "log.jsonl", "int8_health")) == [1, 2, 3]


@pytest.mark.slow
def test_a_resume_with_other_model_flags_fails_before_the_model(data, interrupted, capsys):
    """The checkpoint's shape against the flags given now, before anything is built: one line naming the flag."""
    save = str(interrupted["save"])
    message = _refused(capsys, _argv(data, "--load", save, "--train-iters", "40", "--ffn-hidden-size", "192"))
    assert "checkpoint does not match the model arguments: ffn_hidden_size: checkpoint 128, now 192" in message


@pytest.mark.slow
def test_a_resume_with_another_optimizer_fails_before_the_model(data, interrupted, capsys):
    """The interrupted run trained with Adam in fp32: SGD's state, or --bf16's fp32 master copies, are not in its
    checkpoint (megatron's load failed with a KeyError after the build)."""
    save = str(interrupted["save"])
    for flags, change in ((["--optimizer", "sgd"], "--optimizer adam -> sgd"), (["--bf16"], "no --bf16 -> --bf16")):
        message = _refused(capsys, _argv(data, "--load", save, "--train-iters", "40", *flags))
        assert f"is of another optimizer than this run's ({change})" in message and "--no-load-optim" in message


def test_bf16_switched_under_the_distributed_optimizer_keeps_its_state():
    """The distributed optimizer holds fp32 main weights and moments with or without --bf16: a resume may switch it
    (refused only for megatron's non-distributed wrappers, which differ)."""
    import argparse

    from megatron_int8.training.checkpoint import _check_optimizer_kind

    saved = {"optimizer": "adam", "bf16": False, "use_distributed_optimizer": True}
    now = argparse.Namespace(optimizer="adam", bf16=True, use_distributed_optimizer=True, no_load_optim=False,
                             skip_train=False)
    _check_optimizer_kind(saved, now)
    with pytest.raises(ArgumentError, match=r"\(no --bf16 -> --bf16\)"):
        _check_optimizer_kind({**saved, "use_distributed_optimizer": False}, argparse.Namespace(
            **{**vars(now), "use_distributed_optimizer": False}))


@pytest.mark.slow
def test_an_sgd_run_resumes_with_its_momentum(data, tmp_path):
    """megatron-core gives SGD no state initializer, which its load calls (a TypeError on every resume of an SGD
    run): stopped at iteration 4 and resumed, the run's losses equal those of the run that was not stopped, which
    they would not without the momentum buffers."""
    common = ["--optimizer", "sgd", "--train-iters", "6", "--log-interval", "1", "--eval-iters", "0"]
    _train(data, *common, "--save", str(tmp_path / "a"))
    _train(data, *common, "--save", str(tmp_path / "b"), "--exit-interval", "4")
    resumed = _train(data, *common, "--save", str(tmp_path / "b"), "--load", str(tmp_path / "b"))
    assert "loaded checkpoint" in resumed.stdout
    assert _log(tmp_path / "b" / "train_log.jsonl", "lm_loss") == _log(tmp_path / "a" / "train_log.jsonl", "lm_loss")


@pytest.mark.slow
def test_a_new_global_batch_keeps_the_learning_rate_on_the_iteration_schedule(data, tmp_path):
    """The schedule's flags count iterations: resumed at iteration 10 with half the global batch, the LR goes on
    along the 20-iteration cosine and ends at --min-lr (megatron's schedule counts samples: it jumped to --min-lr at
    once here, and with a larger batch up, ending above --min-lr)."""
    save = str(tmp_path / "ckpt")
    common = ["--train-iters", "20", "--save", save, "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
              "--log-interval", "1", "--eval-iters", "0"]
    _train(data, *common, "--global-batch-size", "8", "--exit-interval", "10")
    second = _train(data, *common, "--global-batch-size", "4", "--load", save)
    assert "(the LR schedule counts iterations: it goes on from the checkpoint's iteration)" in second.stdout
    lr = _log(tmp_path / "ckpt" / "train_log.jsonl", "lr")
    for iteration in range(3, 21):  # warm-up 2 (SMALL_MODEL), then the cosine over iterations 2..20
        expected = 1e-4 + 0.5 * (1 + math.cos(math.pi * (iteration - 2) / (20 - 2))) * (1e-3 - 1e-4)
        assert float(lr[iteration]) == pytest.approx(expected, rel=1e-6), iteration


def test_a_checkpoint_from_before_the_step_count_resumes_at_its_iteration():
    """Checkpoints written before the schedule counted optimizer steps hold megatron's count in samples."""
    from megatron_int8.training.checkpoint import _schedule_position

    assert _schedule_position({"num_steps": 160}, 10) == 10
    assert _schedule_position({"num_steps": 9, "num_steps_unit": "iterations"}, 10) == 9  # a step skipped
    assert _schedule_position(None, 10) == 10


def test_model_flags_that_change_what_the_weights_compute_are_noted():
    """norm epsilon, RoPE and the router's top-k keep every shape: a resume or --skip-train may change them, and says
    so (the loss moved from 4.07 to 5.99 with --norm-epsilon 0.1 and nothing said)."""
    import argparse

    from megatron_int8.training.checkpoint import model_change

    saved = argparse.Namespace(norm_epsilon=1e-5, rotary_base=10000, rotary_percent=1.0, use_rope_scaling=False,
                               rope_scaling_factor=8.0, moe_router_topk=2, position_embedding_type="rope",
                               num_experts=None)
    assert model_change(saved, argparse.Namespace(**vars(saved))) is None
    assert model_change(argparse.Namespace(), saved) is None  # a checkpoint from before the arguments were saved
    now = argparse.Namespace(**{**vars(saved), "norm_epsilon": 0.1, "rotary_base": 500000, "moe_router_topk": 4,
                                "rope_scaling_factor": 16.0})
    assert model_change(saved, now) == ("model: this run's flags, not the checkpoint's (--norm-epsilon 1e-05 -> 0.1; "
                                        "--rotary-base 10000 -> 500000): the loaded weights were trained under the "
                                        "checkpoint's values")  # no experts, no RoPE scaling: those two do nothing
    moe = argparse.Namespace(**{**vars(now), "norm_epsilon": 1e-5, "rotary_base": 10000, "num_experts": 8,
                                "use_rope_scaling": True})
    assert model_change(saved, moe) == ("model: this run's flags, not the checkpoint's (--use-rope-scaling False -> "
                                        "True; --rope-scaling-factor 8.0 -> 16.0; --moe-router-topk 2 -> 4): the "
                                        "loaded weights were trained under the checkpoint's values")


def test_generate_and_export_refuse_bad_requests(tmp_path, capsys):
    generate, export = _load_script("generate"), _load_script("export_hf")
    for argv, expected in ((["--prompt", "x"], "the following arguments are required: --load"),
                           (["--load", str(tmp_path), "--prompt", ""], "--prompt is empty"),
                           (["--load", str(tmp_path), "--prompt", "x", "--temperature", "-1"],
                            "--temperature must be >= 0"),
                           (["--load", str(tmp_path), "--prompt", "x", "--top-p", "0.9"],
                            "--top-p and --seed apply to sampling: give --temperature > 0"),
                           (["--load", str(tmp_path), "--prompt", "x", "--seed", "3"],
                            "--top-p and --seed apply to sampling"),
                           (["--load", str(tmp_path), "--prompt", "x", "--temperature", "1", "--seed", str(2 ** 64)],
                            r"--seed must be in [0, 2**64), got 18446744073709551616"),
                           (["--load", str(tmp_path), "--prompt", "x", "--temperature", "1", "--seed=-1"],
                            "--seed must be in [0, 2**64), got -1")):
        with pytest.raises(SystemExit) as exit_info:
            generate(argv)
        assert exit_info.value.code == 2 and expected in capsys.readouterr().err
    output = tmp_path / "hf"
    output.mkdir()
    (output / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        export(["--load", str(tmp_path), "--output", str(output)])
    assert f"--output {output} is not empty: give a new directory, or --force" in capsys.readouterr().err
    assert (output / "config.json").read_text() == "{}"


def _script_code(name, stand_ins):
    """Python that runs scripts/NAME.py's main on its arguments after `stand_ins` (lines run first: they replace what
    the test must not reach); for a fresh process, as the script installs megatron's CPU support before megatron."""
    return (f"import sys\nsys.path.insert(0, {SCRIPTS!r})\n{stand_ins}\n"
            f"import {name}\nsys.exit({name}.main(sys.argv[1:]))")


MOCK_CHECKPOINT_WITHOUT_WEIGHTS = """
import argparse
from megatron_int8.training import inference
inference.inference_arguments = lambda load, **overrides: argparse.Namespace(
    tokenizer_type="NullTokenizer", vocab_size=4096, max_position_embeddings=64)
def load_for_inference(load, **overrides):
    raise SystemExit("the model was loaded")
inference.load_for_inference = load_for_inference
"""


@pytest.mark.parametrize("prompt, bad", [("1 99999", 99999), ("1 -5", -5), ("1 4100", 4100)])
def test_generate_refuses_token_ids_outside_the_vocabulary_before_the_model_loads(tmp_path, capsys, prompt, bad):
    """A mock-data checkpoint (NullTokenizer, --vocab-size 4096) reads the prompt as token ids: 99999 and -5 once
    failed with an IndexError after the model loaded, and 4100 (inside the embedding's padding) generated from an id
    no token has. The ids are megatron's: 0 to 4096 with the end of document on megatron-core 0.16, 0 to 4095 with it
    from 0.17 on."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    message = _refused(capsys, ["--load", str(tmp_path), "--prompt", prompt],
                       ("-c", _script_code("generate", MOCK_CHECKPOINT_WITHOUT_WEIGHTS)))
    assert message == (f"error: --prompt {prompt!r}: token id {bad} is not in the checkpoint's vocabulary "
                       f"(ids 0 to {NullTokenizer(4096).vocab_size - 1})")


def test_export_refuses_an_output_under_a_file_before_the_weights_load(tmp_path, capsys):
    """--output a_file/hf was a NotADirectoryError traceback when the staging folder beside it was made."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    stand_in = ("from megatron_int8.training import export\n"
                "export.export_hf = lambda *args, **kwargs: sys.exit('the export began')")
    for output in (a_file / "hf", a_file):
        message = _refused(capsys, ["--load", str(tmp_path), "--output", str(output)],
                           ("-c", _script_code("export_hf", stand_in)))
        assert message == f"error: --output {output}: {a_file} is a file; the export writes a directory"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs a folder where nothing can be made, by root too")
def test_export_refuses_an_output_where_nothing_can_be_written_before_the_weights_load(tmp_path, capsys):
    """--output /proc/hf loaded the weights, then failed with a traceback where its staging folder was made."""
    stand_in = ("from megatron_int8.training import export\n"
                "export.export_hf = lambda *args, **kwargs: sys.exit('the export began')")
    message = _refused(capsys, ["--load", str(tmp_path), "--output", "/proc/megatron_int8_hf"],
                       ("-c", _script_code("export_hf", stand_in)))
    assert message.startswith("error: --output /proc/megatron_int8_hf: nothing can be written in /proc (")


@pytest.mark.slow
def test_generate_and_export_refuse_another_tokenizer(data, interrupted, tmp_path, capsys):
    """A tokenizer that is not the checkpoint's: 500 tokens pad to the embedding's 512 rows (only the recorded
    vocabulary tells), 700 to 768. generate.py once printed text from the wrong pieces or failed with an IndexError,
    and export_hf.py wrote a tokenizer whose ids ran past the embedding; a tokenizer file of the wrong kind stopped
    export_hf.py with a traceback."""
    import sentencepiece as spm

    with open(os.path.join(data["root"], "corpus.jsonl")) as f:
        lines = [json.loads(line)["text"] for _, line in zip(range(2000), f)]
    export = (os.path.join(SCRIPTS, "export_hf.py"),)
    for vocab in (500, 700):
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / f"other{vocab}"),
                                       vocab_size=vocab, model_type="bpe", byte_fallback=True, character_coverage=0.99,
                                       minloglevel=2)
        model = str(tmp_path / f"other{vocab}.model")
        expected = f"--tokenizer-model {model} has {vocab} tokens, and the checkpoint trained with 512 tokens"
        for command, argv in ((os.path.join(SCRIPTS, "generate.py"), ["--prompt", "def f"]),
                              (export[0], ["--output", str(tmp_path / f"hf{vocab}")])):
            assert expected in _refused(capsys, ["--load", str(interrupted["save"]), "--tokenizer-model", model,
                                                 *argv], (command,))
        assert not (tmp_path / f"hf{vocab}").exists() and not (tmp_path / f"hf{vocab}.partial").exists()
    message = _refused(capsys, ["--load", str(interrupted["save"]), "--tokenizer-model",
                                os.path.join(data["root"], "corpus.jsonl"), "--output", str(tmp_path / "hf")], export)
    assert "corpus.jsonl" in message


@pytest.mark.slow
def test_generate_refuses_more_new_tokens_than_the_context_leaves(interrupted, capsys):
    err = _refused(capsys, ["--load", str(interrupted["save"]), "--prompt", "def f", "--max-new-tokens", "200"],
                   (os.path.join(SCRIPTS, "generate.py"),))
    assert "--max-new-tokens 200: the prompt's" in err and "64-token context; give --max-new-tokens" in err


def test_help_is_grouped_with_common_flags_first_and_every_default_shown(capsys):
    parser = build_parser()
    groups = [g for g in parser._action_groups if g._group_actions and g.title not in ("options", "positional arguments")]
    assert groups[0].title == "common flags" and groups[-1].title.startswith("undo a switch")
    common = {o for a in groups[0]._group_actions for o in a.option_strings}
    assert common >= {"--config", "--train-iters", "--lr", "--data-path", "--save", "--load", "--int8-linear"}
    assert not any(o.startswith("--no-") for o in common)
    missing = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert missing == [], f"flags without help: {missing}"
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = capsys.readouterr().out
    assert text.index("--train-iters") < text.index("--num-layers") < text.index("--no-swiglu")
    assert "(default: 1234)" in text and "(default: linear)" in text
    # on/off flags say whether what they set is the default (the setting's, not the flag's own store default)
    flat = " ".join(text.split())
    for flag, said in (("--disable-bias-linear", "No biases in the linear layers. (off by default)"),
                       ("--enable-bias-linear", "Undo --disable-bias-linear. (the default)"),
                       ("--load-optim", "Undo --no-load-optim. (the default)"),
                       ("--no-overlap-grad-reduce", "set in the YAML. (the default)"),
                       ("--no-fused-adam", "(megatron's fallback as it stands). --")):  # automatic: nothing added
        assert f"{flag} " in flat and said in flat[flat.index(f"{flag} "):][:300], (flag, said)
    assert "(default: )" not in text and "(default: True)" not in text and "(default: False)" not in text
    assert len(text.splitlines()[0]) < 100  # the usage line names the shape, not all the flags


# a model without a config: megatron's defaults (biases, GELU MLPs, LayerNorm)
BARE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3"]


def _validated(*flags, world_size=1):
    """validate_args of tiny.yaml with `flags` (or of BARE where flags start with it)."""
    from megatron_int8.training.args import parse_args, validate_args

    base = [] if list(flags[:len(BARE)]) == BARE else ["--config", TINY]
    args = parse_args([*base, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", *flags])
    return validate_args(args, world_size=world_size)


def test_moe_with_biases_under_expert_parallelism_is_allowed():
    """Under expert parallelism megatron-core skips the reduction whose view the bias add wrote into: it trains."""
    assert _validated(*BARE, "--num-experts", "4", "--expert-model-parallel-size", "2", world_size=2).add_bias_linear


@pytest.mark.parametrize("flags, message", [
    # each passed validation and failed after the model was built, or never failed
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "0"],
     "--recompute-num-layers 0: must be positive"),  # megatron looped forever
    (["--recompute-num-layers", "2"], "--recompute-num-layers applies with --recompute-granularity full"),
    (BARE + ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3"],
     "--recompute-num-layers 3, which must divide the 2 layers of each pipeline stage"),  # IndexError at step 1
    (["--kv-channels", "7"], "the rotated part of the head must be even: --kv-channels 7 x --rotary-percent 1.0"),
    (BARE + ["--num-experts", "4"], "--num-experts without expert parallelism needs --disable-bias-linear"),
    (["--global-batch-size", "0"], "--global-batch-size 0: must be positive"),
    (["--group-query-attention", "--num-query-groups", "0"], "--num-query-groups 0: must be positive"),
    (["--kv-channels", "0"], "--kv-channels 0: must be positive"),
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size 0: must be positive"),
    (["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by 0: must be positive"),
    (["--vocab-size", "0"], "--vocab-size 0: must be positive"),  # trained on one token
    (["--attention-dropout", "1.5"], r"--attention-dropout 1.5: must be in \[0, 1\]"),
    (["--hidden-dropout", "nan"], r"--hidden-dropout nan: must be in \[0, 1\]"),
    (["--init-method-std=-0.02"], "--init-method-std -0.02: must be a positive number"),
    (["--seed=-1"], r"--seed -1: must be in \[0, 2\*\*32\)"),
    (["--data-seed", "4294967296"], r"--data-seed 4294967296: must be in \[0, 2\*\*32\)"),
    (["--seed", "4294967295", "--pipeline-model-parallel-size", "2"], r"must be below 2\*\*32 - 100"),
    (["--num-workers=-1"], "--num-workers -1: must be >= 0"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes 0: must be positive"),
    (["--clip-grad", "nan"], "--clip-grad nan: must be >= 0"),  # turned clipping off
    (["--lr", "inf"], "--lr inf: must be >= 0"),
    (["--adam-eps", "nan"], "--adam-eps nan: must be positive"),
    (["--lr", "0", "--min-lr", "0"], "--lr 0: must be positive"),  # trained, the weights unchanged
    (["--lr-warmup-init", "0.01"], "--lr-warmup-init 0.01 is above --lr 0.002"),  # megatron's scheduler asserted
    (["--rotary-base", "0"], "--rotary-base 0: must be a positive number"),  # NaN gradients at the first step
    (["--use-rope-scaling", "--rope-scaling-factor", "0"], "--rope-scaling-factor 0.0: must be a positive number"),
    (["--rotary-percent", "0"], r"--rotary-percent 0.0: must be in \(0, 1\]"),  # no positions at all
    (["--rotary-percent", "2"], r"--rotary-percent 2.0: must be in \(0, 1\]"),
    (["--norm-epsilon=-1e-5"], "--norm-epsilon -1e-05: must be >= 0"),  # NaN gradients at the first step
    (["--moe-aux-loss-coeff", "nan"], "--moe-aux-loss-coeff nan: must be >= 0"),
    (["--optimizer", "sgd", "--sgd-momentum", "nan"], r"--sgd-momentum nan: must be in \[0, 1\)"),
    (["--optimizer", "sgd", "--use-distributed-optimizer"], "--use-distributed-optimizer needs --optimizer adam"),
    (BARE + ["--int8-linear", "--int8-swiglu-input"], "--int8-swiglu-input keeps the input of the fused SwiGLU"),
    (["--int8-linear", "--int8-swiglu-input", "--swiglu", "--no-fused-swiglu"], "it needs --swiglu, no --no-fused"),
    (["--int8-linear", "--int8-norm-input", "--normalization", "LayerNorm"],
     "--int8-norm-input keeps the RMSNorms' input in INT8: it needs --normalization RMSNorm, got LayerNorm"),
])
def test_numbers_and_combinations_that_failed_after_the_build_are_refused(flags, message):
    from megatron_int8.training.args import ArgumentError

    with pytest.raises(ArgumentError, match=message):
        _validated(*flags)


def test_mock_data_under_a_config_with_a_tokenizer_type_says_how_to_run_without_one():
    """tiny.yaml sets a SentencePiece tokenizer: with --mock-data the error named only --tokenizer-model."""
    from megatron_int8.training.args import ArgumentError, parse_args, validate_args

    with pytest.raises(ArgumentError, match=r"SentencePieceTokenizer \(from --config .*tiny.yaml\) needs "
                                            r"--tokenizer-model, or with --mock-data --tokenizer-type NullTokenizer"):
        validate_args(parse_args(["--config", TINY, "--mock-data"]), world_size=1)


def test_recompute_counts_that_serve_each_method_are_accepted():
    """uniform: chunks that divide a stage's layers; block: any count (more than a stage holds recomputes them all)."""
    recompute = ["--recompute-granularity", "full", "--recompute-num-layers"]
    assert _validated(*BARE, *recompute, "2", "--recompute-method", "uniform").recompute_num_layers == 2
    assert _validated(*BARE, *recompute, "3", "--recompute-method", "block").recompute_num_layers == 3


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for a process that sees no GPU")
def test_nccl_without_a_gpu_is_refused():
    from megatron_int8.training.args import ArgumentError

    with pytest.raises(ArgumentError, match="--distributed-backend nccl needs CUDA GPUs"):
        _validated("--distributed-backend", "nccl")  # torch's "Distributed package doesn't have NCCL" traceback


def test_output_paths_that_cannot_be_written_fail_before_the_model(tmp_path):
    """A --save under a file, or where nothing can be written, trained up to the first save and lost the run there
    (the data cache failed after the build, a TensorBoard folder was dropped)."""
    import re

    from megatron_int8.training.args import ArgumentError

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for flag in ("--save", "--tensorboard-dir", "--data-cache-path", "--log-jsonl", "--profile-dir"):
        with pytest.raises(ArgumentError, match=re.escape(f"{flag} {a_file / 'out'}: {a_file} is a file, not a dir")):
            _validated(flag, str(a_file / "out"), *(["--profile"] if flag == "--profile-dir" else []))
    _validated("--profile-dir", str(a_file / "out"))  # without --profile nothing is written there
    if os.path.isdir("/proc"):  # no folder can be made there, by root either (whom chmod does not stop)
        with pytest.raises(ArgumentError, match="--save /proc/megatron_int8_run/ckpt: nothing can be written in /proc"):
            _validated("--save", "/proc/megatron_int8_run/ckpt")
    assert _validated("--save", str(tmp_path / "new" / "ckpt")).save and os.listdir(tmp_path) == ["a_file"]


def test_the_triton_backend_where_it_cannot_run_is_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MEGATRON_INT8_BACKEND", raising=False)
    from megatron_int8.training.args import ArgumentError

    with pytest.raises(ArgumentError, match="--int8-backend triton: .*the backend 'auto' picks what runs here"):
        _validated("--int8-linear", "--int8-backend", "triton")
    monkeypatch.setenv("MEGATRON_INT8_BACKEND", "triton")  # the variable overrides the flag: named as the cause
    with pytest.raises(ArgumentError, match="MEGATRON_INT8_BACKEND=triton: "):
        _validated("--int8-linear")


def test_settings_without_effect_are_noted(capsys):
    _validated("--int8-linear", "--int8-num-layers-at-start-in-bf16", "2")
    assert ("note: --int8-num-layers-at-start-in-bf16 apply with --int8-first-last-layers-bf16 only"
            in capsys.readouterr().out)
    _validated("--save-interval", "5")
    assert "note: --save-interval 5 without --save: no checkpoint is saved" in capsys.readouterr().out
    _validated()  # the config's own interval, for runs that save: no note
    assert "--save-interval" not in capsys.readouterr().out
    # a switch's settings without the switch were read and dropped without a word
    _validated("--moe-router-topk", "1", "--moe-aux-loss-coeff", "0.1", "--profile-step-start", "2", "--eod-token", "x")
    out = capsys.readouterr().out
    assert ("note: --moe-aux-loss-coeff, --moe-router-topk have no effect without --num-experts (the model is dense)"
            in out)
    assert "note: --profile-step-start has no effect without --profile (nothing is profiled)" in out
    assert "note: --eod-token x has no effect with --tokenizer-type NullTokenizer" in out
    _validated("--num-experts", "4", "--moe-router-topk", "1", "--profile", "--profile-step-start", "2")
    assert "no effect" not in capsys.readouterr().out


def test_a_config_that_sets_one_setting_twice_is_refused(tmp_path):
    from megatron_int8.training.args import ArgumentError, parse_args

    for keys, message in ((("swiglu: true", "no_swiglu: true"), "'no_swiglu' and 'swiglu' both set swiglu"),
                          (("lr: 0.1", "--lr: 0.2"), "'--lr' and 'lr' both set lr"),
                          (("swiglu: true", "lr: 0.1", "swiglu: false"), r"key 'swiglu' is given twice \(line 3\)"),
                          (("help: true",), "unknown key 'help'$")):
        config = tmp_path / "c.yaml"
        config.write_text("\n".join(keys) + "\n")
        with pytest.raises(ArgumentError, match=message):
            parse_args(["--config", str(config)])


def test_a_second_config_replacing_the_first_is_noted(tmp_path, capsys):
    """The last --config counts (a test swaps tiny.yaml for another file so): the first file's settings were
    dropped without a word."""
    from megatron_int8.training.args import parse_args

    other = tmp_path / "lr.yaml"
    other.write_text("lr: 0.5\n")
    args = parse_args(["--config", TINY, f"--config={other}"])
    assert args.lr == 0.5 and args.num_layers is None
    note = f"note: --config is given 2 times: only the last one, {other}, is read (not {TINY})"
    assert note in capsys.readouterr().out
    parse_args([f"--config={other}"])
    assert "--config" not in capsys.readouterr().out


def test_a_leading_tilde_the_shell_left_is_expanded_in_paths(tmp_path, monkeypatch):
    """`save: ~/run` in a YAML file (or --save=~/run, which bash leaves too) made a folder named '~' in the working
    directory and saved the checkpoints there."""
    from megatron_int8.training.args import parse_args

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "c.yaml").write_text("save: ~/run\ndata_path: 0.5 ~/a 0.5 ~/b\ntokenizer_model: ~/spm.model\n")
    args = parse_args(["--config=~/c.yaml", "--tensorboard-dir=~/tb"])
    assert args.save == str(tmp_path / "run") and args.tensorboard_dir == str(tmp_path / "tb")
    assert args.data_path == ["0.5", str(tmp_path / "a"), "0.5", str(tmp_path / "b")]
    assert args.tokenizer_model == str(tmp_path / "spm.model") and args.from_config["save"] == str(tmp_path / "c.yaml")


def test_generate_refuses_a_temperature_that_is_no_number(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _load_script("generate")(["--load", str(tmp_path), "--prompt", "x", "--temperature", "nan"])
    assert exit_info.value.code == 2 and "--temperature must be >= 0 (0: greedy), got nan" in capsys.readouterr().err


def test_the_model_config_prints_no_deprecation_of_megatron_core():
    """megatron-core 0.19 deprecates cuda_graph_scope for cuda_graph_modules: the config sets whichever the installed
    version has, so no version warns at every start (Python's default filters hid it; -W default showed it)."""
    import warnings

    from megatron_int8.training.args import transformer_config_from_args

    args = _validated()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = transformer_config_from_args(args)
    assert not [str(w.message) for w in caught if "cuda_graph" in str(w.message)]
    assert (getattr(config, "cuda_graph_modules", None) or getattr(config, "cuda_graph_scope", None) or []) == []
