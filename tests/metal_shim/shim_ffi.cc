// The Metal backend's FFI handlers (metal_src/handlers.h: argument checks, parameter
// blocks, kernel choice) with a `run` that dispatches on the MSL-on-CPU shim instead of
// the GPU. Registered as the jaxquant_metal_* targets by tests/test_metal.py, so that
// jq ops with backend="metal" run end to end off macOS; only metal_ffi.mm's Metal calls
// (buffers, pipelines, command buffers) are left out.
#include <cstdlib>
#include <cstring>

#include "handlers.h"

extern "C" int jq_shim_dispatch(const char* name, void** buffers, unsigned n_buffers, unsigned gx, unsigned gy,
                                unsigned gz, unsigned threads, double timeout_s, char* err, unsigned err_len);

namespace jq_metal {

bool use_nax() {
  const char* env = std::getenv("JAXQUANT_METAL_NAX");
  return env != nullptr && std::strcmp(env, "1") == 0;
}

ffi::Error run(const Plan& plan, const std::vector<Binding>& bindings, const void* params, size_t) {
  for (int i = 0; i < 3; ++i) {
    if (plan.grid[i] == 0) return ffi::Error::Success();
  }
  alignas(16) static const unsigned char absent[16] = {};  // a [0] operand: never read
  std::vector<void*> buffers;
  for (const Binding& b : bindings) buffers.push_back(b.bytes ? b.host : const_cast<unsigned char*>(absent));
  buffers.push_back(const_cast<void*>(params));
  char err[1024];
  if (jq_shim_dispatch(plan.kernel.c_str(), buffers.data(), unsigned(buffers.size()), plan.grid[0], plan.grid[1],
                       plan.grid[2], plan.threads, 60.0, err, sizeof err) != 0) {
    return ffi::Error::Internal(std::string("jaxquant metal (CPU shim): ") + err);
  }
  return ffi::Error::Success();
}

}  // namespace jq_metal
