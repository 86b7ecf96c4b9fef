"""benchmarks/stress_outliers.py at tiny size on CPU: the four runs, the table, the results CSV and the PNG;
with the outliers grown 1000x in a few steps, the health statistics flag the injected MLPs and the auto
fallback moves a GEMM, while the SwiGLU guard keeps fc2's fprop error at its healthy level."""
import json
import sys

import pytest
from repo_paths import BENCHMARKS

pytestmark = pytest.mark.slow


def test_tiny_stress_run(tmp_path):
    sys.path.insert(0, BENCHMARKS)
    import stress_outliers

    assert stress_outliers.main(["--size", "tiny", "--steps", "8", "--device", "cpu", "--stats-interval", "1",
                                 "--patience", "2", "--inject-start", "0", "--inject-end", "0.5",
                                 "--window", "4", "--output-dir", str(tmp_path),
                                 "--results-dir", str(tmp_path)]) == 0
    table = (tmp_path / "table.md").read_text().splitlines()
    assert [line.split("|")[1].strip() for line in table[2:]] == ["bf16", "int8", "fallback", "guard"]
    assert (tmp_path / "stress.png").stat().st_size > 10_000
    assert (tmp_path / "stress_outliers.csv").read_text().count("\n") == 5  # header + 4 runs
    lines = [json.loads(line) for line in (tmp_path / "stress.jsonl").read_text().splitlines()]
    losses = {(r["run"], r["iteration"]): r["lm_loss"] for r in lines if "lm_loss" in r}
    assert losses[("int8", 1)] != losses[("bf16", 1)] and len(losses) == 32
    checks = {(r["run"], r["iteration"]): r["int8_health"] for r in lines if "int8_health" in r}
    fc2 = "layer2.mlp.linear_fc2"  # injected layers: all; the last check, outliers at 1000x
    assert checks[("int8", 8)][fc2]["fprop/rel_err"] > 0.1 > checks[("int8", 1)][fc2]["fprop/rel_err"]
    assert checks[("guard", 8)][fc2]["fprop/rel_err"] < 0.05
    int8_row = next(line for line in table if line.startswith("| int8 |"))
    assert "mlp.linear_fc" in int8_row  # the first health flag names an injected MLP
    assert {r["run"] for r in lines if "int8_fallback" in r} == {"fallback"}
