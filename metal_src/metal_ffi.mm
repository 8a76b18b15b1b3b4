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
// Every call is checked (dtypes, ranks, shapes against each other, sizes that fit the
// kernels' 32-bit indices) and a bad one returns ffi::Error before any buffer is touched.
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

#include "dispatch_plan.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

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

ffi::Error invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jaxquant metal: " + what);
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

struct Binding {
  void* host;
  size_t bytes;
  bool output;
};

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

// One dispatch of `plan` with `bindings` at indices 0.. and the parameter block after them.
ffi::Error run(const jq_metal::Plan& plan, const std::vector<Binding>& bindings, const void* params,
               size_t params_size) {
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

Binding in(const ffi::AnyBuffer& b) { return {b.untyped_data(), b.size_bytes(), false}; }
Binding out(ffi::AnyBuffer b) { return {b.untyped_data(), b.size_bytes(), true}; }

// ---- Checks ---------------------------------------------------------------------------

const char* float_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    default: return nullptr;
  }
}

std::string dims_str(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

bool dims_are(ffi::AnyBuffer::Dimensions d, std::initializer_list<int64_t> want) {
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want) {
    if (d[i++] != w) return false;
  }
  return true;
}

constexpr int64_t kMaxIndex = int64_t(1) << 31;  // the kernels index with 32-bit counts

const char* format_name(int64_t fmt) {
  switch (fmt) {
    case 0: return "affine4";
    case 1: return "mxfp4";
    case 2: return "fp4";
    default: return nullptr;
  }
}

bool group_ok(int64_t fmt, int64_t g) {
  switch (fmt) {
    case 0: return g == 32 || g == 64 || g == 128;
    case 1: return g == 32;
    case 2: return g == 16 || g == 32 || g == 64;
    default: return false;
  }
}

// data [lead..., N, K/8] uint32, scales [lead..., N, K/g] (uint8 for mxfp4, else `value`),
// biases like scales for affine4, else [0]. Sets n, k, rows (prod of lead and N).
ffi::Error check_quantized(int64_t fmt, int64_t group, const ffi::AnyBuffer& data, const ffi::AnyBuffer& scales,
                           const ffi::AnyBuffer& biases, ffi::DataType value, int64_t* n, int64_t* k, int64_t* rows) {
  if (format_name(fmt) == nullptr) return invalid("fmt must be 0 (affine4), 1 (mxfp4) or 2 (fp4); got " + std::to_string(fmt));
  if (!group_ok(fmt, group)) return invalid("group_size " + std::to_string(group) + " is not one of " + format_name(fmt) + "'s");
  auto dd = data.dimensions(), sd = scales.dimensions();
  if (data.element_type() != ffi::DataType::U32 || dd.size() < 2)
    return invalid("data must be uint32 [..., N, K/8]; got " + dims_str(dd));
  *n = dd[dd.size() - 2];
  *k = dd[dd.size() - 1] * 8;
  if (*k % 32 || *k == 0) return invalid("K must be a positive multiple of 32; got " + std::to_string(*k));
  const ffi::DataType want_scale = fmt == 1 ? ffi::DataType::U8 : value;
  if (scales.element_type() != want_scale || sd.size() != dd.size())
    return invalid("scales must have data's rank and dtype " + std::string(fmt == 1 ? "uint8" : float_name(value)));
  for (size_t i = 0; i + 1 < dd.size(); ++i) {
    if (sd[i] != dd[i]) return invalid("scales " + dims_str(sd) + " do not match data " + dims_str(dd));
  }
  if (sd[sd.size() - 1] * group != *k) return invalid("scales' last axis must be K / group_size");
  if (fmt == 0) {
    auto bd = biases.dimensions();
    if (biases.element_type() != value || bd.size() != sd.size())
      return invalid("biases must match scales for affine4");
    for (size_t i = 0; i < sd.size(); ++i) {
      if (bd[i] != sd[i]) return invalid("biases " + dims_str(bd) + " do not match scales " + dims_str(sd));
    }
  } else if (biases.element_count() != 0) {
    return invalid("biases must be empty for mxfp4 and fp4");
  }
  *rows = 1;
  for (size_t i = 0; i + 1 < dd.size(); ++i) *rows *= dd[i];
  if (*rows * *k >= kMaxIndex * 8) return invalid("the weight is too large for the kernels' 32-bit indices");
  return ffi::Error::Success();
}

// ---- Handlers -------------------------------------------------------------------------

ffi::Error dequantize_impl(ffi::AnyBuffer data, ffi::AnyBuffer scales, ffi::AnyBuffer biases,
                           ffi::Result<ffi::AnyBuffer> y, int64_t fmt, int64_t group) {
  const char* dt = float_name(y->element_type());
  if (dt == nullptr) return invalid("the output must be float32, float16 or bfloat16");
  int64_t n, k, rows;
  if (ffi::Error e = check_quantized(fmt, group, data, scales, biases, y->element_type(), &n, &k, &rows); e.failure())
    return e;
  if (y->element_count() != rows * k) return invalid("the output must have shape [..., N, K]");
  JqDequantParams p{uint32_t(rows), uint32_t(k), uint32_t(group)};
  return run(jq_metal::plan_dequantize(format_name(fmt), dt, p), {in(data), in(scales), in(biases), out(*y)}, &p,
             sizeof p);
}

// x [Sx, M, K]; data [E, N, K/8]; ids int32 [S] or [0] (then S = E = Sx) -> y [S, M, N].
ffi::Error qmv_impl(ffi::AnyBuffer x, ffi::AnyBuffer data, ffi::AnyBuffer scales, ffi::AnyBuffer biases,
                    ffi::AnyBuffer ids, ffi::Result<ffi::AnyBuffer> y, int64_t fmt, int64_t group) {
  const char* dt = float_name(x.element_type());
  auto xd = x.dimensions();
  if (dt == nullptr || xd.size() != 3) return invalid("x must be float32/float16/bfloat16 [Sx, M, K]");
  if (data.dimensions().size() != 3) return invalid("data must be [E, N, K/8]");
  int64_t n, k, rows;
  if (ffi::Error e = check_quantized(fmt, group, data, scales, biases, x.element_type(), &n, &k, &rows); e.failure())
    return e;
  const int64_t e = data.dimensions()[0], sx = xd[0], m = xd[1];
  if (xd[2] != k) return invalid("x's last axis " + std::to_string(xd[2]) + " must be K = " + std::to_string(k));
  if (m < 1 || m > int64_t(jq_metal::kGemvMaxM)) return invalid("the GEMV takes 1 to 8 rows of x per slot");
  const bool has_ids = ids.element_count() != 0;
  if (has_ids && (ids.element_type() != ffi::DataType::S32 || ids.dimensions().size() != 1))
    return invalid("ids must be int32 [S]");
  const int64_t s = has_ids ? ids.dimensions()[0] : e;
  if (sx < 1 || s % sx) return invalid("the slots (" + std::to_string(s) + ") must be a multiple of x's " + std::to_string(sx));
  if (!has_ids && sx != e) return invalid("without ids, x must have one [M, K] per expert");
  if (y->element_type() != x.element_type() || !dims_are(y->dimensions(), {s, m, n}))
    return invalid("the output must be x's dtype [S, M, N]");
  if (s * m * n >= kMaxIndex || sx * m * k >= kMaxIndex) return invalid("too large for 32-bit indices");
  JqQmmParams p{uint32_t(k), uint32_t(n), uint32_t(m), uint32_t(group), uint32_t(e), uint32_t(s), uint32_t(s / sx),
                uint32_t(has_ids)};
  return run(jq_metal::plan_qmv(format_name(fmt), dt, p),
             {in(data), in(scales), in(biases), in(x), in(ids), out(*y)}, &p, sizeof p);
}

// x [B, M, K]; data [B, N, K/8] -> y [B, M, N] (the GEMM).
ffi::Error qmm_impl(ffi::AnyBuffer x, ffi::AnyBuffer data, ffi::AnyBuffer scales, ffi::AnyBuffer biases,
                    ffi::Result<ffi::AnyBuffer> y, int64_t fmt, int64_t group) {
  const char* dt = float_name(x.element_type());
  auto xd = x.dimensions();
  if (dt == nullptr || xd.size() != 3) return invalid("x must be float32/float16/bfloat16 [B, M, K]");
  if (data.dimensions().size() != 3) return invalid("data must be [B, N, K/8]");
  int64_t n, k, rows;
  if (ffi::Error e = check_quantized(fmt, group, data, scales, biases, x.element_type(), &n, &k, &rows); e.failure())
    return e;
  const int64_t b = data.dimensions()[0], m = xd[1];
  if (xd[0] != b || xd[2] != k) return invalid("x " + dims_str(xd) + " does not match data " + dims_str(data.dimensions()));
  if (y->element_type() != x.element_type() || !dims_are(y->dimensions(), {b, m, n}))
    return invalid("the output must be x's dtype [B, M, N]");
  if (b * m * n >= kMaxIndex || b * m * k >= kMaxIndex || (m + 31) / 32 >= 65536) return invalid("too large for the GEMM's grid");
  JqQmmParams p{uint32_t(k), uint32_t(n), uint32_t(m), uint32_t(group), uint32_t(b), uint32_t(b), 1, 0};
  return run(jq_metal::plan_qmm(format_name(fmt), dt, p, context().use_nax),
             {in(data), in(scales), in(biases), in(x), out(*y)}, &p, sizeof p);
}

// x [..., n]: rows and n; weight [n] or [0] in `wdt`.
ffi::Error check_rows(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, ffi::DataType wdt, int64_t* rows, int64_t* n,
                      bool* has_weight) {
  auto d = x.dimensions();
  if (float_name(x.element_type()) == nullptr || d.size() < 1) return invalid("x must be a float array [..., n]");
  *n = d[d.size() - 1];
  *rows = *n == 0 ? 0 : x.element_count() / *n;
  *has_weight = w.element_count() != 0;
  if (*has_weight && (w.element_type() != wdt || !dims_are(w.dimensions(), {*n})))
    return invalid("weight must be [" + std::to_string(*n) + "] in the output's dtype");
  if (x.element_count() >= kMaxIndex) return invalid("too large for 32-bit indices");
  return ffi::Error::Success();
}

ffi::Error rms_norm_impl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y, float eps,
                         float weight_offset) {
  int64_t rows, n;
  bool has_w;
  if (ffi::Error e = check_rows(x, w, x.element_type(), &rows, &n, &has_w); e.failure()) return e;
  if (y->element_type() != x.element_type() || y->element_count() != x.element_count())
    return invalid("the output must be x's dtype and shape");
  if (rows == 0) return ffi::Error::Success();
  JqNormParams p{uint32_t(rows), uint32_t(n), uint32_t(n), uint32_t(has_w), eps, weight_offset, 0, 0};
  return run(jq_metal::plan_rms_norm(float_name(x.element_type()), p), {in(x), in(w), out(*y)}, &p, sizeof p);
}

ffi::Error add_rms_norm_impl(ffi::AnyBuffer x, ffi::AnyBuffer r, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                             ffi::Result<ffi::AnyBuffer> h, float eps, float weight_offset) {
  int64_t rows, n;
  bool has_w;
  if (ffi::Error e = check_rows(x, w, r.element_type(), &rows, &n, &has_w); e.failure()) return e;
  if (float_name(r.element_type()) == nullptr || r.element_count() != x.element_count())
    return invalid("residual must be a float array of x's shape");
  for (ffi::AnyBuffer o : {*y, *h}) {
    if (o.element_type() != r.element_type() || o.element_count() != x.element_count())
      return invalid("the outputs must be residual's dtype and x's shape");
  }
  if (rows == 0) return ffi::Error::Success();
  JqNormParams p{uint32_t(rows), uint32_t(n), uint32_t(n), uint32_t(has_w), eps, weight_offset, 0, 0};
  return run(jq_metal::plan_add_rms_norm(float_name(x.element_type()), float_name(r.element_type()), p),
             {in(x), in(r), in(w), out(*y), out(*h)}, &p, sizeof p);
}

ffi::Error gated_rms_norm_impl(ffi::AnyBuffer x, ffi::AnyBuffer gate, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                               float eps, float weight_offset, int64_t activation, int64_t norm_before_gate,
                               int64_t group_size) {
  int64_t rows, n;
  bool has_w;
  if (ffi::Error e = check_rows(x, w, gate.element_type(), &rows, &n, &has_w); e.failure()) return e;
  if (float_name(gate.element_type()) == nullptr || gate.element_count() != x.element_count())
    return invalid("gate must be a float array of x's shape");
  if (y->element_type() != gate.element_type() || y->element_count() != x.element_count())
    return invalid("the output must be gate's dtype and x's shape");
  if (activation != 0 && activation != 1) return invalid("activation must be 0 (silu) or 1 (sigmoid)");
  const int64_t g = group_size == 0 ? n : group_size;
  if (g <= 0 || (n != 0 && n % g)) return invalid("group_size must divide the last axis");
  if (rows == 0) return ffi::Error::Success();
  JqNormParams p{uint32_t(rows * (n / g)), uint32_t(g), uint32_t(n), uint32_t(has_w), eps, weight_offset,
                 uint32_t(activation), uint32_t(norm_before_gate != 0)};
  return run(jq_metal::plan_gated_rms_norm(float_name(x.element_type()), float_name(gate.element_type()), p),
             {in(x), in(gate), in(w), out(*y)}, &p, sizeof p);
}

}  // namespace

#define JQ_EXPORT __attribute__((visibility("default")))

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_metal_dequantize, dequantize_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("group_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_metal_qmv, qmv_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("group_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_metal_qmm, qmm_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("group_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_metal_rms_norm, rms_norm_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_metal_add_rms_norm, add_rms_norm_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_metal_gated_rms_norm, gated_rms_norm_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_offset")
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("norm_before_gate")
                                  .Attr<int64_t>("group_size"));

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
