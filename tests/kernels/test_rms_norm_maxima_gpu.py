"""The Triton RMSNorm writing its output's maxima (kernels/rms_norm.py, MAXIMA) on a CUDA GPU at the hidden sizes of
Llama2-7B (4096) and Qwen3-4B (2560), one micro-batch of 8192 tokens, each program walking a strip of rows: the
maxima are exactly the output's, the output is the plain kernel's (to one rounding), the gradients float64's, and
the row-wise INT8 linear reading the output gives bit-identical results with the maxima and without them.
Skipped without CUDA (tests/conftest.py)."""
import pytest
import torch
from int8_bounds import assert_rms_norm_close

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("W", [4096, 2560])
def test_rms_norm_maxima_at_hidden_sizes(W):
    pytest.importorskip("triton")
    from megatron_int8 import Int8Recipe, int8_linear
    from megatron_int8.kernels.rms_norm import triton_rms_norm_forward
    from megatron_int8.ops.rms_norm import FusedRMSNorm
    from megatron_int8.reference import known_maxima

    R = 8192
    x = torch.randn(R, W, device="cuda") * torch.rand(R, 1, device="cuda").add(0.1)
    x[:, 7] *= 300  # a massive-activation channel
    x[11] = 0
    x = x.to(torch.bfloat16)
    norm = FusedRMSNorm(W, eps=1e-5, emit_maxima=True, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    leaf = x.clone().requires_grad_(True)
    y = norm(leaf)
    assert "TritonRMSNorm" in type(y.grad_fn).__name__
    known = known_maxima(y)
    magnitudes = y.detach().float().abs()
    assert torch.equal(known.rows, magnitudes.amax(1)) and torch.equal(known.cols, magnitudes.amax(0))
    assert known.rows[11] == 0
    # the strip loop may order the fp32 row sum differently from the plain kernel: one bf16 rounding apart
    plain = triton_rms_norm_forward(x, norm.weight.detach(), 1e-5)[0].float()
    assert ((y.float() - plain).abs() <= torch.finfo(torch.bfloat16).eps * plain.abs()).all()
    weight = torch.randn(1024, W, device="cuda").to(torch.bfloat16)
    recipe = Int8Recipe(backend="triton")
    unmarked = y.detach().clone().requires_grad_(True)
    assert known_maxima(unmarked) is None
    assert torch.equal(int8_linear(y, weight, recipe=recipe), int8_linear(unmarked, weight, recipe=recipe))
    dy = torch.randn(R, W, device="cuda").to(torch.bfloat16)
    y.backward(dy)
    assert_rms_norm_close(x.cpu(), norm.weight.detach().cpu(), 1e-5, dy.cpu(), y.detach().cpu(), leaf.grad.cpu(),
                          norm.weight.grad.cpu())
