// The Metal backend's XLA FFI handlers, without Metal: each checks its call (dtypes, ranks,
// shapes against each other, sizes that fit the kernels' 32-bit indices; a bad call
// returns ffi::Error before any memory is touched), fills the kernel's parameter block,
// picks the kernel and grid (dispatch_plan.h) and hands them to `run`.
//
// Included by exactly one translation unit per library, which defines `run` and
// `use_nax`: metal_ffi.mm (on the GPU through Metal) or, in the tests,
// tests/metal_shim/shim_ffi.cc (the same kernels on the MSL-on-CPU shim), so everything
// here is exercised off macOS.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "dispatch_plan.h"
#include "xla/ffi/api/ffi.h"

namespace jq_metal {

namespace ffi = xla::ffi;

// One operand or result: host memory (XLA's CPU buffer) and whether the kernel writes it.
struct Binding {
  void* host;
  size_t bytes;
  bool output;
};

// Runs `plan` with `bindings` at buffer indices 0.. and the parameter block after them;
// returns when the outputs are written.
ffi::Error run(const Plan& plan, const std::vector<Binding>& bindings, const void* params, size_t params_size);
// Whether qmm's GEMM uses the tensor-op kernel (qmm_nax.metal).
bool use_nax();

inline ffi::Error invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jaxquant metal: " + what);
}

namespace {

Binding in(const ffi::AnyBuffer& b) { return {b.untyped_data(), b.size_bytes(), false}; }
Binding out(ffi::AnyBuffer b) { return {b.untyped_data(), b.size_bytes(), true}; }

// ---- Checks ---------------------------------------------------------------------------

const char* float_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    default: return nullptr;
  }
}

std::string dims_str(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

bool dims_are(ffi::AnyBuffer::Dimensions d, std::initializer_list<int64_t> want) {
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want) {
    if (d[i++] != w) return false;
  }
  return true;
}

constexpr int64_t kMaxIndex = int64_t(1) << 31;  // the kernels index with 32-bit counts

const char* format_name(int64_t fmt) {
  switch (fmt) {
    case 0: return "affine4";
    case 1: return "mxfp4";
    case 2: return "fp4";
    default: return nullptr;
  }
}

bool group_ok(int64_t fmt, int64_t g) {
  switch (fmt) {
    case 0: return g == 32 || g == 64 || g == 128;
    case 1: return g == 32;
    case 2: return g == 16 || g == 32 || g == 64;
    default: return false;
  }
}

// data [lead..., N, K/8] uint32, scales [lead..., N, K/g] (uint8 for mxfp4, else `value`),
// biases like scales for affine4, else [0]. Sets n, k, rows (prod of lead and N).
ffi::Error check_quantized(int64_t fmt, int64_t group, const ffi::AnyBuffer& data, const ffi::AnyBuffer& scales,
                           const ffi::AnyBuffer& biases, ffi::DataType value, int64_t* n, int64_t* k, int64_t* rows) {
  if (format_name(fmt) == nullptr) return invalid("fmt must be 0 (affine4), 1 (mxfp4) or 2 (fp4); got " + std::to_string(fmt));
  if (!group_ok(fmt, group)) return invalid("group_size " + std::to_string(group) + " is not one of " + format_name(fmt) + "'s");
  auto dd = data.dimensions(), sd = scales.dimensions();
  if (data.element_type() != ffi::DataType::U32 || dd.size() < 2)
    return invalid("data must be uint32 [..., N, K/8]; got " + dims_str(dd));
  *n = dd[dd.size() - 2];
  *k = dd[dd.size() - 1] * 8;
  if (*k % 32 || *k == 0) return invalid("K must be a positive multiple of 32; got " + std::to_string(*k));
  const ffi::DataType want_scale = fmt == 1 ? ffi::DataType::U8 : value;
  if (scales.element_type() != want_scale || sd.size() != dd.size())
    return invalid("scales must have data's rank and dtype " + std::string(fmt == 1 ? "uint8" : float_name(value)));
  for (size_t i = 0; i + 1 < dd.size(); ++i) {
    if (sd[i] != dd[i]) return invalid("scales " + dims_str(sd) + " do not match data " + dims_str(dd));
  }
  if (sd[sd.size() - 1] * group != *k) return invalid("scales' last axis must be K / group_size");
  if (fmt == 0) {
    auto bd = biases.dimensions();
    if (biases.element_type() != value || bd.size() != sd.size())
      return invalid("biases must match scales for affine4");
    for (size_t i = 0; i < sd.size(); ++i) {
      if (bd[i] != sd[i]) return invalid("biases " + dims_str(bd) + " do not match scales " + dims_str(sd));
    }
  } else if (biases.element_count() != 0) {
    return invalid("biases must be empty for mxfp4 and fp4");
  }
  *rows = 1;
  for (size_t i = 0; i + 1 < dd.size(); ++i) *rows *= dd[i];
  if (*rows * *k >= kMaxIndex * 8) return invalid("the weight is too large for the kernels' 32-bit indices");
  return ffi::Error::Success();
}

// ---- Handlers -------------------------------------------------------------------------

ffi::Error dequantize_impl(ffi::AnyBuffer data, ffi::AnyBuffer scales, ffi::AnyBuffer biases,
                           ffi::Result<ffi::AnyBuffer> y, int64_t fmt, int64_t group) {
  const char* dt = float_name(y->element_type());
  if (dt == nullptr) return invalid("the output must be float32, float16 or bfloat16");
  int64_t n, k, rows;
  if (ffi::Error e = check_quantized(fmt, group, data, scales, biases, y->element_type(), &n, &k, &rows); e.failure())
    return e;
  if (y->element_count() != rows * k) return invalid("the output must have shape [..., N, K]");
  JqDequantParams p{uint32_t(rows), uint32_t(k), uint32_t(group)};
  return run(jq_metal::plan_dequantize(format_name(fmt), dt, p), {in(data), in(scales), in(biases), out(*y)}, &p,
             sizeof p);
}

// x [Sx, M, K]; data [E, N, K/8]; ids int32 [S] or [0] (then S = E = Sx) -> y [S, M, N].
ffi::Error qmv_impl(ffi::AnyBuffer x, ffi::AnyBuffer data, ffi::AnyBuffer scales, ffi::AnyBuffer biases,
                    ffi::AnyBuffer ids, ffi::Result<ffi::AnyBuffer> y, int64_t fmt, int64_t group) {
  const char* dt = float_name(x.element_type());
  auto xd = x.dimensions();
  if (dt == nullptr || xd.size() != 3) return invalid("x must be float32/float16/bfloat16 [Sx, M, K]");
  if (data.dimensions().size() != 3) return invalid("data must be [E, N, K/8]");
  int64_t n, k, rows;
  if (ffi::Error e = check_quantized(fmt, group, data, scales, biases, x.element_type(), &n, &k, &rows); e.failure())
    return e;
  const int64_t e = data.dimensions()[0], sx = xd[0], m = xd[1];
  if (xd[2] != k) return invalid("x's last axis " + std::to_string(xd[2]) + " must be K = " + std::to_string(k));
  if (m < 1 || m > int64_t(jq_metal::kGemvMaxM)) return invalid("the GEMV takes 1 to 8 rows of x per slot");
  const bool has_ids = ids.element_count() != 0;
  if (has_ids && (ids.element_type() != ffi::DataType::S32 || ids.dimensions().size() != 1))
    return invalid("ids must be int32 [S]");
  const int64_t s = has_ids ? ids.dimensions()[0] : e;
  if (sx < 1 || s % sx) return invalid("the slots (" + std::to_string(s) + ") must be a multiple of x's " + std::to_string(sx));
  if (!has_ids && sx != e) return invalid("without ids, x must have one [M, K] per expert");
  if (y->element_type() != x.element_type() || !dims_are(y->dimensions(), {s, m, n}))
    return invalid("the output must be x's dtype [S, M, N]");
  if (s * m * n >= kMaxIndex || sx * m * k >= kMaxIndex) return invalid("too large for 32-bit indices");
  JqQmmParams p{uint32_t(k), uint32_t(n), uint32_t(m), uint32_t(group), uint32_t(e), uint32_t(s), uint32_t(s / sx),
                uint32_t(has_ids)};
  return run(jq_metal::plan_qmv(format_name(fmt), dt, p),
             {in(data), in(scales), in(biases), in(x), in(ids), out(*y)}, &p, sizeof p);
}

// x [B, M, K]; data [B, N, K/8] -> y [B, M, N] (the GEMM).
ffi::Error qmm_impl(ffi::AnyBuffer x, ffi::AnyBuffer data, ffi::AnyBuffer scales, ffi::AnyBuffer biases,
                    ffi::Result<ffi::AnyBuffer> y, int64_t fmt, int64_t group) {
  const char* dt = float_name(x.element_type());
  auto xd = x.dimensions();
  if (dt == nullptr || xd.size() != 3) return invalid("x must be float32/float16/bfloat16 [B, M, K]");
  if (data.dimensions().size() != 3) return invalid("data must be [B, N, K/8]");
  int64_t n, k, rows;
  if (ffi::Error e = check_quantized(fmt, group, data, scales, biases, x.element_type(), &n, &k, &rows); e.failure())
    return e;
  const int64_t b = data.dimensions()[0], m = xd[1];
  if (xd[0] != b || xd[2] != k) return invalid("x " + dims_str(xd) + " does not match data " + dims_str(data.dimensions()));
  if (y->element_type() != x.element_type() || !dims_are(y->dimensions(), {b, m, n}))
    return invalid("the output must be x's dtype [B, M, N]");
  if (b * m * n >= kMaxIndex || b * m * k >= kMaxIndex || (m + 31) / 32 >= 65536) return invalid("too large for the GEMM's grid");
  JqQmmParams p{uint32_t(k), uint32_t(n), uint32_t(m), uint32_t(group), uint32_t(b), uint32_t(b), 1, 0};
  return run(jq_metal::plan_qmm(format_name(fmt), dt, p, use_nax()),
             {in(data), in(scales), in(biases), in(x), out(*y)}, &p, sizeof p);
}

// x [..., n]: rows and n; weight [n] or [0] in `wdt`.
ffi::Error check_rows(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, ffi::DataType wdt, int64_t* rows, int64_t* n,
                      bool* has_weight) {
  auto d = x.dimensions();
  if (float_name(x.element_type()) == nullptr || d.size() < 1) return invalid("x must be a float array [..., n]");
  *n = d[d.size() - 1];
  *rows = *n == 0 ? 0 : x.element_count() / *n;
  *has_weight = w.element_count() != 0;
  if (*has_weight && (w.element_type() != wdt || !dims_are(w.dimensions(), {*n})))
    return invalid("weight must be [" + std::to_string(*n) + "] in the output's dtype");
  if (x.element_count() >= kMaxIndex) return invalid("too large for 32-bit indices");
  return ffi::Error::Success();
}

ffi::Error rms_norm_impl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y, float eps,
                         float weight_offset) {
  int64_t rows, n;
  bool has_w;
  if (ffi::Error e = check_rows(x, w, x.element_type(), &rows, &n, &has_w); e.failure()) return e;
  if (y->element_type() != x.element_type() || y->element_count() != x.element_count())
    return invalid("the output must be x's dtype and shape");
  if (rows == 0) return ffi::Error::Success();
  JqNormParams p{uint32_t(rows), uint32_t(n), uint32_t(n), uint32_t(has_w), eps, weight_offset, 0, 0};
  return run(jq_metal::plan_rms_norm(float_name(x.element_type()), p), {in(x), in(w), out(*y)}, &p, sizeof p);
}

ffi::Error add_rms_norm_impl(ffi::AnyBuffer x, ffi::AnyBuffer r, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                             ffi::Result<ffi::AnyBuffer> h, float eps, float weight_offset) {
  int64_t rows, n;
  bool has_w;
  if (ffi::Error e = check_rows(x, w, r.element_type(), &rows, &n, &has_w); e.failure()) return e;
  if (float_name(r.element_type()) == nullptr || r.element_count() != x.element_count())
    return invalid("residual must be a float array of x's shape");
  for (ffi::AnyBuffer o : {*y, *h}) {
    if (o.element_type() != r.element_type() || o.element_count() != x.element_count())
      return invalid("the outputs must be residual's dtype and x's shape");
  }
  if (rows == 0) return ffi::Error::Success();
  JqNormParams p{uint32_t(rows), uint32_t(n), uint32_t(n), uint32_t(has_w), eps, weight_offset, 0, 0};
  return run(jq_metal::plan_add_rms_norm(float_name(x.element_type()), float_name(r.element_type()), p),
             {in(x), in(r), in(w), out(*y), out(*h)}, &p, sizeof p);
}

ffi::Error gated_rms_norm_impl(ffi::AnyBuffer x, ffi::AnyBuffer gate, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                               float eps, float weight_offset, int64_t activation, int64_t norm_before_gate,
                               int64_t group_size) {
  int64_t rows, n;
  bool has_w;
  if (ffi::Error e = check_rows(x, w, gate.element_type(), &rows, &n, &has_w); e.failure()) return e;
  if (float_name(gate.element_type()) == nullptr || gate.element_count() != x.element_count())
    return invalid("gate must be a float array of x's shape");
  if (y->element_type() != gate.element_type() || y->element_count() != x.element_count())
    return invalid("the output must be gate's dtype and x's shape");
  if (activation != 0 && activation != 1) return invalid("activation must be 0 (silu) or 1 (sigmoid)");
  const int64_t g = group_size == 0 ? n : group_size;
  if (g <= 0 || (n != 0 && n % g)) return invalid("group_size must divide the last axis");
  if (rows == 0) return ffi::Error::Success();
  JqNormParams p{uint32_t(rows * (n / g)), uint32_t(g), uint32_t(n), uint32_t(has_w), eps, weight_offset,
                 uint32_t(activation), uint32_t(norm_before_gate != 0)};
  return run(jq_metal::plan_gated_rms_norm(float_name(x.element_type()), float_name(gate.element_type()), p),
             {in(x), in(gate), in(w), out(*y)}, &p, sizeof p);
}

}  // namespace
}  // namespace jq_metal

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_metal_dequantize, jq_metal::dequantize_impl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("group_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_metal_qmv, jq_metal::qmv_impl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("group_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_metal_qmm, jq_metal::qmm_impl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("group_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_metal_rms_norm, jq_metal::rms_norm_impl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_metal_add_rms_norm, jq_metal::add_rms_norm_impl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jq_metal_gated_rms_norm, jq_metal::gated_rms_norm_impl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_offset")
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("norm_before_gate")
                                  .Attr<int64_t>("group_size"));

