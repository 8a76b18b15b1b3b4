// ragged_matmul on Hopper (sm_90a only): the grouped GEMM on float experts,
// y[rows of group e] = x[those rows] @ w[e].T, w [E, N, K] in x's 16-bit dtype, float32
// accumulation (jaxquant/ops/qmm.py gives the op; jaxquant/ffi/mma.py lowers it here).
//
// The work is qmm_wgmma_kernel's for ragged_qmm: items of 128 weight rows of one expert
// x BN rows of its group (ragged_row_block's blocks, in the same order), each item's
// output tile through shared memory to 16-byte rows of y. With nothing to decode, a
// producer warp has the TMA copy each chunk's x box (BN rows x 64 k) and weight box
// (128 rows x 64 k), both 128-byte swizzled, and the two MMA warpgroups take both
// operands from shared memory. A weight box that runs past the expert's N rows reads
// the next expert's (or zeros past the last): those columns are never stored. K past
// its end reads as zeros in both boxes.
//
// Persistent: one block per SM walks the items (item-major over the 128-row columns of
// N, so that the blocks running together share x's rows), and the copies run ahead
// across items. A grid of every possible item (qmm_wgmma_kernel's: ceil(T / BN) + E
// rows of it) is mostly blocks with nothing to do where the experts of every layer
// are one stack with each layer's groups set (stacked parameters under
// jaxquant/models/moe.py's experts_by_layer): E = 768 for gpt-oss-20b's 24 layers, 32 of
// them used. Each block walks the groups 32 at a time, as far as its next item needs
// (RaggedWalk), then the rows past them.
#pragma once

#include "qmm_wgmma.h"

#if defined(JQ_PLATFORM_CUDA)

namespace jq {
namespace gpu {
namespace mma {

template <int BN>
struct RaggedMatmulShared {
  static constexpr int x_bytes = BN * 128;
  static constexpr int w_bytes = kWgRows * 128;          // 128 rows x 64 k x 2 bytes
  static constexpr int stage_bytes = x_bytes + w_bytes;  // a multiple of 1024
  static constexpr int stages = 5;  // with the output tile, 195 KB
  static constexpr int out_off = stages * stage_bytes;   // the output tile, apart: the
  static constexpr int out_bytes = BN * kWgOutStride;    // copies run on meanwhile
  static constexpr int bytes = out_off + out_bytes + 1024;
};

struct RaggedMatmulParams {
  GemmProblem pr;  // q.data: the experts' weights w [E, N, K]
  CUtensorMap x_map, w_map;
};
constexpr int kRaggedMatmulThreads = (kWgWarps + 1) * 32;

template <int XDT, int BN>
__global__ void __launch_bounds__(kRaggedMatmulThreads, 1)
    ragged_matmul_wgmma_kernel(const __grid_constant__ RaggedMatmulParams prm) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Lay = RaggedMatmulShared<BN>;
  constexpr int S = Lay::stages, R = BN / 2;
  const GemmProblem& pr = prm.pr;
  const QmvProblem& p = pr.q;
  extern __shared__ __align__(16) uint8_t smem_dyn[];
  __shared__ __align__(8) uint64_t full[S];   // the stage has landed
  __shared__ __align__(8) uint64_t empty[S];  // the MMA warps are done with it
  const uint32_t dyn_s = (uint32_t)__cvta_generic_to_shared(smem_dyn);
  uint8_t* smem = smem_dyn + ((1024u - (dyn_s & 1023u)) & 1023u);
  const uint32_t smem_s = (uint32_t)__cvta_generic_to_shared(smem);
  const int lane = threadIdx.x & 31;
  const int warp = __shfl_sync(0xffffffffu, threadIdx.x >> 5, 0);  // warp-uniform
  const uint32_t full_s = (uint32_t)__cvta_generic_to_shared(full);
  const uint32_t empty_s = (uint32_t)__cvta_generic_to_shared(empty);
  if (threadIdx.x == 32) {
    for (int i = 0; i < S; ++i) {
      mbar_init(full_s + 8 * i, 1);
      mbar_init(empty_s + 8 * i, kWgWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // the block's work: w = blockIdx.x, + gridDim.x, ...: item w / cols, column w % cols
  const int64_t cols = (p.N + kWgRows - 1) / kWgRows;
  const int chunks = (int)pr.chunks;
  RaggedWalk walk;
  RowBlock blk;
  if (warp == kWgWarps) {  // the producer: two TMA boxes a chunk, from one thread
    uint32_t gi = 0;       // the block's chunks so far, over its items
    for (int64_t w = blockIdx.x; walk.find(pr, w / cols, lane, &blk); w += gridDim.x) {
      const int wrow = (int)(blk.e * p.N + (w % cols) * kWgRows);
      if (lane == 0) {
        for (int c = 0; c < chunks; ++c, ++gi) {
          const uint32_t s = gi % S, st = smem_s + s * Lay::stage_bytes, bar = full_s + 8 * s;
          if (gi >= S) mbar_wait(empty_s + 8 * s, ((gi / S) + 1) & 1);
          mbar_expect_tx(bar, Lay::stage_bytes);
          tma_load_2d(st, &prm.x_map, c * kChunkK, (int)blk.x0, bar);
          tma_load_2d(st + Lay::x_bytes, &prm.w_map, c * kChunkK, wrow, bar);
        }
      }
      gi = __shfl_sync(0xffffffffu, gi, 0);
    }
  } else {
    // warpgroup warp / 4 multiplies weight rows 64 (warp / 4) .. + 63 of the box
    const uint32_t a_off = (uint32_t)Lay::x_bytes + (uint32_t)(warp >> 2) * (64 * 128);
    const auto mma_warps_sync = [] {
      asm volatile("bar.sync 1, %0;\n" ::"n"(kWgWarps * 32) : "memory");
    };
    uint32_t gi = 0;
    for (int64_t w = blockIdx.x; walk.find(pr, w / cols, lane, &blk); w += gridDim.x) {
      float acc[R];
#pragma unroll
      for (int i = 0; i < R; ++i) acc[i] = 0.0f;
      for (int c = 0; c < chunks; ++c, ++gi) {
        const uint32_t s = gi % S, st = smem_s + s * Lay::stage_bytes;
        mbar_wait(full_s + 8 * s, (gi / S) & 1);
        wg_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k)
          wgmma_ss<XDT>(acc, wg_desc(st + a_off + 32 * k), wg_desc(st + 32 * k));
        wg_commit();
        wg_wait<1>();
        // the chunk before's wgmmas are done: its stage may be refilled
        __syncwarp();
        if (c > 0 && lane == 0) mbar_arrive(empty_s + 8 * ((gi - 1) % S));
      }
      wg_wait<0>();
      __syncwarp();
      if (chunks > 0 && lane == 0) mbar_arrive(empty_s + 8 * ((gi - 1) % S));
      mma_warps_sync();  // every MMA warp is done storing the last item's tile
      store_block_y<XDT>(acc, smem + Lay::out_off, warp, lane, blk, (w % cols) * kWgRows, p,
                         kWgWarps * 32, mma_warps_sync);
    }
    // rows past the groups: zero, shared out over the blocks
    const int64_t tail = walk.rows_in_groups(pr, lane);
    const int64_t zeros = (p.M - tail) * p.N;
    uint16_t* y = static_cast<uint16_t*>(p.y);
    for (int64_t i = (int64_t)blockIdx.x * (kWgWarps * 32) + threadIdx.x; i < zeros;
         i += (int64_t)gridDim.x * (kWgWarps * 32))
      y[tail * p.N + i] = 0;
  }
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

// w [E, N, K] as a TMA tensor map over E * N rows: boxes of 64 k x 128 rows, 128-byte
// swizzle, rows and k past the end read as zeros (qmm_wgmma.hip).
bool float_weight_map(const GemmProblem& pr, bool f16, CUtensorMap* map);

template <int XDT, int BN>
hipError_t launch_ragged_matmul_bn(const GemmProblem& pr, hipStream_t stream) {
  using Lay = RaggedMatmulShared<BN>;
  auto kernel = ragged_matmul_wgmma_kernel<XDT, BN>;
  static std::atomic<uint64_t> raised{0};
  if (!raise_shared_limit(kernel, Lay::bytes, raised)) return hipErrorInvalidValue;
  RaggedMatmulParams prm;
  prm.pr = pr;
  if (!x_tensor_map(pr, BN, XDT == kF16, &prm.x_map) ||
      !float_weight_map(pr, XDT == kF16, &prm.w_map))
    return hipErrorInvalidValue;
  // one block an SM (the stages take most of its shared memory), no more than the items
  // could use
  const int64_t cols = (pr.q.N + kWgRows - 1) / kWgRows;
  const int64_t most = cols * pr.row_blocks, sms = sm_count();
  kernel<<<(unsigned)(most < sms ? most : sms), kRaggedMatmulThreads, Lay::bytes, stream>>>(prm);
  return hipGetLastError();
}

}  // namespace mma
}  // namespace gpu
}  // namespace jq
#endif  // JQ_PLATFORM_CUDA
