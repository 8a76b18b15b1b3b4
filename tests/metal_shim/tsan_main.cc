// ThreadSanitizer driver for the shim (tests/test_metal.py::test_kernels_have_no_data_races):
// built with -fsanitize=thread together with the kernels and harness.cc, it dispatches
// every registered kernel once, with the bridge's plans, on buffers of random bits (races
// do not depend on values). TSan reports any access to shared memory (threadgroup arrays,
// device buffers) that no barrier orders, whether or not the result changed.
// `tsan_main racy` dispatches the faulty reduction without its barrier instead, to show
// that such a kernel is reported.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "dispatch_plan.h"

extern "C" {
int jq_shim_dispatch(const char*, void**, unsigned, unsigned, unsigned, unsigned, unsigned, double, char*, unsigned);
int jq_shim_kernel_count();
const char* jq_shim_kernel_name(int);
}

using namespace jq_metal;

static bool starts(const std::string& s, const char* p) { return s.rfind(p, 0) == 0; }

// "jq_qmv_affine4_float32" -> ("affine4", "float32"); norms: the two dtypes.
static std::vector<std::string> parts(const std::string& s, int skip) {
  std::vector<std::string> out;
  size_t i = 0;
  for (int k = 0; k < skip; ++k) i = s.find('_', i) + 1;
  while (true) {
    size_t j = s.find('_', i);
    out.push_back(s.substr(i, j == std::string::npos ? std::string::npos : j - i));
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return out;
}

int main(int argc, char** argv) {
  std::mt19937 rng(0);
  std::vector<std::vector<uint32_t>> mem(6, std::vector<uint32_t>(1 << 16));
  for (auto& m : mem)
    for (auto& v : m) v = rng() & 0x3f7f3f7fu;  // finite float and half/bfloat bit patterns
  mem[4][0] = 0, mem[4][1] = 1, mem[4][2] = 7;  // expert ids for the GEMV (7: out of range)
  char err[1024];
  auto dispatch = [&](const Plan& plan, int n_buffers, const void* params) {
    std::vector<void*> b;
    for (int i = 0; i < n_buffers; ++i) b.push_back(mem[i].data());
    b.push_back(const_cast<void*>(params));
    if (jq_shim_dispatch(plan.kernel.c_str(), b.data(), unsigned(b.size()), plan.grid[0], plan.grid[1], plan.grid[2],
                         plan.threads, 120.0, err, sizeof err)) {
      std::fprintf(stderr, "%s\n", err);
      return false;
    }
    return true;
  };
  if (argc > 1 && std::strcmp(argv[1], "racy") == 0) {
    const uint32_t with_barrier = 0;
    return dispatch({"faulty_racy_sum", {4, 1, 1}, 256}, 1, &with_barrier) ? 0 : 1;
  }
  int ran = 0;
  for (int i = 0; i < jq_shim_kernel_count(); ++i) {
    const std::string name = jq_shim_kernel_name(i);
    bool ok = true;
    if (starts(name, "jq_qmv_") || starts(name, "jq_qmm_")) {
      const bool nax = starts(name, "jq_qmm_nax_");
      auto p = parts(name, nax ? 3 : 2);
      const bool gemv = starts(name, "jq_qmv_");
      JqQmmParams q{64, 5, gemv ? 2u : 9u, p[0] == "fp4" ? 16u : 32u, 2, gemv ? 3u : 2u, gemv ? 3u : 1u, gemv ? 1u : 0u};
      ok = gemv ? dispatch(plan_qmv(p[0], p[1], q), 6, &q) : dispatch(plan_qmm(p[0], p[1], q, nax), 5, &q);
    } else if (starts(name, "jq_dequantize_")) {
      auto p = parts(name, 2);
      JqDequantParams q{7, 64, 32};
      ok = dispatch(plan_dequantize(p[0], p[1], q), 4, &q);
    } else if (starts(name, "jq_rms_norm_")) {
      auto p = parts(name, 3);  // kind, dtype
      const uint32_t n = p[0] == "head" ? 128 : p[0] == "row4" ? 384 : 100;
      JqNormParams q{9, n, n, 1, 1e-6f, 0.0f, 0, 0};
      Plan plan = plan_rms_norm(p[1], q);
      ok = plan.kernel == name && dispatch(plan, 3, &q);
    } else if (starts(name, "jq_add_rms_norm_")) {
      auto p = parts(name, 4);
      JqNormParams q{3, 100, 100, 1, 1e-6f, 0.0f, 0, 0};
      ok = dispatch(plan_add_rms_norm(p[0], p[1], q), 5, &q);
    } else if (starts(name, "jq_gated_rms_norm_")) {
      auto p = parts(name, 4);
      JqNormParams q{6, 50, 100, 1, 1e-6f, 0.0f, 0, 0};
      ok = dispatch(plan_gated_rms_norm(p[0], p[1], q), 4, &q);
    } else {
      continue;  // the faulty kernels
    }
    if (!ok) {
      std::fprintf(stderr, "dispatch of %s failed\n", name.c_str());
      return 1;
    }
    ++ran;
  }
  std::printf("dispatched %d kernels\n", ran);
  return 0;
}
