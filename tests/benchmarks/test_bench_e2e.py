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
