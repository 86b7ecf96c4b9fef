"""The Triton kernels against the PyTorch reference backend, on CPU under TRITON_INTERPRET=1.

Tiny ragged shapes so the interpreter stays quick. Quantized int8 data and scales must be bit-identical
to the reference; the GEMM's integer accumulation exact and its dequantized output equal up to fp32
rounding.

The tests run in a subprocess started with TRITON_INTERPRET=1 (one driver test in the parent pytest process, see
tests/interpreter.py); run directly with TRITON_INTERPRET=1 set, they run in-process:
    TRITON_INTERPRET=1 python3 -m pytest -q tests/test_kernels.py
"""
import importlib
import importlib.util

import pytest
import torch
from interpreter import INTERPRETING, needs_interpreter, run_file_interpreted

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)


if not INTERPRETING:

    def test_kernels_under_triton_interpreter():
        """Run this file's tests in a fresh interpreter with TRITON_INTERPRET=1 set before triton loads: one case
        per code path here (the fast tier), the other dtypes, shapes and options in the slow driver below."""
        run_file_interpreted(__file__, timeout=900, marks="not slow")

    @pytest.mark.slow
    def test_kernels_under_triton_interpreter_more_cases():
        """The interpreted cases marked slow (`SLOW`): further dtypes, shapes and options of paths that the fast
        cases above already run, each also covered at full size by test_kernels_gpu.py."""
        run_file_interpreted(__file__, timeout=900, marks="slow")

from megatron_int8 import Int8Recipe, NonFiniteError, int8_linear, raise_if_nonfinite  # noqa: E402
from megatron_int8.reference import ReferenceBackend  # noqa: E402
from int8_bounds import assert_rope_close  # noqa: E402

qref = importlib.import_module("megatron_int8.reference")
REF = ReferenceBackend()
VARIANTS = [("tensor", False), ("tensor", True), ("row", False), ("row", True), ("block", False), ("block", True)]
SLOW = pytest.mark.slow  # an interpreted case beyond the first of its path: the slow driver runs it
# the fast tier's quantize variants: each scale layout once, weights' BxB tiles and activations' 1xB blocks both
FAST_VARIANTS = [v if v in {("tensor", False), ("row", True), ("block", False), ("block", True)}
                 else pytest.param(*v, marks=SLOW) for v in VARIANTS]
# block scales' non-finite checks take over a minute interpreted: the slow driver, and test_kernels_gpu.py's
NON_FINITE_FAST = [v if v in {("tensor", False), ("row", True)} else pytest.param(*v, marks=SLOW) for v in VARIANTS]
WEIGHT_VARIANTS_SLOW = [v if not v[1] else pytest.param(*v, marks=SLOW) for v in VARIANTS]


@pytest.fixture(scope="module")
def K():
    return importlib.import_module("megatron_int8.kernels")


def outliers(R, C, dtype=torch.bfloat16, zero_rows=(), zero_cols=()):
    """Fresh heavy-tailed data: Student-t body plus ~3% outliers up to ~300x, some exact zeros."""
    x = torch.distributions.StudentT(3.0).sample((R, C))
    spikes = torch.rand(R, C) < 0.03
    x = torch.where(spikes, x.sign() * (1 + torch.rand(R, C) * 300), x)
    x[torch.rand(R, C) < 0.02] = 0
    for r in zero_rows:
        x[r] = 0
    for c in zero_cols:
        x[:, c] = 0
    return x.to(dtype)


def _kw(granularity, weight, block_size=16, **extra):
    return dict(granularity=granularity, block_size=block_size, weight=weight, **extra)


def assert_same_qtensor(got, want, what=""):
    assert got is not None and want is not None, what
    assert got.data.dtype == torch.int8 and got.scale.dtype == torch.float32, what
    assert got.data.shape == want.data.shape and got.scale.shape == want.scale.shape, what
    assert (got.granularity, got.block_size, got.tile2d) == (want.granularity, want.block_size, want.tile2d), what
    assert torch.equal(got.scale, want.scale), f"{what}: scales differ"
    diff = (got.data != want.data).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} int8 values differ, first at {diff[:5].tolist()}"


# ----------------------------------------------------------------------------------------------- quantize
@pytest.mark.parametrize("granularity,weight", FAST_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float32, marks=SLOW),
                                   pytest.param(torch.float16, marks=SLOW)])
def test_quantize_bit_exact_both_layouts(K, granularity, weight, dtype):
    x = outliers(37, 53, dtype, zero_rows=(5,), zero_cols=(7,))  # ragged in both dims, all-zero groups
    kw = _kw(granularity, weight, rowwise=True, columnwise=True)
    r1, c1 = K.triton_quantize(x, **kw)
    r0, c0 = REF.quantize(x, **kw)
    assert_same_qtensor(r1, r0, "rowwise")
    assert_same_qtensor(c1, c0, "columnwise")
    assert r1.data.abs().max() == 127 and c1.data.abs().max() == 127


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_quantize_reduces_many_partials(K, granularity):
    """Wide and tall enough that every reduction of maxima (per tensor, per row, per column) spans several
    steps and several programs, with an outlier placed in the last row and column strips."""
    x = outliers(130, 150, zero_rows=(3,), zero_cols=(140,))
    x[127, 2] = 900.0
    x[5, 147] = -700.0
    kw = _kw(granularity, False, rowwise=True, columnwise=True)
    r1, c1 = K.triton_quantize(x, **kw)
    r0, c0 = REF.quantize(x, **kw)
    assert_same_qtensor(r1, r0, "rowwise")
    assert_same_qtensor(c1, c0, "columnwise")


@pytest.mark.parametrize("granularity,weight", WEIGHT_VARIANTS_SLOW)
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True)])
def test_quantize_single_layout(K, granularity, weight, rowwise, columnwise):
    x = outliers(45, 38)
    kw = _kw(granularity, weight, rowwise=rowwise, columnwise=columnwise)
    r1, c1 = K.triton_quantize(x, **kw)
    r0, c0 = REF.quantize(x, **kw)
    assert (r1 is None) == (not rowwise) and (c1 is None) == (not columnwise)
    if rowwise:
        assert_same_qtensor(r1, r0, "rowwise")
    else:
        assert_same_qtensor(c1, c0, "columnwise")


@pytest.mark.parametrize("granularity,weight", FAST_VARIANTS)
@pytest.mark.parametrize("stochastic", [False, pytest.param(True, marks=SLOW)])
def test_quantize_pads_the_transposed_rows(K, granularity, weight, stochastic):
    """columnwise_pad: Q(x^T) is [C, R'] with R' the next multiple of 16; its first R columns equal the
    unpadded Q(x^T) (same draws when stochastic) and the rest are zero; Q(x) is unaffected."""
    x = outliers(37, 53, zero_rows=(5,))  # 37 rows: padded to 48 (crosses a tile edge in the interpreter)
    kw = _kw(granularity, weight, rowwise=True, columnwise=True, stochastic=stochastic)
    torch.manual_seed(3)
    r1, c1 = K.triton_quantize(x, columnwise_pad=16, **kw)
    torch.manual_seed(3)
    r0, c0 = K.triton_quantize(x, **kw)
    assert c1.data.shape == (53, 48) and c1.data.is_contiguous()
    assert_same_qtensor(r1, r0, "rowwise")
    assert torch.equal(c1.scale, c0.scale)
    assert torch.equal(c1.data[:, :37], c0.data) and not c1.data[:, 37:].any()
    if not stochastic:
        assert_same_qtensor(c1, REF.quantize(x, columnwise_pad=16, **kw)[1], "columnwise vs reference")
    # the padded wgrad-shaped product equals the unpadded one exactly
    g = outliers(37, 29)
    kg = _kw(granularity, False, rowwise=False, columnwise=True)
    _, gp = K.triton_quantize(g, columnwise_pad=16, **kg)
    _, gu = K.triton_quantize(g, **kg)
    if c1.granularity == gp.granularity and c1.tile2d == gp.tile2d:
        assert torch.equal(K.triton_gemm(gp, c1, out_dtype=torch.float32),
                           K.triton_gemm(gu, c0, out_dtype=torch.float32))


@pytest.mark.parametrize("rowwise", [True, False])
def test_quantize_given_column_amax(K, rowwise):
    """Row-wise Q(x^T) with a given per-column amax (the TP group's, larger than x's own in some columns,
    inf in one): bit-identical to the reference; Q(x) keeps its own per-row scales."""
    x = outliers(37, 53)
    col_amax = x.float().abs().amax(dim=0) * torch.where(torch.rand(53) < 0.5, 3.0, 1.0)
    col_amax[4] = float("inf")
    kw = _kw("row", False, rowwise=rowwise, columnwise=True, columnwise_pad=16, check_finite="off")
    r1, c1 = K.triton_quantize(x, columnwise_amax=col_amax, **kw)
    r0, c0 = REF.quantize(x, columnwise_amax=col_amax, **kw)
    torch.testing.assert_close(c1.scale, c0.scale, rtol=0, atol=0, equal_nan=True)  # exact, NaN included
    assert torch.equal(c1.data, c0.data) and c1.data.shape == (53, 48)
    assert torch.isnan(c1.scale[4]) and torch.equal(c1.scale[:4], col_amax[:4] / torch.tensor(127.0))
    if rowwise:
        assert_same_qtensor(r1, r0, "rowwise")
        assert_same_qtensor(r1, K.triton_quantize(x, **kw)[0], "rowwise scales are x's own")
    with pytest.raises(ValueError, match="columnwise_amax"):
        K.triton_quantize(x, columnwise_amax=col_amax[:10], **kw)
    with pytest.raises(ValueError, match="columnwise_amax"):
        K.triton_quantize(x, columnwise_amax=col_amax, **dict(kw, granularity="tensor"))


@pytest.mark.parametrize("columnwise", [True, False])
def test_quantize_given_row_amax(K, launch_log, columnwise):
    """Row-wise Q(x) with a given per-row amax (larger than x's own in some rows, NaN in one): bit-identical
    to the reference; with the column amax given too, one launch (no amax pass, no reduce); a NaN among
    the given maxima is recorded by the deferred check."""
    x = outliers(37, 53)
    row_amax = x.float().abs().amax(dim=1) * torch.where(torch.rand(37) < 0.5, 3.0, 1.0)
    row_amax[6] = float("nan")
    col_amax = x.float().abs().amax(dim=0)
    kw = _kw("row", False, rowwise=True, columnwise=columnwise, columnwise_pad=16, name="fc2 input")
    given = dict(rowwise_amax=row_amax, columnwise_amax=col_amax if columnwise else None)
    launch_log.clear()
    r1, c1 = K.triton_quantize(x, **kw, **given)
    assert launch_log == ["_quantize_kernel"]
    with pytest.raises(NonFiniteError, match="fc2 input"):
        raise_if_nonfinite()
    r0, c0 = REF.quantize(x, **dict(kw, check_finite="off"), **given)
    torch.testing.assert_close(r1.scale, r0.scale, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(r1.scale[6]) and torch.equal(r1.data, r0.data)
    if columnwise:
        assert_same_qtensor(c1, c0, "columnwise")
        assert_same_qtensor(c1, K.triton_quantize(x, **dict(kw, check_finite="off"))[1], "columnwise: x's own")
    with pytest.raises(ValueError, match="rowwise_amax"):
        K.triton_quantize(x, **dict(kw, rowwise_amax=row_amax[:10]))
    with pytest.raises(ValueError, match="rowwise_amax"):
        K.triton_quantize(x, **dict(kw, granularity="tensor", rowwise_amax=row_amax))


def test_quantize_rejects_bad_padding(K):
    x = outliers(8, 8)
    for pad in (0, -16, 1.5):
        with pytest.raises(ValueError, match="columnwise_pad"):
            K.triton_quantize(x, columnwise_pad=pad, **_kw("row", False, rowwise=True, columnwise=True))
    with pytest.raises(ValueError, match="must divide block_size"):
        K.triton_quantize(x, columnwise_pad=32, **_kw("block", False, rowwise=True, columnwise=True))


@pytest.mark.parametrize("weight", [False, True])
@pytest.mark.parametrize("block_size", [32, 48])  # 48: not a power of two, padded register tiles
def test_quantize_block_sizes(K, weight, block_size):
    x = outliers(70, 101)
    kw = _kw("block", weight, block_size=block_size, rowwise=True, columnwise=True)
    r1, c1 = K.triton_quantize(x, **kw)
    r0, c0 = REF.quantize(x, **kw)
    assert_same_qtensor(r1, r0, f"rowwise B={block_size}")
    assert_same_qtensor(c1, c0, f"columnwise B={block_size}")


def test_quantize_non_contiguous_input(K):
    x = outliers(53, 37).t()  # a strided view
    for g, w in [("tensor", False), ("row", False), ("block", True)]:
        r1, c1 = K.triton_quantize(x, **_kw(g, w, rowwise=True, columnwise=True))
        r0, c0 = REF.quantize(x, **_kw(g, w, rowwise=True, columnwise=True))
        assert_same_qtensor(r1, r0, g)
        assert_same_qtensor(c1, c0, g)


@pytest.mark.parametrize("granularity,weight", [("tensor", False), ("row", False), ("block", True)])
def test_quantize_all_zero(K, granularity, weight):
    x = torch.zeros(19, 33, dtype=torch.bfloat16)
    r1, c1 = K.triton_quantize(x, **_kw(granularity, weight, rowwise=True, columnwise=True))
    r0, c0 = REF.quantize(x, **_kw(granularity, weight, rowwise=True, columnwise=True))
    assert_same_qtensor(r1, r0)
    assert_same_qtensor(c1, c0)
    assert torch.all(r1.scale == 1) and torch.all(r1.data == 0)


def test_round_half_to_even_and_extremes(K):
    # amax 127 -> scale exactly 1: every .5 is an exact tie
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.0, 127.0, 3.49, -3.5, 4.5, 0.0, -0.0, 5.5, 6.5]])
    r1, c1 = K.triton_quantize(x, **_kw("tensor", False, rowwise=True, columnwise=True))
    assert r1.data.tolist() == [[0, 2, 2, 0, -2, -2, 126, -127, 127, 3, -4, 4, 0, 0, 6, 6]]
    assert torch.equal(c1.data, r1.data.t())
    # tiny and huge magnitudes: subnormal amax and values near fp32 max
    for scale in (1e-40, 3e38):
        y = (outliers(9, 21, torch.float32) / 300 * scale).float()
        for g, w in [("tensor", False), ("row", False), ("block", False)]:
            assert_same_qtensor(K.triton_quantize(y, **_kw(g, w, rowwise=True, columnwise=False))[0],
                                REF.quantize(y, **_kw(g, w, rowwise=True, columnwise=False))[0], f"{g} x{scale}")


@pytest.mark.parametrize("granularity,weight", NON_FINITE_FAST)
@pytest.mark.parametrize("bad", [float("inf"), pytest.param(float("-inf"), marks=SLOW),
                                 pytest.param(float("nan"), marks=SLOW)])
def test_non_finite(K, granularity, weight, bad):
    x = outliers(37, 53)
    x[11, 17] = bad
    kw = _kw(granularity, weight, rowwise=True, columnwise=True, name="fc1 input")
    with pytest.raises(NonFiniteError, match="fc1 input"):
        K.triton_quantize(x, **dict(kw, check_finite="immediate"))
    K.triton_quantize(x, **kw)  # deferred (the default): no raise until the step-end check
    with pytest.raises(NonFiniteError, match="fc1 input"):
        raise_if_nonfinite()
    # the deferred flag from each scale set a kernel may flag from (row scales, or column scales alone),
    # for an element in a tile away from the ones that store the scales, and none for a finite tensor
    for rowwise, columnwise in ((True, False), (False, True)):
        for r, c in ((11, 17), (36, 52)):
            y = outliers(37, 53)
            K.triton_quantize(y, **dict(kw, rowwise=rowwise, columnwise=columnwise))
            raise_if_nonfinite()
            y[r, c] = bad
            K.triton_quantize(y, **dict(kw, rowwise=rowwise, columnwise=columnwise))
            with pytest.raises(NonFiniteError, match="fc1 input"):
                raise_if_nonfinite()
    kw["check_finite"] = "off"
    r1, c1 = K.triton_quantize(x, **kw)
    r0, c0 = REF.quantize(x, **kw)
    for got, want in ((r1, r0), (c1, c0)):
        nan = torch.isnan(want.scale)
        assert nan.any()
        assert torch.equal(torch.isnan(got.scale), nan), "NaN scale in the wrong groups"
        assert torch.equal(got.scale[~nan], want.scale[~nan])
        finite_elems = torch.isfinite(qref.dequantize(want))  # elements of finite-scale groups
        assert torch.equal(got.data[finite_elems], want.data[finite_elems])
    # the non-finite groups poison the GEMM with NaN (never finite garbage), the others stay exact
    w = outliers(29, 53)
    qw, _ = REF.quantize(w, **_kw(granularity, True, rowwise=True, columnwise=False))
    out = K.triton_gemm(r1, qw, out_dtype=torch.float32)
    want = REF.gemm(r0, qw, out_dtype=torch.float32)
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and torch.isnan(out[11]).all()
    ok = ~torch.isnan(want)
    if granularity == "tensor":
        assert not ok.any()
    else:
        assert ok.any()
        assert_close_fp32(out[ok], want[ok], "finite part")


@SLOW  # ~50 s interpreted; test_kernels_gpu.py's test_stochastic_rounding checks the same on the GPU
def test_stochastic_rounding_is_unbiased_and_in_range(K):
    v = 0.3
    x = torch.full((64, 96), v)
    x[0, 0] = 127.0  # amax 127 -> scale 1: q is floor(0.3 + u) in {0, 1}
    r, c = K.triton_quantize(x, **_kw("tensor", False, rowwise=True, columnwise=True, stochastic=True))
    q = r.data.float()
    body = q.flatten()[1:]
    assert set(body.unique().tolist()) <= {0.0, 1.0}
    # E[q] = 0.3; the mean of 6143 Bernoulli(0.3) draws has sd 0.006, so 0.03 is a 5-sigma bound
    assert abs(body.mean().item() - v) < 0.03, body.mean().item()
    assert torch.equal(c.data, r.data.t()), "Q(x)^T must reuse Q(x)'s random draws"
    # random data, every layout and granularity: q in {floor(x/s), floor(x/s)+1}, mean error ~ 0
    x = outliers(64, 80, torch.float32)
    for g, w in [("tensor", False), ("row", False), ("block", False), ("block", True)]:
        kw = _kw(g, w, rowwise=True, columnwise=True)
        rn, cn = REF.quantize(x, **kw)
        rs, cs = K.triton_quantize(x, stochastic=True, **kw)
        for got, near, src in ((rs, rn, x), (cs, cn, x.t())):
            assert torch.equal(got.scale, near.scale), g
            vq = src / qref.dequantize(qref.QTensor(torch.ones_like(near.data), near.scale, g, 16, near.tile2d))
            lo = torch.floor(vq).clamp(-127, 127)
            d = got.data.float() - lo
            assert ((d == 0) | (d == 1)).all(), g
            assert got.data.abs().max() <= 127
            err = (got.data.float() - vq)[(vq - lo) > 0]  # elements that needed rounding
            assert abs(err.mean().item()) < 0.05, (g, err.mean().item())  # nearest: |mean| ~ 0, sd/sqrt(n)
            assert err.abs().mean() > 0.2  # really stochastic, not round-to-nearest (whose |err| mean ~0.25 too,
            assert (err.abs() > 0.5).any()  # but never above 0.5)
    torch.manual_seed(1)
    a = K.triton_quantize(x, stochastic=True, **_kw("row", False, rowwise=True, columnwise=False))[0]
    torch.manual_seed(1)
    b = K.triton_quantize(x, stochastic=True, **_kw("row", False, rowwise=True, columnwise=False))[0]
    c = K.triton_quantize(x, stochastic=True, **_kw("row", False, rowwise=True, columnwise=False))[0]
    assert torch.equal(a.data, b.data) and not torch.equal(a.data, c.data)


def test_degenerate_shapes(K):
    for shape in [(0, 8), (8, 0)]:
        x = torch.randn(shape)
        r1, c1 = K.triton_quantize(x, **_kw("tensor", False, rowwise=True, columnwise=True))
        assert r1.data.shape == shape and c1.data.shape == shape[::-1]


# ------------------------------------------------------------------------------------------------- gemm
def _q(x, granularity, weight, rowwise=True, block_size=16):
    r, c = REF.quantize(x, **_kw(granularity, weight, block_size=block_size, rowwise=rowwise, columnwise=not rowwise))
    return r if rowwise else c


def assert_close_fp32(got, want, what=""):
    """Equal up to fp32 rounding of the epilogue (a few ulps of the largest magnitude involved)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    tol = 8 * torch.finfo(torch.float32).eps * want.abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol, f"{what}: max error {err} > {tol}"


def test_gemm_integer_accumulation_exact(K):
    a = torch.randint(-127, 128, (37, 211), dtype=torch.int8)
    b = torch.randint(-127, 128, (29, 211), dtype=torch.int8)
    b[3] = 127
    a[4] = -127  # extreme rows: the largest |acc| = 127*127*K
    one = torch.tensor(1.0)
    out = K.triton_gemm(qref.QTensor(a, one, "tensor"), qref.QTensor(b, one, "tensor"), out_dtype=torch.float32)
    assert torch.equal(out, qref.int_mm(a, b).float())  # |acc| < 2^24: exact in fp32 too
    assert out[4, 3] == -127 * 127 * 211


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@pytest.mark.parametrize("M,N,Kd", [(37, 29, 53), pytest.param(16, 16, 16, marks=SLOW),
                                    pytest.param(5, 70, 96, marks=SLOW)])
def test_gemm_fprop_matches_reference(K, granularity, M, N, Kd):
    qa = _q(outliers(M, Kd), granularity, False)
    qb = _q(outliers(N, Kd), granularity, True)
    assert_close_fp32(K.triton_gemm(qa, qb, out_dtype=torch.float32), REF.gemm(qa, qb, out_dtype=torch.float32),
                      f"{granularity} {M}x{N}x{Kd}")


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_gemm_dgrad_and_wgrad_layouts(K, granularity):
    """dgrad: Q(dY) @ Q(W^T)^T; wgrad: Q(dY^T) @ Q(X^T)^T, accumulated into an fp32 main_grad."""
    T, IN, OUT = 45, 38, 27
    dy, w, x = outliers(T, OUT), outliers(OUT, IN), outliers(T, IN)
    qg = _q(dy, granularity, False)
    qwt = _q(w, granularity, True, rowwise=False)
    assert_close_fp32(K.triton_gemm(qg, qwt, out_dtype=torch.float32), REF.gemm(qg, qwt, out_dtype=torch.float32),
                      "dgrad")
    qgt = _q(dy, granularity, False, rowwise=False)
    qxt = _q(x, granularity, False, rowwise=False)
    main = torch.randn(OUT, IN)
    want = REF.gemm(qgt, qxt, out_dtype=torch.float32, accumulate_into=main.clone())
    buf = main.clone()
    got = K.triton_gemm(qgt, qxt, out_dtype=torch.float32, accumulate_into=buf)
    assert got is buf
    assert_close_fp32(got, want, "wgrad accumulate_into")


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_gemm_writes_rows_of_a_larger_output(K, granularity):
    """`out`: a row range of a larger bf16 output gets the reference's values; the other rows are untouched."""
    qa = _q(outliers(40, 48), granularity, False)
    qb = _q(outliers(24, 48), granularity, True)
    big = torch.full((64, 24), 3.0, dtype=torch.bfloat16)
    rows = slice(8, 40)
    got = K.triton_gemm(qa.row_range(slice(0, 32)), qb, out_dtype=torch.bfloat16, out=big[rows])
    assert got.data_ptr() == big[rows].data_ptr()
    want = REF.gemm(qa.row_range(slice(0, 32)), qb, out_dtype=torch.bfloat16)
    assert torch.allclose(big[rows].float(), want.float(), rtol=2 ** -7, atol=0)
    assert (big[:8] == 3).all() and (big[40:] == 3).all()


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, pytest.param(torch.float16, marks=SLOW)])
def test_gemm_bias_and_low_precision_output(K, granularity, out_dtype):
    qa = _q(outliers(33, 40), granularity, False)
    qb = _q(outliers(21, 40), granularity, True)
    bias = (torch.randn(21) * 10).to(out_dtype)
    got = K.triton_gemm(qa, qb, out_dtype=out_dtype, bias=bias)
    want = REF.gemm(qa, qb, out_dtype=out_dtype, bias=bias)
    assert got.dtype == out_dtype
    # fp32 results equal up to rounding, then one rounding to 16 bits: at most one 16-bit ulp apart
    ulp = torch.finfo(out_dtype).eps * want.float().abs().clamp_min(torch.finfo(out_dtype).tiny)
    assert ((got == want) | ((got.float() - want.float()).abs() <= ulp)).all()  # == covers fp16 overflow to inf
    assert torch.isfinite(want).float().mean() > 0.9


@pytest.mark.parametrize("block_size", [32, 48])
def test_gemm_block_sizes(K, block_size):
    qa = _q(outliers(20, 100), "block", False, block_size=block_size)
    qb = _q(outliers(18, 100), "block", True, block_size=block_size)
    assert_close_fp32(K.triton_gemm(qa, qb, out_dtype=torch.float32), REF.gemm(qa, qb, out_dtype=torch.float32),
                      f"block {block_size}")


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_gemm_splits_long_contractions(K, granularity, monkeypatch):
    """K > MAX_EXACT_K: int32 chunks summed in fp32, as in the reference (limit shrunk to 64 here)."""
    qa = _q(outliers(19, 150), granularity, False)
    qb = _q(outliers(17, 150), granularity, True)
    full = K.triton_gemm(qa, qb, out_dtype=torch.float32)
    monkeypatch.setattr(qref, "MAX_EXACT_K", 64)
    got = K.triton_gemm(qa, qb, out_dtype=torch.float32)
    want = REF.gemm(qa, qb, out_dtype=torch.float32)
    assert_close_fp32(got, want, "split")
    assert torch.equal(got, full)  # here every chunk sum is exact in fp32


def test_gemm_rejects_mismatches(K):
    qa = _q(outliers(8, 32), "tensor", False)
    with pytest.raises(ValueError, match="contraction"):
        K.triton_gemm(qa, _q(outliers(8, 16), "tensor", True), out_dtype=torch.float32)
    with pytest.raises(ValueError, match="quantized differently"):
        K.triton_gemm(qa, _q(outliers(8, 32), "row", True), out_dtype=torch.float32)


# ------------------------------------------------------------------------------------- int8_linear
@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_int8_linear_triton_matches_reference(K, granularity):
    x0 = outliers(2 * 19, 48, torch.float32).reshape(2, 19, 48)
    w0 = outliers(40, 48, torch.float32) / 10
    b0 = torch.randn(40)
    dy = outliers(2 * 19, 40, torch.float32).reshape(2, 19, 40)
    res = {}
    for name in ("reference", "triton"):
        x, w, b = (t.clone().requires_grad_(True) for t in (x0, w0, b0))
        recipe = Int8Recipe(granularity=granularity, block_size=16, backend=name, grad_rounding="nearest")
        y = int8_linear(x, w, b, recipe)
        y.backward(dy)
        res[name] = (y.detach(), x.grad, w.grad, b.grad)
    for what, got, want in zip(("output", "dgrad", "wgrad", "bias grad"), res["triton"], res["reference"]):
        assert_close_fp32(got, want, f"{granularity} {what}")


@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_tma_persistent_kernel(K, granularity, accumulate):
    """The persistent TMA-descriptor variant (Hopper's path): ragged M and N, bias, accumulate, through the
    TMA epilogue (a store, or a reduce-add into the fp32 buffer, in 4 column quarters)."""
    M, N, Kd = 37, 36, 96  # more tiles than programs: the persistent loop visits several
    qa = _q(outliers(M, Kd), granularity, False)
    qb = _q(outliers(N, Kd), granularity, True)
    bias = torch.randn(N)
    main = torch.randn(M, N)
    out = main.clone() if accumulate else torch.full((M, N), float("nan"))
    tma_kernel(qa, qb, out, bias, ACCUMULATE=accumulate)
    want = REF.gemm(qa, qb, out_dtype=torch.float32, bias=bias, accumulate_into=main.clone() if accumulate else None)
    assert_close_fp32(out, want, f"tma {granularity}")


def tma_kernel(qa, qb, out, bias=None, *, strips=None, ACCUMULATE=False):
    """One launch of the persistent TMA kernel with interpreter-sized tiles on 3 programs (each walks several
    tiles). `strips`: grouped, qb stacked [E, N, K] and read as [E * N, K]."""
    from megatron_int8.kernels import int8_gemm as G

    bd, sb = qb.data, qb.scale
    if strips is not None:
        bd, sb = bd.reshape(-1, bd.shape[-1]), sb.reshape(-1)
    M, Kd = qa.data.shape
    N = out.shape[1]
    G._int8_gemm_tma_kernel[(3,)](qa.data, bd, out, qa.scale, sb, bias if bias is not None else out, M, N, Kd,
                                  qa.data.stride(0), bd.stride(0), strips if strips is not None else sb, bd.shape[0],
                                  SCALE_MODE=0 if qa.granularity == "tensor" else 1, HAS_BIAS=bias is not None,
                                  ACCUMULATE=ACCUMULATE, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2, NUM_SMS=3,
                                  GROUPED=strips is not None)


@pytest.mark.parametrize("granularity,weight", WEIGHT_VARIANTS_SLOW)
def test_plans_are_per_call_signature(K, monkeypatch, granularity, weight):
    """Quantize and GEMM plans (checks, grids and launch arguments worked out once per call signature):
    a second call with new tensors of the same signature reuses the plan with its own data; a misaligned
    view or other strides of the same shape get plans of their own; every result equals the reference's."""
    from megatron_int8.kernels import int8_gemm as G, quantize as Q
    from megatron_int8.kernels.launch import PlanCache

    monkeypatch.setattr(Q, "_PLANS", PlanCache(64))
    monkeypatch.setattr(G, "_PLANS", PlanCache(64))
    R, C = 48, 64
    kw = _kw(granularity, weight, rowwise=True, columnwise=True, columnwise_pad=16, name="plan test")
    qb = _q(outliers(40, C), granularity, True)
    flat = outliers(R * C + 8, 1).reshape(-1)
    inputs = [("first", outliers(R, C), 1), ("same signature", outliers(R, C), 1),
              ("misaligned view", flat[1:1 + R * C].view(R, C), 2),  # 2 bytes off a 16-byte boundary
              ("transposed strides", outliers(C, R).t(), 3)]
    for what, x, n_plans in inputs:
        got, want = K.triton_quantize(x, **kw), REF.quantize(x, **kw)
        for g, w in zip(got, want):
            assert_same_qtensor(g, w, what)
        assert len(Q._PLANS) == n_plans, what
        qa = want[0]
        out = K.triton_gemm(qa, qb, out_dtype=torch.float32, autotune=False)
        assert_close_fp32(out, REF.gemm(qa, qb, out_dtype=torch.float32), f"{what} gemm")
    assert len(G._PLANS) == 1  # the reference's Q(x) is contiguous and aligned every time: one GEMM signature


def test_columnwise_only_arguments_without_columnwise_output(K):
    """A column amax or segments given with columnwise=False are checked but unused, as in the reference
    backend: Q(x) alone, the same as without them."""
    x = outliers(256, 64)
    kw = _kw("row", False, rowwise=True, columnwise=False, name="rows only")
    want, _ = REF.quantize(x, **kw)
    for extra in (dict(columnwise_amax=x.float().abs().amax(dim=0)),
                  dict(columnwise_segments=qref.Segments.for_counts([100, 120]))):
        got, none = K.triton_quantize(x, **dict(kw, **extra))
        assert none is None
        assert_same_qtensor(got, want, str(extra))
    with pytest.raises(ValueError, match="one amax per column"):
        K.triton_quantize(x, **dict(kw, columnwise_amax=torch.ones(3)))


def test_a_known_plan_still_rejects_bad_argument_types(K):
    x = outliers(32, 48)
    kw = _kw("row", False, rowwise=True, columnwise=True)
    K.triton_quantize(x, **dict(kw, columnwise_pad=1))  # a plan for pad 1 exists from here on
    for bad in (True, 1.0):  # equal to 1, so a plan key without the type would take them
        with pytest.raises(ValueError, match="columnwise_pad must be a positive int"):
            K.triton_quantize(x, **dict(kw, columnwise_pad=bad))


# ------------------------------------------------------------------ launch counts and hot-path guards
# The small linears are CPU-launch-bound on the GPU: these pin the number of kernel launches and torch ops
# per call, so that a regression (an extra finalize pass, a stray reduction, a host sync) fails on the CPU.
QUANTIZE_LAUNCHES = {"tensor": 2, "row": 2, "block": 1}  # amax, quantize; block: one pass
MAXIMA_MEMSETS = {"tensor": 0, "row": 1, "block": 0}  # row: the zeroed buffer the amax kernel folds maxima into
ALLOCS_AND_VIEWS = {"empty.memory_format", "select.int", "slice.Tensor", "view.default", "alias.default",
                    "as_strided.default", "reshape.default", "_reshape_alias.default", "t.default"}


@pytest.fixture
def launch_log(monkeypatch):
    """Records the name of every Triton kernel launched (kernels wrapped where the modules look them up,
    with no plan bound before);
    torch ops inside a launch (the interpreter's host copies) are hidden from any dispatch mode."""
    from torch.utils._python_dispatch import _disable_current_modes

    log = []

    class Counting:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                log.append(self.name)
                with _disable_current_modes():
                    return self.kernel[grid](*args, **kwargs)
            return launch

    from megatron_int8.kernels.launch import LaunchCache, PlanCache

    for mod in ("megatron_int8.kernels.quantize", "megatron_int8.kernels.int8_gemm", "megatron_int8.kernels.swiglu"):
        m = importlib.import_module(mod)
        for name, obj in list(vars(m).items()):
            if name.endswith("_kernel") and hasattr(obj, "__getitem__"):
                monkeypatch.setattr(m, name, Counting(name, obj))
            elif isinstance(obj, LaunchCache):  # launches through a cache hold the kernel themselves
                monkeypatch.setattr(obj, "kernel", Counting(obj.kernel.fn.__name__, obj.kernel))
        if hasattr(m, "_PLANS"):  # plans bound earlier hold the unwrapped kernels: start without any
            monkeypatch.setattr(m, "_PLANS", PlanCache(64))
    return log


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(f"{func._opname}.{func._overloadname}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("granularity,weight", FAST_VARIANTS)
@pytest.mark.parametrize("rowwise,columnwise", [(True, True), pytest.param(True, False, marks=SLOW),
                                                pytest.param(False, True, marks=SLOW)])
def test_quantize_launch_count_and_no_extra_ops(K, launch_log, granularity, weight, rowwise, columnwise):
    x = outliers(37, 53)
    kw = _kw(granularity, weight, rowwise=rowwise, columnwise=columnwise, check_finite="off")
    with _OpLog() as ops:
        r, c = K.triton_quantize(x, **kw)
    assert len(launch_log) == QUANTIZE_LAUNCHES[granularity], launch_log
    extra = [op for op in ops.ops if op not in ALLOCS_AND_VIEWS]
    assert extra == ["zeros.default"] * MAXIMA_MEMSETS[granularity], \
        f"torch ops on the hot path (check_finite='off' must not reduce or sync): {extra}"
    allocs = ops.ops.count("empty.memory_format")
    outs = int(rowwise) + int(columnwise)
    # int8 outputs + scales (one buffer, tensorwise: shared with the partials; block: one per output)
    assert allocs == outs + (outs if granularity == "block" else 1), ops.ops
    r0, c0 = REF.quantize(x, **kw)
    for got, want in ((r, r0), (c, c0)):
        if want is not None:
            assert_same_qtensor(got, want)
    # "immediate": one small reduction and the one host sync that reads it
    launch_log.clear()
    with _OpLog() as ops:
        K.triton_quantize(x, **dict(kw, check_finite="immediate"))
    assert len(launch_log) == QUANTIZE_LAUNCHES[granularity]
    assert ops.ops.count("_local_scalar_dense.default") == 1, ops.ops
    assert len([op for op in ops.ops if op not in ALLOCS_AND_VIEWS]) <= 3 + MAXIMA_MEMSETS[granularity], ops.ops
    # "deferred" (the default): the quantize kernel flags a NaN scale in the name's slot itself: no torch
    # op, no extra launch, no host sync
    K.triton_quantize(x, **dict(kw, check_finite="deferred"))  # the slot exists from here on
    launch_log.clear()
    with _OpLog() as ops:
        K.triton_quantize(x, **dict(kw, check_finite="deferred"))
    assert len(launch_log) == QUANTIZE_LAUNCHES[granularity]
    extra = [op for op in ops.ops if op not in ALLOCS_AND_VIEWS]
    assert extra == ["zeros.default"] * MAXIMA_MEMSETS[granularity], ops.ops


@pytest.mark.parametrize("rowwise", [True, False])
def test_non_finite_given_column_amax(K, rowwise):
    """A given column amax (reduced over the tensor-parallel group) may hold an Inf/NaN that x does not:
    the deferred check records it, as the reference backend does."""
    x = outliers(40, 8)  # R > C: the check cannot rely on the smaller scale array
    col_amax = x.float().abs().amax(dim=0)
    kw = _kw("row", False, rowwise=rowwise, columnwise=True, name="fc1 input")
    K.triton_quantize(x, **dict(kw, columnwise_amax=col_amax))
    raise_if_nonfinite()
    col_amax[3] = float("inf")
    for quantize in (K.triton_quantize, REF.quantize):
        quantize(x, **dict(kw, columnwise_amax=col_amax))
        with pytest.raises(NonFiniteError, match="fc1 input"):
            raise_if_nonfinite()


def test_quantize_given_amax_skips_the_amax_pass(K, launch_log):
    x = outliers(37, 53)
    amax = x.float().abs().amax().reshape(1) * 2  # e.g. reduced over a tensor-parallel group
    r, c = K.triton_quantize(x, **_kw("tensor", False, rowwise=True, columnwise=True, amax=amax))
    assert launch_log == ["_quantize_kernel"]
    r0, c0 = REF.quantize(x, **_kw("tensor", False, rowwise=True, columnwise=True, amax=amax))
    assert_same_qtensor(r, r0)
    assert_same_qtensor(c, c0)


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_int8_linear_launches_per_step(K, launch_log, granularity):
    """fwd + bwd = 3 GEMMs + one quantize call for X (Q(X), Q(X)^T), one for dY (Q(dY), Q(dY)^T) and, for W:
    with cache_weights, one call (Q(W), Q(W)^T) on the first step and none while W is unchanged; without
    it, Q(W) in forward and Q(W)^T in backward (two calls, nothing saved across the step)."""
    x = outliers(2 * 19, 48, torch.float32).reshape(2, 19, 48).requires_grad_(True)
    w = (outliers(40, 48, torch.float32) / 10).requires_grad_(True)
    per_call = QUANTIZE_LAUNCHES[granularity]
    for cache, quantize_calls in ((False, 4), (True, 3), (True, 2)):
        launch_log.clear()
        recipe = Int8Recipe(granularity=granularity, block_size=16, backend="triton", cache_weights=cache,
                            check_finite="off")
        int8_linear(x, w, None, recipe).backward(outliers(2 * 19, 40, torch.float32).reshape(2, 19, 40))
        assert len(launch_log) == quantize_calls * per_call + 3, (cache, launch_log)
        assert launch_log.count("_int8_gemm_kernel") == 3


def test_gemm_dispatch_cache(K, monkeypatch, launch_log):
    """Off the interpreter the first call per key (M and K bucketed to powers of two) autotunes; later calls
    launch the chosen compiled config directly. Here a stand-in autotuner (one fixed config) plays
    triton.autotune's part."""
    import triton
    from megatron_int8.kernels import int8_gemm as G

    calls = []

    class FakeTuner:
        best_config = None

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                calls.append(kwargs["SCALE_MODE"])
                cfg = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "GROUP_M": 2}, num_warps=4, num_stages=2)
                FakeTuner.best_config = cfg
                G._int8_gemm_kernel[grid(cfg.kwargs)](*args, **kwargs, **cfg.all_kwargs())
            return run

    monkeypatch.setattr(G, "_int8_gemm_tuned", FakeTuner())
    monkeypatch.setattr(G, "INTERPRETING", False)
    monkeypatch.setattr(G, "_fast", {})
    monkeypatch.setenv("MEGATRON_INT8_GEMM_AUTOTUNE", "1")
    for granularity in ("tensor", "row", "block"):
        qa = _q(outliers(37, 64), granularity, False, block_size=32)
        qb = _q(outliers(29, 64), granularity, True, block_size=32)
        bias = torch.randn(29)
        want = REF.gemm(qa, qb, out_dtype=torch.float32, bias=bias)
        n = len(calls)
        first = K.triton_gemm(qa, qb, out_dtype=torch.float32, bias=bias)
        assert len(calls) == n + 1 and len(G._fast) >= 1
        launch_log.clear()
        for _ in range(2):
            again = K.triton_gemm(qa, qb, out_dtype=torch.float32, bias=bias)
            assert torch.equal(again, first)
        assert len(calls) == n + 1, "the cached selection must bypass the autotuner"
        assert launch_log == ["_int8_gemm_kernel"] * 2
        assert_close_fp32(first, want, granularity)
        K.triton_gemm(qa, qb, out_dtype=torch.float32)  # another key (no bias): tuned again
        assert len(calls) == n + 2
        # another M in the same power-of-two bucket (37 -> 64): the cached config, a grid for its own M
        qa2 = _q(outliers(61, 64), granularity, False, block_size=32)
        got = K.triton_gemm(qa2, qb, out_dtype=torch.float32, bias=bias)
        assert len(calls) == n + 2, "an M in a tuned bucket must not autotune again"
        assert_close_fp32(got, REF.gemm(qa2, qb, out_dtype=torch.float32, bias=bias), granularity)
        K.triton_gemm(_q(outliers(65, 64), granularity, False, block_size=32), qb, out_dtype=torch.float32,
                      bias=bias)  # the next bucket (128): tuned once
        assert len(calls) == n + 3
        launch_log.clear()  # autotune=False (MoE experts): one heuristic launch, the tuner never called
        qa4 = _q(outliers(300, 64), granularity, False, block_size=32)
        got = K.triton_gemm(qa4, qb, out_dtype=torch.float32, bias=bias, autotune=False)
        assert len(calls) == n + 3 and launch_log == ["_int8_gemm_kernel"]
        assert_close_fp32(got, REF.gemm(qa4, qb, out_dtype=torch.float32, bias=bias), granularity)
        # K buckets too (an expert's wgrad contracts over its token count): 160 -> bucket 256, tuned; 224
        # reuses it (both ragged for a 128-deep K step, so the same EVEN_K variant)
        for k, tuned in ((160, n + 4), (224, n + 4)):
            qa3 = _q(outliers(37, k), granularity, False, block_size=32)
            qb3 = _q(outliers(29, k), granularity, True, block_size=32)
            got = K.triton_gemm(qa3, qb3, out_dtype=torch.float32, bias=bias)
            assert len(calls) == tuned, f"K={k}"
            assert_close_fp32(got, REF.gemm(qa3, qb3, out_dtype=torch.float32, bias=bias), granularity)


# ----------------------------------------------------------------------- MoE experts: grouped operands
# Interpreter calls cost ~1-2 s per 128 rows x 3 launches: few, small calls (4 segments over 384 rows).
COUNTS = [130, 0, 7, 0]  # a segment over 2 strips (130 tokens + 126 zero rows), empty ones inside and last


def moe_input(counts, C, dtype=torch.bfloat16):
    """Tokens sorted by expert in the Segments layout: each expert's rows at a multiple of 128, zero rows
    between them."""
    segments = qref.Segments.for_counts(counts)
    x = torch.zeros(segments.rows, C, dtype=dtype)
    for e, n in enumerate(counts):
        lo = segments.offsets[e]
        x[lo:lo + n] = outliers(n, C, dtype)
    return x, segments


def _seg_kw(segments, rowwise=True, **kw):
    return _kw("row", False, rowwise=rowwise, columnwise=True, columnwise_segments=segments, **kw)


@pytest.mark.parametrize("rowwise", [True, False])
def test_segmented_quantize_bit_exact(K, rowwise):
    """Q(x^T) with per-segment column scales [E, C] (empty segments: 1) and Q(x) in the same call,
    bit-identical to the reference; ragged C; the padding keeps [C, R] (R is already 128-aligned)."""
    x, seg = moe_input(COUNTS, 21)
    x[3, 2], x[262, 20] = 900.0, -700.0  # outliers in the first and the last non-empty segment
    kw = _seg_kw(seg, rowwise, columnwise_pad=16)
    r1, c1 = K.triton_quantize(x, **kw)
    r0, c0 = REF.quantize(x, **kw)
    assert_same_qtensor(c1, c0, "segmented columnwise")
    assert c1.data.shape == (21, 384) and c1.scale.shape == (4, 21)
    assert torch.all(c1.scale[[1, 3]] == 1) and c1.scale[0, 2] == torch.tensor(900.0) / torch.tensor(127.0)
    assert (r1 is None) == (not rowwise)
    if rowwise:
        assert_same_qtensor(r1, r0, "rowwise")


def test_segmented_quantize_non_finite(K):
    """An Inf poisons exactly its row's scale and its segment's scale of its column; check_finite acts as
    for any quantization (immediate: raise; deferred: recorded; off: nothing)."""
    x, seg = moe_input(COUNTS, 16)
    x[260, 5] = float("inf")  # segment 2, column 5
    with pytest.raises(NonFiniteError, match="expert input"):
        K.triton_quantize(x, **_seg_kw(seg, False, name="expert input", check_finite="immediate"))
    K.triton_quantize(x, **_seg_kw(seg, False, name="expert input"))
    with pytest.raises(NonFiniteError, match="expert input"):
        raise_if_nonfinite()
    r1, c1 = K.triton_quantize(x, **_seg_kw(seg, check_finite="off"))
    r0, c0 = REF.quantize(x, **_seg_kw(seg, check_finite="off"))
    nan = torch.zeros(4, 16, dtype=torch.bool)
    nan[2, 5] = True
    assert torch.equal(torch.isnan(c1.scale), nan) and torch.equal(torch.isnan(c0.scale), nan)
    assert torch.equal(c1.scale[~nan], c0.scale[~nan])
    assert torch.equal(torch.isnan(r1.scale), torch.isnan(r0.scale)) and torch.isnan(r1.scale[260])
    fin = torch.ones(16, 384, dtype=torch.bool)
    fin[5, 256:] = False  # Q(x^T)'s elements under the NaN scale
    assert torch.equal(c1.data[fin], c0.data[fin]) and torch.equal(r1.data[:260], r0.data[:260])


def test_segmented_quantize_stochastic(K):
    """Stochastic rounding keys each draw by the element's position in x, as without segments: where every
    segment has the same column maxima as the whole of x, the segmented Q(x^T) equals the unsegmented one
    draw for draw (and Q(x) equals too); every q is floor(v) or floor(v) + 1 and the rounding is unbiased."""
    counts = [130, 0, 70]
    x, seg = moe_input(counts, 20, torch.float32)
    peak = x.abs().amax(0) + 1
    x[0], x[256] = peak, -peak  # each segment's column maxima = x's
    torch.manual_seed(11)
    rs, cs = K.triton_quantize(x, stochastic=True, **_seg_kw(seg))
    torch.manual_seed(11)
    ru, cu = K.triton_quantize(x, stochastic=True, **_kw("row", False, rowwise=True, columnwise=True))
    assert torch.equal(cs.scale[0], cu.scale) and torch.equal(cs.scale[2], cu.scale) and torch.all(cs.scale[1] == 1)
    assert torch.equal(cs.data, cu.data) and torch.equal(rs.data, ru.data) and torch.equal(rs.scale, ru.scale)
    v = x.t() * (1 / cu.scale)[:, None]
    d = cs.data.float() - torch.floor(v)
    assert ((d == 0) | (d == 1)).all()
    err = (cs.data.float() - v)[v != torch.floor(v)]
    assert abs(err.mean().item()) < 0.05 and (err.abs() > 0.5).any()  # unbiased, and not round-to-nearest


def test_segmented_quantize_rejects_bad_arguments(K):
    x, seg = moe_input([5, 0, 7], 16)
    bad = [(dict(granularity="tensor"), ValueError, "row granularity"),
           (dict(columnwise_segments=qref.Segments((0, 128))), ValueError, "cover 128 rows"),
           (dict(columnwise_amax=torch.ones(16)), ValueError, "mutually exclusive"),
           (dict(columnwise_pad=256), ValueError, "must divide SEGMENT_ALIGN"),
           (dict(columnwise_segments=(0, 128, 128, 256)), TypeError, "must be a Segments")]
    for change, err, match in bad:
        for backend in (K.triton_quantize, REF.quantize):
            with pytest.raises(err, match=match):
                backend(x, **dict(_seg_kw(seg), **change))


@pytest.mark.parametrize("rowwise", [True, False])
def test_segmented_quantize_launch_count_and_no_extra_ops(K, launch_log, rowwise):
    """Segments keep the row-wise launches (2, after the maxima's memset) and allocations: no pass over x
    and no torch op of their own (the strip table is made once per routing)."""
    x, seg = moe_input([0, 130], 16)
    kw = _seg_kw(seg, rowwise, check_finite="off")
    K.triton_quantize(x, **kw)  # makes this routing's strip table
    launch_log.clear()
    with _OpLog() as ops:
        r, c = K.triton_quantize(x, **kw)
    assert len(launch_log) == QUANTIZE_LAUNCHES["row"], launch_log
    assert [op for op in ops.ops if op not in ALLOCS_AND_VIEWS] == ["zeros.default"], ops.ops  # the maxima
    assert ops.ops.count("empty.memory_format") == int(rowwise) + 1 + 1, ops.ops  # int8 outputs, scales
    assert_same_qtensor(c, REF.quantize(x, **kw)[1])


@pytest.mark.parametrize("given", ["both", "row", "col"])
def test_quantize_into_given_destinations(K, given):
    """`out`: Q(x), Q(x^T) and their scales written into an expert's slot of stacked buffers (views with an
    offset), bit-identical to a plain call for both backends, the other slots untouched; a destination not
    given is allocated as usual. Ragged N and K, padded Q(x^T) rows."""
    N, Kd, E, slot = 37, 53, 3, 1
    w = outliers(N, Kd, zero_rows=(4,))
    kw = _kw("row", True, rowwise=True, columnwise=True, columnwise_pad=16)
    want = REF.quantize(w, **kw)
    for quantize in (K.triton_quantize, REF.quantize):
        row = qref.QTensor(torch.full((E, N, Kd), 55, dtype=torch.int8), torch.full((E, N), -1.0), "row", 16)
        col = qref.QTensor(torch.full((E, Kd, 48), 55, dtype=torch.int8), torch.full((E, Kd), -1.0), "row", 16)
        dest = [qref.QTensor(t.data[slot], t.scale[slot], "row", 16) for t in (row, col)]
        out = (dest[0] if given != "col" else None, dest[1] if given != "row" else None)
        got = quantize(w, out=out, **kw)
        for g, d, ref in zip(got, out, want):
            assert_same_qtensor(g, ref, f"{quantize.__name__}, {given}")
            if d is not None:
                assert g.data.data_ptr() == d.data.data_ptr() and g.scale.data_ptr() == d.scale.data_ptr()
        for t, d in zip((row, col), out):
            others = [e for e in range(E) if e != slot or d is None]
            assert torch.all(t.data[others] == 55) and torch.all(t.scale[others] == -1.0)


def test_quantize_rejects_bad_destinations(K):
    """A destination that does not fit its output is refused before any kernel writes through it."""
    x = outliers(20, 32)
    kw = _kw("row", False, rowwise=True, columnwise=True)
    row = qref.QTensor(torch.empty(20, 32, dtype=torch.int8), torch.empty(20), "row", 16)
    col = qref.QTensor(torch.empty(32, 20, dtype=torch.int8), torch.empty(32), "row", 16)
    wide = torch.empty(20, 64, dtype=torch.int8)
    bad = [(dict(out=(row,)), TypeError, "pair"),
           (dict(out=(row, col), granularity="tensor"), ValueError, "row granularity only"),
           (dict(out=(row, col), rowwise=False), ValueError, "not requested"),
           (dict(out=(col, None)), ValueError, r"shape \(20, 32\)"),
           (dict(out=(qref.QTensor(wide[:, :32], torch.empty(20), "row", 16), None)), ValueError, "not contiguous"),
           (dict(out=(qref.QTensor(row.data.view(torch.uint8), row.scale, "row", 16), None)), ValueError, "torch.int8 tensor"),
           (dict(out=(None, qref.QTensor(col.data, torch.empty(32, dtype=torch.float64), "row", 16))), ValueError,
            "float32"),
           (dict(out=(None, (col.data, col.scale))), TypeError, "must be a QTensor"),
           (dict(out=(row, col), columnwise_pad=16), ValueError, r"shape \(32, 32\)")]  # Q(x^T) rows padded
    for change, err, match in bad:
        for quantize in (K.triton_quantize, REF.quantize):
            with pytest.raises(err, match=match):
                quantize(x, **dict(kw, **change))
    x_seg, seg = moe_input([5, 0], 16)
    seg_col = qref.QTensor(torch.empty(16, 256, dtype=torch.int8), torch.empty(16), "row", 16)
    for quantize in (K.triton_quantize, REF.quantize):
        with pytest.raises(ValueError, match="segmented"):
            quantize(x_seg, out=(None, seg_col), **_seg_kw(seg))


def test_segmented_quantize_plan_serves_every_routing(K):
    """The plan of a segmented quantize is keyed by the number of segments, not by the routing: a second
    routing with the same aligned row count reuses it (no new plan) and still gets its own segments'
    scales; segments that do not cover x are refused on every call, with a plan cached or not."""
    plans = importlib.import_module("megatron_int8.kernels.quantize")._PLANS
    x1, seg1 = moe_input([130, 0, 7, 0], 24)
    x2, seg2 = moe_input([7, 0, 0, 130], 24)
    assert x1.shape == x2.shape and seg1 != seg2
    kw1, kw2 = _seg_kw(seg1, columnwise_pad=16), _seg_kw(seg2, columnwise_pad=16)
    n_plans = len(plans)
    got1 = K.triton_quantize(x1, **kw1)
    assert len(plans) == n_plans + 1  # kept
    got2 = K.triton_quantize(x2, **kw2)
    assert len(plans) == n_plans + 1  # reused
    for got, want in ((got1, REF.quantize(x1, **kw1)), (got2, REF.quantize(x2, **kw2))):
        assert_same_qtensor(got[0], want[0], "rowwise")
        assert_same_qtensor(got[1], want[1], "segmented columnwise")
    assert torch.all(got2[1].scale[[1, 2]] == 1) and not torch.all(got2[1].scale[3] == 1)
    short = qref.Segments.for_counts([7, 0, 0, 0])  # 4 segments over 128 rows, x has 384
    with pytest.raises(ValueError, match="cover 128 rows"):
        K.triton_quantize(x2, **_seg_kw(short, columnwise_pad=16))


def stacked_weights(E, N, Kd):
    """The experts' row-wise Q(W_e) [N, K] stacked as [E, N, K] with scales [E, N]."""
    qs = [_q(outliers(N, Kd), "row", True) for _ in range(E)]
    return qref.QTensor(torch.stack([q.data for q in qs]), torch.stack([q.scale for q in qs]), "row", 16)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_matches_reference(K, out_dtype):
    """One launch for all experts: each 16-row tile finds its expert, ragged N (36) and K (53), empty
    segments first and last. fp32: bit-identical ((acc * sa) * sb, as the reference); bf16: at most one
    bf16 ulp (the interpreter's fp32 -> bf16 cast is not round-to-nearest)."""
    x, seg = moe_input([0, 20, 150, 0], 53)
    qa = _q(x, "row", False)
    qb = stacked_weights(4, 36, 53)
    got = K.triton_grouped_gemm(qa, qb, seg, out_dtype=out_dtype)
    want = REF.grouped_gemm(qa, qb, seg, out_dtype=out_dtype)
    assert got.dtype == out_dtype and got.shape == (384, 36)
    if out_dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        assert ((got.float() - want.float()).abs() <= 2.0 ** -7 * want.float().abs()).all()
    assert torch.equal(K.triton_grouped_gemm(_q(x[:0], "row", False), qb, qref.Segments((0,) * 5),
                                             out_dtype=out_dtype), torch.zeros(0, 36, dtype=out_dtype))
    with pytest.raises(ValueError, match="stacked operands"):
        K.triton_grouped_gemm(qa, stacked_weights(3, 36, 53), seg, out_dtype=out_dtype)


def test_grouped_gemm_splits_long_contractions(K, monkeypatch):
    """K > MAX_EXACT_K: the plain kernel's int32 chunks summed in fp32, as the reference (limit 64 here)."""
    x, seg = moe_input([40, 0, 3], 100)
    qa, qb = _q(x, "row", False), stacked_weights(3, 20, 100)
    monkeypatch.setattr(qref, "MAX_EXACT_K", 64)
    assert torch.equal(K.triton_grouped_gemm(qa, qb, seg, out_dtype=torch.float32),
                       REF.grouped_gemm(qa, qb, seg, out_dtype=torch.float32))


def test_grouped_gemm_tma_kernel(K):
    """The persistent TMA kernel's grouped mode (Hopper's path): b read as [E * N, K], a tile's box past
    its expert's N = 36 rows reads the next expert's, into columns that are never stored; ragged K (80)."""
    x, seg = moe_input([20, 0, 150], 80)
    qa, qb = _q(x, "row", False), stacked_weights(3, 36, 80)
    out = torch.full((384, 36), float("nan"))
    tma_kernel(qa, qb, out, strips=seg.strip_experts(out.device))
    assert torch.equal(out, REF.grouped_gemm(qa, qb, seg, out_dtype=torch.float32))


def test_grouped_kernels_use_each_tiles_segment(K, monkeypatch):
    """The comparisons above catch a tile that reads another segment's weights or scales: with the strip
    owners shifted by one strip, the grouped GEMM and the segmented Q(x^T) differ from the reference."""
    x, seg = moe_input([20, 150], 32)
    qa, qb = _q(x, "row", False), stacked_weights(2, 16, 32)
    right = seg.strip_experts(x.device)
    monkeypatch.setattr(qref.Segments, "strip_experts", lambda self, device: torch.roll(right, 1))
    assert not torch.equal(K.triton_grouped_gemm(qa, qb, seg, out_dtype=torch.float32),
                           REF.grouped_gemm(qa, qb, seg, out_dtype=torch.float32))
    kw = _seg_kw(seg, False)
    assert not torch.equal(K.triton_quantize(x, **kw)[1].data, REF.quantize(x, **kw)[1].data)


def test_gemm_strided_column_slice_operands(K):
    """An expert's wgrad operands are column slices of the segmented Q(dY^T) and Q(X^T) (row stride R):
    triton_gemm and the TMA kernel (strided descriptors) equal the product of contiguous copies, into
    main_grad."""
    dy, seg = moe_input([20, 0, 150], 24)
    x = torch.zeros(seg.rows, 40, dtype=torch.bfloat16)
    x[dy.abs().sum(1) > 0] = outliers(170, 40)
    qg = REF.quantize(dy, **_seg_kw(seg, False))[1]
    qx = REF.quantize(x, **_seg_kw(seg, False))[1]
    for e in (0, 2):
        ga, xa = qref.segment_operand(qg, seg, e), qref.segment_operand(qx, seg, e)
        assert not ga.data.is_contiguous() and ga.data.stride() == (384, 1)
        gc, xc = (qref.QTensor(q.data.contiguous(), q.scale, "row", 16) for q in (ga, xa))
        main = torch.randn(24, 40)
        want = K.triton_gemm(gc, xc, out_dtype=torch.float32, accumulate_into=main.clone())
        ref = REF.gemm(gc, xc, out_dtype=torch.float32, accumulate_into=main.clone())
        assert_close_fp32(want, ref, "wgrad")
        assert torch.equal(K.triton_gemm(ga, xa, out_dtype=torch.float32, accumulate_into=main.clone()), want)
        out, contiguous = main.clone(), main.clone()
        tma_kernel(ga, xa, out, ACCUMULATE=True)
        tma_kernel(gc, xc, contiguous, ACCUMULATE=True)
        assert torch.equal(out, contiguous)
        assert_close_fp32(out, ref, "TMA wgrad")



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rot_of_d,batch_freqs", [(1.0, False), (0.5, True)])
def test_rope_kernel_forward_and_backward(dtype, rot_of_d, batch_freqs):
    """The Triton RoPE on a strided q (a slice of a fused qkv tensor), 20 heads (masked head blocks),
    a partial rotary dimension and per-batch angles: forward and the transposed rotation of backward
    against float64; the dimensions past the rotary ones are copied exactly."""
    from megatron_int8.ops import rope

    # a whole ulp of rounding: the interpreter's fp32 -> bf16 cast truncates (tests/test_kernels_gpu.py
    # holds the GPU kernel to half an ulp)
    ulps = 1.0 if dtype == torch.bfloat16 else 0.5
    S, B, H, D = 5, 3, 20, 16
    rot = int(D * rot_of_d)
    qkv = outliers(S * B * H, 3 * D, dtype).view(S, B, H, 3 * D)
    q = qkv[..., :D]  # strides (B*H*3D, H*3D, 3D, 1)
    assert not q.is_contiguous()
    freqs = torch.rand(S, B if batch_freqs else 1, 1, rot) * 4096  # large angles, as late positions have
    q_leaf = q.detach().clone().requires_grad_(True)
    out = rope.fused_rope(q_leaf, freqs)
    assert out.grad_fn is not None and "TritonRoPE" in type(out.grad_fn).__name__
    assert_rope_close(out, q, freqs, False, "forward", ulps)
    grad = outliers(S * B * H, D, dtype).view(S, B, H, D)
    out.backward(grad)
    assert_rope_close(q_leaf.grad, grad, freqs, True, "backward", ulps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["k head slice", "q heads in place", "rows of 40", "wide rows, several per program"])
def test_rms_norm_kernel_forward_and_backward(dtype, layout):
    """The Triton RMSNorm (megatron_int8.ops.rms_norm.FusedRMSNorm) on the shapes it meets: a strided k slice
    of a fused qkv output (rows of one head, normalized without a copy), the query heads of every group in
    place ([S, B, G, heads per group, D], as QueryNormInPlaceSelfAttention passes them, also without a copy),
    ragged rows narrower than the block (masked columns, many rows per program), and rows wide enough that
    each backward program loops over many of them. Heavy-tailed data with zero rows; forward, input and
    weight gradients against float64."""
    from int8_bounds import assert_rms_norm_close

    from megatron_int8.kernels.rms_norm import _rows
    from megatron_int8.ops.rms_norm import FusedRMSNorm

    ulps = 1.0 if dtype == torch.bfloat16 else 0.5  # the interpreter's fp32 -> bf16 cast truncates
    if layout in ("k head slice", "q heads in place"):
        S, B, G, D = 5, 3, 4, 16
        qkv = outliers(S * B * G, 5 * D, dtype, zero_rows=(7,)).view(S, B, G, 5 * D)  # 3 q heads, k, v per group
        x = qkv[..., 3 * D:4 * D] if layout == "k head slice" else qkv[..., :3 * D].unflatten(-1, (3, D))
        assert not x.is_contiguous() and _rows(x).data_ptr() == x.data_ptr()  # the kernel reads x in place
    elif layout == "rows of 40":
        x = outliers(300, 40, dtype, zero_rows=(3,))
    else:
        x = outliers(150, 2048, dtype).view(30, 5, 2048)
    W = x.shape[-1]
    norm = FusedRMSNorm(W, eps=1e-6, dtype=dtype)
    norm.use_triton = True  # 2048-wide rows run torch's kernels by default
    with torch.no_grad():
        norm.weight.copy_((1 + torch.randn(W)).to(dtype))
    leaf = x.detach().requires_grad_(True)
    y = norm(leaf)
    assert "TritonRMSNorm" in type(y.grad_fn).__name__
    dy = outliers(x.numel() // W, W, dtype).view(x.shape)
    y.backward(dy)
    assert_rms_norm_close(x, norm.weight.detach(), 1e-6, dy, y, leaf.grad, norm.weight.grad, ulps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_qkv_normed_writes_the_qkv_gradient_in_place(dtype):
    """attention._SplitQKVNormed (the split of a fused QKV output plus the Triton q/k norms as one autograd node)
    against the same norms run separately on views of the split, whose backward is autograd's cat: bit-identical
    query, key and value, gradients of the fused input and of both norm weights, and value still a view of the
    input. Then both against float64 (assert_rms_norm_close): the query heads, the key heads, and the value
    gradient passed through exactly."""
    from int8_bounds import assert_rms_norm_close
    from mcore_helpers import split_qkv_both_ways

    from megatron_int8.megatron.attention import _qkv_parts
    from megatron_int8.ops.rms_norm import FusedRMSNorm

    ulps = 1.0 if dtype == torch.bfloat16 else 0.5  # the interpreter's fp32 -> bf16 cast truncates
    S, B, G, P, D = 9, 2, 3, 2, 16  # 3 groups of 2 query heads, a key and a value head each
    mixed = outliers(S * B, G * (P + 2) * D, dtype, zero_rows=(5,)).view(S, B, -1)
    norms = [FusedRMSNorm(D, eps=1e-6, dtype=dtype) for _ in range(2)]
    with torch.no_grad():
        for n in norms:
            n.weight.copy_((1 + torch.randn(D)).to(dtype))
    grads = [outliers(S * B * n, D, dtype).view(S, B, n, D) for n in (G * P, G, G)]

    fused, separate = split_qkv_both_ways(mixed, norms, grads, G, D)
    for a, b in zip(fused, separate):
        assert torch.equal(a, b)
    outs_f, dmix_f, dw_f = fused[:3], fused[3], fused[4:]

    q_in, k_in, v = _qkv_parts(mixed, G, D)
    dq_in, dk_in, dv_in = _qkv_parts(dmix_f, G, D)
    assert torch.equal(dv_in, grads[2]) and torch.equal(outs_f[2], v)
    for x, n, y, dy, dx, dw in ((q_in, norms[0], outs_f[0].view(q_in.shape), grads[0].view(q_in.shape), dq_in, dw_f[0]),
                                (k_in, norms[1], outs_f[1], grads[1], dk_in, dw_f[1])):
        assert_rms_norm_close(x, n.weight.detach(), 1e-6, dy, y, dx, dw, ulps)


@pytest.mark.parametrize("poison", [None, "inf in dq", "nan in dk", "nan in dv"])
def test_split_qkv_normed_hands_the_linear_its_gradient_amax(poison):
    """With emit_amax, the QKV-shaped gradient reaches the layer before the node (the QKV linear; here a probe)
    as the same object, carrying max |gradient| exactly (quantize.known_maxima). An Inf/NaN in the query or
    key gradient makes that norm's dx non-finite and the amax inf; a NaN in the value gradient makes it NaN.
    Either way the quantizer's scale is NaN (the non-finite check), never a finite wrong one."""
    from megatron_int8.megatron.attention import _SplitQKVNormed
    from megatron_int8.reference import known_maxima

    S, B, G, P, D = 7, 2, 2, 3, 16
    leaf = outliers(S * B, G * (P + 2) * D, zero_rows=(3,)).view(S, B, -1).requires_grad_(True)
    wq, wk = ((1 + torch.randn(D)).bfloat16().requires_grad_(True) for _ in range(2))
    grads = [outliers(S * B * n, D).view(S, B, n, D) for n in (G * P, G, G)]
    if poison is not None:
        which = {"inf in dq": 0, "nan in dk": 1, "nan in dv": 2}[poison]
        grads[which][2, 1, 0, 5] = float("inf") if poison.startswith("inf") else float("nan")
    _GradProbe.seen.clear()
    outs = _SplitQKVNormed.apply(_GradProbe.apply(leaf), wq, wk, 1e-6, 1e-6, G, D, True)
    torch.autograd.backward(outs, grads)
    (seen,) = _GradProbe.seen
    known = known_maxima(seen)
    assert known is not None and known.rows is None and known.amax.dim() == 0
    want = seen.float().abs().amax()
    if poison is None:
        assert want > 0 and torch.equal(known.amax, want)
    elif poison == "nan in dv":
        assert known.amax.isnan()
    else:
        assert known.amax == float("inf")
    _GradProbe.seen.clear()
    outs = _SplitQKVNormed.apply(_GradProbe.apply(leaf), wq, wk, 1e-6, 1e-6, G, D, False)
    torch.autograd.backward(outs, grads)
    assert known_maxima(_GradProbe.seen[0]) is None  # nothing attached without emit_amax


def test_rms_norm_backward_rejects_a_destination_it_cannot_write_in_place():
    """A dx destination whose strides do not merge into the input's rows is refused, never silently copied."""
    from megatron_int8.kernels.rms_norm import triton_rms_norm_backward, triton_rms_norm_forward

    x = outliers(2 * 3 * 4, 16).view(2, 3, 4, 16)  # rows [6, 4, 16] for the kernel
    w = torch.ones(16, dtype=torch.bfloat16)
    y, rstd = triton_rms_norm_forward(x, w, 1e-6)
    bad = torch.empty(3, 2, 4, 16, dtype=torch.bfloat16).transpose(0, 1)  # [2, 3, 4, 16]: dims 0, 1 do not merge
    with pytest.raises(ValueError, match="do not merge"):
        triton_rms_norm_backward(y, x, w, rstd, dx=bad)
    with pytest.raises(ValueError, match="destination"):
        triton_rms_norm_backward(y, x, w, rstd, dx=torch.empty(2, 3, 4, 16, dtype=torch.float32))
    strided = torch.empty(4, 2, 3, 16, dtype=torch.bfloat16).permute(1, 2, 0, 3)  # merges: written in place
    dx, _ = triton_rms_norm_backward(y, x, w, rstd, dx=strided)
    assert dx is strided and torch.equal(strided, triton_rms_norm_backward(y, x, w, rstd)[0])


class _GradProbe(torch.autograd.Function):
    """Identity that records the gradient object it receives, as the INT8 linear before SwiGLU (fc1) does."""
    seen = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _GradProbe.seen.append(g)
        return g


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("emit_maxima", [False, True])
def test_swiglu_kernel_forward_backward_and_maxima(dtype, emit_maxima):
    """The Triton SwiGLU (megatron_int8.ops.swiglu) on a ragged 3-D input whose rows are strided (a slice of a
    wider tensor): forward and input gradient against float64; with emit_maxima, the maxima attached to the
    output and to the input gradient are exactly those tensors' row and column maxima."""
    from int8_bounds import assert_swiglu_close

    from megatron_int8.reference import known_maxima
    from megatron_int8.ops.swiglu import swiglu

    ulps = 1.0 if dtype == torch.bfloat16 else 0.5  # the interpreter's fp32 -> bf16 cast truncates
    S, B, F = 5, 9, 37
    wide = outliers(S * B, 2 * F + 6, dtype, zero_rows=(4,)).view(S, B, 2 * F + 6)
    x = wide[..., :2 * F]
    assert not x.is_contiguous()
    leaf = x.detach().requires_grad_(True)
    _GradProbe.seen.clear()
    y = swiglu(_GradProbe.apply(leaf), emit_maxima)
    assert "TritonSwiGLU" in type(y.grad_fn).__name__ and y.shape == (S, B, F)
    dy = outliers(S * B, F, dtype).view(S, B, F)
    y.backward(dy)
    (dx,) = _GradProbe.seen
    assert_swiglu_close(x, dy, y, dx, ulps)
    for t in (y, dx):
        known = known_maxima(t)
        if not emit_maxima:
            assert known is None
            continue
        t2 = t.detach().reshape(-1, t.shape[-1]).float().abs()
        assert torch.equal(known.rows, t2.amax(1)) and torch.equal(known.cols, t2.amax(0))
    if emit_maxima:  # a changed tensor no longer has known maxima
        y.detach().mul_(2)
        assert known_maxima(y) is None


@pytest.mark.parametrize("dtype,probs_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)])
def test_weighted_swiglu_kernel_forward_backward(dtype, probs_dtype):
    """The Triton weighted SwiGLU (grouped MoE experts) on strided rows, F spanning several column blocks:
    y = silu(a) b p, dx, and p's gradient (row sums added up over the column blocks) against float64. A row
    with weight 0 gets zero output and zero input gradient, and still its weight's gradient."""
    from int8_bounds import assert_swiglu_close

    from megatron_int8.ops.swiglu import weighted_swiglu

    ulps = 1.0 if dtype == torch.bfloat16 else 0.5  # the interpreter's fp32 -> bf16 cast truncates
    R, F = 45, 37
    x = outliers(R, 2 * F + 6, dtype, zero_rows=(4,))[:, :2 * F]
    assert not x.is_contiguous()
    probs = torch.rand(R, dtype=torch.float64) * 1.5
    probs[7] = 0
    probs = probs.to(probs_dtype)
    leaf, p_leaf = x.detach().requires_grad_(True), probs.clone().requires_grad_(True)
    y = weighted_swiglu(leaf, p_leaf)
    assert "TritonWeightedSwiGLU" in type(y.grad_fn).__name__ and y.shape == (R, F) and y.dtype == dtype
    dy = outliers(R, F, dtype)
    y.backward(dy)
    assert leaf.grad.dtype == dtype and p_leaf.grad.dtype == probs_dtype
    assert_swiglu_close(x, dy, y.detach(), leaf.grad, ulps, probs=probs, dprobs=p_leaf.grad)
    assert (y[7] == 0).all() and (leaf.grad[7] == 0).all() and p_leaf.grad[7] != 0


def test_weighted_swiglu_kernel_empty_and_bad_weights():
    from megatron_int8.kernels.swiglu import triton_swiglu_forward, triton_weighted_swiglu_backward

    x, p = torch.empty(0, 8), torch.empty(0)
    y, _, _ = triton_swiglu_forward(x, probs=p)
    dx, dp = triton_weighted_swiglu_backward(torch.empty(0, 4), x, p)
    assert y.shape == (0, 4) and dx.shape == (0, 8) and dp.shape == (0,)
    x, p = torch.empty(3, 0), torch.rand(3)  # rows without columns: the weights' gradient is zero
    dx, dp = triton_weighted_swiglu_backward(torch.empty(3, 0), x, p)
    assert dx.shape == (3, 0) and torch.equal(dp, torch.zeros(3))
    x = outliers(6, 8)
    for bad in (torch.rand(5), torch.rand(6, 1), torch.arange(6)):
        with pytest.raises(ValueError, match="probs"):
            triton_swiglu_forward(x, probs=bad)


def test_swiglu_kernel_non_finite_maxima():
    """An Inf or NaN in SwiGLU's output makes its row's and column's maxima inf (a NaN scale downstream)."""
    from megatron_int8.kernels.swiglu import triton_swiglu_backward, triton_swiglu_forward

    x = outliers(21, 2 * 19)
    x[3, 5] = float("nan")
    x[7, 19 + 2] = float("inf")  # b of column 2 in row 7: silu(a) * inf
    y, rows, cols = triton_swiglu_forward(x, maxima=True)
    bad_rows, bad_cols = ~torch.isfinite(y).all(1), ~torch.isfinite(y).all(0)
    assert bad_rows[3] and bad_rows[7] and bad_cols[5]
    assert torch.isinf(rows[bad_rows]).all() and torch.isinf(cols[bad_cols]).all()
    assert torch.equal(rows[~bad_rows], y[~bad_rows].float().abs().amax(1))
    dx, rows, cols = triton_swiglu_backward(outliers(21, 19), x, maxima=True)
    bad_rows, bad_cols = ~torch.isfinite(dx).all(1), ~torch.isfinite(dx).all(0)
    assert torch.isinf(rows[bad_rows]).all() and torch.isinf(cols[bad_cols]).all()
    assert torch.equal(cols[~bad_cols], dx[:, ~bad_cols].float().abs().amax(0))


@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_mlp_with_swiglu_maxima_skips_two_amax_passes(launch_log, granularity):
    """fc1 -> SwiGLU -> fc2 with INT8 linears: with the SwiGLU's maxima handed over, fc2's input and fc1's
    output gradient are quantized without an amax pass of their own, and every output and gradient is
    bit-identical to the run without them (the maxima are exact)."""
    from megatron_int8.ops.swiglu import swiglu

    recipe = Int8Recipe(granularity=granularity, backend="triton", cache_weights=False)
    T, H, F = 40, 24, 36
    x = outliers(T, H)
    w1, w2 = outliers(2 * F, H) / 8, outliers(H, F) / 8
    dy = outliers(T, H)
    results = {}
    for emit in (False, True):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, w1, w2)]
        launch_log.clear()
        out = int8_linear(swiglu(int8_linear(leaves[0], leaves[1], None, recipe), emit), leaves[2], None, recipe)
        out.backward(dy)
        results[emit] = (out, *(t.grad for t in leaves))
        amax_launches = launch_log.count("_amax_kernel")
        # weights (cache off): 4, forward and backward; activations and gradients: 4, 2 with known maxima
        assert amax_launches == (6 if emit else 8), launch_log
    for got, want in zip(results[True], results[False]):
        assert torch.equal(got, want)


# In the parent pytest process every test above is skipped (the two driver tests run them in the subprocess).
DRIVERS = {"test_kernels_under_triton_interpreter", "test_kernels_under_triton_interpreter_more_cases"}
for _name, _fn in list(globals().items()):
    if _name.startswith("test_") and callable(_fn) and _name not in DRIVERS:
        globals()[_name] = needs_interpreter(_fn)
