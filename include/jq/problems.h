// Plain descriptions of one call of each op, filled in (and validated) by
// include/jq/ffi_common.h and consumed by the CPU and GPU kernels.
#pragma once

#include <stdint.h>

namespace jq {

// dequantize: data [..., N, W] -> out [..., N, K]
struct DequantProblem {
  int32_t fmt, bits, group;
  int64_t rows;    // product of all dims but the last (matrices * N)
  int64_t n;       // rows per matrix (dim -2; 1 for rank-1 data)
  int64_t k;       // elements per row
  int64_t words;   // uint32 words per row (= k * bits / 32)
  int64_t groups;  // groups per row (= k / group)
  const uint32_t* data;
  const void* scales;
  int32_t scale_dt;  // DType of scales (kU8 for E8M0 / E4M3)
  const void* biases;  // affine only
  const float* global_scale;  // nvfp4 only, or nullptr
  int64_t gs_count;           // 1: one scalar; > 1: one per gs_div matrices (vmap)
  int64_t gs_div;
  void* out;
  int32_t out_dt;
};

// Fused dequantize-GEMV over slots (qmm with small M, batched qmm, gather_qmm):
//   y[s, m, n] = sum_k x[s / x_div, m, k] * w[e(s), n, k],  e(s) = indices[s] or s.
// An expert id outside [0, E) gives a NaN row; nothing of qw is read for it.
struct QmvProblem {
  int32_t fmt, bits, group;
  int64_t S, M, N, K, E, Sx, x_div, words, groups;
  const void* x;
  int32_t x_dt;  // output dtype too
  const uint32_t* data;  // [E, N, words]
  const void* scales;    // [E, N, groups]
  int32_t scale_dt;
  const void* biases;
  const float* global_scale;  // nvfp4: nullptr or one scalar
  const int32_t* indices;     // [S] or nullptr (e(s) = s)
  void* y;                    // [S, M, N]
};

enum NormKind : int32_t { kRmsNorm = 0, kAddRmsNorm = 1, kGatedRmsNorm = 2 };
enum Activation : int32_t { kSilu = 0, kSigmoid = 1 };

// rms_norm / add_rms_norm / gated_rms_norm over rows of width d.
struct NormProblem {
  int32_t kind;
  int64_t rows, d;
  const void* x;
  int32_t x_dt;
  const void* r;  // residual (add) or gate (gated)
  int32_t r_dt;
  const void* w;  // weight or nullptr
  int32_t w_dt;
  int64_t w_div;  // row r uses weight row r / w_div (rows: one weight row)
  void* y;
  int32_t y_dt;
  void* h;  // add_rms_norm's h
  int32_t h_dt;
  float eps, offset;
  int32_t activation, norm_before_gate;
  int64_t group;  // gated: normalize within groups of this size (== d: whole row)
};

}  // namespace jq
