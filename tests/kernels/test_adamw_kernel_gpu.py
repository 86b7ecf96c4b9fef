"""The precision-aware AdamW's Triton kernel on a CUDA GPU against the PyTorch reference on the CPU
(skipped without CUDA).

    python3 -m pytest -q tests/kernels/test_adamw_kernel_gpu.py

The kernel launches without fp contraction and with IEEE square root and division, so it computes the
reference's fp32 operations one by one: fp32 masters, remainders, INT8 codes and scales, and bf16 outputs
(both round to nearest even on the GPU) must be equal bit for bit, at real and ragged sizes, over steps."""
import pytest
import torch
from adamw_cases import HYPER, MASTER_KINDS, assert_kernel_matches_reference, kernel_case

from megatron_int8.ops.adamw import QBLOCK, AdamWScalars, BlockQuantized, adamw_step, adamw_step_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("master_kind", MASTER_KINDS)
@pytest.mark.parametrize("moments", [("int8", "int8"), ("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "int8")])
@pytest.mark.parametrize("n", [QBLOCK * 8 * 3, 4096 * 1024 + 77])
def test_kernel_equals_reference_bit_for_bit(n, moments, master_kind):
    pytest.importorskip("triton")
    ref = kernel_case(n, moments, master_kind, "cpu", seed=7)
    out = kernel_case(n, moments, master_kind, "cuda", seed=7)
    for step in range(1, 4):
        scalars = AdamWScalars.of(**HYPER, step=step)
        adamw_step_reference(*ref[:4], scalars, ref[4])
        adamw_step(*out[:4], scalars, out[4])  # CUDA: the Triton kernel
        assert_kernel_matches_reference(out, ref, bf16_ulps=0)
        grad = torch.randn(n, generator=torch.Generator().manual_seed(step)) * 1e-3
        ref[1].copy_(grad)
        out[1].copy_(grad)


def test_kernel_state_stays_on_the_gpu():
    _, _, m, v, master = kernel_case(1000, ("int8", "int8"), "remainder", "cuda", seed=8)
    assert isinstance(m, BlockQuantized) and m.codes.is_cuda and m.scales.is_cuda and master.is_cuda
