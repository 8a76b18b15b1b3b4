// The RMSNorm family: rms_norm (three geometries), add_rms_norm, gated_rms_norm.
// y = x * rsqrt(mean(x^2) + eps) * (weight + weight_offset), statistics in float32.
//
// From the MetalTile RMSNorm kernels (seed), with their dispatch invariants:
// - rms_norm_row4: one threadgroup per row, 4 consecutive elements per thread,
//   threads = n / 4, so n % 128 == 0 (whole simdgroups) and n <= 4096 (1024 threads).
//   Threads past the row (a wrong dispatch) clamp their loads, add 0 and store nothing,
//   and still reach the reduction.
// - rms_norm_head: per-head rows (n = 64, 128, 256: q/k norms): one simdgroup per row,
//   n / 32 consecutive elements per lane, 8 rows per threadgroup, a simd_sum only (no
//   threadgroup memory, no barrier). The seed's small-head kernel ran 2 per thread with
//   one row per threadgroup; at head sizes one simdgroup per row keeps every lane busy.
// - rms_norm_wide / add_rms_norm / gated_rms_norm: any n: threads stride over the row by
//   the threadgroup size, two passes over the row (the values cannot stay in registers
//   for unbounded n). add_rms_norm's second pass re-reads h from its own output; the
//   gated norm's "row" is one group of `group_size` elements (a threadgroup per group).
// The weight is optional (has_weight) and has the dtype of the output.
#include "jq_metal.h"

namespace jq {

constant constexpr uint kHeadRowsPerThreadgroup = 8;

template <typename T>
METAL_FUNC float weight_factor(device const T* w, constant NormParams& p, uint i) {
  return p.has_weight != 0u ? float(w[i]) + p.weight_offset : 1.0f;
}

template <typename T>
kernel void rms_norm_row4(device const T* x [[buffer(0)]],
                          device const T* w [[buffer(1)]],
                          device T* out [[buffer(2)]],
                          constant NormParams& p [[buffer(3)]],
                          JQ_THREAD_IDS) {
  threadgroup float scratch[32];
  const ulong base = ulong(tgid.x) * p.n;
  const uint col = tid * 4u;
  const bool in_bounds = col + 3u < p.n;
  const uint safe_col = in_bounds ? col : 0u;
  const vec<T, 4> xv = *(device const vec<T, 4>*)(x + base + safe_col);
  const float x0 = float(xv[0]), x1 = float(xv[1]), x2 = float(xv[2]), x3 = float(xv[3]);
  const float ssq = in_bounds ? x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3 : 0.0f;
  const float total = threadgroup_sum(ssq, scratch, lane, simd, threads / 32u);
  const float inv = rsqrt(total / float(p.n) + p.eps);
  if (in_bounds) {
    device T* y = out + base + col;
    y[0] = T(x0 * inv * weight_factor(w, p, col));
    y[1] = T(x1 * inv * weight_factor(w, p, col + 1u));
    y[2] = T(x2 * inv * weight_factor(w, p, col + 2u));
    y[3] = T(x3 * inv * weight_factor(w, p, col + 3u));
  }
}

template <typename T>
kernel void rms_norm_head(device const T* x [[buffer(0)]],
                          device const T* w [[buffer(1)]],
                          device T* out [[buffer(2)]],
                          constant NormParams& p [[buffer(3)]],
                          JQ_THREAD_IDS) {
  const uint row = tgid.x * kHeadRowsPerThreadgroup + simd;
  if (row >= p.rows) return;  // the whole simdgroup leaves together
  const uint per_lane = p.n / 32u;  // 2, 4 or 8
  const ulong base = ulong(row) * p.n + lane * per_lane;
  float v[8];
  float ssq = 0.0f;
  for (uint i = 0; i < per_lane; ++i) {
    v[i] = float(x[base + i]);
    ssq += v[i] * v[i];
  }
  const float inv = rsqrt(simd_sum(ssq) / float(p.n) + p.eps);
  for (uint i = 0; i < per_lane; ++i) {
    out[base + i] = T(v[i] * inv * weight_factor(w, p, lane * per_lane + i));
  }
}

template <typename T>
kernel void rms_norm_wide(device const T* x [[buffer(0)]],
                          device const T* w [[buffer(1)]],
                          device T* out [[buffer(2)]],
                          constant NormParams& p [[buffer(3)]],
                          JQ_THREAD_IDS) {
  threadgroup float scratch[32];
  const ulong base = ulong(tgid.x) * p.n;
  float ssq = 0.0f;
  for (uint i = tid; i < p.n; i += threads) {
    const float v = float(x[base + i]);
    ssq += v * v;
  }
  const float inv = rsqrt(threadgroup_sum(ssq, scratch, lane, simd, threads / 32u) / float(p.n) + p.eps);
  for (uint i = tid; i < p.n; i += threads) {
    out[base + i] = T(float(x[base + i]) * inv * weight_factor(w, p, i));
  }
}

// h = (x + residual) rounded to the residual's dtype; y = rms_norm(h) in that dtype.
template <typename TX, typename TR>
kernel void add_rms_norm(device const TX* x [[buffer(0)]],
                         device const TR* residual [[buffer(1)]],
                         device const TR* w [[buffer(2)]],
                         device TR* out [[buffer(3)]],
                         device TR* h_out [[buffer(4)]],
                         constant NormParams& p [[buffer(5)]],
                         JQ_THREAD_IDS) {
  threadgroup float scratch[32];
  const ulong base = ulong(tgid.x) * p.n;
  float ssq = 0.0f;
  for (uint i = tid; i < p.n; i += threads) {
    const TR h = TR(float(x[base + i]) + float(residual[base + i]));
    h_out[base + i] = h;
    ssq += float(h) * float(h);
  }
  const float inv = rsqrt(threadgroup_sum(ssq, scratch, lane, simd, threads / 32u) / float(p.n) + p.eps);
  for (uint i = tid; i < p.n; i += threads) {  // the same thread wrote h_out[base + i]
    out[base + i] = TR(float(h_out[base + i]) * inv * weight_factor(w, p, i));
  }
}

METAL_FUNC float activate(float g, uint activation) {
  const float s = 1.0f / (1.0f + exp(-g));
  return activation == 0u ? g * s : s;
}

// One threadgroup per group of p.n elements (the whole row when group_size is None).
// norm_before_gate: rms_norm(x) * w * act(gate); else rms_norm(x * act(gate)) * w.
template <typename TX, typename TG>
kernel void gated_rms_norm(device const TX* x [[buffer(0)]],
                           device const TG* gate [[buffer(1)]],
                           device const TG* w [[buffer(2)]],
                           device TG* out [[buffer(3)]],
                           constant NormParams& p [[buffer(4)]],
                           JQ_THREAD_IDS) {
  threadgroup float scratch[32];
  const ulong base = ulong(tgid.x) * p.n;
  const uint w_base = uint(base % p.weight_period);
  float ssq = 0.0f;
  for (uint i = tid; i < p.n; i += threads) {
    float v = float(x[base + i]);
    if (p.norm_before_gate == 0u) v *= activate(float(gate[base + i]), p.activation);
    ssq += v * v;
  }
  const float inv = rsqrt(threadgroup_sum(ssq, scratch, lane, simd, threads / 32u) / float(p.n) + p.eps);
  for (uint i = tid; i < p.n; i += threads) {
    const float a = activate(float(gate[base + i]), p.activation);
    const float wf = weight_factor(w, p, w_base + i);
    const float xv = float(x[base + i]);
    out[base + i] = TG(p.norm_before_gate != 0u ? xv * inv * wf * a : xv * a * inv * wf);
  }
}

#define JQ_NORM1(T, tname)                                          \
  JQ_KERNEL("jq_rms_norm_row4_" tname, rms_norm_row4<T>)            \
  JQ_KERNEL("jq_rms_norm_head_" tname, rms_norm_head<T>)            \
  JQ_KERNEL("jq_rms_norm_wide_" tname, rms_norm_wide<T>)
JQ_NORM1(float, "float32")
JQ_NORM1(half, "float16")
JQ_NORM1(bfloat, "bfloat16")

#define JQ_NORM2(TA, aname, TB, bname)                                          \
  JQ_KERNEL("jq_add_rms_norm_" aname "_" bname, add_rms_norm<TA, TB>)           \
  JQ_KERNEL("jq_gated_rms_norm_" aname "_" bname, gated_rms_norm<TA, TB>)
#define JQ_NORM2_ALL(TA, aname)                 \
  JQ_NORM2(TA, aname, float, "float32")         \
  JQ_NORM2(TA, aname, half, "float16")          \
  JQ_NORM2(TA, aname, bfloat, "bfloat16")
JQ_NORM2_ALL(float, "float32")
JQ_NORM2_ALL(half, "float16")
JQ_NORM2_ALL(bfloat, "bfloat16")

}  // namespace jq
