// The fused GEMV for the small-float formats: MXFP4/6/8, NVFP4, FP4 (kernel: qmv_impl.h).
#include "qmv_impl.h"

namespace jq {
namespace gpu {

hipError_t launch_qmv_float(const QmvProblem& p, const QmvConfig& c, hipStream_t stream) {
  switch (p.fmt) {
    case kMxfp4: return launch_qmv<Codec<kMxfp4, 4>>(p, c, stream);
    case kMxfp6E2M3: return launch_qmv<Codec<kMxfp6E2M3, 6>>(p, c, stream);
    case kMxfp6E3M2: return launch_qmv<Codec<kMxfp6E3M2, 6>>(p, c, stream);
    case kMxfp8E4M3: return launch_qmv<Codec<kMxfp8E4M3, 8>>(p, c, stream);
    case kMxfp8E5M2: return launch_qmv<Codec<kMxfp8E5M2, 8>>(p, c, stream);
    case kNvfp4: return launch_qmv<Codec<kNvfp4, 4>>(p, c, stream);
    default: return launch_qmv<Codec<kFp4, 4>>(p, c, stream);
  }
}

}  // namespace gpu
}  // namespace jq
