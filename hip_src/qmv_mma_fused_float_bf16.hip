// The fused decode GEMVs (qmv_mma.h, FUSE: rms_norm_qmm's norm prologue and
// qmm_swiglu's epilogue) for the float formats with bf16 activations (one
// translation unit per family and dtype, built in parallel).
#include "qmv_mma.h"

#if defined(JQ_PLATFORM_CUDA)
namespace jq {
namespace gpu {
namespace mma {

JQ_MMA_FUSED_TU(float, bf16, kBF16, kFloatFormats)

}  // namespace mma
}  // namespace gpu
}  // namespace jq
#endif
