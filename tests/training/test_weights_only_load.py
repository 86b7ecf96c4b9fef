"""`--load DIR --no-load-optim` (the weights alone, a fresh optimizer) continues from the loaded weights: the
optimizer's master weights are rebuilt from them, so its first step does not write the initial weights back
(megatron's mixed-precision optimizer and this package's precision-aware one, whose masters megatron leaves
to it)."""
import pytest
from test_checkpoint_reshard import _stopped_at
from test_training import data, losses, train  # noqa: F401  (`data` is the module's fixture)

RUN = ["--bf16", "--int8-linear", "--train-iters", "6", "--micro-batch-size", "2", "--global-batch-size", "4",
       "--lr", "3e-3", "--lr-warmup-iters", "0",
       "--eval-interval", "100", "--save-interval", "3"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimizer", [
    [],  # megatron's Float16OptimizerWithFloat16Params: fp32 main params beside the bf16 ones
    ["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--exp-avg-dtype", "int8",
     "--exp-avg-sq-dtype", "int8"],  # the precision-aware AdamW with fp32 masters of bf16 parameters
], ids=["float16-optimizer", "precision-aware"])
def test_weights_only_load_continues_from_the_loaded_weights(data, tmp_path, optimizer):  # noqa: F811
    whole = tmp_path / "whole"
    train(data, *RUN, *optimizer, "--save", str(whole))
    expected = losses(whole / "train_log.jsonl")
    assert expected[1] - expected[4] > 0.1, expected  # training moved the loss: a revert would show
    weights = _stopped_at(whole, tmp_path / "weights", 3)
    out = train(data, *RUN, *optimizer, "--save", str(weights), "--load", str(weights), "--no-load-optim")
    assert "loaded checkpoint" in out
    got = losses(weights / "train_log.jsonl")
    # iteration 4 runs the loaded weights before any step, as the whole run did. From there a fresh Adam state
    # keeps lowering the loss; the initial weights written back by the first step would raise it toward
    # iteration 1's (measured without the reload, 2026-11-27: iterations 5 and 6 at 6.229 and 6.055 after 6.032)
    assert got[4] == expected[4], (got, expected)
    assert got[5] < got[4] and got[6] < got[5], (got, expected)
    # the schedule goes on from the checkpoint's iteration (a fresh scheduler would warm up again from 0)
    lr, lr_whole = losses(weights / "train_log.jsonl", "lr"), losses(whole / "train_log.jsonl", "lr")
    assert [lr[i] for i in (4, 5, 6)] == [lr_whole[i] for i in (4, 5, 6)], (lr, lr_whole)
