"""The trainer with the precision-aware optimizer (INT8 moments, remainders) on one GPU, where its step is
the Triton kernel (skipped without CUDA).

    python3 -m pytest -q tests/training/test_precision_aware_training_gpu.py"""
import pytest
from test_checkpoint_reshard import _stopped_at
from test_training import data, losses, train  # noqa: F401  (`data` is the module's fixture)

pytestmark = pytest.mark.gpu


@pytest.mark.slow
def test_gpu_training_with_int8_states_and_remainders_trains_and_resumes(data, tmp_path):  # noqa: F811
    """On one GPU the step runs the Triton kernel. Bit-exact resume is tested on the CPU
    (test_precision_aware_training.py); GPU kernels sum in varying order, so the resumed losses are held
    to test_training_gpu.py's resume tolerance, 2e-2."""
    flags = ["--bf16", "--int8-linear", "--use-distributed-optimizer", "--use-precision-aware-optimizer",
             "--exp-avg-dtype", "int8", "--exp-avg-sq-dtype", "int8", "--store-param-remainders",
             "--train-iters", "20", "--micro-batch-size", "4", "--global-batch-size", "8", "--eval-iters", "0",
             "--save-interval", "10"]
    whole = tmp_path / "whole"
    out = train(data, *flags, "--save", str(whole), gpu=True)
    assert "one fused Triton kernel per parameter" in out and "device cuda" in out
    curve = losses(whole / "train_log.jsonl")
    assert sum(curve[i] for i in range(17, 21)) / 4 < curve[1] - 1.0, curve
    resumed = _stopped_at(whole, tmp_path / "resumed", 10)
    train(data, *flags, "--save", str(resumed), "--load", str(resumed), gpu=True)
    got = losses(resumed / "train_log.jsonl")
    assert sorted(got) == list(range(11, 21)) and all(abs(got[i] - curve[i]) < 2e-2 for i in got), (got, curve)
