// The fused decode GEMVs (qmv_mma.h, FUSE: rms_norm_qmm's norm prologue and
// qmm_swiglu's epilogue) for the affine formats with f32 activations (one
// translation unit per family and dtype, built in parallel).
#include "qmv_mma.h"

#if defined(JQ_PLATFORM_CUDA)
namespace jq {
namespace gpu {
namespace mma {

JQ_MMA_FUSED_TU(affine, f32, kF32, kAffineFormats)

}  // namespace mma
}  // namespace gpu
}  // namespace jq
#endif
