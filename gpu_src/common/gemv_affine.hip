// The fused GEMV for affine 2..8-bit weights (kernel: gemv_impl.h).
#include "gemv_impl.h"

namespace jq {
namespace gpu {

hipError_t launch_qmv_affine(const QmvProblem& p, const QmvConfig& c, hipStream_t stream) {
  return launch_qmv_of<kAffineFormats>(p, c, stream);
}

}  // namespace gpu
}  // namespace jq
