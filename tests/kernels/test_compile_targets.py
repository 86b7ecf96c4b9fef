"""Every Triton kernel of megatron_int8/kernels compiles for Ampere (sm_80) on a machine with no GPU and no nvcc.

`triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 80, 32))` runs Triton's whole
pipeline (TTIR, TTGIR, LLVM IR, PTX) and the ptxas that the triton wheel bundles, so each case below ends in a
cubin for sm_80 without touching a driver. The signatures are those of the package's launches (pointer dtypes,
integer arguments, 16-byte aligned pointers) and the constexprs and warp counts come from the modules' own
tables, so a retuned tile is compiled as it will run.

Where the kernels fall back on Ampere:
- The pointer GEMM (`_int8_gemm_kernel`, every mode: tensor / row / block scales, bias, accumulate_into, split
  contraction, grouped) is the only GEMM the dispatch launches there (`int8_gemm._tma_eligible` needs
  capability 9). Its `tl.dot` on int8 becomes `mma.sync` (no wgmma).
- The persistent TMA kernel still compiles for sm_80: Triton rewrites its tensor descriptors into pointer
  loads and stores (`rewrite_tensor_descriptor_to_pointer` below capability 9), so no bulk-tensor copy and
  no wgmma is left in its PTX. It is checked, not launched, there.
- Quantize, SwiGLU, RMSNorm, RoPE, cross entropy and AdamW use no Hopper-only operation.
- INT8 attention (its quantize pass, forward, dK/dV and dQ kernels): the products become `mma.sync`.
- The Gluon GEMMs (int8_gemm_ws.py: tensor / row scales, and the block recipe's) are Hopper's alone (their wgmmas
  are written out): compiled for sm_90a only, and launched only on capability 9.
On Hopper (sm_90a) the same TMA kernel uses bulk tensor copies and wgmma; its configuration (`TMA_TILE`) is
compiled for it too, and its shared memory must fit `programs_per_sm` programs per SM. The attention kernels are
compiled for sm_90a too (they launch on every CUDA GPU): each of their products, the INT8 ones and dP's BF16 one,
is a wgmma there, which takes INT8 operands K-major only (hence the kernels' transposed copies).

The compiles take a few seconds each (10 s for the dK/dV attention kernel at head dim 128): 85-100 s of CPU for
the file, about half of it the attention kernels (triton 3.9), 90-160 s of wall time on a shared 2-core machine,
hence `slow`. Triton's cache makes a second run quick.
"""
import importlib
import re

import pytest
import torch
from interpreter import INTERPRETING

triton = pytest.importorskip("triton")
if INTERPRETING:
    pytest.skip("compiles with the real Triton compiler, not under TRITON_INTERPRET", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

pytestmark = pytest.mark.slow

AMPERE, HOPPER = GPUTarget("cuda", 80, 32), GPUTarget("cuda", 90, 32)
HOPPER_MAX_SHARED_PER_BLOCK = 227 * 1024  # cudaDevAttrMaxSharedMemoryPerBlockOptin on H100 / H200
HOPPER_SHARED_PER_SM, RESERVED_PER_BLOCK = 228 * 1024, 1024
HOPPER_ONLY_PTX = ("wgmma.", "cp.async.bulk.tensor", "cp.reduce.async.bulk.tensor", "setmaxnreg")

G = importlib.import_module("megatron_int8.kernels.int8_gemm")
Q = importlib.import_module("megatron_int8.kernels.quantize")
SW = importlib.import_module("megatron_int8.kernels.swiglu")
RN = importlib.import_module("megatron_int8.kernels.rms_norm")
AW = importlib.import_module("megatron_int8.kernels.adamw")
RP = importlib.import_module("megatron_int8.kernels.rope")
CE = importlib.import_module("megatron_int8.kernels.cross_entropy")
AT = importlib.import_module("megatron_int8.kernels.int8_attention")
_ATTENTION_OP = importlib.import_module("megatron_int8.ops.int8_attention")
ATTENTION_CONFIGS = {scores: _ATTENTION_OP.Int8AttentionConfig(scores=scores) for scores in ("int8", "bf16")}


def compile_for(target, kernel, pointers, constexprs, num_warps, num_stages=3, floats=(), source=ASTSource,
                **options):
    """triton.compile of `kernel` for `target`: pointer arguments (names ending in _ptr) typed by `pointers`
    (default fp32) and 16-byte aligned, `floats` fp32, every other runtime argument i32; constexprs not given
    take the kernel's defaults; `source`: GluonASTSource for a Gluon kernel; `options`: further launch options
    (enable_fp_fusion)."""
    signature, values, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
            values[name] = constexprs[name] if name in constexprs else param.default
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointers.get(name, "fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    unknown = set(constexprs) - set(values)
    assert not unknown, f"{kernel.__name__} has no constexprs {unknown}"
    return triton.compile(source(kernel, signature, values, attrs), target=target,
                          options=dict(num_warps=num_warps, num_stages=num_stages, **options))


def assert_code_for(compiled, target):
    """The compile went down to a cubin for `target`, and sm_80 code holds no Hopper-only instruction."""
    ptx = compiled.asm["ptx"]
    arch = f"sm_{target.arch}" + ("a" if target.arch >= 90 else "")
    assert re.search(rf"\.target {arch}\b", ptx), ptx[:400]
    assert len(compiled.asm["cubin"]) > 0
    if target.arch < 90:
        found = [op for op in HOPPER_ONLY_PTX if op in ptx]
        assert not found, f"Hopper-only PTX in sm_80 code: {found}"
    return ptx


# ------------------------------------------------------------------------------------------------- GEMMs
GEMM_POINTERS = dict(a_ptr="i8", b_ptr="i8", strip_ptr="i32")


def _gemm_pointers(out: str) -> dict:
    return dict(GEMM_POINTERS, c_ptr=out, bias_ptr=out)


PLAIN_CASES = {
    # id: (output dtype, constexprs)
    "tensor bf16 + bias, 128x256": ("bf16", dict(SCALE_MODE=0, HAS_BIAS=True, ACCUMULATE=False, SPLIT_K_EXACT=False,
                                                  EVEN_K=True, BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, SUB_K=1,
                                                  GROUP_M=8)),
    "row fp32 accumulate_into, ragged K": ("fp32", dict(SCALE_MODE=1, HAS_BIAS=False, ACCUMULATE=True,
                                                        SPLIT_K_EXACT=False, EVEN_K=False, BLOCK_M=128, BLOCK_N=128,
                                                        BLOCK_K=128, SUB_K=1, GROUP_M=8)),
    "block 128 fp32": ("fp32", dict(SCALE_MODE=2, HAS_BIAS=False, ACCUMULATE=False, SPLIT_K_EXACT=False, EVEN_K=True,
                                    BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, SUB_K=1, GROUP_M=8)),
    "row split contraction": ("fp32", dict(SCALE_MODE=1, HAS_BIAS=False, ACCUMULATE=False, SPLIT_K_EXACT=True,
                                           EVEN_K=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, SUB_K=1, GROUP_M=8)),
    "grouped row bf16": ("bf16", dict(SCALE_MODE=1, HAS_BIAS=False, ACCUMULATE=False, SPLIT_K_EXACT=False, EVEN_K=True,
                                      BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, SUB_K=1, GROUP_M=8, GROUPED=True)),
}


@pytest.mark.parametrize("case", list(PLAIN_CASES))
def test_plain_gemm_compiles_for_ampere(case):
    out, constexprs = PLAIN_CASES[case]
    ptx = assert_code_for(compile_for(AMPERE, G._int8_gemm_kernel, _gemm_pointers(out), constexprs, num_warps=8),
                          AMPERE)
    assert "mma.sync.aligned" in ptx and ".s8.s8" in ptx  # int8 tensor-core MMAs


def _tma_constexprs(variant: "G.TmaVariant", accumulate: bool, scale_mode: int, grouped=False) -> dict:
    opts = variant.launch_options(n_sms=132)
    warps, stages = opts.pop("num_warps"), opts.pop("num_stages")
    return dict(opts, SCALE_MODE=scale_mode, HAS_BIAS=False, ACCUMULATE=accumulate, GROUPED=grouped), \
        warps, stages


# (output, accumulate_into, scale mode): the forward / dgrad output and the wgrad into main_grad
TMA_OUTPUTS = [("bf16", False, 0), ("fp32", True, 1)]


@pytest.mark.parametrize("out,accumulate,scale_mode", TMA_OUTPUTS)
def test_tma_gemm_compiles_for_ampere_without_hopper_instructions(out, accumulate, scale_mode):
    """The dispatch never launches the TMA kernel below capability 9, but it compiles there: its descriptors
    become pointer accesses."""
    constexprs, warps, stages = _tma_constexprs(G.TMA_TILE, accumulate, scale_mode)
    ptx = assert_code_for(compile_for(AMPERE, G._int8_gemm_tma_kernel, _gemm_pointers(out), constexprs, warps,
                                      stages), AMPERE)
    assert "mma.sync.aligned" in ptx


@pytest.mark.parametrize("out,accumulate,scale_mode", TMA_OUTPUTS)
def test_tma_tile_compiles_for_hopper_and_fits(out, accumulate, scale_mode):
    """The TMA kernel's configuration (TMA_TILE): bulk-tensor loads, wgmma, a TMA store (or reduce-add into
    main_grad), and shared memory for `programs_per_sm` programs on one SM."""
    variant = G.TMA_TILE
    constexprs, warps, stages = _tma_constexprs(variant, accumulate, scale_mode)
    compiled = compile_for(HOPPER, G._int8_gemm_tma_kernel, _gemm_pointers(out), constexprs, warps, stages)
    ptx = assert_code_for(compiled, HOPPER)
    assert "wgmma.mma_async" in ptx and ".s32.s8.s8" in ptx
    assert "cp.async.bulk.tensor" in ptx
    assert ("cp.reduce.async.bulk.tensor" in ptx) == accumulate
    shared = compiled.metadata.shared
    assert shared <= HOPPER_MAX_SHARED_PER_BLOCK, f"{shared} bytes of shared memory"
    assert variant.programs_per_sm * (shared + RESERVED_PER_BLOCK) <= HOPPER_SHARED_PER_SM, shared


def test_grouped_tma_gemm_compiles_for_hopper():
    constexprs, warps, stages = _tma_constexprs(G.TMA_TILE, False, 1, grouped=True)
    assert_code_for(compile_for(HOPPER, G._int8_gemm_tma_kernel, _gemm_pointers("bf16"), constexprs, warps, stages),
                    HOPPER)


WS = importlib.import_module("megatron_int8.kernels.int8_gemm_ws")


@pytest.mark.skipif(WS.KERNEL is None, reason=str(WS.unavailable_reason()))
@pytest.mark.parametrize("out,scale_mode", [("bf16", 1), ("fp16", 0)])
def test_gluon_gemm_compiles_for_hopper_with_async_wgmma(out, scale_mode):
    """The warp-specialized Gluon GEMM (Hopper only: the dispatch gives it sm_90 GEMMs, int8_gemm_ws.supports): the
    k loop waits with one wgmma group still in flight (`wait_group 1`, where Triton's TMA kernel waits for 0), the
    producer's registers are handed to the consumers (setmaxnreg), loads are bulk tensor copies from descriptors
    made on the device, and the ring fits one program per SM."""
    from triton.experimental.gluon._runtime import GluonASTSource

    opts = WS.launch_options(scale_mode)  # num_warps is also a constexpr of the kernel (the consumers' layout)
    compiled = compile_for(HOPPER, WS.KERNEL, _gemm_pointers(out), opts, opts["num_warps"], num_stages=1,
                           source=GluonASTSource)
    ptx = assert_code_for(compiled, HOPPER)
    assert "wgmma.mma_async" in ptx and ".s32.s8.s8" in ptx
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)
    assert "setmaxnreg" in ptx and "cp.async.bulk.tensor" in ptx and "tensormap" in ptx
    assert compiled.metadata.shared <= HOPPER_MAX_SHARED_PER_BLOCK, compiled.metadata.shared


@pytest.mark.skipif(WS.BLOCK_KERNEL is None, reason=str(WS.unavailable_reason()))
@pytest.mark.parametrize("block,out,b_tiles,accumulate,bias", [(128, "bf16", True, False, True),
                                                                 (128, "fp32", False, True, False),
                                                                 (512, "bf16", True, False, False)])
def test_gluon_block_gemm_compiles_for_hopper(block, out, b_tiles, accumulate, bias):
    """The block recipe's Gluon GEMM (int8_gemm_ws.supports_block): wgmma on int8, each block's product waited for
    (`wait_group 0`; blocks of several k-steps keep one group in flight within the block, `wait_group 1`) before its
    promotion, which converts int32 to fp32 through the float bits where b is a weight in tiles of up to 256 (no cvt)
    and with cvt otherwise (wgrad's operands; 512: its products exceed 2**22), TMA loads from device-side
    descriptors, setmaxnreg, and a ring that fits one program per SM."""
    from triton.experimental.gluon._runtime import GluonASTSource

    opts = WS.block_launch_options(block, b_tiles, bias, accumulate)
    compiled = compile_for(HOPPER, WS.BLOCK_KERNEL, _gemm_pointers(out), opts, opts["num_warps"], num_stages=1,
                           source=GluonASTSource)
    ptx = assert_code_for(compiled, HOPPER)
    assert "wgmma.mma_async" in ptx and ".s32.s8.s8" in ptx
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+0;", ptx)
    assert ("cvt.rn.f32.s32" in ptx) == (block > 256 or not b_tiles)
    assert bool(re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)) == (block > 128)
    assert "setmaxnreg" in ptx and "cp.async.bulk.tensor" in ptx and "tensormap" in ptx
    assert compiled.metadata.shared <= HOPPER_MAX_SHARED_PER_BLOCK, compiled.metadata.shared


# ---------------------------------------------------------------------------------- the other kernels
def _quantize_cases():
    ATR, ATC = Q._AMAX_TILE
    amax = dict(TR=ATR, TC=ATC, TILE_MAX=False, ROW_MAX=True, COL_MAX=True, SEG=False)
    cases = {"amax rowwise + columnwise maxima": (Q._amax_kernel, dict(x_ptr="bf16", strip_ptr="i32"), amax,
                                                   Q._AMAX_WARPS)}
    for label, tensor, row, col, sr in (("tensor both axes", True, True, True, False),
                                        ("row both axes, stochastic", False, True, True, True)):
        TR, TC = Q._Q_TILE_T if col else Q._Q_TILE
        cx = dict(TR=TR, TC=TC, BP=1 if not tensor else Q._MAX_TILE_PARTIALS, SB=Q._SCALE_BLOCK, TENSOR=tensor,
                  ROW=row, COL=col, STOCHASTIC=sr, FOUR=True, SEG=False, FLAG=True)
        cases[f"quantize {label}"] = (Q._quantize_kernel, dict(x_ptr="bf16", q_ptr="i8", qt_ptr="i8", strip_ptr="i32"),
                                      cx, Q._Q_T_WARPS if col else Q._WARPS)
    for label, mode, tile, warps in (("block 128x128 weight", Q._MODE_TILE2D, (128, 128), 16),
                                     ("block 1x128 both axes", Q._MODE_1XB, (128, 128), 16)):
        cx = dict(TR=tile[0], TC=tile[1], MODE=mode, ROW=True, COL=True, STOCHASTIC=False, FOUR=True, FLAG=True)
        cases[f"quantize {label}"] = (Q._quantize_block_kernel, dict(x_ptr="bf16", q_ptr="i8", qt_ptr="i8"), cx, warps)
    return cases


def _other_cases():
    TR, TC = SW._TILE
    swiglu = dict(TR=TR, TC=TC, STAGES=SW._STAGES, MAXIMA=True, WEIGHTED=True)
    block_r, block_w = RN._blocks(4096)
    norm = dict(BLOCK_R=block_r, BLOCK_W=block_w, QB=128)
    cases = {
        # INT8_COPY: the kernels also write (forward) or read (backward) x's INT8 copy
        "swiglu forward + INT8 copy": (SW._swiglu_fwd_kernel, dict(x_ptr="bf16", y_ptr="bf16", q_ptr="i8"),
                                       dict(swiglu, INT8_COPY=True), SW._WARPS),
        "swiglu backward": (SW._swiglu_bwd_kernel, dict(g_ptr="bf16", x_ptr="bf16", dx_ptr="bf16"),
                            dict(swiglu, INT8_COPY=False), SW._WARPS),
        "swiglu backward from the INT8 copy": (SW._swiglu_bwd_kernel, dict(g_ptr="bf16", x_ptr="i8", dx_ptr="bf16"),
                                               dict(swiglu, INT8_COPY=True), SW._WARPS),
        "rms_norm forward + INT8 copy": (RN._rms_norm_fwd_kernel,
                                         dict(x_ptr="bf16", w_ptr="bf16", y_ptr="bf16", q_ptr="i8"),
                                         dict(norm, INT8_COPY=True), RN._WARPS),
        "rms_norm backward": (RN._rms_norm_bwd_kernel, dict(dy_ptr="bf16", x_ptr="bf16", w_ptr="bf16", dx_ptr="bf16"),
                              dict(norm, AMAX=True, INT8_COPY=False), RN._WARPS),
        "rms_norm backward from the INT8 copy": (RN._rms_norm_bwd_kernel, dict(dy_ptr="bf16", x_ptr="i8", w_ptr="bf16",
                                                                               dx_ptr="bf16"),
                                                 dict(norm, AMAX=True, INT8_COPY=True), RN._WARPS),
        "rms_norm weight-gradient sum": (RN._sum_rows_kernel, dict(out_ptr="bf16"),
                                         dict(BLOCK_P=64, BLOCK_W=RN._SUM_COLUMNS), 4),
        "rope": (RP._rope_kernel, dict(x_ptr="bf16", out_ptr="bf16"),
                 dict(BLOCK_H=4, BLOCK_HALF=64, BLOCK_PASS=1, INVERSE=False, PASS=False), 4),
        "cross entropy forward": (CE._ce_forward_kernel, dict(x_ptr="bf16", tgt_ptr="i64"),
                                  dict(BLOCK=CE.FORWARD_BLOCK, FINISH=True), CE.NUM_WARPS),
        "cross entropy backward": (CE._ce_backward_kernel, dict(x_ptr="bf16", tgt_ptr="i64", out_ptr="bf16"),
                                   dict(BLOCK=CE.BACKWARD_BLOCK), CE.NUM_WARPS),
    }
    adamw = dict(param_ptr="bf16", grad_ptr="bf16", master_ptr="i16", m_ptr="i8", v_ptr="i8")
    cases["adamw, INT8 moments, bf16 parameter + int16 remainder"] = (
        AW._adamw_kernel, adamw, dict(QB=AW.BLOCKS_PER_PROGRAM, QBLOCK_=AW.QBLOCK, MASTER=AW.MASTER_REMAINDER,
                                      M_KIND=AW.INT8, V_KIND=AW.INT8), 4)
    return cases


def _attention_cases():
    """The four attention kernels with Int8AttentionConfig's default tiles, causal, for head dims 128 and 64, and the
    three that take the scores' operands with scores="bf16" at 128."""
    cfg = ATTENTION_CONFIGS["int8"]
    quantize = dict(x_ptr="bf16", rows_ptr="i8", t_ptr="i8", o_ptr="bf16")  # scales, mean, delta: fp32
    bwd = dict(v_ptr="bf16", do_ptr="bf16")
    cases = {
        "attention quantize K: mean, per token + per block, d128": (
            AT._quantize_kernel, quantize, dict(D=128, BLOCK=cfg.block, MEAN=True, ROWS=True, DELTA=False), 8),
        "attention quantize dO: per block + delta, d128": (
            AT._quantize_kernel, quantize, dict(D=128, BLOCK=cfg.block, MEAN=False, ROWS=False, DELTA=True), 8),
    }
    for d, scores in ((128, "int8"), (64, "int8"), (128, "bf16")):
        bf16 = scores == "bf16"  # scores="bf16": Q and K of the scores in BF16 (the other products INT8)
        cfg = ATTENTION_CONFIGS[scores]  # the forward's default tile depends on the scores
        name = f"causal d{d}" + (" bf16 scores" if bf16 else "")
        qk = dict(q_ptr="bf16", k_ptr="bf16") if bf16 else dict(q_ptr="i8", k_ptr="i8")
        cases[f"attention forward {name}"] = (
            AT._attn_fwd_kernel, dict(qk, vt_ptr="i8", o_ptr="bf16"),
            dict(D=d, BLOCK_M=cfg.fwd_block_m, BLOCK_N=cfg.fwd_block_n, QBLOCK=cfg.block, CAUSAL=True,
                 SCORES_BF16=bf16, UPCAST=False),
            AT.warps_for(cfg.fwd_block_m))
        cases[f"attention backward dK dV {name}"] = (
            AT._attn_bwd_dkdv_kernel, dict(bwd, **qk, qt_ptr="i8", dot_ptr="i8", dk_ptr="bf16", dv_ptr="bf16"),
            dict(D=d, BLOCK_M=cfg.bwd_block_m, BLOCK_N=cfg.bwd_block_n, QBLOCK=cfg.block, CAUSAL=True,
                 SCORES_BF16=bf16, UPCAST=False),
            AT.warps_for(cfg.bwd_block_n))
        cases[f"attention backward dQ {name}"] = (
            AT._attn_bwd_dq_kernel, dict(bwd, **qk, kt_ptr="i8", dq_ptr="bf16"),
            dict(D=d, BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, QBLOCK=cfg.block, CAUSAL=True,
                 SCORES_BF16=bf16, UPCAST=False),
            AT.warps_for(cfg.dq_block_m))
    return cases


ATTENTION_CASES = _attention_cases()
OTHER_CASES = {**_quantize_cases(), **_other_cases(), **ATTENTION_CASES}


FLOAT_ARGUMENTS = ("eps", "decay", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "step_size", "inv_sqrt_bc2",
                   "qk_scale", "sm_scale")


@pytest.mark.parametrize("case", list(OTHER_CASES))
def test_kernel_compiles_for_ampere(case):
    kernel, pointers, constexprs, warps = OTHER_CASES[case]
    options = dict(enable_fp_fusion=False) if kernel is AW._adamw_kernel else {}  # as its launch
    assert_code_for(compile_for(AMPERE, kernel, pointers, constexprs, warps, floats=FLOAT_ARGUMENTS, **options),
                    AMPERE)


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_kernel_compiles_for_hopper_with_wgmma(case):
    """On sm_90a every product of the attention kernels is a wgmma (INT8 ones s32.s8.s8, BF16 scores f32.bf16.bf16; no
    mma.sync left), and a program's shared memory fits one block."""
    kernel, pointers, constexprs, warps = ATTENTION_CASES[case]
    compiled = compile_for(HOPPER, kernel, pointers, constexprs, warps, floats=FLOAT_ARGUMENTS)
    ptx = assert_code_for(compiled, HOPPER)
    if kernel is not AT._quantize_kernel:
        assert re.search(r"wgmma\.mma_async\S*\.s32\.s8\.s8", ptx) and "mma.sync" not in ptx
        if constexprs.get("SCORES_BF16"):
            assert re.search(r"wgmma\.mma_async\S*\.f32\.bf16\.bf16", ptx)
    assert compiled.metadata.shared <= HOPPER_MAX_SHARED_PER_BLOCK, compiled.metadata.shared


def test_every_kernel_is_covered():
    """Every @triton.jit entry point (a `*_kernel` launched from Python) of every module in megatron_int8/kernels
    has a case here."""
    import pkgutil

    import megatron_int8.kernels as package

    covered = {G._int8_gemm_kernel, G._int8_gemm_tma_kernel, WS.KERNEL, WS.BLOCK_KERNEL,
               *(k for k, *_ in OTHER_CASES.values())}
    launched = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        launched |= {getattr(module, name) for name in dir(module)
                     if name.endswith("_kernel") and isinstance(getattr(module, name), triton.runtime.JITFunction)}
    assert len(launched) >= 19 and launched <= covered, sorted(k.__name__ for k in launched - covered)
