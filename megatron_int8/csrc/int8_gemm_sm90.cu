// INT8 x INT8 -> INT32 GEMM for Hopper (sm_90a) with the dequantization fused into the epilogue.
//
// out[M, N] = (acc * sa) * sb, acc = a[M, K] @ b[N, K]^T in int32 (both operands K-major, row strides
// in bytes), sa a scalar or per-row vector, sb a scalar or per-column vector; bf16 output, or added into
// an fp32 buffer (Megatron's main_grad). The fp32 operations are the reference's
// (megatron_int8.reference.gemm), so results are bit-identical to it.
//
// Why CUDA and not Triton: Triton 3.6's software-pipelined INT8 kernel tops out at 60-64% of Hopper's INT8
// peak, and its warp specialization miscomputes at 4 warps (docs/history.md, 2026-11-21). This
// kernel is warp-specialized by hand: one producer thread issues TMA loads into a 3-stage shared-memory ring
// (mbarrier full/empty pairs), two consumer warpgroups each run wgmma m64n256k32 on half of a 128 x 256
// output tile. Persistent grid, group-M tile order. The epilogue writes the dequantized tile into a
// 128-byte-swizzled staging buffer (conflict-free) and leaves through asynchronous TMA stores (fp32:
// TMA reduce-adds into main_grad, which the producer prefetches into L2 late in the mainloop when K is short),
// so the next tile's mainloop does not wait for global memory; the producer meanwhile runs ahead into the next
// tile. Ragged M/N/K edges: TMA fills out-of-bounds reads with zeros and clips out-of-bounds writes.
//
// Grouped mode (MoE fprop/dgrad, `strip_experts` not null): a's rows hold every expert's tokens in strips of
// `strip_rows` (a multiple of kBlockM) that each belong to one expert, b is the experts' operands stacked
// as [E * N, K] and sb their scales [E * N]. A tile reads its expert from the strip table and offsets b's
// rows and scales by expert * N: one launch for all experts, with the plain kernel's tiles and epilogue.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kBlockM = 128, kBlockN = 256, kBlockK = 128, kStages = 3, kGroupM = 8;
constexpr int kConsumers = 2;
constexpr int kSlots = 4;  // output staging slots of 128 rows x 128 bytes (16 KB each)
// main_grad's tensor map moves boxes of 64 rows x 32 fp32 columns: a consumer's half of one staging slot
constexpr int kMainGradBoxRows = 64, kMainGradBoxCols = 128 / 4;
constexpr int kMainGradBoxes = (kBlockM / kMainGradBoxRows) * (kBlockN / kMainGradBoxCols);  // per tile
constexpr int kPrefetchMaxKBlocks = 48;  // up to K = 6144: beyond it the prefetch did not pay (see prefetch_main_grad)
constexpr int kThreads = 128 * (kConsumers + 1);
constexpr uint32_t kStageBytes = (kBlockM + kBlockN) * kBlockK;

struct Smem {
  int8_t a[kStages][kBlockM * kBlockK];  // each stage 1024-byte aligned: the 128-byte swizzle needs it
  int8_t b[kStages][kBlockN * kBlockK];
  uint8_t c[kSlots][kBlockM * 128];  // output staging: a slot holds 64 bf16 or 32 fp32 columns
  float sb[kConsumers][kBlockN];  // each consumer warpgroup's copy of the tile's column scales
  uint64_t full[kStages];   // TMA bytes landed
  uint64_t empty[kStages];  // both consumer warpgroups done reading
};
constexpr size_t kSmemBytes = sizeof(Smem) + 1024;  // + alignment slack for the dynamic buffer

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int inner, int outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(inner), "r"(outer)
      : "memory");
}

template <bool kAdd>
__device__ __forceinline__ void tma_store(const CUtensorMap* map, const void* src, int inner, int outer) {
  if constexpr (kAdd)
    asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.bulk_group [%0, {%2, %3}], [%1];"
                 ::"l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(src)), "r"(inner), "r"(outer) : "memory");
  else
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
                 ::"l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(src)), "r"(inner), "r"(outer) : "memory");
}
__device__ __forceinline__ void tma_prefetch_l2(const CUtensorMap* map, int inner, int outer) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];"
               ::"l"(reinterpret_cast<uint64_t>(map)), "r"(inner), "r"(outer) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ void proxy_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void warpgroup_sync(int id) { asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory"); }

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row core groups 1024 bytes apart.
__device__ __forceinline__ uint64_t smem_desc(const void* p) {
  return ((smem_addr(p) & 0x3FFFFull) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across the asynchronous wgmma boundary.
__device__ __forceinline__ void pin_accumulators(int32_t (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

__device__ __forceinline__ void wgmma_m64n256k32_s8(int32_t (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                    int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.s32.s8.s8 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
          "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
          "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
          "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]),
          "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]),
          "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]),
          "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]),
          "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63]),
          "+r"(d[64]), "+r"(d[65]), "+r"(d[66]), "+r"(d[67]), "+r"(d[68]), "+r"(d[69]), "+r"(d[70]), "+r"(d[71]),
          "+r"(d[72]), "+r"(d[73]), "+r"(d[74]), "+r"(d[75]), "+r"(d[76]), "+r"(d[77]), "+r"(d[78]), "+r"(d[79]),
          "+r"(d[80]), "+r"(d[81]), "+r"(d[82]), "+r"(d[83]), "+r"(d[84]), "+r"(d[85]), "+r"(d[86]), "+r"(d[87]),
          "+r"(d[88]), "+r"(d[89]), "+r"(d[90]), "+r"(d[91]), "+r"(d[92]), "+r"(d[93]), "+r"(d[94]), "+r"(d[95]),
          "+r"(d[96]), "+r"(d[97]), "+r"(d[98]), "+r"(d[99]), "+r"(d[100]), "+r"(d[101]), "+r"(d[102]), "+r"(d[103]),
          "+r"(d[104]), "+r"(d[105]), "+r"(d[106]), "+r"(d[107]), "+r"(d[108]), "+r"(d[109]), "+r"(d[110]), "+r"(d[111]),
          "+r"(d[112]), "+r"(d[113]), "+r"(d[114]), "+r"(d[115]), "+r"(d[116]), "+r"(d[117]), "+r"(d[118]), "+r"(d[119]),
          "+r"(d[120]), "+r"(d[121]), "+r"(d[122]), "+r"(d[123]), "+r"(d[124]), "+r"(d[125]), "+r"(d[126]), "+r"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

__device__ __forceinline__ void tile_coords(int tile, int tiles_m, int tiles_n, int& tm, int& tn) {
  const int per_group = kGroupM * tiles_n;
  const int first_m = tile / per_group * kGroupM;
  const int rows = min(tiles_m - first_m, kGroupM);
  const int in_group = tile % per_group;
  tm = first_m + in_group % rows;
  tn = in_group / rows;
}

// Two adjacent outputs into a staging slot row of 128 bytes, 128-byte swizzle: 16-byte chunk index XOR row % 8.
template <bool kAccumulate>
__device__ __forceinline__ void stage_pair(uint8_t* slot, int row, int byte, float v0, float v1) {
  uint8_t* p = slot + row * 128 + ((((byte >> 4) ^ row) & 7) << 4) + (byte & 15);
  if constexpr (kAccumulate)
    *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
  else
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
}

// fp32 accumulation, issued by the producer after k-block kb's loads: main_grad's tile into L2, spread over the
// last eighth of the tile's k-blocks. Without it the epilogue's reduce-adds read main_grad from HBM, every CTA at
// once (the tiles run in lockstep), and that burst stalls the next tiles' operand loads: a Mixtral expert's wgrad
// (K = 2048 tokens) took 1.9x the time of the same GEMM with a bf16 output, 1.5x with the prefetch. At K = 8192
// the burst is a small share of the tile and the prefetch changed nothing (docs/kernels.md, "CUDA GEMM").
// Prefetching the whole tile when it starts had slowed every wgrad (2026-11-22).
__device__ __forceinline__ void prefetch_main_grad(const CUtensorMap* map_c, int kb, int k_blocks, int tm, int tn,
                                                   int M, int N) {
  if (k_blocks > kPrefetchMaxKBlocks) return;
  const int first = k_blocks * 7 / 8, last = max(first + 1, k_blocks - 1);
  if (kb < first || kb >= last) return;
  const int span = last - first;
  constexpr int kPerRow = kBlockN / kMainGradBoxCols;  // boxes across the tile
  for (int j = (kb - first) * kMainGradBoxes / span; j < (kb - first + 1) * kMainGradBoxes / span; ++j) {
    const int row = tm * kBlockM + j / kPerRow * kMainGradBoxRows, col = tn * kBlockN + j % kPerRow * kMainGradBoxCols;
    if (row < M && col < N) tma_prefetch_l2(map_c, col, row);
  }
}

template <bool kAccumulate>
__global__ void __launch_bounds__(kThreads, 1)
    int8_gemm_sm90_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                          const __grid_constant__ CUtensorMap map_c, const float* __restrict__ scale_a, int sa_stride,
                          const float* __restrict__ scale_b, int sb_stride, int M, int N, int K,
                          const int* __restrict__ strip_experts, int strip_rows) {
  extern __shared__ uint8_t smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int warpgroup = threadIdx.x / 128;
  const int tiles_m = (M + kBlockM - 1) / kBlockM, tiles_n = (N + kBlockN - 1) / kBlockN;
  const int tiles = tiles_m * tiles_n;
  const int k_blocks = (K + kBlockK - 1) / kBlockK;
  // grouped: the first of b's rows (and scales) that belong to tile row tm's expert
  const auto expert_row0 = [&](int tm) {
    return strip_experts ? strip_experts[tm * kBlockM / strip_rows] * N : 0;
  };

  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], kConsumers * 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warpgroup == 0) {  // producer: one thread issues every TMA load
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      int stage = 0;
      uint32_t phase = 0;
      for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int tm, tn;
        tile_coords(tile, tiles_m, tiles_n, tm, tn);
        const int b_row0 = expert_row0(tm);
        for (int kb = 0; kb < k_blocks; ++kb) {
          mbar_wait(&s.empty[stage], phase ^ 1);
          mbar_expect_tx(&s.full[stage], kStageBytes);
          tma_load(s.a[stage], &map_a, &s.full[stage], kb * kBlockK, tm * kBlockM);
          tma_load(s.b[stage], &map_b, &s.full[stage], kb * kBlockK, b_row0 + tn * kBlockN);
          if constexpr (kAccumulate) prefetch_main_grad(&map_c, kb, k_blocks, tm, tn, M, N);
          if (++stage == kStages) stage = 0, phase ^= 1;
        }
      }
    }
  } else {  // consumers: warpgroup 1 takes rows 0-63 of the tile, warpgroup 2 rows 64-127
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int half = warpgroup - 1;
    const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
    int stage = 0;
    uint32_t phase = 0;
    int32_t d[128];
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      int tm, tn;
      tile_coords(tile, tiles_m, tiles_n, tm, tn);
      // The epilogue's scales, loaded now so the mainloop hides their latency (loaded inside the epilogue,
      // one per column pair, they stalled it on L1TEX); the column scales reach the epilogue's threads
      // through shared memory.
      const int row0 = tm * kBlockM + half * 64, col0 = tn * kBlockN;
      const int r0 = warp * 16 + lane / 4, r1 = r0 + 8;
      const float sa0 = row0 + r0 < M ? scale_a[static_cast<long>(row0 + r0) * sa_stride] : 0.f;
      const float sa1 = row0 + r1 < M ? scale_a[static_cast<long>(row0 + r1) * sa_stride] : 0.f;
      const long sb0_row = expert_row0(tm);
      float sb_own[kBlockN / 128];
#pragma unroll
      for (int i = 0; i < kBlockN / 128; ++i) {
        const int c = col0 + i * 128 + t;
        sb_own[i] = c < N ? scale_b[(sb0_row + c) * sb_stride] : 0.f;
      }
      int prev = -1;
      for (int kb = 0; kb < k_blocks; ++kb) {
        mbar_wait(&s.full[stage], phase);
        const int8_t* a = s.a[stage] + half * 64 * kBlockK;
        const int8_t* b = s.b[stage];
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < kBlockK / 32; ++k)
          wgmma_m64n256k32_s8(d, smem_desc(a + k * 32), smem_desc(b + k * 32), kb > 0 || k > 0);
        wgmma_commit();
        wgmma_wait<1>();  // the previous k-block's wgmmas are done: hand its stage back
        if (prev >= 0) mbar_arrive(&s.empty[prev]);
        prev = stage;
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
      wgmma_wait<0>();
      pin_accumulators(d);
      mbar_arrive(&s.empty[prev]);
#pragma unroll
      for (int i = 0; i < kBlockN / 128; ++i) s.sb[half][i * 128 + t] = sb_own[i];  // read after the sync below

      // Accumulator fragment: register 4j + 2i + c holds row 16 * warp + lane / 4 + 8i, column 8j + 2(lane % 4) + c.
      // The 256 columns leave in rounds of kSlots slots (bf16: 64 columns a slot, fp32: 32).
      constexpr int kBytes = kAccumulate ? 4 : 2, kSlotCols = 128 / kBytes, kRounds = kBlockN / kSlotCols / kSlots;
#pragma unroll
      for (int round = 0; round < kRounds; ++round) {
        if (t == 0) bulk_wait_read();  // the staging slots' previous stores have read them
        warpgroup_sync(1 + half);
#pragma unroll
        for (int jj = 0; jj < kBlockN / 8 / kRounds; ++jj) {
          const int j = round * (kBlockN / 8 / kRounds) + jj;
          const int c = j * 8 + 2 * (lane % 4);
          const float2 sb = *reinterpret_cast<const float2*>(&s.sb[half][c]);
          const float sb0 = sb.x, sb1 = sb.y;
          uint8_t* slot = s.c[(c / kSlotCols) % kSlots] + half * 64 * 128;
          const int byte = (c % kSlotCols) * kBytes;
          stage_pair<kAccumulate>(slot, r0, byte, static_cast<float>(d[4 * j]) * sa0 * sb0,
                                  static_cast<float>(d[4 * j + 1]) * sa0 * sb1);
          stage_pair<kAccumulate>(slot, r1, byte, static_cast<float>(d[4 * j + 2]) * sa1 * sb0,
                                  static_cast<float>(d[4 * j + 3]) * sa1 * sb1);
        }
        proxy_fence();  // make the generic-proxy writes visible to the TMA engine
        warpgroup_sync(1 + half);
        if (t == 0) {
#pragma unroll
          for (int slot = 0; slot < kSlots; ++slot) {
            const int col = col0 + (round * kSlots + slot) * kSlotCols;
            if (col < N && row0 < M) tma_store<kAccumulate>(&map_c, s.c[slot] + half * 64 * 128, col, row0);
          }
          bulk_commit();
        }
      }
    }
    if (t == 0) bulk_wait_all();
  }
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encode_tiled() {  // the driver's entry point, found through the runtime: no -lcuda needed
  static EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      return static_cast<EncodeTiled>(nullptr);
    return reinterpret_cast<EncodeTiled>(p);
  }();
  return fn;
}

// A 2-D row-major tensor map with a 128-byte swizzle; ld in elements, boxes of box_cols x box_rows.
bool make_map(CUtensorMap* map, CUtensorMapDataType dtype, int elem_bytes, const void* ptr, int rows, int cols,
              long ld, int box_cols, int box_rows) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * elem_bytes};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t unit[2] = {1, 1};
  return encode_tiled()(map, dtype, 2, const_cast<void*>(ptr), dims, strides, box, unit,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

constexpr int kMaxDevices = 64;

template <bool kAccumulate>
int launch(const CUtensorMap& map_a, const CUtensorMap& map_b, const CUtensorMap& map_c, const float* scale_a,
           int sa_stride, const float* scale_b, int sb_stride, int M, int N, int K, const int* strip_experts,
           int strip_rows, int num_sms, int device, cudaStream_t stream) {
  // The shared-memory limit is a per-device attribute: set it once per device (a repeated set is harmless).
  static bool configured[kMaxDevices] = {};
  if (!configured[device]) {
    const cudaError_t set = cudaFuncSetAttribute(int8_gemm_sm90_kernel<kAccumulate>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(kSmemBytes));
    if (set != cudaSuccess) return 100 + set;
    configured[device] = true;
  }
  const int tiles = ((M + kBlockM - 1) / kBlockM) * ((N + kBlockN - 1) / kBlockN);
  const int grid = tiles < num_sms ? tiles : num_sms;
  int8_gemm_sm90_kernel<kAccumulate><<<grid, kThreads, kSmemBytes, stream>>>(
      map_a, map_b, map_c, scale_a, sa_stride, scale_b, sb_stride, M, N, K, strip_experts, strip_rows);
  const cudaError_t launched = cudaGetLastError();
  return launched == cudaSuccess ? 0 : 100 + launched;
}

// The three tensor maps, then the launch, on the current device.
int launch_on_current(const void* a, long lda, const void* b, long ldb, int b_rows, void* out, long ldc,
                      const float* scale_a, int sa_stride, const float* scale_b, int sb_stride, int M, int N, int K,
                      const int* strip_experts, int strip_rows, int accumulate, int num_sms, int device,
                      cudaStream_t s) {
  CUtensorMap map_a, map_b, map_c;
  const bool ok =
      make_map(&map_a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, a, M, K, lda, kBlockK, kBlockM) &&
      make_map(&map_b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, b, b_rows, K, ldb, kBlockK, kBlockN) &&
      (accumulate ? make_map(&map_c, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, out, M, N, ldc, kMainGradBoxCols,
                             kMainGradBoxRows)
                  : make_map(&map_c, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, out, M, N, ldc, 64, 64));
  if (!ok) return 3;
  return accumulate
             ? launch<true>(map_a, map_b, map_c, scale_a, sa_stride, scale_b, sb_stride, M, N, K, strip_experts,
                            strip_rows, num_sms, device, s)
             : launch<false>(map_a, map_b, map_c, scale_a, sa_stride, scale_b, sb_stride, M, N, K, strip_experts,
                             strip_rows, num_sms, device, s);
}

}  // namespace

// Returns 0, or: 1 unsupported shape/stride/alignment, 2 no cuTensorMapEncodeTiled, 3 tensor map rejected,
// 100 + cudaError_t for a launch failure. The Python side (megatron_int8/kernels/sm90_gemm.py) checks
// the same conditions first and raises with a message; these codes are the last line.
// `device`: the GPU that holds the tensors and the stream; the launch switches to it if it is not current.
// Plain: b_rows == N, strip_experts null. Grouped: b_rows = E * N, strip_experts[M / strip_rows] on the device.
extern "C" int megatron_int8_gemm_sm90(const void* a, long lda, const void* b, long ldb, int b_rows, void* out,
                                       long ldc, const float* scale_a, int sa_stride, const float* scale_b,
                                       int sb_stride, int M, int N, int K, const int* strip_experts, int strip_rows,
                                       int accumulate, int num_sms, int device, void* stream) {
  const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const int out_bytes = accumulate ? 4 : 2;
  if (M <= 0 || N <= 0 || K <= 0 || K % 16 || lda % 16 || ldb % 16 || (ldc * out_bytes) % 16 || lda < K ||
      ldb < K || ldc < N || !aligned16(a) || !aligned16(b) || !aligned16(out) || num_sms <= 0 || device < 0 ||
      device >= kMaxDevices)
    return 1;
  if (strip_experts ? strip_rows <= 0 || strip_rows % kBlockM || M % strip_rows || b_rows < N || b_rows % N
                    : b_rows != N)
    return 1;
  if (!encode_tiled()) return 2;
  int current = 0;
  cudaError_t err = cudaGetDevice(&current);
  if (err == cudaSuccess && current != device) err = cudaSetDevice(device);
  if (err != cudaSuccess) return 100 + err;
  const int code = launch_on_current(a, lda, b, ldb, b_rows, out, ldc, scale_a, sa_stride, scale_b, sb_stride, M, N,
                                     K, strip_experts, strip_rows, accumulate, num_sms, device,
                                     static_cast<cudaStream_t>(stream));
  if (current != device) cudaSetDevice(current);
  return code;
}

// Loads the kernel on the current device: fails (non-zero cudaError_t) where the driver is older than
// this build's runtime or cannot run sm_90a code, so the Python side can fall back before any GEMM.
extern "C" int megatron_int8_gemm_sm90_probe() {
  cudaFuncAttributes attributes;
  return static_cast<int>(cudaFuncGetAttributes(&attributes, int8_gemm_sm90_kernel<false>));
}

extern "C" int megatron_int8_gemm_sm90_smem_bytes() { return static_cast<int>(kSmemBytes); }
