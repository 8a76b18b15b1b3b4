// rms_norm, add_rms_norm, gated_rms_norm on the GPU, for any row width.
//
// The statistics run over "segments": a row (rms, add) or a group of a row
// (gated with group_size). Segments up to 1024 wide get one warp each (per-head
// rows of 64/128/256 pack several per block); wider ones one block each
// (e.g. 5376). Two passes over the segment: the mean of squares in float32
// (lane-strided, then a shuffle butterfly, then across warps), then the
// normalized values. add_rms_norm writes h in the residual's dtype in pass
// one and normalizes the rounded h.
#include "gpu_common.h"

namespace jq {
namespace gpu {

__device__ __forceinline__ float activation(float g, int32_t a) {
  const float sig = 1.0f / (1.0f + jq_exp(-g));
  return a == kSilu ? g * sig : sig;
}

__device__ __forceinline__ float ld(const void* p, int64_t i, int32_t dt) {
  switch (dt) {
    case kF32: return static_cast<const float*>(p)[i];
    case kBF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return jq_h2f(static_cast<const uint16_t*>(p)[i]);
  }
}

__device__ __forceinline__ float round_to(float v, int32_t dt) {
  switch (dt) {
    case kF32: return v;
    case kBF16: return bf16_to_f32(f32_to_bf16(v));
    default: return jq_h2f(jq_f2h(v));
  }
}

// The value that is normalized: x, round(x + residual), or x * act(gate).
__device__ __forceinline__ float pre(const NormProblem& p, int64_t i) {
  const float x = ld(p.x, i, p.x_dt);
  if (p.kind == kAddRmsNorm) return round_to(x + ld(p.r, i, p.r_dt), p.h_dt);
  if (p.kind == kGatedRmsNorm && !p.norm_before_gate) return x * activation(ld(p.r, i, p.r_dt), p.activation);
  return x;
}

template <bool WARP_PER_SEGMENT>
__global__ void __launch_bounds__(1024) norm_kernel(NormProblem p, int64_t seg_len,
                                                   int64_t segments) {
  constexpr int W = JQ_WARP;
  __shared__ float partial[1024 / 32];
  const int lane = (int)(threadIdx.x % W), warp = (int)(threadIdx.x / W);
  const int64_t segs_per_row = p.d / seg_len;
  const int64_t per_block = WARP_PER_SEGMENT ? blockDim.x / W : 1;
  const int stride = WARP_PER_SEGMENT ? W : (int)blockDim.x;
  const int tid = WARP_PER_SEGMENT ? lane : (int)threadIdx.x;
  for (int64_t base = (int64_t)blockIdx.x * per_block; base < segments;
       base += (int64_t)gridDim.x * per_block) {
    const int64_t seg = base + (WARP_PER_SEGMENT ? warp : 0);
    const bool active = seg < segments;
    const int64_t row = active ? seg / segs_per_row : 0;
    const int64_t off = row * p.d + (active ? (seg % segs_per_row) * seg_len : 0);
    float ss = 0.0f;
    if (active) {
      for (int64_t i = tid; i < seg_len; i += stride) {
        const float v = pre(p, off + i);
        if (p.kind == kAddRmsNorm) store_out(p.h, off + i, p.h_dt, v);
        ss = fmaf(v, v, ss);
      }
    }
    ss = warp_sum(ss);
    if (!WARP_PER_SEGMENT) {
      if (lane == 0) partial[warp] = ss;
      __syncthreads();
      ss = 0.0f;
      for (int i = 0; i < (int)(blockDim.x / W); ++i) ss += partial[i];
      __syncthreads();
    }
    if (!active) continue;
    const float inv = jq_rsqrt(ss / (float)seg_len + p.eps);
    const int64_t wrow = row / p.w_div;
    const int64_t woff = (off - row * p.d);
    for (int64_t i = tid; i < seg_len; i += stride) {
      float y = pre(p, off + i) * inv;
      if (p.w) y = y * (ld(p.w, wrow * p.d + woff + i, p.w_dt) + p.offset);
      if (p.kind == kGatedRmsNorm && p.norm_before_gate)
        y = y * activation(ld(p.r, off + i, p.r_dt), p.activation);
      store_out(p.y, off + i, p.y_dt, y);
    }
  }
}

hipError_t launch_norm(const NormProblem& p, hipStream_t stream) {
  const int64_t seg_len = p.kind == kGatedRmsNorm ? p.group : p.d;
  const int64_t segments = p.rows * (p.d / seg_len);
  const int warp = jq_device_warp_size();
  const int64_t cap = (int64_t)jq_device_sm_count() * 64;
  if (seg_len <= 1024) {
    const int threads = 256;
    const int64_t per_block = threads / warp;
    int64_t blocks = (segments + per_block - 1) / per_block;
    blocks = blocks < 1 ? 1 : (blocks > cap ? cap : blocks);
    norm_kernel<true><<<dim3((unsigned)blocks), dim3(threads), 0, stream>>>(p, seg_len, segments);
  } else {
    const int threads = 1024;
    int64_t blocks = segments < cap ? segments : cap;
    blocks = blocks < 1 ? 1 : blocks;
    norm_kernel<false><<<dim3((unsigned)blocks), dim3(threads), 0, stream>>>(p, seg_len, segments);
  }
  return hipGetLastError();
}

}  // namespace gpu
}  // namespace jq
