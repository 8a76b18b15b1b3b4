// CPU checks of include/jq/cdna4_layout.h, the address arithmetic of
// gpu_src/rocm/cdna4_qmm.hip (built and driven by tests/test_cdna4_kernel.py).
//
//   cdna4_walk walk N K T bsrc ssrc
//     Every (N tile, K step, lane, register byte) the kernel feeds to
//     v_mfma_scale_f32_16x16x128_f8f6f4 is looked up in the Python layout's
//     permutation (bsrc/ssrc: uint32 per preshuffled byte, the canonical index
//     + 1 it holds, 0 for scale padding) and must be the element the
//     instruction's operand semantics puts in that register; every canonical
//     byte must be read exactly once. Likewise the x terms' and x scales'
//     offsets, and the result's (row, column) coverage.
//   cdna4_walk emulate B M N K T xq xs w ws y
//     Runs the kernel's loop (its split of K over waves included) on the CPU
//     with the same header, an emulated
//     MFMA (the operand semantics above, products and block sums in double,
//     one float32 rounding per instruction) and the kernel's NaN-scale rule;
//     writes y float32 [B, M, N].
// Exit status 0 when every check passed; the first failures are printed.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <vector>

#include "jq/cdna4_layout.h"

using namespace jq::cdna4;

namespace {

int failures = 0;
void fail(const std::string& what) {
  if (failures++ < 20) fprintf(stderr, "FAIL %s\n", what.c_str());
}

template <class T>
std::vector<T> read_file(const char* path, size_t count) {
  std::vector<T> v(count);
  FILE* f = fopen(path, "rb");
  if (!f || fread(v.data(), sizeof(T), count, f) != count) {
    fprintf(stderr, "cannot read %zu items from %s\n", count, path);
    exit(2);
  }
  fclose(f);
  return v;
}

// --- The instruction's operand semantics (independent of the header) --------
// E2M1 operand, lane l, register byte b, nibble h: (row, K element in the step).
void e2m1_element(int lane, int b, int h, int* row, int* k) {
  *row = lane % 16;
  *k = 32 * (lane / 16) + 2 * b + h;
}
// E4M3 operand, lane l, register byte b.
void e4m3_element(int lane, int b, int* row, int* k) {
  *row = lane % 16;
  *k = 8 * (lane / 16) + 32 * (b / 8) + b % 8;
}
// Scale operand, lane l: (row, K block in the step).
void scale_element(int lane, int* row, int* block) {
  *row = lane % 16;
  *block = lane / 16;
}
// Result register r of lane l: (row of M, column of N).
void result_element(int lane, int r, int* row, int* col) {
  *row = 4 * (lane / 16) + r;
  *col = lane % 16;
}

int walk(int64_t N, int64_t K, int T, const char* bsrc_path, const char* ssrc_path) {
  const int64_t KB = K / 2, KS = K / 32, Np = (N + 31) / 32 * 32;
  const auto bsrc = read_file<uint32_t>(bsrc_path, (size_t)(N * KB));
  const auto ssrc = read_file<uint32_t>(ssrc_path, (size_t)(Np * KS));
  std::vector<int> b_reads(N * KB, 0), s_reads(Np * KS, 0);
  for (int64_t n_pair = 0; n_pair < Np / 32; ++n_pair)
    for (int64_t kp = 0; kp < K / kPairK; ++kp)
      for (int lane = 0; lane < kWave; ++lane) {
        const int64_t soff = scale_lane_offset(n_pair, kp, lane, KS);
        if (soff < 0 || soff + 4 > Np * KS) fail("scale word out of bounds");
        for (int t = 0; t < 2; ++t) {
          const int64_t tile = 2 * n_pair + t;
          for (int s = 0; s < 2; ++s) {
            const int64_t step = 2 * kp + s;
            int srow, sblock;
            scale_element(lane, &srow, &sblock);
            const int64_t want_n = tile * 16 + srow, want_ks = step * 4 + sblock;
            const int64_t sbyte = soff + scale_byte(t, s);
            const uint32_t got = ssrc[sbyte];
            if (want_n >= N) {
              if (got != 0) fail("scale padding byte is not padding");
            } else if (got != (uint32_t)(want_n * KS + want_ks + 1)) {
              fail("scale n_pair=" + std::to_string(n_pair) + " kp=" + std::to_string(kp) +
                   " lane=" + std::to_string(lane) + " t=" + std::to_string(t) +
                   " s=" + std::to_string(s));
            }
            s_reads[sbyte]++;
            if (tile * 16 >= N) continue;  // the kernel reads no weight for a padding tile
            const int64_t off = b_lane_offset(tile, step, lane, KB);
            if (off < 0 || off + 16 > N * KB) {
              fail("weight bytes out of bounds");
              continue;
            }
            for (int b = 0; b < 16; ++b) {
              int row, k;
              e2m1_element(lane, b, 0, &row, &k);
              int row1, k1;
              e2m1_element(lane, b, 1, &row1, &k1);
              // one byte holds elements k (low nibble) and k + 1 (high nibble)
              if (row1 != row || k1 != k + 1 || k % 2) fail("E2M1 semantics pair");
              const int64_t n = tile * 16 + row, kb = (step * 128 + k) / 2;
              if (bsrc[off + b] != (uint32_t)(n * KB + kb + 1))
                fail("weight tile=" + std::to_string(tile) + " step=" + std::to_string(step) +
                     " lane=" + std::to_string(lane) + " byte=" + std::to_string(b));
              b_reads[off + b]++;
            }
          }
        }
      }
  for (int64_t i = 0; i < N * KB; ++i)
    if (b_reads[i] != 1) {
      fail("weight byte " + std::to_string(i) + " read " + std::to_string(b_reads[i]) + " times");
      break;
    }
  for (int64_t i = 0; i < Np * KS; ++i)
    if (s_reads[i] != 1) {
      fail("scale byte " + std::to_string(i) + " read " + std::to_string(s_reads[i]) + " times");
      break;
    }
  // x terms [T, Mp, K] and scales [Mp, K/32], two M tiles.
  const int64_t Mp = 32;
  std::vector<int> x_reads(T * Mp * K, 0), xs_reads(Mp * KS, 0);
  for (int term = 0; term < T; ++term)
    for (int64_t mt = 0; mt < Mp / 16; ++mt)
      for (int64_t step = 0; step < K / kStepK; ++step)
        for (int lane = 0; lane < kWave; ++lane) {
          for (int chunk = 0; chunk < 4; ++chunk)
            for (int j = 0; j < 8; ++j) {
              int row, k;
              e4m3_element(lane, 8 * chunk + j, &row, &k);
              const int64_t off = x_lane_offset(term, mt, step, lane, chunk, Mp, K) + j;
              const int64_t want = (term * Mp + mt * 16 + row) * K + step * 128 + k;
              if (off != want) fail("x term offset lane=" + std::to_string(lane));
              else x_reads[off]++;
            }
          if (term == 0) {
            int row, block;
            scale_element(lane, &row, &block);
            const int64_t off = x_scale_offset(mt, step, lane, KS);
            if (off != (mt * 16 + row) * KS + step * 4 + block) fail("x scale offset");
            else xs_reads[off]++;
          }
        }
  for (size_t i = 0; i < x_reads.size(); ++i)
    if (x_reads[i] != 1) { fail("x byte read " + std::to_string(x_reads[i]) + " times"); break; }
  for (size_t i = 0; i < xs_reads.size(); ++i)
    if (xs_reads[i] != 1) { fail("x scale read " + std::to_string(xs_reads[i]) + " times"); break; }
  // result: each (row, col) of a 16x16 tile written once, where the semantics say.
  std::vector<int> out(256, 0);
  for (int lane = 0; lane < kWave; ++lane)
    for (int r = 0; r < 4; ++r) {
      int row, col;
      result_element(lane, r, &row, &col);
      if (out_row(1, lane, r) != 16 + row || out_col(2, lane) != 32 + col) fail("result map");
      out[row * 16 + col]++;
    }
  for (int i = 0; i < 256; ++i)
    if (out[i] != 1) { fail("result coverage"); break; }
  printf("walk N=%lld K=%lld T=%d: %d failures\n", (long long)N, (long long)K, T, failures);
  return failures ? 1 : 0;
}

// --- emulation ---------------------------------------------------------------
double e2m1_value(int code) {
  static const double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return (code & 8 ? -1 : 1) * mag[code & 7];
}
double e4m3_value(int code) {
  const int e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return NAN;
  const double v = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
  return code & 0x80 ? -v : v;
}
double e8m0_value(int code) { return code == 255 ? NAN : ldexp(1.0, code - 127); }

struct Regs {
  uint8_t a[kWave][32];
  uint8_t b[kWave][16];
  uint32_t sa[kWave], sb[kWave];
};

// D (lane-distributed, 4 floats per lane) += the scaled product, per the semantics.
void mfma_emulated(const Regs& R, int opsel_a, int opsel_b, float acc[kWave][4]) {
  double A[16][128], B[128][16], SA[16][4], SB[16][4];
  for (int lane = 0; lane < kWave; ++lane) {
    for (int b = 0; b < 32; ++b) {
      int row, k;
      e4m3_element(lane, b, &row, &k);
      A[row][k] = e4m3_value(R.a[lane][b]);
    }
    for (int b = 0; b < 16; ++b)
      for (int h = 0; h < 2; ++h) {
        int row, k;
        e2m1_element(lane, b, h, &row, &k);
        B[k][row] = e2m1_value((R.b[lane][b] >> (4 * h)) & 15);
      }
    int row, block;
    scale_element(lane, &row, &block);
    SA[row][block] = e8m0_value((R.sa[lane] >> (8 * opsel_a)) & 255);
    SB[row][block] = e8m0_value((R.sb[lane] >> (8 * opsel_b)) & 255);
  }
  for (int lane = 0; lane < kWave; ++lane)
    for (int r = 0; r < 4; ++r) {
      int i, j;
      result_element(lane, r, &i, &j);
      double sum = 0;
      for (int blk = 0; blk < 4; ++blk) {
        double dot = 0;
        for (int k = 32 * blk; k < 32 * blk + 32; ++k) dot += A[i][k] * B[k][j];
        sum += dot * SA[i][blk] * SB[j][blk];
      }
      acc[lane][r] = (float)((double)acc[lane][r] + sum);
    }
}

int emulate(int64_t Bn, int64_t M, int64_t N, int64_t K, int T, const char* xq_path,
            const char* xs_path, const char* w_path, const char* ws_path, const char* y_path) {
  const int64_t Mp = (M + 15) / 16 * 16, KB = K / 2, KS = K / 32, Np = (N + 31) / 32 * 32;
  const auto xq = read_file<uint8_t>(xq_path, (size_t)(Bn * T * Mp * K));
  const auto xs = read_file<uint8_t>(xs_path, (size_t)(Bn * Mp * KS));
  const auto w = read_file<uint8_t>(w_path, (size_t)(Bn * N * KB));
  const auto ws = read_file<uint8_t>(ws_path, (size_t)(Bn * Np * KS));
  std::vector<float> y(Bn * M * N, 0.f);
  static Regs R;
  for (int64_t b = 0; b < Bn; ++b)
    for (int64_t mt = 0; mt < Mp / 16; ++mt)
      for (int64_t n_pair = 0; n_pair < Np / 32; ++n_pair) {
        const uint8_t* wb = w.data() + b * N * KB;
        const uint8_t* wsb = ws.data() + b * Np * KS;
        const uint8_t* xt = xq.data() + b * T * Mp * K;
        const uint8_t* xsb = xs.data() + b * Mp * KS;
        const bool second = n_pair * 32 + 16 < N;
        const int waves = waves_per_pair(K);  // the kernel's split of K over its waves
        static float acc[kMaxWavesPerPair][2][kWave][4];
        memset(acc, 0, sizeof(acc));
        bool nan[2][kWave] = {};
        for (int wave = 0; wave < waves; ++wave)
          for (int64_t kp = wave; kp < K / kPairK; kp += waves)
            for (int s = 0; s < 2; ++s) {
              const int64_t step = 2 * kp + s;
              for (int term = 0; term < T; ++term)
                for (int t = 0; t < 2; ++t) {
                  for (int lane = 0; lane < kWave; ++lane) {
                    memcpy(&R.sb[lane], wsb + scale_lane_offset(n_pair, kp, lane, KS), 4);
                    if (scale_is_nan(R.sb[lane], scale_byte(t, 0)) ||
                        scale_is_nan(R.sb[lane], scale_byte(t, 1)))
                      nan[t][lane] = true;
                    if (t == 0 || second)
                      memcpy(R.b[lane], wb + b_lane_offset(2 * n_pair + t, step, lane, KB), 16);
                    else
                      memset(R.b[lane], 0, 16);
                    for (int c = 0; c < 4; ++c)
                      memcpy(&R.a[lane][8 * c],
                             xt + x_lane_offset(term, mt, step, lane, c, Mp, K), 8);
                    R.sa[lane] = xsb[x_scale_offset(mt, step, lane, KS)];
                  }
                  mfma_emulated(R, 0, scale_byte(t, s), acc[wave][t]);
                }
            }
        for (int lane = 0; lane < kWave; ++lane)
          for (int t = 0; t < 2; ++t) {
            bool flag = false;  // the kernel's shuffles over lanes with the same row
            for (int g = 0; g < 4; ++g) flag |= nan[t][(lane & 15) + 16 * g];
            for (int r = 0; r < 4; ++r) {
              const int64_t row = out_row(mt, lane, r), col = out_col(2 * n_pair + t, lane);
              float v = acc[0][t][lane][r];
              for (int u = 1; u < waves; ++u) v += acc[u][t][lane][r];  // wave order
              if (row < M && col < N) y[(b * M + row) * N + col] = flag ? NAN : v;
            }
          }
      }
  FILE* f = fopen(y_path, "wb");
  if (!f || fwrite(y.data(), sizeof(float), y.size(), f) != y.size()) return 2;
  fclose(f);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 7 && !strcmp(argv[1], "walk"))
    return walk(atoll(argv[2]), atoll(argv[3]), atoi(argv[4]), argv[5], argv[6]);
  if (argc == 12 && !strcmp(argv[1], "emulate"))
    return emulate(atoll(argv[2]), atoll(argv[3]), atoll(argv[4]), atoll(argv[5]), atoi(argv[6]),
                   argv[7], argv[8], argv[9], argv[10], argv[11]);
  fprintf(stderr, "usage: cdna4_walk walk N K T bsrc ssrc | emulate B M N K T xq xs w ws y\n");
  return 2;
}
