// XLA FFI handlers of the ffi backend on the CPU platform.
//
// Each handler validates its call (include/jq/ffi_common.h) and returns
// ffi::Error on a bad one; then it splits the work over XLA's intra-op thread
// pool (ParallelFor below; JAXQUANT_FFI_THREADS caps it) and runs the kernels of
// the best ISA this CPU has (cpu_src/kernels_impl.inc).
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "jq/codec.h"
#include "jq/ffi_common.h"
#include "kernels.h"

namespace jq {
namespace cpu {

// The best ISA this CPU has (x86-64: cpuid, and the OS saving the vector state:
// libgcc's __builtin_cpu_supports checks both; arm64: NEON, which every arm64 CPU
// has); JAXQUANT_FFI_CPU_ISA=avx2 or baseline caps it (the tests run every ISA's
// kernels on one machine).
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
    if (kernels_neon()) return kernels_neon();
    return kernels_base();
  }();
  return k;
}

// ---------------------------------------------------------------------------
// Threads: XLA's intra-op thread pool (the FFI's ThreadPool context), so a call
// shares the cores with XLA's own work instead of a second pool competing for
// them. A call uses up to min(the pool's threads, the cap) threads: its own
// and tasks scheduled on the pool; where XLA gives no pool, its own thread only.
// The cap: JAXQUANT_FFI_THREADS (read once), or jq_cpu_set_threads; default all.

static std::atomic<int> g_thread_cap{0};  // 0: not set by jq_cpu_set_threads

static int thread_cap() {
  static const int from_env = [] {
    const char* env = getenv("JAXQUANT_FFI_THREADS");
    const int n = env ? atoi(env) : 0;
    return n > 0 ? std::min(n, 256) : 0;
  }();
  const int set = g_thread_cap.load(std::memory_order_relaxed);
  if (set > 0) return set;
  if (from_env > 0) return from_env;
  return std::max(1, (int)std::thread::hardware_concurrency());
}

// Runs fn over [0, n) in chunks of `grain` on the caller's thread and up to
// threads - 1 tasks of XLA's pool, chunks handed out through an atomic counter.
// The caller waits only for the chunks some thread took (a task still queued when
// every chunk is taken finds none and returns), so a call made from a pool thread
// cannot wait on tasks queued behind it. False where fn threw on any thread (an
// allocation failure): the remaining chunks are skipped, and the call returns once
// every taken chunk has ended, so the handler can turn it into an ffi::Error. An
// exception never leaves a pool thread.
class ParallelFor {
 public:
  using Fn = std::function<void(int64_t, int64_t)>;

  static int threads(ffi::ThreadPool& pool) {
    const int64_t pool_threads = pool.num_threads();  // 0: no pool
    return (int)std::max<int64_t>(1, std::min<int64_t>(thread_cap(), pool_threads));
  }

  static bool run(ffi::ThreadPool& pool, int64_t n, int64_t grain, const Fn& fn,
                  bool flush_denormals = true) {
    if (n <= 0) return true;
    grain = std::max<int64_t>(grain, 1);
    const int64_t chunks = (n + grain - 1) / grain;
    const int64_t helpers = std::min<int64_t>(threads(pool), chunks) - 1;
    if (helpers <= 0) {
      FlushDenormals fd(flush_denormals);
      try {
        fn(0, n);
      } catch (...) {
        return false;
      }
      return true;
    }
    auto st = std::make_shared<State>();
    st->fn = &fn;
    st->n = n;
    st->grain = grain;
    st->chunks = chunks;
    st->flush = flush_denormals;
    for (int64_t i = 0; i < helpers; ++i) pool.Schedule([st] { work(*st); });
    work(*st);
    {
      std::unique_lock<std::mutex> lock(st->mu);
      st->cv.wait(lock, [&] { return st->done.load() == st->chunks; });
    }
    return !st->failed.load();
  }

 private:
  struct State {
    std::atomic<int64_t> next{0}, done{0};  // chunks taken (times grain), chunks ended
    std::atomic<bool> failed{false};
    std::mutex mu;
    std::condition_variable cv;
    const Fn* fn = nullptr;  // valid while a chunk is left: the caller waits for them
    int64_t n = 0, grain = 1, chunks = 0;
    bool flush = true;
  };

  static void work(State& st) {
    FlushDenormals fd(st.flush);
    for (;;) {
      const int64_t i0 = st.next.fetch_add(st.grain);
      if (i0 >= st.n) break;
      if (!st.failed.load(std::memory_order_relaxed)) {
        try {
          (*st.fn)(i0, std::min(st.n, i0 + st.grain));
        } catch (...) {
          st.failed.store(true);
        }
      }
      if (st.done.fetch_add(1) + 1 == st.chunks) {
        std::lock_guard<std::mutex> lock(st.mu);
        st.cv.notify_all();
      }
    }
  }
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
  static constexpr bool kCapturable = false;  // XLA's CPU runtime has no command buffers

  static ffi::Error dequantize(const DequantProblem& p, ffi::ThreadPool pool) {
    const Kernels* k = select_kernels();
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(p.k, 1));
    if (!ParallelFor::run(
            pool, p.rows, grain, [&](int64_t r0, int64_t r1) { k->dequant(p, r0, r1); },
            dequant_flushes_denormals(p)))
      return out_of_memory("dequantize");
    return ffi::Error::Success();
  }

  static ffi::Error qmv(const QmvProblem& p, ffi::ThreadPool pool) {
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
    // Work items: (slot, block of rows). Blocks are a multiple of 8 rows and
    // small enough to give every thread a few items. Each output row is computed
    // by one kernel call whatever the split, so the result is the same bits for
    // any number of threads.
    const int threads = ParallelFor::threads(pool);
    const int64_t want = std::max<int64_t>(1, 4 * threads / std::max<int64_t>(p.S, 1));
    int64_t nb = (p.N + want - 1) / want;
    nb = std::max<int64_t>(16, std::min<int64_t>(512, (nb + 7) / 8 * 8));
    const int64_t blocks = (p.N + nb - 1) / nb;
    const int64_t scratch_n = k->qmv_scratch(p);
    const bool ok = ParallelFor::run(pool, p.S * blocks, 1, [&](int64_t i0, int64_t i1) {
      const std::unique_ptr<float[]> scratch = scratch_floats(scratch_n);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t s = i / blocks, b = i % blocks;
        k->qmv(p, s, b * nb, std::min(p.N, (b + 1) * nb), scratch.get());
      }
    });
    return ok ? ffi::Error::Success() : out_of_memory("qmv");
  }

  // The blocked GEMM: x packed once (float32, transposed; split over K), then work
  // items of (slot, block of gemm_rows weight rows), each decoding its panel once for
  // all rows of x. An output element's float ops do not depend on the split.
  static ffi::Error gemm(const QmvProblem& p, ffi::ThreadPool pool) {
    if (p.K == 0) return qmv(p, pool);  // zeros, NaN rows for invalid experts
    const Kernels* k = select_kernels();
    const int64_t slot_floats = k->gemm_x_floats(p);
    std::unique_ptr<float[]> xt;
    try {
      xt = scratch_floats(p.Sx * slot_floats);
    } catch (...) {
      return out_of_memory("gemm");
    }
    const int64_t kchunk = 256;
    const int64_t kchunks = (p.K + kchunk - 1) / kchunk;
    float* xtp = xt.get();
    if (!ParallelFor::run(pool, p.Sx * kchunks, 1, [&](int64_t i0, int64_t i1) {
          for (int64_t i = i0; i < i1; ++i) {
            const int64_t sx = i / kchunks, c = i % kchunks;
            k->gemm_pack_x(p, sx, c * kchunk, std::min(p.K, (c + 1) * kchunk),
                           xtp + sx * slot_floats);
          }
        }))
      return out_of_memory("gemm");
    const int64_t nb = k->gemm_rows;
    const int64_t blocks = (p.N + nb - 1) / nb;
    const int64_t scratch_n = k->gemm_scratch(p);
    const bool ok = ParallelFor::run(pool, p.S * blocks, 1, [&](int64_t i0, int64_t i1) {
      const std::unique_ptr<float[]> scratch = scratch_floats(scratch_n);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t s = i / blocks, b = i % blocks;
        k->gemm(p, s, b * nb, std::min(p.N, (b + 1) * nb), xtp + (s / p.x_div) * slot_floats,
                scratch.get());
      }
    });
    return ok ? ffi::Error::Success() : out_of_memory("gemm");
  }

  static ffi::Error norm(const NormProblem& p, ffi::ThreadPool pool) {
    const Kernels* k = select_kernels();
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(p.d, 1));
    const bool ok = ParallelFor::run(pool, p.rows, grain, [&](int64_t r0, int64_t r1) {
      const std::unique_ptr<float[]> scratch = scratch_floats(3 * p.d);
      k->norm(p, r0, r1, scratch.get());
    });
    return ok ? ffi::Error::Success() : out_of_memory("norm");
  }
};

using CpuHandlers = Handlers<CpuPlatform, ffi::ThreadPool>;

}  // namespace cpu
}  // namespace jq

// The CPU library's targets: every platform's, and the blocked GEMM.
#define JQ_CPU_TARGETS(X, ...) JQ_FFI_TARGETS(X, __VA_ARGS__) X(gemm, __VA_ARGS__)

// jq_cpu_<target> for every target, jq_abi_version, jq_ffi_targets, jq_format_name.
JQ_FFI_DEFINE_LIBRARY(jq_cpu_, jq::cpu::CpuHandlers, JQ_CPU_TARGETS)

// ---------------------------------------------------------------------------
// Plain C entry points of the CPU library only, for the tests.

extern "C" {

__attribute__((visibility("default"))) const char* jq_cpu_isa() {
  return jq::cpu::select_kernels()->isa;
}

// The most threads a call uses (XLA's pool may have fewer).
__attribute__((visibility("default"))) int jq_cpu_threads() { return jq::cpu::thread_cap(); }

// Caps the threads of the calls that start from now on (n >= 1; 0: back to
// JAXQUANT_FFI_THREADS or all); returns the previous cap.
__attribute__((visibility("default"))) int jq_cpu_set_threads(int n) {
  const int before = jq::cpu::thread_cap();
  jq::cpu::g_thread_cap.store(std::max(0, std::min(n, 256)));
  return before;
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
