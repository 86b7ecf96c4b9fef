"""Each MEGATRON_INT8_GEMM_TMA_VARIANT of the persistent TMA GEMM on a Hopper GPU, through triton_gemm and
triton_grouped_gemm with MEGATRON_INT8_GEMM_KERNEL=tma: fp32, bf16 + bias and fp32 accumulate_into (the TMA
reduce-add) outputs against the reference backend, within the fp32 rounding bounds of test_kernels_gpu.py, on
real and ragged shapes. Tuned and untuned calls both take a variant's fixed configuration (base's tuned calls
keep the autotuned list, which test_kernels_gpu.py covers); every launch is checked to use the variant's tile.

    python3 -m pytest -q tests/kernels/test_gemm_variants_gpu.py        (benchmarks/gpu_triton_gemm_check.sh)
"""
import importlib

import pytest
import torch
from test_kernels_gpu import (EPS, _kw, _mag, assert_gemm_close, check_grouped_gemm, mixtral_counts, moe_input,
                              outliers, ref_gemm, stacked_weights)

pytestmark = pytest.mark.gpu

G = importlib.import_module("megatron_int8.kernels.int8_gemm")
# (M, N, K): a Llama2-7B fprop, ragged M with TMA-aligned rows (N * 2 bytes and K a multiple of 16), a tiny one
SHAPES = [(8192, 4096, 4096), (1000, 1544, 784), (37, 32, 64)]


@pytest.fixture
def variant_launches(monkeypatch, request):
    """Select the variant; record the tile of every launch that goes through it."""
    name = request.param
    monkeypatch.setenv("MEGATRON_INT8_GEMM_KERNEL", "tma")
    monkeypatch.setenv("MEGATRON_INT8_GEMM_TMA_VARIANT", name)
    tiles = []
    launch = G._variant_launch

    def recording(args, meta, nb):
        cache, grid, launch_args, kw = launch(args, meta, nb)
        tiles.append((kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"]))
        return cache, grid, launch_args, kw

    monkeypatch.setattr(G, "_variant_launch", recording)
    return G.TMA_VARIANTS[name], tiles


def _expected_tile(variant):
    return variant.block_m, variant.block_n, variant.num_warps, variant.num_stages


@pytest.mark.parametrize("variant_launches", list(G.TMA_VARIANTS), indirect=True)
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("M,N,Kd", SHAPES)
@pytest.mark.parametrize("autotune", [False, True])
def test_variant_gemm_matches_reference(variant_launches, granularity, M, N, Kd, autotune):
    from megatron_int8.reference import ReferenceBackend

    REF = ReferenceBackend()
    variant, tiles = variant_launches
    if autotune and variant is G.TMA_VARIANTS["base"]:
        pytest.skip("base's tuned calls take the autotuned list: test_kernels_gpu.py")
    qa, _ = REF.quantize(outliers(M, Kd), **_kw(granularity, False, rowwise=True, columnwise=False))
    qb, _ = REF.quantize(outliers(N, Kd), **_kw(granularity, True, rowwise=True, columnwise=False))
    mag = _mag(qa, qb, REF)
    got = G.triton_gemm(qa, qb, out_dtype=torch.float32, autotune=autotune)
    assert_gemm_close(got, ref_gemm(REF, qa, qb, out_dtype=torch.float32), mag, f"{granularity} fp32")
    bias = torch.randn(N, device="cuda").bfloat16()
    want = ref_gemm(REF, qa, qb, out_dtype=torch.bfloat16, bias=bias)
    got = G.triton_gemm(qa, qb, out_dtype=torch.bfloat16, bias=bias, autotune=autotune)
    assert ((got.float() - want.float()).abs() <= 2.0 ** -7 * want.float().abs()
            + 4 * EPS * (mag + bias.float().abs())).all(), f"{granularity} bf16 + bias"
    main = torch.randn(M, N, device="cuda")
    want = ref_gemm(REF, qa, qb, out_dtype=torch.float32, accumulate_into=main.clone())
    buf = main.clone()
    assert G.triton_gemm(qa, qb, out_dtype=torch.float32, accumulate_into=buf, autotune=autotune) is buf
    assert_gemm_close(buf, want, mag + main.abs(), f"{granularity} accumulate_into", 2)
    # untuned, every call takes the TMA kernel with the variant's tile; tuned, the plan may time the plain kernel
    # faster (small shapes), and then every TMA launch there was still took the variant's tile
    assert (tiles or autotune) and set(tiles) <= {_expected_tile(variant)}, tiles


@pytest.mark.parametrize("variant_launches", list(G.TMA_VARIANTS), indirect=True)
def test_variant_grouped_gemm(variant_launches):
    """Mixtral's fc1 fprop shape over 8 experts with skewed routing; variants taller than an expert's segment
    alignment run grouped GEMMs on base's tile."""
    from megatron_int8.reference import ReferenceBackend

    REF = ReferenceBackend()
    variant, tiles = variant_launches
    x, seg = moe_input(mixtral_counts(), 4096)
    qa, _ = REF.quantize(x, **_kw("row", False, rowwise=True, columnwise=False))
    qb = stacked_weights(REF, 8, 2048, 4096)
    check_grouped_gemm(G, REF, qa, qb, seg, "grouped")
    assert set(tiles) == {_expected_tile(G.tma_variant(grouped=True))}
