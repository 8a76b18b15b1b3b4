// The tensor-core decode GEMV (qmv_mma.h) for bf16 activations: one translation
// unit per activation dtype so that nvcc builds them in parallel.
#include "qmv_mma.h"

#if defined(JQ_PLATFORM_CUDA)
namespace jq {
namespace gpu {
namespace mma {

hipError_t launch_qmv_mma_bf16(const Problem& pr, int nt, hipStream_t stream) {
  return launch_formats<kBF16>(pr, nt, stream);
}

}  // namespace mma
}  // namespace gpu
}  // namespace jq
#endif
