// The fused GEMV for affine 2..8-bit weights (kernel: qmv_impl.h).
#include "qmv_impl.h"

namespace jq {
namespace gpu {

hipError_t launch_qmv_affine(const QmvProblem& p, const QmvConfig& c, hipStream_t stream) {
  switch (p.bits) {
    case 2: return launch_qmv<Codec<kAffine, 2>>(p, c, stream);
    case 3: return launch_qmv<Codec<kAffine, 3>>(p, c, stream);
    case 4: return launch_qmv<Codec<kAffine, 4>>(p, c, stream);
    case 5: return launch_qmv<Codec<kAffine, 5>>(p, c, stream);
    case 6: return launch_qmv<Codec<kAffine, 6>>(p, c, stream);
    default: return launch_qmv<Codec<kAffine, 8>>(p, c, stream);
  }
}

}  // namespace gpu
}  // namespace jq
