"""benchmarks/bench_health_overhead.py --probe-only on CPU: one probe timed on a shape whose weight axes are
sampled, and its row in the results CSV ($OUT's: a CPU run's row stays out of benchmarks/results)."""
import csv
import os

import pytest
from repo_paths import BENCHMARKS


def test_probe_only_times_one_probe(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(BENCHMARKS)
    monkeypatch.setenv("OUT", str(tmp_path))
    import bench_health_overhead

    assert bench_health_overhead.main(["--probe-only", "--probe-shape", "512", "1280", "1536", "--device", "cpu",
                                       "--repeats", "1", "--granularity", "tensor"]) == 0
    assert "512x1280x1536 tensor on cpu" in capsys.readouterr().out
    with open(tmp_path / "bench_health_probe.csv", encoding="utf-8") as f:
        (row,) = list(csv.DictReader(f))
    assert row["shape"] == "512x1280x1536" and row["granularity"] == "tensor" and float(row["probe_ms"]) > 0


def test_a_cpu_probe_stays_out_of_the_committed_results(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(BENCHMARKS)
    monkeypatch.delenv("OUT", raising=False)
    import bench_health_overhead
    import common

    monkeypatch.setattr(common, "RESULTS", str(tmp_path))
    assert bench_health_overhead.main(["--probe-only", "--probe-shape", "64", "128", "128", "--device", "cpu",
                                       "--repeats", "1"]) == 0
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("bad", [["--probe-shape", "0", "128", "128"], ["--repeats", "0"], ["--interval", "0"]])
def test_a_zero_probe_size_is_a_usage_error(monkeypatch, capsys, bad):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_health_overhead

    with pytest.raises(SystemExit) as exit_info:
        bench_health_overhead.main(["--probe-only", "--device", "cpu", "--probe-shape", "64", "128", "128", *bad])
    assert exit_info.value.code == 2 and f"argument {bad[0]}: must be an integer >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("counts", [["--iters", "9", "--warmup", "8", "--interval", "10"],
                                    ["--iters", "20", "--warmup", "19", "--interval", "10"],
                                    ["--iters", "60", "--warmup", "8", "--interval", "1"],
                                    ["--iters", "60", "--warmup", "-1"]])
def test_runs_without_a_timed_statistics_step_are_refused_before_the_trainer(monkeypatch, capsys, counts):
    """--iters 9 --warmup 8 found "no statistics step after warm-up" only after a whole trainer run."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_health_overhead

    monkeypatch.setattr(bench_health_overhead, "run", lambda opts, graphed: pytest.fail("a trainer run started"))
    with pytest.raises(SystemExit) as exit_info:
        bench_health_overhead.main(counts)
    assert exit_info.value.code == 2 and "must time a statistics step" in capsys.readouterr().err


def test_the_default_counts_time_statistics_steps(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_health_overhead

    class Started(Exception):
        pass

    def run(opts, graphed):
        raise Started

    monkeypatch.setattr(bench_health_overhead, "run", run)
    with pytest.raises(Started):  # past the check, into the first trainer run
        bench_health_overhead.main([])
