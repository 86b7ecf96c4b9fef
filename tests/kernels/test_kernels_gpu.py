"""The Triton kernels against the reference backend on a CUDA GPU, at real and ragged sizes.

Quantization is compared with the reference run on the CPU: on CUDA, torch computes the reference's
`amax / 127` (a division by a Python scalar) as amax * fl(1/127), which is not the IEEE division that the
contract (and the kernels, through div_rn) specify, so its scales can differ by one ulp. The reference GEMM
runs on CUDA except where its torch._int_mm calls cannot take the operands (a K-block slice whose row
stride is not a multiple of 8 is rejected by cuBLASLt); there it runs on the CPU too.

Skipped without CUDA (tests/conftest.py). Fresh heavy-tailed random data with outliers, never zeros.
Quantization: int8 data and fp32 scales bit-identical to the reference (IEEE reciprocal of the scale, round half to even).
GEMM: integer accumulation exact; dequantized outputs within fp32 rounding of the reference, bounded by
the magnitudes |a| @ |b| that the epilogue sums. int8_linear: backend "triton" vs "reference", outputs and
every gradient.
"""
import importlib
import math

import pytest
import torch

pytestmark = pytest.mark.gpu

qref = importlib.import_module("megatron_int8.reference")
VARIANTS = [("tensor", False), ("tensor", True), ("row", False), ("row", True), ("block", False), ("block", True)]
EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def K():
    pytest.importorskip("triton")
    return importlib.import_module("megatron_int8.kernels")


@pytest.fixture(scope="module")
def REF():
    from megatron_int8.reference import ReferenceBackend

    return ReferenceBackend()


def outliers(R, C, dtype=torch.bfloat16, device="cuda"):
    x = torch.randn(R, C, device=device) * torch.rand(R, 1, device=device).add(0.1)  # per-row spread
    spikes = torch.rand(R, C, device=device) < 1e-3
    x = torch.where(spikes, x.sign() * (5 + torch.rand(R, C, device=device) * 500), x)
    x[:, 3] *= 40  # an outlier channel
    return x.to(dtype)


def _to(qt, device):
    if qt is None:
        return None
    return qref.QTensor(qt.data.to(device), qt.scale.to(device), qt.granularity, qt.block_size, qt.tile2d)


def ref_quantize(REF, x, **kw):
    """The reference quantization, computed on the CPU (IEEE scale division), returned on x's device."""
    return tuple(_to(q, x.device) for q in REF.quantize(x.cpu(), **kw))


def ref_gemm(REF, qa, qb, **kw):
    if qa.data.shape[1] % 8 == 0 or qa.granularity != "block":
        return REF.gemm(qa, qb, **kw)
    kw = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in kw.items()}
    return REF.gemm(_to(qa, "cpu"), _to(qb, "cpu"), **kw).cuda()


def use_gemm_route(monkeypatch, route: str) -> None:
    """MEGATRON_INT8_GEMM_KERNEL=`route`; "triton-hopper": the Hopper route with the CUDA kernel made unavailable,
    i.e. Triton's TMA and Gluon kernels as a Hopper without nvcc runs them, with fresh plan and dispatch caches
    (their keys hold the variable, not the CUDA kernel's availability)."""
    from megatron_int8.kernels import int8_gemm as G
    from megatron_int8.kernels.launch import PlanCache

    monkeypatch.setenv("MEGATRON_INT8_GEMM_KERNEL", "hopper" if route == "triton-hopper" else route)
    if route == "triton-hopper":
        monkeypatch.setattr(G.sm90_gemm, "available", lambda: False)
        monkeypatch.setattr(G, "_PLANS", PlanCache(64))
        monkeypatch.setattr(G, "_fast", {})


def _kw(g, weight, block_size=128, **kw):
    return dict(granularity=g, block_size=block_size, weight=weight, **kw)


def assert_same_qtensor(got, want, what):
    assert got.data.shape == want.data.shape and got.scale.shape == want.scale.shape, what
    assert (got.granularity, got.block_size, got.tile2d) == (want.granularity, want.block_size, want.tile2d), what
    assert torch.equal(got.scale, want.scale), f"{what}: scales differ"
    n = (got.data != want.data).sum().item()
    assert n == 0, f"{what}: {n} int8 values differ"


@pytest.mark.parametrize("granularity,weight", VARIANTS)
@pytest.mark.parametrize("shape", [(8192, 4096), (4096, 11008), (1000, 1537), (3, 4099)])
def test_quantize_bit_exact(K, REF, granularity, weight, shape):
    x = outliers(*shape)
    for rowwise, columnwise in ((True, True), (True, False), (False, True)):
        kw = _kw(granularity, weight, rowwise=rowwise, columnwise=columnwise)
        got, want = K.triton_quantize(x, **kw), ref_quantize(REF, x, **kw)
        for g, w, what in zip(got, want, ("rowwise", "columnwise")):
            assert (g is None) == (w is None)
            if w is not None:
                assert_same_qtensor(g, w, f"{granularity} weight={weight} {shape} {what} ({rowwise},{columnwise})")


@pytest.mark.parametrize("granularity,weight", VARIANTS)
@pytest.mark.parametrize("magnitude", [1e-38, 1e-42])
def test_quantize_tiny_groups_bit_exact(K, REF, granularity, weight, magnitude):
    # groups whose amax/127 falls below 2^-126 take that scale, on the GPU as in the reference
    x = (outliers(1000, 1537, torch.float32) * magnitude).float()
    kw = _kw(granularity, weight, rowwise=True, columnwise=True)
    got, want = K.triton_quantize(x, **kw), ref_quantize(REF, x, **kw)
    for g, w, what in zip(got, want, ("rowwise", "columnwise")):
        assert_same_qtensor(g, w, f"{granularity} weight={weight} x{magnitude} {what}")
        assert (g.scale >= 2.0 ** -126).all()


@pytest.mark.parametrize("granularity,weight", VARIANTS)
def test_quantize_padded_transpose_and_wgrad(K, REF, granularity, weight):
    """An MoE expert's token count (1037: not a multiple of 16) padded to 1040 in Q(x^T): bit-identical to
    the padded reference, zero pad, and the wgrad-shaped GEMM over the padded tokens equals the reference
    product of the unpadded operands."""
    x, g = outliers(1037, 4096), outliers(1037, 1536)
    kw = _kw(granularity, weight, rowwise=True, columnwise=True, columnwise_pad=16)
    got, want = K.triton_quantize(x, **kw), ref_quantize(REF, x, **kw)
    assert got[1].data.shape == (4096, 1040) and not got[1].data[:, 1037:].any()
    for a, b, what in zip(got, want, ("rowwise", "columnwise")):
        assert_same_qtensor(a, b, f"{granularity} weight={weight} padded {what}")
    kg = _kw(granularity, False, rowwise=False, columnwise=True)
    _, qg = K.triton_quantize(g, columnwise_pad=16, **kg)
    if qg.tile2d == got[1].tile2d:
        _, qg0 = ref_quantize(REF, g, **kg)
        _, qx0 = ref_quantize(REF, x, **dict(kw, rowwise=False, columnwise_pad=1))
        out = K.triton_gemm(qg, got[1], out_dtype=torch.float32)
        ref_out = ref_gemm(REF, qg0, qx0, out_dtype=torch.float32)
        bound = 16 * EPS * (qg0.dequantize().abs() @ qx0.dequantize().abs().t())
        assert ((out - ref_out).abs() <= bound).all(), granularity


def test_quantize_given_column_amax(K, REF):
    """Row-wise Q(x^T) with the TP group's per-column amax (the sequence-parallel INT8 all-gather)."""
    x = outliers(4096, 4096)
    col_amax = x.float().abs().amax(dim=0) * torch.where(torch.rand(4096, device="cuda") < 0.5, 3.0, 1.0)
    kw = _kw("row", False, rowwise=True, columnwise=True, columnwise_amax=col_amax)
    for got, want, what in zip(K.triton_quantize(x, **kw), ref_quantize(REF, x, **dict(kw, columnwise_amax=col_amax.cpu())),
                               ("rowwise", "columnwise")):
        assert_same_qtensor(got, want, f"given column amax, {what}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantize_other_dtypes_and_block_sizes(K, REF, dtype):
    x = outliers(2000, 3001, dtype)
    for g, w, b in [("tensor", False, 128), ("row", False, 128), ("block", False, 64), ("block", True, 96),
                    ("block", False, 256)]:
        kw = _kw(g, w, block_size=b, rowwise=True, columnwise=True)
        for got, want, what in zip(K.triton_quantize(x, **kw), ref_quantize(REF, x, **kw), ("row", "col")):
            assert_same_qtensor(got, want, f"{g} B={b} {dtype} {what}")


@pytest.mark.parametrize("granularity,weight", VARIANTS)
def test_non_finite(K, REF, granularity, weight):
    from megatron_int8 import NonFiniteError, raise_if_nonfinite

    for bad in (float("inf"), float("nan")):
        x = outliers(1000, 1537)
        x[700, 1300] = bad
        kw = _kw(granularity, weight, rowwise=True, columnwise=True, name="fc2 output gradient")
        with pytest.raises(NonFiniteError, match="fc2 output gradient"):
            K.triton_quantize(x, **dict(kw, check_finite="immediate"))
        K.triton_quantize(outliers(1000, 1537), **kw)  # deferred (the default): a finite tensor ...
        raise_if_nonfinite()  # ... leaves no flag
        K.triton_quantize(x, **kw)
        with pytest.raises(NonFiniteError, match="fc2 output gradient"):
            raise_if_nonfinite()
        kw["check_finite"] = "off"
        for got, want in zip(K.triton_quantize(x, **kw), ref_quantize(REF, x, **kw)):
            nan = torch.isnan(want.scale)
            assert nan.any() and torch.equal(torch.isnan(got.scale), nan)
            assert torch.equal(got.scale[~nan], want.scale[~nan])
            fin = torch.isfinite(qref.dequantize(want))
            assert torch.equal(got.data[fin], want.data[fin])


def test_stochastic_rounding(K, REF):
    x = outliers(4096, 4096, torch.float32)
    for g, w in [("tensor", False), ("row", False), ("block", False)]:
        kw = _kw(g, w, rowwise=True, columnwise=True)
        near = ref_quantize(REF, x, **kw)
        sr = K.triton_quantize(x, stochastic=True, **kw)
        for got, n, src in ((sr[0], near[0], x), (sr[1], near[1], x.t())):
            assert torch.equal(got.scale, n.scale)
            s = qref.dequantize(qref.QTensor(torch.ones_like(n.data), n.scale, g, 128, n.tile2d))
            v = src * (torch.ones_like(s) / s)  # the contract: x times the IEEE reciprocal of its scale
            d = got.data.float() - torch.floor(v).clamp(-127, 127)
            assert ((d == 0) | (d == 1)).all(), g
            frac = v - torch.floor(v)
            err = got.data.float() - v
            # unbiased: E[q - v] = 0 (n ~ 16M draws; sd of the mean < 1e-3)
            assert abs(err.mean().item()) < 2e-3, (g, err.mean().item())
            # P(round up) = frac
            inside = (v > -127) & (v < 127)
            assert abs((d == 1)[inside].float().mean().item() - frac[inside].mean().item()) < 2e-3
    # Q(x)^T reuses Q(x)'s draws for tensorwise scales
    r, c = K.triton_quantize(x, stochastic=True, **_kw("tensor", False, rowwise=True, columnwise=True))
    assert torch.equal(c.data, r.data.t())


def _abs(q):
    return qref.QTensor(q.data.abs(), q.scale.abs(), q.granularity, q.block_size, q.tile2d)


def _mag(qa, qb, REF):
    """|a| @ |b| with the same scales: bounds the sum of magnitudes the fp32 epilogue adds up."""
    return ref_gemm(REF, _abs(qa), _abs(qb), out_dtype=torch.float32)


def assert_gemm_close(got, want, mag, what, n_terms=1):
    assert got.shape == want.shape and got.dtype == want.dtype, what
    tol = 4 * n_terms * EPS * mag + 1e-30
    err = (got.float() - want.float()).abs()
    bad = ~(err <= tol)
    assert not bad.any(), f"{what}: {bad.sum().item()} outputs off, worst err {err.max().item()}"


GEMM_SHAPES = [(8192, 4096, 4096), (8192, 11008, 4096), (8192, 4096, 14336), (4096, 4096, 8192),
               (1000, 1537, 777), (37, 29, 53), (4100, 257, 4224)]


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@pytest.mark.parametrize("M,N,Kd", GEMM_SHAPES)
def test_gemm_matches_reference(K, REF, granularity, M, N, Kd):
    qa, _ = REF.quantize(outliers(M, Kd), **_kw(granularity, False, rowwise=True, columnwise=False))
    qb, _ = REF.quantize(outliers(N, Kd), **_kw(granularity, True, rowwise=True, columnwise=False))
    mag = _mag(qa, qb, REF)
    nkb = -(-Kd // 128) if granularity == "block" else 1
    want = ref_gemm(REF, qa, qb, out_dtype=torch.float32)
    assert_gemm_close(K.triton_gemm(qa, qb, out_dtype=torch.float32), want, mag, f"{granularity} fp32", nkb)
    bias = torch.randn(N, device="cuda").bfloat16()
    want = ref_gemm(REF, qa, qb, out_dtype=torch.bfloat16, bias=bias)
    got = K.triton_gemm(qa, qb, out_dtype=torch.bfloat16, bias=bias)
    ulp = 2.0 ** -7 * want.float().abs()
    assert ((got.float() - want.float()).abs() <= ulp + 4 * nkb * EPS * (mag + bias.float().abs())).all()
    main = torch.randn(M, N, device="cuda")
    want = ref_gemm(REF, qa, qb, out_dtype=torch.float32, accumulate_into=main.clone())
    buf = main.clone()
    got = K.triton_gemm(qa, qb, out_dtype=torch.float32, accumulate_into=buf)
    assert got is buf
    assert_gemm_close(got, want, mag + main.abs(), f"{granularity} accumulate_into", nkb + 1)


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_gemm_into_row_ranges_equals_whole(K, REF, granularity):
    """The pipelined TP GEMMs: the rows of one output written range by range (TMA-eligible offsets and an
    unaligned one) equal one GEMM over all rows, bit for bit (each output tile's sum is the same)."""
    M, N, Kd = 4096, 3840, 2560
    qa, _ = REF.quantize(outliers(M, Kd), **_kw(granularity, False, rowwise=True, columnwise=False))
    qb, _ = REF.quantize(outliers(N, Kd), **_kw(granularity, True, rowwise=True, columnwise=False))
    whole = K.triton_gemm(qa, qb, out_dtype=torch.bfloat16)
    for cuts in ((0, 2048, M), (0, 1000, 3001, M)):
        out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
        for lo, hi in zip(cuts, cuts[1:]):
            got = K.triton_gemm(qa.row_range(slice(lo, hi)), qb, out_dtype=torch.bfloat16, out=out[lo:hi])
            assert got.data_ptr() == out[lo:hi].data_ptr()
        assert torch.equal(out, whole), cuts


@pytest.mark.parametrize("granularity,M,N,Kd", [("tensor", 8192, 4096, 4096), ("row", 1000, 1537, 777),
                                                ("block", 4100, 257, 4224)])
def test_gemm_autotuned_path(K, REF, granularity, M, N, Kd, monkeypatch):
    """The autotuned configs (the GPU test run may set MEGATRON_INT8_GEMM_AUTOTUNE=0 for the others)."""
    monkeypatch.setenv("MEGATRON_INT8_GEMM_AUTOTUNE", "1")
    qa, _ = REF.quantize(outliers(M, Kd), **_kw(granularity, False, rowwise=True, columnwise=False))
    qb, _ = REF.quantize(outliers(N, Kd), **_kw(granularity, True, rowwise=True, columnwise=False))
    nkb = -(-Kd // 128) if granularity == "block" else 1
    assert_gemm_close(K.triton_gemm(qa, qb, out_dtype=torch.float32), ref_gemm(REF, qa, qb, out_dtype=torch.float32),
                      _mag(qa, qb, REF), f"autotuned {granularity}", nkb)
    main = torch.randn(M, N, device="cuda")
    buf = main.clone()
    K.triton_gemm(qa, qb, out_dtype=torch.float32, accumulate_into=buf)  # autotuning must not double-add
    want = ref_gemm(REF, qa, qb, out_dtype=torch.float32, accumulate_into=main.clone())
    assert_gemm_close(buf, want, _mag(qa, qb, REF) + main.abs(), f"autotuned {granularity} accumulate", nkb + 1)


@pytest.mark.parametrize("kernel", ["auto", "portable"])
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("M,N,Kd", [(1037, 14336, 4096), (4096, 1536, 1040), (3, 4096, 1040)])
def test_gemm_untuned_expert_shapes(K, REF, kernel, granularity, M, N, Kd, monkeypatch):
    """autotune=False (MoE experts): the fixed TMA tile ("auto", operands eligible) or the plain kernel's
    fixed tile, on expert-like shapes: a ragged token count as M (fprop), a padded one as K (wgrad into
    main_grad), and an expert with 3 tokens."""
    from megatron_int8.kernels import int8_gemm as G

    use_gemm_route(monkeypatch, kernel)
    qa, _ = REF.quantize(outliers(M, Kd), **_kw(granularity, False, rowwise=True, columnwise=False))
    qb, _ = REF.quantize(outliers(N, Kd), **_kw(granularity, True, rowwise=True, columnwise=False))
    mag = _mag(qa, qb, REF)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    mode = G._SCALE_TENSOR if granularity == "tensor" else G._SCALE_ROW
    assert G._tma_eligible(qa.data, qb.data, out, mode, False), "these shapes must reach the TMA kernel"
    n = len(G._fast)
    bias = torch.randn(N, device="cuda").bfloat16()
    want = ref_gemm(REF, qa, qb, out_dtype=torch.bfloat16, bias=bias)
    got = K.triton_gemm(qa, qb, out_dtype=torch.bfloat16, bias=bias, autotune=False)
    assert ((got.float() - want.float()).abs() <= 2.0 ** -7 * want.float().abs() + 4 * EPS * (mag + 1)).all()
    main = torch.randn(M, N, device="cuda")
    buf = main.clone()
    K.triton_gemm(qa, qb, out_dtype=torch.float32, accumulate_into=buf, autotune=False)
    want = ref_gemm(REF, qa, qb, out_dtype=torch.float32, accumulate_into=main.clone())
    assert_gemm_close(buf, want, mag + main.abs(), f"untuned {kernel} {granularity} accumulate_into", 2)
    assert len(G._fast) == n, "an untuned call must not autotune or cache a tuned launcher"


@pytest.mark.parametrize("kernel", ["auto", "portable", "triton-hopper"])
def test_gemm_cached_dispatch(K, REF, kernel, monkeypatch):
    """Calls after the first (autotuned) one launch the cached kernel/config directly: same results."""
    from megatron_int8.kernels import int8_gemm as G

    monkeypatch.setenv("MEGATRON_INT8_GEMM_AUTOTUNE", "1")
    use_gemm_route(monkeypatch, kernel)
    M, N, Kd = 2048, 1536, 1024
    qa, _ = REF.quantize(outliers(M, Kd), **_kw("tensor", False, rowwise=True, columnwise=False))
    qb, _ = REF.quantize(outliers(N, Kd), **_kw("tensor", True, rowwise=True, columnwise=False))
    bias = torch.randn(N, device="cuda").bfloat16()
    first = K.triton_gemm(qa, qb, out_dtype=torch.bfloat16, bias=bias)
    n = len(G._fast)
    for _ in range(3):
        assert torch.equal(K.triton_gemm(qa, qb, out_dtype=torch.bfloat16, bias=bias), first)
    assert len(G._fast) == n
    want = ref_gemm(REF, qa, qb, out_dtype=torch.bfloat16, bias=bias)
    assert ((first.float() - want.float()).abs() <= 2.0 ** -7 * want.float().abs() + 4 * EPS * (_mag(qa, qb, REF) + 1)).all()
    main = torch.randn(M, N, device="cuda")  # fp32 accumulate: first tuned (restoring the buffer), then cached
    bufs = [main.clone() for _ in range(3)]
    for b in bufs:
        K.triton_gemm(qa, qb, out_dtype=torch.float32, accumulate_into=b)
    assert torch.equal(bufs[0], bufs[1]) and torch.equal(bufs[1], bufs[2])
    want = ref_gemm(REF, qa, qb, out_dtype=torch.float32, accumulate_into=main.clone())
    assert_gemm_close(bufs[0], want, _mag(qa, qb, REF) + main.abs(), f"{kernel} cached accumulate", 2)


@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("M,N,Kd", [(8192, 4096, 4096), (1000, 1544, 784), (4100, 264, 4224)])
def test_gemm_tma_persistent_forced(K, REF, granularity, M, N, Kd, monkeypatch):
    monkeypatch.setenv("MEGATRON_INT8_GEMM_AUTOTUNE", "1")
    use_gemm_route(monkeypatch, "triton-hopper")
    qa, _ = REF.quantize(outliers(M, Kd), **_kw(granularity, False, rowwise=True, columnwise=False))
    qb, _ = REF.quantize(outliers(N, Kd), **_kw(granularity, True, rowwise=True, columnwise=False))
    mag = _mag(qa, qb, REF)
    bias = torch.randn(N, device="cuda").bfloat16()
    want = ref_gemm(REF, qa, qb, out_dtype=torch.bfloat16, bias=bias)
    got = K.triton_gemm(qa, qb, out_dtype=torch.bfloat16, bias=bias)
    assert ((got.float() - want.float()).abs() <= 2.0 ** -7 * want.float().abs() + 4 * EPS * (mag + 1)).all()
    # fp32 outputs: the TMA epilogue (a store, and the wgrad's reduce-add into main_grad)
    assert_gemm_close(K.triton_gemm(qa, qb, out_dtype=torch.float32), ref_gemm(REF, qa, qb, out_dtype=torch.float32),
                      mag, f"tma {granularity} fp32", 1)
    main = torch.randn(M, N, device="cuda")
    buf = main.clone()
    K.triton_gemm(qa, qb, out_dtype=torch.float32, accumulate_into=buf)  # autotuning must not double-add
    want = ref_gemm(REF, qa, qb, out_dtype=torch.float32, accumulate_into=main.clone())
    assert_gemm_close(buf, want, mag + main.abs(), f"tma {granularity} accumulate_into", 2)


@pytest.mark.parametrize("M,N,Kd", [(4096, 4096, 8192), (1000, 1544, 784)])
def test_tma_reduce_add_epilogue(K, REF, M, N, Kd):
    """The wgrad's TMA reduce-add into main_grad in TMA_TILE's configuration (4 column sub-tiles, 2 programs per
    SM): within fp32 rounding of the reference, bit-identical when repeated, and twice the product when run
    twice."""
    from megatron_int8.kernels import int8_gemm as G

    qa, _ = REF.quantize(outliers(M, Kd), **_kw("row", False, rowwise=True, columnwise=False))
    qb, _ = REF.quantize(outliers(N, Kd), **_kw("row", True, rowwise=True, columnwise=False))
    mag = _mag(qa, qb, REF)
    main = torch.randn(M, N, device="cuda") * mag.mean()

    def launch(buf):  # the TMA kernel alone in TMA_TILE's configuration (the package may route a GEMM elsewhere)
        opts = G.TMA_TILE.launch_options(G.num_sms(buf.device))
        G._ensure_allocator()
        grid = (min(opts["NUM_SMS"], G.cdiv(M, opts["BLOCK_M"]) * G.cdiv(N, opts["BLOCK_N"])),)
        G._int8_gemm_tma_kernel[grid](qa.data, qb.data, buf, qa.scale, qb.scale, buf, M, N, Kd, qa.data.stride(0),
                                      qb.data.stride(0), qb.scale, N, SCALE_MODE=1, HAS_BIAS=False, ACCUMULATE=True,
                                      **opts)
        return buf

    want = ref_gemm(REF, qa, qb, out_dtype=torch.float32, accumulate_into=main.clone())
    got = launch(main.clone())
    assert_gemm_close(got, want, mag + main.abs(), "reduce-add", 2)
    assert torch.equal(got, launch(main.clone())), "the reduce-add must be deterministic"
    twice = launch(launch(main.clone()))
    want2 = ref_gemm(REF, qa, qb, out_dtype=torch.float32, accumulate_into=want.clone())
    assert_gemm_close(twice, want2, 2 * mag + main.abs(), "reduce-add twice", 4)


def test_tma_kernel_on_autograd_thread(K, monkeypatch):
    """The backward pass runs on autograd's thread: the TMA kernel's allocator must be set there too."""
    from megatron_int8 import Int8Recipe, int8_linear

    monkeypatch.setenv("MEGATRON_INT8_GEMM_AUTOTUNE", "1")
    use_gemm_route(monkeypatch, "triton-hopper")

    x = outliers(4096, 1024).requires_grad_(True)
    w = (outliers(2048, 1024) * 0.02).requires_grad_(True)
    y = int8_linear(x, w, None, Int8Recipe(backend="triton", check_finite="off"))
    y.backward(outliers(4096, 2048))
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


def test_gemm_integer_accumulation_exact(K):
    # K = 1024: |acc| <= 127*127*1024 < 2^24, so the fp32 output shows the int32 accumulator exactly;
    # the larger K compare equal after the same int32 -> fp32 rounding
    for M, N, Kd in [(8192, 4096, 1024), (1000, 1234, 1040), (8192, 4096, 8192), (777, 1234, 4099)]:
        a = torch.randint(-127, 128, (M, Kd), dtype=torch.int8, device="cuda")
        b = torch.randint(-127, 128, (N, Kd), dtype=torch.int8, device="cuda")
        a[5], b[7] = 127, -127
        one = torch.tensor(1.0, device="cuda")
        out = K.triton_gemm(qref.QTensor(a, one, "tensor"), qref.QTensor(b, one, "tensor"), out_dtype=torch.float32)
        # both sides round the same exact int32 to fp32
        assert torch.equal(out, qref.int_mm(a, b).float())
        assert out[5, 7].item() == torch.tensor(-127 * 127 * Kd, dtype=torch.float32).item()


def test_gemm_long_contraction_splits_exactly(K, REF):
    Kd = qref.MAX_EXACT_K + 4000  # int32 would overflow at 127*127*K
    a = torch.full((64, Kd), 127, dtype=torch.int8, device="cuda")
    b = torch.full((48, Kd), 127, dtype=torch.int8, device="cuda")
    b[1] = -127
    for g in ("tensor", "row"):
        sa = torch.tensor(0.5, device="cuda") if g == "tensor" else torch.rand(64, device="cuda")
        sb = torch.tensor(0.25, device="cuda") if g == "tensor" else torch.rand(48, device="cuda")
        qa, qb = qref.QTensor(a, sa, g), qref.QTensor(b, sb, g)
        got = K.triton_gemm(qa, qb, out_dtype=torch.float32)
        want = REF.gemm(qa, qb, out_dtype=torch.float32)
        assert torch.equal(got, want), g
        exact = 127.0 * 127.0 * Kd
        assert (got[:, 0] > 0).all() and (got[:, 1] < 0).all()
        rel = (got[0, 0] / (sa.reshape(-1)[0] * sb.reshape(-1)[0]) / exact - 1).abs().item()
        assert rel < 1e-6


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@pytest.mark.parametrize("fusion", [False, True])
def test_int8_linear_triton_vs_reference(granularity, fusion):
    from megatron_int8 import Int8Recipe, TPOptions, int8_linear

    x0 = outliers(2 * 1024, 2048).reshape(2, 1024, 2048)
    w0 = (outliers(3072, 2048) * 0.02).bfloat16()
    b0 = torch.randn(3072, device="cuda").bfloat16()
    dy = outliers(2048, 3072).reshape(2, 1024, 3072)
    res = {}
    for name in ("reference", "triton"):
        x, w, b = (t.clone().requires_grad_(True) for t in (x0, w0, b0))
        if fusion:
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device="cuda")
        recipe = Int8Recipe(granularity=granularity, backend=name, grad_rounding="nearest")  # same RNG-free path
        y = int8_linear(x, w, b, recipe, tp=TPOptions(gradient_accumulation_fusion=fusion))
        y.backward(dy)
        res[name] = (y.detach(), x.grad, w.main_grad if fusion else w.grad, b.grad)
    for what, got, want in zip(("output", "dgrad", "wgrad", "bias grad"), res["triton"], res["reference"]):
        assert got.dtype == want.dtype and got.shape == want.shape, what
        assert torch.isfinite(got).all(), what
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert rel < 2e-3, f"{granularity} {what}: relative error {rel}"  # bf16 output rounding only
        close = (got.float() - want.float()).abs() <= 2.0 ** -7 * want.float().abs() + 1e-3 * want.float().abs().max()
        assert close.float().mean() > 0.9999, f"{granularity} {what}"


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_linear_with_no_tokens(K, granularity):
    """An MoE expert that received no tokens: M = 0 in fprop and dgrad, K = 0 in wgrad (an empty
    contraction: zero gradient, main_grad unchanged). cuBLASLt's int_mm rejects K = 0."""
    from megatron_int8 import Int8Recipe, TPOptions, int8_linear

    recipe = Int8Recipe(granularity=granularity, backend="triton")
    x = torch.randn(0, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (outliers(256, 512) * 0.02).requires_grad_(True)
    y = int8_linear(x, w, None, recipe)
    y.backward(torch.randn(0, 256, device="cuda", dtype=torch.bfloat16))
    assert y.shape == (0, 256) and x.grad.shape == (0, 512)
    assert torch.equal(w.grad, torch.zeros_like(w))
    w2 = torch.nn.Parameter(outliers(256, 512) * 0.02)
    w2.main_grad = torch.randn(256, 512, device="cuda")
    before = w2.main_grad.clone()
    int8_linear(x, w2, None, recipe, tp=TPOptions(gradient_accumulation_fusion=True)).backward(
        torch.randn(0, 256, device="cuda", dtype=torch.bfloat16))
    assert torch.equal(w2.main_grad, before)


def test_hp_wgrad_into_main_grad_is_one_fp32_accumulation_on_gpu():
    """cuBLAS addmm into the fp32 main_grad (the BF16 linears' fused wgrad): no bf16 rounding of g^T x, in place,
    on a ragged shape."""
    from int8_bounds import assert_fp32_accumulation_close

    from megatron_int8.ops.main_grad import hp_wgrad_into

    g, x = outliers(256, 392).to(torch.bfloat16), outliers(256, 328).to(torch.bfloat16)
    main_grad = outliers(392, 328).float().contiguous()
    before, ptr = main_grad.clone(), main_grad.data_ptr()
    hp_wgrad_into(main_grad, g, x)
    assert main_grad.data_ptr() == ptr
    assert_fp32_accumulation_close(main_grad.cpu(), before.cpu(), g.cpu(), x.cpu(), "cuBLAS")


# ----------------------------------------------------------------------- MoE experts: grouped operands
def mixtral_counts(total=8192, experts=8, seed=0):
    """Mildly skewed token counts of Mixtral's 8 experts (8192 routed tokens; a fixed-seed multinomial)."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(experts, generator=g) * 0.5, 0)
    picks = torch.multinomial(probs, total, replacement=True, generator=g)
    return torch.bincount(picks, minlength=experts).tolist()


RAGGED_COUNTS = [0, 5, 300, 0, 129, 1000, 0, 3]  # empty experts first, inside and last; 1-strip to 8-strip


def moe_input(counts, C, dtype=torch.bfloat16):
    """Tokens sorted by expert in the Segments layout (each expert's rows at a multiple of 128, zero rows
    between them)."""
    seg = qref.Segments.for_counts(counts)
    x = torch.zeros(seg.rows, C, dtype=dtype, device="cuda")
    for e, n in enumerate(counts):
        x[seg.offsets[e]:seg.offsets[e] + n] = outliers(n, C, dtype)
    return x, seg


def _seg_kw(seg, rowwise=True, **kw):
    return _kw("row", False, rowwise=rowwise, columnwise=True, columnwise_segments=seg, **kw)


@pytest.mark.parametrize("counts,C", [(mixtral_counts(), 4096), (mixtral_counts(), 14336), (RAGGED_COUNTS, 1537)])
def test_segmented_quantize_bit_exact(K, REF, counts, C):
    """Q(x^T) with per-expert column scales [E, C] (and Q(x) in the same call): bit-identical to the
    reference, empty experts' scales 1, Q(x^T) [C, R] (R is already a multiple of the 16-token pad)."""
    x, seg = moe_input(counts, C)
    for rowwise in (True, False):
        kw = _seg_kw(seg, rowwise, columnwise_pad=16)
        got, want = K.triton_quantize(x, **kw), ref_quantize(REF, x, **kw)
        assert_same_qtensor(got[1], want[1], f"segmented {counts} C={C} rowwise={rowwise}")
        assert got[1].data.shape == (C, seg.rows) and got[1].scale.shape == (len(counts), C)
        assert torch.all(got[1].scale[[e for e, n in enumerate(counts) if n == 0]] == 1)
        if rowwise:
            assert_same_qtensor(got[0], want[0], f"rowwise {counts} C={C}")


def test_segmented_quantize_non_finite(K, REF):
    from megatron_int8 import NonFiniteError, raise_if_nonfinite

    x, seg = moe_input(mixtral_counts(), 4096)
    row = seg.offsets[3] + 7
    x[row, 1000] = float("inf")
    kw = _seg_kw(seg, name="expert fc1 input")
    with pytest.raises(NonFiniteError, match="expert fc1 input"):
        K.triton_quantize(x, **dict(kw, check_finite="immediate"))
    K.triton_quantize(x, **kw)
    with pytest.raises(NonFiniteError, match="expert fc1 input"):
        raise_if_nonfinite()
    kw["check_finite"] = "off"
    (r, c), (r0, c0) = K.triton_quantize(x, **kw), ref_quantize(REF, x, **kw)
    nan = torch.zeros_like(c.scale, dtype=torch.bool)
    nan[3, 1000] = True
    assert torch.equal(torch.isnan(c.scale), nan) and torch.equal(c.scale[~nan], c0.scale[~nan])
    assert torch.isnan(r.scale[row]) and torch.equal(torch.isnan(r.scale), torch.isnan(r0.scale))
    lo, hi = seg.bounds(3)
    fin = torch.ones_like(c.data, dtype=torch.bool)
    fin[1000, lo:hi] = False
    assert torch.equal(c.data[fin], c0.data[fin])


def test_segmented_quantize_stochastic(K):
    """The draws are keyed by the element's position in x, as without segments (equal where every segment
    has x's column maxima), and the rounding is unbiased."""
    counts = mixtral_counts()
    x, seg = moe_input(counts, 4096, torch.float32)
    peak = x.abs().amax(0) + 1
    for e, n in enumerate(counts):
        if n:
            x[seg.offsets[e]] = peak if e % 2 else -peak
    torch.manual_seed(5)
    rs, cs = K.triton_quantize(x, stochastic=True, **_seg_kw(seg))
    torch.manual_seed(5)
    ru, cu = K.triton_quantize(x, stochastic=True, **_kw("row", False, rowwise=True, columnwise=True))
    assert torch.equal(cs.scale, cu.scale.expand(len(counts), -1)) and torch.equal(cs.data, cu.data)
    assert torch.equal(rs.data, ru.data)
    v = x.t() * (torch.ones_like(cu.scale) / cu.scale)[:, None]
    d = cs.data.float() - torch.floor(v)
    assert ((d == 0) | (d == 1)).all()
    err = (cs.data.float() - v)[v != torch.floor(v)]
    assert abs(err.mean().item()) < 2e-3 and (err.abs() > 0.5).any()


def stacked_weights(REF, E, N, Kd):
    """The experts' row-wise Q(W_e) [N, K] stacked as [E, N, K] with scales [E, N] (one expert's bf16 weight
    at a time)."""
    data = torch.empty(E, N, Kd, dtype=torch.int8, device="cuda")
    scale = torch.empty(E, N, device="cuda")
    for e in range(E):
        q, _ = REF.quantize(outliers(N, Kd) * 0.02, **_kw("row", True, rowwise=True, columnwise=False))
        data[e], scale[e] = q.data, q.scale
    return qref.QTensor(data, scale, "row")


def check_grouped_gemm(K, REF, qa, qb, seg, what):
    """fp32 and bf16 outputs against the reference, within the fp32 rounding bound of the existing GEMM tests."""
    mag = REF.grouped_gemm(_abs(qa), _abs(qb), seg, out_dtype=torch.float32)
    want = REF.grouped_gemm(qa, qb, seg, out_dtype=torch.float32)
    assert_gemm_close(K.triton_grouped_gemm(qa, qb, seg, out_dtype=torch.float32), want, mag, f"{what} fp32")
    want = REF.grouped_gemm(qa, qb, seg, out_dtype=torch.bfloat16)
    got = K.triton_grouped_gemm(qa, qb, seg, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert ((got.float() - want.float()).abs() <= 2.0 ** -7 * want.float().abs() + 4 * EPS * mag).all(), what


@pytest.mark.parametrize("kernel", ["auto", "portable"])
@pytest.mark.parametrize("N,Kd", [(28672, 4096), (4096, 14336), (14336, 4096), (4096, 28672)])
def test_grouped_gemm_mixtral_shapes(K, REF, kernel, N, Kd, monkeypatch):
    """Mixtral's expert GEMMs (fc1/fc2 fprop and dgrad, 8 experts, 8192 skewed routed tokens) in one launch:
    the persistent TMA kernel ("auto": the operands are eligible) and the plain kernel."""
    from megatron_int8.kernels import int8_gemm as G

    use_gemm_route(monkeypatch, kernel)
    x, seg = moe_input(mixtral_counts(), Kd)
    qa, _ = REF.quantize(x, **_kw("row", False, rowwise=True, columnwise=False))
    del x
    qb = stacked_weights(REF, 8, N, Kd)
    out = torch.empty(seg.rows, N, device="cuda", dtype=torch.bfloat16)
    assert G._tma_eligible(qa.data, qb.data.reshape(8 * N, Kd), out, G._SCALE_ROW, False)
    check_grouped_gemm(K, REF, qa, qb, seg, f"{kernel} N={N} K={Kd}")


@pytest.mark.parametrize("N,Kd,tma", [(1000, 784, True), (1537, 777, False)])
def test_grouped_gemm_ragged_and_empty_experts(K, REF, N, Kd, tma, monkeypatch):
    """Ragged N and K (TMA eligible, or not: the plain kernel), empty experts, no tokens at all, and a
    contraction split into int32-exact chunks (limit shrunk to 512 here: the plain kernel)."""
    from megatron_int8.kernels import int8_gemm as G

    x, seg = moe_input(RAGGED_COUNTS, Kd)
    qa, _ = REF.quantize(x, **_kw("row", False, rowwise=True, columnwise=False))
    qb = stacked_weights(REF, 8, N, Kd)
    out = torch.empty(seg.rows, N, device="cuda", dtype=torch.bfloat16)
    assert G._tma_eligible(qa.data, qb.data.reshape(8 * N, Kd), out, G._SCALE_ROW, False) == tma
    check_grouped_gemm(K, REF, qa, qb, seg, f"N={N} K={Kd}")
    empty = qref.Segments((0,) * 9)
    qa0 = qref.QTensor(qa.data[:0], qa.scale[:0], "row")
    assert K.triton_grouped_gemm(qa0, qb, empty, out_dtype=torch.bfloat16).shape == (0, N)
    monkeypatch.setattr(qref, "MAX_EXACT_K", 512)
    check_grouped_gemm(K, REF, qa, qb, seg, f"split N={N} K={Kd}")


@pytest.mark.parametrize("autotune", [False, True])
def test_wgrad_on_column_slices(K, REF, autotune, monkeypatch):
    """An expert's wgrad operands are column slices of the segmented Q(dY^T) and Q(X^T) (row stride R): they
    reach the TMA kernel (strided descriptors) untuned and through the autotuned dispatch (TMA forced),
    accumulated into main_grad, equal to the reference product of contiguous copies."""
    from megatron_int8.kernels import int8_gemm as G

    monkeypatch.setenv("MEGATRON_INT8_GEMM_AUTOTUNE", "1")
    use_gemm_route(monkeypatch, "auto" if not autotune else "triton-hopper")
    counts = mixtral_counts() if not autotune else [700, 0, 1300]
    n_out, n_in = (4096, 14336) if not autotune else (1536, 1024)
    dy, seg = moe_input(counts, n_out)
    x = torch.zeros(seg.rows, n_in, dtype=torch.bfloat16, device="cuda")
    for e, n in enumerate(counts):
        x[seg.offsets[e]:seg.offsets[e] + n] = outliers(n, n_in)
    _, qg = K.triton_quantize(dy, **_seg_kw(seg, False, columnwise_pad=16))
    _, qx = K.triton_quantize(x, **_seg_kw(seg, False, columnwise_pad=16))
    for e, n in enumerate(counts):
        if n == 0:
            continue
        ga, xa = qref.segment_operand(qg, seg, e), qref.segment_operand(qx, seg, e)
        assert not xa.data.is_contiguous() and ga.data.stride() == (seg.rows, 1)
        main = torch.randn(n_out, n_in, device="cuda")
        assert G._tma_eligible(ga.data, xa.data, main, G._SCALE_ROW, False)
        buf = main.clone()
        got = K.triton_gemm(ga, xa, out_dtype=torch.float32, accumulate_into=buf, autotune=autotune)
        assert got is buf
        gc, xc = (qref.QTensor(q.data.contiguous(), q.scale, "row") for q in (ga, xa))
        want = REF.gemm(gc, xc, out_dtype=torch.float32, accumulate_into=main.clone())
        assert_gemm_close(buf, want, _mag(gc, xc, REF) + main.abs(), f"expert {e} wgrad", 2)


@pytest.mark.parametrize("heads,groups,rot", [(20, 20, 128), (32, 8, 64)])
def test_fused_rope_real_shapes(heads, groups, rot):
    """The Triton RoPE at a Llama2-13B TP 2 q (20 heads) and a GQA k (8 groups, half the dimensions
    rotated), both strided slices of a fused qkv output, seq 4096 x micro-batch 2: forward and backward
    within one round-to-nearest of the float64 values (the interpreter test allows a whole ulp)."""
    from int8_bounds import assert_rope_close

    from megatron_int8.ops import rope

    S, B, D = 4096, 2, 128
    qkv = outliers(S * B * (heads + 2 * groups), D).view(S, B, heads + 2 * groups, D)
    for x in (qkv[:, :, :heads], qkv[:, :, heads:heads + groups]):
        assert not x.is_contiguous()
        freqs = (torch.arange(S, device="cuda", dtype=torch.float32)[:, None]
                 * 10000.0 ** (-torch.arange(0, rot, 2, device="cuda") / rot)).repeat(1, 2)[:, None, None, :]
        leaf = x.detach().clone().requires_grad_(True)
        out = rope.fused_rope(leaf, freqs)
        assert "TritonRoPE" in type(out.grad_fn).__name__
        assert_rope_close(out.cpu(), x.cpu(), freqs.cpu(), False, "forward")
        grad = outliers(S * B * x.shape[2], D).view(S, B, x.shape[2], D)
        out.backward(grad)
        assert_rope_close(leaf.grad.cpu(), grad.cpu(), freqs.cpu(), True, "backward")


@pytest.mark.parametrize("shape,layout", [
    ((4096, 2, 32, 128), "q heads"),  # Qwen3's q, contiguous (megatron's own SelfAttention copies it)
    ((4096, 2, 8, 4, 128), "q heads in place"),  # Qwen3's q as QueryNormInPlaceSelfAttention passes it
    ((4096, 2, 8, 128), "k head slice"),  # Qwen3's k: a strided slice of the fused qkv output
    ((4096, 2, 4096), "hidden"),
    ((4096, 2, 2560), "hidden"),  # Qwen3-4B: rows narrower than the power-of-two block
])
def test_fused_rms_norm_real_shapes(shape, layout):
    """The Triton RMSNorm at one micro-batch (2 x 4096 tokens) of Qwen3's q/k head norms and of the hidden
    norms: forward, input and weight gradients within one round-to-nearest of float64 plus fp32 sums."""
    from int8_bounds import assert_rms_norm_close

    from megatron_int8.ops.rms_norm import FusedRMSNorm

    W = shape[-1]
    if layout == "k head slice":
        S, B, G, D = shape
        x = outliers(S * B * G, 6 * D).view(S, B, G, 6 * D)[..., 4 * D:5 * D]  # 4 q heads, k, v per group
        assert not x.is_contiguous()
    elif layout == "q heads in place":
        S, B, G, H, D = shape
        x = outliers(S * B * G, (H + 2) * D).view(S, B, G, (H + 2) * D)[..., :H * D].unflatten(-1, (H, D))
        assert not x.is_contiguous()
    else:
        x = outliers(math.prod(shape[:-1]), W).view(shape)
    norm = FusedRMSNorm(W, eps=1e-6, device="cuda", dtype=torch.bfloat16)
    norm.use_triton = True  # hidden-size rows run torch's kernels by default
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(W, device="cuda"))
    leaf = x.detach().requires_grad_(True)
    y = norm(leaf)
    assert "TritonRMSNorm" in type(y.grad_fn).__name__
    dy = outliers(x.numel() // W, W).view(x.shape)
    y.backward(dy)
    assert_rms_norm_close(x, norm.weight.detach(), 1e-6, dy, y, leaf.grad, norm.weight.grad)


@pytest.mark.parametrize("R,F", [(8192, 9728), (4100, 1377)])
def test_swiglu_real_shapes_and_maxima(R, F):
    """The Triton SwiGLU at one micro-batch of Qwen3-4B's MLP (8192 tokens, F = 9728) and at a ragged size:
    forward and input gradient within one bf16 rounding of float64 (plus fp32 arithmetic); the maxima it
    attaches are exactly the outputs' row and column maxima."""
    from int8_bounds import assert_swiglu_close

    from megatron_int8.reference import known_maxima
    from megatron_int8.ops.swiglu import swiglu

    x = outliers(R, 2 * F)
    leaf = x.detach().requires_grad_(True)
    mid = leaf * 1  # fc1's output is a non-leaf: its gradient object reaches the next node unchanged
    grads = []
    mid.register_hook(grads.append)
    y = swiglu(mid, emit_maxima=True)
    assert "TritonSwiGLU" in type(y.grad_fn).__name__
    dy = outliers(R, F)
    y.backward(dy)
    (dx,) = grads
    assert_swiglu_close(x.cpu(), dy.cpu(), y.detach().cpu(), dx.cpu())
    for t in (y.detach(), dx):
        known = known_maxima(t) if t is dx else known_maxima(y)
        assert known is not None
        a = t.float().abs()
        assert torch.equal(known.rows, a.amax(1)) and torch.equal(known.cols, a.amax(0))


@pytest.mark.parametrize("R,F", [(4224, 14336), (1031, 1377)])
def test_weighted_swiglu_real_shapes(R, F):
    """The Triton weighted SwiGLU at a Mixtral expert layout (14336 columns; 4224 rows, about one micro-batch of
    two experts' tokens) and at a ragged size: y, dx and the router probabilities' gradient against float64
    (one bf16 rounding plus fp32 arithmetic; an fp32 sum over 14336 columns for the probabilities)."""
    from int8_bounds import assert_swiglu_close

    from megatron_int8.ops.swiglu import weighted_swiglu

    x = outliers(R, 2 * F)
    probs = torch.rand(R, device="cuda")
    probs[:64] = 0  # padding rows of the aligned layout carry weight 0
    leaf, p_leaf = x.detach().requires_grad_(True), probs.clone().requires_grad_(True)
    y = weighted_swiglu(leaf, p_leaf)
    assert "TritonWeightedSwiGLU" in type(y.grad_fn).__name__
    dy = outliers(R, F)
    y.backward(dy)
    assert_swiglu_close(x.cpu(), dy.cpu(), y.detach().cpu(), leaf.grad.cpu(), probs=probs.cpu(),
                        dprobs=p_leaf.grad.cpu())
    assert (y[:64] == 0).all() and (leaf.grad[:64] == 0).all()


@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_mlp_with_swiglu_maxima_bit_identical(granularity):
    """fc1 -> SwiGLU -> fc2 with INT8 linears at Qwen3-4B's MLP shapes: with the SwiGLU's maxima handed to the
    linears, outputs and every gradient are bit-identical to the run without them."""
    from megatron_int8 import Int8Recipe, int8_linear
    from megatron_int8.ops.swiglu import swiglu

    recipe = Int8Recipe(granularity=granularity, backend="triton")
    T, H, F = 4096, 2560, 9728
    x, w1, w2, dy = outliers(T, H), outliers(2 * F, H) / 64, outliers(H, F) / 64, outliers(T, H)
    results = []
    for emit in (False, True):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, w1, w2)]
        out = int8_linear(swiglu(int8_linear(leaves[0], leaves[1], None, recipe), emit), leaves[2], None, recipe)
        out.backward(dy)
        results.append((out, *(t.grad for t in leaves)))
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_moe_routing_tables_do_not_synchronize():
    """The small host-built tables of an MoE routing (strip owners, the aligned rows) reach
    the GPU without a stream synchronization (pinned memory, non-blocking), and hold the right values.
    Control: a plain torch.tensor(..., device="cuda") does synchronize, so the check can fail."""
    pytest.importorskip("megatron.core")
    from megatron_int8.megatron.experts import _aligned_rows

    counts = [130, 0, 7, 300]
    seg = qref.Segments.for_counts(counts)
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.tensor([1, 2, 3], device=dev)
        strips = seg.strip_experts(dev)
        rows = _aligned_rows(counts, seg, dev)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert strips.tolist() == [0, 0, 2, 3, 3, 3]
    want = list(range(0, 130)) + list(range(256, 263)) + list(range(384, 684))
    assert rows.tolist() == want


@pytest.mark.parametrize("N,Kd", [(37, 53), (1024, 4096)])
def test_quantize_into_stacked_slots(K, REF, N, Kd):
    """Weights quantized straight into their slots of stacked buffers (backend.quantize's `out`), every slot
    in turn: with odd shapes the slots' data and scales sit at offsets that are not 16-byte aligned, which
    Triton specializes on (the plan key holds the alignment). Bit-identical to the reference, slot by slot."""
    E = 3
    row = qref.QTensor(torch.empty((E, N, Kd), dtype=torch.int8, device="cuda"),
                       torch.empty((E, N), device="cuda"), "row", 128)
    col = qref.QTensor(torch.empty((E, Kd, N), dtype=torch.int8, device="cuda"),
                       torch.empty((E, Kd), device="cuda"), "row", 128)
    kw = dict(granularity="row", block_size=128, weight=True, rowwise=True, columnwise=True)
    ws = [outliers(N, Kd) for _ in range(E)]
    for e, w in enumerate(ws):
        K.triton_quantize(w, out=tuple(qref.QTensor(t.data[e], t.scale[e], "row", 128) for t in (row, col)), **kw)
    for e, w in enumerate(ws):
        r0, c0 = ref_quantize(REF, w, **kw)
        assert torch.equal(row.data[e], r0.data) and torch.equal(row.scale[e], r0.scale), e
        assert torch.equal(col.data[e], c0.data) and torch.equal(col.scale[e], c0.scale), e
