// The Metal backend's bridge: XLA FFI handlers on the CPU platform that run the kernels of
// jaxquant.metallib on the GPU (macOS only; built by metal_src/CMakeLists.txt with ARC).
//
// XLA hands a CPU handler host pointers; on Apple silicon the GPU reads the same memory.
// A range that is page aligned (address and length) is wrapped without a copy
// (newBufferWithBytesNoCopy); any other range is staged through a shared buffer (copied
// in for inputs, copied back for outputs after the GPU is done). Each call encodes one
// dispatch, commits and waits, so the outputs are complete when the handler returns; its
// Metal objects live in an autorelease pool drained before it returns (nothing survives
// a call but the device, the queue, the libraries and the pipeline cache).
//
// The handlers themselves (argument checks, parameter blocks, kernel choice) are in
// handlers.h, shared with the tests' CPU runner; this file supplies `run` and `use_nax`.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <mach/mach.h>
#include <stdlib.h>
#include <string.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "handlers.h"

namespace jq_metal {
namespace {

// ---- Device, libraries, pipelines ------------------------------------------------------

struct Context {
  id<MTLDevice> device = nil;
  id<MTLCommandQueue> queue = nil;
  id<MTLLibrary> library = nil;      // jaxquant.metallib
  id<MTLLibrary> nax_library = nil;  // jaxquant_nax.metallib, used where the GPU has tensor units
  bool use_nax = false;
  std::string device_name;
  std::string init_error;
  std::mutex mu;  // the pipeline cache
  std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines;
};

Context& context() {
  static Context* c = new Context();  // lives as long as the process
  return *c;
}

ffi::Error internal(const std::string& what) {
  return ffi::Error::Internal("jaxquant metal: " + what);
}

// The GPU family with the tensor units of the MPP tensor ops (M5 and later). Spelled as a
// number so that the bridge builds with SDKs that predate the enum value.
constexpr MTLGPUFamily kFamilyWithTensorUnits = (MTLGPUFamily)1010;  // MTLGPUFamilyApple10

id<MTLLibrary> load_library(id<MTLDevice> device, const std::string& path, std::string* why) {
  NSError* error = nil;
  NSURL* url = [NSURL fileURLWithPath:[NSString stringWithUTF8String:path.c_str()]];
  id<MTLLibrary> lib = [device newLibraryWithURL:url error:&error];
  if (lib == nil && why != nullptr) {
    *why = path + ": " + (error ? std::string(error.localizedDescription.UTF8String) : "unknown error");
  }
  return lib;
}

ffi::Error pipeline_for(const std::string& name, id<MTLComputePipelineState>* out) {
  Context& c = context();
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.pipelines.find(name);
  if (it != c.pipelines.end()) {
    *out = it->second;
    return ffi::Error::Success();
  }
  const bool nax = name.rfind("jq_qmm_nax_", 0) == 0;
  id<MTLLibrary> lib = nax ? c.nax_library : c.library;
  if (lib == nil) return internal("no library holds kernel " + name);
  id<MTLFunction> fn = [lib newFunctionWithName:[NSString stringWithUTF8String:name.c_str()]];
  if (fn == nil) return internal("the metallib has no kernel " + name);
  NSError* error = nil;
  id<MTLComputePipelineState> ps = [c.device newComputePipelineStateWithFunction:fn error:&error];
  if (ps == nil) {
    return internal("pipeline for " + name + ": " +
                    (error ? std::string(error.localizedDescription.UTF8String) : "unknown error"));
  }
  c.pipelines.emplace(name, ps);
  *out = ps;
  return ffi::Error::Success();
}

// ---- Buffers --------------------------------------------------------------------------

struct Bound {
  id<MTLBuffer> buffer;
  bool staged;
};

Bound bind(id<MTLDevice> device, const Binding& b) {
  const size_t page = vm_page_size;
  if (b.bytes == 0) {  // an absent operand ([0]): the kernels never read it
    return {[device newBufferWithLength:16 options:MTLResourceStorageModeShared], false};
  }
  if (reinterpret_cast<uintptr_t>(b.host) % page == 0 && b.bytes % page == 0) {
    id<MTLBuffer> wrapped = [device newBufferWithBytesNoCopy:b.host
                                                      length:b.bytes
                                                     options:MTLResourceStorageModeShared
                                                 deallocator:nil];
    if (wrapped != nil) return {wrapped, false};
  }
  id<MTLBuffer> staged = [device newBufferWithLength:b.bytes options:MTLResourceStorageModeShared];
  if (staged != nil && !b.output) memcpy(staged.contents, b.host, b.bytes);
  return {staged, true};
}

}  // namespace

bool use_nax() { return context().use_nax; }

// One dispatch of `plan` with `bindings` at indices 0.. and the parameter block after them.
ffi::Error run(const Plan& plan, const std::vector<Binding>& bindings, const void* params, size_t params_size) {
  Context& c = context();
  if (c.device == nil) return internal("not initialized: " + c.init_error);
  for (int i = 0; i < 3; ++i) {
    if (plan.grid[i] == 0) return ffi::Error::Success();  // nothing to compute
  }
  id<MTLComputePipelineState> ps = nil;
  if (ffi::Error e = pipeline_for(plan.kernel, &ps); e.failure()) return e;
  if (plan.threads > ps.maxTotalThreadsPerThreadgroup) {
    return internal(plan.kernel + " needs " + std::to_string(plan.threads) + " threads per threadgroup; this GPU allows " +
                    std::to_string(ps.maxTotalThreadsPerThreadgroup));
  }
  @autoreleasepool {
    std::vector<Bound> bound;
    bound.reserve(bindings.size());
    for (const Binding& b : bindings) {
      bound.push_back(bind(c.device, b));
      if (bound.back().buffer == nil) return internal("could not allocate a buffer of " + std::to_string(b.bytes) + " bytes");
    }
    id<MTLCommandBuffer> cb = [c.queue commandBuffer];
    id<MTLComputeCommandEncoder> enc = [cb computeCommandEncoder];
    [enc setComputePipelineState:ps];
    for (size_t i = 0; i < bound.size(); ++i) [enc setBuffer:bound[i].buffer offset:0 atIndex:i];
    [enc setBytes:params length:params_size atIndex:bound.size()];
    [enc dispatchThreadgroups:MTLSizeMake(plan.grid[0], plan.grid[1], plan.grid[2])
        threadsPerThreadgroup:MTLSizeMake(plan.threads, 1, 1)];
    [enc endEncoding];
    [cb commit];
    [cb waitUntilCompleted];
    if (cb.status != MTLCommandBufferStatusCompleted) {
      return internal(plan.kernel + " failed on the GPU: " +
                      (cb.error ? std::string(cb.error.localizedDescription.UTF8String) : "unknown error"));
    }
    for (size_t i = 0; i < bound.size(); ++i) {
      if (bound[i].staged && bindings[i].output) memcpy(bindings[i].host, bound[i].buffer.contents, bindings[i].bytes);
    }
  }
  return ffi::Error::Success();
}

}  // namespace jq_metal

using namespace jq_metal;  // the C entry points below use the context and helpers above

#define JQ_EXPORT __attribute__((visibility("default")))

extern "C" {

JQ_EXPORT int jq_metal_abi_version() { return 1; }

// Opens the default GPU and `lib_dir`/jaxquant.metallib (and jaxquant_nax.metallib where
// present and the GPU has tensor units; JAXQUANT_METAL_NAX=0 turns it off, =1 forces it).
// Returns nullptr, or why the backend cannot run. Idempotent.
JQ_EXPORT const char* jq_metal_init(const char* lib_dir) {
  Context& c = context();
  std::lock_guard<std::mutex> lock(c.mu);
  if (c.device != nil) return nullptr;
  @autoreleasepool {
    id<MTLDevice> device = MTLCreateSystemDefaultDevice();
    if (device == nil) {
      c.init_error = "no Metal device";
      return c.init_error.c_str();
    }
    std::string why;
    id<MTLLibrary> lib = load_library(device, std::string(lib_dir) + "/jaxquant.metallib", &why);
    if (lib == nil) {
      c.init_error = "could not load " + why;
      return c.init_error.c_str();
    }
    const char* env = getenv("JAXQUANT_METAL_NAX");
    const bool want_nax = env ? strcmp(env, "0") != 0 : [device supportsFamily:kFamilyWithTensorUnits];
    if (want_nax) {
      c.nax_library = load_library(device, std::string(lib_dir) + "/jaxquant_nax.metallib", nullptr);
      c.use_nax = c.nax_library != nil;
    }
    c.queue = [device newCommandQueue];
    c.library = lib;
    c.device_name = device.name.UTF8String;
    c.device = device;
  }
  return nullptr;
}

JQ_EXPORT const char* jq_metal_device_name() { return context().device_name.c_str(); }

// 1 when qmm's GEMM runs on the tensor-op kernel (qmm_nax.metal).
JQ_EXPORT int jq_metal_uses_nax() { return context().use_nax ? 1 : 0; }

}  // extern "C"
