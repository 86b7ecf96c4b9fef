"""A warp-specialized INT8 GEMM for Hopper written in Gluon (`triton.experimental.gluon`): Triton's own
Hopper path, with no nvcc.

Why: Triton 3.6 issues an int8 wgmma synchronously (its pipeliner lets a dot run asynchronously only with
an fp32 accumulator), so every k-block of the TMA kernel in int8_gemm.py waits for its wgmmas before the
next ones issue. Gluon states the schedule explicitly:
- one producer warp issues the TMA loads of a STAGES-deep ring (a `ready` and an `empty` mbarrier per slot);
- the consumer warpgroups (the default partition, 8 warps: 64 rows of the 128 x 256 tile each) wait on
  `ready`, issue the k-block's wgmmas asynchronously, wait until only that group is in flight, and hand the
  previous k-block's slot back through `empty`; so one wgmma group runs while the next is issued;
- the tile loop is persistent (one program per SM, group-M order, as the TMA kernel's).
Its epilogue is not overlapped with the next tile's wgmmas: it pays off where the k loop is long
(`MIN_K`), and the dispatch (int8_gemm.TMA_TILE) keeps the Triton TMA kernel below that.

The block recipe's GEMMs (1 x B scales along K, B x B weight tiles; B = 128, 256 or 512) take a second kernel of
this module, `_int8_gemm_ws_block_kernel` (`supports_block`): the same producer, and consumers that promote each
block's int32 product into an fp32 tile with that block's scales, as the reference does.

Contract (`supports`): sm_90 (wgmma), tensor or row scales, no bias, no grouped GEMM, a bf16 or fp16
output (an fp32 tile beside the accumulator spills registers: wgrads into main_grad stay on the TMA kernel's
reduce-add), fewer than 2**31 output elements, and what the TMA kernel needs of its operands
(int8_gemm._tma_eligible: K <= MAX_EXACT_K, aligned). Epilogue in the reference's order, (acc * sa) * sb
then the cast, so results are bit-identical to the reference backend.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from .launch import capability

MIN_TRITON = (3, 6)  # Gluon's API as this kernel uses it (warp_specialize, device-side descriptors): 3.6 to 3.9 tested


def gluon_problem(version: str) -> Optional[str]:
    """Why this Triton cannot run the kernel (None where it can): Gluon's API changed before 3.6."""
    try:
        found = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        return f"unrecognised triton version {version!r}"
    if found < MIN_TRITON:
        return f"needs triton >= {'.'.join(map(str, MIN_TRITON))} for Gluon's API, found {version}"
    return None


_MISSING = gluon_problem(triton.__version__)
if _MISSING is None:
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                      warpgroup_mma, warpgroup_mma_wait)
    except ImportError as exc:  # a Triton without Gluon: the dispatch keeps the Triton TMA kernel
        _MISSING = f"triton.experimental.gluon is not importable ({exc})"

MIN_K = 4096  # the dispatch's threshold: longer k loops amortize the unoverlapped epilogue (docs/kernels.md)
BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, NUM_WARPS = 128, 256, 128, 4, 8, 8
_PRODUCER_WARPS, _PRODUCER_REGS = 1, 40


def unavailable_reason():
    """Why the kernel cannot be used with this Triton (None where it can)."""
    return _MISSING


if _MISSING is None:
    # Triton 3.6 names the TMA copy async_copy_global_to_shared; later versions call it async_load and make
    # the old name raise
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    @gluon.jit
    def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
        """Group-M order: GROUP_M row-tiles walk each column of tiles together (int8_gemm's order)."""
        group = GROUP_M * num_pid_n
        first_m = (tile_id // group) * GROUP_M
        size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
        return first_m + (tile_id % group) % size_m, (tile_id % group) // size_m

    @gluon.jit
    def _producer(a_ptr, b_ptr, stride_am, stride_bn, a_bufs, b_bufs, ready, empty, M, N, K,  #
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                  GROUP_M: gl.constexpr):
        # device-side TMA descriptors (int8_gemm's scratch allocator), made here so that the consumers' registers
        # hold nothing of them
        a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K], a_bufs.layout)
        b_desc = tma.make_tensor_descriptor(b_ptr, [N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K], b_bufs.layout)
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        k_tiles = gl.cdiv(K, BLOCK_K)
        step = 0
        for tile_id in range(pid, num_pid_m * num_pid_n, nprog):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            for kk in range(k_tiles):
                s = step % STAGES
                # a fresh mbarrier counts as having completed the phase before its first, so the first pass
                # over the ring (parity 1) does not wait
                mbarrier.wait(empty.index(s), ((step // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                _tma_load(a_desc, [pid_m * BLOCK_M, kk * BLOCK_K], bar, a_bufs.index(s))
                _tma_load(b_desc, [pid_n * BLOCK_N, kk * BLOCK_K], bar, b_bufs.index(s))
                step += 1

    @gluon.jit
    def _consumer(a_bufs, b_bufs, ready, empty, c_ptr, sa_ptr, sb_ptr, M, N, K,  #
                  SCALE_MODE: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                  num_warps: gl.constexpr):
        # int8 wgmma: k = 32 per instruction; triton lowers n <= 224 for 8-bit types, so 256 columns are two
        # n = 128 instructions. With 8 warps each warpgroup owns 64 rows.
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, 128, 32])
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        k_tiles = gl.cdiv(K, BLOCK_K)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, acc_layout)
        step = 0
        for tile_id in range(pid, num_pid_m * num_pid_n, nprog):
            for kk in range(k_tiles):
                s = step % STAGES
                mbarrier.wait(ready.index(s), (step // STAGES) & 1)
                a_s = a_bufs.index(s)
                b_s = b_bufs.index(s)
                acc = warpgroup_mma(a_s, b_s.permute((1, 0)), acc, use_acc=kk > 0, is_async=True)
                acc, a_s, b_s = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_s, b_s))
                # the previous step's wgmmas are done: its slot goes back to the producer (at kk == 0 that was
                # the previous tile's last step, released after the tile's final wait)
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=kk > 0)
                step += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
            offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            out = acc.to(gl.float32)
            if SCALE_MODE == 0:
                out = (out * gl.load(sa_ptr)) * gl.load(sb_ptr)
            else:
                sa = gl.load(sa_ptr + offs_m, mask=offs_m < M, other=0.0)
                sb = gl.load(sb_ptr + offs_n, mask=offs_n < N, other=0.0)
                out = (out * gl.expand_dims(sa, 1)) * gl.expand_dims(sb, 0)
            rows = gl.expand_dims(offs_m, 1)
            cols = gl.expand_dims(offs_n, 0)
            # int32 offsets (supports() requires M * N < 2**31): int64 ones spill registers
            gl.store(c_ptr + (rows * N + cols), out.to(c_ptr.dtype.element_ty), mask=(rows < M) & (cols < N))

    @gluon.jit
    def _int8_gemm_ws_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, stride_am, stride_bn,
                             strip_ptr, NB,  #
                             SCALE_MODE: gl.constexpr, BLOCK_M: gl.constexpr,
                             BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                             GROUP_M: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                             num_warps: gl.constexpr):
        """c[M, N] = (a[M, K] @ b[N, K]^T) * scales, row-major c. The runtime arguments are the TMA kernel's
        (int8_gemm._tma_args), so a plan binds either; bias_ptr, strip_ptr and NB are unused (no bias, no
        grouped GEMM)."""
        layout: gl.constexpr = gl.NVMMASharedLayout(128, 8, 2)  # 128-byte swizzle of int8 rows, as wgmma reads
        a_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_M, BLOCK_K], layout)
        b_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, BLOCK_K], layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)  # the consumers arrive once, after a barrier among them
        fence_async_shared()
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, c_ptr, sa_ptr, sb_ptr, M, N, K, SCALE_MODE, BLOCK_M, BLOCK_N,
                         BLOCK_K, STAGES, GROUP_M, num_warps)),
            (_producer, (a_ptr, b_ptr, stride_am, stride_bn, a_bufs, b_bufs, ready, empty, M, N, K, BLOCK_M, BLOCK_N,
                         BLOCK_K, STAGES, GROUP_M)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])

    @gluon.jit
    def _block_consumer(a_bufs, b_bufs, ready, empty, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, stride_cm,
                        stride_sam, stride_sak, stride_sbn, stride_sbk,  #
                        SUB_K: gl.constexpr, B_TILES: gl.constexpr, HAS_BIAS: gl.constexpr, ACCUMULATE: gl.constexpr,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                        GROUP_M: gl.constexpr, num_warps: gl.constexpr):
        # each scale block of K (SUB_K k-steps of BLOCK_K) has scales of its own, so its int32 product is promoted
        # into the fp32 tile on its own, after its wgmmas and before the next block's: the consumers synchronize at
        # each slot release, and a product in flight beside the one being promoted and the fp32 tile (three
        # 64-register tiles per thread) is more than the sm_90a build keeps (its ptxas schedules the promotion
        # before the next issue). That promotion is what limits the kernel (docs/benchmarks.md, "Block-scale GEMMs
        # on Hopper").
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        rows: gl.constexpr = gl.SliceLayout(1, acc_layout)
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        n_kb = gl.cdiv(K, BLOCK_K * SUB_K)  # supports_block: SUB_K > 1 only where K is a multiple of the block
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, acc_layout)
        step = 0
        for tile_id in range(pid, num_pid_m * num_pid_n, nprog):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=rows)
            offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            # rows and columns past the edges read the last one's scales (their outputs are never stored), so the
            # k loop's scale loads need no masks
            sa_rows = gl.minimum(offs_m, M - 1) * stride_sam
            if B_TILES:  # a weight tile's scale per block of K (the BLOCK_N rows of b are in one tile)
                sb_tile = (pid_n // SUB_K) * stride_sbn
            else:
                sb_rows = gl.minimum(offs_n, N - 1) * stride_sbn
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
            for kb in range(n_kb):
                part = zero
                for j in gl.static_range(SUB_K):
                    s = step % STAGES
                    mbarrier.wait(ready.index(s), (step // STAGES) & 1)
                    a_s = a_bufs.index(s)
                    b_s = b_bufs.index(s)
                    part = warpgroup_mma(a_s, b_s.permute((1, 0)), part, use_acc=j > 0, is_async=True)
                    if j == 0:  # the block's scales load while its first wgmmas run
                        sa = gl.load(sa_ptr + (sa_rows + kb * stride_sak))
                        if B_TILES:
                            sab = gl.expand_dims(sa * gl.load(sb_ptr + (sb_tile + kb * stride_sbk)), 1)
                        else:
                            sb = gl.load(sb_ptr + (sb_rows + kb * stride_sbk))
                    if j < SUB_K - 1:  # within a block one wgmma group stays in flight, as in the row kernel
                        part, a_s, b_s = warpgroup_mma_wait(num_outstanding=1, deps=(part, a_s, b_s))
                    else:
                        part, a_s, b_s = warpgroup_mma_wait(num_outstanding=0, deps=(part, a_s, b_s))
                    if j > 0:  # the previous k-step's wgmmas are done
                        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
                    step += 1
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
                if B_TILES and SUB_K <= 2:
                    # int32 -> fp32 exactly through the float bits (|part| <= 127 * 127 * 256 < 2**22): an
                    # integer and an fp32 add in place of the conversion instruction; with the weight tile's scale
                    # folded into the row scales (one fused multiply-add per element) fprop and dgrad ran
                    # 1.18-1.30x faster, while with wgrad's scale per column the two adds ran 6-9% slower than the
                    # instruction (docs/benchmarks.md, "Block-scale GEMMs on Hopper")
                    f = (part + 0x4B400000).to(gl.float32, bitcast=True) - 12582912.0
                else:
                    f = part.to(gl.float32)
                if B_TILES:
                    acc += f * sab
                else:
                    acc += (f * gl.expand_dims(sa, 1)) * gl.expand_dims(sb, 0)  # the reference's order
            if HAS_BIAS:
                acc = acc + gl.expand_dims(gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32), 0)
            r = gl.expand_dims(offs_m, 1)
            c = gl.expand_dims(offs_n, 0)
            ptrs = c_ptr + (r * stride_cm + c)  # int32 offsets (supports_block: M * N < 2**31)
            mask = (r < M) & (c < N)
            if ACCUMULATE:
                acc = gl.load(ptrs, mask=mask, other=0.0) + acc
            gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _int8_gemm_ws_block_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K,
                                   stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                                   stride_sam, stride_sak, stride_sbn, stride_sbk, K_CHUNK, SB_ROWS_PER_SCALE,
                                   strip_ptr,  #
                                   SUB_K: gl.constexpr, B_TILES: gl.constexpr, HAS_BIAS: gl.constexpr,
                                   ACCUMULATE: gl.constexpr, BLOCK_M: gl.constexpr,
                                   BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                                   GROUP_M: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                   num_warps: gl.constexpr):
        """c[M, N] = sum over blocks kb of K of (a[:, kb] @ b[:, kb]^T) * sa[m, kb] * sb[n, kb] [+ bias], written or
        added into c (ACCUMULATE): the block recipe's GEMM, 1 x B scales along K (B = SUB_K * BLOCK_K); B_TILES: b is
        a weight in B x B tiles, sb[n // B, kb]. The runtime arguments are the plain kernel's
        (int8_gemm._plain_args), so a plan binds either; its unit strides (stride_ak, stride_bk, stride_cn),
        K_CHUNK, SB_ROWS_PER_SCALE (B_TILES says it) and strip_ptr are unused."""
        layout: gl.constexpr = gl.NVMMASharedLayout(128, 8, 2)
        a_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_M, BLOCK_K], layout)
        b_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, BLOCK_K], layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_block_consumer, (a_bufs, b_bufs, ready, empty, c_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, stride_cm,
                               stride_sam, stride_sak, stride_sbn, stride_sbk, SUB_K, B_TILES, HAS_BIAS, ACCUMULATE,
                               BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, num_warps)),
            (_producer, (a_ptr, b_ptr, stride_am, stride_bn, a_bufs, b_bufs, ready, empty, M, N, K, BLOCK_M, BLOCK_N,
                         BLOCK_K, STAGES, GROUP_M)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])

    KERNEL = _int8_gemm_ws_kernel
    BLOCK_KERNEL = _int8_gemm_ws_block_kernel
else:
    KERNEL = BLOCK_KERNEL = None


def supports(c: torch.Tensor, has_bias: bool, accumulate: bool, grouped: bool) -> bool:
    """Whether a GEMM that the TMA kernel takes (int8_gemm._tma_eligible) can run here instead, into c: Gluon
    present, a Hopper GPU (wgmma: sm_90 only), no bias, not accumulating, not grouped, a 16-bit c of fewer than
    2**31 elements."""
    return (KERNEL is not None and not (has_bias or accumulate or grouped) and c.element_size() == 2
            and c.numel() < 2**31 and capability(c.device)[0] == 9)


def launch_options(scale_mode: int) -> dict:
    """The kernel's constexprs and launch options."""
    return dict(SCALE_MODE=scale_mode, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                STAGES=STAGES, GROUP_M=GROUP_M, PRODUCER_WARPS=_PRODUCER_WARPS, PRODUCER_REGS=_PRODUCER_REGS,
                num_warps=NUM_WARPS)


BLOCK_SCALE_TILE = (128, 128, 128, 4, 8)  # the block-scale kernel's BLOCK_M, BLOCK_N, BLOCK_K, STAGES, warps
BLOCK_SIZES = (128, 256, 512)  # the recipe's block sizes it takes: SUB_K = block_size // BLOCK_K k-steps per scale
# the kernel indexes a weight tile's scale by pid_n // SUB_K and converts through the float bits for SUB_K <= 2:
# both assume these tile sides
assert BLOCK_SCALE_TILE[1] == BLOCK_SCALE_TILE[2] == 128, "the block kernel assumes BLOCK_N == BLOCK_K == 128"


def supports_block(c: torch.Tensor, block_size: int, sb_rows: int, K: int) -> bool:
    """Whether the block-scale kernel can take a block-recipe GEMM (operands as the TMA kernel needs them, checked
    by the caller) into c: Gluon present, sm_90, a block size of BLOCK_SIZES that divides K (128: any K), b's scales
    per row or per block x block tile, c of fewer than 2**31 elements (int32 offsets)."""
    return (BLOCK_KERNEL is not None and block_size in BLOCK_SIZES and (block_size == 128 or K % block_size == 0)
            and sb_rows in (1, block_size) and c.numel() < 2**31 and capability(c.device)[0] == 9)


def block_launch_options(block_size: int, b_tiles: bool, has_bias: bool, accumulate: bool) -> dict:
    """The block-scale kernel's constexprs and launch options (b_tiles: b is a weight in block x block tiles)."""
    bm, bn, bk, stages, warps = BLOCK_SCALE_TILE
    return dict(SUB_K=block_size // bk, B_TILES=b_tiles, HAS_BIAS=has_bias, ACCUMULATE=accumulate, BLOCK_M=bm,
                BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, GROUP_M=GROUP_M, PRODUCER_WARPS=_PRODUCER_WARPS,
                PRODUCER_REGS=_PRODUCER_REGS, num_warps=warps)
