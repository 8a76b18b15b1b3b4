// XLA FFI handlers of the ffi backend on the GPU (CUDA and ROCm from this one
// file). Each validates its call (include/jq/ffi_common.h: an ffi::Error with
// a message instead of a launch on bad memory) and launches on XLA's stream.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mutex>
#include <string>

#include "gpu_common.h"
#include "jq/ffi_common.h"

namespace ffi = xla::ffi;

namespace {
struct DeviceInfo {
  int warp = 0, sms = 0;
};
DeviceInfo device_info() {
  static std::mutex mu;
  static DeviceInfo cache[64];
  int dev = 0;
  if (hipGetDevice(&dev) != hipSuccess || dev < 0 || dev >= 64) dev = 0;
  std::lock_guard<std::mutex> lock(mu);
  DeviceInfo& d = cache[dev];
  if (d.warp == 0) {
    int v = 0;
    d.warp = hipDeviceGetAttribute(&v, hipDeviceAttributeWarpSize, dev) == hipSuccess && v > 0 ? v : 32;
    d.sms = hipDeviceGetAttribute(&v, hipDeviceAttributeMultiprocessorCount, dev) == hipSuccess && v > 0 ? v : 80;
  }
  return d;
}
}  // namespace

int jq_device_warp_size() { return device_info().warp; }
int jq_device_sm_count() { return device_info().sms; }

namespace jq {
namespace gpu {

// Kernel choice for the fused GEMV: one place, as data. $JAXQUANT_FFI_GPU_QMV
// ("R,THREADS") overrides the rows per warp for M = 1 (benchmark sweeps); the
// accumulation order does not depend on it.
QmvConfig qmv_config(const QmvProblem& p) {
  // M = 1: 4 rows per warp in 128-thread blocks (H100, (4096, 14336): 26-27 µs against
  // 29-32 µs for 256 threads; benchmarks/h100_ffi_gemv_sweep.txt).
  QmvConfig c{1, 4, 128};
  if (p.M > 1) {
    c = QmvConfig{8, 1, 256};
  } else if (p.N < 4 * 1024) {
    c = QmvConfig{1, 2, 256};  // small N: more warps
  }
  if (const char* env = getenv("JAXQUANT_FFI_GPU_QMV")) {
    int r = 0, t = 0;
    if (sscanf(env, "%d,%d", &r, &t) == 2 && p.M == 1 && (r == 1 || r == 2 || r == 4) &&
        (t == 64 || t == 128 || t == 256))
      c = QmvConfig{1, r, t};
  }
  return c;
}

static ffi::Error dequantize_impl(hipStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scales,
                                  ffi::AnyBuffer biases, ffi::AnyBuffer gs,
                                  ffi::Result<ffi::AnyBuffer> out, int64_t fmt, int64_t bits,
                                  int64_t group_size) {
  DequantProblem p;
  if (auto e = make_dequant(data, scales, biases, gs, *out, fmt, bits, group_size, &p);
      e.failure())
    return e;
  if (p.rows == 0 || p.k == 0) return ffi::Error::Success();
  JQ_LAUNCH_CHECK(launch_dequant(p, stream), "the dequantize kernel");
  return ffi::Error::Success();
}

static ffi::Error qmv_impl(hipStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer data,
                           ffi::AnyBuffer scales, ffi::AnyBuffer biases, ffi::AnyBuffer gs,
                           ffi::AnyBuffer indices, ffi::Result<ffi::AnyBuffer> y, int64_t fmt,
                           int64_t bits, int64_t group_size) {
  QmvProblem p;
  if (auto e = make_qmv(x, data, scales, biases, gs, indices, *y, fmt, bits, group_size, &p);
      e.failure())
    return e;
  if (p.S == 0 || p.M == 0 || p.N == 0) return ffi::Error::Success();
  if (p.K == 0)
    return ffi::Error::InvalidArgument("jaxquant ffi: K=0 is not supported by the GPU GEMV");
  const QmvConfig c = qmv_config(p);
  JQ_LAUNCH_CHECK(p.fmt == kAffine ? launch_qmv_affine(p, c, stream)
                                   : launch_qmv_float(p, c, stream),
                  "the qmv kernel");
  return ffi::Error::Success();
}

static ffi::Error run_norm(const NormProblem& p, hipStream_t stream) {
  if (p.rows == 0 || p.d == 0) return ffi::Error::Success();
  JQ_LAUNCH_CHECK(launch_norm(p, stream), "the norm kernel");
  return ffi::Error::Success();
}

static ffi::Error rms_norm_impl(hipStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                ffi::Result<ffi::AnyBuffer> y, float eps, float weight_offset) {
  NormProblem p;
  if (auto e = make_norm(kRmsNorm, x, nullptr, w, *y, nullptr, eps, weight_offset, 0, 1, 0, &p);
      e.failure())
    return e;
  return run_norm(p, stream);
}

static ffi::Error add_rms_norm_impl(hipStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer r,
                                    ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                                    ffi::Result<ffi::AnyBuffer> h, float eps,
                                    float weight_offset) {
  NormProblem p;
  ffi::AnyBuffer hb = *h;
  if (auto e = make_norm(kAddRmsNorm, x, &r, w, *y, &hb, eps, weight_offset, 0, 1, 0, &p);
      e.failure())
    return e;
  return run_norm(p, stream);
}

static ffi::Error gated_rms_norm_impl(hipStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gate,
                                      ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y, float eps,
                                      float weight_offset, int64_t activation,
                                      int64_t norm_before_gate, int64_t group_size) {
  NormProblem p;
  if (auto e = make_norm(kGatedRmsNorm, x, &gate, w, *y, nullptr, eps, weight_offset,
                         activation, norm_before_gate, group_size, &p);
      e.failure())
    return e;
  return run_norm(p, stream);
}

}  // namespace gpu
}  // namespace jq

using Stream = ffi::PlatformStream<hipStream_t>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_gpu_dequantize, jq::gpu::dequantize_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_gpu_qmv, jq::gpu::qmv_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_gpu_rms_norm, jq::gpu::rms_norm_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_gpu_add_rms_norm, jq::gpu::add_rms_norm_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_gpu_gated_rms_norm, jq::gpu::gated_rms_norm_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_offset")
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("norm_before_gate")
                                  .Attr<int64_t>("group_size"));

extern "C" __attribute__((visibility("default"))) int jq_abi_version() { return 1; }
