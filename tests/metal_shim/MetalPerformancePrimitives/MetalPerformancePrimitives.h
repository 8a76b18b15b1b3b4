// MSL-on-CPU shim: mpp::tensor_ops::matmul2d as Apple's header documents it:
// C = A * B (mode multiply) or C += A * B (multiply_accumulate) over rank-2 tensors whose
// extent(0) is the contiguous axis: A is M x K (extents K, M), B is K x N (extents N, K)
// or, with transpose_right, N x K (extents K, N); C is M x N (extents N, M).
// run() is cooperative over its execution scope: every thread of the threadgroup must
// enter it (the shim checks the threadgroup is exactly the scope, a barrier before and
// after, one thread computes in float32 in k order).
#pragma once
#include <metal_tensor>
#include <stdexcept>

namespace mpp {
namespace tensor_ops {
struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };
  int m, n, k;
  bool transpose_left, transpose_right, relaxed_precision;
  mode matmul_mode;
  constexpr matmul2d_descriptor(int m_, int n_, int k_ = -1, bool tl = false, bool tr = false,
                                bool relaxed = false, mode md = mode::multiply)
      : m(m_), n(n_), k(k_), transpose_left(tl), transpose_right(tr), relaxed_precision(relaxed),
        matmul_mode(md) {}
};

template <matmul2d_descriptor D, typename Scope> struct matmul2d {
  template <typename A, typename B, typename C> void run(const A& a, const B& b, const C& c) const {
    static_assert(!D.transpose_left, "the shim implements transpose_left = false only");
    if (metal::shim::threads_per_threadgroup() != Scope::threads)
      throw std::runtime_error("matmul2d: the threadgroup is not the op's execution scope");
    metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    if (metal::shim::thread_index() == 0) {
      const int K = a.extents().extent(0);
      if (a.extents().extent(1) < D.m || c.extents().extent(0) < D.n || c.extents().extent(1) < D.m)
        throw std::runtime_error("matmul2d: tensor smaller than the descriptor's tile");
      for (int i = 0; i < D.m; ++i)
        for (int j = 0; j < D.n; ++j) {
          float acc = D.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate
                          ? float(c.data[i * c.extents().extent(0) + j]) : 0.0f;
          for (int kk = 0; kk < K; ++kk) {
            const float bv = D.transpose_right ? float(b.data[j * b.extents().extent(0) + kk])
                                               : float(b.data[kk * b.extents().extent(0) + j]);
            acc += float(a.data[i * K + kk]) * bv;
          }
          c.data[i * c.extents().extent(0) + j] = acc;
        }
    }
    metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  }
};
}  // namespace tensor_ops
}  // namespace mpp
