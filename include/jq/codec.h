// jaxquant codec: the bit layouts of the quantized formats for native code.
//
// One header for cpu_src/ (g++), gpu_src/ (nvcc for CUDA, clang/hipcc for
// ROCm). It mirrors jaxquant/formats.py with one element list and one format
// list (JQ_ELEMENT_LIST, JQ_FORMAT_LIST); tests/test_ffi.py checks them against
// formats.ELEMENTS / formats.FORMATS through the CPU library (jq_element_spec,
// jq_format_spec), decodes every element code here and compares it with
// formats.element_values, and checks the GPU decoders against the exact ones
// (tests/native/codec_check.cc).
//
// How kernels use it:
//   dispatch_format(fmt, bits, [&](auto codec) { kernel<decltype(codec)>(...); })
//     the one runtime switch on formats: a Codec<FMT, BITS> per (format, bits) of
//     the table (a mask of format ids narrows what a translation unit builds);
//   Codec<FMT, BITS>: kScale, kElement and the element's parameters, decode(c),
//     unit_element<E>(w); dequant_value<Codec>(...) the reference's dequantize.
//
// Packing: data is uint32 [..., N, K*bits/32], a little-endian bit stream
// along K: element k occupies bits [k*bits, (k+1)*bits). 32 elements ("a
// unit") occupy exactly `bits` words, so every kernel walks K in units.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)
// (GPU sources include gpu_src/common/jq_hip.h, and with it the runtime's headers, first.)
#define JQ_HD __host__ __device__ __forceinline__
#define JQ_DEVICE_COMPILER 1
#else
#define JQ_HD inline __attribute__((always_inline))
#define JQ_DEVICE_COMPILER 0
#endif

namespace jq {

// ---------------------------------------------------------------------------
// The table: ONE list of elements and ONE list of formats.
// Everything else is derived from them: the ids (their order; the ffi package
// reads the names through jq_format_name, so the Python side never keeps its
// own copy), the spec tables, every Codec<FMT, BITS> and dispatch_format below.
// Adding a format: one row in JQ_FORMAT_LIST (and its element in
// JQ_ELEMENT_LIST, or its codebook in JQ_CODEBOOK_LIST, if new); the kernels pick it
// up through dispatch_format.

enum ScaleKind : int32_t { kScaleFloat = 0, kScaleE8M0 = 1, kScaleE4M3 = 2 };
enum Special : int32_t { kSpecialNone = 0, kSpecialFn = 1, kSpecialIeee = 2 };

//   id     name    ebits mbits bias special
#define JQ_ELEMENT_LIST(X)                 \
  X(kE2M1, "e2m1", 2, 1, 1, kSpecialNone)  \
  X(kE2M3, "e2m3", 2, 3, 1, kSpecialNone)  \
  X(kE3M2, "e3m2", 3, 2, 3, kSpecialNone)  \
  X(kE4M3, "e4m3", 4, 3, 7, kSpecialFn)    \
  X(kE5M2, "e5m2", 5, 2, 15, kSpecialIeee)

// Codebooks: non-uniform elements, code -> value (integers in [-128, 127], exact in
// every float type). Their element ids follow the minifloats' (kCbIq4nl == kNumElements).
//   id        name     the values in code order
#define JQ_CODEBOOK_LIST(X) \
  X(kCbIq4nl, "iq4nl", -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

template <class... B>
constexpr uint32_t mask_of(B... b) {  // bit b set for each b
  return ((1u << b) | ... | 0u);
}
constexpr int log2_exact(int64_t g) { return g <= 1 ? 0 : 1 + log2_exact(g / 2); }
template <class... G>
constexpr uint32_t log2_mask_of(G... g) {  // bit log2(g) set for each g
  return ((1u << log2_exact(g)) | ... | 0u);
}

//   id           name          element     bits allowed             group sizes allowed      scale       biases global_scale
#define JQ_FORMAT_LIST(X)                                                                                            \
  X(kAffine,     "affine",     kNoElement, mask_of(2, 3, 4, 5, 6, 8), log2_mask_of(16, 32, 64, 128), kScaleFloat, 1, 0) \
  X(kMxfp4,      "mxfp4",      kE2M1,      mask_of(4),                log2_mask_of(32),          kScaleE8M0,  0, 0) \
  X(kMxfp6E2M3,  "mxfp6_e2m3", kE2M3,      mask_of(6),                log2_mask_of(32),          kScaleE8M0,  0, 0) \
  X(kMxfp6E3M2,  "mxfp6_e3m2", kE3M2,      mask_of(6),                log2_mask_of(32),          kScaleE8M0,  0, 0) \
  X(kMxfp8E4M3,  "mxfp8_e4m3", kE4M3,      mask_of(8),                log2_mask_of(32),          kScaleE8M0,  0, 0) \
  X(kMxfp8E5M2,  "mxfp8_e5m2", kE5M2,      mask_of(8),                log2_mask_of(32),          kScaleE8M0,  0, 0) \
  X(kNvfp4,      "nvfp4",      kE2M1,      mask_of(4),                log2_mask_of(16),          kScaleE4M3,  0, 1) \
  X(kFp4,        "fp4",        kE2M1,      mask_of(4),                log2_mask_of(16, 32, 64),  kScaleFloat, 0, 0) \
  X(kIq4nl,      "iq4nl",      kCbIq4nl,   mask_of(4),                log2_mask_of(32),          kScaleFloat, 0, 0)

#define JQ_LIST_ID(id, ...) id,
enum Element : int32_t { JQ_ELEMENT_LIST(JQ_LIST_ID) kNumElements, kNoElement = -1 };
enum CodebookId : int32_t {
  kCodebookIdsBefore = kNumElements - 1,
  JQ_CODEBOOK_LIST(JQ_LIST_ID) kNumElementsAndCodebooks
};
enum Format : int32_t { JQ_FORMAT_LIST(JQ_LIST_ID) kNumFormats };
#undef JQ_LIST_ID
constexpr int kNumCodebooks = kNumElementsAndCodebooks - kNumElements;

struct ElementSpec {
  const char* name;
  int32_t ebits, mbits, bias, special;
};

struct CodebookSpec {
  const char* name;
  int8_t values[16];
};

struct FormatSpec {
  const char* name;     // jaxquant.formats.FORMATS key
  int32_t element;      // Element or CodebookId, or kNoElement (affine: unsigned ints)
  uint32_t bits_mask;   // bit b set: bits=b allowed
  uint32_t group_mask;  // bit log2(g) set: group_size=g allowed
  int32_t scale;        // ScaleKind
  int32_t has_biases;
  int32_t has_global_scale;
};

#define JQ_LIST_ROW(id, ...) {__VA_ARGS__},
static constexpr ElementSpec kElements[kNumElements] = {JQ_ELEMENT_LIST(JQ_LIST_ROW)};
static constexpr FormatSpec kFormats[kNumFormats] = {JQ_FORMAT_LIST(JQ_LIST_ROW)};
#undef JQ_LIST_ROW
#define JQ_CODEBOOK_ROW(id, name, ...) {name, {__VA_ARGS__}},
static constexpr CodebookSpec kCodebooks[kNumCodebooks] = {JQ_CODEBOOK_LIST(JQ_CODEBOOK_ROW)};
#undef JQ_CODEBOOK_ROW

constexpr bool is_codebook(int32_t element) {
  return element >= kNumElements && element < kNumElementsAndCodebooks;
}

constexpr uint32_t codebook_format_mask() {
  uint32_t m = 0;
  for (int f = 0; f < kNumFormats; ++f)
    if (is_codebook(kFormats[f].element)) m |= 1u << f;
  return m;
}

// Format sets, for dispatch_format in translation units that build only some.
// kFloatFormats: the minifloat elements (the GPU kernels' float decoders take those);
// kCodebookFormats: the codebook ones (decoded by Codec::decode alone).
constexpr uint32_t kAllFormats = (1u << kNumFormats) - 1u;
constexpr uint32_t kAffineFormats = 1u << kAffine;
constexpr uint32_t kCodebookFormats = codebook_format_mask();
constexpr uint32_t kFloatFormats = kAllFormats & ~kAffineFormats & ~kCodebookFormats;

inline bool format_allows(int32_t fmt, int64_t bits, int64_t group) {
  if (fmt < 0 || fmt >= kNumFormats || bits < 1 || bits > 31 || group < 1 || group > (1 << 30))
    return false;
  if (!(kFormats[fmt].bits_mask & (1u << bits))) return false;
  if (group & (group - 1)) return false;
  int lg = 0;
  while ((1ll << lg) < group) ++lg;
  return (kFormats[fmt].group_mask >> lg) & 1u;
}

// ---------------------------------------------------------------------------
// Float bit helpers (portable; no subnormal factor is ever formed).

JQ_HD float bits_to_f32(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

JQ_HD uint32_t f32_to_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}

// 2**e for e in [-126, 127], exact (a normal float).
JQ_HD float exp2i_normal(int32_t e) { return bits_to_f32((uint32_t)(e + 127) << 23); }

// x * 2**n for n in [-127, 127], the way jaxquant.quantize.ldexp does it: one
// multiply while 2**n is normal, else two normal factors (2**-127 is a float32
// subnormal, and XLA/DAZ would read it as zero).
JQ_HD float ldexp_e8m0(float x, int32_t n) {
  if (n >= -126) return x * exp2i_normal(n);
  int32_t half = n >> 1;  // floor(n / 2), like Python's n // 2
  return x * exp2i_normal(half) * exp2i_normal(n - half);
}

JQ_HD float quiet_nan() { return bits_to_f32(0x7fc00000u); }
JQ_HD float infinity() { return bits_to_f32(0x7f800000u); }

// bfloat16 / float16 <-> float32, round to nearest even (what XLA's convert does).
JQ_HD float bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }

JQ_HD uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

JQ_HD float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return bits_to_f32(sign | 0x7f800000u | (m << 13));
  if (e == 0) {  // zero or subnormal: m * 2**-24, exact
    float v = (float)m * exp2i_normal(-24);
    return sign ? -v : v;
  }
  return bits_to_f32(sign | ((e + 112u) << 23) | (m << 13));
}

JQ_HD uint16_t f32_to_f16(float f) {
  uint32_t u = f32_to_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a >= 0x38800000u) {  // normal f16
    uint32_t r = a - (112u << 23);
    r += 0xfffu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
  }
  if (a < 0x33000000u) return sign;  // < 2**-25: rounds to zero
  // subnormal f16: value / 2**-24 rounded to nearest even
  uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126u - e;  // 14..24 ; value = m * 2**(e-150), target units 2**-24
  uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
  return (uint16_t)(sign | q);
}

// ---------------------------------------------------------------------------
// Element decode: exact values, built from the bit definition.

template <int EB, int MB, int BIAS, int SP>
JQ_HD float decode_minifloat(uint32_t c) {
  const uint32_t e = (c >> MB) & ((1u << EB) - 1u);
  const uint32_t m = c & ((1u << MB) - 1u);
  const uint32_t s = (c >> (EB + MB)) & 1u;
  const uint32_t sig = e ? (m | (1u << MB)) : m;
  const int32_t ex = (e ? (int32_t)e : 1) - BIAS - MB;  // >= -16 for every element here
  float mag = (float)sig * exp2i_normal(ex);
  if (SP == kSpecialFn && e == (1u << EB) - 1u && m == (1u << MB) - 1u) mag = quiet_nan();
  if (SP == kSpecialIeee && e == (1u << EB) - 1u) mag = m ? quiet_nan() : infinity();
  return s ? -mag : mag;
}

// The same values with fewer instructions, for GPU code (where float32
// subnormals are not flushed): the magnitude bits go straight into a float's
// exponent and mantissa fields and one multiply by 2**(127 - bias) rebases the
// exponent; codes with exponent 0 pass through a float32 subnormal, exactly.
// The code sits in bits [SHIFT, SHIFT + 1 + EB + MB) of `word` (the other bits
// may hold anything): taking it from its packed word costs no extra shift
// (E2M1 from a 4-bit word: three integer ops and the multiply).
template <int D>
JQ_HD uint32_t shift_left(uint32_t x) {  // x << D, or x >> -D for negative D
  if constexpr (D >= 0) return x << D; else return x >> -D;
}

template <int EB, int MB, int BIAS, int SP, int SHIFT = 0>
JQ_HD float decode_minifloat_gpu(uint32_t word) {
  static_assert(SHIFT >= 0 && SHIFT + 1 + EB + MB <= 32, "the code must lie within the word");
  constexpr uint32_t kMag = ((1u << (EB + MB)) - 1u) << (23 - MB);  // placed magnitude
  const uint32_t mag = shift_left<23 - MB - SHIFT>(word) & kMag;
  const uint32_t sign = shift_left<31 - SHIFT - EB - MB>(word) & 0x80000000u;
  float v = bits_to_f32(mag | sign) * exp2i_normal(127 - BIAS);
  if (SP == kSpecialFn && mag == kMag) v = quiet_nan();
  if (SP == kSpecialIeee && (mag >> 23) == (1u << EB) - 1u)
    v = (mag & 0x7fffffu) ? quiet_nan() : bits_to_f32(0x7f800000u | sign);
  return v;
}

// Element EL's decoders, with its parameters read from the table.
template <int EL>
JQ_HD float decode_element_exact(uint32_t c) {
  constexpr ElementSpec e = kElements[EL];
  return decode_minifloat<e.ebits, e.mbits, e.bias, e.special>(c);
}

template <int EL, int SHIFT = 0>
JQ_HD float decode_element_gpu(uint32_t word) {
  constexpr ElementSpec e = kElements[EL];
  return decode_minifloat_gpu<e.ebits, e.mbits, e.bias, e.special, SHIFT>(word);
}

// Codebook CB's value of code c (low 4 bits): the values, as bytes value + 128, are
// four 32-bit constants; the code's bits 2-3 pick the word, bits 0-1 the byte, and the
// byte minus 128 becomes a float by the mantissa trick (exact). No table in memory, so
// the same code serves host and device, scalar or vectorized.
constexpr uint32_t codebook_word(int cb, int i) {
  uint32_t w = 0;
  for (int j = 0; j < 4; ++j)
    w |= (uint32_t)(uint8_t)(kCodebooks[cb].values[4 * i + j] + 128) << (8 * j);
  return w;
}

template <int EL>
JQ_HD float decode_codebook(uint32_t c) {
  static_assert(is_codebook(EL), "not a codebook");
  constexpr int cb = EL - kNumElements;
  constexpr uint32_t w0 = codebook_word(cb, 0), w1 = codebook_word(cb, 1);
  constexpr uint32_t w2 = codebook_word(cb, 2), w3 = codebook_word(cb, 3);
  const uint32_t w = (c & 8u) ? ((c & 4u) ? w3 : w2) : ((c & 4u) ? w1 : w0);
  const uint32_t byte = (w >> ((c & 3u) << 3)) & 0xffu;
  return bits_to_f32(byte | 0x4b000000u) - 8388736.0f;  // 2**23 + 128
}

// Runtime element id (host code, tests): exact values.
JQ_HD float decode_element(int32_t element, uint32_t c) {
  switch (element) {
#define JQ_ELEMENT_CASE(id, ...) case id: return decode_element_exact<id>(c);
    JQ_ELEMENT_LIST(JQ_ELEMENT_CASE)
#undef JQ_ELEMENT_CASE
#define JQ_CODEBOOK_CASE(id, ...) case id: return decode_codebook<id>(c);
    JQ_CODEBOOK_LIST(JQ_CODEBOOK_CASE)
#undef JQ_CODEBOOK_CASE
    default: return quiet_nan();
  }
}

// An unsigned integer code as a float without an int->float conversion (the
// conversion unit is a quarter of the FMA rate on NVIDIA GPUs): exact below 2**23.
JQ_HD float uint_to_float_magic(uint32_t c) { return bits_to_f32(c | 0x4b000000u) - 8388608.0f; }

// Which decoders Codec uses: the GPU ones in device code. (tests/native/codec_check.cc
// defines it to 1 to check the GPU decoders on the host, bit for bit.)
#ifndef JQ_GPU_DECODE
#if JQ_DEVICE_COMPILER && (defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__))
#define JQ_GPU_DECODE 1
#else
#define JQ_GPU_DECODE 0
#endif
#endif

// Element e (0..31) of a unit of 32 elements held in `BITS` words: the code.
// E is a compile-time constant in every caller, so the word index and
// the straddle are resolved by the compiler.
template <int BITS, int E>
JQ_HD uint32_t unit_code(const uint32_t* w) {
  constexpr int start = E * BITS, word = start / 32, shift = start % 32;
  constexpr uint32_t mask = (1u << BITS) - 1u;
  if constexpr (shift + BITS <= 32) {
    return (w[word] >> shift) & mask;
  } else {
    return ((w[word] >> shift) | (w[word + 1] << (32 - shift))) & mask;
  }
}

// ---------------------------------------------------------------------------
// Compile-time codecs: one per (format, bits), all from the table.
//   decode(c)          the element's value before scaling (affine: the code as a float)
//   unit_element<E>(w) element E of a unit held in BITS words, decoded (GPU kernels:
//                      a code that does not straddle two words is decoded in place)

template <int FMT, int BITS>
struct Codec {
  static_assert(FMT >= 0 && FMT < kNumFormats && ((kFormats[FMT].bits_mask >> BITS) & 1u),
                "no format allows this (format, bits)");
  static constexpr int kFmt = FMT, kBits = BITS, kScale = kFormats[FMT].scale;
  static constexpr int kElement = kFormats[FMT].element;
  static constexpr bool kCodebook = is_codebook(kElement);
  // The element's parameters (minifloat formats; unused for affine and codebooks).
  static constexpr bool kMinifloat = kElement >= 0 && !kCodebook;
  static constexpr int kEb = kMinifloat ? kElements[kElement].ebits : 0;
  static constexpr int kMb = kMinifloat ? kElements[kElement].mbits : 0;
  static constexpr int kBias = kMinifloat ? kElements[kElement].bias : 0;
  static constexpr int kSp = kMinifloat ? kElements[kElement].special : 0;

  JQ_HD static float decode(uint32_t c) {
    if constexpr (FMT == kAffine) {
#if JQ_GPU_DECODE
      return uint_to_float_magic(c);
#else
      return (float)c;
#endif
    } else if constexpr (kCodebook) {
      return decode_codebook<kElement>(c);
    } else {
#if JQ_GPU_DECODE
      return decode_element_gpu<kElement>(c);
#else
      return decode_element_exact<kElement>(c);
#endif
    }
  }

  template <int E>
  JQ_HD static float unit_element(const uint32_t* w) {
    constexpr int start = E * BITS, word = start / 32, shift = start % 32;
    if constexpr (JQ_GPU_DECODE && kMinifloat && shift + BITS <= 32) {
      return decode_element_gpu<kElement, shift>(w[word]);
    } else {
      return decode(unit_code<BITS, E>(w));
    }
  }
};

// ---------------------------------------------------------------------------
// dispatch_format(fmt, bits, f): calls f(Codec<FMT, BITS>{}) for the runtime
// (fmt, bits) and returns true; false for a pair no format allows (callers
// validate first: ffi_common.h check_format). Every (format, bits) of the table
// is instantiated, or those of the formats in FORMATS (a mask of format ids)
// for a translation unit that builds some only. The one switch on formats:
//   dispatch_format(p.fmt, p.bits, [&](auto codec) { run<decltype(codec)>(p); });

template <int FMT, int BITS, class F>
bool dispatch_bits_from(int32_t bits, F& f) {
  constexpr uint32_t allowed = kFormats[FMT].bits_mask;
  if constexpr (BITS >= 32 || (allowed >> BITS) == 0u) {
    return false;
  } else {
    if constexpr ((allowed >> BITS) & 1u) {
      if (bits == BITS) {
        f(Codec<FMT, BITS>{});
        return true;
      }
    }
    return dispatch_bits_from<FMT, BITS + 1>(bits, f);
  }
}

template <uint32_t FORMATS, int FMT, class F>
bool dispatch_format_from(int32_t fmt, int32_t bits, F& f) {
  if constexpr (FMT == kNumFormats) {
    return false;
  } else {
    if constexpr ((FORMATS >> FMT) & 1u) {
      if (fmt == FMT) return dispatch_bits_from<FMT, 1>(bits, f);
    }
    return dispatch_format_from<FORMATS, FMT + 1>(fmt, bits, f);
  }
}

template <uint32_t FORMATS = kAllFormats, class F>
bool dispatch_format(int32_t fmt, int32_t bits, F&& f) {
  return dispatch_format_from<FORMATS, 0>(fmt, bits, f);
}

// Runtime-index variant (host code, tests).
JQ_HD uint32_t stream_code(const uint32_t* row, int64_t k, int bits) {
  const int64_t start = k * bits;
  const int64_t word = start >> 5;
  const int shift = (int)(start & 31);
  const uint32_t mask = (1u << bits) - 1u;
  uint32_t v = row[word] >> shift;
  if (shift + bits > 32) v |= row[word + 1] << (32 - shift);
  return v & mask;
}

// The scale of one group as a float multiplier, for the non-E8M0 kinds.
// (E8M0 is applied with ldexp_e8m0 on the exponent, never as a float.)
JQ_HD float scale_e4m3(uint8_t code) { return decode_element_exact<kE4M3>(code); }

// Float dtypes of the interface (activations, scales, outputs).
enum DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2, kU8 = 3, kOther = 99 };
// Bytes of one element of a DType (scales: float32, 16-bit floats, or uint8 codes).
constexpr JQ_HD int dtype_bytes(int32_t dt) { return dt == kF32 ? 4 : dt == kU8 ? 1 : 2; }

JQ_HD float load_float(const void* p, int64_t i, int32_t dt) {
  switch (dt) {
    case kF32: return static_cast<const float*>(p)[i];
    case kF16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case kBF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return quiet_nan();
  }
}

JQ_HD void store_float(void* p, int64_t i, int32_t dt, float v) {
  switch (dt) {
    case kF32: static_cast<float*>(p)[i] = v; break;
    case kF16: static_cast<uint16_t*>(p)[i] = f32_to_f16(v); break;
    case kBF16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); break;
    default: break;
  }
}

// Dequantize one element exactly like jaxquant.quantize.dequantize_reference
// (float32 arithmetic; affine = fma(q, scale, bias), which is what XLA emits).
// `scale_code` is the raw E8M0/E4M3 byte for those kinds; `scale`/`bias`
// the float values for kScaleFloat.
template <class C>
JQ_HD float dequant_value(uint32_t code, float scale, float bias, uint32_t scale_code,
                          float global_scale) {
  if constexpr (C::kFmt == kAffine) {
#if JQ_DEVICE_COMPILER && (defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__))
    return fmaf((float)code, scale, bias);
#else
    return __builtin_fmaf((float)code, scale, bias);
#endif
  } else if constexpr (C::kScale == kScaleE8M0) {
    if (scale_code == 255u) return quiet_nan();
    return ldexp_e8m0(C::decode(code), (int32_t)scale_code - 127);
  } else if constexpr (C::kScale == kScaleE4M3) {
    return C::decode(code) * scale_e4m3((uint8_t)scale_code) * global_scale;
  } else {
    return C::decode(code) * scale;
  }
}

}  // namespace jq
