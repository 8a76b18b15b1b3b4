// The tensor-core decode GEMV (gemv_mma.h): the affine formats with f32 activations
// (one translation unit per family and dtype, built in parallel; the prefill GEMM
// takes 16-bit activations only).
#include "gemv_mma.h"

#if defined(JQ_PLATFORM_CUDA)
namespace jq {
namespace gpu {
namespace mma {

#if JQ_MMA_BUILDS(JQ_MMA_GEMV)
hipError_t launch_gemv_mma_affine_f32(const Problem& pr, int nt, hipStream_t stream) {
  return launch_formats<GemvLaunch, kF32, kAffineFormats>(pr, nt, stream);
}
#endif

}  // namespace mma
}  // namespace gpu
}  // namespace jq
#endif
