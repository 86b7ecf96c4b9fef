"""The Triton RMSNorm with its input's INT8 copy (kernels/rms_norm.py, INT8_COPY) on a CUDA GPU at the hidden
sizes of Llama2-7B (4096) and Qwen3-4B (2560: 20 blocks in a padded row of 4096), one micro-batch of 8192
tokens: the copy equals the reference run on the CPU, the forward the plain Triton kernel's, and the gradients
float64's at the dequantized copy. Skipped without CUDA (tests/conftest.py)."""
import pytest
import torch
from int8_bounds import assert_rms_norm_close

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("W", [4096, 2560])
def test_rms_norm_int8_copy_hidden_sizes(W):
    pytest.importorskip("triton")
    from megatron_int8.kernels.rms_norm import triton_rms_norm_forward
    from megatron_int8.ops.rms_norm import INT8_COPY_BLOCK, FusedRMSNorm
    from megatron_int8.reference import QTensor, dequantize, quantize

    R = 8192
    x = torch.randn(R, W, device="cuda") * torch.rand(R, 1, device="cuda").add(0.1)
    x[:, 7] *= 300  # a massive-activation channel
    x = x.to(torch.bfloat16)
    norm = FusedRMSNorm(W, eps=1e-5, int8_copy=True, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    leaf = x.clone().requires_grad_(True)
    y = norm(leaf)
    assert "TritonRMSNorm" in type(y.grad_fn).__name__
    q, scales, _, rstd = y.grad_fn.saved_tensors
    want = quantize(x.cpu().float(), "block", block_size=INT8_COPY_BLOCK, check_finite="off")
    assert torch.equal(q.cpu(), want.data) and torch.equal(scales.cpu(), want.scale)
    # the forward is the plain Triton kernel's (torch's kernel, which the norm runs at this width without the copy,
    # sums in another order)
    assert torch.equal(y, triton_rms_norm_forward(x, norm.weight.detach(), 1e-5)[0])
    dy = torch.randn(R, W, device="cuda").to(torch.bfloat16)
    y.backward(dy)
    x_hat = dequantize(QTensor(q.cpu(), scales.cpu(), "block", INT8_COPY_BLOCK))
    assert_rms_norm_close(x.cpu(), norm.weight.detach().cpu(), 1e-5, dy.cpu(), y.detach().cpu(), leaf.grad.cpu(),
                          norm.weight.grad.cpu(), grad_at=x_hat)
