import pytest
import torch

from int8_bounds import assert_within_int8_bound, expanded_scale, float64_group_amax, heavy_tailed
from megatron_int8.reference import MAX_EXACT_K, NonFiniteError, QTensor, dequantize, gemm, quantize, raise_if_nonfinite

GRANULARITIES = [("tensor", False), ("row", False), ("block", False), ("block", True)]
FP32_EPS = torch.finfo(torch.float32).eps


def float64_quantize(x, scale64):
    """The float64 reference: q = clamp(round_half_even(x / s), -127, 127); the implementations compute
    x * (1 / s) in fp32, which differs only within the near-tie exemption of the tests below."""
    return torch.round(x.double() / scale64).clamp(-127, 127)


@pytest.mark.parametrize("granularity,tile2d", GRANULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_matches_float64_reference(granularity, tile2d, dtype):
    x = heavy_tailed(70, 300, dtype=dtype)  # ragged: neither dim a multiple of the 32-block
    qt = quantize(x, granularity, block_size=32, tile2d=tile2d)
    assert qt.data.dtype == torch.int8 and qt.scale.dtype == torch.float32
    # scale = amax / 127 computed in fp32, for the right group of every element
    amax = float64_group_amax(x, granularity, 32, tile2d)
    s = expanded_scale(qt)
    assert torch.equal(s, (amax.float() / 127).double()), "scale is not fp32(amax/127) of the element's group"
    q_ref = float64_quantize(x, s)
    q = qt.data.double()
    # Exactly the contract: round_half_even(fl32(x * fl32(1/s))); the product of two fp32 values is
    # exact in float64, so this evaluates it without a second rounding.
    v32 = (x.double() * (torch.ones_like(s).float() / s.float()).double()).float().double()
    assert torch.equal(q, v32.round().clamp(-127, 127))
    # Against the true quotient x/s: equal except within two fp32 roundings (|fp32 v - v| <= 2^-23 |v|)
    # of a .5 tie, exact ties included (x * fl(1/s) can leave a tie of x/s, e.g. for fp16 data).
    v = x.double() / s
    off_tie = (v - v.floor() - 0.5).abs()
    near_tie = off_tie <= 2 * FP32_EPS * v.abs()
    assert torch.equal(q[~near_tie], q_ref[~near_tie])
    assert (q - q_ref).abs().max() <= 1
    assert near_tie.float().mean() < 1e-2  # the exemption stays rare (bf16 data has more near-ties)
    assert q.abs().max() <= 127
    # the extremes of each group map to exactly +-127
    assert torch.equal(q[x.double().abs() == amax].abs(), torch.full_like(q[x.double().abs() == amax], 127.0))


def test_round_half_to_even_ties_and_negative_extreme():
    # amax 127 -> scale exactly 1: ties are exact in every precision
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.0, 127.0, 3.49]])
    q = quantize(x, "tensor").data
    assert q.tolist() == [[0, 2, 2, 0, -2, -2, 126, -127, 127, 3]]


def test_clamp_keeps_symmetric_range_under_stochastic_rounding():
    x = torch.tensor([[127.0, -127.0, 126.9, -126.9] * 64])
    for seed in range(5):
        q = quantize(x, "tensor", stochastic=True, generator=torch.Generator().manual_seed(seed)).data
        assert q.min() >= -127 and q.max() <= 127


@pytest.mark.parametrize("granularity,tile2d", GRANULARITIES)
def test_zero_tensor_gives_zero_and_finite_scale(granularity, tile2d):
    qt = quantize(torch.zeros(40, 50), granularity, block_size=16, tile2d=tile2d)
    assert torch.isfinite(qt.scale).all() and (qt.scale == 1).all()
    assert not qt.data.any()
    assert not dequantize(qt).any()


@pytest.mark.parametrize("granularity,tile2d", GRANULARITIES)
@pytest.mark.parametrize("magnitude", [1e-39, 1e-41, 1e-44])  # every amax under 3.7e-37 (outliers of 30x)
def test_tiny_groups_quantize_within_half_a_step_of_the_smallest_scale(granularity, tile2d, magnitude):
    # amax/127 below fp32's smallest normal made 1/scale inf and every element +-127: 2-4x the input
    x = (heavy_tailed(40, 96) * magnitude).float()
    qt = quantize(x, granularity, block_size=32, tile2d=tile2d)
    step = (float64_group_amax(x, granularity, 32, tile2d) / 127).clamp_min(2.0 ** -126)  # independent of qt
    assert torch.equal(expanded_scale(qt), step.float().double())
    err = (dequantize(qt).double() - x.double()).abs()
    assert (err <= step / 2).all(), f"worst error {(err / step).max():.3f} steps"
    assert qt.data.abs().max() <= 127


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_input_raises_naming_the_tensor(bad):
    x = torch.randn(8, 16)
    x[3, 5] = bad
    with pytest.raises(NonFiniteError, match="output gradient"):
        quantize(x, "tensor", name="output gradient", check_finite="immediate")


@pytest.mark.parametrize("granularity,tile2d", GRANULARITIES)
def test_deferred_check_raises_once_naming_every_bad_tensor(granularity, tile2d):
    good, bad = torch.randn(40, 50), torch.randn(40, 50)
    bad[7, 33] = float("nan")
    kw = dict(block_size=16, tile2d=tile2d)
    quantize(good, granularity, name="fc1 input", **kw)
    quantize(bad, granularity, name="fc2 input", **kw)  # no raise here: the check is deferred
    quantize(bad * 2, granularity, name="output gradient", **kw)
    quantize(bad, granularity, name="weight", check_finite="off", **kw)  # "off" records nothing
    with pytest.raises(NonFiniteError, match="since the last check") as info:
        raise_if_nonfinite()
    named = str(info.value).split(" in ")[1].split(" since")[0].split(", ")
    assert sorted(named) == ["fc2 input", "output gradient"]  # not fc1 (finite), not weight (check off)
    raise_if_nonfinite()  # the record was reset by the read
    quantize(good, granularity, name="fc2 input", **kw)
    raise_if_nonfinite()  # a later finite tensor under the same name does not raise


@pytest.mark.parametrize("mode", ["off", "deferred"])
def test_non_finite_without_immediate_check_gives_nan_not_garbage(mode):
    x = torch.randn(8, 16)
    x[3, 5] = float("inf")
    qt = quantize(x, "row", check_finite=mode)
    out = dequantize(qt)
    assert torch.isnan(out[3]).all()  # the affected group is NaN ...
    assert torch.isfinite(out[torch.arange(8) != 3]).all()  # ... the others are intact


def test_unknown_check_finite_mode_is_an_error():
    with pytest.raises(ValueError, match="check_finite"):
        quantize(torch.randn(4, 4), "tensor", check_finite=True)


@pytest.mark.parametrize("granularity, tile2d", [("rows", False), ("Row", False), ("row", True), ("tensor", True)])
def test_qtensor_refuses_a_granularity_it_does_not_have(granularity, tile2d):
    """A misspelt granularity, or BxB tiles on a non-block operand, would be read by dequantize and gemm as
    another layout of scales."""
    data = torch.randint(-127, 128, (4, 8), dtype=torch.int8)
    with pytest.raises(ValueError, match="QTensor"):
        QTensor(data, torch.rand(4), granularity, 128, tile2d)


def test_stochastic_rounding_is_unbiased():
    g = torch.Generator().manual_seed(0)
    x = heavy_tailed(16, 64, generator=g)
    n = 400
    acc = torch.zeros(16, 64, dtype=torch.float64)
    for _ in range(n):
        acc += dequantize(quantize(x, "tensor", stochastic=True, generator=g)).double()
    mean = acc / n
    s = quantize(x, "tensor").scale.double()
    # each draw's error is within one step with std <= s/2: the mean is within 5 sigma of x
    assert ((mean - x.double()).abs() <= 5 * (s / 2) / n**0.5 + 1e-12).all()
    nearest_err = (dequantize(quantize(x, "tensor")).double() - x.double()).abs().max()
    assert nearest_err <= s / 2 * (1 + 1e-6)


@pytest.mark.parametrize("granularity,tile2d", GRANULARITIES)
def test_transposed_or_requantized_columnwise_is_consistent(granularity, tile2d):
    x = heavy_tailed(48, 80)
    qt = quantize(x, granularity, block_size=16, tile2d=tile2d)
    if granularity == "tensor" or tile2d:
        qtt = qt.transposed()
        assert torch.equal(dequantize(qtt), dequantize(qt).t())
    else:
        with pytest.raises(ValueError, match="re-quantized"):
            qt.transposed()


@pytest.mark.parametrize("granularity,tile2d", GRANULARITIES)
def test_gemm_exact_on_quantized_operands_and_within_bound(granularity, tile2d):
    a, b = heavy_tailed(67, 96), heavy_tailed(45, 96)
    qa = quantize(a, granularity, block_size=32)
    qb = quantize(b, granularity, block_size=32, tile2d=tile2d)
    out = gemm(qa, qb, out_dtype=torch.float32)
    # the INT32 GEMM + epilogue equals the float64 product of the dequantized operands
    exact = dequantize(qa).double() @ dequantize(qb).double().t()
    slack = dequantize(qa).double().abs() @ dequantize(qb).double().abs().t() * 4 * FP32_EPS
    assert ((out.double() - exact).abs() <= slack).all()
    assert_within_int8_bound(out, a, b, granularity, b_weight=tile2d, block_size=32, what=granularity)


def test_gemm_bias_and_accumulate_into():
    a, b = heavy_tailed(20, 64), heavy_tailed(12, 64)
    qa, qb = quantize(a, "tensor"), quantize(b, "tensor")
    bias = torch.randn(12)
    plain = gemm(qa, qb, out_dtype=torch.float32)
    assert torch.allclose(gemm(qa, qb, out_dtype=torch.float32, bias=bias), plain + bias, rtol=0, atol=1e-5)
    buf = torch.randn(20, 12)
    start = buf.clone()
    out = gemm(qa, qb, out_dtype=torch.float32, accumulate_into=buf)
    assert out is buf
    assert torch.allclose(buf, start + plain, rtol=1e-6, atol=1e-5)


def test_gemm_refuses_a_bias_that_is_not_one_per_output_column():
    """A [M, 1] bias broadcast over the rows (each row got its own constant, no error); a [3] bias failed in the
    epilogue's broadcast."""
    qa, qb = quantize(heavy_tailed(12, 64), "row"), quantize(heavy_tailed(12, 64), "row")
    for bad in (torch.randn(12, 1), torch.randn(1, 12), torch.randn(3), torch.randn(12, 12)):
        with pytest.raises(ValueError, match=r"bias must have shape \(12,\)"):
            gemm(qa, qb, out_dtype=torch.float32, bias=bad)
    with pytest.raises(ValueError, match="bias must have shape .* on cpu, got .* on meta"):
        gemm(qa, qb, out_dtype=torch.float32, bias=torch.randn(12, device="meta"))


def test_gemm_refuses_an_integer_out_dtype():
    """out_dtype=torch.int8 wrapped the dequantized product around (300.0 became 44), int32 truncated it."""
    qa, qb = quantize(heavy_tailed(4, 64), "row"), quantize(heavy_tailed(6, 64), "row")
    for dtype in (torch.int8, torch.int32):
        with pytest.raises(TypeError, match=f"out_dtype must be floating point, got {dtype}"):
            gemm(qa, qb, out_dtype=dtype)


def test_gemm_writes_rows_of_a_larger_output_and_checks_out():
    """`out` (the pipelined TP GEMMs write row ranges of one output): the same values as a fresh output,
    nothing else touched; a wrong shape, dtype, layout, or out with accumulate_into raises."""
    a, b = heavy_tailed(30, 64), heavy_tailed(12, 64)
    qa, qb = quantize(a, "row"), quantize(b, "row")
    big = torch.full((50, 12), 7.0)
    got = gemm(qa.row_range(slice(10, 25)), qb, out_dtype=torch.float32, bias=torch.ones(12), out=big[5:20])
    assert got.data_ptr() == big[5:20].data_ptr()
    assert torch.equal(big[5:20], gemm(quantize(a[10:25], "row"), qb, out_dtype=torch.float32, bias=torch.ones(12)))
    assert (big[:5] == 7).all() and (big[20:] == 7).all()
    for bad in (torch.empty(15, 13), torch.empty(15, 12, dtype=torch.float64), torch.empty(12, 15).t()):
        with pytest.raises(ValueError, match="out must be a contiguous"):
            gemm(qa.row_range(slice(0, 15)), qb, out_dtype=torch.float32, out=bad)
    with pytest.raises(ValueError, match="not both"):
        gemm(qa, qb, out_dtype=torch.float32, out=torch.empty(30, 12), accumulate_into=torch.zeros(30, 12))
    with pytest.raises(ValueError, match="BxB-tile"):
        quantize(b, "block", block_size=32, tile2d=True).row_range(slice(0, 4))


def test_gemm_long_contraction_never_overflows_int32():
    K = MAX_EXACT_K + 384
    a = torch.full((2, K), 127, dtype=torch.int8)
    b = torch.full((3, K), -127, dtype=torch.int8)
    b[1] = 127
    one = torch.ones((), dtype=torch.float32)
    out = gemm(QTensor(a, one, "tensor"), QTensor(b, one, "tensor"), out_dtype=torch.float32)
    expected = 127 * 127 * K  # > 2**31: would wrap in a single int32 accumulation
    assert expected > 2**31
    assert out[0, 1].item() == pytest.approx(expected, rel=1e-6)
    assert out[1, 0].item() == pytest.approx(-expected, rel=1e-6)


def test_gemm_rejects_mismatched_operands():
    qa = quantize(torch.randn(4, 32), "tensor")
    with pytest.raises(ValueError, match="contraction"):
        gemm(qa, quantize(torch.randn(4, 16), "tensor"))
    with pytest.raises(ValueError, match="differently"):
        gemm(qa, quantize(torch.randn(4, 32), "row"))
    with pytest.raises(ValueError, match="differently"):
        gemm(quantize(torch.randn(4, 64), "block", block_size=32), quantize(torch.randn(4, 64), "block", block_size=16))


def test_quantize_names_a_bad_block_size_and_a_complex_input():
    """block_size 0 raised ZeroDivisionError, -16 a reshape error, 32.0 a pad error; a complex x lost its
    imaginary part with a warning only."""
    from megatron_int8.reference import ReferenceBackend

    x = torch.randn(8, 64)
    for bad in (0, -16, 32.0, True):
        with pytest.raises(ValueError, match=f"block_size must be a positive int, got {bad!r}"):
            quantize(x, "block", block_size=bad)
        with pytest.raises(ValueError, match="block_size must be a positive int"):
            ReferenceBackend().quantize(x, granularity="block", block_size=bad, weight=False, rowwise=True,
                                        columnwise=False)
    with pytest.raises(TypeError, match="real tensor, got torch.complex64"):
        quantize(x.to(torch.complex64), "row")


def test_quantize_rejects_non_2d():
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.randn(2, 3, 4))


@pytest.mark.parametrize("granularity,weight", [("tensor", False), ("row", False), ("block", False), ("block", True)])
def test_reference_backend_pads_the_transposed_rows(granularity, weight):
    from megatron_int8.reference import ReferenceBackend

    x = heavy_tailed(21, 40)
    kw = dict(granularity=granularity, block_size=16, weight=weight, rowwise=True, columnwise=True)
    row, col = ReferenceBackend().quantize(x, columnwise_pad=16, **kw)
    row0, col0 = ReferenceBackend().quantize(x, **kw)
    assert torch.equal(row.data, row0.data) and row.data.shape == (21, 40)
    assert col.data.shape == (40, 32) and torch.equal(col.scale, col0.scale)
    assert torch.equal(col.data[:, :21], col0.data) and not col.data[:, 21:].any()
    for pad, match in ((0, "positive int"), (2.0, "positive int"), (32, "divide block_size")):
        if match == "divide block_size" and granularity != "block":
            continue
        with pytest.raises(ValueError, match=match):
            ReferenceBackend().quantize(x, columnwise_pad=pad, **kw)


def test_given_amax_shapes_are_checked():
    x = heavy_tailed(6, 10)
    row = quantize(x, "row", amax=x.abs().amax(dim=1) * 2)
    assert torch.equal(row.scale, quantize(x, "row").scale * 2)  # doubling is exact in fp32
    for granularity, amax in (("row", torch.ones(10)), ("tensor", torch.ones(6)), ("block", torch.ones(6))):
        with pytest.raises(ValueError, match="amax"):
            quantize(x, granularity, amax=amax)
