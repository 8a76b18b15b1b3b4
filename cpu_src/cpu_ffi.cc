// XLA FFI handlers of the ffi backend on the CPU platform.
//
// Each handler validates its call (include/jq/ffi_common.h) and returns
// ffi::Error on a bad one; then it splits the work over a small thread pool
// (JAXQUANT_FFI_THREADS, default: the machine's hardware threads) and runs
// the kernels of the best ISA this CPU has (cpu_src/kernels_impl.inc).
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "jq/codec.h"
#include "jq/ffi_common.h"
#include "kernels.h"

namespace jq {
namespace cpu {

#if !defined(JQ_HAVE_AVX2_VARIANT)
const Kernels* kernels_avx2() { return nullptr; }
#endif
#if !defined(JQ_HAVE_AVX512_VARIANT)
const Kernels* kernels_avx512() { return nullptr; }
#endif

// The best ISA this CPU has (cpuid, and the OS saving the vector state: libgcc's
// __builtin_cpu_supports checks both); JAXQUANT_FFI_CPU_ISA=avx2 or baseline caps
// it (the tests run every ISA's kernels on one machine).
static const Kernels* select_kernels() {
  static const Kernels* k = [] {
    const char* force = getenv("JAXQUANT_FFI_CPU_ISA");
    const bool cap_base = force && strcmp(force, "baseline") == 0;
    const bool cap_avx2 = force && strcmp(force, "avx2") == 0;
    if (cap_base) return kernels_base();
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (!cap_avx2 && kernels_avx512() && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vbmi") &&
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
      return kernels_avx512();
    if (kernels_avx2() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
      return kernels_avx2();
#endif
    return kernels_base();
  }();
  return k;
}

// While a kernel runs: flush float32 subnormals like XLA's CPU code does (flush),
// or keep them (the MX dequantize, whose reference builds subnormal results
// exactly from bits: every E8M0-scaled element is a float32 number).
struct FlushDenormals {
#if defined(__x86_64__)
  unsigned saved;
  explicit FlushDenormals(bool flush) : saved(_mm_getcsr()) {
    _mm_setcsr(flush ? (saved | 0x8040u) : (saved & ~0x8040u));  // FTZ | DAZ
  }
  ~FlushDenormals() { _mm_setcsr(saved); }
#else
  explicit FlushDenormals(bool) {}
#endif
};

// ---------------------------------------------------------------------------
// A small thread pool: one job at a time (a second concurrent caller runs
// its job inline), chunks handed out through an atomic counter.

class Pool {
 public:
  static Pool& get() {
    static std::mutex mu;
    static Pool* pool = nullptr;
    std::lock_guard<std::mutex> lock(mu);
    if (pool == nullptr || pool->pid_ != getpid()) pool = new Pool();  // new after fork
    return *pool;
  }

  int threads() const { return (int)workers_.size() + 1; }

  // Runs fn over [0, n) in chunks of `grain`. False where fn threw on any thread
  // (an allocation failure): the remaining chunks are skipped and the call returns
  // once every thread has stopped, so the handler can turn it into an ffi::Error.
  // An exception must never leave a worker thread (std::terminate).
  bool parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn,
                    bool flush_denormals = true) {
    if (n <= 0) return true;
    grain = std::max<int64_t>(grain, 1);
    if (workers_.empty() || n <= grain || !run_mu_.try_lock()) {
      FlushDenormals fd(flush_denormals);
      try {
        fn(0, n);
      } catch (...) {
        return false;
      }
      return true;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      flush_ = flush_denormals;
      fn_ = &fn;
      n_ = n;
      grain_ = grain;
      next_.store(0);
      failed_.store(false);
      pending_ = (int)workers_.size();
      ++generation_;
    }
    cv_.notify_all();
    work();
    {
      std::unique_lock<std::mutex> lock(mu_);
      done_.wait(lock, [&] { return pending_ == 0; });
      fn_ = nullptr;
    }
    const bool ok = !failed_.load();
    run_mu_.unlock();
    return ok;
  }

 private:
  Pool() : pid_(getpid()) {
    int n = (int)std::thread::hardware_concurrency();
    if (const char* env = getenv("JAXQUANT_FFI_THREADS")) n = atoi(env);
    n = std::max(1, std::min(n, 256));
    for (int i = 0; i + 1 < n; ++i) workers_.emplace_back([this] { loop(); });
    for (auto& t : workers_) t.detach();  // lives as long as the process
  }

  void work() {
    FlushDenormals fd(flush_);
    for (;;) {
      const int64_t i0 = next_.fetch_add(grain_);
      if (i0 >= n_ || failed_.load(std::memory_order_relaxed)) break;
      try {
        (*fn_)(i0, std::min(n_, i0 + grain_));
      } catch (...) {
        failed_.store(true);
      }
    }
  }

  void loop() {
    int64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
      }
      work();
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (--pending_ == 0) done_.notify_all();
      }
    }
  }

  pid_t pid_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_, mu_;
  std::condition_variable cv_, done_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  std::atomic<int64_t> next_{0};
  std::atomic<bool> failed_{false};
  int64_t n_ = 0, grain_ = 1, generation_ = 0;
  int pending_ = 0;
  bool flush_ = true;
};

// ---------------------------------------------------------------------------
// How the CPU runs a validated, non-empty problem (the handlers around these:
// include/jq/ffi_common.h, Handlers).

// The error of a parallel_for that failed: every exception a kernel can raise is
// an allocation failure (the kernels themselves do not throw).
static ffi::Error out_of_memory(const char* op) {
  return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                    std::string("jaxquant ffi: ") + op + ": out of host memory for the CPU "
                    "kernel's scratch");
}

// Scratch of one chunk of a parallel_for, freed when the chunk ends: a per-thread
// cache would keep the largest call's scratch (M * K floats) for the process's life.
static std::unique_ptr<float[]> scratch_floats(int64_t n) {
  return std::unique_ptr<float[]>(new float[(size_t)n]);  // std::bad_alloc on failure
}

struct CpuPlatform {
  static ffi::Error dequantize(const DequantProblem& p) {
    const Kernels* k = select_kernels();
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(p.k, 1));
    const bool mx = kFormats[p.fmt].scale == kScaleE8M0;
    if (!Pool::get().parallel_for(
            p.rows, grain, [&](int64_t r0, int64_t r1) { k->dequant(p, r0, r1); },
            /*flush_denormals=*/!mx))
      return out_of_memory("dequantize");
    return ffi::Error::Success();
  }

  static ffi::Error qmv(const QmvProblem& p) {
    if (p.K == 0) {
      for (int64_t i = 0; i < p.S * p.M * p.N; ++i) store_float(p.y, i, p.x_dt, 0.0f);
      // (invalid experts still give NaN rows)
      if (p.indices)
        for (int64_t s = 0; s < p.S; ++s)
          if (p.indices[s] < 0 || p.indices[s] >= p.E)
            for (int64_t i = 0; i < p.M * p.N; ++i)
              store_float(p.y, s * p.M * p.N + i, p.x_dt, quiet_nan());
      return ffi::Error::Success();
    }
    const Kernels* k = select_kernels();
    Pool& pool = Pool::get();
    // Work items: (slot, block of rows). Blocks are a multiple of 8 rows and
    // small enough to give every thread a few items.
    const int64_t want = std::max<int64_t>(1, 4 * pool.threads() / std::max<int64_t>(p.S, 1));
    int64_t nb = (p.N + want - 1) / want;
    nb = std::max<int64_t>(16, std::min<int64_t>(512, (nb + 7) / 8 * 8));
    const int64_t blocks = (p.N + nb - 1) / nb;
    const int64_t scratch_n = qmv_scratch_floats(p);
    const bool ok = pool.parallel_for(p.S * blocks, 1, [&](int64_t i0, int64_t i1) {
      const std::unique_ptr<float[]> scratch = scratch_floats(scratch_n);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t s = i / blocks, b = i % blocks;
        k->qmv(p, s, b * nb, std::min(p.N, (b + 1) * nb), scratch.get());
      }
    });
    return ok ? ffi::Error::Success() : out_of_memory("qmv");
  }

  static ffi::Error norm(const NormProblem& p) {
    const Kernels* k = select_kernels();
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(p.d, 1));
    const bool ok = Pool::get().parallel_for(p.rows, grain, [&](int64_t r0, int64_t r1) {
      const std::unique_ptr<float[]> scratch = scratch_floats(3 * p.d);
      k->norm(p, r0, r1, scratch.get());
    });
    return ok ? ffi::Error::Success() : out_of_memory("norm");
  }
};

using CpuHandlers = Handlers<CpuPlatform>;

}  // namespace cpu
}  // namespace jq

// jq_cpu_<target> for every target, jq_abi_version, jq_ffi_targets, jq_format_name.
JQ_FFI_DEFINE_LIBRARY(jq_cpu_, jq::cpu::CpuHandlers, JQ_FFI_TARGETS)

// ---------------------------------------------------------------------------
// Plain C entry points of the CPU library only, for the tests.

extern "C" {

__attribute__((visibility("default"))) const char* jq_cpu_isa() {
  return jq::cpu::select_kernels()->isa;
}

__attribute__((visibility("default"))) int jq_cpu_threads() {
  return jq::cpu::Pool::get().threads();
}

// Format `fmt`: {element, bits_mask, group_mask, scale kind, has_biases, has_global_scale}.
__attribute__((visibility("default"))) int jq_format_spec(int fmt, int32_t* out) {
  if (fmt < 0 || fmt >= jq::kNumFormats) return -1;
  const jq::FormatSpec& f = jq::kFormats[fmt];
  const int32_t v[6] = {f.element, (int32_t)f.bits_mask, (int32_t)f.group_mask, f.scale,
                        f.has_biases, f.has_global_scale};
  memcpy(out, v, sizeof v);
  return 0;
}

// Element `el`: {ebits, mbits, bias, special}.
__attribute__((visibility("default"))) int jq_element_spec(int el, int32_t* out) {
  if (el < 0 || el >= jq::kNumElements) return -1;
  const jq::ElementSpec& e = jq::kElements[el];
  const int32_t v[4] = {e.ebits, e.mbits, e.bias, e.special};
  memcpy(out, v, sizeof v);
  return 0;
}

// All 2**bits values of element `el` (a minifloat, or a codebook: ids from
// kNumElements on), decoded by the shared codec header.
__attribute__((visibility("default"))) int jq_decode_element_all(int el, float* out) {
  if (el < 0 || el >= jq::kNumElementsAndCodebooks) return -1;
  const int n = jq::is_codebook(el) ? 16 : 1 << (1 + jq::kElements[el].ebits +
                                                 jq::kElements[el].mbits);
  for (int c = 0; c < n; ++c) out[c] = jq::decode_element(el, (uint32_t)c);
  return n;
}

// f32 -> bf16 / f16 (round to nearest even) for the tests of the codec.
__attribute__((visibility("default"))) void jq_round_f32(const float* in, int64_t n, int dt,
                                                          uint16_t* out) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = dt == jq::kBF16 ? jq::f32_to_bf16(in[i]) : jq::f32_to_f16(in[i]);
}

}  // extern "C"
