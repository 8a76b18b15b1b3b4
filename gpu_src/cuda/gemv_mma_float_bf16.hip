// The kernels on the cuda_mma layout for the float formats with bf16 activations:
// the decode GEMV (gemv_mma.h), the prefill GEMM and the layout's dequantize
// (qmm_gemm.h). One translation unit per family and dtype, built in parallel.
#include "qmm_gemm.h"

#if defined(JQ_PLATFORM_CUDA)
namespace jq {
namespace gpu {
namespace mma {

#if JQ_MMA_BUILDS(JQ_MMA_GEMV)
hipError_t launch_gemv_mma_float_bf16(const Problem& pr, int nt, hipStream_t stream) {
  return launch_formats<GemvLaunch, kBF16, kFloatFormats>(pr, nt, stream);
}
#endif

#if JQ_MMA_BUILDS(JQ_MMA_GEMM)
hipError_t launch_qmm_gemm_float_bf16(const GemmProblem& pr, hipStream_t stream) {
  return launch_formats<GemmLaunch, kBF16, kFloatFormats>(pr, 1, stream);
}
#endif

#if JQ_MMA_BUILDS(JQ_MMA_DEQUANT)
hipError_t launch_dequant_mma_float_bf16(const GemmProblem& pr, hipStream_t stream) {
  return launch_formats<DequantMmaLaunch, kBF16, kFloatFormats>(pr, 1, stream);
}
#endif

}  // namespace mma
}  // namespace gpu
}  // namespace jq
#endif
