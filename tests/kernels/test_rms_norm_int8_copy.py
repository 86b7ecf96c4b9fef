"""The Triton RMSNorm that keeps its input's INT8 copy for backward (kernels/rms_norm.py, INT8_COPY), on CPU under
TRITON_INTERPRET=1: the copy bit-identical to reference.quantize's 1 x B blocks of each row, the forward unchanged,
and backward from the copy against float64 at the dequantized values.

Runs in a TRITON_INTERPRET=1 subprocess (tests/interpreter.py); directly:
    TRITON_INTERPRET=1 python3 -m pytest -q tests/kernels/test_rms_norm_int8_copy.py
"""
import importlib.util

import pytest
import torch
from int8_bounds import assert_rms_norm_close, heavy_tailed
from interpreter import INTERPRETING, needs_interpreter, run_file_interpreted

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

if not INTERPRETING:

    def test_rms_norm_int8_copy_under_triton_interpreter():
        """Run this file's tests in a fresh interpreter with TRITON_INTERPRET=1 set before triton loads."""
        run_file_interpreted(__file__, timeout=900)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("W,block", [(200, 32), (128, 128)])
def test_kernel_copy_matches_the_reference_and_backward_is_within_bounds(dtype, W, block):
    """Strided 3-D rows; W = 200 in 32-column blocks (the last one partial, padded width 256), and one 128 block."""
    from megatron_int8.kernels.rms_norm import triton_rms_norm_backward, triton_rms_norm_forward
    from megatron_int8.reference import QTensor, dequantize, quantize

    x = heavy_tailed(5, 7, W + 8, scale=40.0, dtype=dtype)[..., :W]
    x[1, 2, :block] = 0  # an all-zero block: scale 1
    weight = (torch.rand(W) + 0.5).to(dtype)
    y, rstd, q, scales = triton_rms_norm_forward(x, weight, 1e-6, block)
    want = quantize(x.reshape(-1, W).float(), "block", block_size=block, check_finite="off")
    assert q.shape == x.shape and torch.equal(q.view(-1, W), want.data) and torch.equal(scales, want.scale)
    plain_y, plain_rstd = triton_rms_norm_forward(x, weight, 1e-6)
    assert torch.equal(y, plain_y) and torch.equal(rstd, plain_rstd)
    dy = heavy_tailed(5, 7, W, dtype=dtype)
    dx, dw = triton_rms_norm_backward(dy, q, weight, rstd, int8_copy=(scales, block))
    assert dx.dtype == dtype and dx.shape == x.shape
    x_hat = dequantize(QTensor(q.view(-1, W), scales, "block", block)).view(x.shape)
    ulps = 1.0 if dtype == torch.bfloat16 else 0.5  # the interpreter's fp32 -> bf16 cast truncates
    assert_rms_norm_close(x, weight, 1e-6, dy, y, dx, dw, ulps, grad_at=x_hat)
    assert not torch.equal(dx, triton_rms_norm_backward(dy, x, weight, rstd)[0])


@needs_interpreter
def test_module_keeps_the_int8_copy_at_any_width():
    """FusedRMSNorm(int8_copy=True) runs the Triton kernels above TRITON_MAX_WIDTH too, and keeps int8 data, fp32
    block scales and rstd (besides its weight)."""
    from megatron_int8.ops.rms_norm import TRITON_MAX_WIDTH, FusedRMSNorm

    W = 640
    assert W > TRITON_MAX_WIDTH
    norm = FusedRMSNorm(W, eps=1e-6, int8_copy=True, dtype=torch.bfloat16)
    x = heavy_tailed(6, W, dtype=torch.bfloat16).requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, tuple(t.shape))) or t,
                                                   lambda t: t):
        y = norm(x)
    assert "TritonRMSNorm" in type(y.grad_fn).__name__
    assert saved == [(torch.int8, (6, W)), (torch.float32, (6, 5)), (torch.bfloat16, (W,)), (torch.float32, (6,))]
    y.backward(heavy_tailed(6, W, dtype=torch.bfloat16))
    assert x.grad.isfinite().all() and norm.weight.grad.isfinite().all()


@needs_interpreter
def test_kernel_copy_rejects_bad_blocks_and_destinations():
    from megatron_int8.kernels.rms_norm import triton_rms_norm_backward, triton_rms_norm_forward

    x, weight = heavy_tailed(4, 64), torch.rand(64) + 0.5
    for block in (8, 24, 128):  # 128 > the padded width 64
        with pytest.raises(ValueError, match="power of two"):
            triton_rms_norm_forward(x, weight, 1e-6, block)
    _, rstd, q, scales = triton_rms_norm_forward(x, weight, 1e-6, 32)
    dy = heavy_tailed(4, 64)
    with pytest.raises(ValueError, match="INT8 copy"):
        triton_rms_norm_backward(dy, q, weight, rstd, int8_copy=(scales[:, :1], 32))
    with pytest.raises(ValueError, match="dx destination"):
        triton_rms_norm_backward(dy, q, weight, rstd, dx=torch.empty_like(dy), int8_copy=(scales, 32))
