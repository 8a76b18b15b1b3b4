// Runs the CPU kernels of one ISA (cpu_src/kernels.h's table) on the problems of a
// case file and writes their outputs, for tests/test_cpu_kernels_isa.py: the same
// cases through every ISA this build holds (x86-64 natively; arm64 built with a cross
// compiler and run under qemu-user) must give the same bits.
//
//   cpu_kernels_driver ISA CASES OUT    ISA: avx512, avx2, neon or baseline
//
// Exit status: 0 done; 2 bad arguments or file; 3 the ISA is not compiled into this
// build. The caller checks that the CPU has the ISA (the driver does not ask).
//
// Case file (little-endian, written by the test): "JQKCASE1", int64 count, then per
// case int64 kind (0 dequantize, 1 qmv, 2 norm, 3 gemm), int64 params[24], int64 narrays and
// per array int64 nbytes and its bytes (0 bytes: a null pointer). The output file holds
// each case's outputs in order: dequantize `out`, qmv and gemm `y`, norm `y` then
// (add_rms_norm) `h`. Each call runs in the float environment the library's handlers
// set (FlushDenormals, kernels.h); qmv is called per block of `block` rows as the
// handler does (an output row does not depend on the split), gemm per x packed in
// chunks of K and per block of the table's gemm_rows, as cpu_ffi.cc does.
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels.h"

using namespace jq;
using jq::cpu::dequant_flushes_denormals;
using jq::cpu::FlushDenormals;
using jq::cpu::Kernels;

namespace {

constexpr int kParams = 24;

struct Reader {
  FILE* f;
  bool ok = true;
  int64_t i64() {
    int64_t v = 0;
    ok = ok && fread(&v, 8, 1, f) == 1;
    return v;
  }
};

// An array of the case, 8-byte aligned (null where empty).
struct Array {
  std::vector<uint64_t> words;
  int64_t nbytes = 0;
  const void* ptr() const { return nbytes ? words.data() : nullptr; }
};

int64_t dt_size(int64_t dt) { return dt == kF32 ? 4 : (dt == kU8 ? 1 : 2); }

float f32_of(int64_t bits) {
  const uint32_t u = (uint32_t)bits;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

std::vector<char> run_dequant(const Kernels& k, const int64_t* q, const std::vector<Array>& a) {
  DequantProblem p{};
  p.fmt = (int32_t)q[0], p.bits = (int32_t)q[1], p.group = (int32_t)q[2];
  p.rows = q[3], p.n = q[4], p.k = q[5], p.words = q[6], p.groups = q[7];
  p.scale_dt = (int32_t)q[8], p.gs_count = q[9], p.gs_div = q[10], p.out_dt = (int32_t)q[11];
  p.data = static_cast<const uint32_t*>(a[0].ptr());
  p.scales = a[1].ptr();
  p.biases = a[2].ptr();
  p.global_scale = static_cast<const float*>(a[3].ptr());
  std::vector<char> out((size_t)(p.rows * p.k * dt_size(p.out_dt)));
  p.out = out.data();
  FlushDenormals fd(dequant_flushes_denormals(p));
  k.dequant(p, 0, p.rows);
  return out;
}

QmvProblem qmv_problem(const int64_t* q, const std::vector<Array>& a) {
  QmvProblem p{};
  p.fmt = (int32_t)q[0], p.bits = (int32_t)q[1], p.group = (int32_t)q[2];
  p.S = q[3], p.M = q[4], p.N = q[5], p.K = q[6], p.E = q[7], p.Sx = q[8], p.x_div = q[9];
  p.words = q[10], p.groups = q[11], p.x_dt = (int32_t)q[12], p.scale_dt = (int32_t)q[13];
  p.x = a[0].ptr();
  p.data = static_cast<const uint32_t*>(a[1].ptr());
  p.scales = a[2].ptr();
  p.biases = a[3].ptr();
  p.global_scale = static_cast<const float*>(a[4].ptr());
  p.indices = static_cast<const int32_t*>(a[5].ptr());
  return p;
}

std::vector<char> run_qmv(const Kernels& k, const int64_t* q, const std::vector<Array>& a) {
  QmvProblem p = qmv_problem(q, a);
  const int64_t block = q[14];
  std::vector<char> y((size_t)(p.S * p.M * p.N * dt_size(p.x_dt)));
  p.y = y.data();
  std::vector<float> scratch((size_t)k.qmv_scratch(p));
  FlushDenormals fd(true);
  for (int64_t s = 0; s < p.S; ++s)
    for (int64_t n0 = 0; n0 < p.N; n0 += block)
      k.qmv(p, s, n0, n0 + block < p.N ? n0 + block : p.N, scratch.data());
  return y;
}

std::vector<char> run_gemm(const Kernels& k, const int64_t* q, const std::vector<Array>& a) {
  QmvProblem p = qmv_problem(q, a);
  std::vector<char> y((size_t)(p.S * p.M * p.N * dt_size(p.x_dt)));
  p.y = y.data();
  const int64_t slot = k.gemm_x_floats(p), kchunk = 96;  // chunks off the panel's width
  std::vector<float> xt((size_t)(p.Sx * slot));
  std::vector<float> scratch((size_t)k.gemm_scratch(p));
  FlushDenormals fd(true);
  for (int64_t sx = 0; sx < p.Sx; ++sx)
    for (int64_t k0 = 0; k0 < p.K; k0 += kchunk)
      k.gemm_pack_x(p, sx, k0, k0 + kchunk < p.K ? k0 + kchunk : p.K, xt.data() + sx * slot);
  for (int64_t s = 0; s < p.S; ++s)
    for (int64_t n0 = 0; n0 < p.N; n0 += k.gemm_rows)
      k.gemm(p, s, n0, n0 + k.gemm_rows < p.N ? n0 + k.gemm_rows : p.N,
             xt.data() + (s / p.x_div) * slot, scratch.data());
  return y;
}

std::vector<char> run_norm(const Kernels& k, const int64_t* q, const std::vector<Array>& a) {
  NormProblem p{};
  p.kind = (int32_t)q[0], p.rows = q[1], p.d = q[2];
  p.x_dt = (int32_t)q[3], p.r_dt = (int32_t)q[4], p.w_dt = (int32_t)q[5], p.w_div = q[6];
  p.y_dt = (int32_t)q[7], p.h_dt = (int32_t)q[8];
  p.eps = f32_of(q[9]), p.offset = f32_of(q[10]);
  p.activation = (int32_t)q[11], p.norm_before_gate = (int32_t)q[12], p.group = q[13];
  p.x = a[0].ptr();
  p.r = a[1].ptr();
  p.w = a[2].ptr();
  const size_t ny = (size_t)(p.rows * p.d * dt_size(p.y_dt));
  const size_t nh = p.kind == kAddRmsNorm ? (size_t)(p.rows * p.d * dt_size(p.h_dt)) : 0;
  std::vector<char> out(ny + nh);
  p.y = out.data();
  p.h = nh ? out.data() + ny : nullptr;
  std::vector<float> scratch((size_t)(3 * p.d));
  FlushDenormals fd(true);
  k.norm(p, 0, p.rows, scratch.data());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s avx512|avx2|neon|baseline CASES OUT\n", argv[0]);
    return 2;
  }
  const std::string isa = argv[1];
  const Kernels* k = isa == "avx512" ? cpu::kernels_avx512()
                          : isa == "avx2" ? cpu::kernels_avx2()
                          : isa == "neon" ? cpu::kernels_neon()
                          : isa == "baseline" ? cpu::kernels_base()
                                              : nullptr;
  if (!k) {
    fprintf(stderr, "%s: not compiled into this build\n", argv[1]);
    return 3;
  }
  FILE* in = fopen(argv[2], "rb");
  FILE* out = fopen(argv[3], "wb");
  if (!in || !out) {
    fprintf(stderr, "cannot open %s or %s\n", argv[2], argv[3]);
    return 2;
  }
  char magic[8];
  Reader r{in};
  if (fread(magic, 8, 1, in) != 1 || memcmp(magic, "JQKCASE1", 8) != 0) {
    fprintf(stderr, "%s: not a case file\n", argv[2]);
    return 2;
  }
  const int64_t count = r.i64();
  for (int64_t c = 0; r.ok && c < count; ++c) {
    const int64_t kind = r.i64();
    int64_t q[kParams];
    for (int64_t& v : q) v = r.i64();
    const int64_t narrays = r.i64();
    if (!r.ok || narrays < 0 || narrays > 8) break;
    std::vector<Array> arrays((size_t)narrays < 6 ? 6 : (size_t)narrays);
    for (int64_t i = 0; r.ok && i < narrays; ++i) {
      Array& arr = arrays[(size_t)i];
      arr.nbytes = r.i64();
      if (arr.nbytes < 0 || arr.nbytes > (int64_t{1} << 32)) r.ok = false;
      if (!r.ok) break;
      arr.words.assign((size_t)(arr.nbytes + 7) / 8, 0);
      r.ok = arr.nbytes == 0 || fread(arr.words.data(), (size_t)arr.nbytes, 1, in) == 1;
    }
    if (!r.ok) break;
    std::vector<char> y = kind == 0   ? run_dequant(*k, q, arrays)
                          : kind == 1 ? run_qmv(*k, q, arrays)
                          : kind == 2 ? run_norm(*k, q, arrays)
                          : kind == 3 ? run_gemm(*k, q, arrays)
                                      : std::vector<char>();
    if (kind < 0 || kind > 3) {
      fprintf(stderr, "case %lld: unknown kind %lld\n", (long long)c, (long long)kind);
      return 2;
    }
    if (!y.empty() && fwrite(y.data(), y.size(), 1, out) != 1) {
      fprintf(stderr, "cannot write %s\n", argv[3]);
      return 2;
    }
  }
  if (!r.ok) {
    fprintf(stderr, "%s: truncated or malformed\n", argv[2]);
    return 2;
  }
  fclose(in);
  if (fclose(out) != 0) return 2;
  printf("%s: %lld cases\n", k->isa, (long long)count);
  return 0;
}
