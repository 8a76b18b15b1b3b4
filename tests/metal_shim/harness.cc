// The CPU shim's launcher: runs a grid of threadgroups of a kernel that JQ_KERNEL
// registered, each threadgroup as real threads (see metal_stdlib for the model).
// C ABI for the tests (ctypes): jq_shim_dispatch, jq_shim_kernel_count/_name.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dispatch_plan.h"

#include <metal_stdlib>
#include <metal_tensor>
// The MSL keywords are macros in the shim; plain C++ from here on.
#undef kernel
#undef device
#undef constant
#undef thread
#undef threadgroup

namespace {

struct Deadlock : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Dispatch;

// A barrier among `count` threads that gives up at a deadline: a barrier that not every
// participant reaches is a deadlock on a GPU, here an error. Once any barrier of the
// dispatch fails, every wait of the dispatch fails (poisoned), so all threads unwind.
class TimedBarrier {
 public:
  // slack: this barrier's deadline in units of the dispatch's timeout
  TimedBarrier(unsigned count, Dispatch* d, const char* what, double slack = 1.0)
      : count_(count), d_(d), what_(what), slack_(slack) {}
  void wait();
  void poison() {
    std::lock_guard<std::mutex> lock(mu_);
    cv_.notify_all();
  }

 private:
  unsigned count_, arrived_ = 0;
  unsigned long generation_ = 0;
  Dispatch* d_;
  const char* what_;
  double slack_;
  std::mutex mu_;
  std::condition_variable cv_;
};

struct Simdgroup {
  explicit Simdgroup(Dispatch* d) : publish(32, d, "simdgroup operation"), consume(32, d, "simdgroup operation") {}
  TimedBarrier publish, consume;
  alignas(16) unsigned char slots[32][16];
  unsigned sizes[32];
};

struct Dispatch {
  unsigned threads = 0;
  std::chrono::duration<double> timeout;
  std::atomic<bool> poisoned{false};
  std::mutex err_mu;
  std::string error;
  std::unique_ptr<TimedBarrier> threadgroup, between_groups;
  std::vector<std::unique_ptr<Simdgroup>> simdgroups;

  void fail(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(err_mu);
      if (error.empty()) error = why;
    }
    if (!poisoned.exchange(true)) {
      threadgroup->poison();
      between_groups->poison();
      for (auto& s : simdgroups) {
        s->publish.poison();
        s->consume.poison();
      }
    }
  }
};

void TimedBarrier::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  if (d_->poisoned) throw Deadlock("poisoned");
  const unsigned long gen = generation_;
  if (++arrived_ == count_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  const bool released = cv_.wait_for(lock, d_->timeout * slack_, [&] { return generation_ != gen || d_->poisoned.load(); });
  if (generation_ != gen) return;
  if (!released) {
    const unsigned arrived = arrived_;
    lock.unlock();
    d_->fail(std::string(what_) + ": only " + std::to_string(arrived) + " of " + std::to_string(count_) +
             " threads arrived before the deadline (a barrier not every thread reaches: deadlock on a GPU)");
  }
  throw Deadlock("poisoned");
}

struct ThreadState {
  Dispatch* d = nullptr;
  unsigned tid = 0;
};
thread_local ThreadState self;

std::map<std::string, std::pair<unsigned, jq_shim::Launch>>& registry() {
  static std::map<std::string, std::pair<unsigned, jq_shim::Launch>> r;
  return r;
}

std::mutex dispatch_mu;  // one dispatch at a time: `threadgroup` storage is static

}  // namespace

namespace metal {
void threadgroup_barrier(mem_flags) { self.d->threadgroup->wait(); }
void simdgroup_barrier(mem_flags) { shim_simd_sync(); }
namespace shim {
unsigned lane_id() { return self.tid % 32; }
unsigned thread_index() { return self.tid; }
unsigned threads_per_threadgroup() { return self.d->threads; }
void simd_exchange(const void* bytes, unsigned size, void* out32) {
  Simdgroup& s = *self.d->simdgroups[self.tid / 32];
  const unsigned lane = self.tid % 32;
  std::memcpy(s.slots[lane], bytes, size);
  s.sizes[lane] = size;
  s.publish.wait();
  for (unsigned i = 0; i < 32; ++i) {
    if (s.sizes[i] != size) {
      self.d->fail("simdgroup lanes called different simdgroup operations at once");
      throw Deadlock("poisoned");
    }
    std::memcpy(static_cast<unsigned char*>(out32) + i * size, s.slots[i], size);
  }
  s.consume.wait();
}
}  // namespace shim
}  // namespace metal

namespace jq_shim {
void register_kernel(const char* name, unsigned n_buffers, Launch launch) {
  registry()[name] = {n_buffers, std::move(launch)};
}
}  // namespace jq_shim

extern "C" {

int jq_shim_kernel_count() { return int(registry().size()); }

const char* jq_shim_kernel_name(int i) {
  auto it = registry().begin();
  std::advance(it, i);
  return it->first.c_str();
}

// Runs kernel `name` over grid (gx, gy, gz) of threadgroups of `threads` threads (a
// multiple of 32), buffers[0..n_buffers) bound in order (the last is the parameter
// block). Threadgroups run one after another, in grid order. Returns 0, or -1 with a
// message in err.
int jq_shim_dispatch(const char* name, void** buffers, unsigned n_buffers, unsigned gx, unsigned gy,
                     unsigned gz, unsigned threads, double timeout_s, char* err, unsigned err_len) {
  auto report = [&](const std::string& why) {
    std::snprintf(err, err_len, "%s", why.c_str());
    return -1;
  };
  auto it = registry().find(name);
  if (it == registry().end()) return report(std::string("no kernel named ") + name);
  if (it->second.first != n_buffers)
    return report(std::string(name) + " takes " + std::to_string(it->second.first) + " buffers, got " +
                  std::to_string(n_buffers));
  if (threads == 0 || threads % 32 || threads > 1024)
    return report("threads per threadgroup must be a multiple of 32 in [32, 1024]");
  std::lock_guard<std::mutex> one_at_a_time(dispatch_mu);
  Dispatch d;
  d.threads = threads;
  d.timeout = std::chrono::duration<double>(timeout_s);
  d.threadgroup = std::make_unique<TimedBarrier>(threads, &d, "threadgroup_barrier");
  // The end-of-threadgroup barrier waits 3x longer, so a barrier inside the kernel that
  // not every thread reaches is the one reported even when the machine is loaded and
  // threads that finished early arrive at the end long before the stuck ones stall.
  d.between_groups = std::make_unique<TimedBarrier>(
      threads, &d, "end of threadgroup (a thread is still inside the kernel)", 3.0);
  for (unsigned s = 0; s < threads / 32; ++s) d.simdgroups.push_back(std::make_unique<Simdgroup>(&d));
  const jq_shim::Launch& launch = it->second.second;
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      self.d = &d;
      self.tid = t;
      try {
        for (unsigned z = 0; z < gz; ++z)
          for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
              launch(buffers, metal::uint3(x, y, z), t, t % 32, t / 32, threads);
              d.between_groups->wait();
            }
      } catch (const Deadlock&) {
      } catch (const std::exception& e) {
        d.fail(std::string("kernel threw: ") + e.what());
      }
    });
  }
  for (auto& th : pool) th.join();
  if (!d.error.empty()) return report(std::string(name) + ": " + d.error);
  return 0;
}

// The bridge's kernel choice and grid for an op (dispatch_plan.h). op: "qmv", "qmm",
// "qmm_nax", "dequantize" (a = format, b = dtype), "rms_norm" (a = dtype),
// "add_rms_norm", "gated_rms_norm" (a, b = the two dtypes); params: the op's block.
int jq_shim_plan(const char* op, const char* a, const char* b, const void* params, char* kernel,
                 unsigned kernel_len, unsigned* grid, unsigned* threads) {
  using namespace jq_metal;
  const std::string o(op);
  Plan plan;
  if (o == "qmv") plan = plan_qmv(a, b, *static_cast<const JqQmmParams*>(params));
  else if (o == "qmm") plan = plan_qmm(a, b, *static_cast<const JqQmmParams*>(params), false);
  else if (o == "qmm_nax") plan = plan_qmm(a, b, *static_cast<const JqQmmParams*>(params), true);
  else if (o == "dequantize") plan = plan_dequantize(a, b, *static_cast<const JqDequantParams*>(params));
  else if (o == "rms_norm") plan = plan_rms_norm(a, *static_cast<const JqNormParams*>(params));
  else if (o == "add_rms_norm") plan = plan_add_rms_norm(a, b, *static_cast<const JqNormParams*>(params));
  else if (o == "gated_rms_norm") plan = plan_gated_rms_norm(a, b, *static_cast<const JqNormParams*>(params));
  else return -1;
  std::snprintf(kernel, kernel_len, "%s", plan.kernel.c_str());
  for (int i = 0; i < 3; ++i) grid[i] = plan.grid[i];
  *threads = plan.threads;
  return 0;
}

}  // extern "C"
