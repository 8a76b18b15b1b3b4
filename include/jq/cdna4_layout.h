// The CDNA4 (gfx950) MXFP4 GEMM's address arithmetic: where each lane of a
// wave finds the operands of v_mfma_scale_f32_16x16x128_f8f6f4 in the
// preshuffled weight (jaxquant/layouts/cdna4.py), the preshuffled E8M0 scales
// and the MXFP8-split activations, and where it writes its results.
//
// One header for the GPU kernel (gpu_src/rocm/cdna4_qmm.hip) and for the CPU
// address-walk test (tests/cdna4_walk.cc, built by tests/test_cdna4_kernel.py),
// which checks every (lane, register byte, K step, tile) against the bytes the
// Python layout put there. Plain integer functions: no runtime headers needed.
//
// The instruction's operand semantics (CDNA4 ISA, 16x16x128, wave64), which
// these addresses are built to satisfy; lane l = r16 + 16*g (r16 < 16, g < 4):
//   E2M1 operand (B here: the weight, blgp=4): register byte b (0..15), nibble
//     h (low first) is row r16 (of N), K element 32*g + 2*b + h. Bytes 16..31
//     of the 256-bit operand are ignored.
//   E4M3 operand (A here: x, cbsz=0): register byte b (0..31) is row r16 (of M),
//     K element 8*g + 32*(b/8) + b%8.
//   scale operand: the byte op_sel picks from the lane's 32-bit register is the
//     E8M0 scale of row r16, K block g (elements 32*g .. 32*g+31).
//   result: register r (0..3) is D[row 4*g + r (of M)][column r16 (of N)].
#pragma once

#include <stdint.h>

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)
#define JQ_CDNA4_HD __host__ __device__ __forceinline__
#else
#define JQ_CDNA4_HD inline
#endif

namespace jq {
namespace cdna4 {

constexpr int kWave = 64;
constexpr int kTileRows = 16;      // rows of one MFMA operand (N for B, M for A)
constexpr int kStepK = 128;        // K elements per MFMA
constexpr int kStepBytes = 64;     // E2M1 bytes of one row per MFMA
constexpr int kTileBytes = 1024;   // one 16-row x 64-byte B tile
constexpr int kLaneBytes = 16;     // E2M1 bytes per lane per MFMA
constexpr int kScaleBlockRows = 32;    // rows of one scale block (2 N tiles)
constexpr int kScaleBlockK = 8;        // scales per row of one scale block (2 K steps)
constexpr int kScaleBlockBytes = 256;
constexpr int kPairK = 256;        // K elements of one scale block: the kernel's K loop step

// Kernel choice (one place, as data): the waves of a workgroup share one 32-row
// pair of N and split its K pairs round-robin (wave w takes K pairs w, w + W, ...),
// then add their partial sums in wave order. More waves keep more loads in flight
// per pair, which a GEMV (few pairs, long K) needs; at most 8 (512 threads).
constexpr int kMaxWavesPerPair = 8;
JQ_CDNA4_HD int waves_per_pair(int64_t k) {
  const int64_t pairs = k / kPairK;
  return pairs >= 8 ? 8 : pairs >= 4 ? 4 : pairs >= 2 ? 2 : 1;
}

JQ_CDNA4_HD int lane_row(int lane) { return lane & 15; }   // r16
JQ_CDNA4_HD int lane_group(int lane) { return lane >> 4; } // g

// --- B: the preshuffled E2M1 weight of one [N, K] matrix ---------------------
// Byte offset, within the matrix, of the 16 bytes lane `lane` feeds to the MFMA
// for N tile `n_tile` (rows 16*n_tile ..) and K step `k_step` (elements
// 128*k_step ..). k_bytes = K/2.
JQ_CDNA4_HD int64_t b_lane_offset(int64_t n_tile, int64_t k_step, int lane, int64_t k_bytes) {
  return n_tile * (k_bytes / kStepBytes) * kTileBytes + k_step * kTileBytes +
         (int64_t)kLaneBytes * lane;
}

// --- scales: the preshuffled E8M0 scales of one matrix (rows padded to 32) ---
// Byte offset of the 32-bit word lane `lane` loads for scale block (n_pair,
// k_pair): rows 32*n_pair .., K elements 256*k_pair ... k_scales = K/32.
JQ_CDNA4_HD int64_t scale_lane_offset(int64_t n_pair, int64_t k_pair, int lane,
                                      int64_t k_scales) {
  return n_pair * (k_scales / kScaleBlockK) * kScaleBlockBytes + k_pair * kScaleBlockBytes +
         4 * lane;
}
// The byte of that word (the MFMA's op_sel_b) holding the scale for N tile
// `t` (0, 1: rows +0 / +16 of the pair) and K step `s` (0, 1) of the pair.
JQ_CDNA4_HD constexpr int scale_byte(int t, int s) { return t + 2 * s; }

// --- A: x split into MXFP8 terms, uint8 [T, Mp, K] (Mp = M padded to 16) ------
// Byte offset of the 8 E4M3 bytes of register chunk `chunk` (0..3: register
// bytes 8*chunk ..) of lane `lane` for M tile `m_tile`, K step `k_step`, term
// `term`. Row-major [T, Mp, K] in the caller's layout: x_rows = Mp, k = K.
JQ_CDNA4_HD int64_t x_lane_offset(int64_t term, int64_t m_tile, int64_t k_step, int lane,
                                  int chunk, int64_t x_rows, int64_t k) {
  const int64_t row = m_tile * kTileRows + lane_row(lane);
  return (term * x_rows + row) * k + k_step * kStepK + 8 * lane_group(lane) + 32 * chunk;
}
// Byte offset of lane `lane`'s E8M0 scale of x for M tile `m_tile`, K step
// `k_step`: uint8 [Mp, K/32] row-major.
JQ_CDNA4_HD int64_t x_scale_offset(int64_t m_tile, int64_t k_step, int lane, int64_t k_scales) {
  const int64_t row = m_tile * kTileRows + lane_row(lane);
  return row * k_scales + k_step * (kStepK / 32) + lane_group(lane);
}

// --- result ------------------------------------------------------------------
// Row (of M) and column (of N) of result register `r` of lane `lane`, for the
// tile at (m_tile, n_tile).
JQ_CDNA4_HD int64_t out_row(int64_t m_tile, int lane, int r) {
  return m_tile * kTileRows + 4 * lane_group(lane) + r;
}
JQ_CDNA4_HD int64_t out_col(int64_t n_tile, int lane) {
  return n_tile * kTileRows + lane_row(lane);
}

// Whether byte `byte` of a 32-bit word is 0xFF (an E8M0 NaN scale).
JQ_CDNA4_HD bool scale_is_nan(uint32_t word, int byte) {
  return ((word >> (8 * byte)) & 0xffu) == 0xffu;
}

}  // namespace cdna4
}  // namespace jq
