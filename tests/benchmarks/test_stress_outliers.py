"""benchmarks/stress_outliers.py at tiny size on CPU: the five runs, the table, the results CSV and the PNG;
with the outliers grown 1000x in a few steps, the health statistics flag the injected MLPs and the auto
fallback moves a GEMM, while the SwiGLU guard keeps fc2's fprop error at its healthy level. And the departure
measure on crafted loss curves: counted from the injection start on, beyond both 1% and the noise band."""
import json
import sys

import pytest
from repo_paths import BENCHMARKS



def _stress_outliers():
    sys.path.insert(0, BENCHMARKS)
    import stress_outliers

    return stress_outliers


def test_noise_band_is_the_recent_envelope_of_the_second_seed():
    band = _stress_outliers().noise_band([0.03, -0.05, 0.001, 0.002, -0.001, 0.0], window=3)
    assert band == [0.03, 0.05, 0.05, 0.05, 0.002, 0.002]


def test_first_departure_counts_from_the_injection_start_beyond_1pct_and_the_noise():
    so = _stress_outliers()
    dep = [0.04, 0.02, 0.005, 0.012, 0.015, 0.03, 0.02]  # early noise over 1% at steps 1-2
    band = [0.05, 0.05, 0.02, 0.02, 0.02, 0.02, 0.005]
    assert so.first_departure(dep, band, start=2) == 6  # step 4 and 5: over 1% but inside the band
    assert so.first_departure(dep, [0.0] * 7, start=2) == 4  # without a band: the first over 1% after step 2
    assert so.first_departure(dep, [0.0] * 7, start=0) == 1
    assert so.first_departure([0.009] * 7, [0.0] * 7, start=0) is None  # never over 1%
    assert so.first_departure([-0.03] * 7, [0.0] * 7, start=0) is None  # a lower loss is no departure


def test_departure_onset_is_the_start_of_the_stretch_holding_the_peak():
    so = _stress_outliers()
    # an early crossing that recovers (steps 2-3), then the departure that grows (steps 6-8, peak at 8)
    dep = [0.0, 0.02, 0.015, 0.004, 0.008, 0.011, 0.03, 0.06, 0.05]
    assert so.first_departure(dep, [0.0] * 9, start=0) == 2
    assert so.departure_onset(dep, [0.0] * 9, start=0) == 6
    assert so.departure_onset(dep, [0.0] * 5 + [0.02] * 4, start=0) == 7  # step 6 lies inside the band
    assert so.departure_onset(dep, [0.0] * 9, start=7) == 8  # counted from the start on
    assert so.departure_onset([0.009] * 9, [0.0] * 9, start=0) is None
    assert so.departure_onset([0.02, 0.03], [0.0, 0.0], start=2) is None  # nothing after the start


def test_a_killed_job_keeps_the_runs_it_finished(monkeypatch, tmp_path):
    """stress.jsonl gets each run's records as it finishes, in a file started afresh: a job killed in its second
    run leaves the first, which --summarize reads, and none of an earlier job's records."""
    so = _stress_outliers()

    def train(run, cfg, init_state, batches, args, device, log):
        if run != "bf16":
            raise KeyboardInterrupt  # the job is killed during its second run
        return {"loss": [5.0 - 0.1 * s for s in range(args.steps)], "checks": [], "events": [], "flag": None,
                "seconds": 1.0}

    monkeypatch.setattr(so, "train", train)
    earlier = {"args": {"runs": ["int8"]}, "model": {}, "injected": "x"}
    (tmp_path / "stress.jsonl").write_text(json.dumps(earlier) + "\n" + json.dumps({"run": "int8", "seconds": 2.0})
                                           + "\n")
    with pytest.raises(KeyboardInterrupt):
        so.main(["--size", "tiny", "--steps", "6", "--device", "cpu", "--runs", "bf16", "int8", "--window", "2",
                 "--output-dir", str(tmp_path), "--results-dir", str(tmp_path)])
    lines = [json.loads(line) for line in (tmp_path / "stress.jsonl").read_text().splitlines()]
    assert lines[0]["args"]["runs"] == ["bf16", "int8"] and {r["run"] for r in lines[1:]} == {"bf16"}
    assert [r["lm_loss"] for r in lines if "lm_loss" in r] == [5.0, 4.9, 4.8, 4.7, 4.6, 4.5]
    assert so.main(["--summarize", str(tmp_path / "stress.jsonl"), "--output-dir", str(tmp_path / "again")]) == 0
    table = (tmp_path / "again" / "table.md").read_text().splitlines()
    assert [line.split("|")[1].strip() for line in table[2:]] == ["bf16"]


@pytest.mark.parametrize("bad", [["--window", "0"], ["--stats-interval", "0"], ["--steps", "0"],
                                 ["--log-interval", "0"], ["--warmup", "0"]])
def test_a_zero_count_is_refused_before_training(bad, monkeypatch, tmp_path, capsys):
    so = _stress_outliers()
    monkeypatch.setattr(so, "train", lambda *a: pytest.fail("trained"))
    with pytest.raises(SystemExit) as exit_info:
        so.main(["--size", "tiny", "--steps", "2", "--device", "cpu", "--output-dir", str(tmp_path),
                 "--results-dir", str(tmp_path), *bad])
    assert exit_info.value.code == 2
    assert f"argument {bad[0]}: must be an integer >= 1, got 0" in capsys.readouterr().err


def test_summarize_takes_an_explicit_window_over_the_recorded_one(monkeypatch, tmp_path, capsys):
    """A log that recorded --window 0 (written before the check) is redone with the --window given, and refused
    with a usage error without one."""
    so = _stress_outliers()
    monkeypatch.setattr(so, "train", lambda run, cfg, init, batches, args, device, log: {
        "loss": [5.0 - 0.1 * s for s in range(args.steps)], "checks": [], "events": [], "flag": None, "seconds": 1.0})
    assert so.main(["--size", "tiny", "--steps", "6", "--device", "cpu", "--runs", "bf16", "--window", "2",
                    "--output-dir", str(tmp_path), "--results-dir", str(tmp_path)]) == 0
    log = tmp_path / "stress.jsonl"
    header, *records = log.read_text().splitlines()
    header = json.loads(header)
    header["args"]["window"] = 0
    log.write_text("\n".join([json.dumps(header), *records]) + "\n")
    summarize = ["--summarize", str(log), "--output-dir", str(tmp_path / "again")]
    with pytest.raises(SystemExit) as exit_info:
        so.main(summarize)
    assert exit_info.value.code == 2 and "records --window 0: give --window N >= 1" in capsys.readouterr().err
    assert so.main(summarize + ["--window", "3"]) == 0
    assert "| bf16 | 4.6000 |" in (tmp_path / "again" / "table.md").read_text()  # the mean of the last 3 losses


@pytest.mark.slow
def test_tiny_stress_run(tmp_path):
    stress_outliers = _stress_outliers()

    assert stress_outliers.main(["--size", "tiny", "--steps", "8", "--device", "cpu", "--stats-interval", "1",
                                 "--patience", "2", "--inject-start", "0", "--inject-end", "0.5",
                                 "--window", "4", "--output-dir", str(tmp_path),
                                 "--results-dir", str(tmp_path)]) == 0
    table = (tmp_path / "table.md").read_text().splitlines()
    assert [line.split("|")[1].strip() for line in table[2:]] == ["bf16", "bf16_seed2", "int8", "fallback", "guard"]
    assert (tmp_path / "stress.png").stat().st_size > 10_000
    assert (tmp_path / "stress_outliers.csv").read_text().count("\n") == 6  # header + 5 runs
    lines = [json.loads(line) for line in (tmp_path / "stress.jsonl").read_text().splitlines()]
    losses = {(r["run"], r["iteration"]): r["lm_loss"] for r in lines if "lm_loss" in r}
    assert losses[("int8", 1)] != losses[("bf16", 1)] != losses[("bf16_seed2", 1)] and len(losses) == 40
    assert not any(r["run"] == "bf16_seed2" for r in lines if "int8_health" in r)  # BF16: no probes
    checks = {(r["run"], r["iteration"]): r["int8_health"] for r in lines if "int8_health" in r}
    fc2 = "layer2.mlp.linear_fc2"  # injected layers: all; the last check, outliers at 1000x
    assert checks[("int8", 8)][fc2]["fprop/rel_err"] > 0.1 > checks[("int8", 1)][fc2]["fprop/rel_err"]
    assert checks[("guard", 8)][fc2]["fprop/rel_err"] < 0.05
    int8_row = next(line for line in table if line.startswith("| int8 |"))
    assert "mlp.linear_fc" in int8_row  # the first health flag names an injected MLP
    assert {r["run"] for r in lines if "int8_fallback" in r} == {"fallback"}
    # the log alone gives the same table back (health flags recomputed from the recorded checks)
    assert stress_outliers.main(["--summarize", str(tmp_path / "stress.jsonl"),
                                 "--output-dir", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "table.md").read_text() == (tmp_path / "table.md").read_text()
