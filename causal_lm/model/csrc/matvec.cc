// Decode-shaped products y[r, n] = sum_k x[r, k] * W[n, k] for a few rows r (1..16), reading W once for all rows at
// the machine's memory bandwidth. XLA:CPU runs these at 8-9 GB/s in float32 and has no product that reads int8 or
// int4 weights without widening them first (docs/performance.md); decoding one token is ~200 of them.
//
// W is output-major (each output's weights contiguous, one dot product per output, the weights streamed in address
// order); the decode form of a model stores its weights this way (model/matvec.py):
//   float32  w  [N, K], or tiled [N/4, K/16, 4, 16]: tiles of 4 outputs x 16 inputs, each output's 16 inputs one
//            64-byte line, the 4 outputs' lines adjacent, the tiles of a block of 4 outputs in input order. A block
//            of 4 outputs then reads one stream of addresses instead of 4 (w[n] .. w[n + 3] are K floats apart):
//            the 135M shape's products, Zen 5, 2 threads, 40 -> 48 GB/s (a quiet minute: 58 -> 77, where a plain
//            sum over the same bytes reads 75-78; docs/performance.md). Which layout changes no value.
//   int8     q  [N, K] int8, or tiled [N/4, K/64, 4, 64] (each output's 64 inputs one line, as float32's 16),
//            scale [N, G]                                      w = q * scale           (groups of g = K / G inputs)
//            (tiled, the 135M shape's products, one row, alternated in one process: 43 -> 51 GB/s, 20 of 20)
//   int4     p  [N, G, g/2] uint8, scale [N, G] (, minimum [N, G])
//            byte j of group G holds input G*g + j in its low nibble and G*g + j + g/2 in its high nibble;
//            w = (nibble - 8) * scale (symmetric), or nibble * scale + minimum (with minimums).
// The outputs are split across the caller and XLA's intra-op thread pool, one contiguous range per thread
// (`ffi::Ctx<ffi::ThreadPool>`, parallel.h: its helpers linger between calls).
//
// Order of the sums, the same for every output whatever the number of rows or threads (so decoding is batch
// invariant): per output n and row r, 8 lanes; within a group, lane l is a fused multiply-add chain over the
// group's inputs i = l (mod 8) in increasing order, part[l] = fma(x[r, k], w~[n, k], part[l]) (w~: the float
// weight, the int8 value or the nibble as a float); then per group in order acc[l] = fma(part[l], scale[n, G],
// acc[l]) (float32: one group, acc = part); y = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)); int4 adds, per
// group in order, y = fma(sum_G x, offset[n, G], y), offset = -8 * scale or the minimum (sum_G x: the group's inputs
// added in order). The AVX2 path (groups that are whole vectors) and the scalar path do exactly these operations.
// On a CPU with AVX-512 (the kernels are compiled for the machine they run on), float32 weights of a multiple of 16
// inputs, int8 groups of a multiple of 16 inputs and int4 groups of 32 take 16 lanes instead: lane l chains over the
// group's inputs i = l (mod 16), the lanes then fold to 8, l[j] + l[j + 8], and the sum goes on as above. One
// widening and one conversion serve 16 weights instead of 8, which is what the quantized products are bound by, and
// float32 streams its weights faster in 16 lanes (docs/performance.md). Which order a product takes depends on the
// machine and the weight's group size only, never on the rows.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CLM_AVX2 1
#if defined(__AVX512F__)
#define CLM_AVX512 1
#endif
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 16;

enum Format { kF32 = 0, kI8 = 1, kI4 = 2 };

struct Problem {
  Format format;
  int64_t R, K, N, G, g;  // rows, inputs, outputs, groups, inputs per group
  const float* x;         // [R, K]
  const void* w;          // the weight bytes, output-major
  bool tiled;             // float32 / int8 in tiles of 4 outputs x one 64-byte line of inputs each
  const float* scale;     // [N, G] (int8, int4)
  const float* minimum;   // [N, G] or null (int4)
  const float* xsum;      // [R, G] group sums of x (int4)
  float* y;               // [R, N]
};

inline float lanes_sum(const float* l) { return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])); }

// Where a float32 or int8 weight (n, k) is: w[w_row<L>(n) + w_col<L>(k)], L the inputs of one 64-byte line (16
// float32, 64 int8).
template <int64_t L>
inline int64_t w_row(const Problem& P, int64_t n) {
  return P.tiled ? (n >> 2) * 4 * P.K + (n & 3) * L : n * P.K;
}
template <int64_t L>
inline int64_t w_col(const Problem& P, int64_t k) {
  return P.tiled ? (k / L) * 4 * L + k % L : k;
}

// The float weight of output n, input i of group G (the scalar path).
inline float weight(const Problem& P, int64_t n, int64_t G, int64_t i) {
  const int64_t k = G * P.g + i;
  if (P.format == kF32) return static_cast<const float*>(P.w)[w_row<16>(P, n) + w_col<16>(P, k)];
  if (P.format == kI8) return static_cast<float>(static_cast<const int8_t*>(P.w)[w_row<64>(P, n) + w_col<64>(P, k)]);
  const int64_t h = P.g / 2;
  const uint8_t b = static_cast<const uint8_t*>(P.w)[(n * P.G + G) * h + (i < h ? i : i - h)];
  return static_cast<float>(i < h ? (b & 15) : (b >> 4));
}

// Rows r0..r0+RB of output n, the scalar path (any group size).
template <int RB>
void scalar_rows(const Problem& P, int64_t r0, int64_t n) {
  float acc[RB][8] = {}, part[RB][8];
  for (int64_t G = 0; G < P.G; ++G) {
    for (int r = 0; r < RB; ++r) std::fill(part[r], part[r] + 8, 0.0f);
    for (int64_t i = 0; i < P.g; ++i) {
      const float w = weight(P, n, G, i);
      for (int r = 0; r < RB; ++r) part[r][i % 8] = std::fma(P.x[(r0 + r) * P.K + G * P.g + i], w, part[r][i % 8]);
    }
    for (int r = 0; r < RB; ++r)
      for (int l = 0; l < 8; ++l)
        acc[r][l] = P.format == kF32 ? part[r][l] : std::fma(part[r][l], P.scale[n * P.G + G], acc[r][l]);
  }
  for (int r = 0; r < RB; ++r) {
    float s = lanes_sum(acc[r]);
    if (P.format == kI4)
      for (int64_t G = 0; G < P.G; ++G) {
        const float off = P.minimum ? P.minimum[n * P.G + G] : -8.0f * P.scale[n * P.G + G];
        s = std::fma(P.xsum[(r0 + r) * P.G + G], off, s);
      }
    P.y[(r0 + r) * P.N + n] = s;
  }
}

// The int4 offsets of row r, outputs n0..n0+NB: per group in order s[b] = fma(sum_G x, offset[n, G], s[b]), the NB
// outputs' chains interleaved (each one a chain of fused multiply-adds that would stall on its latency alone).
template <int NB>
inline void add_offsets(const Problem& P, int64_t r, int64_t n0, float* s) {
  for (int64_t G = 0; G < P.G; ++G) {
    const float xs = P.xsum[r * P.G + G];
    for (int b = 0; b < NB; ++b) {
      const int64_t at = (n0 + b) * P.G + G;
      s[b] = std::fma(xs, P.minimum ? P.minimum[at] : -8.0f * P.scale[at], s[b]);
    }
  }
}

#ifdef CLM_AVX2
// Asks for the cache line kAhead bytes past p into L2: the weights a few blocks of outputs later. The hardware's
// prefetchers follow one stream well but not the NB interleaved ones a block of outputs reads; asking into L1 a block
// ahead (this kernel's first form) kept a core at 14 GB/s of float32 and 10 of int8 on Zen 4, asking into L2 32 KiB
// ahead reaches 22 per core, 40 GB/s with both (a plain sum over the same bytes: 30-32).
constexpr int64_t kAhead = 32768;
inline void ahead(const void* p) { _mm_prefetch(static_cast<const char*>(p) + kAhead, _MM_HINT_T1); }

// lanes_sum of the 8 lanes of v, in registers: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). Storing the vector
// and adding its lanes back from memory (this kernel's form before) waited on the store at every output: one core's
// float32 products of the 135M shape, Zen 5, 27 -> 30 GB/s.
inline float lanes_sum8(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l[j] + l[j + 4]
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));  // (l0 + l4) + (l2 + l6), (l1 + l5) + (l3 + l7)
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

inline __m256 widen8(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}
inline __m256i bytes8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Rows r0..r0+RB of outputs n0..n0+NB, every group whole vectors of 8 (float32 / int8: g % 8 == 0; int4:
// g/2 % 8 == 0). RB * NB independent chains keep the FMA units busy (one chain waits on its latency).
template <int RB, int NB>
void vector_rows(const Problem& P, int64_t r0, int64_t n0) {
  const int64_t K = P.K, g = P.g;
  const float* x = P.x + r0 * K;
  __m256 acc[RB][NB], part[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm256_setzero_ps();
  for (int64_t G = 0; G < P.G; ++G) {
    const int64_t k0 = G * g;
    for (int r = 0; r < RB; ++r)
      for (int b = 0; b < NB; ++b) part[r][b] = _mm256_setzero_ps();
    if (P.format == kF32) {
      const float* w = static_cast<const float*>(P.w);
      int64_t at[NB];
      for (int b = 0; b < NB; ++b) at[b] = w_row<16>(P, n0 + b);
      for (int64_t i = 0; i < g; i += 8) {
        const int64_t col = w_col<16>(P, k0 + i);
        if (i % 16 == 0)
          for (int b = 0; b < NB; ++b) ahead(w + at[b] + col);
        __m256 wv[NB];
        for (int b = 0; b < NB; ++b) wv[b] = _mm256_loadu_ps(w + at[b] + col);
        for (int r = 0; r < RB; ++r) {
          const __m256 xv = _mm256_loadu_ps(x + r * K + k0 + i);
          for (int b = 0; b < NB; ++b) part[r][b] = _mm256_fmadd_ps(xv, wv[b], part[r][b]);
        }
      }
    } else if (P.format == kI8) {
      const int8_t* q = static_cast<const int8_t*>(P.w);
      int64_t at[NB];
      for (int b = 0; b < NB; ++b) at[b] = w_row<64>(P, n0 + b);
      for (int64_t i = 0; i < g; i += 8) {
        const int64_t col = w_col<64>(P, k0 + i);
        if ((k0 + i) % 64 == 0)
          for (int b = 0; b < NB; ++b) ahead(q + at[b] + col);
        __m256 wv[NB];
        for (int b = 0; b < NB; ++b) wv[b] = widen8(q + at[b] + col);
        for (int r = 0; r < RB; ++r) {
          const __m256 xv = _mm256_loadu_ps(x + r * K + k0 + i);
          for (int b = 0; b < NB; ++b) part[r][b] = _mm256_fmadd_ps(xv, wv[b], part[r][b]);
        }
      }
    } else {
      const int64_t h = g / 2, row = P.G * h;  // bytes per output
      const uint8_t* p = static_cast<const uint8_t*>(P.w) + n0 * row + G * h;
      if (G % 16 == 0)  // the scales (and minimums): two more streams, as many floats as 8 bytes of nibbles
        for (int b = 0; b < NB; ++b) {
          ahead(P.scale + (n0 + b) * P.G + G);
          if (P.minimum) ahead(P.minimum + (n0 + b) * P.G + G);
        }
      if (h == 16) {  // groups of 32 (GGUF's Q4_0 / Q4_1): the group's 16 bytes of each output in one load
        const __m128i nib = _mm_set1_epi8(15);
        if (G % 4 == 0)
          for (int b = 0; b < NB; ++b) ahead(p + b * row);
        for (int b = 0; b < NB; ++b) {
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + b * row));
          const __m128i lo = _mm_and_si128(bytes, nib), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nib);
          // inputs k0 + 0..7, 8..15 (low nibbles of bytes 0..7, 8..15), then k0 + 16..23, 24..31 (high nibbles)
          const __m256 w[4] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                               _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                               _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
                               _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))};
          for (int r = 0; r < RB; ++r)
            for (int u = 0; u < 4; ++u)
              part[r][b] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k0 + 8 * u), w[u], part[r][b]);
        }
      } else {
      const __m256i low = _mm256_set1_epi32(15);
      // Each 8 bytes are widened once: their low nibbles go into the sums now, their high nibbles (inputs h
      // later) are kept, as floats, for after the low ones (the order of the sums above); groups wider than
      // kKeep bytes widen them again.
      constexpr int64_t kKeep = 32;
      __m256 high[kKeep / 8][NB];
      const bool keep = h <= kKeep;
      for (int64_t i = 0; i < h; i += 8) {  // the low nibbles: inputs k0 .. k0 + h
        if ((G * h + i) % 64 == 0)
          for (int b = 0; b < NB; ++b) ahead(p + b * row + i);
        __m256 wv[NB];
        for (int b = 0; b < NB; ++b) {
          const __m256i bytes = bytes8(p + b * row + i);
          wv[b] = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low));
          if (keep) high[i / 8][b] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
        }
        for (int r = 0; r < RB; ++r) {
          const __m256 xv = _mm256_loadu_ps(x + r * K + k0 + i);
          for (int b = 0; b < NB; ++b) part[r][b] = _mm256_fmadd_ps(xv, wv[b], part[r][b]);
        }
      }
      for (int64_t i = 0; i < h; i += 8) {  // the high nibbles: inputs k0 + h .. k0 + g
        __m256 wv[NB];
        for (int b = 0; b < NB; ++b)
          wv[b] = keep ? high[i / 8][b] : _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes8(p + b * row + i), 4));
        for (int r = 0; r < RB; ++r) {
          const __m256 xv = _mm256_loadu_ps(x + r * K + k0 + h + i);
          for (int b = 0; b < NB; ++b) part[r][b] = _mm256_fmadd_ps(xv, wv[b], part[r][b]);
        }
      }
      }
    }
    if (P.format == kF32) {
      for (int r = 0; r < RB; ++r)
        for (int b = 0; b < NB; ++b) acc[r][b] = part[r][b];
    } else {
      for (int b = 0; b < NB; ++b) {
        const __m256 sc = _mm256_set1_ps(P.scale[(n0 + b) * P.G + G]);
        for (int r = 0; r < RB; ++r) acc[r][b] = _mm256_fmadd_ps(part[r][b], sc, acc[r][b]);
      }
    }
  }
  for (int r = 0; r < RB; ++r) {
    float s[NB];
    for (int b = 0; b < NB; ++b) s[b] = lanes_sum8(acc[r][b]);
    if (P.format == kI4) add_offsets<NB>(P, r0 + r, n0, s);
    for (int b = 0; b < NB; ++b) P.y[(r0 + r) * P.N + n0 + b] = s[b];
  }
}
#endif

#ifdef CLM_AVX512
// The 16 lanes of v folded to 8: l[j] + l[j + 8].
inline __m256 fold16(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// Rows r0..r0+RB of outputs n0..n0+NB in 16 lanes: float32 and int8 with g % 16 == 0, int4 with g == 32.
template <int RB, int NB>
void wide_rows(const Problem& P, int64_t r0, int64_t n0) {
  const int64_t K = P.K, g = P.g;
  const float* x = P.x + r0 * K;
  __m512 acc[RB][NB], part[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t G = 0; G < P.G; ++G) {
    const int64_t k0 = G * g;
    for (int r = 0; r < RB; ++r)
      for (int b = 0; b < NB; ++b) part[r][b] = _mm512_setzero_ps();
    if (P.format == kF32) {
      const float* w = static_cast<const float*>(P.w);
      int64_t at[NB];
      for (int b = 0; b < NB; ++b) at[b] = w_row<16>(P, n0 + b);
      for (int64_t i = 0; i < g; i += 16) {
        const int64_t col = w_col<16>(P, k0 + i);
        for (int b = 0; b < NB; ++b) ahead(w + at[b] + col);
        __m512 wv[NB];
        for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_ps(w + at[b] + col);
        for (int r = 0; r < RB; ++r) {
          const __m512 xv = _mm512_loadu_ps(x + r * K + k0 + i);
          for (int b = 0; b < NB; ++b) part[r][b] = _mm512_fmadd_ps(xv, wv[b], part[r][b]);
        }
      }
    } else if (P.format == kI8) {
      const int8_t* q = static_cast<const int8_t*>(P.w);
      int64_t at[NB];
      for (int b = 0; b < NB; ++b) at[b] = w_row<64>(P, n0 + b);
      for (int64_t i = 0; i < g; i += 16) {
        const int64_t col = w_col<64>(P, k0 + i);
        if ((k0 + i) % 64 == 0)
          for (int b = 0; b < NB; ++b) ahead(q + at[b] + col);
        __m512 wv[NB];
        for (int b = 0; b < NB; ++b)
          wv[b] = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + at[b] + col))));
        for (int r = 0; r < RB; ++r) {
          const __m512 xv = _mm512_loadu_ps(x + r * K + k0 + i);
          for (int b = 0; b < NB; ++b) part[r][b] = _mm512_fmadd_ps(xv, wv[b], part[r][b]);
        }
      }
    } else {  // int4, groups of 32: byte j holds inputs k0 + j (low nibble) and k0 + 16 + j (high)
      const int64_t row = P.G * 16;
      const uint8_t* p = static_cast<const uint8_t*>(P.w) + n0 * row + G * 16;
      if (G % 16 == 0)
        for (int b = 0; b < NB; ++b) {
          ahead(P.scale + (n0 + b) * P.G + G);
          if (P.minimum) ahead(P.minimum + (n0 + b) * P.G + G);
        }
      if (G % 4 == 0)
        for (int b = 0; b < NB; ++b) ahead(p + b * row);
      // Each of the 16 bytes widened once to a 32-bit lane; its two nibbles become floats by a lookup in the 16
      // values 0..15 (vpermps takes its index from a lane's low 4 bits, so the low nibble needs no mask): the floats
      // a conversion of each nibble gives, in 5 instructions for 32 weights instead of 8 (masks, two widenings,
      // two conversions). Zen 5, 30 layers' int4 g32 products chained, one row, alternated in one process: 5.31 ->
      // 5.02 ms (symmetric, 9 of 12 rounds), 7.27 -> 6.73 ms (minimums, 8 of 12).
      const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      for (int b = 0; b < NB; ++b) {
        const __m512i lanes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + b * row)));
        const __m512 lo = _mm512_permutexvar_ps(lanes, values);
        const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(lanes, 4), values);
        for (int r = 0; r < RB; ++r) {
          part[r][b] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k0), lo, part[r][b]);
          part[r][b] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k0 + 16), hi, part[r][b]);
        }
      }
    }
    if (P.format == kF32) {
      for (int r = 0; r < RB; ++r)
        for (int b = 0; b < NB; ++b) acc[r][b] = part[r][b];
    } else {
      for (int b = 0; b < NB; ++b) {
        const __m512 sc = _mm512_set1_ps(P.scale[(n0 + b) * P.G + G]);
        for (int r = 0; r < RB; ++r) acc[r][b] = _mm512_fmadd_ps(part[r][b], sc, acc[r][b]);
      }
    }
  }
  for (int r = 0; r < RB; ++r) {
    float s[NB];
    for (int b = 0; b < NB; ++b) s[b] = lanes_sum8(fold16(acc[r][b]));
    if (P.format == kI4) add_offsets<NB>(P, r0 + r, n0, s);
    for (int b = 0; b < NB; ++b) P.y[(r0 + r) * P.N + n0 + b] = s[b];
  }
}
#endif

// Rows r0..r0+RB of outputs n0..n0+NB.
template <int RB, int NB>
inline void rows(const Problem& P, int64_t r0, int64_t n0) {
#ifdef CLM_AVX512
  if ((P.format != kI4 && P.g % 16 == 0) || (P.format == kI4 && P.g == 32)) return wide_rows<RB, NB>(P, r0, n0);
#endif
#ifdef CLM_AVX2
  const bool whole = P.format == kI4 ? (P.g / 2) % 8 == 0 : P.g % 8 == 0;
  if (whole) return vector_rows<RB, NB>(P, r0, n0);
#endif
  for (int b = 0; b < NB; ++b) scalar_rows<RB>(P, r0, n0 + b);
}

// Outputs [n0, n1), all rows. Blocks of 4 rows x 3 outputs (12 independent chains: the FMA units stay busy, and
// each vector of x loaded serves 3 outputs); the rows left over (R % 4): 4 outputs at a time for one row, 2 x 2 for
// two or three. Each output's weights are read from memory once, then from L1. Tiled weights (n0, n1 multiples of 4)
// go by whole tiles, but for int8's blocks of 4 rows: float32 4 rows x 4 outputs where there are 32 vector registers
// (AVX-512), else 4 x 2 twice; int8 keeps 4 x 3 (its widened weights and separate group sums need more registers:
// 4 x 4 was 7% slower at batch 8 in the 135M step, Zen 5, 4 x 3 level with untiled weights).
void outputs(const Problem& P, int64_t n0, int64_t n1) {
  const int64_t R4 = P.R / 4 * 4;
  if (R4 && P.tiled && P.format == kF32) {
    for (int64_t n = n0; n < n1; n += 4)
      for (int64_t r = 0; r < R4; r += 4) {
#ifdef CLM_AVX512
        rows<4, 4>(P, r, n);
#else
        rows<4, 2>(P, r, n);
        rows<4, 2>(P, r, n + 2);
#endif
      }
  } else if (R4) {
    int64_t n = n0;
    for (; n + 3 <= n1; n += 3)
      for (int64_t r = 0; r < R4; r += 4) rows<4, 3>(P, r, n);
    for (; n < n1; ++n)
      for (int64_t r = 0; r < R4; r += 4) rows<4, 1>(P, r, n);
  }
  if (R4 == P.R) return;
  for (int64_t n = n0; n < n1; n += (n + 4 <= n1 ? 4 : 1)) {
    const bool four = n + 4 <= n1;
    int64_t r = R4;
    for (; r + 2 <= P.R; r += 2) {
      if (four) {
        rows<2, 2>(P, r, n);
        rows<2, 2>(P, r, n + 2);
      } else {
        rows<2, 1>(P, r, n);
      }
    }
    if (r < P.R) {
      if (four)
        rows<1, 4>(P, r, n);
      else
        rows<1, 1>(P, r, n);
    }
  }
}

// One contiguous range of outputs per thread (whole blocks of 8), on the caller and XLA's pool (parallel.h); the
// split changes no value. Each thread streams one run of addresses, which its prefetches (`ahead`, 32 KiB on) stay
// inside but at its end. Measured against ranges of 64-1024 outputs taken in turn (the form before: the small
// products, 576 or 960 outputs in 5 or 8 ranges, ended with one thread idle while the other did the last range), the
// 135M shape on the Intel VM, a jitted decode step, the two alternated in one process: float32 batch 1 -1.7% a step
// (every one of 10 pairs), batch 8 -1.4%, int8 batch 1 -5% (every one of 8 pairs).
void parallel(const Problem& P, ffi::ThreadPool& pool) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per = ((P.N + threads - 1) / threads + 7) / 8 * 8;
  causal_lm_native::parallel_for((P.N + per - 1) / per, pool,
                                 [&P, per](int64_t i) { outputs(P, i * per, std::min((i + 1) * per, P.N)); });
}

ffi::Error check(int64_t R, int64_t K, int64_t N) {
  if (R < 1 || R > kMaxRows) return ffi::Error::InvalidArgument("matvec: rows must be 1..16");
  if (K < 1 || N < 1) return ffi::Error::InvalidArgument("matvec: empty weight");
  return ffi::Error::Success();
}

ffi::Error F32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w_any, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w_any.dimensions();
  const bool tiled = wd.size() == 4;
  if (w_any.element_type() != ffi::DataType::F32 || xd.size() != 2 ||
      !(tiled ? wd[2] == 4 && wd[3] == 16 && wd[1] * 16 == xd[1] : wd.size() == 2 && wd[1] == xd[1]))
    return ffi::Error::InvalidArgument("matvec_f32: x [R, K] float32, w [N, K] or [N/4, K/16, 4, 16] float32");
  const int64_t R = xd[0], K = xd[1], N = tiled ? wd[0] * 4 : wd[0];
  if (auto e = check(R, K, N); e.failure()) return e;
  Problem P{kF32, R, K, N, 1, K, x.typed_data(), w_any.untyped_data(), tiled, nullptr, nullptr, nullptr,
            y->typed_data()};
  parallel(P, pool);
  return ffi::Error::Success();
}

ffi::Error I8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::Buffer<ffi::F32> scale,
              ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions();
  const bool tiled = qd.size() == 4;
  if (q.element_type() != ffi::DataType::S8 || xd.size() != 2 || sd.size() != 2 ||
      !(tiled ? qd[2] == 4 && qd[3] == 64 && qd[1] * 64 == xd[1] : qd.size() == 2 && qd[1] == xd[1]))
    return ffi::Error::InvalidArgument("matvec_i8: x [R, K], q int8 [N, K] or [N/4, K/64, 4, 64], scale [N, G]");
  const int64_t R = xd[0], K = xd[1], N = tiled ? qd[0] * 4 : qd[0], G = sd[1];
  if (sd[0] != N) return ffi::Error::InvalidArgument("matvec_i8: scale [N, G]");
  if (auto e = check(R, K, N); e.failure()) return e;
  if (G < 1 || K % G) return ffi::Error::InvalidArgument("matvec_i8: the groups must divide the inputs");
  Problem P{kI8, R, K, N, G, K / G, x.typed_data(), q.untyped_data(), tiled, scale.typed_data(),
            nullptr, nullptr, y->typed_data()};
  parallel(P, pool);
  return ffi::Error::Success();
}

ffi::Error I4Impl(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::U8>& p, ffi::Buffer<ffi::F32>& scale,
                  const float* minimum, ffi::ResultBuffer<ffi::F32>& y) {
  auto xd = x.dimensions(), pd = p.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || pd.size() != 3 || sd.size() != 2 || sd[0] != pd[0] || sd[1] != pd[1])
    return ffi::Error::InvalidArgument("matvec_i4: x [R, K], p [N, G, g/2], scale [N, G]");
  const int64_t R = xd[0], K = xd[1], N = pd[0], G = pd[1], g = 2 * pd[2];
  if (auto e = check(R, K, N); e.failure()) return e;
  if (G * g != K) return ffi::Error::InvalidArgument("matvec_i4: the groups must cover the inputs");
  const float* xp = x.typed_data();
  std::vector<float> xsum(R * G);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < G; ++i) {
      float s = 0.0f;
      for (int64_t k = i * g; k < (i + 1) * g; ++k) s += xp[r * K + k];
      xsum[r * G + i] = s;
    }
  Problem P{kI4, R, K, N, G, g, xp, p.typed_data(), false, scale.typed_data(), minimum, xsum.data(), y->typed_data()};
  parallel(P, pool);
  return ffi::Error::Success();
}

ffi::Error I4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> p, ffi::Buffer<ffi::F32> scale,
              ffi::ResultBuffer<ffi::F32> y) {
  return I4Impl(pool, x, p, scale, nullptr, y);
}

ffi::Error I4Min(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> p, ffi::Buffer<ffi::F32> scale,
                 ffi::Buffer<ffi::F32> minimum, ffi::ResultBuffer<ffi::F32> y) {
  auto md = minimum.dimensions(), sd = scale.dimensions();
  if (md.size() != 2 || md[0] != sd[0] || md[1] != sd[1])
    return ffi::Error::InvalidArgument("matvec_i4: minimum must be [N, G] like scale");
  return I4Impl(pool, x, p, scale, minimum.typed_data(), y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(causal_lm_matvec_f32, F32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(causal_lm_matvec_i8, I8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(causal_lm_matvec_i4, I4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(causal_lm_matvec_i4m, I4Min,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

CLM_PARALLEL_STATE_SYMBOL
