// Kernel-level A/B of the decode GEMV (qmv_mma.h): another revision's kernel
// (qmv_mma_old.h: that revision's header with its namespace renamed to mma_old, which
// scripts/gpu_ab_decode.sh makes) against this tree's, alternating in one process,
// both through their own launchers (PDL, grid, warps), back to back with one sync per
// sample (DESIGN §7's kernel throughput) and as % of a 1 GiB device copy measured in
// the same process. Outputs are compared bit for bit (changes that keep each output's
// float operations must keep its bits; the inputs avoid FP8 NaN / infinity codes, and
// the scales are small codes (u8 0..15, 16-bit 0x00ff-masked): a timing check, the GPU
// tests check the values against the float64 oracle). Not part of the library.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <random>
#include <vector>
#include "driver_common.h"
#include "qmv_mma_old.h"

using namespace jq;
namespace N = jq::gpu::mma;
namespace O = jq::gpu::mma_old;

// the formats of the shapes below (each one built twice: keep the list short)
constexpr uint32_t kFmts = (1u << jq::kAffine) | (1u << jq::kMxfp4) | (1u << jq::kNvfp4) |
                           (1u << jq::kMxfp6E2M3) | (1u << jq::kMxfp6E3M2) |
                           (1u << jq::kMxfp8E4M3) | (1u << jq::kMxfp8E5M2);

// one launch through the revision's own launcher (its PDL, grid, warps, smem)
template <bool OLD> static void launch(const QmvProblem& q) {
  const int nt = q.M > 8 ? 2 : 1;
  cudaError_t e;  // (a variable: the template arguments' commas would split CK's argument)
  if constexpr (OLD)
    e = O::launch_formats<O::GemvLaunch, kBF16, kFmts>(gemv_problem<O::Problem>(q), nt, 0);
  else
    e = N::launch_formats<N::GemvLaunch, kBF16, kFmts>(gemv_problem<N::Problem>(q), nt, 0);
  CK(e);
}

template <bool OLD> static double time_us(const Weights& st, int iters) {
  for (int i = 0; i < 20; ++i) launch<OLD>(st.qs[i % st.qs.size()]);
  CK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int r = 0; r < 7; ++r) {
    CK(cudaEventRecord(a));
    for (int i = 0; i < iters; ++i) launch<OLD>(st.qs[i % st.qs.size()]);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(1e3 * ms / iters);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

static std::vector<uint16_t> output(const Weights& st) {
  std::vector<uint16_t> y(st.qs[0].M * st.qs[0].N);
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(y.data(), st.qs[0].y, 2 * y.size(), cudaMemcpyDeviceToHost));
  return y;
}

int main(int argc, char** argv) {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const double gbs = copy_gbs();
  printf("# %s, %d SMs; copy %.0f GB/s\n", prop.name, prop.multiProcessorCount, gbs);
  const bool once = argc > 1 && strcmp(argv[1], "once") == 0;  // for ncu: one launch each
  // Llama-3-8B's decode shapes (q/k/v, o, gate+up, down, the head) and every format's at
  // (4096, 14336), bf16 x
  std::vector<Shape> shapes = {
      {"affine4 g64 qkv", kAffine, 64, kBF16, 1, 4096, 6144},
      {"affine4 g64 o", kAffine, 64, kBF16, 1, 4096, 4096},
      {"affine4 g64 up", kAffine, 64, kBF16, 1, 4096, 14336},
      {"affine4 g64 gate_up", kAffine, 64, kBF16, 1, 4096, 28672},
      {"affine4 g64 down", kAffine, 64, kBF16, 1, 14336, 4096},
      {"affine4 g64 head", kAffine, 64, kBF16, 1, 4096, 128256},
      {"affine4 g64 up M=4", kAffine, 64, kBF16, 4, 4096, 14336},
      {"affine4 g64 up M=8", kAffine, 64, kBF16, 8, 4096, 14336},
      {"mxfp4 qkv", kMxfp4, 32, kU8, 1, 4096, 6144},
      {"mxfp4 up", kMxfp4, 32, kU8, 1, 4096, 14336},
      {"mxfp4 down", kMxfp4, 32, kU8, 1, 14336, 4096},
      {"mxfp4 gpt-oss expert", kMxfp4, 32, kU8, 1, 2880, 5760},
      {"nvfp4 up", kNvfp4, 16, kU8, 1, 4096, 14336},
      {"mxfp8_e4m3 up", kMxfp8E4M3, 32, kU8, 1, 4096, 14336, 8},
      {"mxfp8_e5m2 up", kMxfp8E5M2, 32, kU8, 1, 4096, 14336, 8},
      {"mxfp6_e2m3 up", kMxfp6E2M3, 32, kU8, 1, 4096, 14336, 6},
      {"mxfp6_e3m2 up", kMxfp6E3M2, 32, kU8, 1, 4096, 14336, 6},
      {"affine2 g64 up", kAffine, 64, kBF16, 1, 4096, 14336, 2},
      {"affine3 g64 up", kAffine, 64, kBF16, 1, 4096, 14336, 3},
      {"affine5 g64 up", kAffine, 64, kBF16, 1, 4096, 14336, 5},
      {"affine6 g64 up", kAffine, 64, kBF16, 1, 4096, 14336, 6},
      {"affine8 g64 up", kAffine, 64, kBF16, 1, 4096, 14336, 8},
  };
  if (once) {
    for (auto& s : shapes) {
      if (strstr(s.name, "up") == nullptr || s.M != 1) continue;
      Weights st = make_weights(s);
      launch<true>(st.qs[0]);
      launch<false>(st.qs[0]);
      CK(cudaDeviceSynchronize());
    }
    return 0;
  }
  printf("%-22s %7s %7s | %7s %6s | %7s %6s | bits\n", "shape", "MB", "copy", "old", "%copy",
         "new", "%copy");
  for (auto& s : shapes) {
    Weights st = make_weights(s);
    const int iters = st.bytes > 100e6 ? 50 : 200;
    launch<true>(st.qs[0]);
    const auto y_old = output(st);
    launch<false>(st.qs[0]);
    const auto y_new = output(st);
    double t_old = 1e30, t_new = 1e30;
    for (int r = 0; r < 2; ++r) {  // alternating: old, new, old, new; the best of each
      t_old = std::min(t_old, time_us<true>(st, iters));
      t_new = std::min(t_new, time_us<false>(st, iters));
    }
    const double cu = st.bytes / gbs / 1e3;
    printf("%-22s %7.1f %7.2f | %7.2f %5.1f%% | %7.2f %5.1f%% | %s\n", s.name, st.bytes / 1e6, cu,
           t_old, 100 * cu / t_old, t_new, 100 * cu / t_new, y_old == y_new ? "equal" : "DIFFER");
    for (auto& q : st.qs) {
      CK(cudaFree((void*)q.data));
      CK(cudaFree((void*)q.scales));
      if (q.biases) CK(cudaFree((void*)q.biases));
    }
  }
  return 0;
}
