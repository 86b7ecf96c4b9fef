"""Triton INT8 x INT8 -> INT32 GEMM with the dequantization fused into the epilogue.

out[M, N] = dequant(a[M, K] @ b[N, K]^T) [+ bias], both operands K-major (the only layout Hopper's
`wgmma ... s32.s8.s8` accepts), written as bf16/fp16/fp32, or added into an fp32 buffer (`accumulate_into`,
Megatron's gradient-accumulation fusion into `main_grad`).

Epilogues, in the reference's (megatron_int8.reference.gemm) order of fp32 operations:
- tensor: (acc * sa) * sb; row: (acc * sa[m]) * sb[n]; then + bias, then cast or add into the buffer.
- block: the loop walks K in blocks of `block_size`; each block's exact int32 partial is promoted to fp32
  and added as partial * sa[m, kb] * sb[n, kb] (BxB weight tiles index sb[n // B, kb]).
INT32 overflow: |acc| <= 127 * 127 * K, so for K > reference.MAX_EXACT_K the kernel accumulates int32 over
chunks of MAX_EXACT_K and sums the chunks in fp32, exactly like the reference.

Tiles: group-M swizzled output tiles; M/N edges read wrapped rows (in bounds, never stored) and K edges
are masked to zero, so ragged shapes are exact. Autotuned over a short list of Hopper configs.
Operands may be strided (unit last stride): an MoE expert's wgrad operands are column slices of the
segmented Q(x^T); the TMA kernel takes them where their row strides and pointers are 16-byte aligned.

Grouped mode (`triton_grouped_gemm`, MoE fprop/dgrad): a's rows hold every expert's tokens, each expert's
starting at a multiple of SEGMENT_ALIGN, and b the experts' stacked operands; each tile (BLOCK_M divides
SEGMENT_ALIGN) reads its expert from a per-strip table and offsets b's rows and scales by expert * N. One
launch for all experts, a fixed tile (token counts change with every routing, so nothing is tuned).

Routes (MEGATRON_INT8_GEMM_KERNEL, dispatch.py): one per architecture. Hopper: a hand-written CUDA kernel
(kernels/sm90_gemm.py) takes the tensor- and row-scale GEMMs without bias where nvcc builds it; else Triton's
persistent TMA kernel in one fixed configuration (TMA_TILE), sharing the 16-bit-output GEMMs with K > 4096 with
a warp-specialized Gluon kernel (kernels/int8_gemm_ws.py); the block recipe's GEMMs (block size 128, or 256 and 512
where they divide K) go to that module's block-scale kernel. Every other GPU, and what no Hopper kernel takes (other
block sizes, K > MAX_EXACT_K with tensor or row scales): the portable pointer kernel. With "auto" (the default) and
autotuning, `_gemm_plan` times the CUDA kernel against the Triton choice below and keeps the faster; the CUDA
kernel's grouped mode takes the grouped GEMMs with a bf16 output.

Triton dispatch: the first call per key (N; M and K rounded up to powers of two; scale mode, flags, output dtype,
device, TMA eligibility and the MEGATRON_INT8_GEMM_* settings) autotunes the plain kernel and, with
MEGATRON_INT8_GEMM_KERNEL=auto, times it against the TMA kernel (TMA_TILE, not tuned); the chosen kernel and
config are then cached in `_fast`, and later calls launch that kernel and config (grid from their own M) instead
of going through `triton.autotune`'s per-call dispatch (key building, pruning, hooks) and the kernel selection.
On top of that, each exact call signature (shapes, strides, dtypes, alignments, options) gets a plan
(`_PLANS`): its checks, arguments and launch are worked out once, and later calls only allocate the output
and call the compiled kernel (`launch.BoundLaunch`, past `JITFunction.run`). Small linears are
CPU-launch-bound, so this is measurable. The power-of-two buckets matter for
MoE experts, whose token count changes with every routing: it is M of their fprop and dgrad GEMMs and K
of their wgrad GEMM, so tuning per exact shape would benchmark all configs on nearly every expert GEMM,
while a bucket is tuned once (the best tile moves little within 2x of M or K).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch
import triton
import triton.language as tl
import triton.testing

from .. import reference as ref
from ..dispatch import ENV_GEMM_AUTOTUNE, ENV_GEMM_KERNEL, env_choice, env_flag
from . import int8_gemm_ws, sm90_gemm
from .launch import ARG, INTERPRETING, LaunchCache, PlanCache, capability, cdiv, next_pow2, num_sms
from ._tl import SEGMENT_ALIGN


_SCALE_TENSOR, _SCALE_ROW, _SCALE_BLOCK = 0, 1, 2


@triton.jit
def _int8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_sam, stride_sak, stride_sbn, stride_sbk,
    K_CHUNK,  # int32-exact contraction length (multiple of BLOCK_K), used when SPLIT_K_EXACT
    SB_ROWS_PER_SCALE,  # rows of b sharing one block-scale row (block_size for BxB tiles, else 1)
    strip_ptr,  # GROUPED: the expert owning each SEGMENT_ALIGN strip of a's rows
    SCALE_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
    SPLIT_K_EXACT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr,  # block recipe: block_size // BLOCK_K dot steps per scale block
    GROUP_M: tl.constexpr,
    GROUPED: tl.constexpr = False,  # b and sb: the experts' stacked [E * N, K] and [E * N] (grouped_gemm)
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % group) % size_m)
    pid_n = (pid % group) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_am = offs_m % M  # wrapped rows: in bounds, computed but never stored
    if GROUPED:  # the tile's expert (BLOCK_M divides SEGMENT_ALIGN) picks its N rows of b and of sb
        expert = tl.load(strip_ptr + (pid_m * BLOCK_M) // SEGMENT_ALIGN)
        offs_bn = expert.to(tl.int64) * N + offs_n % N
    else:
        offs_bn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_am[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_bn[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk

    if SCALE_MODE == 2:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        sa_ptrs = sa_ptr + offs_am.to(tl.int64) * stride_sam
        sb_ptrs = sb_ptr + (offs_bn // SB_ROWS_PER_SCALE).to(tl.int64) * stride_sbn
        n_kb = tl.cdiv(K, BLOCK_K * SUB_K)
        for kb in range(0, n_kb):
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            for s in tl.static_range(SUB_K):
                k0 = (kb * SUB_K + s) * BLOCK_K
                if EVEN_K:
                    a = tl.load(a_ptrs)
                    b = tl.load(b_ptrs)
                else:
                    a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0)
                    b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0)
                part = tl.dot(a, b, part, out_dtype=tl.int32)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
            sa = tl.load(sa_ptrs + kb * stride_sak)
            sb = tl.load(sb_ptrs + kb * stride_sbk)
            acc += (part.to(tl.float32) * sa[:, None]) * sb[None, :]
        out = acc
    else:
        if SPLIT_K_EXACT:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kc in range(0, K, K_CHUNK):
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
                for k0 in range(kc, tl.minimum(kc + K_CHUNK, K), BLOCK_K):
                    a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0)
                    b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0)
                    part = tl.dot(a, b, part, out_dtype=tl.int32)
                    a_ptrs += BLOCK_K * stride_ak
                    b_ptrs += BLOCK_K * stride_bk
                acc += part.to(tl.float32)
        else:
            iacc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            for k0 in range(0, K, BLOCK_K):
                if EVEN_K:
                    a = tl.load(a_ptrs)
                    b = tl.load(b_ptrs)
                else:
                    a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0)
                    b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0)
                iacc = tl.dot(a, b, iacc, out_dtype=tl.int32)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
            acc = iacc.to(tl.float32)
        if SCALE_MODE == 0:
            out = (acc * tl.load(sa_ptr)) * tl.load(sb_ptr)
        else:
            sa = tl.load(sa_ptr + offs_am.to(tl.int64) * stride_sam)
            sb = tl.load(sb_ptr + offs_bn.to(tl.int64) * stride_sbn)
            out = (acc * sa[:, None]) * sb[None, :]

    if HAS_BIAS:
        out = out + tl.load(bias_ptr + offs_bn).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    c_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if ACCUMULATE:
        out = tl.load(c_ptrs, mask=c_mask, other=0.0) + out
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=c_mask)


# Triton's interpreter has no TMA reduce (create_descriptor_reduce); there the epilogue adds through a load
_TMA_REDUCE = tl.constexpr(not INTERPRETING)


@triton.jit
def _tma_write(c_desc, om, on, tile, ACCUMULATE: tl.constexpr):
    """One output (sub-)tile through TMA: a reduce-add into the fp32 buffer, or a store."""
    if ACCUMULATE:
        if _TMA_REDUCE:
            c_desc.atomic_add([om, on], tile)
        else:
            c_desc.store([om, on], c_desc.load([om, on]) + tile)
    else:
        c_desc.store([om, on], tile.to(c_desc.dtype))


@triton.jit
def _column_halves(tile, ROWS: tl.constexpr, COLS: tl.constexpr):
    """(left, right) column halves of a [ROWS, COLS] register tile, for the TMA epilogue's sub-tiles."""
    return tl.split(tl.permute(tl.reshape(tile, (ROWS, 2, COLS // 2)), (0, 2, 1)))


@triton.jit
def _int8_gemm_tma_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K,
    stride_am, stride_bn,  # row strides of a and b (16-byte multiples; their last stride is 1)
    strip_ptr,  # GROUPED: the expert owning each SEGMENT_ALIGN strip of a's rows
    NB,  # rows of b: N, or E * N when GROUPED
    SCALE_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr, GROUPED: tl.constexpr = False,
):
    """Persistent variant (tensor and row scales, operands with unit last stride): TMA tensor-descriptor
    loads (out-of-bounds boxes read as zero), one program per SM walking the group-M swizzled tiles, the tile loop
    flattened into the k loop, so one tile's epilogue overlaps the next tile's loads.
    The output tile leaves through TMA (clipped at the edges), in 4 column sub-tiles so that the
    shared-memory staging buffer fits beside the pipeline and a second program on the SM. With
    ACCUMULATE (fp32 `accumulate_into`, the wgrad into main_grad) it is a TMA reduce-add: L2 adds the tile
    into main_grad asynchronously, so the old values never pass through registers and the next tile's
    mainloop does not wait for them. (The add is IEEE fp32 round-to-nearest; like every PTX fp32 reduction
    it flushes subnormal operands and results to zero.)
    GROUPED (grouped_gemm, row scales): b and sb are the experts' stacked [E * N, K] and [E * N]; a tile
    reads the N rows of its expert (BLOCK_M divides SEGMENT_ALIGN); a box past them reads the next
    expert's rows into columns >= N, which are never stored."""
    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[NB, K], strides=[stride_bn, 1], block_shape=[BLOCK_N, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N // 4])
    group = GROUP_M * num_pid_n
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=True):
        first_m = (tile_id // group) * GROUP_M
        size_m = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + ((tile_id % group) % size_m)
        pid_n = (tile_id % group) // size_m
        om = pid_m * BLOCK_M
        on = pid_n * BLOCK_N
        if GROUPED:
            bn = tl.load(strip_ptr + om // SEGMENT_ALIGN) * N + on  # b's first row for this tile
        else:
            bn = on
        iacc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for ki in range(k_tiles):
            a = a_desc.load([om, ki * BLOCK_K])
            b = b_desc.load([bn, ki * BLOCK_K])
            iacc = tl.dot(a, b.T, iacc, out_dtype=tl.int32)
        out = iacc.to(tl.float32)
        offs_m = om + tl.arange(0, BLOCK_M)
        offs_n = on + tl.arange(0, BLOCK_N)
        if SCALE_MODE == 0:
            out = (out * tl.load(sa_ptr)) * tl.load(sb_ptr)
        else:
            sa = tl.load(sa_ptr + offs_m, mask=offs_m < M, other=0.0)
            sb = tl.load(sb_ptr + (bn + tl.arange(0, BLOCK_N)), mask=offs_n < N, other=0.0)
            out = (out * sa[:, None]) * sb[None, :]
        if HAS_BIAS:
            out = out + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        left, right = _column_halves(out, BLOCK_M, BLOCK_N)  # 4 column quarters
        q0, q1 = _column_halves(left, BLOCK_M, BLOCK_N // 2)
        q2, q3 = _column_halves(right, BLOCK_M, BLOCK_N // 2)
        _tma_write(c_desc, om, on, q0, ACCUMULATE)
        _tma_write(c_desc, om, on + BLOCK_N // 4, q1, ACCUMULATE)
        _tma_write(c_desc, om, on + BLOCK_N // 2, q2, ACCUMULATE)
        _tma_write(c_desc, om, on + 3 * BLOCK_N // 4, q3, ACCUMULATE)


def _scratch_alloc(size, alignment, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _ensure_allocator():
    """Device-side tensor descriptors need a scratch allocator. Triton keeps it in a ContextVar, i.e. per
    thread: set it on every launch, since autograd runs backward on its own thread."""
    triton.set_allocator(_scratch_alloc)


def _tma_eligible(ad, bd, c, mode, split, scales=()) -> bool:
    """Hopper, tensor or row scales, no split contraction, and what TMA descriptors need: 16-byte aligned
    base pointers and row strides, unit last strides. The int8 operands may be strided views (an MoE
    expert's wgrad operands are column slices of Q(x^T)); the output c is contiguous. The TMA kernel
    reads row scales at unit stride: strided `scales` go to the plain kernel, which takes their strides."""
    if mode == _SCALE_BLOCK or split:
        return False
    if any(s.dim() and s.stride(-1) != 1 for s in scales):
        return False
    return _tma_operands(ad, bd, c)


def _tma_operands(ad, bd, c) -> bool:
    """What TMA descriptors need of the operands and what the TMA epilogues need of c, on an sm_90+ GPU."""
    if not ad.is_cuda or capability(ad.device)[0] < 9:
        return False
    if not c.is_contiguous() or (c.shape[1] * c.element_size()) % 16:
        return False
    if any(t.stride(1) != 1 or t.stride(0) % 16 for t in (ad, bd)):  # int8: strides in bytes
        return False
    return all(t.data_ptr() % 16 == 0 for t in (ad, bd, c))


def _block_ws_eligible(ad, bd, c, block_size: int, sb_rows: int, K: int) -> bool:
    """Whether a block-scale GEMM goes to the Gluon block-scale kernel (int8_gemm_ws.supports_block): Hopper's
    route for the block recipe (MEGATRON_INT8_GEMM_KERNEL=portable keeps the plain kernel). Its operands as TMA
    loads need them; c as the TMA kernels need it too, which its pointer stores do not, but those are the outputs
    its GPU tests cover."""
    return (not INTERPRETING and env_choice(ENV_GEMM_KERNEL) != "portable" and _tma_operands(ad, bd, c)
            and int8_gemm_ws.supports_block(c, block_size, sb_rows, K))


class TmaVariant(NamedTuple):
    """The persistent TMA kernel's fixed configuration. `programs_per_sm` persistent programs run on each SM (they
    must fit its shared memory and registers together). GEMMs with K above `gluon_min_k` go to the
    warp-specialized Gluon kernel (kernels/int8_gemm_ws.py) where it applies (int8_gemm_ws.supports); the rest run
    this configuration."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    programs_per_sm: int
    gluon_min_k: int

    def launch_options(self, n_sms: int) -> dict:
        """The kernel's tile keywords and launch options on a GPU of n_sms SMs."""
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k, GROUP_M=8,
                    NUM_SMS=n_sms * self.programs_per_sm, num_warps=self.num_warps, num_stages=self.num_stages)


# The TMA kernel's one configuration, wherever it runs (untuned calls, the Hopper route, and the TMA candidate
# that "auto" times against the plain kernel; the CUDA kernel is unaffected).
# Triton 3.6 issues an int8 wgmma synchronously (its pipeliner makes a dot asynchronous only with an fp32
# accumulator, WGMMAPipeline.cpp "Rule 2.1"; every k-block ends in `warp_group_dot_wait 0`). Two ways hide that
# wait: 128 x 128 x 128 tiles on 4 warps, 3 stages, the tile loop flattened into the k loop, the epilogue in 4
# column sub-tiles, 2 programs per SM (104 / 112 KB of shared memory each, bf16 / fp32 into main_grad; checked by
# tests/kernels/test_compile_targets.py), so that one program's waits and epilogue overlap the other's mainloop;
# and GEMMs with K > int8_gemm_ws.MIN_K and a 16-bit output go to the warp-specialized Gluon kernel, which issues
# its wgmmas asynchronously and is the faster of the two exactly there (its epilogue is not overlapped, so short
# k loops lose). On an H100 (72c340d, that commit's benchmarks/bench_triton_gemm.py) this pair ran the 42 GEMMs at
# a median 0.915x the CUDA kernel; the other configurations measured then are in docs/history.md.
TMA_TILE = TmaVariant(128, 128, 128, 4, 3, programs_per_sm=2, gluon_min_k=int8_gemm_ws.MIN_K)
# a grouped GEMM's tile must not span two experts' row segments
assert ref.SEGMENT_ALIGN % TMA_TILE.block_m == 0, "TMA_TILE's rows must divide SEGMENT_ALIGN"


_GEMM_PLAIN, _GEMM_TMA = LaunchCache(_int8_gemm_kernel), LaunchCache(_int8_gemm_tma_kernel)
_GEMM_WS = LaunchCache(int8_gemm_ws.KERNEL) if int8_gemm_ws.KERNEL is not None else None
_GEMM_WS_BLOCK = LaunchCache(int8_gemm_ws.BLOCK_KERNEL) if int8_gemm_ws.BLOCK_KERNEL is not None else None
_fast = {}  # dispatch key -> select(args) of the kernel and config chosen for it (see module doc)
_PLANS = PlanCache(1024)  # call signature -> run(a, b, bias, accumulate_into, out); see _gemm_plan
CHOSEN = {}  # (M, N, K) -> "cuda" or "triton": the kernel the latest plan for that shape took (benchmarks)


def dispatch_buckets(M: int, N: int, K: int) -> tuple:
    """The shape part of a dispatch key: M and K rounded up to powers of two (MoE token counts vary)."""
    return next_pow2(M), N, next_pow2(K)


def _configs():
    cfgs = []
    for bm, bn, warps, stages in [
        (256, 128, 8, 3), (256, 128, 8, 4), (128, 256, 8, 3), (128, 256, 8, 4),
        (128, 128, 4, 4), (128, 128, 8, 4), (128, 128, 4, 5),
    ]:
        cfgs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8}, num_warps=warps, num_stages=stages))
    return cfgs


_PLAIN_SHARED_BYTES = 200 * 1024  # the plain kernel's pipeline buffers, under Hopper's 227 KiB per block


def plain_stages(block_m: int, block_n: int, block_k: int, sub_k: int, stages: int) -> int:
    """`stages`, or fewer where its buffers would not fit shared memory: a block recipe's block of sub_k k-steps
    (block size 256: 2, 512: 4) is unrolled, and each step's operand tiles are buffered per stage, so 128 x 256
    tiles on 3 stages needed 295,936 bytes (289 KiB) at block size 256 under Triton 3.6 (Hopper: 227 KiB)."""
    per_stage = sub_k * (block_m + block_n) * block_k  # int8 operand tiles
    return max(1, min(stages, _PLAIN_SHARED_BYTES // per_stage))


def _prune(configs, named_args, **kwargs):
    """Drop tiles far larger than the problem (tiny or ragged GEMMs); fewer stages where a block recipe's unrolled
    block would not fit shared memory (plain_stages)."""
    M, N = named_args["M"], named_args["N"]
    keep = [c for c in configs if c.kwargs["BLOCK_M"] <= max(128, next_pow2(M))
            and c.kwargs["BLOCK_N"] <= max(128, next_pow2(N))] or configs[:1]
    sub_k, block_k = kwargs.get("SUB_K", 1), kwargs.get("BLOCK_K", 128)
    fitted = []
    for c in keep:
        stages = plain_stages(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], block_k, sub_k, c.num_stages)
        if stages != c.num_stages:
            c = triton.Config(dict(c.kwargs), num_warps=c.num_warps, num_stages=stages)
        if all(stages != f.num_stages or c.kwargs != f.kwargs or c.num_warps != f.num_warps for f in fitted):
            fitted.append(c)
    return fitted


_int8_gemm_tuned = triton.autotune(
    configs=_configs(),
    key=["M", "N", "K", "SCALE_MODE", "HAS_BIAS", "ACCUMULATE", "SPLIT_K_EXACT", "EVEN_K", "BLOCK_K", "SUB_K"],
    prune_configs_by={"early_config_prune": _prune},
    # no restore_value: accumulating calls are tuned on a scratch copy of their buffer (triton_gemm)
    do_bench=lambda fn, quantiles: triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles),
)(_int8_gemm_kernel)


def _block_k_for(block_size: int) -> int:
    for bk in (128, 64, 32, 16):
        if block_size % bk == 0:
            return bk
    raise ValueError(f"block_size {block_size} must be a multiple of 16")


def triton_gemm(
    a: ref.QTensor,
    b: ref.QTensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: Optional[torch.Tensor] = None,
    accumulate_into: Optional[torch.Tensor] = None,
    autotune: bool = True,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """dequant(a @ b^T) [+ bias] as out_dtype, or added into `accumulate_into` (fp32) and returned.
    `out`: a contiguous [M, N] out_dtype tensor to write instead of a new one (e.g. rows of a larger output).

    autotune=False (or MEGATRON_INT8_GEMM_AUTOTUNE=0): no tuning or timing; the CUDA sm_90a kernel where it
    applies (kernels/sm90_gemm.py), else one fixed tile of the persistent TMA kernel where the operands allow it
    (MEGATRON_INT8_GEMM_KERNEL=portable: the plain kernel), else of the plain kernel.
    Host cost: checks, kernel choice and launch arguments are worked out once per plan key (every tensor's
    shape, strides, dtype and 16-byte alignment, the options); later calls with that key allocate the
    output and call the bound launch (launch.BoundLaunch)."""
    ad, bd, sa, sb = a.data, b.data, a.scale, b.scale
    tuned = autotune and not INTERPRETING and env_flag(ENV_GEMM_AUTOTUNE)
    key = (ad.device, ad.shape, ad.stride(), ad.dtype, ad.data_ptr() % 16, bd.shape, bd.stride(), bd.dtype,
           bd.data_ptr() % 16, a.granularity, a.block_size, a.tile2d, b.granularity, b.block_size, b.tile2d,
           sa.shape, sa.stride(), sa.dtype, sa.data_ptr() % 16, sb.shape, sb.stride(), sb.dtype, sb.data_ptr() % 16,
           out_dtype, None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.data_ptr() % 16),
           None if accumulate_into is None else (accumulate_into.shape, accumulate_into.stride(),
                                                 accumulate_into.dtype, accumulate_into.data_ptr() % 16),
           None if out is None else (out.shape, out.stride(), out.dtype, out.data_ptr() % 16),
           tuned, env_choice(ENV_GEMM_KERNEL), ref.MAX_EXACT_K)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _gemm_plan(a, b, out_dtype, bias, accumulate_into, tuned, out)
        _PLANS.put(key, plan)
    return plan(a, b, bias, accumulate_into, out)


def _gemm_plan(a, b, out_dtype, bias, accumulate_into, tuned, out=None):
    """`run(a, b, bias, accumulate_into, out) -> c` for every call of this plan key (triton_gemm): the CUDA
    sm_90a kernel (kernels/sm90_gemm.py) or a Triton kernel, per MEGATRON_INT8_GEMM_KERNEL."""
    ref.check_gemm_operands(a, b)
    ref.check_gemm_out(a, b, out_dtype, accumulate_into, out, bias)
    M, K = a.data.shape
    N = b.data.shape[0]
    if M == 0 or N == 0 or K == 0:
        return lambda a, b, bias, acc, out: ref.gemm(a, b, out_dtype=out_dtype, bias=bias, accumulate_into=acc,
                                                     out=out)
    which = env_choice(ENV_GEMM_KERNEL)
    cuda_ok = _use_cuda(which, lambda: sm90_gemm.supports(a, b, bias, out_dtype, accumulate_into, out))
    CHOSEN[(M, N, K)] = "triton"
    if not cuda_ok:
        return _triton_plan(a, b, out_dtype, bias, accumulate_into, tuned, out)

    cuda_launch = sm90_gemm.planned(a, b, out_dtype, accumulate_into is not None)

    def cuda_run(a, b, bias, accumulate_into, out):
        return cuda_launch(a, b, accumulate_into, out)

    if which == "hopper" or not tuned:
        run = cuda_run
    else:
        triton_run = _triton_plan(a, b, out_dtype, bias, accumulate_into, tuned, out)
        run = _faster((cuda_run, triton_run), a, b, bias, accumulate_into, out)
    if run is cuda_run:
        CHOSEN[(M, N, K)] = "cuda"
    return run


def _use_cuda(which: str, supported: Callable[[], bool]) -> bool:
    """Whether a GEMM goes to the CUDA kernel: MEGATRON_INT8_GEMM_KERNEL `which` is "auto" or "hopper" and the
    kernel takes the operands (`supported()`) and is available (else the Hopper route is Triton's TMA pair)."""
    return which in ("auto", "hopper") and not INTERPRETING and supported() and sm90_gemm.available()


def _no_hopper_kernel(tma_ok: bool) -> None:
    """MEGATRON_INT8_GEMM_KERNEL=hopper asks for the Hopper kernels only: raise where none takes the GEMM."""
    if not tma_ok:
        raise ValueError(f"{ENV_GEMM_KERNEL}=hopper: no Hopper kernel takes this GEMM (they need an sm_90 GPU, "
                         "16-byte-aligned operands, and tensor or row scales with K <= MAX_EXACT_K or block scales "
                         "of block size 128, or 256 and 512 dividing K); unset it (auto) to run the portable kernel "
                         "here")


def _fastest(candidates: dict, optional=()):
    """The key of the fastest zero-argument callable, each called once first (compiling, autotuning) and
    then timed (median of do_bench). A candidate named in `optional` that raises is left out."""
    times = {}
    for name, fn in candidates.items():
        try:
            fn()
            times[name] = triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")
        except Exception:  # noqa: BLE001  (e.g. a Triton kernel that fails to compile is simply not chosen)
            if name not in optional:
                raise
    return min(times, key=times.get)


def _faster(runs, a, b, bias, accumulate_into, out):
    """The faster of two plan functions, timed on scratch destinations (accumulate_into must be added into
    exactly once, by the real call)."""
    acc = None if accumulate_into is None else _scratch_like(accumulate_into)
    dest = None if out is None else _scratch_like(out)
    return runs[_fastest({i: functools.partial(run, a, b, bias, acc, dest) for i, run in enumerate(runs)})]


def _scratch_like(t: torch.Tensor) -> torch.Tensor:
    """A copy with t's strides: plans launch with the real destination's row stride baked in."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _triton_plan(a, b, out_dtype, bias, accumulate_into, tuned, out=None):
    """The Triton kernels' plan function (_gemm_plan)."""
    M, K = a.data.shape
    N = b.data.shape[0]
    dev = a.data.device
    # a stand-in output with the real one's properties, for the plan's checks and the autotuner's trials
    c = accumulate_into if accumulate_into is not None else out
    if c is None:
        c = torch.empty((M, N), dtype=out_dtype, device=dev)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    ad, bd = a.data, b.data
    sub_k, sb_rows = 1, 1
    row_block_scales = False
    if a.granularity == "tensor":
        mode, sa, sb = _SCALE_TENSOR, a.scale, b.scale
        s_strides = (0, 0, 0, 0)
        block_k = 128
    elif a.granularity == "row":
        mode, sa, sb = _SCALE_ROW, a.scale, b.scale
        s_strides = (sa.stride(0), 0, sb.stride(0), 0)
        block_k = 128
    elif a.granularity == "block":
        mode = _SCALE_BLOCK
        B = a.block_size
        block_k = _block_k_for(B)
        sub_k = B // block_k
        row_block_scales = a.tile2d
        sa = a.scale_per_row_block() if a.tile2d else a.scale  # activations: [M, nkb]
        sb = b.scale
        sb_rows = B if b.tile2d else 1
        s_strides = (sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1))
    else:
        raise ValueError(f"unknown granularity {a.granularity!r}")
    if INTERPRETING:
        block_k = min(block_k, 32)
        if mode == _SCALE_BLOCK:
            block_k = 32 if a.block_size % 32 == 0 else 16
            sub_k = a.block_size // block_k
    max_k = ref.MAX_EXACT_K  # read at plan time (tests shrink it; it is part of the plan key)
    split = mode != _SCALE_BLOCK and K > max_k
    k_chunk = max(block_k, max_k // block_k * block_k)
    args = _plain_args(ad, bd, c, sa, sb, bias if bias is not None else c, M, N, K, s_strides, k_chunk, sb_rows, sa)
    meta = dict(SCALE_MODE=mode, HAS_BIAS=bias is not None, ACCUMULATE=accumulate_into is not None,
                SPLIT_K_EXACT=split, EVEN_K=K % (block_k * sub_k) == 0, BLOCK_K=block_k, SUB_K=sub_k)
    tma_ok = _tma_eligible(ad, bd, c, mode, split, (sa, sb))
    if mode == _SCALE_BLOCK and _block_ws_eligible(ad, bd, c, a.block_size, sb_rows, K):
        # one configuration, not tuned: at block size 128 it ran each of Llama2-7B's GEMMs 1.05-1.42x faster than the
        # tuned plain kernel (H200, docs/benchmarks.md)
        opts = int8_gemm_ws.block_launch_options(a.block_size, sb_rows > 1, bias is not None,
                                                 accumulate_into is not None)
        tiles = cdiv(M, opts["BLOCK_M"]) * cdiv(N, opts["BLOCK_N"])
        cache, grid, launch_args, kw = _GEMM_WS_BLOCK, (min(num_sms(dev), tiles),), args, opts
    elif tuned:
        cache, grid, launch_args, kw = _tuned_launch(args, meta, M, N, K, c, tma_ok)
    else:
        cache, grid, launch_args, kw = _untuned_launch(args, meta, tma_ok, N)
    launch = cache.prepare(grid, tuple(ARG if isinstance(v, torch.Tensor) else v for v in launch_args), **kw)
    tma = cache in (_GEMM_TMA, _GEMM_WS, _GEMM_WS_BLOCK)  # device-side tensor descriptors

    def run(a, b, bias, accumulate_into, out):
        if tma:  # the scratch allocator is per thread, and backward runs on autograd's own
            _ensure_allocator()
        c = accumulate_into if accumulate_into is not None else out
        if c is None:
            c = torch.empty((M, N), dtype=out_dtype, device=dev)
        sa = a.scale_per_row_block() if row_block_scales else a.scale
        if bias is None:
            bias = c
        elif not bias.is_contiguous():
            bias = bias.contiguous()
        # the tensors in the kernels' argument order (_plain_args; _tma_args keeps it)
        launch(a.data, b.data, c, sa, b.scale, bias, sa)
        return c
    return run


def _plain_args(ad, bd, c, sa, sb, bias, M, N, K, s_strides, k_chunk, sb_rows, strips) -> tuple:
    """The plain kernel's runtime arguments (the TMA kernel's are derived by _tma_args)."""
    return (ad, bd, c, sa, sb, bias, M, N, K, ad.stride(0), ad.stride(1), bd.stride(0), bd.stride(1),
            c.stride(0), c.stride(1), *s_strides, k_chunk, sb_rows, strips)


def _tma_args(args, nb: int) -> tuple:
    """The TMA kernel's runtime arguments from the plain kernel's: a..K, the row strides of a and b, the
    strip owners and b's row count `nb`."""
    return (*args[:9], args[9], args[11], args[-1], nb)


def _untuned_launch(args, meta, tma_ok: bool, nb: int):
    """(cache, grid, arguments, keywords) of one fixed tile, no tuning (one compile per kernel): the
    persistent TMA kernel where the operands allow it (MEGATRON_INT8_GEMM_KERNEL=portable: never), else the
    plain kernel; 16 x 16 tiles in the interpreter. `nb`: the rows of b (E * N for grouped GEMMs)."""
    M, N = args[6], args[7]
    if INTERPRETING:
        return _GEMM_PLAIN, (cdiv(M, 16) * cdiv(N, 16),), args, dict(meta, BLOCK_M=16, BLOCK_N=16, GROUP_M=2)
    which = env_choice(ENV_GEMM_KERNEL)
    if which == "hopper":
        _no_hopper_kernel(tma_ok)
    c_dtype = args[2].dtype
    if tma_ok and which != "portable":
        return _tma_tile_launch(args, meta, nb)
    # fp32 outputs leave the plain kernel through registers: beside a 128 x 256 accumulator, the loaded
    # fp32 tile of `accumulate_into` doubles the registers per thread (Mixtral fc1 wgrad: 198 TOP/s);
    # a split contraction's 128 x 256 tile needs 272 KB of shared memory (triton 3.6, unaligned K)
    wide = c_dtype.itemsize == 2 and N >= 256 and M >= 128 and not meta["SPLIT_K_EXACT"]
    BM, BN = (128, 256) if wide else (128, 128)
    stages = plain_stages(BM, BN, meta["BLOCK_K"], meta["SUB_K"], 3)
    return _GEMM_PLAIN, (cdiv(M, BM) * cdiv(N, BN),), args, dict(meta, BLOCK_M=BM, BLOCK_N=BN, GROUP_M=8,
                                                                  num_warps=8, num_stages=stages)


def _tma_tile_launch(args, meta, nb: int):
    """(cache, grid, arguments, keywords) of the persistent TMA kernel in its fixed configuration (TMA_TILE), or
    of the Gluon kernel where the configuration hands it this GEMM (TmaVariant.gluon_min_k)."""
    _ensure_allocator()
    grouped = meta.get("GROUPED", False)
    M, N, K, c = args[6], args[7], args[8], args[2]
    if (K > TMA_TILE.gluon_min_k and int8_gemm_ws.supports(c, meta["HAS_BIAS"], meta["ACCUMULATE"], grouped)):
        opts = int8_gemm_ws.launch_options(meta["SCALE_MODE"])
        tiles = cdiv(M, opts["BLOCK_M"]) * cdiv(N, opts["BLOCK_N"])
        return _GEMM_WS, (min(num_sms(args[0].device), tiles),), _tma_args(args, nb), opts
    opts = TMA_TILE.launch_options(num_sms(args[0].device))
    tiles = cdiv(M, opts["BLOCK_M"]) * cdiv(N, opts["BLOCK_N"])
    return _GEMM_TMA, (min(opts["NUM_SMS"], tiles),), _tma_args(args, nb), dict(
        opts, SCALE_MODE=meta["SCALE_MODE"], HAS_BIAS=meta["HAS_BIAS"], ACCUMULATE=meta["ACCUMULATE"],
        GROUPED=grouped)


def _tuned_launch(args, meta, M, N, K, c, tma_ok):
    """(cache, grid, arguments, keywords) of the kernel and config selected for this dispatch key: the
    first call per key autotunes the plain kernel (on a scratch copy of c) and, with
    MEGATRON_INT8_GEMM_KERNEL=auto, times it against the TMA kernel."""
    which = env_choice(ENV_GEMM_KERNEL)
    # operand strides are kernel arguments (the JIT specializes them itself): not part of the key
    fast_key = (*dispatch_buckets(M, N, K), c.dtype, args[0].device, tma_ok, which, *meta.values())
    selected = _fast.get(fast_key)
    if selected is None:
        launch_plain, launch_tma = _launchers(args, meta, M, N, tma_ok)
        if which == "hopper":
            _no_hopper_kernel(launch_tma is not None)
        # autotuning runs every trial on a scratch copy (accumulate_into must be added into exactly once)
        if which == "auto" and launch_tma is not None:
            which = _pick(launch_plain, launch_tma, c)
        else:
            which = "tma" if which == "hopper" else "plain"
            (launch_tma if which == "tma" else launch_plain)(c.clone() if meta["ACCUMULATE"] else torch.empty_like(c))
        selected = _fast[fast_key] = _selected_config(which == "tma", meta, N)
    return selected(args)


def _selected_config(tma: bool, meta, N):
    """select(args) -> (cache, grid, arguments, keywords) of the kernel chosen for this key: the TMA kernel's
    fixed configuration, or the config the autotuner just used for the plain kernel (its `best_config`), for
    calls that may differ in M within the bucket (args[6] sets the grid).
    Its `kernel` attribute names the kernel ("plain" or "tma"), for benchmarks to report."""
    if tma:

        def select_tma(args):
            return _tma_tile_launch(args, meta, N)

        select_tma.kernel = "tma"
        return select_tma
    kw = dict(_int8_gemm_tuned.best_config.all_kwargs())
    BM, n_tiles = kw["BLOCK_M"], cdiv(N, kw["BLOCK_N"])
    kw.update(meta)

    def select(args):
        return _GEMM_PLAIN, (cdiv(args[6], BM) * n_tiles,), args, kw

    select.kernel = "plain"
    return select


def triton_grouped_gemm(a: ref.QTensor, b: ref.QTensor, segments: ref.Segments, *,
                        out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Same contract as reference.grouped_gemm: rows of segment e of the output = dequant(a_e @ b[e]^T), [R, N].

    One launch for all experts (MoE fprop/dgrad): b's stacked [E, N, K] is read as [E * N, K], and each
    BLOCK_M-row tile (BLOCK_M divides SEGMENT_ALIGN) looks up its expert in Segments.strip_experts and
    uses that expert's N rows of b and of its scales; rows of empty segments do not exist. On Hopper the
    CUDA kernel's grouped mode takes bf16 outputs (sm90_gemm.sm90_grouped_gemm; MEGATRON_INT8_GEMM_KERNEL
    "portable" keeps Triton). Triton: a fixed tile, no autotuning (the token counts change with every
    routing), the persistent TMA kernel where the operands allow it, else the plain kernel. K > MAX_EXACT_K:
    the plain kernel's exact split contraction (int32 chunks summed in fp32), as triton_gemm."""
    ref.check_grouped_operands(a, b, segments)
    R, K = a.data.shape
    E, N, _ = b.data.shape
    if R == 0 or N == 0 or K == 0:
        return ref.grouped_gemm(a, b, segments, out_dtype=out_dtype)
    if _use_cuda(env_choice(ENV_GEMM_KERNEL), lambda: sm90_gemm.supports_grouped(a, b, out_dtype)):
        return sm90_gemm.sm90_grouped_gemm(a, b, segments, out_dtype=out_dtype)
    c = torch.empty((R, N), dtype=out_dtype, device=a.data.device)
    ad, bd, sb = a.data, b.data.reshape(E * N, K), b.scale.reshape(E * N)
    block_k = 32 if INTERPRETING else 128
    split = K > ref.MAX_EXACT_K
    args = _plain_args(ad, bd, c, a.scale, sb, c, R, N, K, (a.scale.stride(0), 0, sb.stride(0), 0),
                       max(block_k, ref.MAX_EXACT_K // block_k * block_k), 1, segments.strip_experts(ad.device))
    meta = dict(SCALE_MODE=_SCALE_ROW, HAS_BIAS=False, ACCUMULATE=False, SPLIT_K_EXACT=split,
                EVEN_K=K % block_k == 0, BLOCK_K=block_k, SUB_K=1, GROUPED=True)
    tma_ok = _tma_eligible(ad, bd, c, _SCALE_ROW, split, (a.scale, sb))
    cache, grid, launch_args, kw = _untuned_launch(args, meta, tma_ok, E * N)
    cache.launch(grid, *launch_args, **kw)
    return c


def _launchers(args, meta, M, N, tma_ok):
    def plain(out):
        grid = lambda m: (cdiv(M, m["BLOCK_M"]) * cdiv(N, m["BLOCK_N"]),)  # noqa: E731
        _int8_gemm_tuned[grid](*(args[:2] + (out,) + args[3:]), **meta)

    if not tma_ok:
        return plain, None

    def tma(out):  # the fixed configuration: launched, not tuned
        _ensure_allocator()
        cache, grid, launch_args, kw = _tma_tile_launch(args[:2] + (out,) + args[3:], meta, N)
        cache.launch(grid, *launch_args, **kw)

    return plain, tma


def _pick(launch_plain, launch_tma, c) -> str:
    """Autotune the plain kernel and time both once per shape on a scratch copy of the output; keep the faster
    (a TMA kernel that fails to compile is not chosen)."""
    scratch = _scratch_like(c)
    return _fastest({"plain": functools.partial(launch_plain, scratch), "tma": functools.partial(launch_tma, scratch)},
                    optional=("tma",))
