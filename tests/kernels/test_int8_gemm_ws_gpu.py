"""The warp-specialized Gluon INT8 GEMM (megatron_int8/kernels/int8_gemm_ws.py) on a Hopper GPU, through triton_gemm.

Its epilogue does the reference's fp32 operations in its order ((acc * sa) * sb, then the cast) on an exact int32
accumulation, so every bf16/fp16 output must equal the reference backend's bit for bit, as the CUDA kernel's does.
Operands are quantized from fresh heavy-tailed data with outliers; ragged M, N and K exercise the TMA boxes'
zero fill and the masked stores, a tiny GEMM a box larger than the tensor, a long K many passes over the ring,
and a column slice a strided operand (an MoE expert's wgrad operand); `gluon_everywhere` hands it every GEMM it
can take (a test-only TMA_TILE), short K included. The dispatch check: TMA_TILE sends exactly the GEMMs with
K > MIN_K and a 16-bit output without bias to the Gluon kernel, and keeps the others on the Triton TMA kernel.

    python3 -m pytest -q tests/kernels/test_int8_gemm_ws_gpu.py
"""
import importlib

import pytest
import torch
from test_kernels_gpu import _kw, outliers, use_gemm_route

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
