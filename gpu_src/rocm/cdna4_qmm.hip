// qmm on CDNA4 (gfx950) for MXFP4 weights in the `cdna4` layout
// (jaxquant/layouts/cdna4.py; docs/cdna4.md): y = x @ w.T with the scaled
// matrix instruction v_mfma_scale_f32_16x16x128_f8f6f4, which multiplies an
// E4M3 operand by an E2M1 operand, each with its own E8M0 scale per 32 K
// elements, and accumulates in float32.
//
// x (bfloat16/float16) is not an MFMA operand type: jaxquant/ffi/cdna4.py splits
// it, per 32-element block, into T E4M3 terms sharing one E8M0 scale
// (x = 2^s * (t0 + t1 + ...)); bfloat16 needs T = 2 and float16 T = 3 for the
// sum to hold each element exactly (down to 2^-17 of its block's largest
// magnitude). The kernel runs one MFMA per term and sums them in the float32
// accumulator, so the weight is read once and x's split costs MFMA issue
// slots only (the instruction is far from the bound on a memory-bound GEMV).
//
// Work: a workgroup owns 32 rows of N (two 16-row MFMA tiles: one preshuffled
// scale block) and one 16-row tile of M; its W waves (waves_per_pair) split K
// in steps of 256 (two MFMA K steps: one 32-bit scale word per lane holds its
// 2 tiles x 2 steps of weight scales, op_sel picks the byte) and add their
// partial sums through LDS in wave order. Every address comes from
// include/jq/cdna4_layout.h, which tests/test_cdna4_kernel.py checks on the CPU
// against the Python layout.
//
// An E8M0 weight scale 0xFF (NaN) makes the reference's whole block NaN; the
// kernel does not rely on the instruction's handling of it: it flags the row
// and writes NaN for its column.
#include <stdint.h>
#include <string.h>

#include <mutex>
#include <string>

#include "jq_hip.h"  // first: the runtime's headers
#include "jq/cdna4_layout.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jq {
namespace cdna4 {

constexpr int kMaxTerms = 3;

#if defined(__HIP_DEVICE_COMPILE__) && defined(__gfx950__)
#define JQ_CDNA4_KERNEL_BODY 1
typedef int v8i __attribute__((ext_vector_type(8)));
typedef float v4f __attribute__((ext_vector_type(4)));

__device__ __forceinline__ uint4 load16(const uint8_t* p) {
  return *reinterpret_cast<const uint4*>(p);
}
__device__ __forceinline__ uint2 load8(const uint8_t* p) {
  return *reinterpret_cast<const uint2*>(p);
}

// The weight operand: 16 bytes in the low half of the 256-bit register (E2M1
// reads 128 bits).
__device__ __forceinline__ v8i b_operand(uint4 v) {
  v8i r = {0, 0, 0, 0, 0, 0, 0, 0};
  r[0] = (int)v.x;
  r[1] = (int)v.y;
  r[2] = (int)v.z;
  r[3] = (int)v.w;
  return r;
}

// A (x term): register chunk c (bytes 8c..8c+7) from x_lane_offset(.., c, ..).
__device__ __forceinline__ v8i a_operand(const uint8_t* xt, int64_t m_tile, int64_t k_step,
                                         int lane, int term, int64_t x_rows, int64_t k) {
  v8i r;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const uint2 v = load8(xt + x_lane_offset(term, m_tile, k_step, lane, c, x_rows, k));
    r[2 * c] = (int)v.x;
    r[2 * c + 1] = (int)v.y;
  }
  return r;
}

// One K step (s = 0, 1 of the pair) for both N tiles: A is E4M3 (cbsz 0), B is
// E2M1 (blgp 4); x's scale sits in byte 0 of its register (op_sel_a 0), the
// weight's in byte scale_byte(t, s) of the shared word.
template <int S, int TERMS>
__device__ __forceinline__ void k_step(v4f& acc0, v4f& acc1, const uint8_t* xt,
                                       const uint8_t* xsb, int64_t m_tile, int64_t kp, int lane,
                                       int64_t x_rows, int64_t k, int64_t k_scales, uint4 w0,
                                       uint4 w1, uint32_t wscale) {
  const int64_t step = 2 * kp + S;
  const int xscale = xsb[x_scale_offset(m_tile, step, lane, k_scales)];
  const v8i b0 = b_operand(w0), b1 = b_operand(w1);
#pragma unroll
  for (int term = 0; term < TERMS; ++term) {
    const v8i a = a_operand(xt, m_tile, step, lane, term, x_rows, k);
    acc0 = __builtin_amdgcn_mfma_scale_f32_16x16x128_f8f6f4(
        a, b0, acc0, 0, 4, 0, xscale, scale_byte(0, S), (int)wscale);
    acc1 = __builtin_amdgcn_mfma_scale_f32_16x16x128_f8f6f4(
        a, b1, acc1, 0, 4, 0, xscale, scale_byte(1, S), (int)wscale);
  }
}

__device__ __forceinline__ uint16_t f32_to_bf16_rne(float f) {
  uint32_t u = __builtin_bit_cast(uint32_t, f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
#endif  // gfx950 device pass

// xq uint8 [B, T, Mp, K] (E4M3 terms), xs uint8 [B, Mp, K/32] (E8M0),
// w uint8 [B, N, K/2] (cdna4 bytes), ws uint8 [B, Np, K/32] (cdna4 scales),
// y [B, M, N] (bfloat16 when OUT_BF16, else float16).
template <int TERMS, bool OUT_BF16>
__global__ __launch_bounds__(kWave* kMaxWavesPerPair) void qmm_kernel(
    const uint8_t* __restrict__ xq, const uint8_t* __restrict__ xs,
    const uint8_t* __restrict__ w, const uint8_t* __restrict__ ws, uint16_t* __restrict__ y,
    int64_t M, int64_t Mp, int64_t N, int64_t K) {
#if defined(JQ_CDNA4_KERNEL_BODY)
  __shared__ float partial[kMaxWavesPerPair][2][4][kWave];
  __shared__ int partial_flags[kMaxWavesPerPair][kWave];
  const int lane = (int)(threadIdx.x & (kWave - 1));
  const int wave = (int)(threadIdx.x / kWave), waves = (int)(blockDim.x / kWave);
  const int64_t n_pair = blockIdx.x, m_tile = blockIdx.y, b = blockIdx.z;
  const int64_t k_bytes = K / 2, k_scales = K / 32;
  const int64_t n_padded = (N + kScaleBlockRows - 1) / kScaleBlockRows * kScaleBlockRows;
  const uint8_t* wb = w + b * N * k_bytes;
  const uint8_t* wsb = ws + b * n_padded * k_scales;
  const uint8_t* xt = xq + b * TERMS * Mp * K;
  const uint8_t* xsb = xs + b * Mp * k_scales;
  // N % 16 == 0: the pair's second tile exists unless N ends half way through it
  // (its scales are the layout's zero padding; its weight is not read).
  const bool second = n_pair * kScaleBlockRows + kTileRows < N;
  const int64_t t0 = 2 * n_pair, t1 = 2 * n_pair + 1;
  v4f acc0 = {0.f, 0.f, 0.f, 0.f}, acc1 = {0.f, 0.f, 0.f, 0.f};
  bool nan0 = false, nan1 = false;
  const uint4 zero = {0u, 0u, 0u, 0u};
  for (int64_t kp = wave; kp < K / kPairK; kp += waves) {
    const uint32_t wscale =
        *reinterpret_cast<const uint32_t*>(wsb + scale_lane_offset(n_pair, kp, lane, k_scales));
    const uint4 w00 = load16(wb + b_lane_offset(t0, 2 * kp, lane, k_bytes));
    const uint4 w01 = load16(wb + b_lane_offset(t0, 2 * kp + 1, lane, k_bytes));
    const uint4 w10 = second ? load16(wb + b_lane_offset(t1, 2 * kp, lane, k_bytes)) : zero;
    const uint4 w11 = second ? load16(wb + b_lane_offset(t1, 2 * kp + 1, lane, k_bytes)) : zero;
    nan0 |= scale_is_nan(wscale, scale_byte(0, 0)) | scale_is_nan(wscale, scale_byte(0, 1));
    nan1 |= scale_is_nan(wscale, scale_byte(1, 0)) | scale_is_nan(wscale, scale_byte(1, 1));
    k_step<0, TERMS>(acc0, acc1, xt, xsb, m_tile, kp, lane, Mp, K, k_scales, w00, w10, wscale);
    k_step<1, TERMS>(acc0, acc1, xt, xsb, m_tile, kp, lane, Mp, K, k_scales, w01, w11, wscale);
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    partial[wave][0][r][lane] = acc0[r];
    partial[wave][1][r][lane] = acc1[r];
  }
  partial_flags[wave][lane] = (nan0 ? 1 : 0) | (nan1 ? 2 : 0);
  __syncthreads();
  if (wave != 0) return;
  // A NaN scale anywhere in a row of w: that column is NaN. The 4 lanes of a
  // column (same lane_row) each saw a quarter of its scales.
  int flags = 0;
  for (int v = 0; v < waves; ++v) flags |= partial_flags[v][lane];
  flags |= jq_shfl_xor(flags, 16);
  flags |= jq_shfl_xor(flags, 32);
  const float qnan = __builtin_nanf("");
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const int64_t col = out_col(t == 0 ? t0 : t1, lane);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int64_t row = out_row(m_tile, lane, r);
      if (row >= M || col >= N) continue;
      float v = partial[0][t][r][lane];
      for (int u = 1; u < waves; ++u) v += partial[u][t][r][lane];
      if ((flags >> t) & 1) v = qnan;
      y[(b * M + row) * N + col] = OUT_BF16 ? f32_to_bf16_rne(v)
                                            : __builtin_bit_cast(uint16_t, (_Float16)v);
    }
  }
#else
  (void)xq, (void)xs, (void)w, (void)ws, (void)y, (void)M, (void)Mp, (void)N, (void)K;
#endif
}

// ---------------------------------------------------------------------------
// Host: the FFI handler (validation, the device check, the launch).

namespace {

bool device_is_gfx950(std::string* arch) {
  static std::mutex mu;
  static std::string names[64];
  int dev = 0;
  if (hipGetDevice(&dev) != hipSuccess || dev < 0 || dev >= 64) dev = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (names[dev].empty()) {
    hipDeviceProp_t prop;
    names[dev] = hipGetDeviceProperties(&prop, dev) == hipSuccess ? std::string(prop.gcnArchName)
                                                                 : std::string("unknown");
  }
  *arch = names[dev];
  return names[dev].rfind("gfx950", 0) == 0;
}

std::string dims(ffi::AnyBuffer::Dimensions d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + (d.size() == 1 ? ",)" : ")");
}

ffi::Error bad(const std::string& what) {
  return ffi::Error::InvalidArgument("jaxquant ffi cdna4_qmm: " + what);
}

template <int TERMS, bool BF16>
hipError_t launch(const uint8_t* xq, const uint8_t* xs, const uint8_t* w, const uint8_t* ws,
                  uint16_t* y, int64_t B, int64_t M, int64_t Mp, int64_t N, int64_t K,
                  hipStream_t stream) {
  const int64_t pairs = (N + kScaleBlockRows - 1) / kScaleBlockRows;
  const dim3 grid((unsigned)pairs, (unsigned)(Mp / kTileRows), (unsigned)B);
  qmm_kernel<TERMS, BF16><<<grid, dim3(kWave * waves_per_pair(K)), 0, stream>>>(xq, xs, w, ws,
                                                                                y, M, Mp, N, K);
  return hipGetLastError();
}

}  // namespace

// jaxquant_cdna4_qmm (bound in gpu_src/common/gpu_ffi.hip).
ffi::Error qmm_impl(hipStream_t stream, ffi::AnyBuffer xq, ffi::AnyBuffer xs, ffi::AnyBuffer w,
                    ffi::AnyBuffer ws, ffi::Result<ffi::AnyBuffer> y) {
  using DT = ffi::DataType;
  const auto xd = xq.dimensions(), sd = xs.dimensions(), wd = w.dimensions(),
             wsd = ws.dimensions(), yd = y->dimensions();
  if (xq.element_type() != DT::U8 || xd.size() != 4)
    return bad("x terms must be uint8 [B, T, Mp, K]; got " + dims(xd));
  const int64_t B = xd[0], T = xd[1], Mp = xd[2], K = xd[3];
  if (T < 1 || T > kMaxTerms) return bad("x must have 1 to 3 E4M3 terms; got " + std::to_string(T));
  if (K <= 0 || K % kPairK || Mp % kTileRows)
    return bad("x terms " + dims(xd) + ": K must be a positive multiple of 256 and Mp of 16");
  if (xs.element_type() != DT::U8 || sd.size() != 3 || sd[0] != B || sd[1] != Mp || sd[2] != K / 32)
    return bad("x scales must be uint8 [B, Mp, K/32] = (" + std::to_string(B) + ", " +
               std::to_string(Mp) + ", " + std::to_string(K / 32) + "); got " + dims(sd));
  if (w.element_type() != DT::U32 || wd.size() != 3 || wd[0] != B || wd[2] * 8 != K ||
      wd[1] % kTileRows)
    return bad("w must be uint32 [B, N, K/8] with N % 16 == 0 (B=" + std::to_string(B) +
               ", K=" + std::to_string(K) + "); got " + dims(wd));
  const int64_t N = wd[1], Np = (N + 31) / 32 * 32;
  if (ws.element_type() != DT::U8 || wsd.size() != 3 || wsd[0] != B || wsd[1] != Np ||
      wsd[2] != K / 32)
    return bad("w scales must be uint8 [B, Np, K/32] = (" + std::to_string(B) + ", " +
               std::to_string(Np) + ", " + std::to_string(K / 32) + "); got " + dims(wsd));
  const DT yt = y->element_type();
  if ((yt != DT::BF16 && yt != DT::F16) || yd.size() != 3 || yd[0] != B || yd[2] != N ||
      yd[1] > Mp || (yd[1] + kTileRows - 1) / kTileRows * kTileRows != Mp)
    return bad("y must be bfloat16/float16 [B, M, N] with Mp = M rounded up to 16; got " +
               dims(yd) + " for Mp=" + std::to_string(Mp) + ", N=" + std::to_string(N));
  const int64_t M = yd[1];
  if (B > 65535 || Mp / kTileRows > 65535 || (N + 31) / 32 > INT32_MAX)
    return bad("more than 65535 matrices or 16-row tiles of x, or 2^31 pairs of rows of w");
  if (B == 0 || M == 0 || N == 0) return ffi::Error::Success();
  std::string arch;
  if (!device_is_gfx950(&arch))
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "jaxquant ffi cdna4_qmm: the cdna4 kernel runs on gfx950 only; this "
                      "device is " + arch + " (jq.unpack_layout the weight)");
  auto* xq_p = static_cast<const uint8_t*>(xq.untyped_data());
  auto* xs_p = static_cast<const uint8_t*>(xs.untyped_data());
  auto* w_p = static_cast<const uint8_t*>(w.untyped_data());
  auto* ws_p = static_cast<const uint8_t*>(ws.untyped_data());
  auto* y_p = static_cast<uint16_t*>(y->untyped_data());
  const bool bf16 = yt == DT::BF16;
  hipError_t err;
  switch (T * 2 + (bf16 ? 1 : 0)) {
#define JQ_CDNA4_CASE(TT, BB)                                                            \
  case TT * 2 + BB:                                                                      \
    err = launch<TT, BB>(xq_p, xs_p, w_p, ws_p, y_p, B, M, Mp, N, K, stream);            \
    break;
    JQ_CDNA4_CASE(1, 0)
    JQ_CDNA4_CASE(1, 1)
    JQ_CDNA4_CASE(2, 0)
    JQ_CDNA4_CASE(2, 1)
    JQ_CDNA4_CASE(3, 0)
    JQ_CDNA4_CASE(3, 1)
#undef JQ_CDNA4_CASE
    default: return bad("unreachable term count");
  }
  if (err != hipSuccess)
    return ffi::Error::Internal(std::string("jaxquant ffi: launching the cdna4 qmm kernel "
                                            "failed: ") + hipGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace cdna4
}  // namespace jq

// The handler symbol jq_gpu_cdna4_qmm is defined with the ROCm library's other targets
// (gpu_src/common/gpu_ffi.hip: RocmHandlers, JQ_GPU_TARGETS).
