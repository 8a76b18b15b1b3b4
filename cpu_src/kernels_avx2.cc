// The CPU kernels for x86-64 with AVX2, FMA and F16C (chosen at run time).
#define JQ_CPU_NS avx2
#define JQ_CPU_ISA_NAME "avx2+fma+f16c"
#include "kernels_impl.inc"

namespace jq {
namespace cpu {
const Kernels* kernels_avx2() { return &avx2::kTable; }
}  // namespace cpu
}  // namespace jq
