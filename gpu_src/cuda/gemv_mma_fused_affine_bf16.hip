// The fused decode GEMVs (gemv_mma.h, FUSE: rms_norm_qmm's norm prologue and
// qmm_swiglu's epilogue) for the affine formats with bf16 activations (one
// translation unit per family and dtype; CMake compiles it once per variant).
#include "gemv_mma.h"

#if defined(JQ_PLATFORM_CUDA)
namespace jq {
namespace gpu {
namespace mma {

#if JQ_MMA_BUILDS(JQ_MMA_NORM)
JQ_MMA_FUSED_LAUNCHER(norm, kFuseNorm, affine, bf16, kBF16, kAffineFormats)
#endif
#if JQ_MMA_BUILDS(JQ_MMA_SWIGLU)
JQ_MMA_FUSED_LAUNCHER(swiglu, kFuseSwiglu, affine, bf16, kBF16, kAffineFormats)
#endif

}  // namespace mma
}  // namespace gpu
}  // namespace jq
#endif
