"""benchmarks/bench_attention.py's usage errors, found before any timing."""
import pytest

import bench_attention


@pytest.mark.parametrize("where, said", [("nope/x.csv", "no directory"), (".", "is not a writable file")])
def test_a_csv_that_cannot_be_written_is_refused_before_the_timings(monkeypatch, tmp_path, capsys, where, said):
    monkeypatch.setattr(bench_attention, "time_impl", lambda *a: pytest.fail("timed"))
    with pytest.raises(SystemExit) as exit_info:
        bench_attention.main(["--csv", str(tmp_path / where)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "argument --csv: " in err and said in err
