// What the kernel-level CUDA drivers share (tune_mma_driver.hip, ab_mma_driver.hip):
// error checks, random device buffers, the 1 GiB device copy that their % of copy
// bandwidth is measured against, in the same process. Not part of the library.
#pragma once

#include <stdio.h>
#include <stdlib.h>

#include <random>
#include <vector>

#include <cuda_runtime.h>

#define CK(x)                                                                           \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      printf("error %s at line %d\n", cudaGetErrorString(e_), __LINE__);                \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

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
