// The tensor-core decode GEMV (qmv_mma.h): the float formats with bf16 activations
// (one translation unit per family and dtype, built in parallel).
#include "qmv_mma.h"

#if defined(JQ_PLATFORM_CUDA)
namespace jq {
namespace gpu {
namespace mma {

hipError_t launch_qmv_mma_float_bf16(const Problem& pr, int nt, hipStream_t stream) {
  return launch_float<kBF16>(pr, nt, stream);
}

}  // namespace mma
}  // namespace gpu
}  // namespace jq
#endif
