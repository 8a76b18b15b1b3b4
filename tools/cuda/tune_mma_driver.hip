// Kernel-level timing of the decode GEMV's variants (gemv_mma.h), no JAX: each
// variant of the kernel's tunables (stages in flight, x staged before or after
// the first weight copies, warps per block, x from shared memory or L1) at the
// issue's shapes, launched back to back with one sync (docs/measuring.md's kernel
// throughput), next to a device-to-device copy of 1 GiB in the same process.
// Variants that sum in the same order must give the same bits as the first: the
// driver checks that too. Not part of the library; built and run by
// tools/gpu/tune_decode.sh (or by hand, here with no GPU, then run there):
//   nvcc -x cu -std=c++17 -O3 --expt-relaxed-constexpr -gencode arch=compute_90,code=sm_90 \
//        -Iinclude -Igpu_src/common -Igpu_src/cuda tools/cuda/tune_mma_driver.hip -o tune_mma_driver
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

#include "driver_common.h"

using namespace jq;
using namespace jq::gpu::mma;

struct Setup {
  std::vector<Problem> prs;  // one per copy of the weights
  double bytes;              // weights + scales (+ biases) read per call
};

static Setup make(const Shape& s) {
  const Weights wt = make_weights(s);
  Setup st{{}, wt.bytes};
  for (const QmvProblem& q : wt.qs) st.prs.push_back(gemv_problem<Problem>(q));
  return st;
}

struct Result {
  double us;
  std::vector<uint16_t> y;
};

static bool g_pdl = false;  // launch as programmatic dependents (cudaLaunchKernelEx)
static int g_carveout = -1;  // cudaFuncAttributePreferredSharedMemoryCarveout (-1: the default)

template <class K, class... A>
static void launch(K kernel, dim3 grid, dim3 block, size_t smem, A... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = g_pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

template <class C, int NT, int P, int SDT, int S, bool EARLY, int PF = S - 1, int TB = 1>
static Result run(const Setup& st, int warps, bool x_shared, int iters) {
  std::vector<Problem> prs = st.prs;
  for (auto& p : prs) {
    p.x_rows = (int)p.q.M;
    p.x_stride = (int)(p.q.K * 2 + 16);
    // x_shared: staged up to kMaxXSharedBytes at any M (launch_s stages one row only)
    if (!x_shared || (int64_t)p.x_rows * p.x_stride > kMaxXSharedBytes) p.x_stride = 0;
  }
  const Problem& pr = prs[0];
  x_shared = pr.x_stride > 0;
  const size_t nc = prs.size();
  const SharedLayout lay = SharedLayout::of<C, P, S, TB>(pr.x_rows, pr.x_stride, warps);
  auto kernel = qmv_mma_kernel<C, kBF16, NT, P, SDT, S, EARLY, PF, TB>;
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, g_carveout));
  const int64_t grid_x = (pr.full_tiles + TB - 1) / TB + (pr.tiles - pr.full_tiles);
  dim3 grid((unsigned)grid_x, 1, 1), block((unsigned)(32 * warps));
  for (int i = 0; i < 20; ++i) launch(kernel, grid, block, lay.bytes, prs[i % nc]);
  CK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int r = 0; r < 7; ++r) {
    CK(cudaEventRecord(a));
    for (int i = 0; i < iters; ++i) launch(kernel, grid, block, lay.bytes, prs[i % nc]);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(1e3 * ms / iters);
  }
  CK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  Result res;
  res.us = t[t.size() / 2];
  res.y.resize(pr.q.M * pr.q.N);
  CK(cudaMemcpy(res.y.data(), pr.q.y, 2 * res.y.size(), cudaMemcpyDeviceToHost));
  int blocks = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, 32 * warps, lay.bytes));
  printf("    S=%d early=%d warps=%d tiles/block=%d x=%-6s%s%s carveout %3d  %7.2f us  blocks/SM %2d",
         S, (int)EARLY, warps, TB, x_shared ? "shared" : "L1", g_pdl ? " pdl" : "",
         PF ? " l2pf" : "", g_carveout, res.us, blocks);
  if (PF) printf(" (%d chunks)", PF);
  return res;
}

template <class C, int NT, int P, int SDT>
static void sweep(const Shape& s, double gbs) {
  const Setup st = make(s);
  printf("%s M=%lld K=%lld N=%lld: %.1f MB (%zu copies), %.2f us at copy bandwidth\n", s.name,
         (long long)s.M, (long long)s.K, (long long)s.N, st.bytes / 1e6, st.prs.size(),
         st.bytes / gbs / 1e3);
  const int iters = 200;
  const int w0 = (int)warps_for(st.prs[0].chunks);
  auto report = [&](const Result& r, const Result& ref, bool same_order) {
    const bool same = r.y == ref.y;
    printf("  %5.1f%% of copy%s\n", 100.0 * st.bytes / (r.us * 1e-6) / (gbs * 1e9),
           same_order ? (same ? "  (bits = first)" : "  BITS DIFFER FROM THE FIRST") : "");
    if (same_order && !same) exit(3);
  };
  const Result ref = run<C, NT, P, SDT, Stages<4>::value, false>(st, w0, true, iters);
  report(ref, ref, true);
  report(run<C, NT, P, SDT, 4, true>(st, w0, true, iters), ref, true);
  report(run<C, NT, P, SDT, 6, true>(st, w0, true, iters), ref, true);
  report(run<C, NT, P, SDT, 8, true>(st, w0, true, iters), ref, true);
  report(run<C, NT, P, SDT, 4, true>(st, w0, false, iters), ref, true);
  report(run<C, NT, P, SDT, 8, true>(st, w0, false, iters), ref, true);
  for (int w : {2, 4, 8})
    if (w != w0) {
      report(run<C, NT, P, SDT, 4, true>(st, w, true, iters), ref, false);
      report(run<C, NT, P, SDT, 8, true>(st, w, true, iters), ref, false);
    }
}

// References at the same size: an empty kernel of the same grid (launch and drain
// alone), a kernel that only reads the weight bytes (16-byte loads, 4 in flight
// per thread), both back to back like the GEMV.
__global__ void empty_kernel(int) {}
__global__ void read_kernel(const uint4* p, int64_t n, uint32_t* out) {
  uint32_t acc = 0;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = __ldcs(p + i + j * stride);
#pragma unroll
    for (int j = 0; j < 4; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) out[0] = acc;  // keeps the loads
}

template <class K, class... A>
static double time_us(int iters, K kernel, dim3 grid, dim3 block, A... args) {
  for (int i = 0; i < 10; ++i) launch(kernel, grid, block, 0, args...);
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a));
  for (int i = 0; i < iters; ++i) launch(kernel, grid, block, 0, args...);
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms;
  CK(cudaEventElapsedTime(&ms, a, b));
  return 1e3 * ms / iters;
}

static void references(double gbs) {
  uint32_t* out;
  CK(cudaMalloc(&out, 4));
  printf("empty kernel, 896 x 128 threads: %.2f us\n",
         time_us(500, empty_kernel, dim3(896), dim3(128), 0));
  for (double mb : {2.0, 8.0, 33.0, 132.0}) {
    const int64_t n = (int64_t)(mb * 1e6 / 16);
    const int copies = (int)(kRotateBytes / (mb * 1e6)) + 1;
    std::vector<uint4*> bufs;
    for (int c = 0; c < copies; ++c) {
      uint4* p;
      CK(cudaMalloc(&p, n * 16));
      CK(cudaMemset(p, c, n * 16));
      bufs.push_back(p);
    }
    for (int blocks_per_sm : {4, 8, 16}) {
      const int grid = 132 * blocks_per_sm;
      for (int i = 0; i < 10; ++i) launch(read_kernel, dim3(grid), dim3(256), 0, (const uint4*)bufs[i % copies], n, out);
      cudaEvent_t a, b;
      CK(cudaEventCreate(&a));
      CK(cudaEventCreate(&b));
      CK(cudaEventRecord(a));
      const int iters = 200;
      for (int i = 0; i < iters; ++i)
        launch(read_kernel, dim3(grid), dim3(256), 0, (const uint4*)bufs[i % copies], n, out);
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      float ms;
      CK(cudaEventElapsedTime(&ms, a, b));
      const double us = 1e3 * ms / iters;
      printf("read-only kernel %6.1f MB, %4d x 256 threads: %7.2f us = %5.1f%% of copy\n", mb, grid,
             us, 100.0 * mb * 1e6 / (us * 1e-6) / (gbs * 1e9));
    }
    for (auto p : bufs) CK(cudaFree(p));
  }
}

// Time against bytes at fixed N: the slope is the kernel's streaming rate, the
// intercept its fixed cost per launch (ramp, prologue, epilogue, launch gap).
template <class C, int P, int SDT>
static void scaling(const char* name, int fmt, int group, int sdt, int64_t N, double gbs) {
  printf("%s M=1 N=%lld, time against K (production variant):\n", name, (long long)N);
  for (int64_t K : {256, 512, 1024, 2048, 4096, 8192, 16384}) {
    const Setup st = make({name, fmt, group, sdt, 1, K, N});
    printf("  K=%5lld %6.1f MB  copy %6.2f us:", (long long)K, st.bytes / 1e6, st.bytes / gbs / 1e3);
    const int w = (int)warps_for(K / kChunkK);
    run<C, 1, P, SDT, Stages<4>::value, true, 0>(st, w, true, 200);
    printf("\n%40s", "");
    run<C, 1, P, SDT, Stages<4>::value, true>(st, w, true, 200);
    printf("\n%40s", "");
    run<C, 1, P, SDT, Stages<4>::value, true, 8>(st, w, true, 200);
    printf("\n%40s", "");
    run<C, 1, P, SDT, Stages<4>::value, true, 64>(st, w, true, 200);
    printf("\n");
  }
}

int main(int argc, char** argv) {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const double gbs = copy_gbs();
  printf("# %s, %d SMs; copy bandwidth %.0f GB/s (cudaMemcpy D2D, 1 GiB)\n", prop.name,
         prop.multiProcessorCount, gbs);
  using A4 = Codec<kAffine, 4>;
  using F4 = Codec<kMxfp4, 4>;
  if (argc > 1 && strcmp(argv[1], "pdl") == 0) {
    references(gbs);
    g_pdl = true;
    printf("-- programmatic dependent launches:\n");
    references(gbs);
    for (bool pdl : {false, true}) {
      g_pdl = pdl;
      scaling<A4, 1, kBF16>("affine4 g64", kAffine, 64, kBF16, 14336, gbs);
      scaling<F4, 2, kU8>("mxfp4", kMxfp4, 32, kU8, 14336, gbs);
    }
    return 0;
  }
  if (argc > 1 && strcmp(argv[1], "carveout") == 0) {  // M = 8, 16: x from L1, L1's share
    g_pdl = true;
    const Shape shapes[] = {{"affine4 g64", kAffine, 64, kBF16, 8, 4096, 14336},
                            {"affine4 g64", kAffine, 64, kBF16, 16, 4096, 14336},
                            {"affine4 g64", kAffine, 64, kBF16, 16, 14336, 4096}};
    for (const Shape& s : shapes) {
      const Setup st = make(s);
      printf("%s M=%lld K=%lld N=%lld: %.1f MB, %.2f us at copy bandwidth\n", s.name,
             (long long)s.M, (long long)s.K, (long long)s.N, st.bytes / 1e6,
             st.bytes / gbs / 1e3);
      const int w0 = warps_for(st.prs[0].chunks);
      for (int co : {-1, 0, 10, 25, 50, 100}) {
        g_carveout = co;
        for (int w : {2, w0}) {
          const double us = s.M > 8 ? run<A4, 2, 1, kBF16, 4, true>(st, w, false, 200).us
                                    : run<A4, 1, 1, kBF16, 4, true>(st, w, false, 200).us;
          printf("  %5.1f%% of copy\n", 100.0 * st.bytes / (us * 1e-6) / (gbs * 1e9));
        }
      }
    }
    return 0;
  }
  if (argc > 1 && strcmp(argv[1], "tiles") == 0) {  // M = 8, 16: 1 or 2 tiles per block
    g_pdl = true;
    auto tiles = [&](auto codec, auto nt, auto p, auto sdt, const Shape& s) {
      using C = decltype(codec);
      constexpr int NT = decltype(nt)::value, P = decltype(p)::value, SDT = decltype(sdt)::value;
      const Setup st = make(s);
      printf("%s M=%lld K=%lld N=%lld: %.1f MB, %.2f us at copy bandwidth\n", s.name,
             (long long)s.M, (long long)s.K, (long long)s.N, st.bytes / 1e6,
             st.bytes / gbs / 1e3);
      const double mb = st.bytes / 1e6;
      const int w0 = warps_for(st.prs[0].chunks);
      for (int w : {w0, 2}) {
        const Result ref = run<C, NT, P, SDT, 4, true, 3, 1>(st, w, true, 200);
        printf("  %5.1f%% of copy\n", 100.0 * mb * 1e6 / (ref.us * 1e-6) / (gbs * 1e9));
        const Result two = run<C, NT, P, SDT, 4, true, 3, 2>(st, w, true, 200);
        printf("  %5.1f%% of copy%s\n", 100.0 * mb * 1e6 / (two.us * 1e-6) / (gbs * 1e9),
               two.y == ref.y ? "  (bits = 1 tile/block)" : "  BITS DIFFER FROM 1 TILE/BLOCK");
        if (two.y != ref.y) exit(3);
      }
    };
    using I1 = std::integral_constant<int, 1>;
    using I2 = std::integral_constant<int, 2>;
    using U8 = std::integral_constant<int, kU8>;
    using B16 = std::integral_constant<int, kBF16>;
    for (int64_t M : {1, 8})
      for (auto kn : {std::pair<int64_t, int64_t>{4096, 14336}, {14336, 4096}}) {
        tiles(A4{}, I1{}, I1{}, B16{}, {"affine4 g64", kAffine, 64, kBF16, M, kn.first, kn.second});
        tiles(F4{}, I1{}, I2{}, U8{}, {"mxfp4", kMxfp4, 32, kU8, M, kn.first, kn.second});
      }
    for (int64_t M : {9, 16})
      for (auto kn : {std::pair<int64_t, int64_t>{4096, 14336}, {14336, 4096}}) {
        tiles(A4{}, I2{}, I1{}, B16{}, {"affine4 g64", kAffine, 64, kBF16, M, kn.first, kn.second});
        tiles(F4{}, I2{}, I2{}, U8{}, {"mxfp4", kMxfp4, 32, kU8, M, kn.first, kn.second});
      }
    return 0;
  }
  if (argc > 1 && strcmp(argv[1], "scaling") == 0) {
    scaling<A4, 1, kBF16>("affine4 g64", kAffine, 64, kBF16, 14336, gbs);
    scaling<F4, 2, kU8>("mxfp4", kMxfp4, 32, kU8, 14336, gbs);
    scaling<A4, 1, kBF16>("affine4 g64", kAffine, 64, kBF16, 4096, gbs);
    return 0;
  }
  sweep<A4, 1, 1, kBF16>({"affine4 g64", kAffine, 64, kBF16, 1, 4096, 14336}, gbs);
  sweep<F4, 1, 2, kU8>({"mxfp4", kMxfp4, 32, kU8, 1, 4096, 14336}, gbs);
  sweep<A4, 1, 1, kBF16>({"affine4 g64", kAffine, 64, kBF16, 1, 14336, 4096}, gbs);
  sweep<F4, 1, 2, kU8>({"mxfp4", kMxfp4, 32, kU8, 1, 14336, 4096}, gbs);
  sweep<A4, 1, 1, kBF16>({"affine4 g64", kAffine, 64, kBF16, 8, 4096, 14336}, gbs);
  sweep<A4, 2, 1, kBF16>({"affine4 g64", kAffine, 64, kBF16, 16, 4096, 14336}, gbs);
  sweep<F4, 1, 2, kU8>({"mxfp4 gpt-oss expert", kMxfp4, 32, kU8, 1, 2880, 5760}, gbs);
  sweep<F4, 1, 2, kU8>({"mxfp4 qwen3 expert", kMxfp4, 32, kU8, 1, 2048, 1536}, gbs);
  return 0;
}
