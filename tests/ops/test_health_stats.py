"""Health statistics (megatron_int8.ops.health) against float64 computations: crafted tensors with known
values, and fresh heavy-tailed data through a float64 emulation of the recipe's quantization."""
import math

import pytest
import torch
from int8_bounds import heavy_tailed

from megatron_int8.ops import health
from megatron_int8.ops.health import STAT_NAMES, LinearProbe, distribution_stats, sample_rows, values_by_name
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


def quantization_fractions(x2d, recipe, *, weight):
    """[underflow, saturation] as a probe computes them, of x2d [rows, K] quantized whole as the recipe quantizes a
    GEMM operand along its rows (BxB tiles for a weight under block granularity)."""
    return health._fractions(x2d, health._quantize(x2d, recipe, weight=weight))


def gemm_relative_error(a, b, recipe, *, b_is_weight=False):
    """The relative error of Q(a) Q(b)^T against a b^T as a probe computes it (both [., K]), each operand quantized
    whole; b_is_weight: BxB tiles under block granularity."""
    return health._product_error(a, health._quantize(a, recipe, weight=False), b,
                                 health._quantize(b, recipe, weight=b_is_weight))


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


@pytest.mark.parametrize("scale", [1e-12, 1.0, 1e9])
def test_distribution_stats_do_not_depend_on_the_scale(scale):
    """Crest and kurtosis are ratios of moments: a bf16 tensor with an outlier channel at the scale of late
    gradients (1e-12) or of overflowing activations (1e9) gives float64's values (fp32 fourth powers of raw values
    flushed to zero, NaN, or overflowed, inf)."""
    torch.manual_seed(3)
    x = torch.randn(256, 4096)
    x[:, 7] *= 60.0
    x = (x * scale).to(torch.bfloat16)
    v = x.double().reshape(-1)
    centred = v - v.mean()
    crest = v.abs().max() / v.square().mean().sqrt()
    kurtosis = centred.pow(4).mean() / centred.square().mean().square()
    amax, got_crest, got_kurtosis = distribution_stats(x).tolist()
    assert amax == v.abs().max().item()
    assert got_crest == pytest.approx(crest.item(), rel=1e-4)
    assert got_kurtosis == pytest.approx(kurtosis.item(), rel=1e-3)


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


def test_sample_channels_are_whole_blocks_spread_over_the_axis():
    assert health.sample_channels(health.SAMPLE_CHANNELS, 128, "cpu") is None  # a small axis: all of it
    index = health.sample_channels(22016, 128, "cpu")  # Llama2-7B's fused fc1: 172 blocks, 8 sampled
    assert index.numel() == health.SAMPLE_CHANNELS and index.unique().numel() == index.numel()
    blocks = index.view(-1, 128)
    assert torch.equal(blocks - blocks[:, :1], torch.arange(128).expand_as(blocks))  # whole blocks
    assert (blocks[:, 0] % 128 == 0).all() and blocks.max() < 22016
    assert blocks[0, 0] == 0 and (blocks[:, 0] >= 11008).sum() == 4  # both the gate and the up half


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_probe_against_float64(granularity, monkeypatch):
    """Every value a probe records against float64 on the same sample (fewer tokens and channels than the
    tensors have): amax over the whole tensors, the other operand statistics on the sampled tokens (X, dY)
    or output channels (W) with the whole tensors' scales, fprop's and dgrad's errors on the sampled tokens x
    sampled output or input channels, wgrad's on the sampled channels of those tokens' partial sum."""
    monkeypatch.setattr(health, "SAMPLE_ROWS", 128)
    monkeypatch.setattr(health, "SAMPLE_CHANNELS", 128)
    M, K, N, B = 640, 320, 384, 64
    x, w, dy = heavy_tailed(M, K), heavy_tailed(N, K) * 0.02, heavy_tailed(M, N) * 1e-3
    recipe = Int8Recipe(granularity=granularity, block_size=B)
    got = _probe(x.reshape(5, 128, K), w, dy.reshape(5, 128, N), recipe)
    assert set(got) == set(STAT_NAMES)
    blockw = granularity == "block"
    rows = sample_rows(M, B)
    out_ch, in_ch = health.sample_channels(N, B, "cpu"), health.sample_channels(K, B, "cpu")
    assert rows.stop - rows.start == 128 and out_ch.numel() == in_ch.numel() == 128  # a strict sample
    whole = lambda t: t.abs().max() if granularity == "tensor" else None  # noqa: E731  (tensorwise scale)
    col_amax = lambda t: t.abs().amax(0) if granularity == "row" else whole(t)  # noqa: E731  (per channel)
    x_s, w_s, dy_s = x[rows], w[out_ch], dy[rows]
    w_t = w[:, in_ch].t()  # dgrad's sampled W^T rows, scaled per input channel over all outputs
    w_t_amax = col_amax(w)[in_ch] if granularity == "row" else whole(w)

    def fractions(t, tile2d=False, amax=None):
        _, q = q64(t, granularity, block=B, tile2d=tile2d, amax=amax)
        nz = t != 0
        return ((q == 0) & nz).sum().item() / nz.sum().item(), (q.abs() == 127).sum().item() / q.numel()

    for name, t, sample, tile in (("x", x, x_s, False), ("w", w, w_s, blockw), ("dy", dy, dy_s, False)):
        v = sample.double().reshape(-1)
        d = v - v.mean()
        amax = t.double().abs().max()
        assert got[f"{name}/amax"] == pytest.approx(amax.item(), rel=1e-6)
        assert got[f"{name}/crest"] == pytest.approx((amax / v.square().mean().sqrt()).item(), rel=1e-4)
        assert got[f"{name}/kurtosis"] == pytest.approx((d.pow(4).mean() / d.square().mean() ** 2).item(), rel=1e-4)
        under, sat = fractions(sample, tile, whole(t))
        assert got[f"{name}/underflow"] == pytest.approx(under, abs=2e-4)
        assert got[f"{name}/saturation"] == pytest.approx(sat, abs=2e-4)

    xq, _ = q64(x_s, granularity, block=B, amax=whole(x))
    wq, _ = q64(w_s, granularity, block=B, tile2d=blockw, amax=whole(w))
    assert got["fprop/rel_err"] == pytest.approx(rel64(xq @ wq.t(), x_s.double() @ w_s.double().t()), rel=2e-3)
    gq, _ = q64(dy_s, granularity, block=B, amax=whole(dy))
    wtq, _ = q64(w_t, granularity, block=B, tile2d=blockw, amax=w_t_amax)
    assert got["dgrad/rel_err"] == pytest.approx(rel64(gq @ wtq.t(), dy_s.double() @ w_t.double().t()), rel=2e-3)
    gtq, _ = q64(dy_s.t(), granularity, block=B, amax=col_amax(dy))
    xtq, _ = q64(x_s.t(), granularity, block=B, amax=col_amax(x))
    exact = dy_s[:, out_ch].double().t() @ x_s[:, in_ch].double()
    assert got["wgrad/rel_err"] == pytest.approx(rel64(gtq[out_ch] @ xtq[in_ch].t(), exact), rel=2e-3)
    assert got["fprop/underflow"] == pytest.approx(
        max(fractions(x_s, amax=whole(x))[0], fractions(w_s, blockw, whole(w))[0]), abs=2e-4)
    assert got["dgrad/underflow"] == pytest.approx(
        max(fractions(dy_s, amax=whole(dy))[0], fractions(w_t, blockw, w_t_amax)[0]), abs=2e-4)
    assert got["wgrad/underflow"] == pytest.approx(
        max(fractions(dy_s.t(), amax=col_amax(dy))[0], fractions(x_s.t(), amax=col_amax(x))[0]), abs=2e-4)
    assert got["wgrad/underflow"] > 0.01 and got["dgrad/rel_err"] > 1e-4  # the statistics see something


def _sequence_parallel_probe_worker(rank, world, init_file):
    import torch.distributed as dist
    from mcore_helpers import init_megatron

    from megatron_int8 import TPOptions, int8_linear

    init_megatron(world, rank, init_file)  # gloo
    torch.manual_seed(rank)
    T, K, N, B = 128, 64, 32, 32  # tokens per rank (all of them sampled), input and output channels, block size
    group = dist.group.WORLD

    def gathered(t):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)
        return torch.cat(parts)

    def fractions(t, granularity, amax):  # underflow: nonzero values that quantize to 0
        _, q = q64(t, granularity, block=B, amax=amax)
        return ((q == 0) & (t != 0)).sum().item() / (t != 0).sum().item()

    def probed(x, w, dy, recipe, tp):
        probe = LinearProbe()
        probe.arm()
        int8_linear(x.clone().requires_grad_(), w, recipe=recipe, tp=tp, probe=probe).backward(dy)
        return values_by_name(probe.take()[0])

    def check_wgrad(got, dy_s, x_s, dy_all, x_all, granularity, what):
        """wgrad over the sampled tokens, each operand with the scales of the tensor the GEMM quantizes."""
        col_amax = {"tensor": lambda t: t.abs().max(), "row": lambda t: t.abs().amax(0), "block": lambda t: None}
        gq, _ = q64(dy_s.t(), granularity, block=B, amax=col_amax[granularity](dy_all))
        xq, _ = q64(x_s.t(), granularity, block=B, amax=col_amax[granularity](x_all))
        exact = dy_s.double().t() @ x_s.double()
        assert got["wgrad/rel_err"] == pytest.approx(rel64(gq @ xq.t(), exact), rel=2e-3), what
        under = max(fractions(dy_s.t(), granularity, col_amax[granularity](dy_all)),
                    fractions(x_s.t(), granularity, col_amax[granularity](x_all)))
        assert got["wgrad/underflow"] == pytest.approx(under, abs=2e-4), what
        assert got["wgrad/rel_err"] > 1e-4, what  # the statistic sees something

    w = heavy_tailed(N, K) * 0.05
    for granularity in ("tensor", "row", "block"):
        recipe = Int8Recipe(granularity=granularity, block_size=B)
        # column-parallel: X's token shards are gathered for fprop and wgrad; dY holds all tokens
        x, dy = heavy_tailed(T, 1, K), heavy_tailed(world * T, 1, N)
        if rank == 1:
            x[3, 0, 5] = 3e4  # an outlier on one rank: the other rank's shard is quantized with its scale too
        got = probed(x, w, dy, recipe, TPOptions(group=group, sequence_parallel=True))
        x2d, x_all = x.reshape(T, K), gathered(x).reshape(world * T, K)
        what = f"rank {rank}, {granularity}, column-parallel"
        if granularity == "tensor":
            whole = x_all.abs().max()
            assert got["x/amax"] == pytest.approx(whole.item(), rel=1e-6), what
            assert got["x/underflow"] == pytest.approx(fractions(x2d, "tensor", whole), abs=2e-4), what
            if rank == 0:  # what the shard's own amax would have read: far fewer values lost than the GEMM loses
                assert got["x/underflow"] > fractions(x2d, "tensor", x2d.abs().max()) + 0.5, what
        dy2d = dy.reshape(world * T, N)
        check_wgrad(got, dy2d[rank * T:(rank + 1) * T], x2d, dy2d, x_all, granularity, what)
        # row-parallel with the output scattered: dY's token shards are gathered for dgrad and wgrad
        x, dy = heavy_tailed(world * T, 1, K), heavy_tailed(T, 1, N)
        if rank == 1:
            dy[7, 0, 2] = 3e4
        got = probed(x, w, dy, recipe, TPOptions(group=group, scatter_output=True))
        dy2d, dy_all = dy.reshape(T, N), gathered(dy).reshape(world * T, N)
        what = f"rank {rank}, {granularity}, row-parallel"
        if granularity == "tensor":
            whole = dy_all.abs().max()
            assert got["dy/amax"] == pytest.approx(whole.item(), rel=1e-6), what
            assert got["dy/underflow"] == pytest.approx(fractions(dy2d, "tensor", whole), abs=2e-4), what
        x2d = x.reshape(world * T, K)
        check_wgrad(got, dy2d, x2d[rank * T:(rank + 1) * T], dy_all, x2d, granularity, what)


@pytest.mark.slow  # multi-process
def test_probe_under_sequence_parallelism_measures_what_the_gemms_quantize():
    """Under sequence parallelism the GEMMs quantize gathered X (column-parallel) and gathered dY (row-parallel,
    output scattered): tensorwise scales, and wgrad's per-channel ones, come from the gathered tensor, and wgrad
    contracts over the gathered tokens. The probe measures the same (fprop, dgrad, wgrad, against float64, every
    granularity), so a rank whose shard lacks the outlier reports the underflow its GEMM has (two ranks, gloo)."""
    from mcore_helpers import run_distributed

    run_distributed(_sequence_parallel_probe_worker, 2)


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


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_probe_with_smoothing_against_float64(granularity, monkeypatch):
    """The guard's fprop on a sample of tokens and output channels, against float64: the smoothed operands'
    whole-tensor scales (tensorwise: from the column maxima) and the smoothed underflow."""
    monkeypatch.setattr(health, "SAMPLE_ROWS", 64)
    monkeypatch.setattr(health, "SAMPLE_CHANNELS", 64)
    M, K, N, B = 320, 128, 192, 32
    x, w, dy = heavy_tailed(M, K), heavy_tailed(N, K) * 0.05, heavy_tailed(M, N)
    x[:, 5] *= 1000.0
    got = _probe(x, w, dy, Int8Recipe(granularity=granularity, block_size=B), smooth=True)
    xs, ws = smoothed_fprop_operands(x, w)  # over the whole tensors
    rows, out_ch = sample_rows(M, B), health.sample_channels(N, B, "cpu")
    assert rows.stop - rows.start == 64 and out_ch.numel() == 64
    whole = lambda t: t.abs().max() if granularity == "tensor" else None  # noqa: E731
    xq, qx = q64(xs[rows], granularity, block=B, amax=whole(xs))
    wq, qw = q64(ws[out_ch], granularity, block=B, tile2d=granularity == "block", amax=whole(ws))
    exact = xs[rows].double() @ ws[out_ch].double().t()
    assert got["fprop/rel_err"] == pytest.approx(rel64(xq @ wq.t(), exact), rel=2e-3)
    under = max(((q == 0) & (t != 0)).sum().item() / (t != 0).sum().item()
                for q, t in ((qx, xs[rows]), (qw, ws[out_ch])))
    assert got["fprop/underflow"] == pytest.approx(under, abs=2e-4)
    assert got["fprop/rel_err"] < _probe(x, w, dy, Int8Recipe(granularity=granularity, block_size=B))["fprop/rel_err"]


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


def test_an_armed_probe_passes_over_a_linear_without_tokens():
    """An MoE expert that the router gave no token (megatron's SequentialMLP still calls it) is not measured,
    rather than failing on the empty tensor's maximum; the probe waits for a forward with tokens."""
    from megatron_int8 import int8_linear

    w = heavy_tailed(48, 96).requires_grad_(True)
    probe = LinearProbe()
    probe.arm()
    x = torch.zeros(0, 96, requires_grad=True)
    out = int8_linear(x, w, recipe=Int8Recipe(), probe=probe)
    out.sum().backward()
    assert out.shape == (0, 48) and torch.equal(w.grad, torch.zeros_like(w)) and probe.armed and probe.take() == []


def test_smooth_swiglu_runs_in_a_row_parallel_scatter_with_the_gradient_all_gather_overlapped():
    """fc2 under sequence parallelism with --tp-comm-overlap: scatter_output and overlap_ag (which gathers the
    output gradient in backward, not the input) take the guard as without the overlap."""
    import torch.distributed as dist
    from mcore_helpers import single_process_megatron

    from megatron_int8 import TPOptions, int8_linear

    gen = torch.Generator().manual_seed(5)
    x, w = heavy_tailed(16, 64, generator=gen), heavy_tailed(32, 64, generator=gen)
    dy = heavy_tailed(16, 32, generator=gen)
    recipe = Int8Recipe(smooth_swiglu=True)
    with single_process_megatron():
        results = []
        for overlap in (False, True):
            xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            out = int8_linear(xg, wg, recipe=recipe, tp=TPOptions(group=dist.group.WORLD, scatter_output=True,
                                                                  overlap_ag=overlap))
            out.backward(dy)
            results.append((out.detach(), xg.grad, wg.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert torch.equal(results[0][0], int8_linear(x, w, recipe=recipe))


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
