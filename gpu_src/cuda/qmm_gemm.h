// The prefill GEMM on NVIDIA tensor cores (CUDA only, sm_80+): qmm with more
// than 16 rows of x per weight matrix, and ragged_qmm, on the `cuda_mma`
// layout of the decode GEMV (gemv_mma.h), whose decode, scales and MMA it uses:
// one prepacked weight serves decode and prefill.
//
// A block computes 16 R rows of N (R warps along N; 8 / R warps split K) for
// kBlockM = 64 rows of x. Per chunk of 64 k a warp decodes its lane's unit once
// into A registers and runs 4 k-steps x 8 n-tiles of mma.sync.m16n8k16: the
// decode is amortized over 64 rows of x instead of 8 or 16. x goes global ->
// shared with 16-byte cp.async (zero-filled past the block's rows), row m's
// 16-byte segment s stored at s ^ (m & 7) so a warp's 8-byte B loads take two
// wavefronts (the least for 256 bytes); the weights go to per-lane stage slots
// as in the GEMV. kGemmStages chunks are in flight; scales are loaded one chunk
// ahead into registers; one barrier per chunk. The warps' partial sums meet in shared memory and the
// block writes y rows of 16 R consecutive n.
//
// ragged_qmm: the row blocks are a device-side schedule. Group e covers
// ceil(rows_e / 64) blocks, an empty group none; grid row j (of ceil(T / 64) + E)
// finds its group with a warp scan over group_sizes, so the cost follows the rows
// and the experts used, not E. The grid rows past the last group's zero the rows
// past sum(group_sizes): there is always at least one (sum of ceil(rows_e / 64)
// < T / 64 + E). Group sizes are clamped to [0, T - start]: rows past T do not
// exist (as in lax.ragged_dot), a negative size is an empty group.
#pragma once

#include "gemv_mma.h"

#if defined(JQ_PLATFORM_CUDA)

namespace jq {
namespace gpu {
namespace mma {

constexpr int kBlockM = 64;                           // rows of x per block: 8 MMA n-tiles
constexpr int kGemmWarps = 8;
constexpr int kGemmStages = 4;
constexpr int kXChunkBytes = kBlockM * kChunkK * 2;  // one chunk of the block's x rows
constexpr int kRedStride = kBlockM + 4;              // partial sums [warp][row][m], padded
static_assert(kGemmWarps * 32 * 2 == kBlockM * 8, "each thread copies two 16-byte pieces of x per chunk");

struct GemmProblem {
  QmvProblem q;       // qmm: S = E matrices, x [Sx, M, K], y [S, M, N];
                      // ragged: E experts, x [1, T, K], y [1, T, N] (M = T)
  int64_t tiles, full_tiles, chunks;
  int64_t row_blocks;  // grid rows: qmm S * ceil(M / 64); ragged ceil(T / 64) + E
  int row_tiles;       // R: 16-row tiles per block, 2, 4 or 8 (the mma.sync kernel)
  int block_m;         // rows of x per block: kBlockM (mma.sync), 64, 128 or 256 (wgmma)
  bool wgmma;          // the Hopper kernel (qmm_wgmma.h), else the mma.sync one
  int ksplit;          // wgmma: blocks per output tile (a thread-block cluster along z),
                       // each over its share of the K chunks; 1, 2 or 4
  bool producer;       // wgmma: a producer (a warp, at 256 rows a warpgroup) makes the
                       // copies through TMA tensor maps (qmm_wgmma.h, WS; plan_gemm
                       // says where)
  const int32_t* group_sizes;  // ragged: [E]; qmm: nullptr
};

// The dynamic shared memory: kGemmStages x [x: KS chunks][weights: warps x 32 lanes x
// BITS words]; the partial sums reuse it at the end.
struct GemmShared {
  int x_bytes, stage_bytes, bytes;
  __host__ __device__ static GemmShared of(int ks, int bits) {
    GemmShared l;
    l.x_bytes = ks * kXChunkBytes;
    l.stage_bytes = l.x_bytes + kGemmWarps * 32 * bits * 4;
    const int red = kGemmWarps * kTileRows * kRedStride * 4;
    l.bytes = kGemmStages * l.stage_bytes > red ? kGemmStages * l.stage_bytes : red;
    return l;
  }
};

// What one block computes: expert e's product for rows [x0, x0 + rows) of x into
// rows [y0, y0 + rows) of y; or (e < 0, ragged) spare block `spare` of `spares`,
// which zeroes its share of the rows [tail, T).
struct RowBlock {
  int64_t e, x0, y0, tail, spare, spares;
  int rows;
};

__device__ __forceinline__ int64_t warp_inclusive_sum(int64_t v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

// ragged_qmm's and ragged_matmul's items (blocks of pr.block_m rows of one group, the
// groups in order) in increasing order, for a warp: the group sizes are scanned 32
// experts at a time, as far as the item asked for needs, so a block's walk over all
// its items reads the E sizes once.
struct RaggedWalk {
  int64_t base = 0;           // the first expert of the scanned 32
  int64_t rows_before = 0;    // rows of the groups before `base` (cut at T)
  int64_t blocks_before = 0;  // items before `base`'s
  bool scanned = false;       // the 32 at `base` are scanned (the lane's fields below)
  int64_t start = 0, end = 0, first = 0, blocks = 0;  // this lane's expert
  int64_t rows_here = 0, blocks_here = 0;             // the 32's, every lane

  __device__ void scan(const GemmProblem& pr, int lane) {
    const QmvProblem& p = pr.q;
    const int64_t T = p.M, BM = pr.block_m, e = base + lane;
    int64_t size = e < p.E ? (int64_t)pr.group_sizes[e] : 0;
    size = size < 0 ? 0 : (size > T ? T : size);
    const int64_t incl = warp_inclusive_sum(size, lane);
    start = min(rows_before + incl - size, T);
    end = min(start + size, T);
    blocks = (end - start + BM - 1) / BM;
    const int64_t bincl = warp_inclusive_sum(blocks, lane);
    first = blocks_before + bincl - blocks;
    rows_here = __shfl_sync(0xffffffffu, incl, 31);
    blocks_here = __shfl_sync(0xffffffffu, bincl, 31);
    scanned = true;
  }
  // past the scanned 32 (rows cut at T)
  __device__ void next(int64_t T) {
    rows_before = min(rows_before + rows_here, T);
    blocks_before += blocks_here;
    base += 32;
    scanned = false;
  }
  // Item j (no smaller than the last one asked for) into *b; false past the last item.
  __device__ bool find(const GemmProblem& pr, int64_t j, int lane, RowBlock* b) {
    const int64_t T = pr.q.M;
    for (;;) {
      if (!scanned) {
        if (base >= pr.q.E) return false;
        scan(pr, lane);
      }
      if (j < blocks_before + blocks_here) break;
      next(T);
    }
    const unsigned mask = __ballot_sync(0xffffffffu, j >= first && j < first + blocks);
    const int src = __ffs(mask) - 1;
    b->e = base + src;
    b->x0 = b->y0 = __shfl_sync(0xffffffffu, start, src) +
                    (j - __shfl_sync(0xffffffffu, first, src)) * pr.block_m;
    b->rows = (int)min((int64_t)pr.block_m, __shfl_sync(0xffffffffu, end, src) - b->x0);
    return true;
  }
  // The rows in groups (those past them are zero), after the walk's last find.
  __device__ int64_t rows_in_groups(const GemmProblem& pr, int lane) {
    while (base < pr.q.E) {
      if (!scanned) scan(pr, lane);
      next(pr.q.M);
    }
    return rows_before;
  }
};

// Grid row j of ragged_qmm (warp 0; lane 0 has set b->e = -1 first): the walk's item j
// (past the last one, b->e stays -1: a spare block) and the rows past the groups.
__device__ __forceinline__ void ragged_row_block(const GemmProblem& pr, int64_t j, int lane, RowBlock* b) {
  RaggedWalk walk;
  walk.find(pr, j, lane, b);
  const int64_t tail = walk.rows_in_groups(pr, lane);
  if (lane == 0) {
    b->tail = tail;
    b->spare = j - walk.blocks_before;
    b->spares = pr.row_blocks - walk.blocks_before;
  }
}

// The block's rows of x and y (warp 0; the block syncs after): qmm matrix s, rows
// mb * block_m ...; ragged_qmm grid row blockIdx.y of the schedule.
__device__ __forceinline__ void row_block(const GemmProblem& pr, int lane, RowBlock* b) {
  const QmvProblem& p = pr.q;
  const int64_t BM = pr.block_m;
  if (lane == 0) {
    b->e = -1;
    if (pr.group_sizes == nullptr) {
      const int64_t per = (p.M + BM - 1) / BM;
      const int64_t s = blockIdx.y / per, mb = blockIdx.y % per;
      b->e = s;
      b->x0 = (s / p.x_div) * p.M + mb * BM;
      b->y0 = s * p.M + mb * BM;
      b->rows = (int)min(BM, p.M - mb * BM);
    }
  }
  __syncwarp();
  if (pr.group_sizes != nullptr) ragged_row_block(pr, blockIdx.y, lane, b);
}

// A ragged spare block (blk.e < 0): zero its share of the rows past the groups, in
// the block's columns n0 .. n0 + ncols - 1.
__device__ __forceinline__ void zero_spare_rows(const GemmProblem& pr, const RowBlock& blk,
                                                int64_t n0, int ncols) {
  const QmvProblem& p = pr.q;
  const int64_t BM = pr.block_m;
  for (int64_t r0 = blk.tail + blk.spare * BM; r0 < p.M; r0 += blk.spares * BM)
    for (int idx = threadIdx.x; idx < BM * ncols; idx += blockDim.x) {
      const int64_t row = r0 + idx / ncols, n = n0 + idx % ncols;
      if (row < p.M && n < p.N) store_out(p.y, row * p.N + n, p.x_dt, 0.0f);
    }
}

// The block's rows (row_block by warp 0, shared through `slot`; the block syncs). A
// ragged spare block zeroes its share of the rows past the groups instead: false.
__device__ __forceinline__ bool block_rows(const GemmProblem& pr, RowBlock* slot, int64_t n0,
                                           int ncols, RowBlock& blk) {
  if ((threadIdx.x >> 5) == 0) row_block(pr, threadIdx.x & 31, slot);
  __syncthreads();
  blk = *slot;
  if (blk.e >= 0) return true;
  zero_spare_rows(pr, blk, n0, ncols);
  return false;
}

// x's 16-bit elements [row m][k in the chunk], swizzled 16-byte segments.
__device__ __forceinline__ int x_offset(int m, int byte_in_row) {
  return m * 128 + ((((byte_in_row >> 4) ^ m) & 7) << 4) + (byte_in_row & 15);
}

__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, bool in) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(in ? 16 : 0));
}

// A group's scale of one row as a float (E8M0 exactly, NaN for code 255).
template <class C>
__device__ __forceinline__ float scale_value(uint32_t sraw, int32_t sdt, float gsv) {
  if constexpr (C::kScale == kScaleE8M0) {
    return sraw == 255u ? quiet_nan() : bits_to_f32(sraw ? sraw << 23 : 0x00400000u);
  } else if constexpr (C::kScale == kScaleE4M3) {
    return scale_e4m3((uint8_t)sraw) * gsv;
  } else {
    return raw_to_float(sraw, sdt);
  }
}

__device__ __forceinline__ uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c, bool f16) {
  uint32_t d;
  if (f16) asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  else asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// A tile's A registers of one chunk: the lane's unit `w` decoded and scaled there
// (w = q * s (+ b) rounded to x's dtype, as the reference's dequantize rounds it).
// Scaling the A registers, not the 8 n-tiles' accumulators per group, keeps the
// per-group work off the MMA loop (on the accumulators it cost ~10x the MMAs' issue
// slots).
template <class C, int XDT, int P, int SDT, class Scales>
__device__ __forceinline__ void scaled_a(const uint32_t* w, const Scales& sc, float gsv,
                                         uint32_t (&a)[4][4]) {
  constexpr bool F16 = XDT == kF16;
  constexpr bool AFFINE = C::kFmt == kAffine;
  constexpr int SPP = 4 / P;
  chunk_a_regs<C, F16, false>(w, a);
#pragma unroll
  for (int pc = 0; pc < P; ++pc) {
    uint32_t s2[2], b2[2];  // rows g and g + 8: (scale, scale) and (bias, bias) pairs
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sv = scale_value<C>(sc.get(pc, 0, h), SDT, gsv);
      s2[h] = F16 ? pack_f16x2(sv, sv) : pack_bf16x2(sv, sv);
      if constexpr (AFFINE) {
        const float bv = raw_to_float(sc.get(pc, 1, h), SDT);
        b2[h] = F16 ? pack_f16x2(bv, bv) : pack_bf16x2(bv, bv);
      }
    }
#pragma unroll
    for (int st = pc * SPP; st < (pc + 1) * SPP; ++st)
#pragma unroll
      for (int j = 0; j < 4; ++j)  // register j holds row g + 8 (j & 1)
        a[st][j] = AFFINE ? hfma2(a[st][j], s2[j & 1], b2[j & 1], F16)
                          : (F16 ? hmul2_f16(a[st][j], s2[j & 1]) : hmul2_bf16(a[st][j], s2[j & 1]));
  }
}

// One chunk of a warp: the scaled A registers, then 4 k-steps x 8 n-tiles of MMAs
// against the chunk of x in shared memory, float32 accumulation over all of K.
template <class C, int XDT, int P, int SDT, class Scales>
__device__ __forceinline__ void gemm_chunk(const uint32_t* w, const Scales& sc,
                                           const uint8_t* xs, const int (&b_off)[4], float gsv,
                                           float (&acc)[8][4]) {
  uint32_t a[4][4];
  scaled_a<C, XDT, P, SDT>(w, sc, gsv, a);
#pragma unroll
  for (int st = 0; st < 4; ++st) {
    const uint8_t* xst = xs + b_off[st];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {  // n-tile nt: 8 rows of x further (an immediate offset)
      const uint2 b = *reinterpret_cast<const uint2*>(xst + nt * 8 * 128);
      mma16816<XDT == kF16>(acc[nt], a[st], b.x, b.y);
    }
  }
}

template <class C, int XDT, int P, int SDT>
__global__ void __launch_bounds__(kGemmWarps * 32, 2) qmm_gemm_kernel(GemmProblem pr) {
  constexpr int BITS = C::kBits;
  constexpr int ssz = dtype_bytes(SDT);
  const QmvProblem& p = pr.q;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ RowBlock blk_s;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int R = pr.row_tiles, KS = kGemmWarps / R;
  const int ks = warp / R, g = lane >> 2, t = lane & 3;
  const int64_t n0 = (int64_t)blockIdx.x * R * kTileRows;
  const int ncols = R * kTileRows;

  RowBlock blk;
  if (!block_rows(pr, &blk_s, n0, ncols, blk)) return;

  // --- the K loop --------------------------------------------------------------
  const GemmShared lay = GemmShared::of(KS, BITS);
  const int64_t tile = (int64_t)blockIdx.x * R + warp % R;
  const bool has_tile = tile < pr.tiles, full = tile < pr.full_tiles;
  const TileCursor cur = full ? tile_cursor<false>(p, blk.e, tile, BITS, ssz, lane)
                              : tile_cursor<true>(p, blk.e, tile, BITS, ssz, lane);
  int gshift = 0;  // group sizes are powers of two
  while ((1 << gshift) < p.group) ++gshift;
  const float gsv = p.global_scale ? p.global_scale[0] : 1.0f;
  const int chunks = (int)pr.chunks, iters = (chunks + KS - 1) / KS;
  const uint32_t smem_s = (uint32_t)__cvta_generic_to_shared(smem);
  const char* xg = static_cast<const char*>(p.x);

  // this thread's share of each chunk of x: 16-byte segment `seg` of rows m0 and m0 + 32
  const int m0 = threadIdx.x >> 3, seg = threadIdx.x & 7;
  const char* xsrc[2];
  uint32_t xdst[2];
  bool xin[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = m0 + 32 * h;
    xin[h] = m < blk.rows;  // else: zero-filled from the block's first row (a valid address)
    xsrc[h] = xg + ((blk.x0 + (xin[h] ? m : 0)) * p.K + seg * 8) * 2;
    xdst[h] = (uint32_t)x_offset(m, seg * 16);
  }
  auto issue = [&](int i) {
    const uint32_t st = smem_s + (i % kGemmStages) * lay.stage_bytes;
    for (int kc = 0; kc < KS; ++kc) {
      const int c = i * KS + kc, cc = c < chunks ? c : chunks - 1;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        cp_async16_zfill(st + kc * kXChunkBytes + xdst[h], xsrc[h] + cc * (kChunkK * 2),
                         xin[h] && c < chunks);
    }
    const int c = i * KS + ks;
    if (full && c < chunks)
      unit_to_shared<BITS>(st + lay.x_bytes + (warp * 32 + lane) * BITS * 4,
                           cur.w + (int64_t)c * (32 * BITS));
  };

  // the lane's B loads of k-step st: row g, bytes 32 st + 8t of the chunk, swizzled
  int b_off[4];
#pragma unroll
  for (int st = 0; st < 4; ++st) b_off[st] = x_offset(g, 32 * st + 8 * t);
  float acc[8][4];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.0f;
#pragma unroll
  for (int i = 0; i < kGemmStages - 1; ++i) {
    if (i < iters) issue(i);
    cp_async_commit();
  }
  ChunkScales<C, P, false, SDT> sc;
  if (full && ks < chunks) sc.load(p, cur, ks, gshift, g);
  for (int i = 0; i < iters; ++i) {
    cp_async_wait<kGemmStages - 2>();  // this thread's copies of stage i have landed
    // ... and everyone's; and every warp is done with stage i - 1, refilled here
    __syncthreads();
    if (i + kGemmStages - 1 < iters) issue(i + kGemmStages - 1);
    cp_async_commit();
    const int c = i * KS + ks;
    ChunkScales<C, P, false, SDT> sc_next = sc;
    if (full && c + KS < chunks) sc_next.load(p, cur, c + KS, gshift, g);
    const uint8_t* st = smem + (i % kGemmStages) * lay.stage_bytes;
    if (has_tile && c < chunks) {
      uint32_t w[BITS];
      if (full) {
        load_unit<BITS, false>(
            reinterpret_cast<const uint32_t*>(st + lay.x_bytes) + (warp * 32 + lane) * BITS, w);
        gemm_chunk<C, XDT, P, SDT>(w, sc, st + ks * kXChunkBytes, b_off, gsv, acc);
      } else {  // the partial last tile: canonical rows, bounds-checked
        tail_unit<BITS>(cur.w, p.words, cur.valid_rows, c, lane, w);
        ChunkScales<C, P, true, SDT> tsc;
        tsc.load(p, cur, c, gshift, g);
        gemm_chunk<C, XDT, P, SDT>(w, tsc, st + ks * kXChunkBytes, b_off, gsv, acc);
      }
    }
    sc = sc_next;
  }
  cp_async_wait<0>();
  __syncthreads();

  // --- partial sums of the K-split warps, then rows of 16 R consecutive n -------
  float(*red)[kTileRows][kRedStride] = reinterpret_cast<float(*)[kTileRows][kRedStride]>(smem);
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][g + 8 * (i >> 1)][8 * nt + 2 * t + (i & 1)] = acc[nt][i];
  __syncthreads();
  for (int idx = threadIdx.x; idx < blk.rows * ncols; idx += blockDim.x) {
    const int m = idx / ncols, col = idx % ncols;
    const int64_t n = n0 + col;
    if (n >= p.N) continue;
    float v = 0.0f;
    for (int k2 = 0; k2 < KS; ++k2) v += red[k2 * R + col / kTileRows][col % kTileRows][m];
    store_out(p.y, (blk.y0 + m) * p.N + n, p.x_dt, v);
  }
}

// The cuda_mma layout's dequantize, for qmm with many rows (then cuBLAS): w [E, N,
// K] in x's dtype (16-bit), canonical order, the values the GEMM multiplies. One warp
// per tile and kDequantChunks chunks, all their loads issued before the first
// decode (bytes in flight: one chunk per warp left it latency-bound); a lane decodes
// and scales its unit like the GEMM (scaled_a) and stores rows g and g + 8, 4
// consecutive k per k-step (8 bytes; 4 lanes write 32 contiguous bytes). pr.q.y is
// w; x, M and S are unused.
constexpr int kDequantChunks = 4;

template <class C, int XDT, int P, int SDT>
__global__ void __launch_bounds__(256) dequant_mma_kernel(GemmProblem pr) {
  constexpr int BITS = C::kBits;
  constexpr int ssz = dtype_bytes(SDT);
  const QmvProblem& p = pr.q;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t per_tile = (pr.chunks + kDequantChunks - 1) / kDequantChunks;
  const int64_t wid = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (wid >= pr.tiles * per_tile) return;
  const int64_t tile = wid / per_tile, e = blockIdx.y;
  const int c0 = (int)(wid % per_tile) * kDequantChunks;
  int gshift = 0;
  while ((1 << gshift) < p.group) ++gshift;
  const float gsv = p.global_scale ? p.global_scale[0] : 1.0f;
  uint32_t a[kDequantChunks][4][4];
  if (tile < pr.full_tiles) {
    const TileCursor cur = tile_cursor<false>(p, e, tile, BITS, ssz, lane);
    uint32_t w[kDequantChunks][BITS];
    ChunkScales<C, P, false, SDT> sc[kDequantChunks];
#pragma unroll
    for (int i = 0; i < kDequantChunks; ++i)
      if (c0 + i < pr.chunks) {
        load_unit<BITS>(cur.w + (int64_t)(c0 + i) * (32 * BITS), w[i]);
        sc[i].load(p, cur, c0 + i, gshift, g);
      }
#pragma unroll
    for (int i = 0; i < kDequantChunks; ++i)
      if (c0 + i < pr.chunks) scaled_a<C, XDT, P, SDT>(w[i], sc[i], gsv, a[i]);
  } else {
    const TileCursor cur = tile_cursor<true>(p, e, tile, BITS, ssz, lane);
#pragma unroll
    for (int i = 0; i < kDequantChunks; ++i)
      if (c0 + i < pr.chunks) {
        uint32_t w[BITS];
        tail_unit<BITS>(cur.w, p.words, cur.valid_rows, c0 + i, lane, w);
        ChunkScales<C, P, true, SDT> sc;
        sc.load(p, cur, c0 + i, gshift, g);
        scaled_a<C, XDT, P, SDT>(w, sc, gsv, a[i]);
      }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // row g + 8h: registers h (k 4t, 4t+1) and h + 2 (4t+2, 4t+3)
    const int64_t n = tile * kTileRows + g + 8 * h;
    if (n >= p.N) continue;
    uint2* out = reinterpret_cast<uint2*>(static_cast<uint16_t*>(p.y) + (e * p.N + n) * p.K +
                                          (int64_t)c0 * kChunkK + 4 * t);
#pragma unroll
    for (int i = 0; i < kDequantChunks; ++i)
      if (c0 + i < pr.chunks)
#pragma unroll
        for (int st = 0; st < 4; ++st) out[16 * i + 4 * st] = make_uint2(a[i][st][h], a[i][st][h + 2]);
  }
}

// Row tiles per block: the widest (least x traffic) that still gives the SMs 1.5
// blocks each; narrower blocks split K among more warps. (H100, M = 64 at
// 4096 -> 14336: R = 2 / 4 / 8 took 99 / 76 / 103 us.) $JAXQUANT_GEMM_ROW_TILES (2, 4
// or 8) overrides it for benchmark sweeps.
inline int gemm_row_tiles(int64_t tiles, int64_t row_blocks) {
  static const int forced = env_choice("JAXQUANT_GEMM_ROW_TILES", {2, 4, 8});
  if (forced) return forced;
  for (int r : {8, 4})
    if ((tiles + r - 1) / r * row_blocks * 2 >= 3 * sm_count()) return r;
  return 2;
}

// The launch policy of the format switches in gemv_mma.h (launch_affine / launch_float).
struct GemmLaunch {
  template <class C, int XDT, int NT, int P, int SDT>
  static hipError_t run(const GemmProblem& pr, hipStream_t stream) {
    if constexpr (XDT == kF32) {
      return hipErrorInvalidValue;  // float32 x: not this kernel (qmm_gemm.hip refuses it)
    } else {
      constexpr int kMost = kGemmStages * (4 * kXChunkBytes + kGemmWarps * 32 * 8 * 4);
      static std::atomic<uint64_t> raised{0};
      if (!raise_shared_limit(qmm_gemm_kernel<C, XDT, P, SDT>, kMost, raised))
        return hipErrorInvalidValue;
      const GemmShared lay = GemmShared::of(kGemmWarps / pr.row_tiles, C::kBits);
      dim3 grid((unsigned)((pr.tiles + pr.row_tiles - 1) / pr.row_tiles), (unsigned)pr.row_blocks);
      qmm_gemm_kernel<C, XDT, P, SDT><<<grid, kGemmWarps * 32, lay.bytes, stream>>>(pr);
      return hipGetLastError();
    }
  }
};

// The launch policy of the layout's dequantize (qmm_gemm.h: dequant_mma_kernel).
struct DequantMmaLaunch {
  template <class C, int XDT, int NT, int P, int SDT>
  static hipError_t run(const GemmProblem& pr, hipStream_t stream) {
    if constexpr (XDT == kF32) {
      return hipErrorInvalidValue;  // 16-bit outputs only (gemv_mma.hip refuses float32)
    } else {
      const int64_t warps = pr.tiles * ((pr.chunks + kDequantChunks - 1) / kDequantChunks);
      dim3 grid((unsigned)((warps + 7) / 8), (unsigned)pr.q.E);
      dequant_mma_kernel<C, XDT, P, SDT><<<grid, 256, 0, stream>>>(pr);
      return hipGetLastError();
    }
  }
};

// A launcher per format family (affine, float: separate translation units, built in
// parallel) and the one that picks between them: NAME_DT -> NAME_affine_DT / NAME_float_DT.
#define JQ_FAMILY_LAUNCHERS(NAME, DT)                                               \
  hipError_t NAME##_affine_##DT(const GemmProblem& pr, hipStream_t stream);         \
  hipError_t NAME##_float_##DT(const GemmProblem& pr, hipStream_t stream);          \
  inline hipError_t NAME##_##DT(const GemmProblem& pr, hipStream_t stream) {        \
    return pr.q.fmt == kAffine ? NAME##_affine_##DT(pr, stream)                     \
                               : NAME##_float_##DT(pr, stream);                    \
  }
JQ_FAMILY_LAUNCHERS(launch_qmm_gemm, bf16)
JQ_FAMILY_LAUNCHERS(launch_qmm_gemm, f16)
JQ_FAMILY_LAUNCHERS(launch_dequant_mma, bf16)
JQ_FAMILY_LAUNCHERS(launch_dequant_mma, f16)

// The Hopper GEMM (qmm_wgmma.h, built for sm_90a in qmm_wgmma.hip): whether it can
// run on the current device (compute capability 9.0 and the library holds its
// code; $JAXQUANT_GEMM_KERNEL=mma turns it off), and its launches.
bool wgmma_usable();
JQ_FAMILY_LAUNCHERS(launch_qmm_wgmma, bf16)
JQ_FAMILY_LAUNCHERS(launch_qmm_wgmma, f16)
#undef JQ_FAMILY_LAUNCHERS

// ragged_matmul's grouped GEMM on float experts (ragged_matmul_wgmma.h, built in
// qmm_wgmma.hip): P.q.data the experts' weights [E, N, K] in x's 16-bit dtype, planned by
// plan_ragged_matmul.
hipError_t launch_ragged_matmul_wgmma(const GemmProblem& pr, hipStream_t stream);

// The wgmma kernel's weight rows per block (qmm_wgmma.h: kWgWarps 16-row tiles).
constexpr int kWgBlockTiles = 8;

// Rows of x per wgmma block for qmm (not ragged) with `rows` >= 256 rows per matrix:
// 256 halves the decode per MMA, but where that grid is short of the GPU (one block
// per SM) 128 rows, twice the blocks, can finish in fewer waves. A 128-row block takes
// about 0.75 of a 256-row one's time, so 128 where 3 x its waves < 4 x 256's. H100
// (132 SMs), M = 512, affine4 / mxfp4, us at 256 against 128 rows per block:
// 4096 -> 4096 (64 blocks against 128) 60.6 / 69.0 vs 47.4 / 51.4; 14336 -> 4096
// 192.2 / 210.2 vs 148.3 / 161.1; 4096 -> 6144 (96 against 192: two waves) 65.4 / 71.7
// vs 89.6 / 101.6; 4096 -> 14336 122.7 / 134.4 vs 177.6 / 193.5.
inline int wgmma_rows_per_block(int64_t tiles, int64_t matrices, int64_t rows) {
  const int64_t cols = (tiles + kWgBlockTiles - 1) / kWgBlockTiles;
  const int64_t sms = sm_count();
  const auto waves = [&](int64_t bm) {
    return (cols * matrices * ((rows + bm - 1) / bm) + sms - 1) / sms;
  };
  return 3 * waves(128) < 4 * waves(256) ? 128 : 256;
}

// Blocks per output tile of the wgmma GEMM (qmm_wgmma.h: a cluster of 2 or 4 blocks
// along z, each over its share of K, block 0 adding the others' accumulators through
// distributed shared memory in rank order). At 64 rows of x per block a block's time
// is its warps' serial chain per chunk (decode, barrier, wgmma wait: about 1300 cycles
// a chunk at 4096 -> 14336, M = 64 on an H100), and a grid of at most one block per SM
// leaves one block of 8 warps an SM: splitting K shortens each block's chain and puts
// more blocks to work. Taken for qmm (not ragged) at 64 rows per block: 4 blocks a tile
// where the grid then still has at most one block per SM (a shared-memory footprint
// that always fits), 2 where the grid has at most one block per SM (two an SM), each
// block keeping 8 chunks or more. $JAXQUANT_WGMMA_KSPLIT (1, 2 or 4) overrides it for
// sweeps.
inline int wgmma_ksplit(const GemmProblem& P) {
  if (!P.wgmma || P.group_sizes != nullptr || P.block_m != 64) return 1;
  static const int forced = env_choice("JAXQUANT_WGMMA_KSPLIT", {1, 2, 4});
  if (forced) return forced;
  const int64_t blocks = (P.tiles + kWgBlockTiles - 1) / kWgBlockTiles * P.row_blocks;
  if (4 * blocks <= sm_count() && P.chunks >= 32) return 4;
  return blocks <= sm_count() && P.chunks >= 16 ? 2 : 1;
}

// The GEMM's plan, for P with q, tiles, full_tiles, chunks and group_sizes set: the
// kernel (wgmma where usable, else mma.sync), its rows of x per block and grid rows.
// wgmma blocks take 256 rows of x from 256 rows per matrix (or per expert, on average):
// the decode's cost per MMA halves (H100, 4096 -> 14336, affine4 / mxfp4: M = 512
// 117 / 127 us against 169 / 187 with 128 rows; M = 4096 860 / 894 against 1189 /
// 1251); qmm takes 128 where the 256-row grid would leave SMs idle
// (wgmma_rows_per_block), 64 from at most 64 rows (the tensor cores' work halves where
// a 128-row block would be half padding), else 128. ragged_qmm takes 128 at fewer rows
// too: its groups are uneven, and each group past a block's rows decodes its weights
// once more (nor does the average say much where a model's experts of every layer are
// one stack: jaxquant/models/moe.py). gpt-oss-20b's MXFP4 prefill of 512 tokens on an
// H200: a ragged product 221 us with 64-row blocks, about 170 with 128, and the prefill
// 19.9 -> 17.4 ms (benchmarks/h200/model.json `gpt-oss-20b.mxfp4.prefill512_rows.*`),
// where uniform groups of 64 rows (`bench moe`, H100) had run 4-32% faster at 64.
inline void plan_gemm(GemmProblem& P) {
  const QmvProblem& q = P.q;
  const bool ragged = P.group_sizes != nullptr;
  // wgmma copies each tile's scales with 4-byte cp.async: every tile base aligned
  const int ssz = dtype_bytes(q.scale_dt);
  const bool aligned = ((reinterpret_cast<uintptr_t>(q.scales) |
                         reinterpret_cast<uintptr_t>(q.biases)) & 3) == 0 &&
                       (q.N * q.groups * ssz) % 4 == 0;
  P.wgmma = aligned && wgmma_usable();
  // the producer's TMA copies of weights, scales and biases (qmm_wgmma.h, WS): every
  // tile full (N a multiple of 16: the tensor maps count whole tiles) and 16-byte bases
  static const bool producer_off = [] {  // $JAXQUANT_WGMMA_PRODUCER=0: sweeps
    const char* env = getenv("JAXQUANT_WGMMA_PRODUCER");
    return env != nullptr && strcmp(env, "0") == 0;
  }();
  const bool aligned16 = ((reinterpret_cast<uintptr_t>(q.data) |
                           reinterpret_cast<uintptr_t>(q.scales) |
                           reinterpret_cast<uintptr_t>(q.biases)) & 15) == 0 &&
                         q.N % kTileRows == 0;
  static const int forced_bm = env_choice("JAXQUANT_WGMMA_BN", {64, 128, 256});  // sweeps
  const int64_t rows = ragged ? q.M / (q.E > 0 ? q.E : 1) : q.M;  // per matrix (expert)
  P.block_m = !P.wgmma             ? kBlockM
              : forced_bm            ? forced_bm
              : rows <= 64 && !ragged ? 64
              : rows < 256           ? 128
              : ragged               ? 256
                                     : wgmma_rows_per_block(P.tiles, q.S, q.M);
  const int64_t per = (q.M + P.block_m - 1) / P.block_m;
  P.row_blocks = ragged ? per + q.E : q.S * per;
  P.row_tiles = gemm_row_tiles(P.tiles, P.row_blocks);
  P.ksplit = wgmma_ksplit(P);
  // not for ragged_qmm's 64-row blocks: with a few rows an expert the grid is many
  // short blocks, each filling the producer's pipeline from empty, and measured 6-8%
  // slower than the warps' own copies (docs/prefill.md)
  P.producer = P.wgmma && aligned16 && !producer_off && !(ragged && P.block_m == 64);
}

// A GEMM (or the layout's dequantize) over q's weight: its 16-row tiles and 64-k
// chunks; group_sizes for ragged_qmm. The handlers and the sanitizer driver build their
// problems here, then plan_gemm sets the launch.
inline GemmProblem gemm_problem(const QmvProblem& q, const int32_t* group_sizes = nullptr) {
  GemmProblem P{};
  P.q = q;
  P.tiles = (q.N + kTileRows - 1) / kTileRows;
  P.full_tiles = q.N / kTileRows;
  P.chunks = q.K / kChunkK;
  P.group_sizes = group_sizes;
  return P;
}

// ragged_matmul's plan (wgmma_usable() holds), for P with q, chunks and group_sizes
// set: rows of x per item and the most items (ragged_row_block's). The float experts'
// GEMM reads an item's 128 x K weight box once, so items of 128 rows read each weight
// once for a group of up to 128 rows, where 64-row items read it again for each 64 rows
// past the first: while the weights outweigh x, the bytes cost more than the tensor
// cores' padding (gpt-oss-20b's bf16 prefill of 512 tokens on an H200: 158 us a
// product at 128, 194 at 64; benchmarks/h200/model.json `gpt-oss-20b.bf16.prefill512*`).
// Only block_m and row_blocks: the kernel has no K split and always its producer warp.
inline void plan_ragged_matmul(GemmProblem& P) {
  P.block_m = 128;
  P.row_blocks = (P.q.M + P.block_m - 1) / P.block_m + P.q.E;
}

// ragged_matmul's problem, planned: x [T, K] of x_dt, w [E, N, K] of the same dtype,
// y [T, N], group_sizes [E] (K a multiple of 8: the last chunk's k past K read as zeros).
inline GemmProblem ragged_matmul_problem(const void* x, int32_t x_dt, const void* w, void* y,
                                         int64_t T, int64_t K, int64_t E, int64_t N,
                                         const int32_t* group_sizes) {
  GemmProblem P{};
  QmvProblem& q = P.q;
  q.S = q.Sx = q.x_div = 1;
  q.M = T;
  q.K = K;
  q.N = N;
  q.E = E;
  q.x = x;
  q.x_dt = x_dt;
  q.data = static_cast<const uint32_t*>(w);
  q.y = y;
  P.chunks = (K + kChunkK - 1) / kChunkK;
  P.group_sizes = group_sizes;
  plan_ragged_matmul(P);
  return P;
}

inline hipError_t launch_gemm(const GemmProblem& P, hipStream_t stream) {
  if (P.wgmma)
    return P.q.x_dt == kF16 ? launch_qmm_wgmma_f16(P, stream) : launch_qmm_wgmma_bf16(P, stream);
  return P.q.x_dt == kF16 ? launch_qmm_gemm_f16(P, stream) : launch_qmm_gemm_bf16(P, stream);
}

}  // namespace mma
}  // namespace gpu
}  // namespace jq
#endif  // JQ_PLATFORM_CUDA
