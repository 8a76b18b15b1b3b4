// The prefill GEMM on Hopper (sm_90a only): qmm with more than 16 rows of x per
// weight matrix, and ragged_qmm, on the `cuda_mma` layout, with wgmma.
//
// The weight is wgmma's A operand, from registers: in a warpgroup, warp r holds
// rows 16r .. 16r + 15 of the 64-row A tile in the fragment layout of
// mma.sync.m16n8k16's A, which is the layout's unit of a lane (docs/decode.md).
// So warp r decodes and scales its own 16-row tile exactly as the mma.sync GEMM
// does (qmm_gemm.h: scaled_a) and the warpgroup multiplies 64 weight rows by BN
// rows of x per k-step, x (B) read by the tensor cores from shared memory.
//
// A block is two warpgroups, 128 weight rows (8 tiles) x BN (64, 128 or 256) rows of x.
// Per chunk of 64 k, several stages deep: one thread has the tensor-memory
// accelerator (TMA) copy the chunk of x into wgmma's 128-byte-swizzled K-major layout
// (rows past x's end read as zeros; an mbarrier per stage counts its bytes in), each
// lane copies its weight unit to a slot of its own and a few lanes the warp's scales,
// with cp.async; or (WS) a producer (a ninth warp, or at 256 rows a third warpgroup)
// has the TMA copy the block's weights, scales and biases too and the MMA warps copy
// nothing.
// Nothing written through the generic proxy is read by wgmma, so no
// proxy fence sits in the loop (one would wait for every cp.async in flight). The
// layout's unit orders each k-step's k for the GEMV's 8-byte B loads (lane t holds k
// 4t .. 4t + 3 where the MMA takes 2t, 2t + 1, 2t + 8, 2t + 9); two shuffles and a
// byte permute per word put the codes in the MMA's order before the decode
// (mma_order_unit), so x stays as it is in memory. A warp decodes chunk i into one of
// two A-register sets while the tensor cores still run chunk i - 1's wgmmas
// (wait_group 1 before the next barrier), so decode and MMAs overlap; the decode's
// instructions (~100 of a warp's ~175 per chunk) are what limits the kernel
// (docs/prefill.md). The accumulators (64 x BN float32 per warpgroup) stay in
// registers over all of K; at the end they go through shared memory to coalesced
// 16-byte rows of y.
//
// ragged_qmm uses the mma.sync GEMM's device-side row schedule (ragged_row_block)
// with BN-row blocks.
#pragma once

#include <utility>

#include "qmm_gemm.h"

#if defined(JQ_PLATFORM_CUDA)
#include <cooperative_groups.h>
#include <cuda.h>

namespace jq {
namespace gpu {
namespace mma {

constexpr int kWgMaxStages = 6;
constexpr int kWgWarps = kWgBlockTiles;             // two warpgroups (qmm_gemm.h)
constexpr int kWgRows = kWgWarps * kTileRows;       // weight rows per block
constexpr int kWgOutStride = kWgRows * 2 + 16;      // bytes per row of y staged in shared memory

// A stage: [x: BN rows x 128 bytes][weights: warps x 32 lanes x BITS words]
// [scales: warps x (scale, bias) x ScaleStage bytes], 1024-aligned (wgmma's swizzle).
template <int BN, int BITS, int P>
struct WgShared {
  static constexpr int x_bytes = BN * 128;
  static constexpr int w_bytes = kWgWarps * 32 * BITS * 4;
  static constexpr int s_bytes = kWgWarps * 2 * ScaleStage<P>::bytes;
  static constexpr int stage_bytes = (x_bytes + w_bytes + s_bytes + 1023) / 1024 * 1024;
  // stages: x and weights stages - 2 chunks ahead (BN = 256: 4, in ~160 KB)
  static constexpr int stages = BN == 256 ? 4 : kWgMaxStages;
  static constexpr int out_bytes = BN * kWgOutStride;
  static constexpr int bytes =
      (stages * stage_bytes > out_bytes ? stages * stage_bytes : out_bytes) + 1024;
};

// wgmma's shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups
// 1024 bytes apart (the leading-dimension offset is unused for this swizzle: 1).
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
         ((uint64_t)1 << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// The stages' mbarriers: x's TMA copies complete on them (transaction bytes).
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// A box of the 2-D tensor map (k0, row0) -> shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int k0,
                                            int row0, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%2, %3}], [%4];\n" ::"r"(dst),
      "l"(map), "r"(k0), "r"(row0), "r"(bar)
      : "memory");
}

// The lane's unit with each k-step's codes in the MMA's k order: lane (g, t) takes the
// codes of k-pair t (k 2t, 2t + 1 of the k-step) from lane (g, t / 2) and of pair t + 4
// from lane (g, 2 + t / 2), the half t & 1 of theirs (the layout gives lane t pairs
// 2t and 2t + 1). 4 and 8 bits: one byte permute per word; other widths code by code.
template <int BITS, int I>
__device__ __forceinline__ void put_code(const uint32_t* u, const uint32_t* v, bool odd,
                                         uint32_t* out) {
  constexpr int j = I & 3, base = I & ~3;  // code I is half (I >> 2) & 1 of register j
  const uint32_t* src = (j >> 1) ? v : u;  // register j: row j & 1, pair slot j >> 1
  const uint32_t c = odd ? unit_code<BITS, base + (j & 1) + 2>(src)
                         : unit_code<BITS, base + (j & 1)>(src);
  constexpr int start = I * BITS, word = start / 32, shift = start % 32;
  out[word] |= c << shift;
  if constexpr (shift + BITS > 32) out[word + 1] |= c >> (32 - shift);
}
template <int BITS, int... I>
__device__ __forceinline__ void put_codes(const uint32_t* u, const uint32_t* v, bool odd,
                                          uint32_t* out, std::integer_sequence<int, I...>) {
  (put_code<BITS, I>(u, v, odd, out), ...);
}

template <int BITS>
__device__ __forceinline__ void mma_order_unit(uint32_t (&w)[BITS], int lane) {
  const int t = lane & 3, src = (lane & ~3) | (t >> 1);
  const bool odd = t & 1;
  uint32_t u[BITS], v[BITS];
#pragma unroll
  for (int i = 0; i < BITS; ++i) {
    u[i] = __shfl_sync(0xffffffffu, w[i], src);
    v[i] = __shfl_sync(0xffffffffu, w[i], src + 2);
  }
  if constexpr (BITS == 4) {  // word s, byte 2h + slot: the nibbles of rows g, g + 8
    const uint32_t sel = odd ? 0x7351u : 0x6240u;
#pragma unroll
    for (int s = 0; s < 4; ++s) w[s] = __byte_perm(u[s], v[s], sel);
  } else if constexpr (BITS == 8) {  // word 2s + h, byte 2 slot + row
    const uint32_t sel = odd ? 0x7632u : 0x5410u;
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = __byte_perm(u[i], v[i], sel);
  } else {
#pragma unroll
    for (int i = 0; i < BITS; ++i) w[i] = 0u;
    put_codes<BITS>(u, v, odd, w, std::make_integer_sequence<int, 32>{});
  }
}

// d[64 x BN] += a[64 x 16] (registers) * b[16 x BN] (shared memory, K-major), float32
// accumulators: d[i] is row 16 r + g + 8 ((i >> 1) & 1), column 8 (i >> 2) + 2 t + (i & 1)
// of the warpgroup's tile (warp r, lane 4 g + t).
#define JQ_WG_ACC_64 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define JQ_WG_ACC_128 JQ_WG_ACC_64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define JQ_WG_ACC_32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define JQ_WG_AB_32 "{%32, %33, %34, %35}, %36"
#define JQ_WG_AB_64 "{%64, %65, %66, %67}, %68"
#define JQ_WG_AB_128 "{%128, %129, %130, %131}, %132"
// 64 accumulator operands from d[o]
#define JQ_WG_OUT_AT(d, o) \
    "+f"(d[o + 0]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), "+f"(d[o + 6]), "+f"(d[o + 7]), \
    "+f"(d[o + 8]), "+f"(d[o + 9]), "+f"(d[o + 10]), "+f"(d[o + 11]), "+f"(d[o + 12]), "+f"(d[o + 13]), "+f"(d[o + 14]), "+f"(d[o + 15]), \
    "+f"(d[o + 16]), "+f"(d[o + 17]), "+f"(d[o + 18]), "+f"(d[o + 19]), "+f"(d[o + 20]), "+f"(d[o + 21]), "+f"(d[o + 22]), "+f"(d[o + 23]), \
    "+f"(d[o + 24]), "+f"(d[o + 25]), "+f"(d[o + 26]), "+f"(d[o + 27]), "+f"(d[o + 28]), "+f"(d[o + 29]), "+f"(d[o + 30]), "+f"(d[o + 31]), \
    "+f"(d[o + 32]), "+f"(d[o + 33]), "+f"(d[o + 34]), "+f"(d[o + 35]), "+f"(d[o + 36]), "+f"(d[o + 37]), "+f"(d[o + 38]), "+f"(d[o + 39]), \
    "+f"(d[o + 40]), "+f"(d[o + 41]), "+f"(d[o + 42]), "+f"(d[o + 43]), "+f"(d[o + 44]), "+f"(d[o + 45]), "+f"(d[o + 46]), "+f"(d[o + 47]), \
    "+f"(d[o + 48]), "+f"(d[o + 49]), "+f"(d[o + 50]), "+f"(d[o + 51]), "+f"(d[o + 52]), "+f"(d[o + 53]), "+f"(d[o + 54]), "+f"(d[o + 55]), \
    "+f"(d[o + 56]), "+f"(d[o + 57]), "+f"(d[o + 58]), "+f"(d[o + 59]), "+f"(d[o + 60]), "+f"(d[o + 61]), "+f"(d[o + 62]), "+f"(d[o + 63])
#define JQ_WG_OUT_32(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define JQ_WG_OUT_64(d) JQ_WG_OUT_AT(d, 0)
#define JQ_WG_OUT_128(d) JQ_WG_OUT_AT(d, 0), JQ_WG_OUT_AT(d, 64)
// wgmma_ss: the same with A from shared memory too (K-major, 128-byte swizzle, like b):
// the float experts' GEMM (ragged_matmul_wgmma.h), whose weights need no decode.
#define JQ_WG_SS_32 "%32, %33"
#define JQ_WG_SS_64 "%64, %65"
#define JQ_WG_SS_128 "%128, %129"
#define JQ_WGMMA(N, R, TY)                                                                      \
  __device__ __forceinline__ void wgmma_##TY(float (&d)[R], const uint32_t (&a)[4], uint64_t b) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                     \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TY "." #TY " {" JQ_WG_ACC_##R \
                 "}, " JQ_WG_AB_##R ", p, 1, 1, 0;\n}\n"                                        \
                 : JQ_WG_OUT_##R(d)                                                             \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                         \
  }                                                                                             \
  __device__ __forceinline__ void wgmma_ss_##TY(float (&d)[R], uint64_t a, uint64_t b) {        \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                     \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TY "." #TY " {" JQ_WG_ACC_##R \
                 "}, " JQ_WG_SS_##R ", p, 1, 1, 0, 0;\n}\n"                                     \
                 : JQ_WG_OUT_##R(d)                                                             \
                 : "l"(a), "l"(b));                                                             \
  }
JQ_WGMMA(64, 32, bf16)
JQ_WGMMA(64, 32, f16)
JQ_WGMMA(128, 64, bf16)
JQ_WGMMA(128, 64, f16)
JQ_WGMMA(256, 128, bf16)
JQ_WGMMA(256, 128, f16)
#undef JQ_WGMMA

template <int XDT, int R>
__device__ __forceinline__ void wgmma(float (&d)[R], const uint32_t (&a)[4], uint64_t b) {
  if constexpr (XDT == kF16) wgmma_f16(d, a, b);
  else wgmma_bf16(d, a, b);
}
template <int XDT, int R>
__device__ __forceinline__ void wgmma_ss(float (&d)[R], uint64_t a, uint64_t b) {
  if constexpr (XDT == kF16) wgmma_ss_f16(d, a, b);
  else wgmma_ss_bf16(d, a, b);
}

// The block's output tile from the MMA warps' accumulators (the wgmma fragment above;
// warps past kWgWarps hold none): through shared memory `out`, [m][128 weight rows] in
// x's dtype, then to y's rows [blk.y0, blk.y0 + blk.rows), columns [n0, n0 + 128) cut
// at N, as 16-byte rows where whole. `out_threads` of the block store; mma_warps_sync
// is the barrier between the two steps that every one of them reaches.
template <int XDT, int R, class Sync>
__device__ __forceinline__ void store_block_y(const float (&acc)[R], uint8_t* out, int warp,
                                              int lane, const RowBlock& blk, int64_t n0,
                                              const QmvProblem& p, int out_threads,
                                              Sync&& mma_warps_sync) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < (warp < kWgWarps ? R : 0); i += 2) {
    const int m = 8 * (i >> 2) + 2 * t, row = 16 * warp + g + 8 * ((i >> 1) & 1);
    const uint32_t v = XDT == kF16 ? pack_f16x2(acc[i], acc[i + 1]) : pack_bf16x2(acc[i], acc[i + 1]);
    *reinterpret_cast<uint16_t*>(out + m * kWgOutStride + row * 2) = (uint16_t)(v & 0xffffu);
    *reinterpret_cast<uint16_t*>(out + (m + 1) * kWgOutStride + row * 2) = (uint16_t)(v >> 16);
  }
  mma_warps_sync();
  const int ncols = (int)min((int64_t)kWgRows, p.N - n0);
  uint16_t* y = static_cast<uint16_t*>(p.y);
  if (ncols == kWgRows && (p.N & 7) == 0) {  // 16-byte rows
    for (int idx = threadIdx.x; idx < blk.rows * (kWgRows / 8); idx += out_threads) {
      const int m = idx / (kWgRows / 8), v8 = idx % (kWgRows / 8);
      *reinterpret_cast<uint4*>(y + (blk.y0 + m) * p.N + n0 + 8 * v8) =
          *reinterpret_cast<const uint4*>(out + m * kWgOutStride + 16 * v8);
    }
  } else {
    for (int idx = threadIdx.x; idx < blk.rows * kWgRows; idx += out_threads) {
      const int m = idx / kWgRows, col = idx % kWgRows;
      if (col < ncols)
        y[(blk.y0 + m) * p.N + n0 + col] =
            *reinterpret_cast<const uint16_t*>(out + m * kWgOutStride + col * 2);
    }
  }
}

// The kernel's parameters: the problem and the tensor map of x (rows [Sx * M or T, K]).
struct WgParams {
  GemmProblem pr;
  CUtensorMap x_map;
  // WS: the weights, scales and biases as [tiles of 16 rows, the tile's bytes], boxes of
  // one chunk x the block's 8 tiles (wgmma_piece_maps)
  CUtensorMap w_map, s_map, b_map;
};

// WS's producer: one warp at 64 and 128 rows of x per block. At 256 a warpgroup (one of
// its threads copies), so the block is three whole warpgroups and their registers can be
// split with setmaxnreg: nine warps would cap a thread at 168 registers, where 64 x 256
// float32 accumulators a warpgroup need more (ptxas serialized the wgmmas), and 232 for
// each MMA thread with 40 for the producer's fit the SM's 64 K.
template <int BN, bool WS>
constexpr int kWgProducerWarps = !WS ? 0 : BN == 256 ? 4 : 1;
template <int BN, bool WS>
constexpr int kWgThreads = (kWgWarps + kWgProducerWarps<BN, WS>) * 32;
constexpr int kWgMmaRegs = 232, kWgProducerRegs = 40;

// KS: blocks per output tile (GemmProblem::ksplit), a cluster along z; block z takes
// chunks [z * ceil(chunks / KS), ...), and two blocks fit an SM's registers (launch
// bounds; four would leave 64 registers a thread).
// WS: the producer (kWgProducerWarps) makes every copy: per chunk four TMA boxes (x, and the
// block's 8 tiles' weights, scales and biases through tensor maps over 16-row tiles),
// all completing on the stage's mbarrier; the eight MMA warps wait on it, decode,
// multiply and release the stage (a second mbarrier) once their wgmmas have read it. No
// block-wide barrier sits in the loop and the MMA warps issue no copies (plan_gemm
// takes it where N is a multiple of 16 and the buffers 16-byte aligned; one bulk copy
// per tile and piece instead of the tensor maps measured slower: the copy engine's cost
// per copy). Without WS each warp copies its own tile's pieces.
template <class C, int XDT, int P, int SDT, int BN, int KS = 1, bool WS = false>
__global__ void __launch_bounds__(kWgThreads<BN, WS>, KS > 1 ? 2 : 1)
    qmm_wgmma_kernel(const __grid_constant__ WgParams prm) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BITS = C::kBits;
  constexpr int ssz = dtype_bytes(SDT);
  using Lay = WgShared<BN, BITS, P>;
  constexpr int S = Lay::stages;
  const GemmProblem& pr = prm.pr;
  const QmvProblem& p = pr.q;
  extern __shared__ __align__(16) uint8_t smem_dyn[];
  __shared__ RowBlock blk_s;
  __shared__ __align__(8) uint64_t x_full[kWgMaxStages];  // the stage has landed
  __shared__ __align__(8) uint64_t x_empty[kWgMaxStages];  // WS: the MMA warps are done with it
  // wgmma's swizzle is of address bits: the stages start 1024-aligned
  const uint32_t dyn_s = (uint32_t)__cvta_generic_to_shared(smem_dyn);
  uint8_t* smem = smem_dyn + ((1024u - (dyn_s & 1023u)) & 1023u);
  const uint32_t smem_s = (uint32_t)__cvta_generic_to_shared(smem);
  // WS: the warp index through a shuffle, so that the compiler knows it is warp-uniform
  // and keeps the loop's counters and descriptors on the uniform datapath under the
  // branch that leaves the producer out (otherwise it spills at 96 registers)
  const int lane = threadIdx.x & 31;
  const int warp = WS ? __shfl_sync(0xffffffffu, threadIdx.x >> 5, 0) : threadIdx.x >> 5;
  const int g = lane >> 2;
  const int64_t n0 = (int64_t)blockIdx.x * kWgRows;

  const uint32_t full_s = (uint32_t)__cvta_generic_to_shared(x_full);
  const uint32_t empty_s = (uint32_t)__cvta_generic_to_shared(x_empty);
  if (threadIdx.x == 32) {
    for (int i = 0; i < S; ++i) {
      mbar_init(full_s + 8 * i, 1);
      if constexpr (WS) mbar_init(empty_s + 8 * i, kWgWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  RowBlock blk;
  if (!block_rows(pr, &blk_s, n0, kWgRows, blk)) return;

  // --- the K loop --------------------------------------------------------------
  int gshift = 0;  // group sizes are powers of two
  while ((1 << gshift) < p.group) ++gshift;
  // the block's chunks c0 .. c0 + chunks - 1 (stages and barrier phases count from c0)
  const int per = (int)((pr.chunks + KS - 1) / KS);
  const int c0 = KS > 1 ? (int)blockIdx.z * per : 0;
  const int chunks = KS > 1 ? max(0, min(per, (int)pr.chunks - c0)) : (int)pr.chunks;
  constexpr int kScalePieces = C::kFmt == kAffine ? 2 : 1;  // scales (and biases)
  constexpr uint32_t kScaleBytes = 16 * P * ssz;            // a tile's of one chunk
  constexpr uint32_t kUnitBytes = 32 * BITS * 4;            // a tile's weights of one chunk

  // WS's stage: [x][weights: 8 tiles][scales: 8 tiles x 16 P ssz][biases: likewise]
  constexpr int kWsBiasOff = kWgWarps * (int)kScaleBytes;
  // a producer warpgroup gives up registers and leaves once its copies are issued (each
  // completes on a stage's mbarrier that the MMA warps wait for); the MMA warps then
  // meet at a named barrier of their own, not at __syncthreads
  constexpr bool kRegSplit = kWgProducerWarps<BN, WS> == 4;
  const auto mma_warps_sync = [] {
    if constexpr (kRegSplit)
      asm volatile("bar.sync 1, %0;\n" ::"n"(kWgWarps * 32) : "memory");
    else
      __syncthreads();
  };
  const auto produce = [&] {  // the producer: four TMA copies a chunk, from one thread
    if (warp != kWgWarps || lane != 0) return;
    const int trow = (int)((blk.e * p.N) / kTileRows + (int64_t)blockIdx.x * kWgWarps);
    constexpr uint32_t bytes = Lay::x_bytes + kWgWarps * (kUnitBytes + kScalePieces * kScaleBytes);
    for (int i = 0; i < chunks; ++i) {
      const int c = c0 + i, s = i % S;
      const uint32_t st = smem_s + s * Lay::stage_bytes, bar = full_s + 8 * s;
      if (i >= S) mbar_wait(empty_s + 8 * s, ((i / S) + 1) & 1);
      mbar_expect_tx(bar, bytes);
      tma_load_2d(st, &prm.x_map, c * kChunkK, (int)blk.x0, bar);
      tma_load_2d(st + Lay::x_bytes, &prm.w_map, c * (32 * BITS), trow, bar);
      const int sk = ((c << 6) >> gshift) * 16 * ssz;
      const uint32_t sdst = st + Lay::x_bytes + Lay::w_bytes;
      tma_load_2d(sdst, &prm.s_map, sk, trow, bar);
      if constexpr (kScalePieces == 2) tma_load_2d(sdst + kWsBiasOff, &prm.b_map, sk, trow, bar);
    }
  };
  if constexpr (kRegSplit) {
    // ptxas gives a region the registers of the setmaxnreg that dominates it: the
    // producer's branch ends in its own return, so what follows is the MMA warps' alone
    if (warp >= kWgWarps) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kWgProducerRegs));
      produce();
      return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kWgMmaRegs));
  } else if constexpr (WS) {
    produce();
  }

  const int64_t tile = (int64_t)blockIdx.x * kWgWarps + warp;
  const bool has_tile = tile < pr.tiles, full = tile < pr.full_tiles;
  const TileCursor cur = full ? tile_cursor<false>(p, blk.e, tile, BITS, ssz, lane)
                              : tile_cursor<true>(p, blk.e, has_tile ? tile : 0, BITS, ssz, lane);
  const float gsv = p.global_scale ? p.global_scale[0] : 1.0f;
  const uint32_t wslot = (uint32_t)Lay::x_bytes + (warp * 32 + lane) * BITS * 4;
  // the warp's scales go through the stages too (plan_gemm takes this kernel only when
  // every tile's scales are 4-byte aligned): a global load one chunk ahead would stall
  // each chunk for a DRAM latency
  const uint32_t sslot = (uint32_t)(Lay::x_bytes + Lay::w_bytes) +
                         warp * (WS ? (int)kScaleBytes : 2 * ScaleStage<P>::bytes);
  const int64_t row0 = blk.e * p.N + (full ? tile : 0) * kTileRows;
  const char* s_tile = static_cast<const char*>(p.scales) + row0 * p.groups * ssz;
  const char* b_tile = p.biases ? static_cast<const char*>(p.biases) + row0 * p.groups * ssz : s_tile;
  // the block's chunk i is the matrix's chunk c0 + i
  auto issue = [&](int i) {
    const int c = c0 + i;
    const uint32_t st = smem_s + (i % S) * Lay::stage_bytes;
    if (threadIdx.x == 0) {
      const uint32_t bar = full_s + 8 * (i % S);
      mbar_expect_tx(bar, Lay::x_bytes);
      tma_load_2d(st, &prm.x_map, c * kChunkK, (int)blk.x0, bar);
    }
    if (full) {
      unit_to_shared<BITS>(st + wslot, cur.w + (int64_t)c * (32 * BITS));
      scales_to_shared<C, P, ssz>(st + sslot, s_tile, b_tile, c, gshift, lane);
    }
  };

  constexpr int R = BN / 2;
  float acc[R];
#pragma unroll
  for (int i = 0; i < R; ++i) acc[i] = 0.0f;
  if constexpr (!WS) {
#pragma unroll
    for (int c = 0; c < S - 2; ++c) {
      if (c < chunks) issue(c);
      cp_async_commit();
    }
  }
  // chunk c with A-register set `a`. Without WS: the copies of chunk c + S - 2 issued
  // into the stage of chunk c - 2 (its wgmmas are done: each warp waited for them
  // before this barrier). Chunk c decoded while chunk c - 1's wgmmas run, then its own.
  auto step = [&](int i, uint32_t(&a)[4][4]) {
    const int c = c0 + i;
    if constexpr (WS) {
      mbar_wait(full_s + 8 * (i % S), (i / S) & 1);  // x, weights and scales
    } else {
      cp_async_wait<S - 3>();  // this lane's weight unit of chunk i has landed
      mbar_wait(full_s + 8 * (i % S), (i / S) & 1);  // and x
      __syncthreads();  // every warp is done with chunk i - 2's stage: refill it
      if (i + S - 2 < chunks) issue(i + S - 2);
      cp_async_commit();
    }
    const uint8_t* st = smem + (i % S) * Lay::stage_bytes;
    uint32_t w[BITS];
    if (full) {
      load_unit<BITS, false>(reinterpret_cast<const uint32_t*>(st + wslot), w);
      mma_order_unit<BITS>(w, lane);
      ChunkScales<C, P, false, SDT> sc;
      sc.load_shared(st + sslot, g, WS ? kWsBiasOff : ScaleStage<P>::bytes);
      scaled_a<C, XDT, P, SDT>(w, sc, gsv, a);
    } else if (has_tile) {  // the partial last tile: canonical rows, bounds-checked
      tail_unit<BITS>(cur.w, p.words, cur.valid_rows, c, lane, w);
      mma_order_unit<BITS>(w, lane);
      ChunkScales<C, P, true, SDT> tsc;
      tsc.load(p, cur, c, gshift, g);
      scaled_a<C, XDT, P, SDT>(w, tsc, gsv, a);
    } else {  // past N: zeros (the shuffles above are warp-wide, this warp takes none)
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int j = 0; j < 4; ++j) a[s][j] = 0u;
    }
    const uint32_t xs = smem_s + (i % S) * Lay::stage_bytes;
    wg_fence();
#pragma unroll
    for (int s = 0; s < 4; ++s) wgmma<XDT>(acc, a[s], wg_desc(xs + 32 * s));
    wg_commit();
    wg_wait<1>();
    if constexpr (WS) {  // chunk i - 1's wgmmas are done: its stage may be refilled
      __syncwarp();
      if (i > 0 && lane == 0) mbar_arrive(empty_s + 8 * ((i - 1) % S));
    }
  };
  uint32_t a0[4][4], a1[4][4];
  if (!WS || warp < kWgWarps) {
    for (int i = 0; i < chunks; i += 2) {
      step(i, a0);
      if (i + 1 < chunks) step(i + 1, a1);
    }
    wg_wait<0>();
  }
  if constexpr (!WS) cp_async_wait<0>();
  mma_warps_sync();

  if constexpr (KS > 1) {
    static_assert(Lay::stages * Lay::stage_bytes >= R * kWgWarps * 32 * 4,
                  "the stages hold a block's accumulators");
    // The cluster's blocks meet through distributed shared memory: block 0 adds the
    // others' accumulators to its own in rank order (the result does not depend on
    // scheduling), then writes y. [i][thread] keeps a warp's reads on 32 banks.
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    float* part = reinterpret_cast<float*>(smem);
    const unsigned rank = cluster.block_rank();
    constexpr int kMmaThreads = kWgWarps * 32;
    const bool mma_thread = threadIdx.x < kMmaThreads;  // WS: not the producer
    if (rank != 0 && mma_thread) {
#pragma unroll
      for (int i = 0; i < R; ++i) part[i * kMmaThreads + threadIdx.x] = acc[i];
    }
    cluster.sync();  // every block's accumulators are in its shared memory
    if (rank == 0 && mma_thread) {
      for (unsigned b = 1; b < KS; ++b) {
        const float* other = cluster.map_shared_rank(part, b);
#pragma unroll
        for (int i = 0; i < R; ++i) acc[i] += other[i * kMmaThreads + threadIdx.x];
      }
    }
    cluster.sync();  // the others' shared memory stays until block 0 has read it
    if (rank != 0) return;
  }

  store_block_y<XDT>(acc, smem, warp, lane, blk, n0, p,
                     kRegSplit ? kWgWarps * 32 : (int)blockDim.x, mma_warps_sync);
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

// x [rows, K] as a TMA tensor map: boxes of 64 k x bn rows, 128-byte swizzle, rows
// past the end read as zeros (qmm_wgmma.hip).
bool x_tensor_map(const GemmProblem& pr, int bn, bool f16, CUtensorMap* map);
// WS: the weights, scales and biases of every expert as [E N / 16 tiles, the tile's
// bytes], boxes of one chunk's piece (32 BITS words; `scale_bytes` = 16 P ssz) x 8 tiles
// (qmm_wgmma.hip). plan_gemm takes WS only where N is a multiple of 16.
bool wgmma_piece_maps(const GemmProblem& pr, int bits, int scale_bytes, CUtensorMap* w,
                      CUtensorMap* s, CUtensorMap* b);

// The compile check's covering set (gemv_mma.h, kEveryVariant): every codec with 128
// rows of x per block, and the other block sizes with one of affine 4-bit's scale
// variants (the block size changes the accumulators and the stages, not the scales).
#if defined(JQ_MMA_COVERING_SET)
template <int P, int SDT>
constexpr bool kWgEveryBlockSize = P == 1 && SDT == kF32;
#else
template <int P, int SDT>
constexpr bool kWgEveryBlockSize = true;
#endif

// The launch policy of the format switches in gemv_mma.h, for this kernel with BN rows
// of x per block (qmm_wgmma.hip builds each BN in its own translation unit).
template <int BN>
struct WgmmaLaunch {
  template <class C, int XDT, int NT, int P, int SDT>
  static hipError_t run(const GemmProblem& pr, hipStream_t stream) {
    if constexpr (XDT == kF32) {
      return hipErrorInvalidValue;  // float32 x: not this kernel (the handler refuses it)
    } else if constexpr (!kEveryVariant<C, XDT> || (BN != 128 && !kWgEveryBlockSize<P, SDT>)) {
      return go<C, XDT, P, SDT, 128>(pr, stream);  // the compile check's covering set
    } else {
      return go<C, XDT, P, SDT, BN>(pr, stream);
    }
  }
  template <class C, int XDT, int P, int SDT, int N>
  static hipError_t go(const GemmProblem& pr, hipStream_t stream) {
    // K split over a cluster only at 64 rows of x per block (wgmma_ksplit)
    if constexpr (N == 64) {
      if (pr.ksplit == 2) return go_ks<C, XDT, P, SDT, N, 2>(pr, stream);
      if (pr.ksplit == 4) return go_ks<C, XDT, P, SDT, N, 4>(pr, stream);
    }
    return go_ks<C, XDT, P, SDT, N, 1>(pr, stream);
  }
  template <class C, int XDT, int P, int SDT, int N, int KS>
  static hipError_t go_ks(const GemmProblem& pr, hipStream_t stream) {
    if (pr.producer) return go_ws<C, XDT, P, SDT, N, KS, true>(pr, stream);
    return go_ws<C, XDT, P, SDT, N, KS, false>(pr, stream);
  }
  template <class C, int XDT, int P, int SDT, int N, int KS, bool WS>
  static hipError_t go_ws(const GemmProblem& pr, hipStream_t stream) {
    using Lay = WgShared<N, C::kBits, P>;
    auto kernel = qmm_wgmma_kernel<C, XDT, P, SDT, N, KS, WS>;
    constexpr int threads = kWgThreads<N, WS>;
    static std::atomic<uint64_t> raised{0};
    if (!raise_shared_limit(kernel, Lay::bytes, raised)) return hipErrorInvalidValue;
    WgParams prm;
    prm.pr = pr;
    if (!x_tensor_map(pr, N, XDT == kF16, &prm.x_map)) return hipErrorInvalidValue;
    if constexpr (WS) {
      constexpr int ssz = dtype_bytes(SDT);
      if (!wgmma_piece_maps(pr, C::kBits, 16 * P * ssz, &prm.w_map, &prm.s_map, &prm.b_map))
        return hipErrorInvalidValue;
    }
    dim3 grid((unsigned)((pr.tiles + kWgWarps - 1) / kWgWarps), (unsigned)pr.row_blocks, KS);
    if constexpr (KS == 1) {
      kernel<<<grid, threads, Lay::bytes, stream>>>(prm);
      return hipGetLastError();
    } else {
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = grid;
      cfg.blockDim = dim3(threads);
      cfg.dynamicSmemBytes = Lay::bytes;
      cfg.stream = stream;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = 1;
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = KS;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      return cudaLaunchKernelEx(&cfg, kernel, prm);
    }
  }
};

}  // namespace mma
}  // namespace gpu
}  // namespace jq
#endif  // JQ_PLATFORM_CUDA
