"""The Triton kernels against the PyTorch reference backend, on CPU under TRITON_INTERPRET=1.

Tiny ragged shapes so the interpreter stays quick. Quantized int8 data and scales must be bit-identical
to the reference; the GEMM's integer accumulation exact and its dequantized output equal up to fp32
rounding.

Triton decides at import time (and at each @triton.jit) whether it interprets, so TRITON_INTERPRET must be
set before triton is first imported, which another test file of the session may already have done. This
file therefore runs its tests in a subprocess started with TRITON_INTERPRET=1 (one driver test in the
parent session); run directly with TRITON_INTERPRET=1 set, the tests run in-process:
    TRITON_INTERPRET=1 python3 -m pytest -q tests/test_kernels.py
"""
import importlib
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

if not INTERPRETING:

    def test_kernels_under_triton_interpreter():
        """Run this file's tests in a fresh interpreter with TRITON_INTERPRET=1 set before triton loads."""
        env = dict(os.environ, TRITON_INTERPRET="1")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__)],
            cwd=root, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"kernel tests failed under TRITON_INTERPRET=1:\n{proc.stdout[-20000:]}\n{proc.stderr[-5000:]}"
        assert " passed" in proc.stdout and "no tests ran" not in proc.stdout, proc.stdout[-2000:]

from megatron_int8 import Int8Recipe, NonFiniteError, int8_linear  # noqa: E402
from megatron_int8.backend import ReferenceBackend  # noqa: E402

qref = importlib.import_module("megatron_int8.quantize")
REF = ReferenceBackend()
VARIANTS = [("tensor", False), ("tensor", True), ("row", False), ("row", True), ("block", False), ("block", True)]

needs_interpreter = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")


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
@pytest.mark.parametrize("granularity,weight", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_quantize_bit_exact_both_layouts(K, granularity, weight, dtype):
    x = outliers(37, 53, dtype, zero_rows=(5,), zero_cols=(7,))  # ragged in both dims, all-zero groups
    kw = _kw(granularity, weight, rowwise=True, columnwise=True)
    r1, c1 = K.triton_quantize(x, **kw)
    r0, c0 = REF.quantize(x, **kw)
    assert_same_qtensor(r1, r0, "rowwise")
    assert_same_qtensor(c1, c0, "columnwise")
    assert r1.data.abs().max() == 127 and c1.data.abs().max() == 127


@pytest.mark.parametrize("granularity,weight", VARIANTS)
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


@pytest.mark.parametrize("granularity,weight", VARIANTS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite(K, granularity, weight, bad):
    x = outliers(37, 53)
    x[11, 17] = bad
    kw = _kw(granularity, weight, rowwise=True, columnwise=True, name="fc1 input")
    with pytest.raises(NonFiniteError, match="fc1 input"):
        K.triton_quantize(x, **kw)
    kw["check_finite"] = False
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
@pytest.mark.parametrize("M,N,Kd", [(37, 29, 53), (16, 16, 16), (5, 70, 96)])
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
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
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
        recipe = Int8Recipe(granularity=granularity, block_size=16, backend=name)
        y = int8_linear(x, w, b, recipe)
        y.backward(dy)
        res[name] = (y.detach(), x.grad, w.grad, b.grad)
    for what, got, want in zip(("output", "dgrad", "wgrad", "bias grad"), res["triton"], res["reference"]):
        assert_close_fp32(got, want, f"{granularity} {what}")


@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_tma_persistent_kernel(K, granularity, accumulate):
    """The persistent TMA-descriptor variant (chosen on Hopper when faster): ragged M and N, bias, accumulate."""
    from megatron_int8.kernels import int8_gemm as G

    M, N, Kd = 37, 36, 96  # more tiles than programs: the persistent loop visits several
    qa = _q(outliers(M, Kd), granularity, False)
    qb = _q(outliers(N, Kd), granularity, True)
    bias = torch.randn(N)
    main = torch.randn(M, N)
    out = main.clone() if accumulate else torch.full((M, N), float("nan"))
    G._int8_gemm_tma_kernel[(3,)](qa.data, qb.data, out, qa.scale, qb.scale, bias, M, N, Kd,
                                  SCALE_MODE=0 if granularity == "tensor" else 1, HAS_BIAS=True,
                                  ACCUMULATE=accumulate, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2,
                                  NUM_SMS=3, FLATTEN=True)
    want = REF.gemm(qa, qb, out_dtype=torch.float32, bias=bias, accumulate_into=main.clone() if accumulate else None)
    assert_close_fp32(out, want, f"tma {granularity}")


# In the parent session every test above is skipped (the driver test runs them in the subprocess).
for _name, _fn in list(globals().items()):
    if _name.startswith("test_") and callable(_fn) and _name != "test_kernels_under_triton_interpreter":
        globals()[_name] = needs_interpreter(_fn)
