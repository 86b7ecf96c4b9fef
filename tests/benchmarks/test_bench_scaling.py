"""benchmarks/bench_scaling.py's time budgeting, with the trainer replaced by a fake that advances a fake clock; and
the usage errors found before any run: --report of a directory without results, no iteration left to time."""
import os

import pytest
from repo_paths import BENCHMARKS



def _run_with_fake_trainer(monkeypatch, tmp_path, deadline, wall_s=100.0):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_scaling

    monkeypatch.setattr(os, "environ", dict(os.environ))  # main() sets NCCL and device variables
    clock, timeouts = [1000.0], []

    def fake_run(model, layers, int8, opts, env=None, fp8=None):
        timeouts.append(opts.run_timeout)
        clock[0] += wall_s
        return {"step_s": 1.0, "loss": 5.0, "losses": [5.0], "peak_gb": 1.0, "wall_s": wall_s,
                "tflops_per_gpu": 1.0}

    monkeypatch.setattr(bench_scaling.time, "time", lambda: clock[0])
    monkeypatch.setattr(bench_scaling, "run_trainer", fake_run)
    bench_scaling.main(["--smoke", "--layouts", "llama2_7b-tp2sp-dp2", "--variants", "bf16", "int8", "int8-int8ag",
                        "--deadline", str(deadline), "--run-timeout", "400", "--out-dir", str(tmp_path)])
    skipped = sorted(f.split("__")[1] for f in os.listdir(tmp_path / "scaling_results")
                     if "skipped" in (tmp_path / "scaling_results" / f).read_text())
    return timeouts, skipped


def test_each_run_ends_before_the_deadline_with_its_sigterm_grace(monkeypatch, tmp_path):
    """deadline 250 s, runs of 100 s, 30 s grace: 220 s, then 120 s for the second run; the third is skipped
    (50 s left)."""
    timeouts, skipped = _run_with_fake_trainer(monkeypatch, tmp_path, deadline=250)
    from common import KILL_AFTER_S

    assert KILL_AFTER_S == 30
    assert timeouts == [220, 120]
    assert skipped == ["int8-int8ag.json"]


def test_a_run_is_skipped_when_less_time_is_left_than_its_layout_took(monkeypatch, tmp_path):
    """deadline 215 s: after a 100 s run, 115 s are left, 85 s after the grace: less than the 100 s the
    layout's first run took (but more than --min-run-s 60), so the rest are skipped, not started to be cut off."""
    timeouts, skipped = _run_with_fake_trainer(monkeypatch, tmp_path, deadline=215)
    assert timeouts == [185]
    assert skipped == ["int8-int8ag.json", "int8.json"]


def test_report_of_a_missing_or_empty_directory_leaves_the_table(monkeypatch, tmp_path, capsys):
    """--report of a misspelled or empty directory is a usage error; the table already in --out-dir stays."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_scaling

    monkeypatch.setattr(os, "environ", dict(os.environ))
    table = tmp_path / "out" / "bench_scaling.md"
    table.parent.mkdir()
    table.write_text("| the earlier table |\n")
    (tmp_path / "empty").mkdir()
    for directory, said in ((tmp_path / "nope", "no directory"), (tmp_path / "empty", "no results under")):
        with pytest.raises(SystemExit) as exit_info:
            bench_scaling.main(["--report", str(directory), "--out-dir", str(table.parent)])
        assert exit_info.value.code == 2 and f"--report: {said} {directory}" in capsys.readouterr().err
    assert table.read_text() == "| the earlier table |\n"


def test_iterations_left_to_time_are_checked_before_any_run(monkeypatch, capsys):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_scaling

    with pytest.raises(SystemExit) as exit_info:
        bench_scaling.parse_args(["--iters", "5", "--warmup", "5"])
    assert exit_info.value.code == 2 and "--iters 5 must exceed --warmup 5 (>= 0)" in capsys.readouterr().err
