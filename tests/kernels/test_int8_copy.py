"""The Triton kernels that keep their input's INT8 copy for backward (INT8_COPY of kernels/swiglu.py and
kernels/rms_norm.py), on CPU under TRITON_INTERPRET=1: each copy bit-identical to reference.quantize's 1 x B blocks
(of each SwiGLU half, of each norm row), the forward unchanged, and backward from the copy against float64 at the
dequantized values and, for SwiGLU, within the quantization bound at x.

Runs in a TRITON_INTERPRET=1 subprocess (tests/interpreter.py); directly:
    TRITON_INTERPRET=1 python3 -m pytest -q tests/kernels/test_int8_copy.py
"""
import importlib.util

import pytest
import torch
from int8_bounds import assert_rms_norm_close, assert_swiglu_close, assert_swiglu_int8_copy_bound, heavy_tailed
from interpreter import INTERPRETING, needs_interpreter, run_file_interpreted

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

if not INTERPRETING:

    def test_int8_copy_kernels_under_triton_interpreter():
        """Run this file's tests in a fresh interpreter with TRITON_INTERPRET=1 set before triton loads."""
        run_file_interpreted(__file__, timeout=900)


def _step(scales: torch.Tensor, F: int, block: int) -> torch.Tensor:
    """Each element's quantization step (its block's scale) for a copy of [R, 2F]."""
    nb = scales.shape[1] // 2
    return torch.cat([scales[:, i * nb:(i + 1) * nb].double().repeat_interleave(block, 1)[:, :F] for i in (0, 1)], 1)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("maxima", [False, True])
def test_swiglu_kernel_copy_matches_the_reference_and_backward_is_within_bounds(dtype, maxima):
    """R = 23 rows (strided), F = 37 with 16-column blocks: three blocks per half, the last one partial."""
    from megatron_int8.kernels.swiglu import (triton_swiglu_backward, triton_swiglu_backward_int8_copy,
                                              triton_swiglu_forward, triton_swiglu_forward_int8_copy)
    from megatron_int8.ops.swiglu import dequantize_halves, int8_copy_of_halves

    R, F, block = 23, 37, 16
    x = heavy_tailed(R, 2 * F + 6, scale=40.0, dtype=dtype)[:, :2 * F]
    x[5, :F] = 0  # an all-zero row of a: scale 1
    y, rows, cols, q, scales = triton_swiglu_forward_int8_copy(x, block, maxima)
    want_q, want_scales = int8_copy_of_halves(x, block)
    assert q.dtype == torch.int8 and torch.equal(q, want_q) and torch.equal(scales, want_scales)
    plain = triton_swiglu_forward(x, maxima)
    assert torch.equal(y, plain[0])
    for got, want in zip((rows, cols), plain[1:]):
        assert (got is None and want is None) if not maxima else torch.equal(got, want)

    dy = heavy_tailed(R, F, dtype=dtype)
    dx, drows, dcols = triton_swiglu_backward_int8_copy(dy, q, scales, block, maxima)
    x_hat = dequantize_halves(q, scales, block)
    ulps = 1.0 if dtype == torch.bfloat16 else 0.5  # the interpreter's fp32 -> bf16 cast truncates
    assert dx.dtype == dtype
    assert_swiglu_close(x, dy, y, dx, ulps, grad_at=x_hat)
    assert_swiglu_int8_copy_bound(x, dy, dx, x_hat, _step(scales, F, block), ulps)
    if maxima:
        assert torch.equal(drows, dx.float().abs().amax(1)) and torch.equal(dcols, dx.float().abs().amax(0))
    # the copy is not x: backward from x differs (the test sees the dequantized values)
    assert not torch.equal(dx, triton_swiglu_backward(dy, x)[0])


@needs_interpreter
def test_swiglu_kernel_copy_marks_a_non_finite_block():
    """A block holding Inf gets a NaN scale, so its gradients are NaN, never finite garbage; others stay finite."""
    from megatron_int8.kernels.swiglu import triton_swiglu_backward_int8_copy, triton_swiglu_forward_int8_copy

    x = heavy_tailed(6, 64)
    x[2, 20] = float("inf")  # a's second 16-column block of row 2
    _, _, _, q, scales = triton_swiglu_forward_int8_copy(x, 16)
    assert scales[2, 1].isnan() and scales.isnan().sum() == 1
    dx, _, _ = triton_swiglu_backward_int8_copy(heavy_tailed(6, 32), q, scales, 16)
    assert dx[2, 16:32].isnan().all() and dx[2, 48:64].isnan().all()
    dx[2, 16:32] = dx[2, 48:64] = 0
    assert dx.isfinite().all()


@needs_interpreter
def test_swiglu_op_keeps_the_int8_copy_for_backward():
    """swiglu(int8_copy=True) on the Triton path keeps only int8 data and fp32 scales (128-column blocks), and its
    gradient equals the kernel's from that copy."""
    from megatron_int8.ops.swiglu import INT8_COPY_BLOCK, dequantize_halves, swiglu

    S, B, F = 3, 4, 150
    x = heavy_tailed(S, B, 2 * F, dtype=torch.bfloat16).requires_grad_(True)
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = swiglu(x, int8_copy=True)
    assert "TritonSwiGLU" in type(y.grad_fn).__name__
    assert saved == [(torch.int8, (S, B, 2 * F)), (torch.float32, (S * B, 4))]
    q, scales = y.grad_fn.saved_tensors
    dy = heavy_tailed(S, B, F, dtype=torch.bfloat16)
    y.backward(dy)
    x_hat = dequantize_halves(q.view(S * B, 2 * F), scales, INT8_COPY_BLOCK).view(S, B, 2 * F)
    assert_swiglu_close(x.detach(), dy, y.detach(), x.grad, 1.0, grad_at=x_hat)


@needs_interpreter
def test_swiglu_kernel_copy_rejects_bad_blocks_and_scales():
    from megatron_int8.kernels.swiglu import triton_swiglu_backward_int8_copy, triton_swiglu_forward_int8_copy

    x = heavy_tailed(4, 64)
    for block in (8, 24):
        with pytest.raises(ValueError, match="power of two"):
            triton_swiglu_forward_int8_copy(x, block)
    _, _, _, q, scales = triton_swiglu_forward_int8_copy(x, 16)
    dy = heavy_tailed(4, 32)
    with pytest.raises(ValueError, match="int8"):
        triton_swiglu_backward_int8_copy(dy, q, scales[:, :2], 16)
    with pytest.raises(ValueError, match="int8"):
        triton_swiglu_backward_int8_copy(dy, q.float(), scales, 16)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("W,block", [(200, 32), (128, 128)])
def test_norm_kernel_copy_matches_the_reference_and_backward_is_within_bounds(dtype, W, block):
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
def test_norm_module_keeps_the_int8_copy_at_any_width():
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
def test_norm_kernel_copy_rejects_bad_blocks_and_destinations():
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
