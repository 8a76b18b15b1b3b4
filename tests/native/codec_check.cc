// The GPU decoders of include/jq/codec.h, checked on the host bit for bit
// against the exact ones (tests/test_ffi.py compiles this with -DJQ_GPU_DECODE=1,
// so Codec takes its device-code paths; host float32 keeps subnormals like GPUs).
// For every (format, bits) of the table: decode(c) for every code, and
// unit_element<E> (codes decoded in place in their packed words) for every
// element position of random units.
#include <stdio.h>
#include <string.h>

#include <random>
#include <utility>

#include "jq/codec.h"

#if !JQ_GPU_DECODE
#error "compile with -DJQ_GPU_DECODE=1"
#endif

using namespace jq;

static bool same(float a, float b) { return (a != a && b != b) || memcmp(&a, &b, 4) == 0; }

template <class C>
static float exact(uint32_t c) {
  if constexpr (C::kFmt == kAffine) {
    return (float)c;
  } else if constexpr (C::kCodebook) {  // the table itself
    return (float)kCodebooks[C::kElement - kNumElements].values[c & 15u];
  } else {
    return decode_element_exact<C::kElement>(c);
  }
}

template <class C, int... E>
static int check_unit(const uint32_t* w, std::integer_sequence<int, E...>) {
  int bad = 0;
  ((bad += !same(C::template unit_element<E>(w), exact<C>(stream_code(w, E, C::kBits)))), ...);
  return bad;
}

int main() {
  std::mt19937 rng(0);
  int fails = 0, checked = 0;
  for (int fmt = 0; fmt < kNumFormats; ++fmt) {
    for (int bits = 1; bits < 32; ++bits) {
      dispatch_format(fmt, bits, [&](auto codec) {
        using C = decltype(codec);
        int bad = 0;
        for (uint32_t c = 0; c < (1u << bits); ++c) bad += !same(C::decode(c), exact<C>(c));
        uint32_t w[C::kBits];
        for (int unit = 0; unit < 4000; ++unit) {
          for (uint32_t& v : w) v = rng();
          bad += check_unit<C>(w, std::make_integer_sequence<int, 32>{});
        }
        printf("%-10s bits=%d: %s (%d bad)\n", kFormats[fmt].name, bits, bad ? "FAIL" : "ok", bad);
        fails += bad != 0;
        ++checked;
      });
    }
  }
  printf("%d (format, bits) checked, %d failing\n", checked, fails);
  return fails || checked != 14 ? 1 : 0;
}
