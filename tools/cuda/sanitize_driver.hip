// A standalone driver of the gpu_src/ kernels (no JAX), for compute-sanitizer:
//   nvcc -x cu -std=c++17 -Iinclude -Igpu_src/common -Igpu_src/cuda tools/cuda/sanitize_driver.hip \
//        -L<lib dir> -ljaxquant_cuda -o sanitize_driver
//   compute-sanitizer --tool memcheck --error-exitcode 9 ./sanitize_driver
// It launches every kernel family on odd shapes (N not a multiple of the rows
// per warp, invalid expert ids, M = 1 and M > 1, group 16, rows of 7 and 5376)
// and checks the GEMV against a host computation with the shared codec header.
// Not part of the library; tools/gpu/check_ffi.sh builds and runs it.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <string.h>

#include <random>
#include <vector>

#include "gpu_common.h"

using namespace jq;
using namespace jq::gpu;

#define CK(x)                                                                     \
  do {                                                                            \
    hipError_t e_ = (x);                                                          \
    if (e_ != hipSuccess) {                                                       \
      printf("error %s at line %d\n", hipGetErrorString(e_), __LINE__);           \
      exit(1);                                                                    \
    }                                                                             \
  } while (0)

template <class T>
static T* to_dev(const std::vector<T>& h) {
  T* d = nullptr;
  CK(hipMalloc(&d, sizeof(T) * (h.size() ? h.size() : 1)));
  if (!h.empty()) CK(hipMemcpy(d, h.data(), sizeof(T) * h.size(), hipMemcpyHostToDevice));
  return d;
}

template <class T>
static std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  CK(hipMemcpy(h.data(), d, sizeof(T) * n, hipMemcpyDeviceToHost));
  return h;
}

static std::mt19937 rng(0);

static int check_qmv(int fmt, int bits, int group, int64_t M, int x_dt) {
  const char* name = kFormats[fmt].name;
  const int64_t E = 3, N = 37, K = 256, S = 5, words = K * bits / 32, groups = K / group;
  std::vector<uint32_t> data(E * N * words);
  for (auto& v : data) v = rng();
  const bool u8 = kFormats[fmt].scale != kScaleFloat;
  std::vector<uint8_t> sc8(E * N * groups);
  std::vector<uint16_t> sc16(E * N * groups), bi16(E * N * groups);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (size_t i = 0; i < sc8.size(); ++i) {
    sc8[i] = fmt == kNvfp4 ? (uint8_t)(0x30 + rng() % 16) : (uint8_t)(120 + rng() % 10);
    sc16[i] = f32_to_bf16(0.01f + 0.02f * (rng() % 100) / 100.0f);
    bi16[i] = f32_to_bf16(nd(rng) * 0.1f);
  }
  std::vector<int32_t> idx = {0, 2, -1, 1, 3};  // -1 and 3: NaN rows
  const int esz = x_dt == kF32 ? 4 : 2;
  std::vector<float> xf(S * M * K);
  std::vector<uint8_t> xbytes(S * M * K * esz);
  for (int64_t i = 0; i < S * M * K; ++i) {
    float v = nd(rng);
    if (x_dt == kBF16) {
      uint16_t h = f32_to_bf16(v);
      xf[i] = bf16_to_f32(h);
      memcpy(&xbytes[i * 2], &h, 2);
    } else {
      xf[i] = v;
      memcpy(&xbytes[i * 4], &v, 4);
    }
  }
  float gs = 0.5f;
  QmvProblem p{};
  p.fmt = fmt; p.bits = bits; p.group = group;
  p.S = S; p.M = M; p.N = N; p.K = K; p.E = E; p.Sx = S; p.x_div = 1; p.words = words;
  p.groups = groups; p.x_dt = x_dt; p.scale_dt = u8 ? kU8 : kBF16;
  p.x = to_dev(xbytes);
  p.data = to_dev(data);
  p.scales = u8 ? (const void*)to_dev(sc8) : (const void*)to_dev(sc16);
  p.biases = fmt == kAffine ? to_dev(bi16) : nullptr;
  std::vector<float> gsv = {gs};
  p.global_scale = fmt == kNvfp4 ? to_dev(gsv) : nullptr;
  p.indices = to_dev(idx);
  std::vector<uint8_t> y0(S * M * N * esz, 0xff);
  uint8_t* y = to_dev(y0);
  p.y = y;
  CK(fmt == kAffine ? launch_qmv_affine(p, qmv_config(p), 0) : launch_qmv_float(p, qmv_config(p), 0));
  CK(hipDeviceSynchronize());
  auto yh = to_host(y, y0.size());
  int bad = 0;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        const int64_t i = (s * M + m) * N + n;
        float got;
        if (x_dt == kBF16) {
          uint16_t h;
          memcpy(&h, &yh[i * 2], 2);
          got = bf16_to_f32(h);
        } else {
          memcpy(&got, &yh[i * 4], 4);
        }
        const int e = idx[s];
        if (e < 0 || e >= E) {
          bad += !isnan(got);
          continue;
        }
        double want = 0, mag = 0;
        dispatch_format(fmt, bits, [&](auto codec) {
          for (int64_t k = 0; k < K; ++k) {
            const int64_t row = e * N + n, gi = row * groups + k / group;
            const uint32_t code = stream_code(&data[row * words], k, bits);
            const float w = dequant_value<decltype(codec)>(
                code, bf16_to_f32(sc16[gi]), bf16_to_f32(bi16[gi]), sc8[gi],
                kFormats[fmt].has_global_scale ? gs : 1.0f);
            want += (double)w * xf[(s * M + m) * K + k];
            mag += fabs((double)w * xf[(s * M + m) * K + k]);
          }
        });
        const double tol = (x_dt == kBF16 ? 1.0 / 128 : 1e-5) * (fabs(want) + 1e-3 * mag) + 1e-6 * mag;
        if (isnan(want) && isnan(got)) continue;  // NaN element codes (E4M3 S.1111.111)
        if (!(fabs(got - want) <= tol)) {
          if (bad < 5) printf("  %s s=%ld m=%ld n=%ld got %g want %g\n", name, (long)s, (long)m, (long)n, got, want);
          ++bad;
        }
      }
  // dequantize the same weights
  DequantProblem d{};
  d.fmt = fmt; d.bits = bits; d.group = group; d.rows = E * N; d.n = N; d.k = K; d.words = words;
  d.groups = groups; d.data = p.data; d.scales = p.scales; d.scale_dt = p.scale_dt;
  d.biases = p.biases; d.global_scale = p.global_scale; d.gs_count = p.global_scale ? 1 : 0;
  d.gs_div = E;
  float* out = nullptr;
  CK(hipMalloc(&out, sizeof(float) * E * N * K));
  d.out = out; d.out_dt = kF32;
  CK(launch_dequant(d, 0));
  CK(hipDeviceSynchronize());
  printf("%-10s bits=%d M=%ld x=%s: %s (%d bad)\n", name, bits, (long)M, x_dt == kBF16 ? "bf16" : "f32",
         bad ? "FAIL" : "ok", bad);
  return bad ? 1 : 0;
}

static int check_norm(int kind, int64_t rows, int64_t d, int64_t group) {
  std::vector<uint16_t> x(rows * d), r(rows * d), w(d);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& v : x) v = f32_to_bf16(nd(rng));
  for (auto& v : r) v = f32_to_bf16(nd(rng));
  for (auto& v : w) v = f32_to_bf16(nd(rng));
  NormProblem p{};
  p.kind = kind; p.rows = rows; p.d = d; p.x = to_dev(x); p.x_dt = kBF16;
  p.r = kind == kRmsNorm ? nullptr : to_dev(r); p.r_dt = kBF16; p.w = to_dev(w); p.w_dt = kBF16;
  p.w_div = rows; p.y_dt = kBF16; p.h_dt = kBF16; p.eps = 1e-6f; p.offset = 0.0f;
  p.activation = kSilu; p.norm_before_gate = 1; p.group = group;
  std::vector<uint16_t> z(rows * d, 0);
  p.y = to_dev(z);
  p.h = kind == kAddRmsNorm ? to_dev(z) : nullptr;
  CK(launch_norm(p, 0));
  CK(hipDeviceSynchronize());
  auto y = to_host(static_cast<uint16_t*>(p.y), rows * d);
  int bad = 0;
  if (kind == kRmsNorm) {
    for (int64_t i = 0; i < rows; ++i) {
      double ss = 0;
      for (int64_t j = 0; j < d; ++j) ss += (double)bf16_to_f32(x[i * d + j]) * bf16_to_f32(x[i * d + j]);
      const double inv = 1.0 / sqrt(ss / d + 1e-6);
      for (int64_t j = 0; j < d; ++j) {
        const double want = bf16_to_f32(x[i * d + j]) * inv * bf16_to_f32(w[j]);
        bad += !(fabs(bf16_to_f32(y[i * d + j]) - want) <= 1.0 / 64 * (fabs(want) + 1e-2));
      }
    }
  }
  printf("norm kind=%d rows=%ld d=%ld group=%ld: %s (%d bad)\n", kind, (long)rows, (long)d,
         (long)group, bad ? "FAIL" : "ok", bad);
  return bad ? 1 : 0;
}

int main() {
  int fails = 0;
  for (int64_t M : {1, 5, 11}) {
    fails += check_qmv(kAffine, 4, 64, M, kBF16);
    fails += check_qmv(kAffine, 3, 32, M, kF32);
    fails += check_qmv(kAffine, 6, 128, M, kBF16);
    fails += check_qmv(kMxfp4, 4, 32, M, kBF16);
    fails += check_qmv(kMxfp6E3M2, 6, 32, M, kF32);
    fails += check_qmv(kMxfp8E4M3, 8, 32, M, kBF16);
    fails += check_qmv(kNvfp4, 4, 16, M, kBF16);
  }
  fails += check_norm(kRmsNorm, 5, 7, 7);
  fails += check_norm(kRmsNorm, 3, 5376, 5376);
  fails += check_norm(kRmsNorm, 33, 128, 128);
  fails += check_norm(kAddRmsNorm, 4, 5376, 5376);
  fails += check_norm(kGatedRmsNorm, 4, 256, 64);
  printf("%s: %d failing checks\n", fails ? "FAILED" : "ALL OK", fails);
  return fails ? 1 : 0;
}
