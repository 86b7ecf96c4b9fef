"""benchmarks/bench_e2e.py beyond the six models: any configs/MODEL.yaml (the 350M convergence model), with no
paper figure to compare, and a clear error for a config that does not exist."""
import pytest

import bench_e2e


def test_any_config_runs_and_the_paper_column_says_n_a(monkeypatch, tmp_path):
    calls = []

    def fake_run(model, layers, int8, opts, env=None, fp8=None):
        calls.append((model, layers, int8, tuple(opts.extra)))
        step = layers * (0.9 if int8 else 1.0)
        return {"step_s": step, "loss": 5.0, "losses": [5.0], "peak_gb": 20.0, "resident_gb": 6.0, "wall_s": 1.0,
                "tflops_per_gpu": 1.0}

    monkeypatch.setattr(bench_e2e, "run_trainer", fake_run)
    monkeypatch.setenv("OUT", str(tmp_path))
    out = tmp_path / "e2e.md"
    bench_e2e.main(["--models", "convergence_350m", "--full-depth", "--out", str(out), "--extra", "--vocab-size",
                    "8192"])
    assert {c[:3] for c in calls} == {("convergence_350m", 24, False), ("convergence_350m", 24, True)}
    assert all(c[3] == ("--vocab-size", "8192") for c in calls)
    row = next(line for line in out.read_text().splitlines() if line.startswith("| convergence_350m"))
    assert "| 1.111x |" in row and "| n/a |" in row  # 1.0 / 0.9, and no paper figure for this model


def test_a_missing_config_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--models", "llama_nope"])
    assert "no configs/llama_nope.yaml" in capsys.readouterr().err


def test_iterations_left_to_time_are_checked_before_any_run(monkeypatch, capsys):
    """--iters at most --warmup leaves no step to time: a usage error before the first trainer run, not after it."""
    monkeypatch.setattr(bench_e2e, "run_trainer", lambda *a, **k: pytest.fail("a trainer run started"))
    for iters, warmup in (("2", "4"), ("4", "4"), ("4", "-1")):
        with pytest.raises(SystemExit) as exit_info:
            bench_e2e.main(["--models", "qwen3_4b", "--iters", iters, "--warmup", warmup])
        assert exit_info.value.code == 2
        assert f"--iters {iters} must exceed --warmup {warmup} (>= 0)" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--micro-batch-size", "0"], "--micro-batch-size: must be an integer >= 1, got 0"),
    (["--grad-accum", "0"], "--grad-accum: must be an integer >= 1, got 0"),
    (["--depths", "0", "2"], "--depths: must be an integer >= 1, got 0"),
    (["--gpus", "0", "1", "--nproc", "2"], "--gpus runs single-GPU models side by side"),
    (["--fp8-compile"], "--fp8-compile applies to the FP8 runs: give --fp8-peer too"),
    (["--memory-cap-gib", "-5"], "--memory-cap-gib must be a positive number of GiB, got -5.0"),  # labelled capped
    (["--out", "/nonexistent_dir_of_bench_e2e/e2e.md"], "no directory /nonexistent_dir_of_bench_e2e"),
])
def test_settings_that_would_waste_or_mislabel_runs_are_refused_before_any(monkeypatch, capsys, flags, message):
    """Each was accepted: zeros failed inside the trainer, --out only after the first model's runs, a negative cap
    ran uncapped under the capped label, --gpus with --nproc > 1 and --fp8-compile without --fp8-peer did nothing."""
    monkeypatch.setattr(bench_e2e, "run_trainer", lambda *a, **k: pytest.fail("a trainer run started"))
    with pytest.raises(SystemExit) as exit_info:
        bench_e2e.main(["--models", "qwen3_4b", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_memory_cap_wraps_every_trainer_run(monkeypatch, tmp_path):
    """--memory-cap-gib: each trainer process starts under benchmarks/memory_cap.py with the cap, before the
    trainer's module; the rows go to their own CSV with the cap among the settings."""
    import json
    import subprocess

    import common

    commands = []

    def fake_subprocess_run(cmd, **kwargs):
        commands.append(cmd)
        with open(cmd[cmd.index("--log-jsonl") + 1], "w", encoding="utf-8") as log:
            for step in range(6):
                log.write(json.dumps({"lm_loss": 5.0 - step * 0.1, "step_time_s": 1.0}) + "\n")
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(common.subprocess, "run", fake_subprocess_run)
    opts = bench_e2e.parse_args(["--models", "qwen3_4b", "--full-depth", "--iters", "6", "--warmup", "2",
                                 "--memory-cap-gib", "79"])
    row = bench_e2e.measure_model("qwen3_4b", opts)
    assert len(commands) == 2 and row["int8_tok_s"] == row["bf16_tok_s"]
    for cmd in commands:
        at = cmd.index("megatron_int8.pretrain")
        assert cmd[at - 2].endswith("benchmarks/memory_cap.py") and cmd[at - 1] == "79.0" and "-m" not in cmd[:at]
    assert bench_e2e.results_name(opts) == "e2e_capped" and bench_e2e.csv_row(row, opts)["memory_cap_gib"] == 79.0
    assert "capped at 79 GiB" in bench_e2e.format_table([row], opts)
    commands.clear()
    uncapped = bench_e2e.parse_args(["--models", "qwen3_4b", "--full-depth", "--iters", "6", "--warmup", "2"])
    bench_e2e.measure_model("qwen3_4b", uncapped)
    assert all(cmd[cmd.index("megatron_int8.pretrain") - 1] == "-m" for cmd in commands)
    assert bench_e2e.results_name(uncapped) == "e2e" and "memory_cap_gib" not in bench_e2e.csv_row(row, uncapped)


def test_memory_cap_sets_the_fraction_before_the_module_runs(monkeypatch):
    import memory_cap
    import torch

    events = []
    total = 141 * memory_cap.GIB  # an H200's memory as torch reports it, in round GiB here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": total}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device: events.append(("cap", fraction, device)))
    monkeypatch.setattr(memory_cap.runpy, "run_module", lambda name, run_name, alter_sys: events.append(
        ("run", name, run_name, list(memory_cap.sys.argv))))
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(memory_cap.sys, "argv", ["memory_cap.py"])
    memory_cap.main(["79", "megatron_int8.pretrain", "--config", "c.yaml"])
    assert events == [("cap", 79 / 141, 3), ("run", "megatron_int8.pretrain", "__main__",
                                             ["megatron_int8.pretrain", "--config", "c.yaml"])]
    with pytest.raises(ValueError, match="does not fit"):
        memory_cap.cap_fraction(150, total)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        memory_cap.apply_cap(79)


def test_a_flag_string_that_is_one_trainer_flag_is_taken_as_the_value():
    """argparse alone reads `--int8-extra --int8-swiglu-input` as two options and stops; --extra's flags stay."""
    opts = bench_e2e.parse_args(["--int8-extra", "--int8-swiglu-input", "--layout", "--sequence-parallel",
                                 "--bf16-extra", "--recompute-activations", "--models", "qwen3_4b",
                                 "--extra", "--bf16-extra", "--x"])
    assert opts.int8_extra == "--int8-swiglu-input"
    assert opts.layout == "--sequence-parallel"
    assert opts.bf16_extra == "--recompute-activations"
    assert opts.models == ["qwen3_4b"]
    assert opts.extra == ["--bf16-extra", "--x"]
    several = bench_e2e.parse_args(["--int8-extra", "--int8-swiglu-input --int8-no-dgrad-weight-cache"])
    assert several.int8_extra == "--int8-swiglu-input --int8-no-dgrad-weight-cache"
    assert bench_e2e.parse_args(["--int8-extra=--int8-norm-input"]).int8_extra == "--int8-norm-input"
