"""The CUDA sm_90a INT8 GEMM (megatron_int8/kernels/sm90_gemm.py) on a Hopper GPU.

Its contract is the reference backend's GEMM for tensorwise and row-wise scales without bias, bit for bit:
the int32 accumulation is exact and the epilogue does the reference's fp32 operations in its order, so every
output (bf16, fp32 added into main_grad) must be identical. Operands are quantized from fresh heavy-tailed
data with outliers (tests/test_kernels_gpu.outliers); ragged M/N/K exercise the TMA edge handling.
"""
import importlib

import pytest
import torch

from test_kernels_gpu import RAGGED_COUNTS, _kw, mixtral_counts, moe_input, outliers, stacked_weights, use_gemm_route

pytestmark = pytest.mark.gpu

qref = importlib.import_module("megatron_int8.reference")


@pytest.fixture(scope="module")
def S():
    pytest.importorskip("triton")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs compute capability 9.0")
    mod = importlib.import_module("megatron_int8.kernels.sm90_gemm")
    assert mod.available(), mod.unavailable_reason()
    return mod


@pytest.fixture(scope="module")
def REF():
    from megatron_int8.reference import ReferenceBackend

    return ReferenceBackend()


def operands(REF, granularity, M, N, Kd):
    qa, _ = REF.quantize(outliers(M, Kd), **_kw(granularity, False, rowwise=True, columnwise=False))
    qb, _ = REF.quantize(outliers(N, Kd), **_kw(granularity, True, rowwise=True, columnwise=False))
    return qa, qb


# K up to 6144 (48 k-blocks) has fp32 accumulation prefetch main_grad into L2 (ragged edges skip boxes), beyond not
SHAPES = [(8192, 4096, 4096), (4096, 22016, 8192), (8192, 2560, 9728), (1000, 1544, 784), (4100, 264, 4224),
          (37, 24, 48), (129, 8, 16), (2000, 1800, 6144), (300, 520, 6160)]


@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("M,N,Kd", SHAPES)
def test_bit_identical_to_reference(S, REF, granularity, M, N, Kd):
    qa, qb = operands(REF, granularity, M, N, Kd)
    want = REF.gemm(qa, qb, out_dtype=torch.bfloat16)
    assert torch.equal(S.sm90_gemm(qa, qb), want)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert S.sm90_gemm(qa, qb, out=out) is out and torch.equal(out, want)
    main = torch.randn(M, N, device="cuda") * 100
    want = REF.gemm(qa, qb, out_dtype=torch.float32, accumulate_into=main.clone())
    got = S.sm90_gemm(qa, qb, accumulate_into=main)
    assert got is main and torch.equal(got, want)


def test_integer_extremes_exact(S):
    """Full-scale rows and columns (|acc| = 127 * 127 * K) and all-zero ones, unit scales: the fp32 sum is
    the int32 accumulator rounded once, as in the reference."""
    for M, N, Kd in [(8192, 4096, 1024), (777, 1240, 4112), (256, 512, 65536)]:
        a = torch.randint(-127, 128, (M, Kd), dtype=torch.int8, device="cuda")
        b = torch.randint(-127, 128, (N, Kd), dtype=torch.int8, device="cuda")
        a[5], b[7], a[6], b[8] = 127, -127, 0, 0
        one = torch.tensor(1.0, device="cuda")
        acc = torch.zeros(M, N, device="cuda")
        S.sm90_gemm(qref.QTensor(a, one, "tensor"), qref.QTensor(b, one, "tensor"), accumulate_into=acc)
        assert torch.equal(acc, qref.int_mm(a, b).float())
        assert acc[5, 7].item() == -127 * 127 * Kd
        assert (acc[6] == 0).all() and (acc[:, 8] == 0).all()


def test_strided_operands(S, REF):
    """Column slices of a wider operand (an MoE expert's wgrad reads slices of the segmented Q(x^T))."""
    qa, qb = operands(REF, "row", 1024, 2048, 4096)
    a = qref.QTensor(qa.data[:, 1024:3072], qa.scale, "row")
    b = qref.QTensor(qb.data[:, 1024:3072], qb.scale, "row")
    assert torch.equal(S.sm90_gemm(a, b), REF.gemm(a, b, out_dtype=torch.bfloat16))


def test_contract_checks(S, REF):
    qa, qb = operands(REF, "tensor", 256, 256, 256)
    assert not S.supports(qa, qb, torch.zeros(256, device="cuda"), torch.bfloat16, None, None)  # bias
    assert not S.supports(qa, qb, None, torch.float32, None, None)  # fp32 output that is not accumulated
    odd = qref.QTensor(qa.data[:, :200], qa.scale, "tensor")  # K % 16 != 0
    assert not S.supports(odd, qref.QTensor(qb.data[:, :200], qb.scale, "tensor"), None, torch.bfloat16, None, None)
    rq, rb = operands(REF, "row", 256, 256, 256)
    short = qref.QTensor(rq.data, rq.scale[:128], "row")  # a row scale per row, or the kernel reads past it
    assert not S.supports(short, rb, None, torch.bfloat16, None, None)
    spread = torch.zeros(1, 256, device="cuda").expand(256, 256)  # row stride 0: rows would overlap
    assert not S.supports(qa, qb, None, torch.float32, spread, None)
    with pytest.raises(ValueError, match="contract"):
        S.sm90_gemm(qa, qb, out_dtype=torch.float32)
    with pytest.raises(ValueError):
        S.sm90_gemm(qa, qref.QTensor(qb.data[:, :128], qb.scale, "tensor"))  # contraction mismatch


def test_dispatch(S, REF, monkeypatch):
    """triton_gemm takes the CUDA kernel where it applies ('hopper' without timing, and Triton's TMA kernel for
    what it cannot take; nothing where no Hopper kernel applies); 'auto' keeps the faster of it and Triton; both
    are bit-identical to the reference."""
    from megatron_int8.kernels import triton_gemm

    calls = []
    real = S.launch
    monkeypatch.setattr(S, "launch", lambda *a: calls.append(1) or real(*a))
    qa, qb = operands(REF, "row", 2048, 1536, 1024)
    want = REF.gemm(qa, qb, out_dtype=torch.bfloat16)
    for kernel in ("hopper", "auto"):
        use_gemm_route(monkeypatch, kernel)
        calls.clear()
        assert torch.equal(triton_gemm(qa, qb, out_dtype=torch.bfloat16), want), kernel
        if kernel == "hopper":
            assert calls, "the Hopper route did not run the CUDA kernel"
    # auto times both kernels on scratch copies: the real main_grad is added into once, and a strided one
    # (a column slice of a wider buffer) keeps its neighbours
    wide = torch.randn(2048, 2 * 1536, device="cuda")
    main = wide[:, :1536]
    want = REF.gemm(qa, qb, out_dtype=torch.float32, accumulate_into=main.clone())
    before = wide[:, 1536:].clone()
    triton_gemm(qa, qb, out_dtype=torch.float32, accumulate_into=main)
    assert torch.equal(main, want) and torch.equal(wide[:, 1536:], before)
    use_gemm_route(monkeypatch, "hopper")
    calls.clear()
    bias = torch.randn(1536, device="cuda").bfloat16()  # no bias in the CUDA kernel: Triton's TMA kernel
    got = triton_gemm(qa, qb, out_dtype=torch.bfloat16, bias=bias)
    want = REF.gemm(qa, qb, out_dtype=torch.bfloat16, bias=bias)
    assert not calls and ((got.float() - want.float()).abs() <= 2.0 ** -7 * want.float().abs() + 1e-3).all()
    qa, qb = operands(REF, "block", 256, 512, 1024)  # block scales of 128: the Gluon block-scale kernel, not CUDA
    got = triton_gemm(qa, qb, out_dtype=torch.bfloat16)
    want = REF.gemm(qa, qb, out_dtype=torch.bfloat16)
    assert not calls and ((got.float() - want.float()).abs() <= 2.0 ** -7 * want.float().abs() + 1e-3).all()
    qa, _ = REF.quantize(outliers(256, 1024), **_kw("block", False, block_size=64, rowwise=True, columnwise=False))
    qb, _ = REF.quantize(outliers(512, 1024), **_kw("block", True, block_size=64, rowwise=True, columnwise=False))
    with pytest.raises(ValueError, match="no Hopper kernel"):  # block size 64: no Hopper kernel takes it
        triton_gemm(qa, qb, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("counts,N,Kd", [(RAGGED_COUNTS, 1000, 784), (RAGGED_COUNTS, 264, 4096),
                                         ("mixtral", 28672, 4096), ("mixtral", 4096, 14336)])
def test_grouped_bit_identical_to_reference(S, REF, counts, N, Kd, monkeypatch):
    """The grouped mode (MoE fprop/dgrad): one launch for all experts, empty experts, N not a multiple of the
    256-column tile (a tile then reads the next expert's rows, whose columns are never stored), ragged K;
    every row, alignment rows included, equals the reference's."""
    from megatron_int8.kernels import triton_grouped_gemm

    x, seg = moe_input(mixtral_counts() if counts == "mixtral" else counts, Kd)
    qa, _ = REF.quantize(x, **_kw("row", False, rowwise=True, columnwise=False))
    del x
    qb = stacked_weights(REF, seg.num_segments, N, Kd)
    want = REF.grouped_gemm(qa, qb, seg, out_dtype=torch.bfloat16)
    assert S.supports_grouped(qa, qb, torch.bfloat16)
    assert torch.equal(S.sm90_grouped_gemm(qa, qb, seg), want)
    calls = []
    real = S.launch
    monkeypatch.setattr(S, "launch", lambda *a: calls.append(1) or real(*a))
    assert torch.equal(triton_grouped_gemm(qa, qb, seg, out_dtype=torch.bfloat16), want)  # the dispatch's choice
    assert calls == [1]
    use_gemm_route(monkeypatch, "portable")  # Triton, within bf16 rounding of the reference
    got = triton_grouped_gemm(qa, qb, seg, out_dtype=torch.bfloat16)
    assert calls == [1] and ((got.float() - want.float()).abs() <= 2.0 ** -7 * want.float().abs()).all()


def test_grouped_contract_checks(S, REF, monkeypatch):
    from megatron_int8.kernels import triton_grouped_gemm

    x, seg = moe_input([100, 0, 300], 256)
    qa, _ = REF.quantize(x, **_kw("row", False, rowwise=True, columnwise=False))
    qb = stacked_weights(REF, 3, 512, 256)
    assert not S.supports_grouped(qa, qb, torch.float32)  # bf16 output only
    odd = qref.QTensor(qb.data[:, :500].contiguous(), qb.scale[:, :500].contiguous(), "row")  # N % 8 != 0:
    # the output's rows would not be 16-byte aligned
    assert not S.supports_grouped(qa, odd, torch.bfloat16)
    with pytest.raises(ValueError, match="contract"):
        S.sm90_grouped_gemm(qa, qb, seg, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="segment"):
        S.sm90_grouped_gemm(qa, qref.QTensor(qb.data[:2], qb.scale[:2], "row"), seg)
    use_gemm_route(monkeypatch, "hopper")  # an fp32 output: Triton's TMA kernel, not the CUDA kernel
    calls = []
    real = S.launch
    monkeypatch.setattr(S, "launch", lambda *a: calls.append(1) or real(*a))
    got = triton_grouped_gemm(qa, qb, seg, out_dtype=torch.float32)
    want = REF.grouped_gemm(qa, qb, seg, out_dtype=torch.float32)
    assert not calls and ((got - want).abs() <= 1e-5 * (want.abs() + want.abs().max())).all()


def test_cuda_graph_replay(S, REF):
    """Captured once, replayed on new operand values written in place (the trainer's graphed steps)."""
    qa, qb = operands(REF, "row", 1024, 2048, 1024)
    main = torch.zeros(1024, 2048, device="cuda")
    S.sm90_gemm(qa, qb, accumulate_into=main)  # first call outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = S.sm90_gemm(qa, qb)
        S.sm90_gemm(qa, qb, accumulate_into=main)
    na, nb = operands(REF, "row", 1024, 2048, 1024)
    for dst, src in ((qa.data, na.data), (qa.scale, na.scale), (qb.data, nb.data), (qb.scale, nb.scale)):
        dst.copy_(src)
    main.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want = REF.gemm(na, nb, out_dtype=torch.bfloat16)
    assert torch.equal(out, want)
    assert torch.equal(main, REF.gemm(na, nb, out_dtype=torch.float32, accumulate_into=torch.zeros_like(main)))


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_int8_linear_on_the_cuda_kernel(S, granularity, monkeypatch):
    """int8_linear (no bias, main_grad fusion) with every GEMM forced onto the CUDA kernel equals the
    reference backend: outputs and gradients within bf16 output rounding."""
    from megatron_int8 import Int8Recipe, TPOptions, int8_linear

    use_gemm_route(monkeypatch, "hopper")
    calls = []
    real = S.launch
    monkeypatch.setattr(S, "launch", lambda *a: calls.append(1) or real(*a))
    x0 = outliers(2 * 1024, 2048).reshape(2, 1024, 2048)
    w0 = (outliers(3072, 2048) * 0.02).bfloat16()
    dy = outliers(2048, 3072).reshape(2, 1024, 3072)
    res = {}
    for name in ("reference", "triton"):
        x, w = (t.clone().requires_grad_(True) for t in (x0, w0))
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device="cuda")
        recipe = Int8Recipe(granularity=granularity, backend=name, grad_rounding="nearest")
        y = int8_linear(x, w, None, recipe, tp=TPOptions(gradient_accumulation_fusion=True))
        y.backward(dy)
        res[name] = (y.detach(), x.grad, w.main_grad)
    assert len(calls) == 3, f"expected fprop, dgrad and wgrad on the CUDA kernel, got {len(calls)} calls"
    for what, got, want in zip(("output", "dgrad", "wgrad"), res["triton"], res["reference"]):
        assert got.dtype == want.dtype and got.shape == want.shape, what
        close = (got.float() - want.float()).abs() <= 2.0 ** -7 * want.float().abs() + 1e-6 * want.float().abs().max()
        assert close.all(), f"{granularity} {what}: {(~close).sum().item()} elements off"
