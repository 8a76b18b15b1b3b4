// The CPU kernels for arm64 with NEON explicitly (every arm64 CPU has it; chosen at
// run time unless JAXQUANT_FFI_CPU_ISA=baseline).
#define JQ_CPU_NS neon
#define JQ_CPU_ISA_NAME "neon"
#define JQ_CPU_NEON 1
#include "kernels_impl.inc"

namespace jq {
namespace cpu {
const Kernels* kernels_neon() { return &neon::kTable; }
}  // namespace cpu
}  // namespace jq
