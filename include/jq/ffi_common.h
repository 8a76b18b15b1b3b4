// The FFI handlers of every platform, written once: validation (every
// dimension, dtype and attribute is checked before a kernel sees a pointer; a
// bad call returns ffi::Error (InvalidArgument) naming the operand, what it
// got and what was expected), the handler bodies and their bindings
// (`Handlers`, at the end), and the library's exported description
// (JQ_FFI_DEFINE_LIBRARY). A platform (cpu_src/cpu_ffi.cc, gpu_src/common/gpu_ffi.hip)
// supplies only how to run a validated problem.
#pragma once

#include <stdint.h>

#include <initializer_list>
#include <string>
#include <utility>

#include "jq/codec.h"
#include "jq/problems.h"
#include "xla/ffi/api/ffi.h"

namespace jq {

namespace ffi = xla::ffi;

inline int32_t dtype_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return kF32;
    case ffi::DataType::F16: return kF16;
    case ffi::DataType::BF16: return kBF16;
    case ffi::DataType::U8: return kU8;
    default: return kOther;
  }
}

inline const char* dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    default: return "an unsupported dtype";
  }
}

inline std::string dims_str(ffi::AnyBuffer::Dimensions d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(d[i]);
  }
  if (d.size() == 1) s += ",";
  return s + ")";
}

inline ffi::Error invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jaxquant ffi: " + what);
}

inline bool is_float_dt(int32_t dt) { return dt == kF32 || dt == kF16 || dt == kBF16; }

inline int64_t prod(ffi::AnyBuffer::Dimensions d, size_t from, size_t to) {
  int64_t p = 1;
  for (size_t i = from; i < to; ++i) p *= d[i];
  return p;
}

inline bool dims_ok(ffi::AnyBuffer::Dimensions d) {
  // Every dim >= 0 and the element count fits comfortably in int64.
  int64_t p = 1;
  for (size_t i = 0; i < d.size(); ++i) {
    if (d[i] < 0) return false;
    if (d[i] > 0 && p > (int64_t{1} << 48) / d[i]) return false;
    p *= d[i] > 0 ? d[i] : 1;
  }
  return true;
}

inline ffi::Error check_format(int64_t fmt, int64_t bits, int64_t group) {
  if (fmt < 0 || fmt >= kNumFormats)
    return invalid("attribute fmt=" + std::to_string(fmt) + " is not a format id (0.." +
                   std::to_string(kNumFormats - 1) + ")");
  if (!format_allows((int32_t)fmt, bits, group))
    return invalid("attributes bits=" + std::to_string(bits) + ", group_size=" +
                   std::to_string(group) + " are not allowed for format id " +
                   std::to_string(fmt));
  return ffi::Error::Success();
}

// Checks the quantized operands: data [..., N, W] uint32, scales [..., N, G],
// biases like scales (affine) or empty, global_scale (nvfp4: empty, one
// scalar, or `max_gs` values) float32. Sets words, groups, k.
inline ffi::Error check_quantized(const ffi::AnyBuffer& data, const ffi::AnyBuffer& scales,
                                  const ffi::AnyBuffer& biases, const ffi::AnyBuffer& gs,
                                  int32_t fmt, int32_t bits, int32_t group, int64_t max_gs,
                                  int64_t* words, int64_t* groups, int64_t* k,
                                  int32_t* scale_dt, int64_t* gs_count) {
  auto dd = data.dimensions(), sd = scales.dimensions();
  if (data.element_type() != ffi::DataType::U32)
    return invalid(std::string("data must be uint32; got ") + dtype_name(data.element_type()));
  if (dd.size() < 1 || !dims_ok(dd))
    return invalid("data must have rank >= 1 and valid dims; got shape " + dims_str(dd));
  if (sd.size() != dd.size() || !dims_ok(sd))
    return invalid("scales must have data's rank; got data " + dims_str(dd) + " and scales " +
                   dims_str(sd));
  for (size_t i = 0; i + 1 < dd.size(); ++i)
    if (dd[i] != sd[i])
      return invalid("scales " + dims_str(sd) + " must match data " + dims_str(dd) +
                     " on all axes but the last");
  const int64_t w = dd[dd.size() - 1];
  if (w % bits != 0)
    return invalid("data's last axis (" + std::to_string(w) + " words) must be a multiple of bits=" +
                   std::to_string(bits) + " (K a multiple of 32)");
  *words = w;
  *k = w / bits * 32;
  if (*k % group != 0)
    return invalid("K=" + std::to_string(*k) + " must be a multiple of group_size=" +
                   std::to_string(group));
  *groups = *k / group;
  if (sd[sd.size() - 1] != *groups)
    return invalid("scales' last axis must be K/group_size = " + std::to_string(*groups) +
                   "; got scales " + dims_str(sd));
  const FormatSpec& f = kFormats[fmt];
  *scale_dt = dtype_of(scales.element_type());
  if (f.scale == kScaleFloat) {
    if (!is_float_dt(*scale_dt))
      return invalid(std::string("scales must be float32, float16 or bfloat16 for this format; got ") +
                     dtype_name(scales.element_type()));
  } else if (*scale_dt != kU8) {
    return invalid(std::string("scales must be uint8 (E8M0/E4M3 codes) for this format; got ") +
                   dtype_name(scales.element_type()));
  }
  if (f.has_biases) {
    if (biases.element_type() != scales.element_type() || biases.dimensions().size() != sd.size())
      return invalid("biases must match scales (" + dims_str(sd) + ", " +
                     dtype_name(scales.element_type()) + "); got " +
                     dims_str(biases.dimensions()) + ", " + dtype_name(biases.element_type()));
    auto bd = biases.dimensions();
    for (size_t i = 0; i < sd.size(); ++i)
      if (bd[i] != sd[i])
        return invalid("biases must match scales " + dims_str(sd) + "; got " + dims_str(bd));
  } else if (biases.element_count() != 0) {
    return invalid("this format has no biases; pass an empty placeholder (got shape " +
                   dims_str(biases.dimensions()) + ")");
  }
  const int64_t gn = (int64_t)gs.element_count();
  if (gn != 0 && gs.element_type() != ffi::DataType::F32)
    return invalid(std::string("global_scale must be float32; got ") + dtype_name(gs.element_type()));
  if (!f.has_global_scale && gn != 0)
    return invalid("this format has no global_scale; pass an empty placeholder");
  if (gn > 1 && (max_gs % gn != 0))
    return invalid("global_scale must be empty, one scalar or one per leading batch of the " +
                   std::to_string(max_gs) + " matrices; got " + std::to_string(gn) + " values");
  *gs_count = gn;
  return ffi::Error::Success();
}

inline ffi::Error make_dequant(const ffi::AnyBuffer& data, const ffi::AnyBuffer& scales,
                               const ffi::AnyBuffer& biases, const ffi::AnyBuffer& gs,
                               const ffi::AnyBuffer& out, int64_t fmt, int64_t bits,
                               int64_t group, DequantProblem* p) {
  if (auto e = check_format(fmt, bits, group); e.failure()) return e;
  p->fmt = (int32_t)fmt;
  p->bits = (int32_t)bits;
  p->group = (int32_t)group;
  auto dd = data.dimensions();
  const int64_t matrices = dd.size() >= 2 ? prod(dd, 0, dd.size() - 2) : 1;
  if (auto e = check_quantized(data, scales, biases, gs, p->fmt, p->bits, p->group, matrices,
                               &p->words, &p->groups, &p->k, &p->scale_dt, &p->gs_count);
      e.failure())
    return e;
  p->rows = prod(dd, 0, dd.size() - 1);
  p->n = dd.size() >= 2 ? dd[dd.size() - 2] : 1;
  p->gs_div = p->gs_count > 1 ? matrices / p->gs_count : matrices;
  auto od = out.dimensions();
  p->out_dt = dtype_of(out.element_type());
  if (!is_float_dt(p->out_dt))
    return invalid(std::string("the output must be float32, float16 or bfloat16; got ") +
                   dtype_name(out.element_type()));
  bool shape_ok = od.size() == dd.size() && od[od.size() - 1] == p->k;
  for (size_t i = 0; shape_ok && i + 1 < dd.size(); ++i) shape_ok = od[i] == dd[i];
  if (!shape_ok)
    return invalid("the output must have shape data.shape[:-1] + (K=" + std::to_string(p->k) +
                   ",); got " + dims_str(od) + " for data " + dims_str(dd));
  p->data = static_cast<const uint32_t*>(data.untyped_data());
  p->scales = scales.untyped_data();
  p->biases = kFormats[fmt].has_biases ? biases.untyped_data() : nullptr;
  p->global_scale = p->gs_count ? static_cast<const float*>(gs.untyped_data()) : nullptr;
  p->out = out.untyped_data();
  return ffi::Error::Success();
}

inline ffi::Error make_qmv(const ffi::AnyBuffer& x, const ffi::AnyBuffer& data,
                           const ffi::AnyBuffer& scales, const ffi::AnyBuffer& biases,
                           const ffi::AnyBuffer& gs, const ffi::AnyBuffer& indices,
                           const ffi::AnyBuffer& y, int64_t fmt, int64_t bits, int64_t group,
                           QmvProblem* p, bool own_slot_map = false, int64_t y_cols = -1) {
  if (auto e = check_format(fmt, bits, group); e.failure()) return e;
  p->fmt = (int32_t)fmt;
  p->bits = (int32_t)bits;
  p->group = (int32_t)group;
  auto dd = data.dimensions();
  if (dd.size() != 3)
    return invalid("data must be [E, N, W] (rank 3); got shape " + dims_str(dd));
  int64_t gs_count = 0;
  if (auto e = check_quantized(data, scales, biases, gs, p->fmt, p->bits, p->group, 1, &p->words,
                               &p->groups, &p->K, &p->scale_dt, &gs_count);
      e.failure())
    return e;
  p->E = dd[0];
  p->N = dd[1];
  auto xd = x.dimensions(), yd = y.dimensions();
  p->x_dt = dtype_of(x.element_type());
  if (!is_float_dt(p->x_dt))
    return invalid(std::string("x must be float32, float16 or bfloat16; got ") +
                   dtype_name(x.element_type()));
  if (xd.size() != 3 || !dims_ok(xd) || xd[2] != p->K)
    return invalid("x must be [Sx, M, K=" + std::to_string(p->K) + "]; got shape " + dims_str(xd));
  if (y.element_type() != x.element_type())
    return invalid(std::string("the output must have x's dtype ") + dtype_name(x.element_type()) +
                   "; got " + dtype_name(y.element_type()));
  // y_cols: the output's last axis when it is not N (a fused epilogue's)
  const int64_t ycols = y_cols >= 0 ? y_cols : p->N;
  if (yd.size() != 3 || !dims_ok(yd) || yd[1] != xd[1] || yd[2] != ycols)
    return invalid("the output must be [S, M=" + std::to_string(xd[1]) +
                   (y_cols >= 0 ? ", " : ", N=") + std::to_string(ycols) + "]; got shape " +
                   dims_str(yd));
  p->S = yd[0];
  p->M = xd[1];
  p->Sx = xd[0];
  if (p->S > 0 && (p->Sx <= 0 || p->S % p->Sx != 0))
    return invalid("x's first axis (" + std::to_string(p->Sx) +
                   ") must divide the number of slots S=" + std::to_string(p->S));
  p->x_div = p->Sx > 0 ? p->S / p->Sx : 1;
  if (!own_slot_map && indices.element_count() != 0) {
    auto id = indices.dimensions();
    if (indices.element_type() != ffi::DataType::S32 || id.size() != 1 || id[0] != p->S)
      return invalid("indices must be int32 [S=" + std::to_string(p->S) + "]; got " +
                     dtype_name(indices.element_type()) + " " + dims_str(id));
    p->indices = static_cast<const int32_t*>(indices.untyped_data());
  } else {
    // own_slot_map: the caller maps slots to experts (ragged_qmm: by group sizes;
    // `indices` is not read)
    if (!own_slot_map && p->S != p->E)
      return invalid("without indices the slots map to the experts: S=" + std::to_string(p->S) +
                     " must equal E=" + std::to_string(p->E));
    p->indices = nullptr;
  }
  p->x = x.untyped_data();
  p->data = static_cast<const uint32_t*>(data.untyped_data());
  p->scales = scales.untyped_data();
  p->biases = kFormats[fmt].has_biases ? biases.untyped_data() : nullptr;
  p->global_scale = gs_count ? static_cast<const float*>(gs.untyped_data()) : nullptr;
  p->y = y.untyped_data();
  return ffi::Error::Success();
}

// x [..., D]; r (residual / gate) like x or empty; w [D], [..., D] (one per row) or empty.
inline ffi::Error make_norm(int32_t kind, const ffi::AnyBuffer& x, const ffi::AnyBuffer* r,
                            const ffi::AnyBuffer& w, const ffi::AnyBuffer& y,
                            const ffi::AnyBuffer* h, float eps, float offset, int64_t activation,
                            int64_t norm_before_gate, int64_t group, NormProblem* p) {
  p->kind = kind;
  auto xd = x.dimensions();
  if (xd.size() < 1 || !dims_ok(xd))
    return invalid("x must have rank >= 1; got shape " + dims_str(xd));
  p->d = xd[xd.size() - 1];
  p->rows = prod(xd, 0, xd.size() - 1);
  p->x_dt = dtype_of(x.element_type());
  if (!is_float_dt(p->x_dt))
    return invalid(std::string("x must be float32, float16 or bfloat16; got ") +
                   dtype_name(x.element_type()));
  if (!(eps >= 0.0f)) return invalid("attribute eps must be >= 0; got " + std::to_string(eps));
  p->eps = eps;
  p->offset = offset;
  p->x = x.untyped_data();
  auto same_shape = [&](const ffi::AnyBuffer& b) {
    auto bd = b.dimensions();
    if (bd.size() != xd.size()) return false;
    for (size_t i = 0; i < xd.size(); ++i)
      if (bd[i] != xd[i]) return false;
    return true;
  };
  const char* rname = kind == kGatedRmsNorm ? "gate" : "residual";
  p->r = nullptr;
  p->r_dt = kOther;
  if (r != nullptr) {
    p->r_dt = dtype_of(r->element_type());
    if (!is_float_dt(p->r_dt))
      return invalid(std::string(rname) + " must be float32, float16 or bfloat16; got " +
                     dtype_name(r->element_type()));
    if (!same_shape(*r))
      return invalid(std::string(rname) + " must have x's shape " + dims_str(xd) + "; got " +
                     dims_str(r->dimensions()));
    p->r = r->untyped_data();
  }
  p->w = nullptr;
  p->w_dt = kOther;
  p->w_div = p->rows > 0 ? p->rows : 1;
  if (w.element_count() != 0) {  // an empty placeholder means "no weight"
    // [D], or [..., D] with leading dims that are a prefix of x's (a batch of
    // weights from vmap: row r uses weight row r / w_div).
    auto wd = w.dimensions();
    p->w_dt = dtype_of(w.element_type());
    if (!is_float_dt(p->w_dt))
      return invalid(std::string("weight must be float32, float16 or bfloat16; got ") +
                     dtype_name(w.element_type()));
    bool ok = wd.size() >= 1 && wd.size() <= xd.size() && wd[wd.size() - 1] == p->d;
    for (size_t i = 0; ok && i + 1 < wd.size(); ++i) ok = wd[i] == xd[i];
    if (!ok)
      return invalid("weight must be [D=" + std::to_string(p->d) + "] (or carry a prefix of x's "
                     "leading dims " + dims_str(xd) + "); got " + dims_str(wd));
    const int64_t wrows = prod(wd, 0, wd.size() - 1);
    p->w_div = p->rows > 0 ? p->rows / wrows : 1;
    p->w = w.untyped_data();
  }
  // Output dtypes: rms: x's; add: residual's (y and h); gated: gate's.
  const int32_t want_dt = kind == kRmsNorm ? p->x_dt : p->r_dt;
  p->y_dt = dtype_of(y.element_type());
  if (p->y_dt != want_dt || !same_shape(y))
    return invalid("the output must have shape " + dims_str(xd) + " and dtype " +
                   (kind == kRmsNorm ? "x's" : kind == kAddRmsNorm ? "residual's" : "gate's") +
                   "; got " + dims_str(y.dimensions()) + " " + dtype_name(y.element_type()));
  p->y = y.untyped_data();
  p->h = nullptr;
  p->h_dt = kOther;
  if (h != nullptr) {
    p->h_dt = dtype_of(h->element_type());
    if (p->h_dt != p->r_dt || !same_shape(*h))
      return invalid("h must have the residual's shape and dtype; got " +
                     dims_str(h->dimensions()) + " " + dtype_name(h->element_type()));
    p->h = h->untyped_data();
  }
  if (activation != kSilu && activation != kSigmoid)
    return invalid("attribute activation=" + std::to_string(activation) +
                   " must be 0 (silu) or 1 (sigmoid)");
  p->activation = (int32_t)activation;
  p->norm_before_gate = norm_before_gate ? 1 : 0;
  if (group == 0) group = p->d;
  if (group < 0 || (p->d > 0 && (group == 0 || p->d % group != 0)))
    return invalid("attribute group_size=" + std::to_string(group) +
                   " must divide the row width D=" + std::to_string(p->d));
  p->group = group;
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// The handlers, one body per target for every platform.
//
// Handlers<Platform, Ctx...>: `Ctx` are the contexts the platform's handlers
// take from XLA before their operands (GPU: ffi::PlatformStream<stream>; CPU:
// ffi::ThreadPool, XLA's intra-op pool), passed on to the platform's runner. Platform has, for each target it
// serves, a static `ffi::Error <target>(const <Problem>& p, <context values>...)`
// that runs a validated, non-empty problem:
//   dequantize(DequantProblem)  qmv(QmvProblem)  norm(NormProblem: the three norms)
//   gemm(QmvProblem: the CPU library's own target)
//
// Adding an FFI target `foo` (one step per layer):
//   1. here: a validator make_foo(...) -> FooProblem (jq/problems.h), a body
//      Handlers::foo and its binding Handlers::bind_foo;
//   2. in each platform that serves it: Platform::foo(const FooProblem&, ctx...),
//      and X(foo) in the target list the platform's library defines
//      (JQ_FFI_TARGETS for every platform, or the platform's own list: a
//      GPU-only target goes in gpu_src/common/gpu_ffi.hip's JQ_GPU_TARGETS);
//   3. Python: a foo_call wrapper in jaxquant/ffi/kernels.py calling
//      jax.ffi.ffi_call("jaxquant_foo", ...). The loader registers every target a
//      library lists (jq_ffi_targets), as "jaxquant_<target>", for its platform.

// The targets every platform's library serves.
// (An X-macro: LIST(X, args...) expands X(target, args...) for each.)
#define JQ_FFI_TARGETS(X, ...)                                                  \
  X(dequantize, __VA_ARGS__) X(qmv, __VA_ARGS__) X(rms_norm, __VA_ARGS__)       \
  X(add_rms_norm, __VA_ARGS__) X(gated_rms_norm, __VA_ARGS__)

// Binding chains: the platform's contexts, then N buffer operands (Arg) / results (Ret).
template <class... Ctx>
struct BindWith;
template <>
struct BindWith<> {
  static auto bind() { return ffi::Ffi::Bind(); }
};
template <class C>
struct BindWith<C> {
  static auto bind() { return ffi::Ffi::Bind().Ctx<C>(); }
};

// (A Binding cannot be copied or moved by others: each helper takes the chain
// so far as a temporary and returns the longer chain as a new one.)
template <int N, class B>
auto ffi_args(B&& b) {
  if constexpr (N == 1) return std::move(b).template Arg<ffi::AnyBuffer>();
  else return ffi_args<N - 1>(std::move(b).template Arg<ffi::AnyBuffer>());
}
template <int N, class B>
auto ffi_rets(B&& b) {
  if constexpr (N == 1) return std::move(b).template Ret<ffi::AnyBuffer>();
  else return ffi_rets<N - 1>(std::move(b).template Ret<ffi::AnyBuffer>());
}
template <class B>
auto format_attrs(B&& b) {  // what make_dequant / make_qmv check with check_format
  return std::move(b).template Attr<int64_t>("fmt").template Attr<int64_t>("bits").template Attr<
      int64_t>("group_size");
}
template <class B>
auto norm_attrs(B&& b) {
  return std::move(b).template Attr<float>("eps").template Attr<float>("weight_offset");
}

template <class Platform, class... Ctx>
struct Handlers {
  // Whether XLA may record these handlers into its command buffers (the CUDA / HIP
  // graph it replays for a jitted function) instead of calling them on every run: the
  // platform says (Platform::kCapturable; JQ_FFI_HANDLER_SYMBOL).
  static constexpr bool kCapturable = Platform::kCapturable;
  using Buf = ffi::AnyBuffer;
  using Out = ffi::Result<ffi::AnyBuffer>;
  static auto bind() { return BindWith<Ctx...>::bind(); }

  // jaxquant_dequantize: data, scales, biases|[0], global_scale|[0] -> [..., N, K]
  static ffi::Error dequantize(typename ffi::CtxDecoding<Ctx>::Type... ctx, Buf data, Buf scales,
                               Buf biases, Buf gs, Out out, int64_t fmt, int64_t bits,
                               int64_t group_size) {
    DequantProblem p;
    if (auto e = make_dequant(data, scales, biases, gs, *out, fmt, bits, group_size, &p);
        e.failure())
      return e;
    if (p.rows == 0 || p.k == 0) return ffi::Error::Success();
    return Platform::dequantize(p, ctx...);
  }
  static auto bind_dequantize() { return format_attrs(ffi_rets<1>(ffi_args<4>(bind()))); }

  // qmv's operands validated into a problem; `run` takes it where it is not empty
  // (the GEMV, or the CPU library's blocked GEMM: one validation for both targets).
  template <class Run>
  static ffi::Error run_qmv(Run run, Buf x, Buf data, Buf scales, Buf biases, Buf gs,
                            Buf indices, Out y, int64_t fmt, int64_t bits, int64_t group_size) {
    QmvProblem p;
    if (auto e = make_qmv(x, data, scales, biases, gs, indices, *y, fmt, bits, group_size, &p);
        e.failure())
      return e;
    if (p.S == 0 || p.M == 0 || p.N == 0) return ffi::Error::Success();
    return run(p);
  }

  // jaxquant_qmv: x [Sx,M,K], data, scales, biases, global_scale, indices|[0] -> [S,M,N]
  static ffi::Error qmv(typename ffi::CtxDecoding<Ctx>::Type... ctx, Buf x, Buf data, Buf scales,
                        Buf biases, Buf gs, Buf indices, Out y, int64_t fmt, int64_t bits,
                        int64_t group_size) {
    return run_qmv([&](const QmvProblem& p) { return Platform::qmv(p, ctx...); }, x, data,
                   scales, biases, gs, indices, y, fmt, bits, group_size);
  }
  static auto bind_qmv() { return format_attrs(ffi_rets<1>(ffi_args<6>(bind()))); }

  // jaxquant_gemm (CPU library only): qmv's operands and result, run as the blocked
  // dequantize-GEMM (many rows of x per weight matrix).
  static ffi::Error gemm(typename ffi::CtxDecoding<Ctx>::Type... ctx, Buf x, Buf data, Buf scales,
                         Buf biases, Buf gs, Buf indices, Out y, int64_t fmt, int64_t bits,
                         int64_t group_size) {
    return run_qmv([&](const QmvProblem& p) { return Platform::gemm(p, ctx...); }, x, data,
                   scales, biases, gs, indices, y, fmt, bits, group_size);
  }
  static auto bind_gemm() { return bind_qmv(); }

  // jaxquant_rms_norm: x, weight|[0] -> y
  static ffi::Error rms_norm(typename ffi::CtxDecoding<Ctx>::Type... ctx, Buf x, Buf w, Out y,
                             float eps, float weight_offset) {
    NormProblem p;
    if (auto e = make_norm(kRmsNorm, x, nullptr, w, *y, nullptr, eps, weight_offset, 0, 1, 0, &p);
        e.failure())
      return e;
    return run_norm(p, ctx...);
  }
  static auto bind_rms_norm() { return norm_attrs(ffi_rets<1>(ffi_args<2>(bind()))); }

  // jaxquant_add_rms_norm: x, residual, weight|[0] -> y, h
  static ffi::Error add_rms_norm(typename ffi::CtxDecoding<Ctx>::Type... ctx, Buf x, Buf r, Buf w,
                                 Out y, Out h, float eps, float weight_offset) {
    NormProblem p;
    Buf hb = *h;
    if (auto e = make_norm(kAddRmsNorm, x, &r, w, *y, &hb, eps, weight_offset, 0, 1, 0, &p);
        e.failure())
      return e;
    return run_norm(p, ctx...);
  }
  static auto bind_add_rms_norm() { return norm_attrs(ffi_rets<2>(ffi_args<3>(bind()))); }

  // jaxquant_gated_rms_norm: x, gate, weight|[0] -> y
  static ffi::Error gated_rms_norm(typename ffi::CtxDecoding<Ctx>::Type... ctx, Buf x, Buf gate,
                                   Buf w, Out y, float eps, float weight_offset,
                                   int64_t activation, int64_t norm_before_gate,
                                   int64_t group_size) {
    NormProblem p;
    if (auto e = make_norm(kGatedRmsNorm, x, &gate, w, *y, nullptr, eps, weight_offset,
                           activation, norm_before_gate, group_size, &p);
        e.failure())
      return e;
    return run_norm(p, ctx...);
  }
  static auto bind_gated_rms_norm() {
    return norm_attrs(ffi_rets<1>(ffi_args<3>(bind())))
        .template Attr<int64_t>("activation")
        .template Attr<int64_t>("norm_before_gate")
        .template Attr<int64_t>("group_size");
  }

 private:
  static ffi::Error run_norm(const NormProblem& p, typename ffi::CtxDecoding<Ctx>::Type... ctx) {
    if (p.rows == 0 || p.d == 0) return ffi::Error::Success();
    return Platform::norm(p, ctx...);
  }
};

}  // namespace jq

// The exported symbols of one library (use once, at global scope):
//   <PREFIX><target>      the XLA FFI handler of each target in TARGET_LIST
//   jq_abi_version()      JQ_ABI_VERSION (jaxquant/ffi/loader.py: ABI_VERSION)
//   jq_ffi_targets()      the targets, comma-separated: what the loader registers
//   jq_format_name(i)     format id i's name (jaxquant.formats), NULL past the last:
//                         the ffi package's FORMAT_IDS
// HANDLERS is a Handlers<...> type name without commas (a `using` alias).
#define JQ_ABI_VERSION 3
#define JQ_FFI_HANDLER_SYMBOL(target, PREFIX, HANDLERS)                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                           \
      PREFIX##target, HANDLERS::target, HANDLERS::bind_##target(),                         \
      HANDLERS::kCapturable                                                                \
          ? std::initializer_list<::xla::ffi::Traits>{::xla::ffi::Traits::kCmdBufferCompatible} \
          : std::initializer_list<::xla::ffi::Traits>{});
#define JQ_FFI_TARGET_NAME(target, ...) #target ","
#define JQ_FFI_DEFINE_LIBRARY(PREFIX, HANDLERS, TARGET_LIST)                                \
  TARGET_LIST(JQ_FFI_HANDLER_SYMBOL, PREFIX, HANDLERS)                                      \
  extern "C" __attribute__((visibility("default"))) int jq_abi_version() {                  \
    return JQ_ABI_VERSION;                                                                  \
  }                                                                                         \
  extern "C" __attribute__((visibility("default"))) const char* jq_ffi_targets() {          \
    return TARGET_LIST(JQ_FFI_TARGET_NAME, );                                               \
  }                                                                                         \
  extern "C" __attribute__((visibility("default"))) const char* jq_format_name(int fmt) {   \
    return fmt >= 0 && fmt < ::jq::kNumFormats ? ::jq::kFormats[fmt].name : nullptr;        \
  }
