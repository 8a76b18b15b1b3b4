// What the kernel-level CUDA drivers share (tune_mma_driver.hip, ab_mma_driver.hip):
// error checks (cuda_check.h), random device buffers, a shape's weight copies, the 1 GiB
// device copy that their % of copy bandwidth is measured against, in the same process.
// Not part of the library.
#pragma once

#include <stdio.h>
#include <stdlib.h>

#include <random>
#include <vector>

#include <cuda_runtime.h>

#include "cuda_check.h"  // CK
#include "gemv_mma.h"  // jq::QmvProblem, the format and dtype ids, the GEMV's tiling

// The device's SM count, which the GEMV's launchers ask for (tiles_per_block): the
// library defines it (gpu_ffi.hip, cached), and these drivers, one translation unit
// each, link no library.
int jq_device_sm_count() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return 1;
  return sms;
}

// `bytes` of random words (each & mask) on the device.
static void* dev_random(size_t bytes, std::mt19937& rng, uint32_t mask) {
  std::vector<uint32_t> h((bytes + 3) / 4);
  for (auto& v : h) v = rng() & mask;
  void* d = nullptr;
  CK(cudaMalloc(&d, 4 * h.size()));
  CK(cudaMemcpy(d, h.data(), 4 * h.size(), cudaMemcpyHostToDevice));
  return d;
}

// Copies of the weights cycled through, more bytes than L2 holds (50 MB on an H100),
// so that every call reads them from DRAM as a model's layers do.
constexpr double kRotateBytes = 256e6;

// A GEMV's shape: y [M, N] = x [M, K] (bf16) @ W [N, K]^T, W `bits`-bit codes of `fmt`
// in groups of `group` with `scale_dt` scales (uint8 codes or bf16).
struct Shape {
  const char* name;
  int fmt, group, scale_dt;
  int64_t M, K, N;
  int bits = 4;
};

// A shape's problems, one per copy of the weights (kRotateBytes in all), and the bytes
// (weights, scales, biases) one call reads.
struct Weights {
  std::vector<jq::QmvProblem> qs;
  double bytes;
};

static Weights make_weights(const Shape& s) {
  using namespace jq;
  std::mt19937 rng(7);
  const int ssz = s.scale_dt == kU8 ? 1 : 2;
  QmvProblem q{};
  q.fmt = s.fmt;
  q.bits = s.bits;
  q.group = s.group;
  q.S = 1;
  q.M = s.M;
  q.N = s.N;
  q.K = s.K;
  q.E = 1;
  q.Sx = 1;
  q.x_div = 1;
  q.words = s.K * s.bits / 32;
  q.groups = s.K / s.group;
  q.x_dt = kBF16;
  q.scale_dt = s.scale_dt;
  const size_t wbytes = s.N * s.K * s.bits / 8, sbytes = s.N * q.groups * ssz;
  // FP8 data: no NaN / infinity codes (bit 3 of each byte clear: E4M3's NaN is S.1111.111,
  // E5M2's specials S.11111.xx), so outputs compare by bits; signs kept
  const uint32_t wmask = s.bits == 8 && s.fmt != kAffine ? 0xf7f7f7f7u : 0xffffffffu;
  q.x = dev_random(s.M * s.K * 2, rng, 0x3bff3bffu);
  void* y = nullptr;
  CK(cudaMalloc(&y, s.M * s.N * 4));
  q.y = y;
  Weights wt{};
  wt.bytes = (double)wbytes + (s.fmt == kAffine ? 2.0 : 1.0) * sbytes;
  const int copies = (int)(kRotateBytes / wt.bytes) + 1;
  for (int c = 0; c < copies; ++c) {
    // every copy the same values (the outputs agree), at its own address
    std::mt19937 wrng(11);
    q.data = static_cast<const uint32_t*>(dev_random(wbytes, wrng, wmask));
    // scales: small bf16 values or E8M0 codes 0..15 (scaled sums stay finite); biases likewise
    q.scales = dev_random(sbytes, wrng, s.scale_dt == kU8 ? 0x0f0f0f0fu : 0x00ff00ffu);
    if (s.fmt == kAffine) q.biases = dev_random(sbytes, wrng, 0x00ff00ffu);
    wt.qs.push_back(q);
  }
  return wt;
}

// Device-to-device copy bandwidth (read + write), GB/s: 10 copies of 1 GiB.
static double copy_gbs() {
  const size_t n = 1ull << 30;
  void *a, *b;
  CK(cudaMalloc(&a, n));
  CK(cudaMalloc(&b, n));
  CK(cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0));
  for (int i = 0; i < 10; ++i) CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice));
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  CK(cudaFree(a));
  CK(cudaFree(b));
  return 2.0 * n * 10 / (ms * 1e-3) / 1e9;
}

// The GEMV's launch problem for q (P: jq::gpu::mma::Problem, or another revision's copy
// of it with the same fields).
template <class P>
P gemv_problem(const jq::QmvProblem& q) {
  using namespace jq::gpu::mma;
  P pr{};
  pr.q = q;
  pr.tiles = (q.N + kTileRows - 1) / kTileRows;
  pr.full_tiles = q.N / kTileRows;
  pr.chunks = q.K / kChunkK;
  return pr;
}
