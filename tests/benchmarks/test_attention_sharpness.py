"""benchmarks/attention_sharpness.py at small size on CPU: sharper attention (a larger temperature) has lower row
entropy and a larger row maximum; the INT8 attention's output error grows with it, stays above BF16 SDPA's and
within the band the forward's quantization steps allow, and the INT8 scores alone account for part of it. Scores
from Q and K rounded here per token and all d channels give the op's own scores' error; finer groups give less; a
second INT8 term for the residuals, or BF16 scores, leave P V's part."""
import math
import sys

import pytest
from repo_paths import BENCHMARKS


def _sharpness():
    sys.path.insert(0, BENCHMARKS)
    import attention_sharpness

    return attention_sharpness


def test_table_rows_follow_the_temperature(capsys):
    rows = _sharpness().main(["--seq", "256", "--heads", "2", "--dim", "64", "--temperatures", "0.5", "6",
                              "--seed", "3"])
    out = capsys.readouterr().out
    assert "| temperature | row entropy (nats) | row max of P | INT8 | INT8 scores, exact P V | BF16 SDPA |" in out
    (_, ent_lo, max_lo, int8_lo, scores_lo, bf16_lo), (_, ent_hi, max_hi, int8_hi, scores_hi, bf16_hi) = rows
    assert ent_hi < ent_lo <= math.log(256) and max_lo < max_hi <= 1
    for int8, scores, bf16 in ((int8_lo, scores_lo, bf16_lo), (int8_hi, scores_hi, bf16_hi)):
        # BF16 rounds each element to 8 significant bits, INT8 a token or block to 255 levels: BF16 < INT8; 0.1 is
        # the health limit (--int8-fallback-max-attention-rel-err), which such inputs stay well below
        assert 0 < bf16 < int8 < 0.1 and 0 < scores <= int8 * 1.5
    assert int8_hi > int8_lo and scores_hi > scores_lo  # the same relative score error costs more when sharp
    assert f"| 6 | {ent_hi:.2f} | {max_hi:.3f} | {int8_hi:.4f} |" in out


def test_score_groups_of_all_channels_are_the_ops_scores(capsys):
    rows = _sharpness().main(["--seq", "256", "--heads", "2", "--dim", "64", "--temperatures", "1", "6",
                              "--score-groups", "64", "16", "--seed", "4"])
    header = "| INT8 scores per 64 channels, exact P V | INT8 scores per 16 channels, exact P V |"
    assert header in capsys.readouterr().out
    for row in rows:
        scores, whole, groups_of_16 = row[4], row[6], row[7]
        assert whole == pytest.approx(scores, rel=1e-3)  # the op's per-token scales, rounded independently here
        assert groups_of_16 < whole


def test_more_score_bits_remove_the_scores_part(capsys):
    rows = _sharpness().main(["--seq", "256", "--heads", "2", "--dim", "64", "--temperatures", "1", "8",
                              "--more-score-bits", "--seed", "5"])
    header = "| two-term INT8 scores, exact P V | two-term INT8 scores, INT8 P V | BF16 scores, INT8 P V |"
    assert header in capsys.readouterr().out
    for _, _, _, int8, scores, bf16_sdpa, two_terms, two_terms_int8_pv, bf16_scores_int8_pv in rows:
        # the residual term rounds each score's INT8 error to 1/127 of itself: a 20x margin on that
        assert 0 < two_terms < scores / 20
        assert two_terms_int8_pv < int8 and bf16_scores_int8_pv < int8  # the scores' part is gone, P V's stays
    diffuse, sharp = rows
    # diffuse rows: P V's fixed steps of 1/127 are coarse for many small p, and its error stays well above BF16's
    assert diffuse[7] > 2 * diffuse[5] and diffuse[8] > 2 * diffuse[5]
    # sharp rows: more score bits cut INT8's error by more than half, to within 2x of BF16 SDPA's
    for remedy in sharp[7], sharp[8]:
        assert remedy < sharp[3] / 2 and remedy < 2 * sharp[5]


@pytest.mark.parametrize("argv", [["--temperatures", "0"], ["--dim", "64", "--score-groups", "48"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        _sharpness().main(argv)
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--seq", "--heads", "--dim"])
def test_a_zero_size_is_a_usage_error(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _sharpness().main([flag, "0"])
    assert exit_info.value.code == 2 and f"argument {flag}: must be an integer >= 1, got 0" in capsys.readouterr().err
