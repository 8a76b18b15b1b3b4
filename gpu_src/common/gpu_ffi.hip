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
  // M = 1: 4 rows per warp in 128-thread blocks, faster than 256 threads at (4096, 14336)
  // on an H100 (benchmarks/h100/qmm.json `qmm.ffi_gemv.*`).
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

// How the GPU runs a validated, non-empty problem (the handlers around these:
// include/jq/ffi_common.h, Handlers): a launch on XLA's stream.
struct GpuPlatform {
  // Each handler validates shapes and launches on XLA's stream: no sync, no allocation,
  // no host read of device data, so XLA may record it into its command buffer. Called
  // on every run instead, an FFI call cost 12-20 us of host time in a jitted function
  // on an H100 (docs/decode.md, "Host time per call").
  static constexpr bool kCapturable = true;

  static ffi::Error dequantize(const DequantProblem& p, hipStream_t stream) {
    JQ_LAUNCH_CHECK(launch_dequant(p, stream), "the dequantize kernel");
    return ffi::Error::Success();
  }

  static ffi::Error qmv(const QmvProblem& p, hipStream_t stream) {
    if (p.K == 0)
      return ffi::Error::InvalidArgument("jaxquant ffi: K=0 is not supported by the GPU GEMV");
    const QmvConfig c = qmv_config(p);
    JQ_LAUNCH_CHECK(p.fmt == kAffine ? launch_qmv_affine(p, c, stream)
                                     : launch_qmv_float(p, c, stream),
                    "the qmv kernel");
    return ffi::Error::Success();
  }

  static ffi::Error norm(const NormProblem& p, hipStream_t stream) {
    JQ_LAUNCH_CHECK(launch_norm(p, stream), "the norm kernel");
    return ffi::Error::Success();
  }
};

using GpuHandlers = Handlers<GpuPlatform, ffi::PlatformStream<hipStream_t>>;

}  // namespace gpu
}  // namespace jq

#if defined(JQ_PLATFORM_ROCM)
namespace jq {
namespace cdna4 {
// gpu_src/rocm/cdna4_qmm.hip (in the ROCm library only): the gfx950 MXFP4 qmm on the
// cdna4 layout; it validates its own operands.
ffi::Error qmm_impl(hipStream_t stream, ffi::AnyBuffer xq, ffi::AnyBuffer xs, ffi::AnyBuffer w,
                    ffi::AnyBuffer ws, ffi::Result<ffi::AnyBuffer> y);
}  // namespace cdna4
namespace gpu {
// The ROCm library's handlers: the GPU ones plus
// jaxquant_cdna4_qmm: x terms [B,T,Mp,K], x scales, data, scales -> y [B,M,N].
struct RocmHandlers : GpuHandlers {
  static ffi::Error cdna4_qmm(hipStream_t stream, Buf xq, Buf xs, Buf w, Buf ws, Out y) {
    return cdna4::qmm_impl(stream, xq, xs, w, ws, y);
  }
  static auto bind_cdna4_qmm() { return ffi_rets<1>(ffi_args<4>(bind())); }
};
}  // namespace gpu
}  // namespace jq

// The targets of the ROCm library: every platform's, plus the gfx950 qmm.
#define JQ_GPU_TARGETS(X, ...) JQ_FFI_TARGETS(X, __VA_ARGS__) X(cdna4_qmm, __VA_ARGS__)
// jq_gpu_<target> for every target, jq_abi_version, jq_ffi_targets, jq_format_name.
JQ_FFI_DEFINE_LIBRARY(jq_gpu_, jq::gpu::RocmHandlers, JQ_GPU_TARGETS)
#else
// The targets of the GPU libraries: every platform's (a GPU-only target is added here).
#define JQ_GPU_TARGETS(X, ...) JQ_FFI_TARGETS(X, __VA_ARGS__)

// jq_gpu_<target> for every target, jq_abi_version, jq_ffi_targets, jq_format_name.
JQ_FFI_DEFINE_LIBRARY(jq_gpu_, jq::gpu::GpuHandlers, JQ_GPU_TARGETS)
#endif
