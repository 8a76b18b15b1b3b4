// Which Metal kernel runs a call, on what grid: shared by the bridge (metal_ffi.mm) and
// the CPU shim's tests, so the geometry the tests run is the one a Mac dispatches.
// Plain C++17, no Metal.
#pragma once
#include <cstdint>
#include <string>

#include "jq_params.h"

namespace jq_metal {

// Rows of x per slot that the GEMV takes; more go to the GEMM.
constexpr uint32_t kGemvMaxM = 8;
// Geometry constants of the kernels (docs/metal.md has the table).
constexpr uint32_t kQmvRowsPerThreadgroup = 4;  // gemv.metal kQmvRows
constexpr uint32_t kQmmTile = 32;               // qmm.metal kTile
constexpr uint32_t kHeadRowsPerThreadgroup = 8; // norms.metal
constexpr uint32_t kDequantThreads = 256;

struct Plan {
  std::string kernel;  // the Metal host name
  uint32_t grid[3];    // threadgroups
  uint32_t threads;    // threads per threadgroup
};

inline uint32_t ceil_div(uint64_t a, uint64_t b) { return uint32_t((a + b - 1) / b); }

// format: "affine4", "mxfp4", "fp4"; dtype: "float32", "float16", "bfloat16".
inline Plan plan_qmv(const std::string& format, const std::string& dtype, const JqQmmParams& p) {
  return {"jq_qmv_" + format + "_" + dtype, {ceil_div(p.n, kQmvRowsPerThreadgroup), p.slots, 1},
          32 * kQmvRowsPerThreadgroup};
}

// nax: the MPP tensor-op kernel (qmm_nax.metal) where the device has it.
inline Plan plan_qmm(const std::string& format, const std::string& dtype, const JqQmmParams& p, bool nax) {
  return {std::string(nax ? "jq_qmm_nax_" : "jq_qmm_") + format + "_" + dtype,
          {ceil_div(p.n, kQmmTile), ceil_div(p.m, kQmmTile), p.slots}, 128};
}

inline Plan plan_dequantize(const std::string& format, const std::string& dtype, const JqDequantParams& p) {
  return {"jq_dequantize_" + format + "_" + dtype,
          {ceil_div(uint64_t(p.rows) * (p.k / 8), kDequantThreads), 1, 1}, kDequantThreads};
}

// Threads for the strided ("any width") norms: about 4 elements per thread, whole
// simdgroups, at most 1024.
inline uint32_t strided_threads(uint32_t n) {
  uint32_t t = ceil_div(ceil_div(n, 4), 32) * 32;
  return t < 32 ? 32 : (t > 1024 ? 1024 : t);
}

inline Plan plan_rms_norm(const std::string& dtype, const JqNormParams& p) {
  if (p.n == 64 || p.n == 128 || p.n == 256) {
    return {"jq_rms_norm_head_" + dtype, {ceil_div(p.rows, kHeadRowsPerThreadgroup), 1, 1},
            32 * kHeadRowsPerThreadgroup};
  }
  if (p.n % 128 == 0 && p.n <= 4096) {
    return {"jq_rms_norm_row4_" + dtype, {p.rows, 1, 1}, p.n / 4};
  }
  return {"jq_rms_norm_wide_" + dtype, {p.rows, 1, 1}, strided_threads(p.n)};
}

inline Plan plan_add_rms_norm(const std::string& x_dtype, const std::string& r_dtype, const JqNormParams& p) {
  return {"jq_add_rms_norm_" + x_dtype + "_" + r_dtype, {p.rows, 1, 1}, strided_threads(p.n)};
}

// p.rows counts groups (rows x groups per row), p.n is the group size.
inline Plan plan_gated_rms_norm(const std::string& x_dtype, const std::string& g_dtype, const JqNormParams& p) {
  return {"jq_gated_rms_norm_" + x_dtype + "_" + g_dtype, {p.rows, 1, 1}, strided_threads(p.n)};
}

}  // namespace jq_metal
