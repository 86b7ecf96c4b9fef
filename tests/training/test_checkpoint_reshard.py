"""Distributed-optimizer checkpoints across tensor-parallel sizes (issue #7), on CPU (gloo).

INT8 at TP=2 + sequence parallelism with --use-distributed-optimizer saves; TP=1 resumes it with its
Adam state (exp_avg, exp_avg_sq, step), and TP=2 resumes TP=1's checkpoint in turn. The trainer saves
the optimizer in megatron's fully_reshardable format (model space) for that; the checks of what a
load refuses (the DP-only dp_reshardable format at another layout) need no training."""
import os
import shutil

import pytest
import torch
from test_training import data, losses, train  # noqa: F401  (`data` is the module's fixture)

from megatron_int8.training.checkpoint import check_optimizer_loadable, checkpoint_dir, saved_distopt_format

COMMON = ["--int8-linear", "--use-distributed-optimizer", "--train-iters", "6", "--micro-batch-size", "2",
          "--global-batch-size", "4", "--eval-interval", "100"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
# Loss tolerance of a resume at another TP size: the one test_training.py's PP=2 -> TP=2 resume uses.
# On CPU the initial weights do not depend on TP, so TP only moves the INT8 noise (each TP shard has its
# own row scales) and the reduction order: measured, the resumed losses are within 1e-4 of the TP=2
# run, an uninterrupted TP=1 run within 2e-4; a resume that loads the weights only (fresh Adam state
# and LR schedule) is 4e-2 off at iteration 5, its first loss after an update. Training moves the loss
# by ~0.17 over iterations 3-6.
LOSS_TOLERANCE = 1e-3
# Adam state of a whole run vs a resumed one, relative (norm of the difference / norm): measured 7e-3
# after a TP=2 -> TP=1 resume (1e-2 for an uninterrupted TP=1 run), 0.57-0.72 for a weights-only resume.
STATE_TOLERANCE = 5e-2


def _stopped_at(src, dst, iteration):
    """A copy of the checkpoints under `src` as if its run had stopped after saving `iteration`."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("train_log.jsonl"))
    for name in os.listdir(dst):
        if name.startswith("iter_") and int(name[5:]) > iteration:
            shutil.rmtree(dst / name)
    (dst / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return dst


def _adam_state(root, iteration):
    """exp_avg and exp_avg_sq of every parameter, at its global shape (the fully_reshardable layout)."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    directory = checkpoint_dir(str(root), iteration)
    dcp_to_torch_save(directory, str(root / f"state_{iteration}.pt"))  # one process, no process group
    state = torch.load(root / f"state_{iteration}.pt")
    # megatron-core 0.16 writes the common state to common.pt, 0.19 into the shards: its reader takes both
    common = dist_checkpointing.load_common_state_dict(directory)
    assert common["distopt_sharding_type"] == "fully_reshardable", common.keys()
    adam = {k: v for k, v in state.items() if k.startswith(("optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq."))}
    return adam, common["adam_steps"]


def _assert_same_adam_state(resumed, reference):
    (state, steps), (expected, expected_steps) = resumed, reference
    assert steps == expected_steps and len(state) == len(expected) >= 18, (steps, expected_steps, sorted(state))
    for key, value in expected.items():
        assert state[key].shape == value.shape, key
        error = float((state[key] - value).norm() / value.norm())
        assert error < STATE_TOLERANCE, (key, error)


@pytest.mark.slow
@pytest.mark.timeout(300)  # ~1 min on 2 cores; each run has _run's 300 s limit too
def test_distributed_optimizer_checkpoint_resumes_at_another_tensor_parallel_size(data, tmp_path):  # noqa: F811
    """TP=2 + SP runs 6 iterations (the reference), saving at 3 and 6; TP=1 resumes its iteration 3 and
    runs 4-6 (saving each); TP=2 + SP resumes TP=1's iteration 5 and runs 6. All with DP=1: the same
    global batch reads the same samples in the same order."""
    whole = tmp_path / "whole"
    out = train(data, *COMMON, *TP2, "--save", str(whole), "--save-interval", "3", nproc=2)
    assert "TP 2, PP 1, DP 1" in out and " int8 int8[" in out

    tp1 = _stopped_at(whole, tmp_path / "tp1", 3)
    out = train(data, *COMMON, "--save", str(tp1), "--load", str(tp1), "--save-interval", "1")
    assert "TP 1, PP 1, DP 1" in out and "(iteration 3," in out
    assert "optimizer state: distributed optimizer, fully_reshardable format, Adam steps [3.0]" in out

    back = _stopped_at(tp1, tmp_path / "back", 5)
    out = train(data, *COMMON, *TP2, "--save", str(back), "--load", str(back), nproc=2)
    assert "TP 2, PP 1, DP 1" in out and "(iteration 5," in out
    assert "optimizer state: distributed optimizer, fully_reshardable format, Adam steps [5.0]" in out

    expected, at_tp1, at_tp2 = (losses(d / "train_log.jsonl") for d in (whole, tp1, back))
    assert sorted(at_tp1) == [4, 5, 6] and sorted(at_tp2) == [6], (at_tp1, at_tp2)
    assert all(abs(at_tp1[i] - expected[i]) < LOSS_TOLERANCE for i in (4, 5, 6)), (at_tp1, expected)
    assert abs(at_tp2[6] - expected[6]) < LOSS_TOLERANCE, (at_tp2, expected)
    assert expected[3] - expected[6] > 0.1, expected  # the tolerance is finer than the training progress
    # The Adam state went through both loads: after 3 more steps at TP=1 (exp_avg keeps 0.9^3 of what
    # was loaded, exp_avg_sq 0.95^3), and after TP=1 -> TP=2, it is the uninterrupted run's.
    reference = _adam_state(whole, 6)
    _assert_same_adam_state(_adam_state(tp1, 6), reference)
    _assert_same_adam_state(_adam_state(back, 6), reference)


LAYOUT = {"tp": 2, "pp": 1, "ep": 1, "etp": 1, "cp": 1, "model_chunks": 1, "dp": 1}


def test_saved_format_is_read_from_the_checkpoint():
    assert saved_distopt_format({"distopt_sharding_type": "fully_reshardable"}) == "fully_reshardable"
    assert saved_distopt_format({"distopt_sharding_type": None, "optimizer": {}}) is None
    # before the trainer recorded it: megatron's own record in the optimizer's common state
    assert saved_distopt_format({"optimizer": {"param_state_sharding_type": "dp_reshardable"}}) == "dp_reshardable"
    assert saved_distopt_format({"optimizer": {0: {"param_state_sharding_type": "dp_reshardable"},
                                               1: {"param_state_sharding_type": "dp_reshardable"}}}) == "dp_reshardable"
    assert saved_distopt_format({"optimizer": {"optimizer": {"state": {}, "param_groups": []}}}) is None


def _check(saved, common, *, distributed=True, optimizers=1, **layout):
    check_optimizer_loadable(saved, common, distributed=distributed, layout={**LAYOUT, **layout},
                             optimizers=optimizers, directory="ckpt")


def test_a_load_that_cannot_take_the_optimizer_state_fails_naming_the_way_out():
    fully = {"distopt_sharding_type": "fully_reshardable", "parallel_layout": LAYOUT}
    dp = {"distopt_sharding_type": "dp_reshardable", "parallel_layout": LAYOUT}
    _check("fully_reshardable", fully, tp=1, etp=1, pp=2, dp=4)
    _check("dp_reshardable", dp, dp=4)
    with pytest.raises(RuntimeError, match=r"dp_reshardable format.*\(tp 2 -> 1\).*--no-load-optim"):
        _check("dp_reshardable", dp, tp=1)
    with pytest.raises(RuntimeError, match="saved with --use-distributed-optimizer and this run is without.*--no-load"):
        _check("fully_reshardable", fully, distributed=False)
    with pytest.raises(RuntimeError, match="saved without --use-distributed-optimizer and this run is with.*--no-load"):
        _check(None, {})
    # EP 2 -> 1: megatron's chain of a dense and an expert optimizer becomes one optimizer
    chained = {**fully, "optimizer": {0: {"param_state_sharding_type": "fully_reshardable"},
                                      1: {"param_state_sharding_type": "fully_reshardable"}}}
    with pytest.raises(RuntimeError, match=r"split over 2 optimizer\(s\) and this run has 1.*--no-load-optim"):
        _check("fully_reshardable", chained, ep=1)
    with pytest.raises(RuntimeError, match="'fully_sharded_model_space' is not one this trainer reads"):
        _check("fully_sharded_model_space", {})


def test_rng_states_follow_the_rank_only_in_the_same_layout(tmp_path, monkeypatch):
    """Rank r's RNG file belongs to rank r's place in the model: restored only where the world size and the parallel
    layout are the checkpoint's (TP 1 x DP 2 -> TP 2 x DP 1 once gave both TP ranks one model-parallel RNG state,
    silently); a missing or unreadable file of that rank is named with the way out."""
    from megatron_int8.training import checkpoint as ckpt

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(ckpt, "_rank", lambda: 1)
    directory = tmp_path / "iter_0000004"
    (directory / "rng").mkdir(parents=True)
    notes = []
    saved = {**LAYOUT, "tp": 1, "dp": 2}
    assert ckpt._saved_rng_state(str(directory), {"world_size": 2, "parallel_layout": saved}, LAYOUT,
                                 notes.append) is None
    assert ckpt._saved_rng_state(str(directory), {"world_size": 4, "parallel_layout": LAYOUT}, LAYOUT,
                                 notes.append) is None
    assert notes == ["note: checkpoint written with another parallel layout: tp 1 (this run: 2), dp 2 (this run: 1): "
                     "RNG states not restored",
                     "note: checkpoint written with another world size 4 (this run: 2): RNG states not restored"]
    same = {"world_size": 2, "parallel_layout": LAYOUT}
    with pytest.raises(ckpt.CheckpointError, match=r"rank_00001.pt is missing .*--no-load-rng"):
        ckpt._saved_rng_state(str(directory), same, LAYOUT, notes.append)
    state = {"torch": torch.get_rng_state(), "seed": 7}
    torch.save(state, directory / "rng" / "rank_00001.pt")
    loaded = ckpt._saved_rng_state(str(directory), same, LAYOUT, notes.append)
    assert torch.equal(loaded["torch"], state["torch"]) and loaded["seed"] == 7
    os.truncate(directory / "rng" / "rank_00001.pt", 100)
    with pytest.raises(ckpt.CheckpointError, match=r"rank_00001.pt cannot be read \(RuntimeError: .*--no-load-rng"):
        ckpt._saved_rng_state(str(directory), same, LAYOUT, notes.append)
    # a checkpoint from before the layout was recorded: the world size decides, as it did
    assert ckpt._saved_rng_state(str(directory), {"world_size": 3}, LAYOUT, notes.append) is None
