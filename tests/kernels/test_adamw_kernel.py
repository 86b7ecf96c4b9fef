"""The precision-aware AdamW's Triton kernel (megatron_int8/kernels/adamw.py) under TRITON_INTERPRET=1 against
the PyTorch reference: fp32 values, INT8 codes and scales bit for bit, in every state format."""
import pytest
from adamw_cases import HYPER, MASTER_KINDS, assert_kernel_matches_reference, kernel_case
from interpreter import INTERPRETING, needs_interpreter, run_file_interpreted

from megatron_int8.ops.adamw import QBLOCK, AdamWScalars, BlockQuantized, adamw_step_reference


@pytest.mark.skipif(INTERPRETING, reason="the driver runs in the parent pytest process")
@pytest.mark.timeout(900)
def test_kernel_under_interpreter():
    pytest.importorskip("triton")
    run_file_interpreted(__file__, timeout=900)


@needs_interpreter
@pytest.mark.parametrize("master_kind", MASTER_KINDS)
@pytest.mark.parametrize("moments", [("int8", "int8"), ("bf16", "bf16"), ("fp32", "int8")])
def test_kernel_matches_reference(moments, master_kind):
    from megatron_int8.kernels.adamw import triton_adamw_step

    n = 9 * QBLOCK + 77  # two programs, a partial block
    scalars = AdamWScalars.of(**HYPER, step=4)
    ref = kernel_case(n, moments, master_kind, "cpu", seed=40)
    out = kernel_case(n, moments, master_kind, "cpu", seed=40)
    adamw_step_reference(ref[0], ref[1], ref[2], ref[3], scalars, ref[4])
    parts = lambda s: (s.codes, s.scales) if isinstance(s, BlockQuantized) else (s, None)  # noqa: E731
    triton_adamw_step(out[0], out[1], *parts(out[2]), *parts(out[3]), out[4], **scalars.__dict__)
    assert_kernel_matches_reference(out, ref, bf16_ulps=1)
