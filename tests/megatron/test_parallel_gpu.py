"""Tensor and sequence parallelism on 2 GPUs (NCCL, skipped with fewer): the INT8 fc1 -> gelu -> fc2 chain
at TP=2, without and with sequence parallelism (BF16 and INT8 all-gather), against float64, the TP=1 INT8 chain and
the high-precision layers, within the same float64 scale-derived bounds as the CPU test
(tests/test_parallel.py, whose worker this runs with device="cuda"): outputs, input gradients, and weight
gradients accumulated into main_grad over 3 micro-batches. Rank r runs on cuda:r with the default backend,
which must be Triton there; inputs, weights and outputs are fp32 (the Triton quantize kernel reads any float
dtype and rounds in fp32; the GEMM writes fp32), as in the CPU test."""
import pytest
import torch
from mcore_helpers import run_distributed
from test_parallel import _tp_chain_worker

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tensor_and_sequence_parallel_match_tp1_and_fp64_on_two_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron's SP communication ordering, as in training
    monkeypatch.setenv("MEGATRON_INT8_GEMM_AUTOTUNE", "0")  # one tile config: no autotuning of these tiny shapes
    monkeypatch.delenv("MEGATRON_INT8_BACKEND", raising=False)  # the default backend is what is tested
    run_distributed(_tp_chain_worker, 2, "cuda", timeout=300)
