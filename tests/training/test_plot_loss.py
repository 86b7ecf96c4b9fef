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


def test_a_log_cut_short_reads_up_to_its_last_whole_line_and_resumes(tmp_path):
    """A kill in the middle of writing a record (a health record spans many KB) leaves a last line without its
    end: the plots read up to it, a resumed run sets it aside with the iterations it redoes, and a bad line
    elsewhere is an error naming it."""
    from types import SimpleNamespace

    from megatron_int8.training.metrics import TrainingLogger

    plot_loss = _plot_loss()
    path = tmp_path / "train_log.jsonl"
    _write_log(path, [3.0, 2.5, 2.0, 1.5], {})
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"iteration": 5, "lm_loss": 1.25, "int8_health": {"x": 1.0}})[:30])
    assert plot_loss.read_series(str(path), "lm_loss")[0] == {1: 3.0, 2: 2.5, 3: 2.0, 4: 1.5}
    printed = []
    logger = SimpleNamespace(print=printed.append)
    TrainingLogger._open_jsonl(logger, str(path), 3)
    logger.jsonl.close()
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [1, 2, 3]
    aside = (tmp_path / "train_log.jsonl.after-3").read_text().splitlines()
    assert json.loads(aside[0])["iteration"] == 4 and aside[1].startswith('{"iteration": 5') and len(aside) == 2
    assert printed == [f"note: 2 line(s) of {path} after iteration 3 moved to {path}.after-3"]
    # interrupted again after the same checkpoint: the first interruption's lines stay where they were set aside
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"iteration": 4, "lm_loss": 1.75}) + "\n")
    logger = SimpleNamespace(print=printed.append)
    TrainingLogger._open_jsonl(logger, str(path), 3)
    logger.jsonl.close()
    aside = (tmp_path / "train_log.jsonl.after-3").read_text().splitlines()
    assert [json.loads(line)["lm_loss"] for line in (aside[0], aside[2])] == [1.5, 1.75] and len(aside) == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"iteration": 1, "lm_loss": 2.0}\n{oops\n{"iteration": 2, "lm_loss": 1.0}\n')
    with pytest.raises(ValueError, match=f"{bad}:2: not JSON"):
        plot_loss.read_series(str(bad), "lm_loss")


def test_output_paths_are_checked_before_the_logs_are_read(tmp_path, capsys):
    """A --summary that cannot be written was a traceback after the PNG was written; a missing folder is made for
    it, as for --output."""
    _write_log(tmp_path / "a.jsonl", [3.0, 2.0], {})
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for flag, path, expected in (("--summary", a_file / "s.md", f"--summary {a_file / 's.md'}: {a_file} is a file"),
                                 ("--summary", a_file / "x" / "s.md", f"--summary {a_file / 'x' / 's.md'}: cannot "
                                                                      f"make its folder {a_file / 'x'} (Not a "),
                                 ("--output", tmp_path, f"--output {tmp_path} is a folder: give a file name")):
        argv = [str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "p.png"), "--summary", str(tmp_path / "s.md")]
        argv[argv.index(flag) + 1] = str(path)
        with pytest.raises(SystemExit) as exit_info:
            _plot_loss().main(argv)
        assert exit_info.value.code == 2 and expected in capsys.readouterr().err
        assert not (tmp_path / "p.png").exists()
    summary = tmp_path / "new" / "folder" / "s.md"
    assert _plot_loss().main([str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "p.png"), "--summary",
                              str(summary)]) == 0
    assert summary.read_text().startswith("| run |")


def test_a_reference_loss_of_0_has_no_relative_gap(tmp_path):
    """Once a ZeroDivisionError: a gap relative to a loss of 0 has no scale."""
    _write_log(tmp_path / "a.jsonl", [0.0] * 20, {20: 0.0})
    _write_log(tmp_path / "b.jsonl", [0.5] * 20, {20: 0.25})
    summary = tmp_path / "s.md"
    assert _plot_loss().main([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--labels", "ref", "other",
                              "--output", str(tmp_path / "p.png"), "--summary", str(summary)]) == 0
    text = summary.read_text()
    assert "| other | 20 | 0.5000 | n/a (reference 0) | 0.2500 | n/a (reference 0) |" in text
    assert "| other | " + " | ".join(["n/a (reference 0)"] * 10) + " |" in text


@pytest.mark.parametrize("reference_iterations, other_iterations", [(1000, 500), (500, 1000), (1000, 600)])
def test_runs_of_different_lengths_are_compared_where_both_reached(tmp_path, reference_iterations, other_iterations):
    """Two runs of one curve, one stopped early: each run's own last 100 iterations were compared (a run ahead sits
    lower on the curve), a +70% gap between identical runs; so was each run's own last validation loss."""
    curve = [1.5 + 1.5 * 0.995 ** i for i in range(1, 1001)]
    valid = {i: curve[i - 1] + 0.1 for i in (250, 500, 750, 1000)}
    _write_log(tmp_path / "a.jsonl", curve[:reference_iterations], valid)
    _write_log(tmp_path / "b.jsonl", curve[:other_iterations], valid)
    summary = tmp_path / "s.md"
    assert _plot_loss().main([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--labels", "ref", "int8",
                              "--output", str(tmp_path / "p.png"), "--summary", str(summary)]) == 0
    text = summary.read_text()
    common = min(reference_iterations, other_iterations)
    evaluated = max(i for i in valid if i <= common)  # the last evaluation of both, not the final one of both
    assert f"| ref | {reference_iterations} | {sum(curve[reference_iterations - 100:reference_iterations]) / 100:.4f} " \
           f"| +0.00% | {valid[reference_iterations]:.4f} | +0.00% |" in text, text
    assert f"| int8 | {other_iterations} (compared at {common}) | {sum(curve[common - 100:common]) / 100:.4f} | " \
           f"+0.00% | {valid[evaluated]:.4f} (at {evaluated}) | +0.00% |" in text, text
    assert "A run that ends at another iteration than ref is compared with it at the last iteration both reached" \
        in text


def test_output_names_the_file_written_and_a_format_matplotlib_cannot_write_is_refused_first(tmp_path, capsys):
    """--output loss said "wrote loss" of the loss.png that matplotlib wrote; --output loss.txt was a matplotlib
    traceback after the logs were read."""
    _write_log(tmp_path / "a.jsonl", [3.0, 2.0], {})
    assert _plot_loss().main([str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "loss")]) == 0
    assert f"wrote {tmp_path / 'loss.png'}\n" in capsys.readouterr().out and (tmp_path / "loss.png").is_file()
    with pytest.raises(SystemExit) as exit_info:  # a log that does not exist: refused before it is read
        _plot_loss().main([str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "loss.txt")])
    assert exit_info.value.code == 2
    assert f"--output {tmp_path / 'loss.txt'}: matplotlib cannot write .txt files: end the name in .png, or " \
        "another of its formats (" in capsys.readouterr().err and not (tmp_path / "loss.txt").exists()
