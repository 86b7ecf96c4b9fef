"""The warp-specialized Gluon INT8 GEMM (megatron_int8/kernels/int8_gemm_ws.py) on a Hopper GPU, through triton_gemm.

Its epilogue does the reference's fp32 operations in its order ((acc * sa) * sb, then the cast) on an exact int32
accumulation, so every bf16/fp16 output must equal the reference backend's bit for bit, as the CUDA kernel's does.
Operands are quantized from fresh heavy-tailed data with outliers; ragged M, N and K exercise the TMA boxes'
zero fill and the masked stores, a tiny GEMM a box larger than the tensor, a long K many passes over the ring,
and a column slice a strided operand (an MoE expert's wgrad operand); `gluon_everywhere` hands it every GEMM it
can take (a test-only TMA_TILE), short K included. The dispatch check: TMA_TILE sends exactly the GEMMs with
K > MIN_K and a 16-bit output without bias to the Gluon kernel, and keeps the others on the Triton TMA kernel.
The block recipe's kernel (1 x B scales along K, B x B weight tiles, B = 128, 256, 512) adds each block's product in
fp32, as the reference does, so its outputs are bounded by the fp32 rounding of those sums (the plain kernel's bound).

    python3 -m pytest -q tests/kernels/test_int8_gemm_ws_gpu.py
"""
import importlib

import pytest
import torch
from test_kernels_gpu import EPS, _kw, _mag, assert_gemm_close, outliers, use_gemm_route

pytestmark = pytest.mark.gpu

G = importlib.import_module("megatron_int8.kernels.int8_gemm")
WS = importlib.import_module("megatron_int8.kernels.int8_gemm_ws")
REF = importlib.import_module("megatron_int8.reference").ReferenceBackend()
QTensor = importlib.import_module("megatron_int8.reference").QTensor
# (M, N, K): Llama2-7B's fc2 fprop, ragged everything, smaller than one tile, one k-block, a long ragged K
SHAPES = [(8192, 4096, 11008), (1000, 1544, 4112), (37, 32, 4160), (300, 520, 128), (2048, 640, 28688)]


@pytest.fixture
def launches(monkeypatch):
    """Record which kernel every fixed-configuration launch takes ("ws" or "tma")."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs compute capability 9.0 (wgmma)")
    assert WS.KERNEL is not None, WS.unavailable_reason()
    use_gemm_route(monkeypatch, "triton-hopper")
    kinds = []
    launch = G._tma_tile_launch

    def recording(args, meta, nb):
        cache, grid, launch_args, kw = launch(args, meta, nb)
        kinds.append("ws" if cache is G._GEMM_WS else "tma")
        return cache, grid, launch_args, kw

    monkeypatch.setattr(G, "_tma_tile_launch", recording)
    return kinds


@pytest.fixture
def gluon_everywhere(monkeypatch):
    """TMA_TILE handing the Gluon kernel every GEMM it takes, whatever K (the package's hands it K > MIN_K)."""
    monkeypatch.setattr(G, "TMA_TILE", G.TMA_TILE._replace(gluon_min_k=0))


def _operands(M, N, K, granularity):
    qa, _ = REF.quantize(outliers(M, K), **_kw(granularity, False, rowwise=True, columnwise=False))
    qb, _ = REF.quantize(outliers(N, K), **_kw(granularity, True, rowwise=True, columnwise=False))
    return qa, qb


@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("autotune", [False, True])
def test_gluon_gemm_is_bit_identical_to_reference(launches, gluon_everywhere, granularity, out_dtype, M, N, K,
                                                  autotune):
    qa, qb = _operands(M, N, K, granularity)
    got = G.triton_gemm(qa, qb, out_dtype=out_dtype, autotune=autotune)
    want = REF.gemm(qa, qb, out_dtype=out_dtype)
    assert launches and set(launches) == {"ws"}, launches
    assert torch.equal(got, want), f"{(got.float() - want.float()).abs().max().item()} off"


def test_gluon_gemm_takes_strided_operands_and_out(launches, gluon_everywhere):
    """A column slice of a wider int8 matrix (16-byte aligned row stride), written into rows of a larger output."""
    M, N, K = 512, 768, 4224
    wide_a, wide_b = _operands(M, N, K + 256, "row")
    # a contraction slice of quantized operands: the scales stay those of the whole rows, as any scales would do
    sliced = QTensor(wide_a.data[:, 128:128 + K], wide_a.scale, "row")
    slicedb = QTensor(wide_b.data[:, 128:128 + K], wide_b.scale, "row")
    assert sliced.data.stride(0) == K + 256
    big = torch.full((M + 64, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = G.triton_gemm(sliced, slicedb, out_dtype=torch.bfloat16, out=big[64:], autotune=False)
    assert got.data_ptr() == big[64:].data_ptr() and big[:64].isnan().all()
    assert torch.equal(got, REF.gemm(sliced, slicedb, out_dtype=torch.bfloat16))
    assert set(launches) == {"ws"}, launches


def test_tma_tile_sends_long_k_16_bit_gemms_to_gluon(launches):
    """TMA_TILE: the Gluon kernel for K > MIN_K with a 16-bit output and no bias; the Triton TMA kernel otherwise."""
    long_k, short_k = _operands(256, 512, WS.MIN_K + 16, "row"), _operands(256, 512, WS.MIN_K, "row")
    cases = [(long_k, dict(out_dtype=torch.bfloat16), "ws"), (short_k, dict(out_dtype=torch.bfloat16), "tma"),
             (long_k, dict(out_dtype=torch.float32), "tma"),
             (long_k, dict(out_dtype=torch.bfloat16, bias=torch.randn(512, device="cuda").bfloat16()), "tma"),
             (long_k, dict(out_dtype=torch.float32, accumulate_into=torch.randn(256, 512, device="cuda")), "tma")]
    for (qa, qb), kw, kind in cases:
        launches.clear()
        want = REF.gemm(qa, qb, **{k: (v.clone() if torch.is_tensor(v) else v) for k, v in kw.items()})
        got = G.triton_gemm(qa, qb, autotune=False, **kw)
        assert launches == [kind], (kw.keys(), launches)
        if kind == "ws":
            assert torch.equal(got, want)
        else:  # the TMA kernel's own tests bound these; here only the route matters
            assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)


# (M, N, K): Llama2-7B's qkv fprop, ragged M and K, a box larger than the tensor, one k-block, Llama2-7B's fc2 wgrad
BLOCK_SHAPES = [(8192, 4096, 4096), (1000, 1544, 4112), (37, 32, 4160), (300, 520, 128), (4096, 11008, 8192)]


@pytest.fixture
def block_launches(monkeypatch):
    """Plans that record the block-scale kernel's launches; fresh plan caches."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs compute capability 9.0 (wgmma)")
    assert WS.BLOCK_KERNEL is not None, WS.unavailable_reason()
    from megatron_int8.kernels.launch import PlanCache

    monkeypatch.setattr(G, "_PLANS", PlanCache(64))
    prepared = []
    prepare = G._GEMM_WS_BLOCK.prepare

    def recording(grid, template, **kw):
        prepared.append(grid)
        return prepare(grid, template, **kw)

    monkeypatch.setattr(G._GEMM_WS_BLOCK, "prepare", recording)
    return prepared


def _block_operands(M, N, K, a_tiles, b_tiles, block_size=128):
    """Block-quantized operands: b in B x B tiles (a weight: fprop, dgrad) or in 1 x B rows (wgrad's Q(x^T)); a in
    rows, or in tiles."""
    kw = dict(block_size=block_size, rowwise=True, columnwise=False)
    qa, _ = REF.quantize(outliers(M, K), **_kw("block", a_tiles, **kw))
    qb, _ = REF.quantize(outliers(N, K), **_kw("block", b_tiles, **kw))
    return qa, qb


def _block_cases():
    cases = [(128, *shape, a_tiles, b_tiles) for shape in BLOCK_SHAPES
             for a_tiles, b_tiles in [(False, True), (False, False), (True, True)]]
    # 256 and 512: several k-steps per scale block (512: the products' int32 exceeds 2**22, converted as such);
    # ragged M, and N not a multiple of the block (a partial last weight tile)
    for B in (256, 512):
        cases += [(B, 1000, 1544, 4096, False, True), (B, 640, 520, 2048, False, False),
                  (B, 8192, 4096, 8192, False, True)]
    return cases


@pytest.mark.parametrize("B,M,N,K,a_tiles,b_tiles", _block_cases())
def test_block_gemm_matches_reference(block_launches, B, M, N, K, a_tiles, b_tiles):
    """Each output is the reference's fp32 sum over the blocks of K within the rounding of that sum: an fp32 and a
    bf16 output with bias, and an fp32 accumulation into an existing buffer (main_grad)."""
    qa, qb = _block_operands(M, N, K, a_tiles, b_tiles, B)
    mag = _mag(qa, qb, REF)
    nkb = -(-K // B)
    assert_gemm_close(G.triton_gemm(qa, qb, out_dtype=torch.float32), REF.gemm(qa, qb, out_dtype=torch.float32), mag,
                      "fp32", nkb)
    bias = torch.randn(N, device="cuda").bfloat16()
    want = REF.gemm(qa, qb, out_dtype=torch.bfloat16, bias=bias)
    got = G.triton_gemm(qa, qb, out_dtype=torch.bfloat16, bias=bias)
    ulp = 2.0 ** -7 * want.float().abs()
    assert ((got.float() - want.float()).abs() <= ulp + 4 * nkb * EPS * (mag + bias.float().abs())).all()
    main = torch.randn(M, N, device="cuda")
    buf = main.clone()
    got = G.triton_gemm(qa, qb, out_dtype=torch.float32, accumulate_into=buf)
    assert got is buf
    want = REF.gemm(qa, qb, out_dtype=torch.float32, accumulate_into=main.clone())
    assert_gemm_close(got, want, mag + main.abs(), "accumulate_into", nkb + 1)
    assert len(block_launches) == 3, block_launches


def test_block_gemm_propagates_a_nan_scale(block_launches):
    """A non-finite input gives its group a NaN scale: every output it reaches is NaN, the others stay finite."""
    qa, qb = _block_operands(256, 384, 512, False, True)
    qa.scale[5, 2] = float("nan")
    got = G.triton_gemm(qa, qb, out_dtype=torch.float32)
    assert got[5].isnan().all() and torch.isfinite(torch.cat([got[:5], got[6:]])).all()


def test_block_gemm_route(block_launches, monkeypatch):
    """MEGATRON_INT8_GEMM_KERNEL=portable keeps block GEMMs on the plain kernel (same results within the bound);
    operands that TMA cannot read (a row stride that is no multiple of 16 bytes) go there too, and so does a block of
    256 that does not divide K."""
    qa, qb = _block_operands(512, 640, 1024, False, True)
    want = REF.gemm(qa, qb, out_dtype=torch.float32)
    mag = _mag(qa, qb, REF)
    monkeypatch.setenv("MEGATRON_INT8_GEMM_KERNEL", "portable")
    assert_gemm_close(G.triton_gemm(qa, qb, out_dtype=torch.float32), want, mag, "portable", 8)
    assert block_launches == []
    monkeypatch.setenv("MEGATRON_INT8_GEMM_KERNEL", "auto")
    odd, oddb = _block_operands(512, 640, 1000, False, True)  # K = 1000: int8 rows of 1000 bytes
    assert_gemm_close(G.triton_gemm(odd, oddb, out_dtype=torch.float32), REF.gemm(odd, oddb, out_dtype=torch.float32),
                      _mag(odd, oddb, REF), "unaligned", 8)
    assert block_launches == []
    # 4.5 blocks of 256, 2.25 of 512: the plain kernel, tuned and untuned (whose 128 x 256 tile on 3 stages needed
    # 289 KiB of shared memory at block size 256 under Triton 3.6 until int8_gemm.plain_stages)
    for B, K, autotune in ((256, 1152, True), (256, 1152, False), (512, 1152, True), (512, 1152, False)):
        qB, qBb = _block_operands(512, 640, K, False, True, B)
        got = G.triton_gemm(qB, qBb, out_dtype=torch.bfloat16, autotune=autotune).float()
        want = REF.gemm(qB, qBb, out_dtype=torch.bfloat16).float()
        assert ((got - want).abs() <= 2.0 ** -7 * want.abs() + 12 * EPS * _mag(qB, qBb, REF)).all(), (B, autotune)
    assert block_launches == []
    G.triton_gemm(qa, qb, out_dtype=torch.float32)
    assert len(block_launches) == 1
