"""The persistent TMA GEMM's one configuration (int8_gemm.TMA_TILE) and its route to the Gluon kernel.

Under TRITON_INTERPRET=1 (a subprocess, see tests/interpreter.py) the configuration's code path runs at a
scaled-down tile: its epilogue in 4 column sub-tiles, its flattened tile loop and its 2 programs per SM, on ragged
shapes where each program walks several tiles. Results are compared with the reference backend: fp32 bit for bit
(the same fp32 operations in the same order), bf16 within one ulp (the interpreter's rounding of the cast). The
route checks run in this process. Its sm_90a build (shared memory, wgmma, bulk copies) is checked by
test_compile_targets.py; its results at full size by test_kernels_gpu.py and test_int8_gemm_ws_gpu.py.
"""
import importlib

import pytest
import torch
from int8_bounds import heavy_tailed
from interpreter import INTERPRETING, needs_interpreter, run_file_interpreted

pytest.importorskip("triton")

if not INTERPRETING:

    def test_tma_tile_under_triton_interpreter():
        run_file_interpreted(__file__, timeout=900)

G = importlib.import_module("megatron_int8.kernels.int8_gemm")
REF = importlib.import_module("megatron_int8.reference").ReferenceBackend()
# interpreter tiles: the configuration's rows / 8, columns / 4 (a TMA box row needs >= 16 bytes: 4 bf16 sub-tiles of 32)
SCALE_M, SCALE_N = 8, 4


def _operands(M, N, K, granularity, seed):
    gen = torch.Generator().manual_seed(seed)
    a = heavy_tailed(M, K, generator=gen, dtype=torch.bfloat16)
    b = heavy_tailed(N, K, generator=gen, dtype=torch.bfloat16)
    qa = REF.quantize(a, granularity=granularity, block_size=128, weight=False, rowwise=True, columnwise=False)[0]
    qb = REF.quantize(b, granularity=granularity, block_size=128, weight=True, rowwise=True, columnwise=False)[0]
    return qa, qb


def _launch_scaled(variant, qa, qb, c, accumulate, programs=3):
    """One launch of the TMA kernel with the configuration's structure on a scaled-down tile."""
    opts = variant.launch_options(n_sms=programs)
    opts.update(BLOCK_M=variant.block_m // SCALE_M, BLOCK_N=variant.block_n // SCALE_N, BLOCK_K=32, GROUP_M=2)
    opts.pop("num_warps"), opts.pop("num_stages")
    M, K = qa.data.shape
    N = qb.data.shape[0]
    G._int8_gemm_tma_kernel[(opts["NUM_SMS"],)](
        qa.data, qb.data, c, qa.scale, qb.scale, c, M, N, K, qa.data.stride(0), qb.data.stride(0), qb.scale, N,
        SCALE_MODE=0 if qa.granularity == "tensor" else 1, HAS_BIAS=False, ACCUMULATE=accumulate, **opts)


@needs_interpreter
@pytest.mark.parametrize("granularity,out_dtype,accumulate", [("tensor", torch.bfloat16, False),
                                                               ("row", torch.float32, False),
                                                               ("row", torch.float32, True)])
def test_tma_tile_matches_reference(granularity, out_dtype, accumulate):
    variant = G.TMA_TILE
    # ragged: partial edge tiles (N keeps the output rows 16-byte aligned, as TMA needs)
    M, N, K = 3 * variant.block_m // SCALE_M + 5, 2 * variant.block_n // SCALE_N + 8, 96
    qa, qb = _operands(M, N, K, granularity, seed=3)
    main = torch.randn(M, N, generator=torch.Generator().manual_seed(1))
    c = main.clone() if accumulate else torch.full((M, N), float("nan"), dtype=out_dtype)
    _launch_scaled(variant, qa, qb, c, accumulate)
    want = REF.gemm(qa, qb, out_dtype=out_dtype, accumulate_into=main.clone() if accumulate else None)
    if out_dtype == torch.float32:
        assert torch.equal(c, want), f"max error {(c - want).abs().max().item()}"
    else:  # the interpreter's cast to bf16 may round the exact fp32 value the other way: one bf16 ulp at most
        ulp = torch.finfo(out_dtype).eps * want.float().abs()
        assert ((c.float() - want.float()).abs() <= ulp).all()


def test_tma_tile_is_the_measured_pair():
    """128 x 128 x 128 tiles on 4 warps, 3 stages, 4 epilogue sub-tiles, two programs per SM, and the Gluon kernel
    for K > MIN_K (kernels/int8_gemm.py says why); its rows divide SEGMENT_ALIGN, so a grouped tile reads one
    expert's rows."""
    assert G.TMA_TILE == G.TmaVariant(128, 128, 128, 4, 3, programs_per_sm=2,
                                      gluon_min_k=G.int8_gemm_ws.MIN_K)
    assert G.TMA_TILE.launch_options(132)["NUM_SMS"] == 264
    assert importlib.import_module("megatron_int8.reference").SEGMENT_ALIGN % G.TMA_TILE.block_m == 0


@pytest.mark.parametrize("K,out_dtype,bias,accumulate,want", [
    (4096 + 16, torch.bfloat16, False, False, "ws"),
    (4096 + 16, torch.float16, False, False, "ws"),
    (4096, torch.bfloat16, False, False, "tma"),  # a short k loop: the epilogue would not be hidden
    (4096 + 16, torch.float32, False, False, "tma"),  # an fp32 tile beside the accumulator spills
    (4096 + 16, torch.float32, False, True, "tma"),  # main_grad: the TMA kernel's reduce-add
    (4096 + 16, torch.bfloat16, True, False, "tma"),  # no bias in the Gluon kernel
])
def test_tma_tile_routes_gemms_to_the_gluon_kernel(monkeypatch, K, out_dtype, bias, accumulate, want):
    """_tma_tile_launch on a Hopper (faked here): which kernel the fixed configuration launches, and with what."""
    if G._GEMM_WS is None:
        pytest.skip(G.int8_gemm_ws.unavailable_reason())
    monkeypatch.setattr(G.int8_gemm_ws, "capability", lambda device: (9, 0))
    monkeypatch.setattr(G, "num_sms", lambda device: 132)
    M, N = 1000, 4096
    a, b = torch.zeros(M, K, dtype=torch.int8), torch.zeros(N, K, dtype=torch.int8)
    c, scales = torch.empty(M, N, dtype=out_dtype), (torch.ones(M), torch.ones(N))
    args = G._plain_args(a, b, c, *scales, c, M, N, K, (1, 0, 1, 0), K, 1, scales[0])
    meta = dict(SCALE_MODE=1, HAS_BIAS=bias, ACCUMULATE=accumulate)
    cache, grid, launch_args, kw = G._tma_tile_launch(args, meta, N)
    assert ("ws" if cache is G._GEMM_WS else "tma") == want
    assert launch_args == G._tma_args(args, N)  # both kernels take the same runtime arguments
    if want == "ws":
        assert grid == (min(132, 8 * 16),) and (kw["BLOCK_M"], kw["BLOCK_N"], kw["SCALE_MODE"]) == (128, 256, 1)
    else:
        assert kw["BLOCK_N"] == 128 and kw["ACCUMULATE"] == accumulate


@pytest.mark.parametrize("capability,fits", [((9, 0), True), ((8, 0), False), ((8, 9), False), ((10, 0), False)])
def test_gluon_kernel_is_for_hopper_only(monkeypatch, capability, fits):
    """wgmma exists on sm_90 alone: Ampere, Ada and Blackwell keep the Triton kernels (and the compile test builds
    the Gluon kernel for sm_90a only)."""
    if G._GEMM_WS is None:
        pytest.skip(G.int8_gemm_ws.unavailable_reason())
    monkeypatch.setattr(G.int8_gemm_ws, "capability", lambda device: capability)
    c = torch.empty(64, 64, dtype=torch.bfloat16)
    assert G.int8_gemm_ws.supports(c, has_bias=False, accumulate=False, grouped=False) is fits


@pytest.mark.parametrize("version,usable", [("3.6.0", True), ("3.9.0", True), ("3.10.0+git1234", True),
                                            ("3.5.1", False), ("2.3.0", False), ("nightly", False)])
def test_gluon_kernel_needs_a_triton_with_its_api(version, usable):
    """Older Tritons have Gluon with another API: the dispatch must keep the Triton kernels there, with a reason."""
    problem = G.int8_gemm_ws.gluon_problem(version)
    assert (problem is None) is usable, problem


@pytest.mark.parametrize("block_size,sb_rows,K,capability,fits", [
    (128, 128, 4096, (9, 0), True), (128, 1, 4160, (9, 0), True),  # weight tiles; wgrad's rows; any K at 128
    (256, 256, 4096, (9, 0), True), (512, 1, 8192, (9, 0), True),
    (256, 256, 1152, (9, 0), False), (512, 512, 11008, (9, 0), False),  # the block does not divide K
    (64, 64, 4096, (9, 0), False), (96, 1, 4032, (9, 0), False),  # other block sizes
    (128, 64, 4096, (9, 0), False),  # weight tiles of another size than the activations' blocks
    (128, 128, 4096, (8, 0), False), (128, 128, 4096, (10, 0), False)])
def test_block_kernel_contract(monkeypatch, block_size, sb_rows, K, capability, fits):
    """The block recipe's Gluon GEMM takes block sizes 128 (any K) and 256 / 512 dividing K, b's scales per row or per
    block x block tile, on sm_90 alone; everything else goes to the portable kernel."""
    if G._GEMM_WS_BLOCK is None:
        pytest.skip(G.int8_gemm_ws.unavailable_reason())
    monkeypatch.setattr(G.int8_gemm_ws, "capability", lambda device: capability)
    c = torch.empty(64, 64, dtype=torch.float32)
    assert G.int8_gemm_ws.supports_block(c, block_size, sb_rows, K) is fits


def test_plain_kernel_stages_fit_blocks_of_several_k_steps():
    """At block sizes of several k-steps (256: 2, 512: 4) the portable kernel buffers each unrolled step's tiles per
    stage: the prune lowers the stages until a config's int8 buffers fit 200 KiB (Triton 3.6 asked 289 KiB for 128 x
    256 on 3 stages at 256, over the H200's 227 KiB), leaves block size 128's configs as they are, keeps no duplicate;
    the untuned tile gets the same fit."""
    def listed(configs):
        return [(tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages) for c in configs]

    configs = G._configs()
    shape = dict(M=8192, N=8192)
    assert listed(G._prune(configs, shape, SUB_K=1, BLOCK_K=128)) == listed(configs)
    for sub_k in (2, 4):
        fitted = G._prune(configs, shape, SUB_K=sub_k, BLOCK_K=128)
        assert fitted and len(set(listed(fitted))) == len(fitted)
        for c in fitted:
            per_stage = sub_k * (c.kwargs["BLOCK_M"] + c.kwargs["BLOCK_N"]) * 128
            assert c.num_stages >= 1 and (c.num_stages * per_stage <= 200 * 1024 or c.num_stages == 1), c
        assert {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in fitted} == \
            {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in configs}
    assert [G.plain_stages(128, 256, 128, sub_k, 3) for sub_k in (1, 2, 4)] == [3, 2, 1]
