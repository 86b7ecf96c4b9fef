"""Automatic per-GEMM fallback (megatron_int8.training.health.AutoFallback): decisions on crafted sequences of
statistics, and its state through a checkpoint's common state (torch.save / torch.load) and a resumed run."""
import io
import math

import pytest
import torch

from megatron_int8.training.health import (AutoFallback, FallbackThresholds, safer_mode, scalars, summarize)

ROW = {"granularity": "row", "fprop": True, "dgrad": True, "wgrad": True}
GOOD = {"fprop/rel_err": 0.02, "fprop/underflow": 0.01, "dgrad/rel_err": 0.03, "dgrad/underflow": 0.05,
        "wgrad/rel_err": 0.02, "wgrad/underflow": 0.1}


def with_(**changes):
    return {**GOOD, **{k.replace("__", "/"): v for k, v in changes.items()}}


def run(fallback, sequence, name="layer2.mlp.linear_fc2", built=ROW, start=100, step=100):
    events = []
    for i, values in enumerate(sequence):
        events += fallback.check(start + i * step, name, built, values)
    return events


def test_each_gemm_has_its_own_error_limit():
    """The default limits (fprop 0.1, dgrad 0.1, wgrad 1.0): a wgrad error of 0.4, which a healthy run showed,
    never moves; the same error in dgrad does."""
    fallback = AutoFallback(FallbackThresholds(patience=2))
    assert run(fallback, [with_(wgrad__rel_err=0.4)] * 5) == []
    assert [e["gemm"] for e in run(fallback, [with_(dgrad__rel_err=0.4)] * 2, start=600)] == ["dgrad"]
    assert FallbackThresholds().crossed("wgrad", with_(wgrad__rel_err=1.5, wgrad__underflow=0.95)) == [
        "rel_err 1.5 > 1", "underflow 0.95 > 0.9"]


def test_healthy_statistics_never_move():
    fallback = AutoFallback(FallbackThresholds(patience=2))
    assert run(fallback, [GOOD] * 50) == [] and fallback.moved == {}


def test_patience_counts_consecutive_checks_only():
    """Over the error threshold twice, healthy once, twice again: no move with patience 3; a third
    consecutive crossing moves fprop (row scales) to high precision, at that check, with the reason."""
    fallback = AutoFallback(FallbackThresholds(max_rel_err=0.1, patience=3))
    bad = with_(fprop__rel_err=0.25)
    assert run(fallback, [bad, bad, GOOD, bad, bad]) == []
    (event,) = run(fallback, [bad], start=600)
    assert event["iteration"] == 600 and event["gemm"] == "fprop" and event["change"] == "fprop -> high precision"
    assert "rel_err 0.25 > 0.1" in event["reason"] and "3 consecutive" in event["reason"]
    assert fallback.mode_of("layer2.mlp.linear_fc2", ROW) == {**ROW, "fprop": False}


def test_finer_scales_then_high_precision_for_that_gemm_only():
    """tensor -> row scales for the linear, then the GEMM that still fails goes to high precision; the other
    GEMMs stay INT8, a high-precision GEMM is no longer watched, and block scales go straight to it."""
    fallback = AutoFallback(FallbackThresholds(max_underflow=0.5, patience=2))  # 0.7 by default
    built = {**ROW, "granularity": "tensor"}
    bad = with_(dgrad__underflow=0.9)
    events = run(fallback, [bad] * 4, built=built)
    assert [e["change"] for e in events] == ["scales tensor -> row", "dgrad -> high precision"]
    assert all("underflow 0.9 > 0.5" in e["reason"] for e in events)
    assert fallback.mode_of("layer2.mlp.linear_fc2", built) == {"granularity": "row", "fprop": True,
                                                                 "dgrad": False, "wgrad": True}
    assert run(fallback, [bad] * 10, built=built) == []
    block = {**ROW, "granularity": "block"}
    assert safer_mode(block, "wgrad") == ({**block, "wgrad": False}, "wgrad -> high precision")


def test_a_move_restarts_every_streak_of_that_linear():
    """wgrad was two checks into its streak when fprop moved the linear: wgrad needs three new crossings."""
    fallback = AutoFallback(FallbackThresholds(patience=3))
    both = with_(fprop__rel_err=0.5, wgrad__rel_err=1.5)
    assert run(fallback, [with_(fprop__rel_err=0.5)] + [both] * 2) == [
        {"iteration": 300, "linear": "layer2.mlp.linear_fc2", "gemm": "fprop", "change": "fprop -> high precision",
         "reason": "rel_err 0.5 > 0.1 on 3 consecutive checks"}]
    assert run(fallback, [with_(wgrad__rel_err=1.5)] * 2, start=400) == []
    assert [e["gemm"] for e in run(fallback, [with_(wgrad__rel_err=1.5)], start=600)] == ["wgrad"]


def test_unmeasured_checks_neither_grow_nor_break_a_streak():
    fallback = AutoFallback(FallbackThresholds(patience=2))
    bad = with_(fprop__rel_err=0.3)
    missing = {k: v for k, v in bad.items() if not k.startswith("fprop")}
    nan = with_(fprop__rel_err=math.nan, fprop__underflow=math.nan)
    assert run(fallback, [bad, missing, nan]) == []
    assert len(run(fallback, [bad], start=400)) == 1


def test_linears_are_independent_and_disabled_fallback_only_watches():
    fallback = AutoFallback(FallbackThresholds(patience=1))
    bad = with_(fprop__rel_err=0.3)
    assert len(run(fallback, [bad], name="layer1.mlp.linear_fc1")) == 1
    assert "layer2.mlp.linear_fc2" not in fallback.moved
    off = AutoFallback(FallbackThresholds(patience=1), enabled=False)
    assert run(off, [bad] * 5) == [] and off.moved == {}


def test_thresholds_are_checked():
    for bad in ({"max_rel_err": 0}, {"max_rel_err": (0.1, 0.2)}, {"max_underflow": 1.5},
                {"max_underflow": (0.5, 0.5, 0)}, {"max_underflow": (0.5, 0.6)}, {"patience": 0}):
        with pytest.raises(ValueError):
            FallbackThresholds(**bad)
    assert FallbackThresholds(max_rel_err=0.3).max_rel_err == (0.3, 0.3, 0.3)
    assert FallbackThresholds(max_rel_err=[0.2]).max_rel_err == (0.2, 0.2, 0.2)
    assert FallbackThresholds(max_underflow=0.5).max_underflow == (0.5, 0.5, 0.5)
    assert safer_mode({**ROW, "fprop": False}, "fprop") is None


def test_wgrad_has_its_own_underflow_limit():
    """wgrad's operands (per channel over the tokens) may underflow more than fprop's and dgrad's before a move:
    0.8 moves dgrad (limit 0.7) but not wgrad (limit 0.9); 0.95 moves wgrad."""
    thresholds = FallbackThresholds()
    assert thresholds.max_underflow == (0.7, 0.7, 0.9)
    assert thresholds.crossed("dgrad", {"dgrad/underflow": 0.8}) == ["underflow 0.8 > 0.7"]
    assert thresholds.crossed("wgrad", {"wgrad/underflow": 0.8}) == []
    assert thresholds.crossed("wgrad", {"wgrad/underflow": 0.95}) == ["underflow 0.95 > 0.9"]
    fallback = AutoFallback(FallbackThresholds(patience=2))
    events = run(fallback, [with_(wgrad__underflow=0.8, dgrad__underflow=0.8)] * 2)
    assert [(e["gemm"], e["change"]) for e in events] == [("dgrad", "dgrad -> high precision")]


def test_state_round_trips_through_a_checkpoint_and_continues_identically():
    """The state a checkpoint stores (torch.save of the common dict) gives back the same moves and streaks:
    the resumed controller then decides exactly as the uninterrupted one, also for a streak that the
    checkpoint interrupted."""
    thresholds = FallbackThresholds(patience=3)
    bad, under = with_(dgrad__rel_err=0.4), with_(wgrad__underflow=0.95)
    built = {**ROW, "granularity": "tensor"}
    sequence = [bad] * 3 + [under] * 3 + [bad] * 3
    uninterrupted = AutoFallback(thresholds)
    all_events = run(uninterrupted, sequence, built=built)
    first = AutoFallback(thresholds)
    events = run(first, sequence[:5], built=built)
    buffer = io.BytesIO()
    torch.save({"int8_fallback": first.state_dict()}, buffer)
    buffer.seek(0)
    resumed = AutoFallback(thresholds)
    resumed.load_state_dict(torch.load(buffer, weights_only=True)["int8_fallback"])
    assert resumed.state_dict() == first.state_dict() and resumed.streaks  # a streak was under way
    events += run(resumed, sequence[5:], start=600, built=built)
    assert events == all_events
    assert [(e["iteration"], e["gemm"], e["change"]) for e in events] == [
        (300, "dgrad", "scales tensor -> row"), (600, "wgrad", "wgrad -> high precision"),
        (900, "dgrad", "dgrad -> high precision")]
    assert resumed.state_dict() == uninterrupted.state_dict()
    assert resumed.reset() == ["layer2.mlp.linear_fc2"] and resumed.moved == {} and resumed.streaks == {}
    with pytest.raises(ValueError, match="unexpected mode fields"):
        AutoFallback().load_state_dict({"moved": {"x": {"mode": {"granularity": "row"}, "events": []}}})


def test_summary_and_scalar_names():
    checks = [(200, {"layer1.mlp.linear_fc1": {**GOOD, "x/amax": 3.0},
                     "layer2.mlp.linear_fc2": with_(fprop__rel_err=0.2)})]
    line = summarize(checks)
    assert line.startswith("int8 health (it 200, worst): fprop rel_err 2.00e-01 (layer2.mlp.linear_fc2)")
    names = scalars(checks[0][1])
    assert names["int8_health/layer1.mlp.linear_fc1/x/amax"] == 3.0
    assert names["int8_health/layer2.mlp.linear_fc2/fprop/rel_err"] == 0.2
    assert summarize([]) == ""


def test_plot_health_reads_the_log_as_written(tmp_path):
    """scripts/plot_health.py: health lines by iteration (a resumed run's rewrite wins), other lines ignored,
    fallback events, the PNG; a log without statistics is an error that says why."""
    import json
    import sys

    from repo_paths import SCRIPTS

    sys.path.insert(0, SCRIPTS)
    import plot_health

    log = tmp_path / "train_log.jsonl"
    lines = [{"iteration": 1, "lm_loss": 5.0}]
    for it in (10, 20, 30, 20):  # iteration 20 written again by a resumed run
        by_linear = {"layer1.mlp.linear_fc2": with_(fprop__rel_err=0.01 * it), "layer1.mlp.linear_fc1": GOOD}
        lines.append({"iteration": it, "int8_health": scalars(by_linear)})
    lines[-1]["int8_health"]["int8_health/layer1.mlp.linear_fc2/fprop/rel_err"] = 0.5
    lines.append({"iteration": 30, "int8_fallback": {"iteration": 30, "linear": "layer1.mlp.linear_fc2",
                                                      "gemm": "fprop", "change": "fprop -> high precision",
                                                      "reason": "r"}})
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    series, events = plot_health.read_health(str(log))
    assert series["layer1.mlp.linear_fc2"]["fprop/rel_err"] == [(10, 0.1), (20, 0.5), (30, pytest.approx(0.3))]
    import gzip  # a kept log (benchmarks/results/*.jsonl.gz) reads the same

    with gzip.open(tmp_path / "train_log.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(log.read_text())
    assert plot_health.read_health(str(tmp_path / "train_log.jsonl.gz")) == (series, events)
    assert plot_health.worst_linears(series, "fprop/rel_err", 1) == ["layer1.mlp.linear_fc2"]
    assert [e["gemm"] for e in events] == ["fprop"]
    assert plot_health.main([str(log), "--output", str(tmp_path / "h.png")]) == 0
    assert (tmp_path / "h.png").stat().st_size > 10_000
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"iteration": 1, "lm_loss": 5.0}) + "\n")
    assert plot_health.main([str(empty), "--output", str(tmp_path / "e.png")]) == 1
    # only an INT8 attention's statistics: every linear-statistic panel says it has no records, without a warning
    attention = tmp_path / "attention.jsonl"
    attention.write_text(json.dumps({"iteration": 10, "int8_health": {
        "int8_health/layer1.self_attention.core_attention/qk/rel_err": 0.007}}) + "\n")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_health.main([str(attention), "--output", str(tmp_path / "a.png")]) == 0


def test_plot_health_names_bad_input_before_it_draws(tmp_path, capsys):
    """Each of these was a traceback (or, --top -1, a PNG without lines): one line names the input now, the file and
    line of a bad record."""
    import json
    import sys

    from repo_paths import SCRIPTS

    sys.path.insert(0, SCRIPTS)
    import plot_health

    log = tmp_path / "train_log.jsonl"
    good = {"iteration": 10, "int8_health": scalars({"layer1.mlp.linear_fc1": GOOD})}
    log.write_text(json.dumps(good) + "\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    png = str(tmp_path / "h.png")
    for argv, expected in (([str(log), "--output", png, "--top", "-1"], "--top must be at least 1"),
                           ([str(log), "--output", png, "--linears", "["],
                            "--linears '[': not a regular expression (unterminated character set"),
                           ([str(log), "--output", str(a_file / "h.png")], f"--output {a_file / 'h.png'}: {a_file} "
                                                                            "is a file, not a folder")):
        with pytest.raises(SystemExit) as exit_info:
            plot_health.main(argv)
        assert exit_info.value.code == 2 and expected in capsys.readouterr().err
    fallback = {"iteration": 10, "int8_fallback": {"iteration": 10, "gemm": "fprop"}}
    for name, line, expected in (("not_json", "{oops", "not JSON"),
                                 ("a_list", "[10]", "a JSON list, not a record"),
                                 ("no_iteration", json.dumps({"int8_health": good["int8_health"]}),
                                  "a health record without 'iteration'"),
                                 ("no_linear", json.dumps(fallback), "a health record without 'linear'")):
        bad = tmp_path / f"{name}.jsonl"
        bad.write_text(json.dumps(good) + "\n" + line + "\n")
        assert plot_health.main([str(bad), "--output", png]) == 1
        assert capsys.readouterr().err.startswith(f"error: {bad}:2: {expected}")
    assert plot_health.main([str(tmp_path / "missing.jsonl"), "--output", png]) == 1
    assert "No such file or directory" in capsys.readouterr().err and not (tmp_path / "h.png").exists()
    assert plot_health.main([str(log), "--output", str(tmp_path / "new" / "h.png")]) == 0  # its folder is made


def test_a_restored_move_never_brings_back_what_this_runs_flags_turned_off():
    """A move saved by a tensorwise run (tensor -> row scales, then wgrad -> high precision) resumed under other
    flags: on the mode it was made from it is the move; on a block-scale run with BF16 dgrad it keeps the block
    scales and dgrad in high precision, and takes the move's wgrad."""
    from megatron_int8.training.health import on_built_mode

    tensor = {"granularity": "tensor", "fprop": True, "dgrad": True, "wgrad": True}
    moved = {"granularity": "row", "fprop": True, "dgrad": True, "wgrad": False}
    assert on_built_mode(tensor, moved) == moved
    assert on_built_mode(ROW, moved) == {**ROW, "wgrad": False}
    block_bf16_dgrad = {"granularity": "block", "fprop": True, "dgrad": False, "wgrad": True}
    assert on_built_mode(block_bf16_dgrad, moved) == {"granularity": "block", "fprop": True, "dgrad": False,
                                                      "wgrad": False}


def test_after_load_answers_alike_on_every_pipeline_stage():
    """The caller prints the precision table after a load, a collective over the pipeline stages: whether it does
    must not depend on which linears a stage holds (a stage without a moved linear skipped it and the others
    waited forever)."""
    from types import SimpleNamespace

    from megatron_int8.recipe import Int8Recipe
    from megatron_int8.training.health import RunHealth

    fallback = AutoFallback(FallbackThresholds(patience=1))
    run(fallback, [with_(dgrad__rel_err=0.4)], name="layer2.mlp.linear_fc2")
    assert "layer2.mlp.linear_fc2" in fallback.moved
    answers = []
    for local in ("layer1.mlp.linear_fc2", "layer2.mlp.linear_fc2"):  # stage 0, stage 1
        linear = SimpleNamespace(int8_built_recipe=Int8Recipe(), int8_recipe=Int8Recipe())
        health = RunHealth.__new__(RunHealth)
        health.fallback, health.linears, health.attentions, health.reset_on_load = fallback, {local: linear}, {}, False
        answers.append(health.after_load(lambda message: None))
        assert (linear.int8_recipe != Int8Recipe()) == (local == "layer2.mlp.linear_fc2")
    assert answers == [True, True]


def test_expert_moves_follow_their_experts_to_another_expert_parallel_size():
    """Expert linears are named by local slot, and slot i holds expert r * E / ep + i on rank r. With 4 experts,
    slot 1 under EP 2 is experts 1 and 3, which under EP 1 are slots 1 and 3; under EP 2 again, EP 1's experts 0
    (wgrad moved) and 2 (fprop moved) share slot 0, which takes both moves. Other linears and their streaks stay."""
    def slot(i):
        return f"layer1.mlp.experts.local_experts.{i}.linear_fc1"

    fallback = AutoFallback(FallbackThresholds(patience=1))
    run(fallback, [with_(fprop__rel_err=0.4)], name=slot(1))
    run(fallback, [with_(dgrad__rel_err=0.4)], name="layer1.self_attention.linear_qkv")
    run(fallback, [with_(wgrad__underflow=0.1)], name="layer1.self_attention.linear_proj")  # a streak, no move
    fallback.streaks[f"{slot(0)}/wgrad"] = 1
    state = fallback.state_dict()
    assert fallback.regroup_experts(4, 2, 2) == [] and fallback.state_dict() == state  # same size: unchanged
    assert fallback.regroup_experts(4, 2, 1) == [slot(1), slot(3)]
    assert fallback.moved[slot(3)] == fallback.moved[slot(1)] == state["moved"][slot(1)]
    assert "layer1.self_attention.linear_qkv" in fallback.moved and slot(0) not in fallback.moved
    assert f"{slot(0)}/wgrad" not in fallback.streaks and fallback.streaks  # expert streaks start over

    ep1 = AutoFallback(FallbackThresholds(patience=1))
    run(ep1, [with_(wgrad__rel_err=4.0)], name=slot(0))
    run(ep1, [with_(fprop__rel_err=0.4)], name=slot(2))
    assert ep1.regroup_experts(4, 1, 2) == [slot(0)]
    assert ep1.moved[slot(0)]["mode"] == {**ROW, "fprop": False, "wgrad": False}
    assert [e["gemm"] for e in ep1.moved[slot(0)]["events"]] == ["wgrad", "fprop"]


def test_a_restored_move_is_reported_and_watched_in_the_mode_it_runs():
    """A tensorwise run's move (tensor -> row) resumed on a block-scale run with BF16 wgrad runs block scales and
    wgrad in high precision: the log line says so, and the next move starts from that mode."""
    from types import SimpleNamespace

    from megatron_int8.recipe import Int8Recipe
    from megatron_int8.training.health import RunHealth

    name = "layer1.mlp.linear_fc2"
    saved = AutoFallback(FallbackThresholds(patience=1))
    run(saved, [with_(fprop__rel_err=0.4)], name=name, built={**ROW, "granularity": "tensor"})
    assert saved.moved[name]["mode"] == ROW  # tensor -> row
    fallback = AutoFallback(FallbackThresholds(patience=1))
    fallback.load_state_dict(saved.state_dict())
    built = Int8Recipe(granularity="block", wgrad=False)
    linear = SimpleNamespace(int8_built_recipe=built, int8_recipe=built)
    health = RunHealth.__new__(RunHealth)
    health.fallback, health.linears, health.attentions, health.reset_on_load = fallback, {name: linear}, {}, False
    lines = []
    health.after_load(lines.append)
    assert any(f"{name} runs block scales, fprop/dgrad/wgrad:hp" in line for line in lines), lines
    block = {"granularity": "block", "fprop": True, "dgrad": True, "wgrad": False}
    assert fallback.mode_of(name, block) == block
    (event,) = run(fallback, [with_(dgrad__rel_err=0.4)], name=name, built=block)
    assert event["change"] == "dgrad -> high precision"
    assert fallback.moved[name]["mode"] == {**block, "dgrad": False}


def test_a_step_that_misses_a_unit_leaves_its_own_check_empty():
    """Statistics every step: an MoE expert that gets no tokens at step 1 and is measured at step 2 files its values
    under step 2 (they were filed under step 1, and step 2 showed nothing)."""
    from types import SimpleNamespace

    from megatron_int8.recipe import Int8Recipe
    from megatron_int8.training.health import HealthMonitor

    name = "layer1.mlp.experts.local_experts.0.linear_fc1"
    monitor = HealthMonitor({name: SimpleNamespace(int8_built_recipe=Int8Recipe())}, interval=1,
                            fallback=AutoFallback())
    probe = monitor.probes[name]
    torch.manual_seed(0)
    x, w = torch.randn(64, 32), torch.randn(48, 32)
    monitor.before_step(1)  # not reached
    monitor.before_step(2)
    probe.observe_forward(x, w, Int8Recipe()).observe_backward(torch.randn(64, 48), w)
    monitor.before_step(3)  # not reached
    checks = monitor.collect()
    assert [it for it, _ in checks] == [1, 2, 3]
    assert [bool(by_linear[name]) for _, by_linear in checks] == [False, True, False]
    assert checks[1][1][name]["fprop/rel_err"] > 0
