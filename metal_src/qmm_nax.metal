// Quantized GEMM on the GPU's tensor units (Apple "neural accelerators", Metal 4 MPP
// tensor ops): the MetalTile fp4 qmm_nax (seed) design for GPUs that have them; the bridge
// picks it at run time (metal_ffi.mm: device family check, JAXQUANT_METAL_NAX), else
// qmm.metal runs. Needs the macOS 26 SDK (MetalPerformancePrimitives); CMake builds it
// into its own metallib only where that SDK is present.
//
// Geometry as the seed: 128 threads (4 simdgroups, execution_simdgroups<4>), a 32 x 32
// output tile per threadgroup, BK = 32; each K-block the threads stage x (8 elements
// each) and dequantize W (one uint32 pack each) into threadgroup memory, then one
// cooperative matmul2d(32, 32, 32, NT, multiply_accumulate) adds the block into a
// threadgroup float32 tile. Changed: staging in float32 (the seed staged bf16 through
// half), packed tiles (row stride 32: the tensor views here are packed), masked M and N
// edges, every format of dequant_pack.
//
// Grid: (ceil(n / 32), ceil(m / 32), batch) threadgroups of 128 threads.
#include "jq_metal.h"
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>

namespace jq {

using namespace mpp::tensor_ops;

// A packed 32 x 32 tensor view of threadgroup memory (element type with its address space).
template <typename P>
METAL_FUNC auto tile_view(P ptr) {
  using E = remove_pointer_t<P>;
  return tensor<E, dextents<int32_t, 2>, tensor_inline>(ptr, dextents<int32_t, 2>(32, 32));
}

template <typename T, uint F>
kernel void qmm_nax(device const uint* w [[buffer(0)]],
                    device const uchar* scales_raw [[buffer(1)]],
                    device const T* biases [[buffer(2)]],
                    device const T* x [[buffer(3)]],
                    device T* out [[buffer(4)]],
                    constant QmmParams& p [[buffer(5)]],
                    JQ_THREAD_IDS) {
  threadgroup float xs[32 * 32];  // x tile, M x K
  threadgroup float ws[32 * 32];  // W tile, N x K (the right operand transposed)
  threadgroup float cs[32 * 32];  // accumulator, M x N
  const uint n0 = tgid.x * 32u, m0 = tgid.y * 32u, b = tgid.z;
  const uint r = tid / 4u, quad = tid & 3u;
  const bool x_ok = m0 + r < p.m, w_ok = n0 + r < p.n;
  const ulong x_row = (ulong(b) * p.m + m0 + r) * p.k;
  const ulong w_row = ulong(b) * p.n + n0 + r;
  device const uint* wp = w + w_row * (p.k / 8u);
  const ulong s_row = w_row * (p.k / p.group_size);
  for (uint j = 0; j < 8; ++j) cs[tid * 8u + j] = 0.0f;

  constexpr auto desc = matmul2d_descriptor(32, 32, 32, false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroups<4>> op;
  auto tx = tile_view(xs);
  auto tw = tile_view(ws);
  auto tc = tile_view(cs);
  for (uint kb = 0; kb < p.k; kb += 32u) {
    const uint k0 = kb + quad * 8u;
    float v[8];
    if (w_ok) {
      dequant_pack<T, F>(wp[k0 / 8u], scales_raw, biases, s_row + k0 / p.group_size, v);
    } else {
      for (uint j = 0; j < 8; ++j) v[j] = 0.0f;
    }
    for (uint j = 0; j < 8; ++j) {
      xs[r * 32u + quad * 8u + j] = x_ok ? float(x[x_row + k0 + j]) : 0.0f;
      ws[r * 32u + quad * 8u + j] = v[j];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    op.run(tx, tw, tc);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint j = 0; j < 8; ++j) {
    const uint n = n0 + quad * 8u + j;
    if (m0 + r < p.m && n < p.n) out[(ulong(b) * p.m + m0 + r) * p.n + n] = T(cs[r * 32u + quad * 8u + j]);
  }
}

#define JQ_QMM_NAX(T, tname, F, fname) JQ_KERNEL("jq_qmm_nax_" fname "_" tname, qmm_nax<T, F>)
#define JQ_QMM_NAX_ALL(F, fname)           \
  JQ_QMM_NAX(float, "float32", F, fname)   \
  JQ_QMM_NAX(half, "float16", F, fname)    \
  JQ_QMM_NAX(bfloat, "bfloat16", F, fname)
JQ_QMM_NAX_ALL(kAffine4, "affine4")
JQ_QMM_NAX_ALL(kMxfp4, "mxfp4")
JQ_QMM_NAX_ALL(kFp4, "fp4")

}  // namespace jq
