"""Health statistics (megatron_int8.ops.health) against float64 computations: crafted tensors with known
values, and fresh heavy-tailed data through a float64 emulation of the recipe's quantization."""
import math

import pytest
import torch
from int8_bounds import heavy_tailed

from megatron_int8.ops import health
from megatron_int8.ops.health import (STAT_NAMES, LinearProbe, distribution_stats, gemm_relative_error,
                                      quantization_fractions, sample_rows, values_by_name)
from megatron_int8.ops.smooth_swiglu import smooth_scales, smoothed_fprop_operands
from megatron_int8.recipe import Int8Recipe


def q64(x, granularity, *, block=128, tile2d=False, amax=None):
    """float64 emulation of the reference quantizer: (dequantized values, integer values), scale = amax/127
    per group (1 for an all-zero group), round half to even, clamp to +-127."""
    x = x.double()
    R, C = x.shape
    if granularity == "tensor":
        a = (x.abs().max() if amax is None else amax.double().reshape(())).expand(R, C)
    elif granularity == "row":
        a = (x.abs().amax(1) if amax is None else amax.double())[:, None].expand(R, C)
    else:
        rb = block if tile2d else 1
        a = torch.empty_like(x)
        for r in range(0, R, rb):
            for c in range(0, C, block):
                a[r:r + rb, c:c + block] = x[r:r + rb, c:c + block].abs().max()
    scale = torch.where(a > 0, a / 127, torch.ones_like(a))
    q = torch.round(x / scale).clamp(-127, 127)
    return q * scale, q


def rel64(approx, exact):
    return ((approx - exact).norm() / exact.norm()).item()


def test_distribution_stats_on_known_values():
    """Two symmetric spikes in n values: mean 0, Var 2c^2/n, E v^4 = 2c^4/n, so crest sqrt(n/2) and kurtosis
    n/2; a +-a square wave: crest 1, kurtosis 1."""
    n, c = 1000, 7.0
    spikes = torch.zeros(n)
    spikes[3], spikes[500] = c, -c
    amax, crest, kurt = distribution_stats(spikes).tolist()
    assert amax == c
    assert crest == pytest.approx(math.sqrt(n / 2), rel=1e-6)
    assert kurt == pytest.approx(n / 2, rel=1e-5)
    square = torch.tensor([2.5, -2.5] * 64, dtype=torch.bfloat16)
    assert distribution_stats(square).tolist() == pytest.approx([2.5, 1.0, 1.0], rel=1e-6)
    # a constant tensor has no spread: kurtosis undefined (NaN), never a finite made-up value
    assert math.isnan(distribution_stats(torch.full((8,), 3.0))[2].item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_distribution_stats_against_float64(dtype):
    x = heavy_tailed(64, 300, dtype=dtype)
    v = x.double().reshape(-1)
    d = v - v.mean()
    want = [v.abs().max().item(), (v.abs().max() / v.square().mean().sqrt()).item(),
            (d.pow(4).mean() / d.square().mean().square()).item()]
    assert distribution_stats(x).tolist() == pytest.approx(want, rel=2e-5)


def test_quantization_fractions_on_known_values():
    """Row scales with amax 127 (scale 1): 0.3 and 0.5 (half to even) round to 0, 0.51 to 1; exact zeros do
    not count as underflow; +-127 saturate."""
    x = torch.tensor([[127.0, 0.3, 0.5, 0.51, 0.0, -127.0, 3.0, -0.2],
                      [-12.7, 0.04, 0.06, 0.0, 0.0, 12.7, 1.0, 0.0]])  # second row: scale 0.1
    under, sat = quantization_fractions(x, Int8Recipe(granularity="row"), weight=False).tolist()
    # nonzero: 7 + 5 = 12; to zero: 0.3, 0.5, -0.2 | 0.04 -> 4; at +-127: 2 + 2
    assert under == pytest.approx(4 / 12) and sat == pytest.approx(4 / 16)
    # one tensorwise scale (127/127 = 1): the second row's 0.06 vanishes too
    under, sat = quantization_fractions(x, Int8Recipe(granularity="tensor"), weight=False).tolist()
    assert under == pytest.approx(5 / 12) and sat == pytest.approx(2 / 16)


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@pytest.mark.parametrize("weight", [False, True])
def test_quantization_fractions_against_float64(granularity, weight):
    x = heavy_tailed(40, 300, scale=300.0)
    x[x.abs() < 0.3] = 0.0  # exact zeros that must not count
    recipe = Int8Recipe(granularity=granularity, block_size=32)
    _, q = q64(x, granularity, block=32, tile2d=weight and granularity == "block")
    nonzero = x != 0
    want = [((q == 0) & nonzero).sum().item() / nonzero.sum().item(), (q.abs() == 127).sum().item() / q.numel()]
    got = quantization_fractions(x, recipe, weight=weight).tolist()
    assert got[0] == pytest.approx(want[0], abs=1.5 / nonzero.sum().item())  # at most one tie rounded apart
    assert got[1] == pytest.approx(want[1], abs=1.5 / q.numel())
    assert got[0] > 0.01  # the outliers make small values vanish: the statistic sees something


def test_gemm_relative_error_known_value():
    """a = [127, 0.4] quantizes to [127, 0] (scale 1): a.b = 127.4 becomes 127."""
    a = torch.tensor([[127.0, 0.4]])
    b = torch.tensor([[1.0, 1.0]])
    err = gemm_relative_error(a, b, Int8Recipe(granularity="row")).item()
    assert err == pytest.approx(0.4 / 127.4, rel=3e-5)  # 127.4 in fp32 is 127.4 +- 4e-6
    grid = torch.randint(-127, 128, (5, 9)).float()  # every value on the grid: exact
    grid[:, 0] = 127
    assert gemm_relative_error(grid, grid, Int8Recipe(granularity="row")).item() == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_gemm_relative_error_against_float64(granularity):
    a, b = heavy_tailed(33, 256), heavy_tailed(20, 256)
    recipe = Int8Recipe(granularity=granularity, block_size=64)
    da, _ = q64(a, granularity, block=64)
    db, _ = q64(b, granularity, block=64, tile2d=granularity == "block")
    want = rel64(da @ db.t(), a.double() @ b.double().t())
    got = gemm_relative_error(a, b, recipe, b_is_weight=True).item()
    assert got == pytest.approx(want, rel=1e-3)
    assert 1e-4 < got < 0.5


def test_sample_rows_are_whole_blocks():
    assert sample_rows(100, 128) == slice(0, 100)
    rows = sample_rows(5000, 128)
    assert rows.start % 128 == 0 and rows.stop - rows.start == health.SAMPLE_ROWS and rows.stop <= 5000
    rows = sample_rows(1000, 96)  # 256 rounded up to whole 96-blocks
    assert rows.start % 96 == 0 and rows.stop - rows.start == 288 and rows.stop <= 1000


def _probe(x, w, dy, recipe, smooth=False):
    probe = LinearProbe()
    probe.arm()
    record = probe.observe_forward(x, w, recipe, smooth=smooth)
    assert not probe.armed  # one forward per armed step
    record.observe_backward(dy, w)
    (values,) = probe.take()
    assert probe.take() == []
    return values_by_name(values)


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_probe_against_float64(granularity):
    """Every value a probe records against float64: operand statistics over whole tensors, fprop and dgrad
    errors on the sampled tokens, wgrad's on those tokens' partial sum with the whole tensors' scales."""
    M, K, N, B = 640, 192, 96, 64
    x, w, dy = heavy_tailed(M, K), heavy_tailed(N, K) * 0.02, heavy_tailed(M, N) * 1e-3
    recipe = Int8Recipe(granularity=granularity, block_size=B)
    got = _probe(x.reshape(5, 128, K), w, dy.reshape(5, 128, N), recipe)
    assert set(got) == set(STAT_NAMES)
    blockw = granularity == "block"

    def fractions(t, tile2d=False):
        _, q = q64(t, granularity, block=B, tile2d=tile2d)
        nz = t != 0
        return ((q == 0) & nz).sum().item() / nz.sum().item(), (q.abs() == 127).sum().item() / q.numel()

    for name, t, tile in (("x", x, False), ("w", w, blockw), ("dy", dy, False)):
        v = t.double().reshape(-1)
        d = v - v.mean()
        assert got[f"{name}/amax"] == pytest.approx(v.abs().max().item(), rel=1e-6)
        assert got[f"{name}/crest"] == pytest.approx((v.abs().max() / v.square().mean().sqrt()).item(), rel=1e-4)
        assert got[f"{name}/kurtosis"] == pytest.approx((d.pow(4).mean() / d.square().mean() ** 2).item(), rel=1e-4)
        under, sat = fractions(t, tile)
        assert got[f"{name}/underflow"] == pytest.approx(under, abs=2e-4)
        assert got[f"{name}/saturation"] == pytest.approx(sat, abs=2e-4)

    rows = sample_rows(M, B)
    amax = lambda t: t.abs().max() if granularity == "tensor" else None  # noqa: E731  (whole tensor's scale)
    xq, _ = q64(x[rows], granularity, block=B, amax=amax(x))
    wq, _ = q64(w, granularity, block=B, tile2d=blockw)
    assert got["fprop/rel_err"] == pytest.approx(rel64(xq @ wq.t(), x[rows].double() @ w.double().t()), rel=2e-3)
    gq, _ = q64(dy[rows], granularity, block=B, amax=amax(dy))
    wtq, _ = q64(w.t(), granularity, block=B, tile2d=blockw)
    assert got["dgrad/rel_err"] == pytest.approx(rel64(gq @ wtq.t(), dy[rows].double() @ w.double()), rel=2e-3)
    col_amax = lambda t: t.abs().amax(0) if granularity == "row" else amax(t)  # noqa: E731
    gtq, _ = q64(dy[rows].t(), granularity, block=B, amax=col_amax(dy))
    xtq, _ = q64(x[rows].t(), granularity, block=B, amax=col_amax(x))
    assert got["wgrad/rel_err"] == pytest.approx(rel64(gtq @ xtq.t(), dy[rows].double().t() @ x[rows].double()),
                                                 rel=2e-3)
    assert got["fprop/underflow"] == pytest.approx(max(fractions(x)[0], fractions(w, blockw)[0]), abs=2e-4)
    assert got["dgrad/underflow"] == pytest.approx(max(fractions(dy)[0], fractions(w.t(), blockw)[0]), abs=2e-4)
    assert got["wgrad/underflow"] == pytest.approx(max(fractions(dy.t())[0], fractions(x.t())[0]), abs=2e-4)


def test_probe_skips_wgrad_when_tokens_differ():
    """A sequence-parallel shard in forward, all tokens in backward: dgrad is still measured, wgrad not."""
    x, w = heavy_tailed(64, 32), heavy_tailed(16, 32)
    got = _probe(x, w, heavy_tailed(128, 16), Int8Recipe())
    assert "dgrad/rel_err" in got and "wgrad/rel_err" not in got and "wgrad/underflow" not in got


def test_smoothing_keeps_the_product_and_tames_an_outlier_channel():
    """Powers of two: (X/s)(W s)^T equals X W^T to fp32 rounding; with a 1000x channel in X the INT8 fprop
    error drops, because the other channels no longer fall below half a per-token step."""
    x, w = torch.randn(256, 128), torch.randn(64, 128) * 0.05
    x[:, 5] *= 1000.0
    xs, ws = smoothed_fprop_operands(x, w)
    s = smooth_scales(x.abs().amax(0), w.abs().amax(0))
    assert torch.equal(torch.log2(s), torch.log2(s).round())
    assert s[5] >= 16 * s.median()
    exact = x.double() @ w.double().t()
    assert rel64(xs.double() @ ws.double().t(), exact) < 1e-12  # exact: scalings by powers of two
    recipe = Int8Recipe(granularity="row")
    plain, smoothed = gemm_relative_error(x, w, recipe).item(), gemm_relative_error(xs, ws, recipe).item()
    assert smoothed < plain / 4, (plain, smoothed)
    # zero channels (and zero weight columns) keep s = 1
    x[:, 7] = 0
    assert smooth_scales(x.abs().amax(0), w.abs().amax(0))[7] == 1.0


def test_probe_with_smoothing_reports_the_smoothed_fprop():
    x, w, dy = torch.randn(256, 128), torch.randn(64, 128) * 0.05, torch.randn(256, 64)
    x[:, 5] *= 1000.0
    plain = _probe(x, w, dy, Int8Recipe())
    smoothed = _probe(x, w, dy, Int8Recipe(), smooth=True)
    assert smoothed["fprop/rel_err"] < plain["fprop/rel_err"] / 4
    assert smoothed["fprop/underflow"] < plain["fprop/underflow"]
    assert smoothed["x/amax"] == plain["x/amax"]  # operand statistics describe the layer's own input


def test_int8_linear_probe_measures_one_training_call():
    """An armed probe measures the first call that records autograd, forward and backward, with the values a
    direct measurement gives; evaluation (no grad) leaves it armed; an unarmed probe changes nothing."""
    from megatron_int8 import int8_linear

    x, w, dy = heavy_tailed(4, 80, 96), heavy_tailed(48, 96) * 0.05, heavy_tailed(4, 80, 48)
    recipe = Int8Recipe()
    probe = LinearProbe()
    plain = int8_linear(x, w, recipe=recipe)
    assert torch.equal(int8_linear(x, w, recipe=recipe, probe=probe), plain) and probe.take() == []
    probe.arm()
    with torch.no_grad():
        int8_linear(x, w, recipe=recipe, probe=probe)
    assert probe.armed and probe.take() == []
    xg = x.clone().requires_grad_(True)
    out = int8_linear(xg, w, recipe=recipe, probe=probe)
    int8_linear(xg, w, recipe=recipe, probe=probe)  # a second micro-batch: not measured
    assert torch.equal(out, plain)
    out.backward(dy)
    (values,) = probe.take()
    assert values_by_name(values) == _probe(x, w, dy, recipe)


def test_smooth_swiglu_linear_keeps_gradients_and_cuts_fprop_error():
    """The guard changes only fprop's operands: with a 500x input channel its output is far closer to the exact
    product, and dgrad/wgrad are bit-identical to the plain recipe's."""
    from megatron_int8 import int8_linear

    x, w, dy = torch.randn(2, 128, 256), torch.randn(64, 256) * 0.05, torch.randn(2, 128, 64)
    x[..., 9] *= 500.0
    exact = x.double() @ w.double().t()
    grads = {}
    for smooth in (False, True):
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = int8_linear(xg, wg, recipe=Int8Recipe(smooth_swiglu=smooth))
        out.backward(dy)
        grads[smooth] = (rel64(out, exact), xg.grad, wg.grad)
    assert grads[True][0] < grads[False][0] / 4, (grads[False][0], grads[True][0])
    assert torch.equal(grads[True][1], grads[False][1]) and torch.equal(grads[True][2], grads[False][2])
    with pytest.raises(ValueError, match="smooth_swiglu"):
        from megatron_int8 import TPOptions

        int8_linear(x, w, recipe=Int8Recipe(smooth_swiglu=True), tp=TPOptions(sequence_parallel=True))


@pytest.mark.gpu
def test_probe_and_guard_on_cuda_with_the_triton_backend():
    """On a GPU (Triton kernels, bf16): a probe through int8_linear records the values a CPU probe computes on
    the same tensors, and the guard, fed the SwiGLU kernel's column maxima, cuts fc2's fprop error against the
    float64 product while leaving the backward bit-identical to the plain recipe's."""
    from megatron_int8 import int8_linear
    from megatron_int8.ops.swiglu import swiglu

    torch.manual_seed(0)
    h = torch.randn(2, 512, 2 * 1024, device="cuda", dtype=torch.bfloat16)
    h[..., 1024 + 7] *= 300.0  # an up channel 300x: one SwiGLU output channel grows with it
    w = (torch.randn(768, 1024, device="cuda") * 0.02).to(torch.bfloat16)
    dy = torch.randn(2, 512, 768, device="cuda", dtype=torch.bfloat16)
    probe = LinearProbe()
    probe.arm()
    results = {}
    for smooth in (False, True):
        hg, wg = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        x = swiglu(hg, emit_maxima=True)
        out = int8_linear(x, wg, recipe=Int8Recipe(smooth_swiglu=smooth), probe=None if smooth else probe)
        out.backward(dy)
        exact = x.detach().double() @ w.double().t()
        results[smooth] = (rel64(out, exact), hg.grad, wg.grad)
        if not smooth:
            (values,) = probe.take()
            cpu = _probe(x.detach().cpu(), w.cpu(), dy.cpu(), Int8Recipe())
            for name, value in values_by_name(values.cpu()).items():
                assert value == pytest.approx(cpu[name], rel=2e-2, abs=1e-4), name
    assert results[True][0] < results[False][0] / 4, (results[False][0], results[True][0])
    assert torch.equal(results[True][1], results[False][1]) and torch.equal(results[True][2], results[False][2])
