// The fused GEMV for the small-float formats: MXFP4/6/8, NVFP4, FP4 (kernel: gemv_impl.h).
#include "gemv_impl.h"

namespace jq {
namespace gpu {

hipError_t launch_qmv_float(const QmvProblem& p, const QmvConfig& c, hipStream_t stream) {
  return launch_qmv_of<kFloatFormats>(p, c, stream);
}

}  // namespace gpu
}  // namespace jq
