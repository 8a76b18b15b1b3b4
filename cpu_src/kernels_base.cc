// The CPU kernels for the baseline ISA of the target (x86-64: SSE2; arm64: the generic
// vector code, which the compiler maps to NEON, without kernels_neon.cc's explicit paths).
#define JQ_CPU_NS base
#define JQ_CPU_ISA_NAME "baseline"
#include "kernels_impl.inc"

namespace jq {
namespace cpu {
const Kernels* kernels_base() { return &base::kTable; }
}  // namespace cpu
}  // namespace jq
