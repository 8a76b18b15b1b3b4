// A standalone driver of the tensor-core kernels on the cuda_mma layout, the
// decode GEMV (gemv_mma.h) and the prefill GEMM (qmm_gemm.h), no JAX, for
// compute-sanitizer (tools/gpu/check_decode.sh and check_prefill.sh run it):
//   nvcc -x cu -std=c++17 -Iinclude -Igpu_src/common -Igpu_src/cuda tools/cuda/sanitize_mma_driver.hip \
//        -L<lib dir> -ljaxquant_cuda -o sanitize_mma_driver
//   compute-sanitizer --tool memcheck --error-exitcode 9 ./sanitize_mma_driver
// Random codes and scales (every bit pattern is a valid code) in buffers of the
// exact size, so any read past them is an error: tails (N % 16), odd N x groups
// (unaligned expert bases), float32 scales, M = 1 / 9 / 16, every x dtype,
// gather with repeated experts (dedupe) and ids outside [0, E) (NaN rows); the
// GEMM with M = 17 / 64 / 100 and ragged group sizes with empty groups, sizes
// past T, rows past the groups (zero); the layout's dequantize; the fused GEMVs
// (rms_norm_qmm's norm with and without a weight, N with a tail; qmm_swiglu's
// silu / gpt_oss with and without a bias, two slots; rms_norm_qmm_swiglu; qmm_add's
// addend, N with a tail; gather_qmm_swiglu with bad ids, a bias per expert and dedupe);
// ragged_matmul's GEMM on float experts (sm_90). Values are checked by
// tests/test_decode_gpu.py, test_prefill_gpu.py and test_fused.py's GPU tests; here: NaN
// rows exactly where the ids are bad, zero rows past the groups, every output
// element written. Not part of the library.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <random>
#include <vector>

#include "cuda_check.h"  // CK
#include "qmm_gemm.h"

using namespace jq;
using namespace jq::gpu::mma;

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

constexpr int kUnwritten = 0xff;  // y's bytes before a launch: a NaN no kernel writes

struct Case {
  int fmt, bits, group, scale_dt, x_dt;
};

// Random buffers of exactly the problem's size: S slots of M rows (Sx x rows),
// E experts [N, K].
static QmvProblem make_problem(const Case& c, int64_t E, int64_t N, int64_t K, int64_t S,
                               int64_t Sx, int64_t M, const std::vector<int32_t>* ids) {
  std::mt19937 rng(1234 + (int)N + (int)K + c.fmt * 7 + c.bits);
  const int64_t words = K * c.bits / 32, groups = K / c.group;
  const int ssz = c.scale_dt == kU8 ? 1 : (c.scale_dt == kF32 ? 4 : 2);
  const int esz = c.x_dt == kF32 ? 4 : 2;
  QmvProblem q{};
  q.fmt = c.fmt;
  q.bits = c.bits;
  q.group = c.group;
  q.S = S;
  q.M = M;
  q.N = N;
  q.K = K;
  q.E = E;
  q.Sx = Sx;
  q.x_div = S / Sx;
  q.words = words;
  q.groups = groups;
  q.x_dt = c.x_dt;
  q.scale_dt = c.scale_dt;
  // scales: small positive values (bf16/f16/f32 bit patterns of ~0.01..1; E8M0 codes 100..140)
  std::vector<uint8_t> sh(E * N * groups * ssz);
  for (size_t i = 0; i < sh.size() / ssz; ++i) {
    const float v = 0.01f + (rng() % 1000) / 1000.0f;
    uint32_t b;
    memcpy(&b, &v, 4);
    if (ssz == 1) sh[i] = (uint8_t)(c.fmt == kNvfp4 ? 40 + rng() % 60 : 100 + rng() % 40);
    else if (ssz == 2) {
      const uint16_t h = c.scale_dt == kBF16 ? (uint16_t)(b >> 16) : f32_to_f16(v);
      memcpy(&sh[2 * i], &h, 2);
    } else memcpy(&sh[4 * i], &b, 4);
  }
  void* scales = nullptr;
  CK(cudaMalloc(&scales, sh.size()));
  CK(cudaMemcpy(scales, sh.data(), sh.size(), cudaMemcpyHostToDevice));
  q.scales = scales;
  if (c.fmt == kAffine) {
    void* biases = nullptr;
    CK(cudaMalloc(&biases, sh.size()));
    CK(cudaMemcpy(biases, sh.data(), sh.size(), cudaMemcpyHostToDevice));
    q.biases = biases;
  }
  if (c.fmt == kNvfp4) {
    const float gs_h = 0.5f;
    float* gs = nullptr;
    CK(cudaMalloc(&gs, 4));
    CK(cudaMemcpy(gs, &gs_h, 4, cudaMemcpyHostToDevice));
    q.global_scale = gs;
  }
  q.data = dev_random<uint32_t>(E * N * words, rng, 0xffffffffu);
  q.x = dev_random<uint16_t>(Sx * M * K * esz / 2, rng, 0x3bffu);  // small finite values
  if (ids) {
    int32_t* idx = nullptr;
    CK(cudaMalloc(&idx, 4 * ids->size()));
    CK(cudaMemcpy(idx, ids->data(), 4 * ids->size(), cudaMemcpyHostToDevice));
    q.indices = idx;
  }
  void* y = nullptr;
  CK(cudaMalloc(&y, S * M * N * esz));
  CK(cudaMemset(y, kUnwritten, S * M * N * esz));  // unwritten elements show
  q.y = y;
  return q;
}

struct Output {
  std::vector<float> v;
  std::vector<bool> unwritten;
};

// y as float32 (and where it still has the bytes of before the launch), then every
// buffer freed.
static Output finish(QmvProblem& q) {
  CK(cudaDeviceSynchronize());
  const int64_t count = q.S * q.M * q.N;
  const int esz = q.x_dt == kF32 ? 4 : 2;
  std::vector<uint8_t> yh(count * esz);
  CK(cudaMemcpy(yh.data(), q.y, yh.size(), cudaMemcpyDeviceToHost));
  Output out{std::vector<float>(count), std::vector<bool>(count)};
  for (int64_t i = 0; i < count; ++i) {
    bool same = true;
    for (int b = 0; b < esz; ++b) same = same && yh[esz * i + b] == kUnwritten;
    out.unwritten[i] = same;
    if (q.x_dt == kF32) memcpy(&out.v[i], &yh[4 * i], 4);
    else {
      uint16_t h;
      memcpy(&h, &yh[2 * i], 2);
      out.v[i] = q.x_dt == kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
    }
  }
  for (const void* p : {(const void*)q.data, q.scales, q.biases, (const void*)q.global_scale,
                        q.x, (const void*)q.indices, (const void*)q.y})
    if (p) cudaFree((void*)p);
  return out;
}

static void fail(const char* what, int fmt, int bits, long long row) {
  ++failures;
  if (failures < 5) printf("  %s: fmt %d bits %d row %lld\n", what, fmt, bits, row);
}

// (random MXFP8 codes include NaN/Inf codes, so only rows that must be NaN or zero
// are checked there)
static bool any_code_nan(int fmt) { return fmt == kMxfp8E5M2 || fmt == kMxfp8E4M3; }

static void run_case(const Case& c, int64_t E, int64_t N, int64_t K, int64_t M,
                     const std::vector<int32_t>* ids, int dedupe) {
  const int64_t S = ids ? (int64_t)ids->size() : E;
  QmvProblem q = make_problem(c, E, N, K, S, S, M, ids);
  Problem P;
  P.q = q;
  P.tiles = (N + 15) / 16;
  P.full_tiles = N / 16;
  P.chunks = K / 64;
  P.dedupe = ids != nullptr && dedupe > 0;
  const int nt = (ids ? (dedupe > 8 ? 2 : 1) : (M > 8 ? 2 : 1));
  CK(c.x_dt == kF32 ? launch_qmv_mma_f32(P, nt, 0)
                    : c.x_dt == kF16 ? launch_qmv_mma_f16(P, nt, 0) : launch_qmv_mma_bf16(P, nt, 0));
  const Output y = finish(q);
  for (int64_t s = 0; s < S; ++s) {
    const bool bad = ids && ((*ids)[s] < 0 || (*ids)[s] >= E);
    for (int64_t j = 0; j < M * N; ++j) {
      const int64_t i = s * M * N + j;
      const bool nan = isnan(y.v[i]);
      if (y.unwritten[i] || (bad ? !nan : (nan && !any_code_nan(c.fmt)))) {
        fail("NaN mismatch", c.fmt, c.bits, s);
        break;
      }
    }
  }
}

// The fused GEMV over S = E matrices of M rows, `kind` as the handler's `fuse`
// (gemv_mma.hip): 1 rms_norm_qmm (aux: the norm weight [K] in x's dtype, or none), 2
// qmm_swiglu (N = 2I; aux: a float32 bias [N], or none; y [E, M, I] of exactly that
// size), 3 rms_norm_qmm_swiglu (the SwiGLU kernel with the norm prologue; aux: the norm
// weight, or none), 4 qmm_add (the plain GEMV; aux: the addend [E, M, N] in x's dtype);
// or gather_qmm_swiglu (kind 2 with ids: slot s of M = 1 row uses expert ids[s]; aux: a
// float32 bias [E, N] or none; y [S, 1, I]). Every output element written, NaN exactly
// in the rows of ids outside [0, E).
static void run_fused_case(const Case& c, int64_t E, int64_t N, int64_t K, int64_t M, int kind,
                           bool with_aux, int activation,
                           const std::vector<int32_t>* ids = nullptr, int dedupe = 0) {
  static const char* kNames[] = {"", "rms_norm_qmm", "qmm_swiglu", "rms_norm_qmm_swiglu",
                                 "qmm_add"};
  const bool swiglu = kind == 2 || kind == 3, norm = kind == 1 || kind == 3, add = kind == 4;
  const int64_t S = ids ? (int64_t)ids->size() : E;
  QmvProblem q = make_problem(c, E, N, K, S, S, M, ids);
  std::mt19937 rng(99 + (int)N + (int)M);
  const int esz = c.x_dt == kF32 ? 4 : 2;
  if (swiglu && c.x_dt == kF16) {
    // f16 x of up to ~1 with E8M0 scales up to 2^13 overflows f16 (|y| to ~1e7): the
    // activation of -inf is NaN, as the unfused ops give. Smaller x (<= 2^-8) keeps
    // y finite, so every NaN below is the kernel's.
    CK(cudaFree(const_cast<void*>(q.x)));
    q.x = dev_random<uint16_t>(S * M * K, rng, 0x1bffu);
  }
  const int64_t out_n = swiglu ? N / 2 : N;
  CK(cudaFree(q.y));  // the output's exact size
  CK(cudaMalloc(&q.y, S * M * out_n * esz));
  CK(cudaMemset(q.y, kUnwritten, S * M * out_n * esz));
  Problem P;
  P.q = q;
  P.tiles = (N + 15) / 16;
  P.full_tiles = N / 16;
  P.chunks = K / 64;
  P.dedupe = ids != nullptr && dedupe > 0;
  void* aux = nullptr;
  // f16 x normalized to a unit RMS overflows as the small x above would: a small norm
  // weight (<= 2^-8) without an offset keeps the SwiGLU's y finite
  const bool small_norm = norm && swiglu && c.x_dt == kF16;
  if (small_norm) with_aux = true;
  if (add) {  // the addend: y's exact size, small values in x's dtype
    aux = esz == 4 ? (void*)dev_random<uint32_t>(S * M * N, rng, 0x3bffffffu)
                   : (void*)dev_random<uint16_t>(S * M * N, rng, 0x3bffu);
    P.addend = aux;
  } else if (with_aux && norm) {  // small positive weights in x's dtype
    aux = esz == 4 ? (void*)dev_random<uint32_t>(K, rng, 0x3bffffffu)
                   : (void*)dev_random<uint16_t>(K, rng, small_norm ? 0x1bffu : 0x3bffu);
    P.norm_w = aux;
    P.norm_dt = c.x_dt;
  } else if (with_aux) {
    aux = dev_random<uint32_t>(ids ? E * N : N, rng, 0x3bffffffu);
    P.bias = aux;
    P.bias_dt = kF32;
    P.bias_stride = ids ? N : 0;
  }
  P.normalize = norm;
  P.eps = 1e-6f;
  P.offset = small_norm ? 0.0f : 1.0f;
  P.activation = activation;
  P.limit = 7.0f;
  P.alpha = 1.702f;
  const int nt = (ids ? dedupe : M) > 8 ? 2 : 1;
  if (add) {
    CK(c.x_dt == kF32   ? launch_qmv_mma_f32(P, nt, 0)
       : c.x_dt == kF16 ? launch_qmv_mma_f16(P, nt, 0)
                        : launch_qmv_mma_bf16(P, nt, 0));
  } else {
    const int fuse = swiglu ? kFuseSwiglu : kFuseNorm;
    CK(c.x_dt == kF32   ? launch_gemv_mma_fused_f32(P, nt, fuse, 0)
       : c.x_dt == kF16 ? launch_gemv_mma_fused_f16(P, nt, fuse, 0)
                        : launch_gemv_mma_fused_bf16(P, nt, fuse, 0));
  }
  q.N = out_n;  // (the launch has its copy) finish reads S x M x out_n outputs
  const Output y = finish(q);
  if (aux) cudaFree(aux);
  for (size_t i = 0; i < y.v.size(); ++i) {
    const int64_t s = (int64_t)i / (M * out_n);
    const bool bad = ids && ((*ids)[s] < 0 || (*ids)[s] >= E);
    const bool nan = isnan(y.v[i]);
    if (y.unwritten[i] || (bad ? !nan : (nan && !any_code_nan(c.fmt)))) {
      char what[64];
      snprintf(what, sizeof what, "%s: %s", kNames[kind], y.unwritten[i] ? "unwritten" : "NaN");
      fail(what, c.fmt, c.bits, (long long)i);
      break;
    }
  }
}

// The GEMM: qmm over E matrices of M rows (sizes == nullptr) or ragged_qmm of T = M rows.
static void run_gemm_case(const Case& c, int64_t E, int64_t N, int64_t K, int64_t M,
                          const std::vector<int32_t>* sizes) {
  const int64_t S = sizes ? 1 : E;
  QmvProblem q = make_problem(c, E, N, K, S, S, M, nullptr);
  int32_t* gs = nullptr;
  if (sizes) {
    CK(cudaMalloc(&gs, 4 * E));
    CK(cudaMemcpy(gs, sizes->data(), 4 * E, cudaMemcpyHostToDevice));
  }
  GemmProblem P = gemm_problem(q, gs);
  plan_gemm(P);  // wgmma on sm_90 unless $JAXQUANT_GEMM_KERNEL=mma
  CK(launch_gemm(P, 0));
  const Output y = finish(q);
  if (gs) cudaFree(gs);
  int64_t total = 0;
  if (sizes)
    for (int32_t v : *sizes) total += v > 0 ? v : 0;
  for (int64_t r = 0; r < S * M; ++r) {
    const bool zero_row = sizes && r >= total;
    for (int64_t n = 0; n < N; ++n) {
      const float v = y.v[r * N + n];
      if (y.unwritten[r * N + n] || (zero_row ? v != 0.0f : isnan(v) && !any_code_nan(c.fmt))) {
        fail(zero_row ? "row past the groups not zero" : "NaN or unwritten", c.fmt, c.bits, r);
        break;
      }
    }
  }
}

// The layout's dequantize: w [E, N, K] (make_problem's y of S = E slots of M = K
// rows holds exactly E * N * K elements): every element written.
static void run_dequant_case(const Case& c, int64_t E, int64_t N, int64_t K) {
  QmvProblem q = make_problem(c, E, N, K, E, E, K, nullptr);
  const GemmProblem P = gemm_problem(q);
  CK(c.x_dt == kF16 ? launch_dequant_mma_f16(P, 0) : launch_dequant_mma_bf16(P, 0));
  const Output y = finish(q);
  for (size_t i = 0; i < y.v.size(); ++i)
    if (y.unwritten[i] || (isnan(y.v[i]) && !any_code_nan(c.fmt))) {
      fail("dequantize: NaN or unwritten", c.fmt, c.bits, (long long)i);
      break;
    }
}

// ragged_matmul's grouped GEMM on float experts (ragged_matmul_wgmma.h, sm_90 only):
// x [T, K] and w [E, N, K] of small finite 16-bit values in buffers of exactly their size,
// y [T, N]: every element written, rows past the groups zero, no NaN.
static void run_ragged_matmul_case(int xd, int64_t E, int64_t N, int64_t K, int64_t T,
                                   const std::vector<int32_t>& sizes) {
  if (!wgmma_usable()) return;
  std::mt19937 rng(99 + (int)(N + K + T));
  const void* x = dev_random<uint16_t>(T * K, rng, 0x3bffu);
  const void* w = dev_random<uint16_t>(E * N * K, rng, 0x3bffu);
  void* y = nullptr;
  CK(cudaMalloc(&y, T * N * 2));
  CK(cudaMemset(y, kUnwritten, T * N * 2));
  int32_t* gs = nullptr;
  CK(cudaMalloc(&gs, 4 * E));
  CK(cudaMemcpy(gs, sizes.data(), 4 * E, cudaMemcpyHostToDevice));
  GemmProblem P = ragged_matmul_problem(x, xd, w, y, T, K, E, N, gs);
  CK(launch_ragged_matmul_wgmma(P, 0));
  const Output out = finish(P.q);
  cudaFree(gs);
  int64_t total = 0;
  for (int32_t v : sizes) total += v > 0 ? v : 0;
  for (int64_t r = 0; r < T; ++r)
    for (int64_t n = 0; n < N; ++n) {
      const float v = out.v[r * N + n];
      if (out.unwritten[r * N + n] || isnan(v) || (r >= total && v != 0.0f)) {
        fail(r >= total ? "ragged_matmul: row past the groups not zero"
                        : "ragged_matmul: NaN or unwritten", -1, 16, r);
        r = T;
        break;
      }
    }
}

int main() {
  const std::vector<int32_t> ids = {0, 4, -1, 4, 5, 0, 0, 2, 1, 1, 4, 99, 3, 3, 3, 3, 3, 3, 3, 3, 3};
  const std::vector<int32_t> wide_sizes = {100, 0, 150, 90, 60};
  const std::vector<std::vector<int32_t>> ragged_sizes = {
      {0, 70, 0, 60, 0}, {0, 0, 150, 0, 0}, {10, 0, 65, 3, 1}, {150, 100, 0, 30, 0},
      {100, -5, 50, 0, 50}};
  const int xdts[3] = {kBF16, kF16, kF32};
  for (int xi = 0; xi < 3; ++xi) {
    const int xd = xdts[xi];
    // fmt, bits, group, scale dtype (kXdt: x's own; the kernels read float scales as
    // float32 or x's dtype, gemv_mma.h)
    constexpr int kXdt = -1;
    const int cases[][4] = {{kAffine, 4, 64, kXdt}, {kAffine, 4, 32, kF32}, {kAffine, 3, 64, kXdt},
                            {kAffine, 8, 64, kXdt}, {kMxfp4, 4, 32, kU8},  {kMxfp6E2M3, 6, 32, kU8},
                            {kMxfp8E5M2, 8, 32, kU8}, {kNvfp4, 4, 16, kU8}, {kFp4, 4, 16, kF32}};
    {  // other float scales: refused before any launch (jaxquant/ffi/mma.py converts them)
      QmvProblem q = make_problem(Case{kAffine, 4, 64, xd == kBF16 ? kF16 : kBF16, xd}, 1, 16, 64,
                                  1, 1, 1, nullptr);
      Problem P;
      P.q = q;
      P.tiles = P.full_tiles = 1;
      P.chunks = 1;
      P.dedupe = 0;
      const hipError_t err = xd == kF32 ? launch_qmv_mma_f32(P, 1, 0)
                             : xd == kF16 ? launch_qmv_mma_f16(P, 1, 0) : launch_qmv_mma_bf16(P, 1, 0);
      if (err != hipErrorInvalidValue) fail("scales in another 16-bit dtype not refused", kAffine, 4, 0);
      const Output y = finish(q);
      for (int64_t i = 0; i < 16; ++i)
        if (!y.unwritten[i]) {
          fail("a refused call wrote y", kAffine, 4, i);
          break;
        }
    }
    for (const auto& cc : cases) {
      const Case c{cc[0], cc[1], cc[2], cc[3] == kXdt ? xd : cc[3], xd};
      for (int64_t m : {1, 9, 16}) run_case(c, 3, 37, 192, m, nullptr, 0);
      run_case(c, 5, 21, 64 * 5, 1, &ids, 0);    // odd N x groups
      run_case(c, 5, 48, 128, 1, &ids, 7);       // dedupe, 8 rows
      run_case(c, 5, 33, 128, 1, &ids, 12);      // dedupe, 16 rows
      for (int64_t m : {1, 9, 16}) {
        run_fused_case(c, 1, 37, 192, m, 1, m != 9, kActSilu);  // a tail tile
        run_fused_case(c, 2, 96, 192, m, 2, m != 1, m == 16 ? kActSilu : kActGptOss);
        run_fused_case(c, 2, 37, 192, m, 4, true, kActSilu);  // qmm_add, a tail tile
      }
      for (int64_t m : {1, 8})  // rms_norm_qmm_swiglu: one n-tile
        run_fused_case(c, 2, 96, 192, m, 3, m == 1, m == 1 ? kActGptOss : kActSilu);
      run_fused_case(c, 1, 64, 4096, 1, 1, true, kActSilu);  // 4 warps, 8-16 KiB of x
      run_fused_case(c, 1, 64, 4096, 1, 2, true, kActGptOss);  // affine4: 8 warps
      run_fused_case(c, 1, 64, 4096, 1, 3, true, kActSilu);
      // gather_qmm_swiglu: bad ids, per-expert bias rows, dedupe of 8 and 16 rows
      run_fused_case(c, 5, 64, 192, 1, 2, true, kActGptOss, &ids, 0);
      run_fused_case(c, 5, 32, 128, 1, 2, false, kActSilu, &ids, 7);
      run_fused_case(c, 5, 96, 128, 1, 2, true, kActGptOss, &ids, 12);
      if (xd == kF32) continue;                  // the GEMM takes 16-bit x
      for (int64_t m : {17, 64, 100}) run_gemm_case(c, 2, 37, 192, m, nullptr);
      for (const auto& sizes : ragged_sizes) run_gemm_case(c, 5, 37, 192, 150, &sizes);
      // N = 136, K = 256: every tile's scales 4-byte aligned (the wgmma kernel on sm_90)
      for (int64_t m : {17, 64, 100, 130}) run_gemm_case(c, 2, 136, 256, m, nullptr);
      // 64 rows per block and few blocks, so each tile's K is split over a cluster
      // (wgmma_ksplit): K = 1088 (17 chunks) over two blocks, 9 chunks and 8; K = 2112
      // (33 chunks) over four, 9, 9, 9 and 6
      for (int64_t m : {40, 64}) run_gemm_case(c, 2, 136, 1088, m, nullptr);
      for (int64_t m : {40, 64}) run_gemm_case(c, 2, 136, 2112, m, nullptr);
      for (const auto& sizes : ragged_sizes) run_gemm_case(c, 5, 136, 256, 150, &sizes);
      // N = 272, a multiple of 16: the producer warp (qmm_wgmma.h, WS) at 64 rows (K split
      // over a cluster) and 128, the last block's tensor-map boxes past the stack; ragged
      // at 80 rows an expert (128-row blocks) with an empty group and rows past the groups.
      // $JAXQUANT_WGMMA_BN=256 (tools/gpu/check_decode.sh) runs them with the producer
      // warpgroup of 256-row blocks
      for (int64_t m : {40, 64, 130}) run_gemm_case(c, 2, 272, 1088, m, nullptr);
      run_gemm_case(c, 5, 272, 256, 420, &wide_sizes);
      run_dequant_case(c, 2, 37, 192);
    }
  }
  // ragged_matmul: N = 200 (the second weight box runs into the next expert, past the
  // stack for the last), K = 328 (a last chunk of 8 k), T = 150 and 420 (groups of
  // several items), empty groups, sizes past T, rows past the groups; then 8 experts of
  // gpt-oss-20b's gate_up size at 64 rows each
  for (int xd : {kBF16, kF16}) {
    for (const auto& sizes : ragged_sizes) run_ragged_matmul_case(xd, 5, 200, 328, 150, sizes);
    run_ragged_matmul_case(xd, 5, 200, 328, 420, wide_sizes);
    run_ragged_matmul_case(xd, 8, 5760, 2880, 512, std::vector<int32_t>(8, 64));
  }
  printf(failures ? "FAILED (%d)\n" : "ALL OK\n", failures);
  return failures ? 1 : 0;
}
