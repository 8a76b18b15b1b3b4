// CUTLASS's Hopper mixed-input GEMM (4-bit weights, bf16 activations) against cuBLAS's
// bf16 GEMM, at kernel level: no JAX, no jaxquant library. It is the peer that issue 49
// asks to measure jaxquant's prefill GEMM against (docs/prefill.md, "CUTLASS's
// mixed-input GEMM, for comparison"); tools/gpu/cutlass_mixed.sh builds and runs it.
//
//   dense:   y [M, N] = x [M, K] @ W [N, K]^T, W jaxquant's affine4 in groups of 64
//            (w = code * scale + bias, docs/formats.md), for each M of --m;
//   grouped: the same per expert, E experts of [N, K], T rows of x split evenly over them
//            (gpt-oss-20b's experts by default), against a dense bf16 GEMM of equal FLOPs.
//
// For each product: CUTLASS's y is checked against cuBLAS's product of the dequantized
// bf16 weight (which is itself checked at sampled points against a float64 dot on the
// host), then each implementation is timed back to back with CUDA events, cycling through
// copies of the weights that together exceed L2, and one line per (shape, implementation)
// gives the median time, TFLOP/s and the speed relative to cuBLAS bf16.
//
// Options (--key=value): --mode=dense|grouped|all  --m=64,512,4096  --k=4096  --n=14336
//   --experts=32 --tokens=4096 --gk=2944 --gn=5760  --configs=all|NAME,NAME
//   --samples=9 --calls=0 (0: enough calls for ~5 ms per sample) --warmup=3  --list
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cutlass/cutlass.h"
#include "cutlass/version.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "cutlass/util/mixed_dtype_utils.hpp"

#include "cuda_check.h"  // CK

using namespace cute;

#define CUBLAS_CK(x)                                                                   \
  do {                                                                                 \
    cublasStatus_t s_ = (x);                                                           \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                 \
      printf("cuBLAS error %d at line %d\n", int(s_), __LINE__);                       \
      exit(1);                                                                         \
    }                                                                                  \
  } while (0)
#define CUTLASS_CK(x)                                                                  \
  do {                                                                                 \
    cutlass::Status s_ = (x);                                                          \
    if (s_ != cutlass::Status::kSuccess) {                                             \
      printf("CUTLASS error %s at line %d\n", cutlassGetStatusString(s_), __LINE__);   \
      exit(1);                                                                         \
    }                                                                                  \
  } while (0)

// ---------------------------------------------------------------------------------------
// The CUTLASS kernels.
//
// The collective passes the narrow operand through registers and needs it as the MMA's A:
// CUTLASS's problem is y^T [N, M] = W [N, K] . x^T, so W is its A (K-major, i.e. W's rows
// as stored) and x its B (K-major too: x row-major), and y^T column-major is y row-major.
// Swapping explicitly, as example 55 does, keeps the TMA epilogue (an implicit swap
// cannot use it).
//
// The weight's mode is scale-with-zero-point on unsigned 4-bit codes: per element the
// mainloop converts the code to bf16 (exact: 0..15), then computes `code * scale + zero`
// in bf16 (cutlass/detail/collective/mixed_input_utils.hpp, dequantize_A_kblock,
// ConvertAndScaleWithZero: bfloat16_t operator* then operator+, i.e. `mul.bf16` and
// `add.bf16`). affine4's w = code * scale + bias therefore maps with no conversion of any
// stored value: the codes are the same nibbles (element k in the low nibble of byte k/2),
// the scale is the scale and the zero is the bias, both bf16. Where it can round
// differently: jaxquant rounds w once (one bf16 FMA, docs/prefill.md "Numerics"); `mul.bf16`
// / `add.bf16` without `.rn` may be contracted by ptxas into that FMA or rounded twice
// (product, then sum), which moves w by up to half a bf16 ulp of code * scale: more than
// w's own ulp where the bias cancels much of the product (the check below allows for it).
// What differs in layout, prepared once before timing: the scales and zeros are [K/64, N]
// (N fastest, what the collective's TMA reads) where affine4 stores [N, K/64], and the
// codes are permuted within each 16-row, 16-k block (below).
// ---------------------------------------------------------------------------------------
using Bf16 = cutlass::bfloat16_t;
using Code = cutlass::uint4b_t;
constexpr int kGroup = 64;  // affine4's group along K
// The tile's K: 128 bytes of bf16 per row, the TMA box the mixed-input collective is built
// for (example 55's TileShapeK); a group must be a multiple of it, and 64 is.
constexpr int kTileK = 64;
constexpr int kAlignX = 8;   // 16-byte TMA alignment, in elements
constexpr int kAlignW = 32;  // 16 bytes of 4-bit codes
constexpr int kAlignY = 8;

using LayoutXt = cutlass::layout::ColumnMajor;  // x^T as CUTLASS's B: x row-major [M, K]
using LayoutW = cutlass::layout::ColumnMajor;   // W [N, K] row-major as a column-major B
using LayoutYt = cutlass::layout::ColumnMajor;  // y^T column-major: y row-major [M, N]
using StrideX = cutlass::detail::TagToStrideA_t<cutlass::layout::RowMajor>;
using StrideW = cutlass::detail::TagToStrideB_t<LayoutW>;

// The offline reorder (example 55's `shuffle`): in each 16-row, 16-k block (a warp's
// slice of one wgmma's A) the 8 codes a thread holds (rows r and r + 8, k 2t, 2t + 1,
// 2t + 8, 2t + 9) contiguous, one 32-bit shared-memory load instead of byte loads, in the
// order [0,2,4,6,1,3,5,7], from which the uint4 -> bf16 conversion takes two at a time
// with one LOP3 and one bf16x2 subtract (LayoutAwareConvertImpl<uint4b_t, bfloat16_t>).
using ValueShuffle = Layout<Shape<_2, _4>, Stride<_4, _1>>;
using LayoutAtomW =
    decltype(cutlass::compute_memory_reordering_atom<Bf16, Layout<Shape<_1, _1>>, ValueShuffle>());
using LayoutWReordered =
    decltype(cute::tile_to_shape(LayoutAtomW{}, Layout<Shape<int, int, int>, StrideW>{}));

// Scheduler: void is the persistent data-parallel tile scheduler (one tile per CTA turn);
// cutlass::gemm::StreamKScheduler also splits K where tiles are fewer than SMs.
template <int TM, int TN, int CM, class KernelSchedule, class EpilogueSchedule,
          class Scheduler = void>
struct DenseConfig {
  using TileShape = Shape<Int<TM>, Int<TN>, Int<kTileK>>;
  using ClusterShape = Shape<Int<CM>, _1, _1>;
  // C is void: beta = 0, no C read and no shared memory for it.
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutYt, kAlignY,
      Bf16, LayoutYt, kAlignY, EpilogueSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cute::tuple<Code, Bf16, Bf16>,
      LayoutWReordered, kAlignW, Bf16, LayoutXt, kAlignX, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop,
                                                       Epilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

using ProblemShapeG = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using StrideXG = cute::remove_pointer_t<cutlass::detail::TagToStrideA_t<cutlass::layout::RowMajor*>>;
using StrideWG = cute::remove_pointer_t<cutlass::detail::TagToStrideB_t<LayoutW*>>;
using LayoutWReorderedG =
    decltype(cute::tile_to_shape(LayoutAtomW{}, Layout<Shape<int, int, Int<1>>, StrideWG>{}));

template <int TM, int TN>
struct GroupedConfig {
  using TileShape = Shape<Int<TM>, Int<TN>, Int<kTileK>>;
  using ClusterShape = Shape<_1, _1, _1>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutYt*, kAlignY,
      Bf16, LayoutYt*, kAlignY,
      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cute::tuple<Code, Bf16, Bf16>,
      LayoutWReorderedG*, kAlignW, Bf16, LayoutXt*, kAlignX, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShapeG, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// ---------------------------------------------------------------------------------------
// Data: random weights and activations, made on the device from a counter-based hash so
// that every size is cheap to make and every run sees the same values.
// ---------------------------------------------------------------------------------------
__host__ __device__ inline uint64_t splitmix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__device__ inline float uniform01(uint64_t i, uint64_t seed) {
  return float(splitmix(i ^ (seed << 40)) >> 40) * (1.0f / 16777216.0f);
}

// x: bf16 uniform in [-1, 1).
__global__ void fill_x(__nv_bfloat16* x, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    x[i] = __float2bfloat16(2.0f * uniform01(i, seed) - 1.0f);
}

// Codes: uniform bytes (two codes each). Scales and biases of `rows` rows of `groups`
// groups, stored [expert][group][n] (N fastest; `rows` = experts * n): affine4 as
// jq.quantize makes it, the scale's sign picks which end of the group is the bias
// (docs/formats.md), so w = code * scale + bias spans about +-7.5 |scale| around 0;
// |scale| in [2^-7, 2^-5).
__global__ void fill_w(uint8_t* codes, size_t code_bytes, __nv_bfloat16* scales,
                       __nv_bfloat16* biases, size_t n_scales, uint64_t seed) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < code_bytes; i += stride)
    codes[i] = uint8_t(splitmix(i ^ (seed << 40)) >> 56);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n_scales; i += stride) {
    const float mag = ldexpf(1.0f + 3.0f * uniform01(i, seed + 1), -7);
    const float s = uniform01(i, seed + 2) < 0.5f ? mag : -mag;
    const __nv_bfloat16 sb = __float2bfloat16(s);
    scales[i] = sb;
    biases[i] = __float2bfloat16(-__bfloat162float(sb) * (7.0f + uniform01(i, seed + 3)));
  }
}

// The format's value, as jaxquant defines it: w = code * scale + bias computed exactly
// (in double: a 4-bit code times an 8-bit significand plus an 8-bit significand is exact)
// and rounded once to bf16; with `twice`, code * scale rounded to bf16 first (what a
// bf16 multiply then a bf16 add give). Row r = e * n + j of codes [rows, k/2]; scales
// [e][g][j].
__global__ void dequant_w(const uint8_t* codes, const __nv_bfloat16* scales,
                          const __nv_bfloat16* biases, __nv_bfloat16* w, int64_t rows, int64_t n,
                          int64_t k, bool twice) {
  const int64_t groups = k / kGroup;
  const size_t total = size_t(rows) * size_t(k);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total;
       i += size_t(gridDim.x) * blockDim.x) {
    const int64_t r = int64_t(i / size_t(k)), kk = int64_t(i % size_t(k));
    const int64_t e = r / n, j = r % n;
    const uint8_t byte = codes[size_t(r) * size_t(k / 2) + size_t(kk / 2)];
    const int code = (kk & 1) ? (byte >> 4) : (byte & 15);
    const size_t si = size_t(e) * size_t(groups * n) + size_t(kk / kGroup) * size_t(n) + size_t(j);
    double p = double(code) * double(__bfloat162float(scales[si]));
    if (twice) p = double(__bfloat162float(__double2bfloat16(p)));
    const double v = p + double(__bfloat162float(biases[si]));
    w[i] = __double2bfloat16(v);
  }
}

// max |a - b| and max |b| over n bf16 values; a non-finite a or b counts as an infinite
// difference. Non-negative floats order as their bit patterns, hence the integer atomics.
__global__ void max_diff(const __nv_bfloat16* a, const __nv_bfloat16* b, size_t n,
                         unsigned* out) {
  float d = 0.0f, m = 0.0f;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float fa = __bfloat162float(a[i]), fb = __bfloat162float(b[i]);
    const float di = (isfinite(fa) && isfinite(fb)) ? fabsf(fa - fb) : INFINITY;
    d = fmaxf(d, di);
    m = fmaxf(m, fabsf(fb));
  }
  atomicMax(&out[0], __float_as_uint(d));
  atomicMax(&out[1], __float_as_uint(m));
}

static void* dmalloc(size_t bytes) {
  void* p = nullptr;
  CK(cudaMalloc(&p, bytes));
  return p;
}

constexpr int kFillGrid = 1024, kFillBlock = 256;

// Copies of the weights cycled through, together more bytes than L2 holds (50 MB on an
// H100), so that every call reads its weights from DRAM as a model's layers do.
constexpr double kRotateBytes = 256e6;
static int copies_for(double bytes) {
  return std::max(2, int(std::ceil(kRotateBytes / bytes)));
}

// y [m, n] = x [m, k] @ w [n, k]^T in bf16, float accumulation: cuBLAS column-major
// y^T [n, m] = (w as column-major [k, n])^T . (x as column-major [k, m]).
static void cublas_bf16(cublasHandle_t h, const void* x, const void* w, void* y, int m, int n,
                        int k) {
  const float one = 1.0f, zero = 0.0f;
  CUBLAS_CK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, CUDA_R_16BF, k, x,
                         CUDA_R_16BF, k, &zero, y, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT));
}

// ---------------------------------------------------------------------------------------
// The check. CUTLASS's y against cuBLAS's y on the dequantized weight: max |a - b| / max |b|
// over the whole product must stay below kMaxRelErr. What separates them when both are
// right: (1) both round y to bf16, up to 2^-8 of max |y| between them; (2) CUTLASS's w may
// be rounded twice (code * scale to bf16, then + bias) where the reference rounds once:
// code * scale carries up to 12 significant bits, so its rounding moves w by up to
// 2^-9 * 15 |scale| against w's spread of about 4.6 |scale|, independently per element, so
// the sum over K moves y by about 0.0035 of max |y| (a float64 simulation of this data,
// bf16 roundings emulated, M 512, K 4096, N 2048: 0.0035 from (2), 0.0072 with (1));
// (3) float32 accumulation in another order, K * 2^-24, negligible. Under 0.01 when both
// are right; a wrong layout, scale or zero point moves y by a large fraction of max |y|
// (a zero point left out moves every w by its bias, about 7.5 |scale|). Hence 0.02.
// The driver also prints the error against a reference whose w is rounded twice, which
// says which rounding CUTLASS's build does (not checked: both are what it may do).
// The reference itself: cuBLAS's y at sampled (row, column) pairs against a float64 dot of
// the same bf16 inputs on the host, to the same bound (only (1) and (3) apply).
// ---------------------------------------------------------------------------------------
constexpr double kMaxRelErr = 2e-2;

struct Check {
  double rel;
  bool ok;
};
static Check compare(const void* a, const void* b, size_t n, unsigned* scratch) {
  CK(cudaMemset(scratch, 0, 2 * sizeof(unsigned)));
  max_diff<<<kFillGrid, kFillBlock>>>((const __nv_bfloat16*)a, (const __nv_bfloat16*)b, n,
                                      scratch);
  CK(cudaGetLastError());
  unsigned h[2];
  CK(cudaMemcpy(h, scratch, sizeof(h), cudaMemcpyDeviceToHost));
  float d, m;
  memcpy(&d, &h[0], 4);
  memcpy(&m, &h[1], 4);
  const double rel = m > 0 ? double(d) / double(m) : INFINITY;  // all-zero y is a failure
  return {rel, std::isfinite(rel) && rel <= kMaxRelErr};
}

static float bf16_to_float(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// cuBLAS's y [m, n] (row-major, ld n) at 256 sampled points against float64 dots of x
// [m, k] and w [n, k] (both device bf16; rows copied one at a time).
static Check check_reference(const void* x, const void* w, const void* y, int m, int n, int k,
                             uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint16_t> xr(k), wr(k);
  double max_d = 0, max_ref = 0;
  for (int s = 0; s < 256; ++s) {
    const int i = int(rng() % uint64_t(m)), j = int(rng() % uint64_t(n));
    uint16_t yv;
    CK(cudaMemcpy(xr.data(), (const uint16_t*)x + size_t(i) * k, 2 * size_t(k),
                  cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(wr.data(), (const uint16_t*)w + size_t(j) * k, 2 * size_t(k),
                  cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&yv, (const uint16_t*)y + size_t(i) * n + j, 2, cudaMemcpyDeviceToHost));
    double ref = 0;
    for (int kk = 0; kk < k; ++kk) ref += double(bf16_to_float(xr[kk])) * bf16_to_float(wr[kk]);
    const double got = bf16_to_float(yv);
    max_d = std::isfinite(got) ? std::max(max_d, std::fabs(got - ref)) : INFINITY;
    max_ref = std::max(max_ref, std::fabs(ref));
  }
  const double rel = max_ref > 0 ? max_d / max_ref : INFINITY;
  return {rel, std::isfinite(rel) && rel <= kMaxRelErr};
}

// ---------------------------------------------------------------------------------------
// Timing: every implementation back to back in one process. Per sample one event pair
// around `calls` calls (each on the next copy of its weights); the median over samples.
// ---------------------------------------------------------------------------------------
struct Timed {
  std::string name;
  std::function<void(int)> launch;  // the call on weight copy i
  int copies;
  std::vector<float> us;
  int next = 0;  // the copy the next call takes: the rotation runs on across samples
  void call() {
    launch(next);
    next = (next + 1) % copies;
  }
};

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct TimingOptions {
  int samples = 9, calls = 0, warmup = 3;
};

static void time_all(std::vector<Timed>& ts, const TimingOptions& o, cudaStream_t stream) {
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  std::vector<int> calls(ts.size(), o.calls);
  for (size_t t = 0; t < ts.size(); ++t) {
    for (int i = 0; i < o.warmup * ts[t].copies; ++i) ts[t].call();
    CK(cudaStreamSynchronize(stream));
    CK(cudaGetLastError());
    if (calls[t] <= 0) {  // enough calls for about 5 ms per sample, at least one per copy
      CK(cudaEventRecord(start, stream));
      for (int i = 0; i < ts[t].copies; ++i) ts[t].call();
      CK(cudaEventRecord(stop, stream));
      CK(cudaEventSynchronize(stop));
      float ms;
      CK(cudaEventElapsedTime(&ms, start, stop));
      const double per_call_ms = std::max(1e-3, double(ms) / ts[t].copies);
      calls[t] = std::max(ts[t].copies, int(std::ceil(5.0 / per_call_ms)));
    }
  }
  for (int s = 0; s < o.samples; ++s) {
    for (size_t t = 0; t < ts.size(); ++t) {
      CK(cudaEventRecord(start, stream));
      for (int i = 0; i < calls[t]; ++i) ts[t].call();
      CK(cudaEventRecord(stop, stream));
      CK(cudaEventSynchronize(stop));
      CK(cudaGetLastError());
      float ms;
      CK(cudaEventElapsedTime(&ms, start, stop));
      ts[t].us.push_back(1e3f * ms / calls[t]);
    }
  }
  CK(cudaEventDestroy(start));
  CK(cudaEventDestroy(stop));
}

static void report(const char* shape, std::vector<Timed>& ts, double flops) {
  const double ref_us = median(ts[0].us);  // ts[0] is cuBLAS's bf16 GEMM
  for (auto& t : ts) {
    const double us = median(t.us);
    const auto mm = std::minmax_element(t.us.begin(), t.us.end());
    printf("%-28s %-26s %10.2f us %8.1f TFLOP/s %7.3fx cuBLAS bf16   (samples %.2f..%.2f us)\n",
           shape, t.name.c_str(), us, flops / (us * 1e-6) / 1e12, ref_us / us, *mm.first,
           *mm.second);
  }
  fflush(stdout);
}

// After timing, one more call checked as before: the timed calls ran on state that the
// first check did not see (a stream-K kernel's flags, a scheduler's workspace).
static bool recheck(const char* shape, const char* name, const std::function<void()>& launch,
                    void* y, const void* y_ref, size_t n, cudaStream_t stream,
                    unsigned* scratch) {
  CK(cudaMemset(y, 0xff, 2 * n));
  launch();
  CK(cudaStreamSynchronize(stream));
  CK(cudaGetLastError());
  const Check c = compare(y, y_ref, n, scratch);
  printf("%-28s %-26s recheck after timing: max rel err %.3g %s\n", shape, name, c.rel,
         c.ok ? "ok" : "FAIL");
  return c.ok;
}

// ---------------------------------------------------------------------------------------
// The dense product.
// ---------------------------------------------------------------------------------------
struct DenseWeights {  // one 4-bit weight [n, k], its copies, and its dequantized copies
  int64_t n, k;
  std::vector<Code*> codes;  // CUTLASS's reordered codes, one per copy
  std::vector<Bf16*> scales, zeros;
  std::vector<void*> w_bf16;  // dequantized [n, k], one per copy
};

struct DenseRunner {
  virtual ~DenseRunner() = default;
  virtual const char* name() const = 0;
  // Arguments and workspace for every weight copy, y [m, n]; "" or why it cannot run.
  virtual std::string prepare(const DenseWeights& w, const void* x, void* y, int m,
                              int sm_count) = 0;
  virtual void launch(int copy, cudaStream_t stream) = 0;
};

template <class Cfg>
struct CutlassDense : DenseRunner {
  using Gemm = typename Cfg::Gemm;
  const char* name_;
  std::vector<std::unique_ptr<Gemm>> gemms;
  std::vector<void*> workspaces;
  explicit CutlassDense(const char* name) : name_(name) {}
  ~CutlassDense() override {
    for (void* p : workspaces) cudaFree(p);
  }
  const char* name() const override { return name_; }
  std::string prepare(const DenseWeights& w, const void* x, void* y, int m,
                      int sm_count) override {
    for (void* p : workspaces) CK(cudaFree(p));
    gemms.clear();
    workspaces.clear();
    const int n = int(w.n), k = int(w.k);
    const auto shape_w = cute::make_shape(n, k, 1);
    const LayoutWReordered layout_w = cute::tile_to_shape(LayoutAtomW{}, shape_w);
    const auto stride_x = cutlass::make_cute_packed_stride(StrideX{}, cute::make_shape(m, k, 1));
    using StrideS = typename Cfg::Mainloop::StrideScale;
    const auto stride_s =
        cutlass::make_cute_packed_stride(StrideS{}, cute::make_shape(n, k / kGroup, 1));
    using StrideC = typename Gemm::GemmKernel::StrideC;
    using StrideY = typename Gemm::GemmKernel::StrideD;
    const auto stride_c = cutlass::make_cute_packed_stride(StrideC{}, cute::make_shape(n, m, 1));
    const auto stride_y = cutlass::make_cute_packed_stride(StrideY{}, cute::make_shape(n, m, 1));
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = sm_count;
    for (size_t c = 0; c < w.codes.size(); ++c) {
      typename Gemm::Arguments args{
          cutlass::gemm::GemmUniversalMode::kGemm,
          {n, m, k, 1},
          {w.codes[c], layout_w, (const Bf16*)x, stride_x, w.scales[c], stride_s, kGroup,
           w.zeros[c]},
          {{1.0f, 0.0f}, nullptr, stride_c, (Bf16*)y, stride_y},
          hw};
      auto g = std::make_unique<Gemm>();
      if (g->can_implement(args) != cutlass::Status::kSuccess)
        return "can_implement refused the problem";
      const size_t ws = Gemm::get_workspace_size(args);
      void* wsp = ws ? dmalloc(ws) : nullptr;
      workspaces.push_back(wsp);
      const cutlass::Status st = g->initialize(args, wsp);
      if (st != cutlass::Status::kSuccess)
        return std::string("initialize: ") + cutlassGetStatusString(st);
      gemms.push_back(std::move(g));
    }
    return "";
  }
  void launch(int copy, cudaStream_t stream) override { CUTLASS_CK(gemms[copy]->run(stream)); }
};

// The configurations a run can sweep. Example 55's for int4 x bf16 is the first: 128x128
// (weight rows x rows of x) by 64 k, no cluster, the cooperative warp-specialized kernel
// (two consumer warpgroups on one tile). The others: 64 rows of x per tile (a 64-row
// product pads nothing), the ping-pong kernel (the two consumer warpgroups on alternate
// tiles, so one's epilogue overlaps the other's mainloop), a 2x1 cluster (two weight
// tiles share one x tile through TMA multicast, halving x's L2 traffic), and for few
// rows of x, where 14336 / 128 = 112 tiles leave 20 of 132 SMs idle: 64x64 ping-pong
// tiles (224) and stream-K (the K loop split to fill every SM).
using DenseCoop128x128 = DenseConfig<128, 128, 1, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                     cutlass::epilogue::TmaWarpSpecializedCooperative>;
#ifndef JQ_CUTLASS_ONE_CONFIG
using DenseCoop128x64 = DenseConfig<128, 64, 1, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                    cutlass::epilogue::TmaWarpSpecializedCooperative>;
using DensePingpong64x128 = DenseConfig<64, 128, 1, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                        cutlass::epilogue::TmaWarpSpecialized>;
using DenseCoop128x128C2 =
    DenseConfig<128, 128, 2, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                cutlass::epilogue::TmaWarpSpecializedCooperative>;
using DensePingpong64x64 = DenseConfig<64, 64, 1, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                       cutlass::epilogue::TmaWarpSpecialized>;
using DenseCoop128x64StreamK =
    DenseConfig<128, 64, 1, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                cutlass::epilogue::TmaWarpSpecializedCooperative, cutlass::gemm::StreamKScheduler>;
#endif

static std::vector<std::unique_ptr<DenseRunner>> dense_runners() {
  std::vector<std::unique_ptr<DenseRunner>> r;
  r.emplace_back(new CutlassDense<DenseCoop128x128>("cutlass_coop_128x128"));
#ifndef JQ_CUTLASS_ONE_CONFIG
  r.emplace_back(new CutlassDense<DenseCoop128x64>("cutlass_coop_128x64"));
  r.emplace_back(new CutlassDense<DensePingpong64x128>("cutlass_pingpong_64x128"));
  r.emplace_back(new CutlassDense<DenseCoop128x128C2>("cutlass_coop_128x128_c2x1"));
  r.emplace_back(new CutlassDense<DensePingpong64x64>("cutlass_pingpong_64x64"));
  r.emplace_back(new CutlassDense<DenseCoop128x64StreamK>("cutlass_coop_128x64_streamk"));
#endif
  return r;
}

struct Options {
  std::string mode = "dense";
  std::vector<int> ms = {64, 512, 4096};
  int k = 4096, n = 14336;
  int experts = 32, tokens = 4096, gk = 2944, gn = 5760;
  std::string configs = "all";
  bool list = false;
  TimingOptions timing;
};

static bool selected(const Options& o, const char* name) {
  if (o.configs == "all") return true;
  std::string s = "," + o.configs + ",";
  return s.find("," + std::string(name) + ",") != std::string::npos;
}

// Makes a 4-bit weight of `experts` x [n, k] (dequantized copy included) and its copies;
// codes reordered per expert for CUTLASS. `dequant_copies` of the bf16 weight.
struct QuantData {
  uint8_t* codes_plain;  // [experts * n, k/2], affine4's byte order
  Bf16 *scales, *biases;  // [experts][k/64][n]
  void* w_bf16;           // [experts * n, k]
  void* w_bf16_twice;     // the same rounded twice (twice_too), else null
};

static QuantData make_quant(int64_t experts, int64_t n, int64_t k, uint64_t seed,
                            bool twice_too) {
  QuantData d;
  const size_t rows = size_t(experts * n);
  const size_t code_bytes = rows * size_t(k / 2), n_scales = rows * size_t(k / kGroup);
  d.codes_plain = (uint8_t*)dmalloc(code_bytes);
  d.scales = (Bf16*)dmalloc(2 * n_scales);
  d.biases = (Bf16*)dmalloc(2 * n_scales);
  d.w_bf16 = dmalloc(2 * rows * size_t(k));
  fill_w<<<kFillGrid, kFillBlock>>>(d.codes_plain, code_bytes, (__nv_bfloat16*)d.scales,
                                    (__nv_bfloat16*)d.biases, n_scales, seed);
  CK(cudaGetLastError());
  dequant_w<<<kFillGrid, kFillBlock>>>(d.codes_plain, (const __nv_bfloat16*)d.scales,
                                       (const __nv_bfloat16*)d.biases, (__nv_bfloat16*)d.w_bf16,
                                       int64_t(rows), n, k, false);
  CK(cudaGetLastError());
  d.w_bf16_twice = nullptr;
  if (twice_too) {
    d.w_bf16_twice = dmalloc(2 * rows * size_t(k));
    dequant_w<<<kFillGrid, kFillBlock>>>(
        d.codes_plain, (const __nv_bfloat16*)d.scales, (const __nv_bfloat16*)d.biases,
        (__nv_bfloat16*)d.w_bf16_twice, int64_t(rows), n, k, true);
    CK(cudaGetLastError());
  }
  CK(cudaDeviceSynchronize());
  return d;
}

// The codes of expert e reordered into CUTLASS's layout (`dst` holds experts * n * k/2 bytes).
// CUTLASS's reorder_tensor copies in tiles of 128 codes along K with no bound check: at
// K = 2880 (gpt-oss-20b's experts) compute-sanitizer saw it read past the last expert's
// codes. So K is a multiple of 128 here (kReorderK), which the kernels themselves do not
// need (a multiple of the tile's 64).
constexpr int kReorderK = 128;

static void reorder_codes(const uint8_t* src, uint8_t* dst, int64_t experts, int n, int k) {
  const auto shape_w = cute::make_shape(n, k, 1);
  const auto stride_w = cutlass::make_cute_packed_stride(StrideW{}, shape_w);
  const auto layout_w = cute::make_layout(shape_w, stride_w);
  const LayoutWReordered layout_r = cute::tile_to_shape(LayoutAtomW{}, shape_w);
  const size_t expert_bytes = size_t(n) * size_t(k) / 2;
  for (int64_t e = 0; e < experts; ++e)
    cutlass::reorder_tensor((const Code*)(src + e * expert_bytes), layout_w,
                            (Code*)(dst + e * expert_bytes), layout_r);
}

static void print_header(const char* what) {
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  int rt = 0, drv = 0, cublas_v = 0;
  CK(cudaRuntimeGetVersion(&rt));
  CK(cudaDriverGetVersion(&drv));
  cublasHandle_t h;
  CUBLAS_CK(cublasCreate(&h));
  CUBLAS_CK(cublasGetVersion(h, &cublas_v));
  CUBLAS_CK(cublasDestroy(h));
  const time_t now = time(nullptr);
  char date[32];
  strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
  printf("# %s | device %s (sm_%d%d, %d SMs, L2 %d MB) | CUDA runtime %d driver %d | cuBLAS %d "
         "| CUTLASS %d.%d.%d | %s\n",
         what, p.name, p.major, p.minor, p.multiProcessorCount, p.l2CacheSize >> 20, rt, drv,
         cublas_v, CUTLASS_MAJOR, CUTLASS_MINOR, CUTLASS_PATCH, date);
}

static int run_dense(const Options& o, cublasHandle_t h, cudaStream_t stream, int sm_count,
                     unsigned* scratch) {
  const int n = o.n, k = o.k;
  if (k % kReorderK != 0 || n % kAlignY != 0) {
    printf("dense: K must be a multiple of %d and N of %d (got K %d, N %d)\n", kReorderK,
           kAlignY, k, n);
    return 1;
  }
  int failures = 0;
  const int max_m = *std::max_element(o.ms.begin(), o.ms.end());
  void* x = dmalloc(size_t(2) * max_m * k);
  fill_x<<<kFillGrid, kFillBlock>>>((__nv_bfloat16*)x, size_t(max_m) * k, 11);
  CK(cudaGetLastError());
  void* y_ref = dmalloc(size_t(2) * max_m * n);
  void* y = dmalloc(size_t(2) * max_m * n);
  void* y_twice = dmalloc(size_t(2) * max_m * n);

  QuantData q = make_quant(1, n, k, 5, true);
  const size_t code_bytes = size_t(n) * k / 2, n_scales = size_t(n) * (k / kGroup);
  const double q_bytes = double(code_bytes) + 4.0 * n_scales, bf_bytes = 2.0 * n * k;
  DenseWeights w{n, k, {}, {}, {}, {}};
  const int q_copies = copies_for(q_bytes), bf_copies = copies_for(bf_bytes);
  for (int c = 0; c < q_copies; ++c) {
    uint8_t* codes = (uint8_t*)dmalloc(code_bytes);
    Bf16* s = (Bf16*)dmalloc(2 * n_scales);
    Bf16* z = (Bf16*)dmalloc(2 * n_scales);
    if (c == 0) {
      reorder_codes(q.codes_plain, codes, 1, n, k);
    } else {
      CK(cudaMemcpy(codes, w.codes[0], code_bytes, cudaMemcpyDeviceToDevice));
    }
    CK(cudaMemcpy(s, q.scales, 2 * n_scales, cudaMemcpyDeviceToDevice));
    CK(cudaMemcpy(z, q.biases, 2 * n_scales, cudaMemcpyDeviceToDevice));
    w.codes.push_back((Code*)codes);
    w.scales.push_back(s);
    w.zeros.push_back(z);
  }
  w.w_bf16.push_back(q.w_bf16);
  for (int c = 1; c < bf_copies; ++c) {
    void* p = dmalloc(size_t(bf_bytes));
    CK(cudaMemcpy(p, q.w_bf16, size_t(bf_bytes), cudaMemcpyDeviceToDevice));
    w.w_bf16.push_back(p);
  }
  CK(cudaDeviceSynchronize());
  printf("# dense: K %d, N %d, affine4 group %d; weight copies: %d x %.1f MB (4-bit + scales + "
         "zeros), %d x %.1f MB (bf16)\n",
         k, n, kGroup, q_copies, q_bytes / 1e6, bf_copies, bf_bytes / 1e6);

  auto runners = dense_runners();
  for (int m : o.ms) {
    char shape[64];
    snprintf(shape, sizeof(shape), "dense M=%d K=%d N=%d", m, k, n);
    cublas_bf16(h, x, w.w_bf16[0], y_ref, m, n, k);
    cublas_bf16(h, x, q.w_bf16_twice, y_twice, m, n, k);
    CK(cudaDeviceSynchronize());
    const Check rc = check_reference(x, w.w_bf16[0], y_ref, m, n, k, uint64_t(m));
    printf("%-28s %-26s check: cuBLAS vs float64 dot at 256 points, max rel err %.3g (bound "
           "%.0e) %s\n",
           shape, "cublas_bf16", rc.rel, kMaxRelErr, rc.ok ? "ok" : "FAIL");
    failures += !rc.ok;
    std::vector<Timed> ts;
    ts.push_back({"cublas_bf16",
                  [&, m](int c) { cublas_bf16(h, x, w.w_bf16[c], y_ref, m, n, k); }, bf_copies,
                  {}});
    for (auto& r : runners) {
      if (!selected(o, r->name())) continue;
      const std::string why = r->prepare(w, x, y, m, sm_count);
      if (!why.empty()) {
        printf("%-28s %-26s NOT RUN: %s\n", shape, r->name(), why.c_str());
        ++failures;
        continue;
      }
      CK(cudaMemset(y, 0xff, size_t(2) * m * n));  // NaN: a y left unwritten fails the check
      r->launch(0, stream);
      CK(cudaStreamSynchronize(stream));
      CK(cudaGetLastError());
      const Check c = compare(y, y_ref, size_t(m) * n, scratch);
      const Check c2 = compare(y, y_twice, size_t(m) * n, scratch);
      printf("%-28s %-26s check: vs cuBLAS on the dequantized weight, max rel err %.3g "
             "(bound %.0e) %s; vs w rounded twice %.3g\n",
             shape, r->name(), c.rel, kMaxRelErr, c.ok ? "ok" : "FAIL", c2.rel);
      if (!c.ok) {
        ++failures;
        continue;
      }
      DenseRunner* rp = r.get();
      ts.push_back({r->name(), [rp, stream](int c) { rp->launch(c, stream); }, q_copies, {}});
    }
    CUBLAS_CK(cublasSetStream(h, stream));
    time_all(ts, o.timing, stream);
    report(shape, ts, 2.0 * m * double(n) * k);
    for (auto& r : runners) {  // a kernel whose state carries over between calls shows here
      if (std::none_of(ts.begin(), ts.end(), [&](const Timed& t) { return t.name == r->name(); }))
        continue;
      failures += !recheck(shape, r->name(), [&] { r->launch(0, stream); }, y, y_ref,
                           size_t(m) * n, stream, scratch);
    }
  }
  for (void* p : w.w_bf16) CK(cudaFree(p));
  for (size_t c = 0; c < w.codes.size(); ++c) {
    CK(cudaFree(w.codes[c]));
    CK(cudaFree(w.scales[c]));
    CK(cudaFree(w.zeros[c]));
  }
  CK(cudaFree(q.codes_plain));
  CK(cudaFree(q.scales));
  CK(cudaFree(q.biases));
  CK(cudaFree(q.w_bf16_twice));
  CK(cudaFree(x));
  CK(cudaFree(y));
  CK(cudaFree(y_ref));
  CK(cudaFree(y_twice));
  return failures;
}

// ---------------------------------------------------------------------------------------
// The grouped product (example 69's pointer-array kernel): expert e multiplies its rows of
// x [T, K] (rows offset_e .. offset_e + m_e, split evenly) by its weight [N, K].
//
// What CUTLASS's kernel checks (can_implement) is a group equal to K or a multiple of the
// tile's K, which is 64 for bf16 (128 bytes, the TMA box), and 16-byte-aligned rows for
// TMA: K a multiple of 8 for x and of 32 for the codes, N a multiple of 8 for the scale
// and zero rows. gpt-oss-20b's K = 2880 = 45 x 64 would pass, but the weight shuffle needs
// K a multiple of 128 (kReorderK), so the default K is 2944, the next one (2% more work).
//
// On an H200 this kernel, with affine4's scales and zero points per group of 64, stopped
// with an illegal instruction in its producer warp (compute-sanitizer) at K = 2816 and
// 2944, in both configurations. CUTLASS 4.2's int4 x bf16 grouped example says why: "Only
// support row-wise scaling. Zero-points and block-wise scaling is currently not
// supported." The runner is kept for a CUTLASS that does.
// ---------------------------------------------------------------------------------------
struct GroupedRunner {
  virtual ~GroupedRunner() = default;
  virtual const char* name() const = 0;
  virtual std::string prepare(const std::vector<const uint8_t*>& codes,
                              const std::vector<const Bf16*>& scales,
                              const std::vector<const Bf16*>& zeros, const void* x, void* y,
                              const std::vector<int>& rows, int n, int k, int sm_count) = 0;
  virtual void launch(int copy, cudaStream_t stream) = 0;
};

template <class Cfg>
struct CutlassGrouped : GroupedRunner {
  using Gemm = typename Cfg::Gemm;
  using StrideS = typename Cfg::Mainloop::StrideScale;
  using StrideY = typename Gemm::GemmKernel::InternalStrideD;
  const char* name_;
  std::vector<std::unique_ptr<Gemm>> gemms;
  std::vector<void*> allocations;  // workspaces and the per-expert argument arrays
  explicit CutlassGrouped(const char* name) : name_(name) {}
  ~CutlassGrouped() override {
    for (void* p : allocations) cudaFree(p);
  }
  const char* name() const override { return name_; }
  template <class T>
  T* upload(const std::vector<T>& v) {
    T* d = (T*)dmalloc(sizeof(T) * v.size());
    CK(cudaMemcpy(d, v.data(), sizeof(T) * v.size(), cudaMemcpyHostToDevice));
    allocations.push_back(d);
    return d;
  }
  // codes[c] etc.: copy c's base pointers (experts back to back).
  std::string prepare(const std::vector<const uint8_t*>& codes,
                      const std::vector<const Bf16*>& scales,
                      const std::vector<const Bf16*>& zeros, const void* x, void* y,
                      const std::vector<int>& rows, int n, int k, int sm_count) override {
    for (void* p : allocations) CK(cudaFree(p));
    allocations.clear();
    gemms.clear();
    const int experts = int(rows.size());
    const size_t expert_bytes = size_t(n) * k / 2, expert_scales = size_t(n) * (k / kGroup);
    // Every expert's problem, swapped as in the dense case: (N, m_e, K).
    std::vector<typename ProblemShapeG::UnderlyingProblemShape> shapes;
    std::vector<StrideXG> sx;
    std::vector<LayoutWReorderedG> lw;
    std::vector<StrideS> ss;
    std::vector<StrideY> sy;
    std::vector<const Bf16*> px;
    std::vector<Bf16*> py;
    int64_t offset = 0;
    for (int e = 0; e < experts; ++e) {
      const int m = rows[e];
      shapes.push_back({n, m, k});
      sx.push_back(cutlass::make_cute_packed_stride(StrideXG{}, cute::make_shape(m, k, 1)));
      lw.push_back(cute::tile_to_shape(LayoutAtomW{}, cute::make_shape(n, k, Int<1>{})));
      ss.push_back(
          cutlass::make_cute_packed_stride(StrideS{}, cute::make_shape(n, k / kGroup, 1)));
      sy.push_back(cutlass::make_cute_packed_stride(StrideY{}, cute::make_shape(n, m, 1)));
      px.push_back((const Bf16*)x + offset * k);
      py.push_back((Bf16*)y + offset * n);
      offset += m;
    }
    auto* d_shapes = upload(shapes);
    auto* d_sx = upload(sx);
    auto* d_lw = upload(lw);
    auto* d_ss = upload(ss);
    auto* d_sy = upload(sy);
    auto* d_px = upload(px);
    auto* d_py = upload(py);
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = sm_count;
    for (size_t c = 0; c < codes.size(); ++c) {
      std::vector<const Code*> pw;
      std::vector<const Bf16*> ps, pz;
      for (int e = 0; e < experts; ++e) {
        pw.push_back((const Code*)(codes[c] + e * expert_bytes));
        ps.push_back(scales[c] + e * expert_scales);
        pz.push_back(zeros[c] + e * expert_scales);
      }
      typename Gemm::Arguments args;
      decltype(args.epilogue.thread) fusion;
      fusion.alpha = 1.0f;
      fusion.beta = 0.0f;
      fusion.alpha_ptr = nullptr;
      fusion.beta_ptr = nullptr;
      fusion.alpha_ptr_array = nullptr;
      fusion.beta_ptr_array = nullptr;
      fusion.dAlpha = {cute::_0{}, cute::_0{}, 0};
      fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
      args = typename Gemm::Arguments{
          cutlass::gemm::GemmUniversalMode::kGrouped,
          // No host copy of the shapes: with one, can_implement reads each group's
          // strides through the stride arrays, which are device pointers (a host
          // segfault); example 69 passes none either.
          {experts, d_shapes, nullptr},
          {upload(pw), d_lw, d_px, d_sx, upload(ps), d_ss, kGroup, upload(pz)},
          {fusion, nullptr, d_sy, d_py, d_sy},
          hw};
      auto g = std::make_unique<Gemm>();
      if (g->can_implement(args) != cutlass::Status::kSuccess)
        return "can_implement refused the problem";
      const size_t ws = Gemm::get_workspace_size(args);
      void* wsp = dmalloc(std::max<size_t>(ws, 1));
      allocations.push_back(wsp);
      const cutlass::Status st = g->initialize(args, wsp);
      if (st != cutlass::Status::kSuccess)
        return std::string("initialize: ") + cutlassGetStatusString(st);
      gemms.push_back(std::move(g));
    }
    return "";
  }
  void launch(int copy, cudaStream_t stream) override { CUTLASS_CK(gemms[copy]->run(stream)); }
};

// Example 69's tile for int4 x bf16 is 128 weight rows x 16 rows of x (its experts' row
// counts are small and random); at 128 rows per expert (gpt-oss-20b, T = 4096) 128x128
// covers an expert's rows in one tile and decodes each weight tile once.
using GroupedCoop128x16 = GroupedConfig<128, 16>;
#ifndef JQ_CUTLASS_ONE_CONFIG
using GroupedCoop128x128 = GroupedConfig<128, 128>;
#endif

static std::vector<std::unique_ptr<GroupedRunner>> grouped_runners() {
  std::vector<std::unique_ptr<GroupedRunner>> r;
  r.emplace_back(new CutlassGrouped<GroupedCoop128x16>("cutlass_grouped_128x16"));
#ifndef JQ_CUTLASS_ONE_CONFIG
  r.emplace_back(new CutlassGrouped<GroupedCoop128x128>("cutlass_grouped_128x128"));
#endif
  return r;
}

static int run_grouped(const Options& o, cublasHandle_t h, cudaStream_t stream, int sm_count,
                       unsigned* scratch) {
  const int experts = o.experts, t = o.tokens, n = o.gn, k = o.gk;
  if (k % kReorderK != 0 || n % kAlignY != 0 || experts < 1 || t < experts) {
    printf("grouped: K must be a multiple of %d, N of %d, 1 <= experts <= tokens (got K %d, "
           "N %d, E %d, T %d)\n",
           kReorderK, kAlignY, k, n, experts, t);
    return 1;
  }
  int failures = 0;
  std::vector<int> rows(experts, t / experts);
  for (int e = 0; e < t % experts; ++e) ++rows[e];
  void* x = dmalloc(size_t(2) * t * k);
  fill_x<<<kFillGrid, kFillBlock>>>((__nv_bfloat16*)x, size_t(t) * k, 13);
  CK(cudaGetLastError());
  void* y_ref = dmalloc(size_t(2) * t * n);
  void* y = dmalloc(size_t(2) * t * n);

  QuantData q = make_quant(experts, n, k, 7, false);
  const size_t code_bytes = size_t(experts) * n * k / 2;
  const size_t n_scales = size_t(experts) * n * (k / kGroup);
  const double q_bytes = double(code_bytes) + 4.0 * n_scales;
  const int q_copies = copies_for(q_bytes);
  std::vector<const uint8_t*> codes;
  std::vector<const Bf16*> scales, zeros;
  std::vector<void*> owned;
  for (int c = 0; c < q_copies; ++c) {
    uint8_t* cp = (uint8_t*)dmalloc(code_bytes);
    Bf16* s = (Bf16*)dmalloc(2 * n_scales);
    Bf16* z = (Bf16*)dmalloc(2 * n_scales);
    if (c == 0)
      reorder_codes(q.codes_plain, cp, experts, n, k);
    else
      CK(cudaMemcpy(cp, codes[0], code_bytes, cudaMemcpyDeviceToDevice));
    CK(cudaMemcpy(s, q.scales, 2 * n_scales, cudaMemcpyDeviceToDevice));
    CK(cudaMemcpy(z, q.biases, 2 * n_scales, cudaMemcpyDeviceToDevice));
    codes.push_back(cp);
    scales.push_back(s);
    zeros.push_back(z);
    owned.insert(owned.end(), {cp, s, z});
  }
  // The dense peer of equal FLOPs: x [T, K] @ W [N, K]^T, one bf16 weight (its copies).
  const double dense_bytes = 2.0 * n * k;
  const int dense_copies = copies_for(dense_bytes);
  std::vector<void*> dense_w;
  for (int c = 0; c < dense_copies; ++c) {
    void* p = dmalloc(size_t(dense_bytes));
    CK(cudaMemcpy(p, q.w_bf16, size_t(dense_bytes), cudaMemcpyDeviceToDevice));  // expert 0
    dense_w.push_back(p);
  }
  CK(cudaDeviceSynchronize());
  printf("# grouped: E %d, T %d (rows per expert %d..%d), K %d, N %d, affine4 group %d; weight "
         "copies: %d x %.1f MB (4-bit + scales + zeros), dense peer %d x %.1f MB (bf16)\n",
         experts, t, rows.back(), rows.front(), k, n, kGroup, q_copies, q_bytes / 1e6,
         dense_copies, dense_bytes / 1e6);

  char shape[64];
  snprintf(shape, sizeof(shape), "grouped E=%d T=%d K=%d N=%d", experts, t, k, n);
  // The reference: each expert's rows through cuBLAS on its dequantized weight.
  auto grouped_reference = [&](void* out) {
    int64_t off = 0;
    for (int e = 0; e < experts; ++e) {
      if (rows[e] > 0)
        cublas_bf16(h, (const uint16_t*)x + off * k,
                    (const uint16_t*)q.w_bf16 + size_t(e) * n * k, (uint16_t*)out + off * n,
                    rows[e], n, k);
      off += rows[e];
    }
  };
  grouped_reference(y_ref);
  CK(cudaDeviceSynchronize());
  {  // the reference at sampled points of the first and the last expert
    const Check r0 = check_reference(x, q.w_bf16, y_ref, rows[0], n, k, 1);
    const int64_t last = t - rows.back();
    const Check r1 = check_reference((const uint16_t*)x + last * k,
                                     (const uint16_t*)q.w_bf16 + size_t(experts - 1) * n * k,
                                     (const uint16_t*)y_ref + last * n, rows.back(), n, k, 2);
    const bool ok = r0.ok && r1.ok;
    printf("%-28s %-26s check: per-expert cuBLAS vs float64 dot at 2 x 256 points, max rel "
           "err %.3g (bound %.0e) %s\n",
           shape, "cublas_bf16_per_expert", std::max(r0.rel, r1.rel), kMaxRelErr,
           ok ? "ok" : "FAIL");
    failures += !ok;
  }
  std::vector<Timed> ts;
  ts.push_back({"cublas_bf16_dense_TxK.KxN",
                [&](int c) { cublas_bf16(h, x, dense_w[c], y_ref, t, n, k); }, dense_copies, {}});
  auto runners = grouped_runners();
  for (auto& r : runners) {
    if (!selected(o, r->name())) continue;
    const std::string why = r->prepare(codes, scales, zeros, x, y, rows, n, k, sm_count);
    if (!why.empty()) {
      printf("%-28s %-26s NOT RUN: %s\n", shape, r->name(), why.c_str());
      ++failures;
      continue;
    }
    CK(cudaMemset(y, 0xff, size_t(2) * t * n));
    r->launch(0, stream);
    CK(cudaStreamSynchronize(stream));
    CK(cudaGetLastError());
    const Check c = compare(y, y_ref, size_t(t) * n, scratch);
    printf("%-28s %-26s check: vs per-expert cuBLAS on the dequantized weights, max rel err "
           "%.3g (bound %.0e) %s\n",
           shape, r->name(), c.rel, kMaxRelErr, c.ok ? "ok" : "FAIL");
    if (!c.ok) {
      ++failures;
      continue;
    }
    GroupedRunner* rp = r.get();
    ts.push_back({r->name(), [rp, stream](int c) { rp->launch(c, stream); }, q_copies, {}});
  }
  CUBLAS_CK(cublasSetStream(h, stream));
  time_all(ts, o.timing, stream);
  report(shape, ts, 2.0 * t * double(n) * k);
  grouped_reference(y_ref);  // the dense peer's calls overwrote it
  CK(cudaDeviceSynchronize());
  for (auto& r : runners) {
    if (std::none_of(ts.begin(), ts.end(), [&](const Timed& tt) { return tt.name == r->name(); }))
      continue;
    failures += !recheck(shape, r->name(), [&] { r->launch(0, stream); }, y, y_ref,
                         size_t(t) * n, stream, scratch);
  }
  for (void* p : owned) CK(cudaFree(p));
  for (void* p : dense_w) CK(cudaFree(p));
  CK(cudaFree(q.codes_plain));
  CK(cudaFree(q.scales));
  CK(cudaFree(q.biases));
  CK(cudaFree(q.w_bf16));
  CK(cudaFree(x));
  CK(cudaFree(y));
  CK(cudaFree(y_ref));
  return failures;
}

static bool parse_int(const char* s, int* out) {
  char* end = nullptr;
  const long v = strtol(s, &end, 10);
  if (end == s || *end != '\0' || v <= 0 || v > (1L << 30)) return false;
  *out = int(v);
  return true;
}

static bool parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    const std::string key = a.substr(0, eq), val = eq == std::string::npos ? "" : a.substr(eq + 1);
    bool ok = true;
    if (key == "--mode") {
      o->mode = val;
      ok = val == "dense" || val == "grouped" || val == "all";
    } else if (key == "--m") {
      o->ms.clear();
      size_t p = 0;
      while (ok && p <= val.size()) {
        const size_t c = val.find(',', p);
        const std::string tok = val.substr(p, c == std::string::npos ? std::string::npos : c - p);
        int v;
        ok = parse_int(tok.c_str(), &v);
        if (ok) o->ms.push_back(v);
        if (c == std::string::npos) break;
        p = c + 1;
      }
    } else if (key == "--k") ok = parse_int(val.c_str(), &o->k);
    else if (key == "--n") ok = parse_int(val.c_str(), &o->n);
    else if (key == "--experts") ok = parse_int(val.c_str(), &o->experts);
    else if (key == "--tokens") ok = parse_int(val.c_str(), &o->tokens);
    else if (key == "--gk") ok = parse_int(val.c_str(), &o->gk);
    else if (key == "--gn") ok = parse_int(val.c_str(), &o->gn);
    else if (key == "--samples") ok = parse_int(val.c_str(), &o->timing.samples);
    else if (key == "--warmup") ok = parse_int(val.c_str(), &o->timing.warmup);
    else if (key == "--calls") {
      ok = val == "0" || parse_int(val.c_str(), &o->timing.calls);
      if (val == "0") o->timing.calls = 0;
    } else if (key == "--configs") {
      o->configs = val;
      ok = !val.empty();
    } else if (key == "--list") o->list = true;
    else ok = false;
    if (!ok) {
      printf("bad argument: %s\n", argv[i]);
      return false;
    }
  }
  return true;
}

int main(int argc, char** argv) {
  // Line-buffered even into a pipe: a run stopped by a time limit still shows how far
  // it got (a pipe's default block buffer holds a slow run's lines until its end).
  setvbuf(stdout, nullptr, _IOLBF, 0);
  Options o;
  if (!parse(argc, argv, &o)) {
    printf("usage: %s [--mode=dense|grouped|all] [--m=64,512,4096] [--k=4096] [--n=14336]\n"
           "  [--experts=32] [--tokens=4096] [--gk=2944] [--gn=5760] [--configs=all|NAME,...]\n"
           "  [--samples=9] [--calls=0] [--warmup=3] [--list]\n",
           argv[0]);
    return 2;
  }
  std::vector<std::string> names;
  for (auto& r : dense_runners()) names.push_back(r->name());
  for (auto& r : grouped_runners()) names.push_back(r->name());
  if (o.list) {
    for (auto& name : names) printf("%s\n", name.c_str());
    return 0;
  }
  if (o.configs != "all") {  // a misspelt name would otherwise time nothing, silently
    size_t p = 0;
    while (p <= o.configs.size()) {
      const size_t c = o.configs.find(',', p);
      const std::string name = o.configs.substr(p, c == std::string::npos ? c : c - p);
      if (std::find(names.begin(), names.end(), name) == names.end()) {
        printf("unknown configuration '%s' (--list names them)\n", name.c_str());
        return 2;
      }
      if (c == std::string::npos) break;
      p = c + 1;
    }
  }
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  if (p.major != 9 || p.minor != 0) {
    printf("needs an sm_90 GPU (H100/H200): this one is %s, sm_%d%d\n", p.name, p.major,
           p.minor);
    return 1;
  }
  cublasHandle_t h;
  CUBLAS_CK(cublasCreate(&h));
  cudaStream_t stream;
  // A blocking stream: the checks' memsets, copies and kernels on the default stream order
  // with it.
  CK(cudaStreamCreate(&stream));
  CUBLAS_CK(cublasSetStream(h, stream));
  unsigned* scratch = (unsigned*)dmalloc(2 * sizeof(unsigned));
  int failures = 0;
  if (o.mode == "dense" || o.mode == "all") {
    print_header("dense");
    failures += run_dense(o, h, stream, p.multiProcessorCount, scratch);
  }
  if (o.mode == "grouped" || o.mode == "all") {
    print_header("grouped");
    failures += run_grouped(o, h, stream, p.multiProcessorCount, scratch);
  }
  CK(cudaFree(scratch));
  CUBLAS_CK(cublasDestroy(h));
  CK(cudaStreamDestroy(stream));
  printf("# %s\n", failures ? "FAILED" : "all checks passed");
  return failures ? 1 : 0;
}
