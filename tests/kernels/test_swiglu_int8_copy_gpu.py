"""The Triton SwiGLU with its input's INT8 copy (kernels/swiglu.py, INT8_COPY) on a CUDA GPU at real sizes: one
micro-batch of Llama2-7B's MLP (8192 tokens, F = 11008) and a ragged size. The copy is compared with the reference
run on the CPU (on CUDA torch's amax / 127 may differ from the IEEE quotient by one ulp, tests/kernels/
test_kernels_gpu.py); the gradient with float64 at the dequantized copy and, within the quantization bound, at x.
Skipped without CUDA (tests/conftest.py)."""
import pytest
import torch
from int8_bounds import assert_swiglu_close, assert_swiglu_int8_copy_bound

pytestmark = pytest.mark.gpu


def _outliers(R, C):
    """Per-row spread, a few large spikes and an outlier channel, bf16 on the GPU."""
    x = torch.randn(R, C, device="cuda") * torch.rand(R, 1, device="cuda").add(0.1)
    spikes = torch.rand(R, C, device="cuda") < 1e-3
    x = torch.where(spikes, x.sign() * (5 + torch.rand(R, C, device="cuda") * 500), x)
    x[:, 3] *= 40
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("R,F", [(8192, 11008), (4100, 1377)])
def test_swiglu_int8_copy_real_shapes(R, F):
    pytest.importorskip("triton")
    from megatron_int8.ops.swiglu import INT8_COPY_BLOCK, dequantize_halves, int8_copy_of_halves, swiglu
    from megatron_int8.reference import known_maxima

    x = _outliers(R, 2 * F)
    leaf = x.detach().requires_grad_(True)
    mid = leaf * 1  # a non-leaf, as fc1's output
    grads = []
    mid.register_hook(grads.append)
    y = swiglu(mid, emit_maxima=True, int8_copy=True)
    assert "TritonSwiGLU" in type(y.grad_fn).__name__
    q, scales = y.grad_fn.saved_tensors
    assert q.dtype == torch.int8 and q.shape == (R, 2 * F)
    want_q, want_scales = int8_copy_of_halves(x.cpu())
    assert torch.equal(scales.cpu(), want_scales) and torch.equal(q.cpu(), want_q)
    assert torch.equal(y, swiglu(x))
    dy = _outliers(R, F)
    y.backward(dy)
    (dx,) = grads
    x_hat = dequantize_halves(q.cpu(), scales.cpu(), INT8_COPY_BLOCK)
    assert_swiglu_close(x.cpu(), dy.cpu(), y.detach().cpu(), dx.cpu(), grad_at=x_hat)
    nb = scales.shape[1] // 2
    step = torch.cat([scales.cpu()[:, i * nb:(i + 1) * nb].double().repeat_interleave(INT8_COPY_BLOCK, 1)[:, :F]
                      for i in (0, 1)], 1)
    assert_swiglu_int8_copy_bound(x.cpu(), dy.cpu(), dx.cpu(), x_hat, step)
    known = known_maxima(dx)  # the maxima of the gradient computed from the copy are still exact
    assert torch.equal(known.rows, dx.float().abs().amax(1)) and torch.equal(known.cols, dx.float().abs().amax(0))
