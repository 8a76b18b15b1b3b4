// The CPU kernels for x86-64 with AVX-512 F/BW/VL/DQ and VBMI (chosen at run time).
#define JQ_CPU_NS avx512
#define JQ_CPU_ISA_NAME "avx512f+bw+vl+dq+vbmi"
#include "kernels_impl.inc"

namespace jq {
namespace cpu {
const Kernels* kernels_avx512() { return &avx512::kTable; }
}  // namespace cpu
}  // namespace jq
