// The CPU kernels for the baseline ISA of the target (x86-64: SSE2; arm64: the generic
// vector code, which the compiler maps to NEON, without kernels_neon.cc's explicit paths).
#define JQ_CPU_NS base
#define JQ_CPU_ISA_NAME "baseline"
#include "kernels_impl.inc"

namespace jq {
namespace cpu {
const Kernels* kernels_base() { return &base::kTable; }

// The ISA variants this build leaves out (CMakeLists.txt defines JQ_HAVE_<ISA>_VARIANT
// for those it compiles): null, so the choice at run time skips them. Here, in the one
// kernels file every build compiles, for the library and the ISA test's driver alike.
#if !defined(JQ_HAVE_AVX2_VARIANT)
const Kernels* kernels_avx2() { return nullptr; }
#endif
#if !defined(JQ_HAVE_AVX512_VARIANT)
const Kernels* kernels_avx512() { return nullptr; }
#endif
#if !defined(JQ_HAVE_NEON_VARIANT)
const Kernels* kernels_neon() { return nullptr; }
#endif
}  // namespace cpu
}  // namespace jq
