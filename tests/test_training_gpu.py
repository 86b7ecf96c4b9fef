"""The trainer on GPUs (skipped on CPU): BF16 with INT8 Triton kernels on one GPU, and tensor plus
sequence parallelism with the distributed optimizer resuming to the same losses on two GPUs (NCCL)."""
import pytest
import torch
from test_training import data, losses, train  # noqa: F401  (`data` is the module's fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_gpu_tiny_pretraining_bf16_int8(data, tmp_path):  # noqa: F811
    out = train(data, "--bf16", "--int8-linear", "--train-iters", "30", "--micro-batch-size", "4",
                "--global-batch-size", "8", "--eval-interval", "15", "--save", str(tmp_path), gpu=True)
    curve = losses(tmp_path / "train_log.jsonl")
    first, last = curve[1], sum(curve[i] for i in range(27, 31)) / 4
    assert last < first - 1.0, f"loss did not go down: {first:.3f} -> {last:.3f}"
    assert "device cuda" in out and "| int8 |" in out and "peak memory (GB)" in out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_tp2_sequence_parallel_resume(data, tmp_path):  # noqa: F811
    common = ["--bf16", "--int8-linear", "--tensor-model-parallel-size", "2", "--sequence-parallel",
              "--use-distributed-optimizer", "--train-iters", "6", "--micro-batch-size", "2",
              "--global-batch-size", "4", "--eval-interval", "3"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(data, *common, "--save", str(whole), nproc=2, gpu=True)
    train(data, *common, "--save", str(split), "--exit-interval", "3", nproc=2, gpu=True)
    out = train(data, *common, "--save", str(split), "--load", str(split), nproc=2, gpu=True)
    assert "loaded checkpoint" in out
    expected, resumed = losses(whole / "train_log.jsonl"), losses(split / "train_log.jsonl")
    assert sorted(resumed) == list(range(1, 7))
    # GPU attention backward kernels may reorder sums: equal up to BF16 noise, not bitwise.
    assert all(abs(resumed[i] - expected[i]) < 2e-2 for i in range(1, 7)), (resumed, expected)
