// jaxquant codec: the bit layouts of DESIGN.md §3 for native code.
//
// One header for cpu_src/ (g++), hip_src/ (nvcc for CUDA, clang/hipcc for
// ROCm). It mirrors jaxquant/formats.py: the format ids, the element table
// (ebits, mbits, bias, specials) and the scale kinds below are checked
// against formats.FORMATS / formats.ELEMENTS by tests/test_ffi.py through
// jq_codec_describe() in the CPU library, and every element code is decoded
// here and compared with formats.element_values.
//
// Packing: data is uint32 [..., N, K*bits/32], a little-endian bit stream
// along K: element k occupies bits [k*bits, (k+1)*bits). 32 elements ("a
// unit") occupy exactly `bits` words, so every kernel walks K in units.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)
// (GPU sources include hip_src/jq_hip.h, and with it the runtime's headers, first.)
#define JQ_HD __host__ __device__ __forceinline__
#define JQ_DEVICE_COMPILER 1
#else
#define JQ_HD inline __attribute__((always_inline))
#define JQ_DEVICE_COMPILER 0
#endif

namespace jq {

// ---------------------------------------------------------------------------
// The table (DESIGN.md §3). Ids are part of the Python <-> native interface
// (jaxquant/ffi/__init__.py: FORMAT_IDS).

enum Format : int32_t {
  kAffine = 0,
  kMxfp4 = 1,
  kMxfp6E2M3 = 2,
  kMxfp6E3M2 = 3,
  kMxfp8E4M3 = 4,
  kMxfp8E5M2 = 5,
  kNvfp4 = 6,
  kFp4 = 7,
  kNumFormats = 8,
};

enum ScaleKind : int32_t { kScaleFloat = 0, kScaleE8M0 = 1, kScaleE4M3 = 2 };
enum Special : int32_t { kSpecialNone = 0, kSpecialFn = 1, kSpecialIeee = 2 };
enum Element : int32_t { kE2M1 = 0, kE2M3 = 1, kE3M2 = 2, kE4M3 = 3, kE5M2 = 4, kNoElement = -1 };

struct ElementSpec {
  int32_t ebits, mbits, bias, special;
};

// Same order as `Element`.
static constexpr ElementSpec kElements[5] = {
    {2, 1, 1, kSpecialNone},   // e2m1
    {2, 3, 1, kSpecialNone},   // e2m3
    {3, 2, 3, kSpecialNone},   // e3m2
    {4, 3, 7, kSpecialFn},     // e4m3
    {5, 2, 15, kSpecialIeee},  // e5m2
};

struct FormatSpec {
  int32_t element;      // Element, or kNoElement (affine: unsigned ints)
  uint32_t bits_mask;   // bit b set: bits=b allowed
  uint32_t group_mask;  // bit log2(g) set: group_size=g allowed
  int32_t scale;        // ScaleKind
  int32_t has_biases;
  int32_t has_global_scale;
};

#define JQ_BIT(b) (1u << (b))
static constexpr FormatSpec kFormats[kNumFormats] = {
    {kNoElement, JQ_BIT(2) | JQ_BIT(3) | JQ_BIT(4) | JQ_BIT(5) | JQ_BIT(6) | JQ_BIT(8),
     JQ_BIT(5) | JQ_BIT(6) | JQ_BIT(7), kScaleFloat, 1, 0},                // affine
    {kE2M1, JQ_BIT(4), JQ_BIT(5), kScaleE8M0, 0, 0},                       // mxfp4
    {kE2M3, JQ_BIT(6), JQ_BIT(5), kScaleE8M0, 0, 0},                       // mxfp6_e2m3
    {kE3M2, JQ_BIT(6), JQ_BIT(5), kScaleE8M0, 0, 0},                       // mxfp6_e3m2
    {kE4M3, JQ_BIT(8), JQ_BIT(5), kScaleE8M0, 0, 0},                       // mxfp8_e4m3
    {kE5M2, JQ_BIT(8), JQ_BIT(5), kScaleE8M0, 0, 0},                       // mxfp8_e5m2
    {kE2M1, JQ_BIT(4), JQ_BIT(4), kScaleE4M3, 0, 1},                       // nvfp4
    {kE2M1, JQ_BIT(4), JQ_BIT(4) | JQ_BIT(5) | JQ_BIT(6), kScaleFloat, 0, 0},  // fp4
};
#undef JQ_BIT

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

JQ_HD float decode_element(int32_t element, uint32_t c) {
  switch (element) {
    case kE2M1: return decode_minifloat<2, 1, 1, kSpecialNone>(c);
    case kE2M3: return decode_minifloat<2, 3, 1, kSpecialNone>(c);
    case kE3M2: return decode_minifloat<3, 2, 3, kSpecialNone>(c);
    case kE4M3: return decode_minifloat<4, 3, 7, kSpecialFn>(c);
    case kE5M2: return decode_minifloat<5, 2, 15, kSpecialIeee>(c);
    default: return quiet_nan();
  }
}

JQ_HD float decode_e4m3(uint32_t c) { return decode_minifloat<4, 3, 7, kSpecialFn>(c); }

// The same values with fewer instructions, for GPU code (where float32
// subnormals are not flushed): the magnitude bits go straight into a float's
// exponent and mantissa fields and one multiply by 2**(127 - bias) rebases the
// exponent; codes with exponent 0 pass through a float32 subnormal, exactly.
template <int EB, int MB, int BIAS, int SP>
JQ_HD float decode_minifloat_gpu(uint32_t c) {
  constexpr uint32_t kMag = (1u << (EB + MB)) - 1u;
  const uint32_t bits = ((c & kMag) << (23 - MB)) | ((c >> (EB + MB)) << 31);
  float v = bits_to_f32(bits) * exp2i_normal(127 - BIAS);
  if (SP == kSpecialFn && (c & kMag) == kMag) v = quiet_nan();
  if (SP == kSpecialIeee && ((c >> MB) & ((1u << EB) - 1u)) == (1u << EB) - 1u)
    v = (c & ((1u << MB) - 1u)) ? quiet_nan() : bits_to_f32(0x7f800000u | ((c >> (EB + MB)) << 31));
  return v;
}

// An unsigned integer code as a float without an int->float conversion (the
// conversion unit is a quarter of the FMA rate on NVIDIA GPUs): exact below 2**23.
JQ_HD float uint_to_float_magic(uint32_t c) { return bits_to_f32(c | 0x4b000000u) - 8388608.0f; }

#if JQ_DEVICE_COMPILER && (defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__))
#define JQ_DECODE_MINIFLOAT decode_minifloat_gpu
#define JQ_DECODE_UINT uint_to_float_magic
#else
#define JQ_DECODE_MINIFLOAT decode_minifloat
#define JQ_DECODE_UINT(c) ((float)(c))
#endif

// ---------------------------------------------------------------------------
// Compile-time codecs: one per (format, bits). `decode` gives the element's
// value before scaling (affine: the unsigned code as a float).

template <int FMT, int BITS>
struct Codec;

template <int BITS>
struct Codec<kAffine, BITS> {
  static constexpr int kFmt = kAffine, kBits = BITS, kScale = kScaleFloat;
  JQ_HD static float decode(uint32_t c) { return JQ_DECODE_UINT(c); }
};

#define JQ_MINIFLOAT_CODEC(FMT, BITS, EB, MB, BIAS, SP, SCALE)                            \
  template <>                                                                             \
  struct Codec<FMT, BITS> {                                                               \
    static constexpr int kFmt = FMT, kBits = BITS, kScale = SCALE;                        \
    static constexpr int kEb = EB, kMb = MB, kBias = BIAS, kSp = SP;                      \
    JQ_HD static float decode(uint32_t c) { return JQ_DECODE_MINIFLOAT<EB, MB, BIAS, SP>(c); } \
  };
JQ_MINIFLOAT_CODEC(kMxfp4, 4, 2, 1, 1, kSpecialNone, kScaleE8M0)
JQ_MINIFLOAT_CODEC(kMxfp6E2M3, 6, 2, 3, 1, kSpecialNone, kScaleE8M0)
JQ_MINIFLOAT_CODEC(kMxfp6E3M2, 6, 3, 2, 3, kSpecialNone, kScaleE8M0)
JQ_MINIFLOAT_CODEC(kMxfp8E4M3, 8, 4, 3, 7, kSpecialFn, kScaleE8M0)
JQ_MINIFLOAT_CODEC(kMxfp8E5M2, 8, 5, 2, 15, kSpecialIeee, kScaleE8M0)
JQ_MINIFLOAT_CODEC(kNvfp4, 4, 2, 1, 1, kSpecialNone, kScaleE4M3)
JQ_MINIFLOAT_CODEC(kFp4, 4, 2, 1, 1, kSpecialNone, kScaleFloat)
#undef JQ_MINIFLOAT_CODEC

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
JQ_HD float scale_e4m3(uint8_t code) { return decode_e4m3(code); }

// Float dtypes of the interface (activations, scales, outputs).
enum DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2, kU8 = 3, kOther = 99 };

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
