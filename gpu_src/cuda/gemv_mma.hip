// The FFI handlers of the kernels on the cuda_mma layout. CUDA only; the ROCm
// build does not compile this file.
//   jaxquant_qmv_mma (gemv_mma.h, the decode GEMV): the operands of jaxquant_qmv
//     with data, scales and biases in the cuda_mma layout (same shapes as
//     canonical), plus `dedupe` (gather_qmm: up to that many slots sharing an
//     expert read its weights once; 0: every slot alone).
//   jaxquant_qmm_gemm (qmm_gemm.h, the prefill GEMM): x [Sx, M, K] (16-bit),
//     data, scales, biases, global_scale, group_sizes -> y. group_sizes empty:
//     qmm over S = E matrices, y [S, M, N]; int32 [E]: ragged_qmm, x [1, T, K],
//     y [1, T, N].
//   jaxquant_dequant_mma (qmm_gemm.h): data, scales, biases, global_scale ->
//     w [..., N, K] (16-bit, canonical order), the values the GEMM multiplies.
//   jaxquant_ragged_matmul (ragged_matmul_wgmma.h, compute capability 9.0 only): x [T, K] and
//     float experts w [E, N, K], both float16 or both bfloat16, group_sizes int32 [E]
//     -> y [T, N], rows past the groups zero (ragged_matmul, transpose=True).
//   jaxquant_gemv_mma_fused (gemv_mma.h, FUSE): the decode GEMV with rms_norm_qmm's
//     norm prologue, qmm_swiglu's epilogue, both (rms_norm_qmm_swiglu), or qmm_add's
//     addend (gemv_mma_fused_impl below).
#include <algorithm>
#include <string>

#include "jq/ffi_common.h"
#include "qmm_gemm.h"

namespace ffi = xla::ffi;

// Float scales (and biases) must be float32 or x's own 16-bit dtype (for the
// dequantize: the output's): the kernels are built for those alone (gemv_mma.h,
// launch_p); jaxquant/ffi/mma.py converts other scales to float32 before the call.
static ffi::Error check_scale_dtype(const jq::QmvProblem& q, const char* x) {
  static const char* kNames[] = {"float32", "float16", "bfloat16"};
  if (q.scale_dt == jq::kU8 || q.scale_dt == jq::kF32 ||
      (q.x_dt != jq::kF32 && q.scale_dt == q.x_dt))
    return ffi::Error::Success();
  return jq::invalid(std::string("the cuda_mma kernels read float scales as float32 or as ") +
                     x + "'s dtype (" + kNames[q.x_dt] + "); got " + kNames[q.scale_dt] +
                     " scales (convert them to float32: exact)");
}

// The decode GEMV's Problem for q, both handlers': its tiles and chunks, and with
// indices the dedupe (it scans the slots' ids once per block: worth it for
// decode-sized S only). *nt: the n-tiles, 2 where a segment holds more than 8 rows of x.
static jq::gpu::mma::Problem gemv_launch_problem(const jq::QmvProblem& q, int64_t dedupe,
                                                 int* nt) {
  using namespace jq::gpu::mma;
  Problem P;
  P.q = q;
  P.tiles = (q.N + kTileRows - 1) / kTileRows;
  P.full_tiles = q.N / kTileRows;
  P.chunks = q.K / kChunkK;
  P.dedupe = q.indices != nullptr && dedupe != 0 && q.S <= 256;
  const int64_t rows_per_segment = q.indices != nullptr ? (P.dedupe ? dedupe : 1) : q.M;
  *nt = rows_per_segment > 8 ? 2 : 1;
  return P;
}

// The handler: the operands of jaxquant_qmv (data, scales, biases in the
// cuda_mma layout, which keeps their canonical shapes), `dedupe` for gather.
static ffi::Error qmv_mma_impl(hipStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer data,
                               ffi::AnyBuffer scales, ffi::AnyBuffer biases, ffi::AnyBuffer gs,
                               ffi::AnyBuffer indices, ffi::Result<ffi::AnyBuffer> y, int64_t fmt,
                               int64_t bits, int64_t group_size, int64_t dedupe) {
  jq::QmvProblem q;
  if (auto e = jq::make_qmv(x, data, scales, biases, gs, indices, *y, fmt, bits, group_size, &q);
      e.failure())
    return e;
  using namespace jq::gpu::mma;
  if (q.S == 0 || q.M == 0 || q.N == 0) return ffi::Error::Success();
  if (q.K % kChunkK != 0)
    return jq::invalid("the cuda_mma layout needs K a multiple of 64; got K=" +
                       std::to_string(q.K));
  if (q.M > 16 || (q.indices != nullptr && q.M != 1))
    return jq::invalid("the tensor-core GEMV takes M <= 16 rows per matrix (1 per gather slot); "
                       "got M=" + std::to_string(q.M));
  if (q.S > 65535) return jq::invalid("too many slots for one launch: " + std::to_string(q.S));
  if (auto e = check_scale_dtype(q, "x"); e.failure()) return e;
  int nt = 1;
  const Problem P = gemv_launch_problem(q, dedupe, &nt);
  JQ_LAUNCH_CHECK(q.x_dt == jq::kF32   ? launch_qmv_mma_f32(P, nt, stream)
                  : q.x_dt == jq::kF16 ? launch_qmv_mma_f16(P, nt, stream)
                                       : launch_qmv_mma_bf16(P, nt, stream),
                  "the tensor-core GEMV");
  return ffi::Error::Success();
}

// Both handlers: the 6 operands of jaxquant_qmv, one result, the format's attributes.
static auto bind_layout_kernel() {
  return jq::format_attrs(jq::ffi_rets<1>(
      jq::ffi_args<6>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<hipStream_t>>())));
}

// Command-buffer compatible: the handlers only validate shapes and launch kernels on
// XLA's stream (no sync, no allocation, no host read of device data), so XLA records
// them into the CUDA graph it replays instead of calling them on every execution: an
// XLA FFI call costs ~12-20 us of host time otherwise, against ~6 us for one replayed
// in the graph (H100, benchmarks/h100/decode.json `ffi_host_cost.*`; docs/decode.md).
// jq_gpu_qmv_mma_uncaptured, the same handler without the trait, is what
// $JAXQUANT_CMD_BUFFER=0 registers (for measurements).
#define JQ_CAPTURABLE {ffi::Traits::kCmdBufferCompatible}
XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_gpu_qmv_mma, qmv_mma_impl,
                              bind_layout_kernel().Attr<int64_t>("dedupe"), JQ_CAPTURABLE);
XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_gpu_qmv_mma_uncaptured, qmv_mma_impl,
                              bind_layout_kernel().Attr<int64_t>("dedupe"));
// jaxquant_gemv_mma_fused (gemv_mma.h, FUSE): the GEMV's operands, then `aux`, plus the
// fused op's attributes. Without indices slot s uses matrix s.
//   fuse 1, rms_norm_qmm: aux = the norm weight [K] or [0], y [S, M, N];
//   fuse 2, qmm_swiglu: N = 2I with I % 16 == 0, y [S, M, I]; without indices aux = the
//     bias [N] or [0]; with indices int32 [S] (jq.gather_qmm_swiglu: slot s uses expert
//     indices[s], M = 1, `dedupe` as jaxquant_qmv_mma's) aux = the bias [E, N] or [0];
//   fuse 3, rms_norm_qmm_swiglu: fuse 2's product and epilogue without a bias, on x
//     normalized as fuse 1 normalizes it, M <= 8: aux = the norm weight [K] or [0];
//   fuse 4, qmm_add: the plain GEMV, y [S, M, N] = x W^T + aux, aux [S, M, N] in x's dtype.
// activation: 0 silu, 1 gpt_oss (limit: its clamp, inf for none).
static ffi::Error gemv_mma_fused_impl(hipStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer data,
                                     ffi::AnyBuffer scales, ffi::AnyBuffer biases,
                                     ffi::AnyBuffer gs, ffi::AnyBuffer indices,
                                     ffi::AnyBuffer aux, ffi::Result<ffi::AnyBuffer> y,
                                     int64_t fmt, int64_t bits, int64_t group_size, int64_t fuse,
                                     float eps, float weight_offset, int64_t activation,
                                     float limit, float alpha, int64_t dedupe) {
  if (fuse < 1 || fuse > 4)
    return jq::invalid("attribute fuse must be 1 (rms_norm_qmm), 2 (qmm_swiglu), 3 "
                       "(rms_norm_qmm_swiglu) or 4 (qmm_add); got " + std::to_string(fuse));
  const bool swiglu = fuse == 2 || fuse == 3, norm = fuse == 1 || fuse == 3, add = fuse == 4;
  const bool gather = indices.element_count() != 0;
  if (gather && fuse != 2)
    return jq::invalid("only qmm_swiglu's kernel (fuse 2) takes indices; got fuse " +
                       std::to_string(fuse) + " with " + jq::dims_str(indices.dimensions()));
  auto dd = data.dimensions();
  if (dd.size() != 3) return jq::invalid("data must be [E, N, W] (rank 3); got shape " +
                                         jq::dims_str(dd));
  if (swiglu && dd[1] % 32 != 0)
    return jq::invalid("qmm_swiglu's kernel takes N = 2I rows with I a multiple of 16; got N=" +
                       std::to_string(dd[1]));
  jq::QmvProblem q;
  if (auto e = jq::make_qmv(x, data, scales, biases, gs, indices, *y, fmt, bits, group_size, &q,
                            false, swiglu ? dd[1] / 2 : -1);
      e.failure())
    return e;
  const int32_t aux_dt = jq::dtype_of(aux.element_type());
  auto ad = aux.dimensions();
  if (add) {  // the addend: y's shape and dtype, required
    auto yd = y->dimensions();
    const bool same = ad.size() == yd.size() && std::equal(ad.begin(), ad.end(), yd.begin());
    if (!same || aux_dt != q.x_dt)
      return jq::invalid("qmm_add's addend must have the output's shape " + jq::dims_str(yd) +
                         " and x's dtype " + jq::dtype_name(x.element_type()) + "; got " +
                         jq::dtype_name(aux.element_type()) + " " + jq::dims_str(ad));
  } else {
    // the norm weight [K]; the bias: one row [N], or one per expert [E, N] when the slots
    // pick experts
    const int64_t aux_len = norm ? q.K : q.N;
    const char* aux_name = norm ? "norm weight" : "bias";
    const bool aux_shape_ok = gather ? ad.size() == 2 && ad[0] == q.E && ad[1] == aux_len
                                     : ad.size() == 1 && ad[0] == aux_len;
    if (aux.element_count() != 0 && (!jq::is_float_dt(aux_dt) || !aux_shape_ok))
      return jq::invalid(std::string(aux_name) + " must be float32, float16 or bfloat16 [" +
                         (gather ? std::to_string(q.E) + ", " : std::string()) +
                         std::to_string(aux_len) + "] or empty; got " +
                         jq::dtype_name(aux.element_type()) + " " + jq::dims_str(ad));
  }
  if (!(eps >= 0.0f)) return jq::invalid("attribute eps must be >= 0; got " + std::to_string(eps));
  if (activation != 0 && activation != 1)
    return jq::invalid("attribute activation must be 0 (silu) or 1 (gpt_oss); got " +
                       std::to_string(activation));
  if (!(limit > 0.0f)) return jq::invalid("attribute limit must be > 0; got " + std::to_string(limit));
  using namespace jq::gpu::mma;
  if (q.S == 0 || q.M == 0 || q.N == 0) return ffi::Error::Success();
  if (q.K % kChunkK != 0)
    return jq::invalid("the cuda_mma layout needs K a multiple of 64; got K=" +
                       std::to_string(q.K));
  if (q.M > 16 || (gather && q.M != 1))
    return jq::invalid("the tensor-core GEMV takes M <= 16 rows per matrix (1 per gather slot); "
                       "got M=" + std::to_string(q.M));
  if (q.S > 65535) return jq::invalid("too many slots for one launch: " + std::to_string(q.S));
  // the norm normalizes x where the block stages it: in the SwiGLU's kernel up to what
  // that stages (kMaxXSharedBytes)
  const int64_t x_bytes = q.M * (q.K * jq::dtype_bytes(q.x_dt) + 16);
  const int64_t x_most = swiglu ? kMaxXSharedBytes : kMaxNormXSharedBytes;
  if (fuse == 3 && q.M > 8)
    return jq::invalid("rms_norm_qmm_swiglu's kernel takes M <= 8 rows of x; got M=" +
                       std::to_string(q.M));
  if (norm && x_bytes > x_most)
    return jq::invalid(std::string(fuse == 1 ? "rms_norm_qmm" : "rms_norm_qmm_swiglu") +
                       "'s kernel stages x in shared memory: M x (K x bytes + 16) = " +
                       std::to_string(x_bytes) + " is over " + std::to_string(x_most));
  if (auto e = check_scale_dtype(q, "x"); e.failure()) return e;
  int nt = 1;
  Problem P = gemv_launch_problem(q, dedupe, &nt);
  const void* aux_data = aux.element_count() != 0 ? aux.untyped_data() : nullptr;
  if (add) {
    P.addend = aux_data;
    JQ_LAUNCH_CHECK(q.x_dt == jq::kF32   ? launch_qmv_mma_f32(P, nt, stream)
                    : q.x_dt == jq::kF16 ? launch_qmv_mma_f16(P, nt, stream)
                                         : launch_qmv_mma_bf16(P, nt, stream),
                    "the tensor-core GEMV with an addend");
    return ffi::Error::Success();
  }
  P.normalize = norm;
  if (norm) {
    P.norm_w = aux_data;
    P.norm_dt = aux_dt;
  } else {
    P.bias = aux_data;
    P.bias_dt = aux_dt;
    P.bias_stride = gather ? q.N : 0;
  }
  P.eps = eps;
  P.offset = weight_offset;
  P.activation = (int)activation;
  P.limit = limit;
  P.alpha = alpha;
  const int kind = swiglu ? kFuseSwiglu : kFuseNorm;
  JQ_LAUNCH_CHECK(q.x_dt == jq::kF32   ? launch_gemv_mma_fused_f32(P, nt, kind, stream)
                  : q.x_dt == jq::kF16 ? launch_gemv_mma_fused_f16(P, nt, kind, stream)
                                       : launch_gemv_mma_fused_bf16(P, nt, kind, stream),
                  "the fused tensor-core GEMV");
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_gpu_gemv_mma_fused, gemv_mma_fused_impl,
                              jq::format_attrs(jq::ffi_rets<1>(jq::ffi_args<7>(
                                                   ffi::Ffi::Bind()
                                                       .Ctx<ffi::PlatformStream<hipStream_t>>())))
                                  .Attr<int64_t>("fuse")
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_offset")
                                  .Attr<int64_t>("activation")
                                  .Attr<float>("limit")
                                  .Attr<float>("alpha")
                                  .Attr<int64_t>("dedupe"),
                              JQ_CAPTURABLE);

static ffi::Error qmm_gemm_impl(hipStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer data,
                                ffi::AnyBuffer scales, ffi::AnyBuffer biases, ffi::AnyBuffer gs,
                                ffi::AnyBuffer group_sizes, ffi::Result<ffi::AnyBuffer> y,
                                int64_t fmt, int64_t bits, int64_t group_size) {
  const bool ragged = group_sizes.element_count() != 0;
  jq::QmvProblem q;
  if (auto e = jq::make_qmv(x, data, scales, biases, gs, group_sizes, *y, fmt, bits, group_size,
                            &q, ragged);
      e.failure())
    return e;
  if (q.x_dt == jq::kF32)
    return jq::invalid("the tensor-core GEMM takes float16 or bfloat16 x; got float32");
  if (ragged) {
    auto gd = group_sizes.dimensions();
    if (group_sizes.element_type() != ffi::DataType::S32 || gd.size() != 1 || gd[0] != q.E)
      return jq::invalid("group_sizes must be int32 [E=" + std::to_string(q.E) + "]; got " +
                         jq::dtype_name(group_sizes.element_type()) + " " + jq::dims_str(gd));
    if (q.S != 1 || q.Sx != 1)
      return jq::invalid("ragged_qmm takes x [1, T, K] and y [1, T, N]; got " +
                         std::to_string(q.Sx) + " and " + std::to_string(q.S) + " leading");
  }
  using namespace jq::gpu::mma;
  if (q.S == 0 || q.M == 0 || q.N == 0) return ffi::Error::Success();
  if (q.K % kChunkK != 0)
    return jq::invalid("the cuda_mma layout needs K a multiple of 64; got K=" +
                       std::to_string(q.K));
  if (auto e = check_scale_dtype(q, "x"); e.failure()) return e;
  GemmProblem P = gemm_problem(
      q, ragged ? static_cast<const int32_t*>(group_sizes.untyped_data()) : nullptr);
  plan_gemm(P);
  if (P.row_blocks > 65535)
    return jq::invalid("too many rows for one launch: " + std::to_string(P.row_blocks) +
                       " blocks of " + std::to_string(P.block_m));
  JQ_LAUNCH_CHECK(launch_gemm(P, stream), "the tensor-core GEMM");
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_gpu_qmm_gemm, qmm_gemm_impl, bind_layout_kernel(),
                              JQ_CAPTURABLE);

static ffi::Error dequant_mma_impl(hipStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scales,
                                   ffi::AnyBuffer biases, ffi::AnyBuffer gs,
                                   ffi::Result<ffi::AnyBuffer> out, int64_t fmt, int64_t bits,
                                   int64_t group_size) {
  jq::DequantProblem d;
  if (auto e = jq::make_dequant(data, scales, biases, gs, *out, fmt, bits, group_size, &d);
      e.failure())
    return e;
  if (d.out_dt == jq::kF32)
    return jq::invalid("the cuda_mma dequantize writes float16 or bfloat16; got float32");
  if (d.gs_count > 1)
    return jq::invalid("the cuda_mma dequantize takes one global scale");
  using namespace jq::gpu::mma;
  if (d.rows == 0 || d.k == 0) return ffi::Error::Success();
  if (d.k % kChunkK != 0)
    return jq::invalid("the cuda_mma layout needs K a multiple of 64; got K=" +
                       std::to_string(d.k));
  jq::QmvProblem q{};
  q.fmt = d.fmt;
  q.bits = d.bits;
  q.group = d.group;
  q.E = d.rows / d.n;
  q.N = d.n;
  q.K = d.k;
  q.words = d.words;
  q.groups = d.groups;
  q.x_dt = d.out_dt;
  q.data = d.data;
  q.scales = d.scales;
  q.scale_dt = d.scale_dt;
  q.biases = d.biases;
  q.global_scale = d.global_scale;
  q.y = d.out;
  if (auto e = check_scale_dtype(q, "the output"); e.failure()) return e;
  const GemmProblem P = gemm_problem(q);
  if (q.E > 65535 || (P.tiles * P.chunks + 7) / 8 > 2147483647)
    return jq::invalid("too many matrices for one launch: " + std::to_string(q.E));
  JQ_LAUNCH_CHECK(q.x_dt == jq::kF16 ? launch_dequant_mma_f16(P, stream)
                                     : launch_dequant_mma_bf16(P, stream),
                  "the cuda_mma dequantize");
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_gpu_dequant_mma, dequant_mma_impl,
                              jq::format_attrs(jq::ffi_rets<1>(jq::ffi_args<4>(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<hipStream_t>>()))),
                              JQ_CAPTURABLE);

static ffi::Error ragged_matmul_impl(hipStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                     ffi::AnyBuffer group_sizes, ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), gd = group_sizes.dimensions(),
       yd = y->dimensions();
  const int32_t x_dt = jq::dtype_of(x.element_type());
  if (x_dt != jq::kF16 && x_dt != jq::kBF16)
    return jq::invalid(std::string("ragged_matmul's kernel takes float16 or bfloat16 x; got ") +
                       jq::dtype_name(x.element_type()));
  if (w.element_type() != x.element_type())
    return jq::invalid(std::string("ragged_matmul's kernel takes w in x's dtype (") +
                       jq::dtype_name(x.element_type()) + "); got " +
                       jq::dtype_name(w.element_type()));
  if (xd.size() != 2 || wd.size() != 3 || !jq::dims_ok(xd) || !jq::dims_ok(wd) ||
      wd[2] != xd[1])
    return jq::invalid("ragged_matmul takes x [T, K] and w [E, N, K]; got " + jq::dims_str(xd) +
                       " and " + jq::dims_str(wd));
  const int64_t T = xd[0], K = xd[1], E = wd[0], N = wd[1];
  if (group_sizes.element_type() != ffi::DataType::S32 || gd.size() != 1 || gd[0] != E)
    return jq::invalid("group_sizes must be int32 [E=" + std::to_string(E) + "]; got " +
                       jq::dtype_name(group_sizes.element_type()) + " " + jq::dims_str(gd));
  if (y->element_type() != x.element_type() || yd.size() != 2 || yd[0] != T || yd[1] != N)
    return jq::invalid("ragged_matmul's y must be [T, N] = (" + std::to_string(T) + ", " +
                       std::to_string(N) + ") in x's dtype; got " + jq::dims_str(yd));
  // the tensor maps: rows 16-byte strided, coordinates in int32
  if (K % 8 != 0 || K == 0)
    return jq::invalid("ragged_matmul's kernel takes K a positive multiple of 8; got K=" +
                       std::to_string(K));
  if (T > 2147483647 || E * N > 2147483647)
    return jq::invalid("ragged_matmul's kernel takes T and E x N below 2**31; got T=" +
                       std::to_string(T) + ", E x N=" + std::to_string(E * N));
  if (((reinterpret_cast<uintptr_t>(x.untyped_data()) |
        reinterpret_cast<uintptr_t>(w.untyped_data())) & 15) != 0)
    return jq::invalid("ragged_matmul's kernel takes 16-byte aligned x and w");
  using namespace jq::gpu::mma;
  if (!wgmma_usable())
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "jaxquant ffi: ragged_matmul's kernel runs on compute capability 9.0 only");
  if (T == 0 || N == 0) return ffi::Error::Success();
  if (E == 0) {  // no groups: every row is past them
    JQ_LAUNCH_CHECK(cudaMemsetAsync(y->untyped_data(), 0, T * N * 2, stream),
                    "ragged_matmul's zeros");
    return ffi::Error::Success();
  }
  const GemmProblem P = ragged_matmul_problem(
      x.untyped_data(), x_dt, w.untyped_data(), y->untyped_data(), T, K, E, N,
      static_cast<const int32_t*>(group_sizes.untyped_data()));
  JQ_LAUNCH_CHECK(launch_ragged_matmul_wgmma(P, stream), "ragged_matmul's grouped GEMM");
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_gpu_ragged_matmul, ragged_matmul_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<hipStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              JQ_CAPTURABLE);
