"""The trainer with the precision-aware optimizer (INT8 moments, remainders) on one GPU, where its step is
the Triton kernel (skipped without CUDA).

    python3 -m pytest -q tests/training/test_precision_aware_training_gpu.py"""
import pytest
from test_checkpoint_reshard import _stopped_at
from test_training import data, losses, train  # noqa: F401  (`data` is the module's fixture)

pytestmark = pytest.mark.gpu


@pytest.mark.slow
def test_gpu_training_with_int8_states_and_remainders_trains_and_resumes(data, tmp_path):  # noqa: F811
    """On one GPU the step runs the Triton kernel. It trains as test_training_gpu.py's run with torch's Adam
    does (the same 30 iterations and drop), ends within 2% of that run's loss, and resumes. Bit-exact resume is
    tested on the CPU (test_precision_aware_training.py); GPU kernels sum in varying order, so the resumed losses
    are held to test_training_gpu.py's resume tolerance, 2e-2."""
    common = ["--bf16", "--int8-linear", "--use-distributed-optimizer", "--train-iters", "30", "--micro-batch-size",
              "4", "--global-batch-size", "8", "--eval-iters", "0", "--save-interval", "15"]
    flags = [*common, "--use-precision-aware-optimizer", "--exp-avg-dtype", "int8", "--exp-avg-sq-dtype", "int8",
             "--store-param-remainders"]
    fp32_states = tmp_path / "fp32_states"
    train(data, *common, "--save", str(fp32_states), gpu=True)
    reference = losses(fp32_states / "train_log.jsonl")
    whole = tmp_path / "whole"
    out = train(data, *flags, "--save", str(whole), gpu=True)
    assert "one fused Triton kernel per parameter" in out and "device cuda" in out
    curve = losses(whole / "train_log.jsonl")
    first, last = curve[1], sum(curve[i] for i in range(27, 31)) / 4
    assert last < first - 1.0, f"loss did not go down: {first:.3f} -> {last:.3f}"
    last_reference = sum(reference[i] for i in range(27, 31)) / 4
    assert abs(last - last_reference) < 0.02 * last_reference, (last, last_reference)
    resumed = _stopped_at(whole, tmp_path / "resumed", 15)
    train(data, *flags, "--save", str(resumed), "--load", str(resumed), gpu=True)
    got = losses(resumed / "train_log.jsonl")
    assert sorted(got) == list(range(16, 31)) and all(abs(got[i] - curve[i]) < 2e-2 for i in got), (got, curve)
