"""scripts/plot_loss.py's summary: the last-window table and the per-tenth training-loss gaps, on logs with known
losses (fresh random noise around them, so a span's mean is what the test derives, not a constant)."""
import gzip
import importlib.util
import json
import os
import random

import pytest
from repo_paths import SCRIPTS

pytest.importorskip("matplotlib")


def _plot_loss():
    spec = importlib.util.spec_from_file_location("plot_loss", os.path.join(SCRIPTS, "plot_loss.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_log(path, losses, valid):
    with open(path, "w", encoding="utf-8") as f:
        for i, loss in enumerate(losses, start=1):
            f.write(json.dumps({"iteration": i, "lm_loss": loss}) + "\n")
            if i in valid:
                f.write(json.dumps({"iteration": i, "valid_lm_loss": valid[i]}) + "\n")


def test_summary_shows_each_tenth_gap(tmp_path):
    rng = random.Random(7)
    n = 200
    base = [3.0 - i / n + rng.uniform(-0.05, 0.05) for i in range(n)]
    # the second run: +1% over the first half, then +3% (a gap that grows at the middle of the run)
    other = [x * (1.01 if i < n // 2 else 1.03) for i, x in enumerate(base)]
    _write_log(tmp_path / "a.jsonl", base, {n: 2.5})
    _write_log(tmp_path / "b.jsonl", other, {n: 2.55})
    summary = tmp_path / "s.md"
    assert _plot_loss().main([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--labels", "ref", "int8",
                              "--output", str(tmp_path / "p.png"), "--summary", str(summary)]) == 0
    text = summary.read_text()
    last = sum(other[-100:]) / sum(base[-100:]) - 1
    gzipped = tmp_path / "b.jsonl.gz"  # a kept log (benchmarks/results/*.jsonl.gz) reads the same
    gzipped.write_bytes(gzip.compress((tmp_path / "b.jsonl").read_bytes()))
    series = _plot_loss().read_series(str(gzipped), "lm_loss", "valid_lm_loss")
    assert series == _plot_loss().read_series(str(tmp_path / "b.jsonl"), "lm_loss", "valid_lm_loss")
    assert series[1] == {n: 2.55} and len(series[0]) == n
    assert f"| int8 | 200 | {sum(other[-100:]) / 100:.4f} | {100 * last:+.2f}% | 2.5500 | +2.00% |" in text
    assert "| run | 1-20 | 21-40 | 41-60 | 61-80 | 81-100 | 101-120 | 121-140 | 141-160 | 161-180 | 181-200 |" in text
    assert "| int8 | " + " | ".join(["+1.00%"] * 5 + ["+3.00%"] * 5) + " |" in text
