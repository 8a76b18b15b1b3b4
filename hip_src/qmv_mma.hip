// The FFI handler of the tensor-core decode GEMV (kernel: qmv_mma.h):
// target jaxquant_qmv_mma, the operands of jaxquant_qmv with data, scales and
// biases in the cuda_mma layout (same shapes as canonical), plus `dedupe`
// (gather_qmm: up to that many slots sharing an expert read its weights once;
// 0: every slot alone). CUDA only; the ROCm build does not compile this file.
#include <string>

#include "jq/ffi_common.h"
#include "qmv_mma.h"

namespace ffi = xla::ffi;

// The handler: the operands of jaxquant_qmv (data, scales, biases in the
// cuda_mma layout, which keeps their canonical shapes), `dedupe` for gather.
static ffi::Error qmv_mma_impl(hipStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer data,
                               ffi::AnyBuffer scales, ffi::AnyBuffer biases, ffi::AnyBuffer gs,
                               ffi::AnyBuffer indices, ffi::Result<ffi::AnyBuffer> y, int64_t fmt,
                               int64_t bits, int64_t group_size, int64_t dedupe) {
  jq::QmvProblem q;
  if (auto e = jq::make_qmv(x, data, scales, biases, gs, indices, *y, fmt, bits, group_size, &q);
      e.failure())
    return e;
#if defined(JQ_PLATFORM_CUDA)
  using namespace jq::gpu::mma;
  if (q.S == 0 || q.M == 0 || q.N == 0) return ffi::Error::Success();
  if (q.K % kChunkK != 0)
    return jq::invalid("the cuda_mma layout needs K a multiple of 64; got K=" +
                       std::to_string(q.K));
  if (q.M > 16 || (q.indices != nullptr && q.M != 1))
    return jq::invalid("the tensor-core GEMV takes M <= 16 rows per matrix (1 per gather slot); "
                       "got M=" + std::to_string(q.M));
  if (q.S > 65535) return jq::invalid("too many slots for one launch: " + std::to_string(q.S));
  Problem P;
  P.q = q;
  P.tiles = (q.N + kTileRows - 1) / kTileRows;
  P.full_tiles = q.N / kTileRows;
  P.chunks = q.K / kChunkK;
  // dedupe scans the slots' ids once per block: worth it for decode-sized S only
  P.dedupe = q.indices != nullptr && dedupe != 0 && q.S <= 256;
  const int64_t rows_per_segment = q.indices != nullptr ? (P.dedupe ? dedupe : 1) : q.M;
  const int nt = rows_per_segment > 8 ? 2 : 1;
  JQ_LAUNCH_CHECK(q.x_dt == jq::kF32   ? launch_qmv_mma_f32(P, nt, stream)
                  : q.x_dt == jq::kF16 ? launch_qmv_mma_f16(P, nt, stream)
                                       : launch_qmv_mma_bf16(P, nt, stream),
                  "the tensor-core GEMV");
  return ffi::Error::Success();
#else
  (void)stream;
  return ffi::Error::Unimplemented("jaxquant ffi: the tensor-core GEMV is CUDA only");
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_gpu_qmv_mma, qmv_mma_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<hipStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("dedupe"));
