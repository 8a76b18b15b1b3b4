// A standalone driver of the tensor-core decode GEMV (qmv_mma.h), no JAX, for
// compute-sanitizer (scripts/gpu_check_decode.sh builds and runs it):
//   nvcc -x cu -std=c++17 -Iinclude -Ihip_src hip_src/sanitize_mma_driver.hip \
//        -L<lib dir> -ljaxquant_cuda -o sanitize_mma_driver
//   compute-sanitizer --tool memcheck --error-exitcode 9 ./sanitize_mma_driver
// Random codes and scales (every bit pattern is a valid code) in buffers of the
// exact size, so any read past them is an error: tails (N % 16), odd N x groups
// (unaligned expert bases), float32 scales, M = 1 / 9 / 16, every x dtype,
// gather with repeated experts (dedupe) and ids outside [0, E) (NaN rows).
// Values are checked by tests/test_decode_gpu.py; here: NaN rows exactly where
// the ids are bad. Not part of the library.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <random>
#include <vector>

#include "qmv_mma.h"

using namespace jq;
using namespace jq::gpu::mma;

#define CK(x)                                                                  \
  do {                                                                         \
    cudaError_t e_ = (x);                                                      \
    if (e_ != cudaSuccess) {                                                   \
      printf("error %s at line %d\n", cudaGetErrorString(e_), __LINE__);       \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

template <class T>
static T* dev_random(size_t n, std::mt19937& rng, uint32_t mask) {
  std::vector<T> h(n ? n : 1);
  for (auto& v : h) v = (T)(rng() & mask);
  T* d = nullptr;
  CK(cudaMalloc(&d, sizeof(T) * n));  // exact size: sanitizer catches any overrun
  CK(cudaMemcpy(d, h.data(), sizeof(T) * n, cudaMemcpyHostToDevice));
  return d;
}

static int failures = 0;

static void run_case(int fmt, int bits, int group, int scale_dt, int x_dt, int64_t E, int64_t N,
                     int64_t K, int64_t M, const std::vector<int32_t>* ids, int dedupe) {
  std::mt19937 rng(1234 + (int)N + (int)K + fmt * 7 + bits);
  const int64_t words = K * bits / 32, groups = K / group;
  const int ssz = scale_dt == kU8 ? 1 : (scale_dt == kF32 ? 4 : 2);
  const int esz = x_dt == kF32 ? 4 : 2;
  const int64_t S = ids ? (int64_t)ids->size() : E;
  QmvProblem q{};
  q.fmt = fmt;
  q.bits = bits;
  q.group = group;
  q.S = S;
  q.M = M;
  q.N = N;
  q.K = K;
  q.E = E;
  q.Sx = S;
  q.x_div = 1;
  q.words = words;
  q.groups = groups;
  q.x_dt = x_dt;
  q.scale_dt = scale_dt;
  // scales: small positive values (bf16/f16/f32 bit patterns of ~0.01..1; E8M0 codes 100..140)
  std::vector<uint8_t> sh(E * N * groups * ssz);
  for (size_t i = 0; i < sh.size() / ssz; ++i) {
    const float v = 0.01f + (rng() % 1000) / 1000.0f;
    uint32_t b;
    memcpy(&b, &v, 4);
    if (ssz == 1) sh[i] = (uint8_t)(fmt == kNvfp4 ? 40 + rng() % 60 : 100 + rng() % 40);
    else if (ssz == 2) {
      const uint16_t h = scale_dt == kBF16 ? (uint16_t)(b >> 16) : f32_to_f16(v);
      memcpy(&sh[2 * i], &h, 2);
    } else memcpy(&sh[4 * i], &b, 4);
  }
  void* scales = nullptr;
  CK(cudaMalloc(&scales, sh.size()));
  CK(cudaMemcpy(scales, sh.data(), sh.size(), cudaMemcpyHostToDevice));
  void* biases = nullptr;
  if (fmt == kAffine) {
    CK(cudaMalloc(&biases, sh.size()));
    CK(cudaMemcpy(biases, sh.data(), sh.size(), cudaMemcpyHostToDevice));
  }
  float gs_h = 0.5f;
  float* gs = nullptr;
  if (fmt == kNvfp4) {
    CK(cudaMalloc(&gs, 4));
    CK(cudaMemcpy(gs, &gs_h, 4, cudaMemcpyHostToDevice));
  }
  q.data = dev_random<uint32_t>(E * N * words, rng, 0xffffffffu);
  q.scales = scales;
  q.biases = biases;
  q.global_scale = gs;
  q.x = dev_random<uint16_t>(S * M * K * esz / 2, rng, 0x3bffu);  // small finite values
  int32_t* idx = nullptr;
  if (ids) {
    CK(cudaMalloc(&idx, 4 * ids->size()));
    CK(cudaMemcpy(idx, ids->data(), 4 * ids->size(), cudaMemcpyHostToDevice));
  }
  q.indices = idx;
  void* y = nullptr;
  CK(cudaMalloc(&y, S * M * N * esz));
  q.y = y;
  Problem P;
  P.q = q;
  P.tiles = (N + 15) / 16;
  P.full_tiles = N / 16;
  P.chunks = K / 64;
  P.dedupe = ids != nullptr && dedupe > 0;
  const int nt = (ids ? (dedupe > 8 ? 2 : 1) : (M > 8 ? 2 : 1));
  CK(x_dt == kF32 ? launch_qmv_mma_f32(P, nt, 0)
                  : x_dt == kF16 ? launch_qmv_mma_f16(P, nt, 0) : launch_qmv_mma_bf16(P, nt, 0));
  CK(cudaDeviceSynchronize());
  std::vector<uint8_t> yh(S * M * N * esz);
  CK(cudaMemcpy(yh.data(), y, yh.size(), cudaMemcpyDeviceToHost));
  for (int64_t s = 0; s < S; ++s) {
    const bool bad = ids && ((*ids)[s] < 0 || (*ids)[s] >= E);
    for (int64_t j = 0; j < M * N; ++j) {
      const int64_t i = s * M * N + j;
      float v;
      if (x_dt == kF32) memcpy(&v, &yh[4 * i], 4);
      else {
        uint16_t h;
        memcpy(&h, &yh[2 * i], 2);
        v = x_dt == kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
      }
      if (bad != (bool)isnan(v) && !(fmt == kMxfp8E5M2 || fmt == kMxfp8E4M3)) {
        // (random MXFP8 codes include NaN/Inf codes, so only bad rows are checked there)
        ++failures;
        if (failures < 5) printf("  NaN mismatch fmt %d bits %d slot %lld elem %lld\n", fmt, bits,
                                 (long long)s, (long long)j);
        break;
      }
      if (bad && !isnan(v)) {
        ++failures;
        break;
      }
    }
  }
  cudaFree((void*)q.data);
  cudaFree(scales);
  if (biases) cudaFree(biases);
  if (gs) cudaFree(gs);
  cudaFree((void*)q.x);
  if (idx) cudaFree(idx);
  cudaFree(y);
}

int main() {
  const std::vector<int32_t> ids = {0, 4, -1, 4, 5, 0, 0, 2, 1, 1, 4, 99, 3, 3, 3, 3, 3, 3, 3, 3, 3};
  const int xdts[3] = {kBF16, kF16, kF32};
  for (int xi = 0; xi < 3; ++xi) {
    const int xd = xdts[xi];
    // fmt, bits, group, scale dtype
    const int cases[][4] = {{kAffine, 4, 64, kBF16}, {kAffine, 4, 32, kF32}, {kAffine, 3, 64, kF16},
                            {kAffine, 8, 64, kBF16}, {kMxfp4, 4, 32, kU8},  {kMxfp6E2M3, 6, 32, kU8},
                            {kMxfp8E5M2, 8, 32, kU8}, {kNvfp4, 4, 16, kU8}, {kFp4, 4, 16, kF32}};
    for (const auto& c : cases) {
      for (int64_t m : {1, 9, 16}) run_case(c[0], c[1], c[2], c[3], xd, 3, 37, 192, m, nullptr, 0);
      run_case(c[0], c[1], c[2], c[3], xd, 5, 21, 64 * 5, 1, &ids, 0);    // odd N x groups
      run_case(c[0], c[1], c[2], c[3], xd, 5, 48, 128, 1, &ids, 7);       // dedupe, 8 rows
      run_case(c[0], c[1], c[2], c[3], xd, 5, 33, 128, 1, &ids, 12);      // dedupe, 16 rows
    }
  }
  printf(failures ? "FAILED (%d)\n" : "ALL OK\n", failures);
  return failures ? 1 : 0;
}
