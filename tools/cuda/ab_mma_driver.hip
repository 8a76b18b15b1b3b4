// Kernel-level A/B of the decode GEMV (gemv_mma.h): another revision's kernel
// (gemv_mma_old.h: that revision's header with its namespace renamed to mma_old, which
// tools/gpu/ab_decode.sh makes) against this tree's, alternating in one process,
// both through their own launchers (PDL, grid, warps), back to back with one sync per
// sample (docs/measuring.md's kernel throughput) and as % of a 1 GiB device copy measured in
// the same process. Outputs are compared bit for bit (changes that keep each output's
// float operations must keep its bits; the inputs avoid FP8 NaN / infinity codes, and
// the scales are small codes (u8 0..15, 16-bit 0x00ff-masked): a timing check, the GPU
// tests check the values against the float64 oracle). Shapes: Llama-3-8B's and
// gpt-oss-20b's decode GEMVs, every format's (4096, 14336), and the fused variants
// (rms_norm_qmm's norm prologue, qmm_swiglu's epilogue) at the shapes the models run
// them. `ab_mma_driver once [NAME]` launches each shape (whose name contains NAME)
// once, old then new, for ncu. Not part of the library.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <random>
#include <vector>
#include "driver_common.h"
#include "gemv_mma_old.h"

using namespace jq;
namespace N = jq::gpu::mma;
namespace O = jq::gpu::mma_old;

// the formats of the shapes below (each one built twice: keep the list short)
constexpr uint32_t kFmts = (1u << jq::kAffine) | (1u << jq::kMxfp4) | (1u << jq::kNvfp4) |
                           (1u << jq::kMxfp6E2M3) | (1u << jq::kMxfp6E3M2) |
                           (1u << jq::kMxfp8E4M3) | (1u << jq::kMxfp8E5M2);

// The fused variants' operands: kFuseNorm's norm weight (bf16 [K], values near 1), else
// none (kFuseSwiglu: SiLU, no bias). Set per shape.
static int g_fuse = N::kFuseNone;
static const void* g_norm_weight = nullptr;

// The norm weight into a revision's Problem: `norm_w` where it has one, else `aux` (the
// revisions before rms_norm_qmm_swiglu shared one operand field between the fused steps).
template <class P>
static auto set_norm_weight(P& pr, int) -> decltype(pr.norm_w = nullptr, void()) {
  pr.norm_w = g_norm_weight;
  pr.norm_dt = kBF16;
}
template <class P> static void set_norm_weight(P& pr, long) {
  pr.aux = g_norm_weight;
  pr.aux_dt = kBF16;
}

template <class P> static P launch_problem(const QmvProblem& q) {
  P pr = gemv_problem<P>(q);
  if (g_fuse == N::kFuseNorm) {
    set_norm_weight(pr, 0);
    pr.eps = 1e-5f;
  }
  return pr;
}

// one launch through the revision's own launcher (its PDL, grid, warps, smem)
template <bool OLD> static void launch(const QmvProblem& q) {
  const int nt = q.M > 8 ? 2 : 1;
  cudaError_t e;  // (a variable: the template arguments' commas would split CK's argument)
  if constexpr (OLD) {
    const auto pr = launch_problem<O::Problem>(q);
    if (g_fuse == N::kFuseNorm)
      e = O::launch_formats<O::FusedGemvLaunch<N::kFuseNorm>, kBF16, kFmts>(pr, nt, 0);
    else if (g_fuse == N::kFuseSwiglu)
      e = O::launch_formats<O::FusedGemvLaunch<N::kFuseSwiglu>, kBF16, kFmts>(pr, nt, 0);
    else
      e = O::launch_formats<O::GemvLaunch, kBF16, kFmts>(pr, nt, 0);
  } else {
    const auto pr = launch_problem<N::Problem>(q);
    if (g_fuse == N::kFuseNorm)
      e = N::launch_formats<N::FusedGemvLaunch<N::kFuseNorm>, kBF16, kFmts>(pr, nt, 0);
    else if (g_fuse == N::kFuseSwiglu)
      e = N::launch_formats<N::FusedGemvLaunch<N::kFuseSwiglu>, kBF16, kFmts>(pr, nt, 0);
    else
      e = N::launch_formats<N::GemvLaunch, kBF16, kFmts>(pr, nt, 0);
  }
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

// y filled with 0xffff (a NaN) before a launch, so an output the kernel leaves unwritten
// cannot pass as equal
static void clear_output(const Weights& st) {
  CK(cudaMemset(st.qs[0].y, 0xff, st.qs[0].M * st.qs[0].N * 2));
}

static std::vector<uint16_t> output(const Weights& st) {
  std::vector<uint16_t> y(st.qs[0].M * st.qs[0].N / (g_fuse == N::kFuseSwiglu ? 2 : 1));
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(y.data(), st.qs[0].y, 2 * y.size(), cudaMemcpyDeviceToHost));
  return y;
}

int main(int argc, char** argv) {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const double gbs = copy_gbs();
  printf("# %s, %d SMs; copy %.0f GB/s\n", prop.name, prop.multiProcessorCount, gbs);
  // `once [NAME]`, for ncu: one launch each of the M = 1 "up" shapes (or those whose
  // name contains NAME), old then new
  const bool once = argc > 1 && strcmp(argv[1], "once") == 0;
  const char* pick = argc > 2 ? argv[2] : nullptr;
  // Llama-3-8B's decode shapes (q/k/v, o, gate+up, down, the head) and every format's at
  // (4096, 14336), bf16 x
  std::vector<Shape> shapes = {
      {"affine4 g64 qkv", kAffine, 64, kBF16, 1, 4096, 6144},
      {"affine4 g64 o", kAffine, 64, kBF16, 1, 4096, 4096},
      {"affine4 g64 up", kAffine, 64, kBF16, 1, 4096, 14336},
      {"affine4 g64 gate_up", kAffine, 64, kBF16, 1, 4096, 28672},
      {"affine4 g64 down", kAffine, 64, kBF16, 1, 14336, 4096},
      {"affine4 g64 head", kAffine, 64, kBF16, 1, 4096, 128256},
      {"affine4 g64 up M=2", kAffine, 64, kBF16, 2, 4096, 14336},
      {"affine4 g64 up M=4", kAffine, 64, kBF16, 4, 4096, 14336},
      {"affine4 g64 qkv M=4", kAffine, 64, kBF16, 4, 4096, 6144},
      {"mxfp4 up M=4", kMxfp4, 32, kU8, 4, 4096, 14336},
      {"affine4 g64 up M=3", kAffine, 64, kBF16, 3, 4096, 14336},
      {"affine4 g64 up M=6", kAffine, 64, kBF16, 6, 4096, 14336},
      {"affine4 g64 down M=2", kAffine, 64, kBF16, 2, 14336, 4096},
      {"affine4 g64 o M=4", kAffine, 64, kBF16, 4, 4096, 4096},
      {"mxfp4 up M=2", kMxfp4, 32, kU8, 2, 4096, 14336},
      {"affine4 g64 up M=8", kAffine, 64, kBF16, 8, 4096, 14336},
      {"mxfp4 qkv", kMxfp4, 32, kU8, 1, 4096, 6144},
      {"mxfp4 up", kMxfp4, 32, kU8, 1, 4096, 14336},
      {"mxfp4 down", kMxfp4, 32, kU8, 1, 14336, 4096},
      {"mxfp4 o", kMxfp4, 32, kU8, 1, 4096, 4096},
      // gpt-oss-20b's: q/k/v, o, and the 4 routed experts' gate+up and down (as one
      // matrix of 4x the rows: the gather's grid, slots x tiles)
      {"mxfp4 oss qkv", kMxfp4, 32, kU8, 1, 2880, 5120},
      {"mxfp4 oss o", kMxfp4, 32, kU8, 1, 4096, 2880},
      {"mxfp4 oss expert", kMxfp4, 32, kU8, 1, 2880, 5760},
      {"mxfp4 oss 4x gate_up", kMxfp4, 32, kU8, 1, 2880, 23040},
      {"mxfp4 oss 4x down", kMxfp4, 32, kU8, 1, 2880, 11520},
      {"mxfp4 head", kMxfp4, 32, kU8, 1, 4096, 128256},
      {"mxfp4 oss head", kMxfp4, 32, kU8, 1, 2880, 201088},
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
  // the fused variants at the shapes the models run them (Llama-3-8B's and gpt-oss-20b's
  // q/k/v with the norm, Llama's gate+up with the SwiGLU); fuse[i] for shapes[i]
  std::vector<int> fuse(shapes.size(), N::kFuseNone);
  const std::pair<Shape, int> fused[] = {
      {{"affine4 qkv +norm", kAffine, 64, kBF16, 1, 4096, 6144}, N::kFuseNorm},
      {{"mxfp4 qkv +norm", kMxfp4, 32, kU8, 1, 4096, 6144}, N::kFuseNorm},
      {{"mxfp4 oss qkv +norm", kMxfp4, 32, kU8, 1, 2880, 5120}, N::kFuseNorm},
      {{"affine4 gate_up +swiglu", kAffine, 64, kBF16, 1, 4096, 28672}, N::kFuseSwiglu},
      {{"mxfp4 gate_up +swiglu", kMxfp4, 32, kU8, 1, 4096, 28672}, N::kFuseSwiglu},
      {{"affine4 gate_up +swiglu M=2", kAffine, 64, kBF16, 2, 4096, 28672}, N::kFuseSwiglu},
      {{"affine4 gate_up +swiglu M=4", kAffine, 64, kBF16, 4, 4096, 28672}, N::kFuseSwiglu},
  };
  for (const auto& f : fused) {
    shapes.push_back(f.first);
    fuse.push_back(f.second);
  }
  std::mt19937 nrng(5);
  printf("%-22s %7s %7s | %7s %6s | %7s %6s | bits\n", "shape", "MB", "copy", "old", "%copy",
         "new", "%copy");
  for (size_t i = 0; i < shapes.size(); ++i) {
    const Shape& s = shapes[i];
    if (once && (pick ? strstr(s.name, pick) == nullptr
                      : strstr(s.name, "up") == nullptr || s.M != 1))
      continue;
    g_fuse = fuse[i];
    if (g_fuse == N::kFuseNorm) {  // the norm weight: bf16 in [0.5, 2), random mantissas
      std::vector<uint16_t> w(s.K);
      for (auto& v : w) v = (uint16_t)(0x3f00u | (nrng() & 0xffu));
      void* d = nullptr;
      CK(cudaMalloc(&d, 2 * w.size()));
      CK(cudaMemcpy(d, w.data(), 2 * w.size(), cudaMemcpyHostToDevice));
      g_norm_weight = d;
    }
    Weights st = make_weights(s);
    if (once) {
      launch<true>(st.qs[0]);
      launch<false>(st.qs[0]);
      CK(cudaDeviceSynchronize());
    } else {
      const int iters = st.bytes > 100e6 ? 50 : 200;
      clear_output(st);
      launch<true>(st.qs[0]);
      const auto y_old = output(st);
      clear_output(st);
      launch<false>(st.qs[0]);
      const auto y_new = output(st);
      double t_old = 1e30, t_new = 1e30;
      for (int r = 0; r < 2; ++r) {  // alternating: old, new, old, new; the best of each
        t_old = std::min(t_old, time_us<true>(st, iters));
        t_new = std::min(t_new, time_us<false>(st, iters));
      }
      const double cu = st.bytes / gbs / 1e3;
      printf("%-22s %7.1f %7.2f | %7.2f %5.1f%% | %7.2f %5.1f%% | %s\n", s.name, st.bytes / 1e6,
             cu, t_old, 100 * cu / t_old, t_new, 100 * cu / t_new,
             y_old == y_new ? "equal" : "DIFFER");
    }
    if (g_norm_weight) CK(cudaFree((void*)g_norm_weight));
    g_norm_weight = nullptr;
    for (auto& q : st.qs) {
      CK(cudaFree((void*)q.data));
      CK(cudaFree((void*)q.scales));
      if (q.biases) CK(cudaFree((void*)q.biases));
    }
  }
  return 0;
}
