// Decode attention over a cache read in place, for a few queries. Three forms: the whole attention of one layer over
// a contiguous cache's stacked buffers (`causal_lm_decode_attention`, kv_cache.KVCache.attend: the decoder's decode
// steps; described with its code below), the same over a paged pool read through its page table
// (`causal_lm_decode_attention_paged`, paged_cache.PagedKVCache.attend: the serving engine's decode steps; at the
// end), and the two products alone with the softmax left to XLA (below first,
// causal_lm/model/kernels.py `native_attention`: a few queries over keys that are not a cache's buffers, e.g. a
// ring's old slots joined to the chunk). XLA:CPU runs the products as small batched matmuls at a fifth of the memory bandwidth, and a decode
// step of a 135M model spends as long on them as on a third of its weights.
//
//   scores  s[b, kh, g, t, j] = q[b, t, kh * G + g, :] . k[b, j, kh, :]          (float32, unscaled)
//   values  o[b, t, kh * G + g, :] = sum_j w[b, kh, g, t, j] * v[b, j, kh, :]
//
// Between them JAX applies the scale, the mask, the sink, the softcap and the softmax (`masked_softmax`, the one
// function every kernel uses), so these kernels do no position arithmetic. q [B, T, N, H], k [B, S, K, H],
// v [B, S, K, Hv], w [B, K, G, T, S], all float32, row-major; N = K * G.
//
// Order of the sums, fixed whatever the batch or the number of threads (a row's result does not depend on its
// batch): a dot product over H in 8 lanes (lane l: the inputs i = l mod 8 in increasing order, fused
// multiply-adds), then ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)); a value sum over j in increasing order,
// o = fma(w_j, v_j, o) per output element. Work items are (row b, KV head kh), shared out over XLA's intra-op
// threads; the AVX2 path and the scalar path (H or Hv not a multiple of 8) do exactly these operations, and so do
// the whole attention's AVX-512 value sums (16 output elements a vector, each its own chain).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CLM_AVX2 1
#define CLM_VECTOR true
#else
#define CLM_VECTOR false
#endif
#if defined(__AVX512F__) && defined(CLM_AVX2)
#define CLM_AVX512 1
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float lanes_sum(const float* l) { return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])); }

inline float dot(const float* a, const float* b, int64_t n) {
#ifdef CLM_AVX2
  if (n % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    alignas(32) float l[8];
    _mm256_store_ps(l, acc);
    return lanes_sum(l);
  }
#endif
  float l[8] = {};
  for (int64_t i = 0; i < n; ++i) l[i % 8] = std::fma(a[i], b[i], l[i % 8]);
  return lanes_sum(l);
}

inline void axpy(float w, const float* x, float* y, int64_t n) {
#ifdef CLM_AVX2
  if (n % 8 == 0) {
    const __m256 wv = _mm256_set1_ps(w);
    for (int64_t i = 0; i < n; i += 8)
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) y[i] = std::fma(w, x[i], y[i]);
}

struct Dims {
  int64_t B, T, N, K, G, S, H, Hv;
};

// Scores of row b, KV head kh: every key j (read once), against the T * G queries that use it.
void scores_item(const Dims& d, const float* q, const float* k, float* s, int64_t b, int64_t kh) {
  for (int64_t j = 0; j < d.S; ++j) {
    const float* kj = k + ((b * d.S + j) * d.K + kh) * d.H;
    for (int64_t g = 0; g < d.G; ++g)
      for (int64_t t = 0; t < d.T; ++t) {
        const float* qv = q + ((b * d.T + t) * d.N + kh * d.G + g) * d.H;
        s[(((b * d.K + kh) * d.G + g) * d.T + t) * d.S + j] = dot(qv, kj, d.H);
      }
  }
}

// Values of row b, KV head kh: every value vector j (read once) into the T * G outputs it feeds.
void values_item(const Dims& d, const float* w, const float* v, float* o, int64_t b, int64_t kh) {
  for (int64_t g = 0; g < d.G; ++g)
    for (int64_t t = 0; t < d.T; ++t) std::fill_n(o + ((b * d.T + t) * d.N + kh * d.G + g) * d.Hv, d.Hv, 0.0f);
  for (int64_t j = 0; j < d.S; ++j) {
    const float* vj = v + ((b * d.S + j) * d.K + kh) * d.Hv;
    for (int64_t g = 0; g < d.G; ++g)
      for (int64_t t = 0; t < d.T; ++t) {
        const float wj = w[(((b * d.K + kh) * d.G + g) * d.T + t) * d.S + j];
        if (wj != 0.0f) axpy(wj, vj, o + ((b * d.T + t) * d.N + kh * d.G + g) * d.Hv, d.Hv);
      }
  }
}

ffi::Error Scores(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                  ffi::ResultBuffer<ffi::F32> s) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || qd[0] != kd[0] || qd[3] != kd[3] || kd[2] < 1 || qd[2] % kd[2])
    return ffi::Error::InvalidArgument("decode_attention_scores: q [B, T, K * G, H], k [B, S, K, H]");
  const Dims d{qd[0], qd[1], qd[2], kd[2], qd[2] / kd[2], kd[1], qd[3], 0};
  const float *qp = q.typed_data(), *kp = k.typed_data();
  float* sp = s->typed_data();
  causal_lm_native::parallel_for(d.B * d.K, pool,
                                 [&d, qp, kp, sp](int64_t i) { scores_item(d, qp, kp, sp, i / d.K, i % d.K); });
  return ffi::Error::Success();
}

ffi::Error Values(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> v,
                  ffi::ResultBuffer<ffi::F32> o) {
  auto wd = w.dimensions(), vd = v.dimensions();
  if (wd.size() != 5 || vd.size() != 4 || wd[0] != vd[0] || wd[1] != vd[2] || wd[4] != vd[1])
    return ffi::Error::InvalidArgument("decode_attention_values: w [B, K, G, T, S], v [B, S, K, Hv]");
  const Dims d{wd[0], wd[3], wd[1] * wd[2], wd[1], wd[2], wd[4], 0, vd[3]};
  const float *wp = w.typed_data(), *vp = v.typed_data();
  float* op = o->typed_data();
  causal_lm_native::parallel_for(d.B * d.K, pool,
                                 [&d, wp, vp, op](int64_t i) { values_item(d, wp, vp, op, i / d.K, i % d.K); });
  return ffi::Error::Success();
}


// ---- the whole attention over a contiguous cache, read in place ------------------------------------------------
//
//   out[b, t, n] = sum_j w[b, t, n, j] * v[layer, b, j, n / G]
//   w = softmax_j(score) over the visible slots j (+ the sink logit in the denominator), zeros for a row that sees
//   no slot (without a sink); score = q[b, t, n] . k[layer, b, j, n / G] * scale, then softcap * tanh(score /
//   softcap) when softcap > 0 (kernels.masked_softmax's rules).
//
// k [L, B, C, K, H] and v [L, B, C, K, Hv] are the cache's stacked buffers and `layer` a scalar operand: the layer is
// read where it lies (an XLA slice of it would be a copy of the whole layer per call), slots nobody sees are not
// read at all. visible [B, T, C] is the one mask function's output. Work items are (row b, chunk of kChunk slots):
// each reads its slots' keys and values once, contiguously, for every head, and leaves a partial softmax (its max,
// its sum of exponentials, its weighted sum of values); the partials are then merged per output in increasing chunk
// order. The chunks are fixed slot ranges, so a row's result does not depend on the batch or the threads.
// Order within a chunk: each dot product summed as `dot` sums it (eight slots at a time on the AVX2 path,
// `lanes_sum8`, the same tree), exponentials by `exp_approx` (the same float operations on both paths), the sum of
// exponentials and each value sum over slots in increasing order. Measured on Zen 4, the 135M shape at context 512
// (a jitted decode step, one process, alternated with the two-product form it replaces, which sliced the layer out
// and ran the softmax in XLA): int8 weights batch 1 11.7 -> 9.9 ms a step, batch 8 41.2 -> 36.8; float32 batch 1
// 23.7 -> 18.6, batch 8 47.2 -> 38.5. Then (Intel Xeon, AVX-512, 30 layers of the 135M shape's attention alone,
// 513 visible slots): the value sums of a KV head's query rows held in registers over the chunk (`values_chunk`,
// rather than each row's sums loaded and stored once per slot), the mask and max vectorized, the rows' sums of
// exponentials interleaved, and chunks of 128 slots rather than 64: 66 -> 38 us a layer with the cache in L3, 68 ->
// 53 us from DRAM (the prefetches below cost time when the lines are near, and save more when they are not).
constexpr int64_t kChunk = 128;
constexpr int64_t kAheadSlots = 24;

// e^x for x <= 0 (scores minus their max), to ~2 ulp: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r,
// times 2^n; below -87 it is 0. Scalar and AVX2 forms do the same float operations in the same order.
inline float exp_approx(float x) {
  if (x < -87.0f) return 0.0f;
  const float n = std::nearbyint(x * 1.44269504f);
  float r = std::fma(n, -0.693145752f, x);
  r = std::fma(n, -1.42860677e-06f, r);
  float p = 1.38888889e-03f;
  p = std::fma(p, r, 8.33333333e-03f);
  p = std::fma(p, r, 4.16666667e-02f);
  p = std::fma(p, r, 1.66666667e-01f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  return std::ldexp(p, static_cast<int>(n));
}

#ifdef CLM_AVX2
inline __m256 exp_approx8(__m256 x) {
  const __m256 dead = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145752f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-1.42860677e-06f), r);
  __m256 p = _mm256_set1_ps(1.38888889e-03f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.33333333e-03f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.16666667e-02f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.66666667e-01f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(dead, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

struct Fused {
  int64_t B, T, N, K, G, C, H, Hv, chunks;
  int64_t layer;
  float scale, softcap;
  bool has_sink;
  int64_t rows() const { return T * N; }  // softmax rows of one batch row: (t, n)
};

#ifdef CLM_AVX2
// Eight dot products at once, each summed exactly as `dot` sums one: a[s] holds slot s's 8 lanes; out[s] =
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) of a[s], computed for the eight together.
inline __m256 lanes_sum8(const __m256* a) {
  __m256 x[4];
  for (int p = 0; p < 4; ++p)  // [l0+l4, l1+l5, l2+l6, l3+l7] of a[2p] | of a[2p+1]
    x[p] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x31));
  // [(l0+l4)+(l2+l6), (l1+l5)+(l3+l7)] of a[0], a[2] | of a[1], a[3]; then of a[4], a[6] | a[5], a[7]
  const __m256 y0 = _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], 0x44), _mm256_shuffle_ps(x[0], x[1], 0xEE));
  const __m256 y1 = _mm256_add_ps(_mm256_shuffle_ps(x[2], x[3], 0x44), _mm256_shuffle_ps(x[2], x[3], 0xEE));
  const __m256 z = _mm256_hadd_ps(y0, y1);  // [s0, s2, s4, s6 | s1, s3, s5, s7]
  return _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// One query row's scores over eight slots (keys from kj, slot stride kstride), H % 8 == 0: s[u] = dot(qv, slot u).
inline void scores_row8(const float* qv, const float* kj, int64_t kstride, int64_t H, float* s) {
  __m256 a[8];
  for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
  for (int64_t i = 0; i < H; i += 8) {
    const __m256 x = _mm256_loadu_ps(qv + i);
    for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(x, _mm256_loadu_ps(kj + u * kstride + i), a[u]);
  }
  _mm256_storeu_ps(s, lanes_sum8(a));
}
#endif

#ifdef CLM_AVX2
// The values of NB rows (query heads of one KV head) over J slots, U vectors of 8 of Hv, the sums in registers:
// a[b][u] = fma(w[b, j], v[j, u], a[b][u]) for increasing j, skipping w = 0 (what `axpy` does per row and slot).
template <int NB, int U>
void values_block(const float* w, const float* v, int64_t vstride, int64_t J, float* acc, int64_t Hv) {
  __m256 a[NB][U];
  for (int b = 0; b < NB; ++b)
    for (int u = 0; u < U; ++u) a[b][u] = _mm256_loadu_ps(acc + b * Hv + 8 * u);
  for (int64_t j = 0; j < J; ++j) {
    const float* vj = v + j * vstride;
    for (int b = 0; b < NB; ++b) {
      const float wj = w[b * kChunk + j];
      if (wj == 0.0f) continue;
      const __m256 wv = _mm256_set1_ps(wj);
      for (int u = 0; u < U; ++u) a[b][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vj + 8 * u), a[b][u]);
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int u = 0; u < U; ++u) _mm256_storeu_ps(acc + b * Hv + 8 * u, a[b][u]);
}

#ifdef CLM_AVX512
// values_block in 16 lanes, on a CPU with AVX-512: each output element's chain of fused multiply-adds is the same,
// so its bits are too (a test compares with the AVX2 build); half the instructions. The 135M shape's attention
// alone, Intel Xeon (family 6 model 207), batch 1, 530 visible slots, alternated in one process: 37.2 -> 33.3 us a
// layer with the cache in L2, 88.0 -> 82.6 from DRAM; batch 8 from DRAM 540 -> 507.
template <int NB, int U>
void values_block16(const float* w, const float* v, int64_t vstride, int64_t J, float* acc, int64_t Hv) {
  __m512 a[NB][U];
  for (int b = 0; b < NB; ++b)
    for (int u = 0; u < U; ++u) a[b][u] = _mm512_loadu_ps(acc + b * Hv + 16 * u);
  for (int64_t j = 0; j < J; ++j) {
    const float* vj = v + j * vstride;
    for (int b = 0; b < NB; ++b) {
      const float wj = w[b * kChunk + j];
      if (wj == 0.0f) continue;
      const __m512 wv = _mm512_set1_ps(wj);
      for (int u = 0; u < U; ++u) a[b][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(vj + 16 * u), a[b][u]);
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int u = 0; u < U; ++u) _mm512_storeu_ps(acc + b * Hv + 16 * u, a[b][u]);
}
#endif

template <int NB>
void values_rows(const float* w, const float* v, int64_t vstride, int64_t J, float* acc, int64_t Hv) {
  int64_t h = 0;
#ifdef CLM_AVX512
  for (; h + 64 <= Hv; h += 64) values_block16<NB, 4>(w, v + h, vstride, J, acc + h, Hv);
  for (; h + 16 <= Hv; h += 16) values_block16<NB, 1>(w, v + h, vstride, J, acc + h, Hv);
#endif
  for (; h + 32 <= Hv; h += 32) values_block<NB, 4>(w, v + h, vstride, J, acc + h, Hv);
  for (; h < Hv; h += 8) values_block<NB, 1>(w, v + h, vstride, J, acc + h, Hv);
}

// The values of a chunk, Hv % 8 == 0: per (query t, KV head kh) its G rows in blocks of up to 3, each block's sums
// held in registers over the chunk's slots (the rows' v read from L1, not their sums from memory once per slot).
void values_chunk(const Fused& d, const float* scores, const float* v0, int64_t J, float* acc) {
  const int64_t vstride = d.K * d.Hv;
  for (int64_t t = 0; t < d.T; ++t)
    for (int64_t kh = 0; kh < d.K; ++kh)
      for (int64_t g = 0; g < d.G;) {
        const int64_t r = t * d.N + kh * d.G + g, nb = std::min<int64_t>(3, d.G - g);
        const float* w = scores + r * kChunk;
        const float* v = v0 + kh * d.Hv;
        float* a = acc + r * d.Hv;
        if (nb == 3)
          values_rows<3>(w, v, vstride, J, a, d.Hv);
        else if (nb == 2)
          values_rows<2>(w, v, vstride, J, a, d.Hv);
        else
          values_rows<1>(w, v, vstride, J, a, d.Hv);
        g += nb;
      }
}
#endif

#ifdef CLM_AVX512
// The scores of eight slots (keys from kj, slot stride kstride) for every row of batch row b, H % 8 == 0, on a CPU with
// AVX-512: two rows that read the same KV head share each instruction, one in each 256-bit half, both halves
// multiplying the same keys; each half is the 8-lane chain the AVX2 path runs for its row, so the same bits with
// half the multiply-adds and one load of each key vector for two rows. A KV head's rows are taken in (t, g) order in
// pairs; an odd one left over takes the AVX2 form.
inline void scores_kv_pairs(const Fused& d, const float* q, const float* kj, int64_t kstride, int64_t b, float* s) {
  const int64_t per = d.T * d.G;  // rows per KV head
  auto row = [&](int64_t kh, int64_t i) { return (i / d.G) * d.N + kh * d.G + i % d.G; };  // r = t * N + n
  for (int64_t kh = 0; kh < d.K; ++kh) {
    const float* kk = kj + kh * d.H;
    int64_t i = 0;
    for (; i + 2 <= per; i += 2) {
      const int64_t r0 = row(kh, i), r1 = row(kh, i + 1);
      const float* q0 = q + (b * d.T * d.N + r0) * d.H;
      const float* q1 = q + (b * d.T * d.N + r1) * d.H;
      __m512 a[8];
      for (int u = 0; u < 8; ++u) a[u] = _mm512_setzero_ps();
      for (int64_t h = 0; h < d.H; h += 8) {
        const __m512 x = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(q0 + h)), _mm256_loadu_ps(q1 + h), 1);
        for (int u = 0; u < 8; ++u)
          a[u] = _mm512_fmadd_ps(x, _mm512_broadcast_f32x8(_mm256_loadu_ps(kk + u * kstride + h)), a[u]);
      }
      __m256 lo[8], hi[8];
      for (int u = 0; u < 8; ++u) lo[u] = _mm512_castps512_ps256(a[u]), hi[u] = _mm512_extractf32x8_ps(a[u], 1);
      _mm256_storeu_ps(s + r0 * kChunk, lanes_sum8(lo));
      _mm256_storeu_ps(s + r1 * kChunk, lanes_sum8(hi));
    }
    if (i < per) {
      const int64_t r = row(kh, i);
      scores_row8(q + (b * d.T * d.N + r) * d.H, kk, kstride, d.H, s + r * kChunk);
    }
  }
}
#endif

// Row-wise sums s[r * kChunk + 0..J-1] (increasing j) into l[0..R-1], NR rows' chains interleaved in registers.
template <int NR>
inline void exp_sums_block(const float* s, int64_t J, float* l) {
  float a[NR];
  for (int b = 0; b < NR; ++b) a[b] = l[b];
  for (int64_t j = 0; j < J; ++j)
    for (int b = 0; b < NR; ++b) a[b] += s[b * kChunk + j];
  for (int b = 0; b < NR; ++b) l[b] = a[b];
}

inline void exp_sums(const float* s, int64_t R, int64_t J, float* l) {
  int64_t r = 0;
  for (; r + 8 <= R; r += 8) exp_sums_block<8>(s + r * kChunk, J, l + r);
  for (; r + 4 <= R; r += 4) exp_sums_block<4>(s + r * kChunk, J, l + r);
  for (; r < R; ++r) exp_sums_block<1>(s + r * kChunk, J, l + r);
}

// The slots of row b's chunk c that some query row sees: [lo, hi] within the chunk (hi < lo: none).
inline void visible_range(const Fused& d, const bool* visible, int64_t b, int64_t c, int64_t& lo, int64_t& hi) {
  lo = kChunk, hi = -1;
  const int64_t c0 = c * kChunk, n = std::min(kChunk, d.C - c0);
  for (int64_t t = 0; t < d.T; ++t) {
    const bool* vis = visible + (b * d.T + t) * d.C + c0;
    int64_t j = 0;
    while (j < std::min(n, lo) && !vis[j]) ++j;
    lo = std::min(lo, j);
    j = n - 1;
    while (j > hi && !vis[j]) --j;
    hi = std::max(hi, j);
  }
}

// The cache buffers' own layout: slot j of row b's layer at k + ((layer * B + b) * C + j) * K * H (and so for v), read
// where it lies, its keys prefetched ahead.
struct InPlace {
  static constexpr bool kFar = true;
  const float *k, *v;
  void operator()(const Fused& d, int64_t b, int64_t j0, int64_t, const float*& k0, const float*& v0) const {
    k0 = k + ((d.layer * d.B + b) * d.C + j0) * d.K * d.H;
    v0 = v + ((d.layer * d.B + b) * d.C + j0) * d.K * d.Hv;
  }
};

// A paged pool [L, P, ps, K, H] read through a page table [B, NP] (causal_lm/model/paged_cache.py): slot j of row b
// is slot j % ps of page table[b, j / ps]; an entry outside [0, P) is a missing page, whose keys and values are zeros
// (the XLA gather's fill); int8 entries are times their float32 scales [L, P, ps, K] (float(x) * scale, as
// `PagedKVCache.update` dequantizes). A chunk's visible slots are copied, page run by page run, into the thread's
// buffers in the cache's layout, and `chunk_item` sums them there exactly as it sums a contiguous cache's.
template <typename E>
struct Gathered {
  static constexpr bool kFar = false;  // the buffers were just written: nothing to prefetch
  const E *k, *v;
  const float *ks, *vs;  // int8: the scales
  const int32_t* table;
  int64_t P, ps, NP;

  // n slots from pool slot `slot` ((layer * P + page) * ps + offset) of K heads of w elements into dst.
  void copy(const E* src, const float* scale, int64_t slot, int64_t n, int64_t K, int64_t w, float* dst) const {
    if constexpr (std::is_same_v<E, float>) {
      std::copy_n(src + slot * K * w, n * K * w, dst);
    } else {
      for (int64_t i = 0; i < n * K; ++i) {
        const float sc = scale[slot * K + i];
        const E* x = src + (slot * K + i) * w;
        for (int64_t h = 0; h < w; ++h) dst[i * w + h] = static_cast<float>(x[h]) * sc;
      }
    }
  }

  void operator()(const Fused& d, int64_t b, int64_t j0, int64_t J, const float*& k0, const float*& v0) const {
    thread_local std::vector<float> kb, vb;
    const int64_t kstride = d.K * d.H, vstride = d.K * d.Hv;
    kb.resize(static_cast<size_t>(J * kstride));
    vb.resize(static_cast<size_t>(J * vstride));
    for (int64_t j = 0; j < J;) {
      const int64_t at = j0 + j, offset = at % ps, n = std::min(J - j, ps - offset);
      const int64_t page = table[b * NP + at / ps];
      if (page < 0 || page >= P) {
        std::fill_n(kb.data() + j * kstride, n * kstride, 0.0f);
        std::fill_n(vb.data() + j * vstride, n * vstride, 0.0f);
      } else {
        const int64_t slot = (d.layer * P + page) * ps + offset;
        copy(k, ks, slot, n, d.K, d.H, kb.data() + j * kstride);
        copy(v, vs, slot, n, d.K, d.Hv, vb.data() + j * vstride);
      }
      j += n;
    }
    k0 = kb.data(), v0 = vb.data();
  }
};

// Row b, slots [c * kChunk, ...): per softmax row r = (t, n), its max m, sum of exponentials l and weighted sum of
// values acc [Hv] over the chunk's visible slots (m = -inf: none visible). `at(d, b, j0, J, k0, v0)` gives the keys
// and values of slots j0 .. j0 + J - 1 of row b as [J, K, H] and [J, K, Hv] blocks (`InPlace`, `Gathered`).
template <typename At>
void chunk_item(const Fused& d, const float* q, const At& at, const bool* visible, int64_t b, int64_t c, float* m,
                float* l, float* acc) {
  const int64_t R = d.rows();
  const float ninf = -std::numeric_limits<float>::infinity();
  // The slots read are the chunk's first to last visible one (of any query row): the slots outside that range would
  // add exponentials of 0 and no values, so leaving them out changes no bit, and the chunk holding the newest
  // position (a decode step's last chunk) reads only its filled part.
  int64_t lo, hi;
  visible_range(d, visible, b, c, lo, hi);
  std::fill_n(m, R, ninf);
  std::fill_n(l, R, 0.0f);
  std::fill_n(acc, R * d.Hv, 0.0f);
  if (hi < lo) return;  // no row sees a slot of the chunk
  const int64_t j0 = c * kChunk + lo, J = hi - lo + 1;
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(R * kChunk));
  const int64_t kstride = d.K * d.H, vstride = d.K * d.Hv;  // floats from one slot to the next
  const float *k0, *v0;
  at(d, b, j0, J, k0, v0);
  float* scores = scratch.data();  // scores[r * kChunk + j], r = t * N + n
#ifdef CLM_AVX2
  if (At::kFar)
    for (int64_t i = 0; i < kAheadSlots * kstride * 4; i += 64) _mm_prefetch(reinterpret_cast<const char*>(k0) + i, _MM_HINT_T1);
#endif
  // Keys: one pass over the chunk's contiguous [J, K, H] block in slot order, eight slots at a time.
  for (int64_t j = 0; j < J;) {
    const int64_t step = (CLM_VECTOR && d.H % 8 == 0 && j + 8 <= J) ? 8 : 1;
#ifdef CLM_AVX2
    // The hardware prefetchers stop at each 4 KiB page (5 slots of the 135M shape): ask for the keys kAheadSlots
    // slots ahead, and for these slots' values (read after the softmax), into L2. Measured on Zen 4, one core, the
    // 135M shape at context 512 with the cache in DRAM: 105 -> 87 us a layer (16 to 128 slots ahead: within noise).
    // On Zen 5 (30 layers, 530 of 648 slots visible, the distances alternated in one process) the nearer distance
    // wins: from DRAM 41.3 -> 38.0 us a layer at batch 1 and 286 -> 264 at batch 8 with 24 slots rather than 64 (16
    // and 32 about the same, 48 between), in L2 20.2 -> 19.8 and 252 -> 247; every line every 64 bytes (one
    // prefetch per 128 bytes: 14% slower).
    if (At::kFar && j % 8 == 0) {
      const char* kn = reinterpret_cast<const char*>(k0 + (j + kAheadSlots) * kstride);
      const char* vn = reinterpret_cast<const char*>(v0 + j * vstride);
      for (int64_t i = 0; i < 8 * kstride * 4; i += 64) _mm_prefetch(kn + i, _MM_HINT_T1);
      for (int64_t i = 0; i < 8 * vstride * 4; i += 64) _mm_prefetch(vn + i, _MM_HINT_T1);
    }
#endif
#ifdef CLM_AVX512
    // Two query rows per instruction (scores_kv_pairs): 1.5-4% faster a layer on Zen 5 (batch 8 from DRAM 253 ->
    // 249 us, batch 1 32.2 -> 31.0, batch 8 in L2 243 -> 237), the same bits.
    if (step == 8) {
      scores_kv_pairs(d, q, k0 + j * kstride, kstride, b, scores + j);
      j += step;
      continue;
    }
#endif
    for (int64_t t = 0; t < d.T; ++t)
      for (int64_t n = 0; n < d.N; ++n) {
        const float* qv = q + ((b * d.T + t) * d.N + n) * d.H;
        const float* kj = k0 + j * kstride + (n / d.G) * d.H;
        float* s = scores + (t * d.N + n) * kChunk + j;
#ifdef CLM_AVX2
        if (step == 8) {
          scores_row8(qv, kj, kstride, d.H, s);
          continue;
        }
#endif
        s[0] = dot(qv, kj, d.H);
      }
    j += step;
  }
  // The softmax's partial over the chunk, per row: scaled (capped) scores, masked, their max; then the exponentials.
  // A row that sees no slot of the chunk gets m = -inf, l = 0 and weights 0 (its values are never read).
  for (int64_t r = 0; r < R; ++r) {
    const bool* vis = visible + (b * d.T + r / d.N) * d.C + j0;
    float* s = scores + r * kChunk;
    float mr = ninf;
    int64_t j = 0;
#ifdef CLM_AVX2
    if (!(d.softcap > 0)) {  // the max does not depend on the order (x is never NaN-propagated: max_ps keeps mv)
      const __m256 sv = _mm256_set1_ps(d.scale), nv = _mm256_set1_ps(ninf);
      __m256 mv = nv;
      for (; j + 8 <= J; j += 8) {
        const __m256i seen = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(vis + j)));
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(seen, _mm256_setzero_si256()));
        const __m256 x = _mm256_blendv_ps(nv, _mm256_mul_ps(_mm256_loadu_ps(s + j), sv), keep);
        _mm256_storeu_ps(s + j, x);
        mv = _mm256_max_ps(x, mv);
      }
      alignas(32) float lane[8];
      _mm256_store_ps(lane, mv);
      for (float x : lane) mr = std::max(mr, x);
    }
#endif
    for (; j < J; ++j) {
      float x = s[j] * d.scale;
      if (d.softcap > 0) x = std::tanh(x / d.softcap) * d.softcap;
      s[j] = vis[j] ? x : ninf;
      mr = std::max(mr, s[j]);
    }
    m[r] = mr;
    if (mr == ninf) {
      std::fill_n(s, J, 0.0f);
      continue;
    }
    j = 0;
#ifdef CLM_AVX2
    const __m256 mv = _mm256_set1_ps(mr);
    for (; j + 8 <= J; j += 8) _mm256_storeu_ps(s + j, exp_approx8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv)));
#endif
    for (; j < J; ++j) s[j] = exp_approx(s[j] - mr);
  }
  // Each row's sum of exponentials in increasing slot order.
  exp_sums(scores, R, J, l);
  // Values: acc += w * v over the chunk's slots in increasing order, per output element.
#ifdef CLM_AVX2
  if (d.Hv % 8 == 0) {
    values_chunk(d, scores, v0, J, acc);
    return;
  }
#endif
  for (int64_t j = 0; j < J; ++j) {
    const float* vj = v0 + j * vstride;
    for (int64_t r = 0; r < R; ++r) {
      const float w = scores[r * kChunk + j];
      if (w != 0.0f) axpy(w, vj + ((r % d.N) / d.G) * d.Hv, acc + r * d.Hv, d.Hv);
    }
  }
}

// The whole attention of every row: its chunks' partial softmaxes (`chunk_item`, keys and values from `at`), then
// per output the partials merged in increasing chunk order with the sink. q [B, T, N, H], visible [B, T, C], sink
// [N] (read when d.has_sink), out [B, T, N, Hv].
template <typename At>
void attend_chunks(const Fused& d, ffi::ThreadPool& pool, const float* q, const At& at, const bool* vis,
                   const float* sink, float* out) {
  const int64_t R = d.rows(), parts = d.B * d.chunks;
  thread_local std::vector<float> partial;
  partial.resize(static_cast<size_t>(parts * R * (d.Hv + 2)));
  float *pm = partial.data(), *pl = pm + parts * R, *pa = pl + parts * R;
  // Work items are spans: runs of consecutive chunks of one row, ceil(threads / B) per row (at most its chunks), cut
  // where they hold about equal numbers of visible slots. A thread reads one span's keys and values as one run of
  // addresses (its key prefetches run on into the next chunk), rather than chunks taken in turn (the form before:
  // the 135M shape's attention alone, 30 layers from DRAM, Zen 5, batch 8 241 -> 218 us a layer, batch 1 the same).
  // Which thread computes a chunk changes no value.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t spans = std::min<int64_t>(d.chunks, (threads + d.B - 1) / d.B);
  std::vector<int64_t> cuts(static_cast<size_t>(d.B * (spans + 1)));  // row b's spans: chunks [cut s, cut s + 1)
  std::vector<int64_t> seen(static_cast<size_t>(d.chunks));
  for (int64_t b = 0; b < d.B; ++b) {
    int64_t total = 0;
    for (int64_t c = 0; c < d.chunks; ++c) {
      int64_t lo, hi;
      visible_range(d, vis, b, c, lo, hi);
      total += seen[c] = std::max<int64_t>(0, hi - lo + 1);
    }
    int64_t* cut = cuts.data() + b * (spans + 1);
    int64_t c = 0, sum = 0;
    cut[0] = 0;
    for (int64_t s = 1; s < spans; ++s) {  // span s - 1 takes the chunks whose middle is before s / spans of them
      while (c < d.chunks && (2 * sum + seen[c]) * spans <= 2 * s * total) sum += seen[c++];
      cut[s] = c;
    }
    cut[spans] = d.chunks;
  }
  causal_lm_native::parallel_for(d.B * spans, pool, [&d, &cuts, &at, spans, q, vis, pm, pl, pa, R](int64_t i) {
    const int64_t b = i / spans, *cut = cuts.data() + b * (spans + 1) + i % spans;
    for (int64_t c = cut[0]; c < cut[1]; ++c) {
      const int64_t x = b * d.chunks + c;
      chunk_item(d, q, at, vis, b, c, pm + x * R, pl + x * R, pa + x * R * d.Hv);
    }
  });
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t r = 0; r < R; ++r) {
      float* orow = out + (b * R + r) * d.Hv;
      float mr = d.has_sink ? sink[r % d.N] : ninf;
      for (int64_t c = 0; c < d.chunks; ++c) mr = std::max(mr, pm[(b * d.chunks + c) * R + r]);
      std::fill_n(orow, d.Hv, 0.0f);
      if (mr == ninf) continue;  // sees no slot and has no sink: zeros
      float lr = d.has_sink ? exp_approx(sink[r % d.N] - mr) : 0.0f;
      for (int64_t c = 0; c < d.chunks; ++c) {
        const int64_t x = (b * d.chunks + c) * R + r;
        if (pm[x] == ninf) continue;
        const float f = exp_approx(pm[x] - mr);
        lr = std::fma(f, pl[x], lr);
        axpy(f, pa + x * d.Hv, orow, d.Hv);
      }
      const float inv = 1.0f / std::max(lr, 1.17549435e-38f);
      for (int64_t h = 0; h < d.Hv; ++h) orow[h] *= inv;
    }
}

// A call's dimensions (q [B, T, N, H], C slots a row, K KV heads, Hv, L layers) and attributes into d, with the
// checks both whole-attention forms share: visible [B, T, C], sink [N] when there is one, the layer within [0, L).
ffi::Error dims(Fused& d, const std::string& name, ffi::Span<const int64_t> qd, int64_t C, int64_t K, int64_t Hv,
                int64_t L, ffi::Buffer<ffi::S32> layer, float scale, float softcap, int32_t has_sink,
                ffi::Buffer<ffi::PRED> visible, ffi::Buffer<ffi::F32> sink) {
  d.B = qd[0], d.T = qd[1], d.N = qd[2], d.H = qd[3], d.C = C, d.K = K, d.G = d.N / d.K, d.Hv = Hv;
  d.chunks = (d.C + kChunk - 1) / kChunk;
  d.layer = layer.typed_data()[0];
  d.scale = scale, d.softcap = softcap, d.has_sink = has_sink != 0;
  if (static_cast<int64_t>(visible.element_count()) != d.B * d.T * d.C || (d.has_sink && sink.element_count() != static_cast<size_t>(d.N)))
    return ffi::Error::InvalidArgument(name + ": visible [B, T, C], sink [N]");
  if (d.layer < 0 || d.layer >= L) return ffi::Error::InvalidArgument(name + ": layer out of range");
  return ffi::Error::Success();
}

ffi::Error Attention(ffi::ThreadPool pool, float scale, float softcap, int32_t has_sink, ffi::Buffer<ffi::F32> q,
                     ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer,
                     ffi::Buffer<ffi::PRED> visible, ffi::Buffer<ffi::F32> sink, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5 || kd[1] != qd[0] || vd[1] != qd[0] || kd[4] != qd[3] ||
      vd[0] != kd[0] || vd[2] != kd[2] || vd[3] != kd[3] || kd[3] < 1 || qd[2] % kd[3])
    return ffi::Error::InvalidArgument("decode_attention: q [B, T, N, H], k [L, B, C, K, H], v [L, B, C, K, Hv]");
  Fused d;
  if (ffi::Error e = dims(d, "decode_attention", qd, kd[2], kd[3], vd[4], kd[0], layer, scale, softcap, has_sink,
                          visible, sink);
      e.failure())
    return e;
  const bool* vis = reinterpret_cast<const bool*>(visible.untyped_data());
  attend_chunks(d, pool, q.typed_data(), InPlace{k.typed_data(), v.typed_data()}, vis, sink.typed_data(), out->typed_data());
  return ffi::Error::Success();
}

// Decode attention over a paged pool read through its page table (`Gathered`): the function of
// `causal_lm_decode_attention` over the rows' slot views [B, NP * ps] (paged_cache.PagedKVCache.attend), the same
// operations in the same order, so a paged row's output has the bits of the same row in a contiguous cache whose
// slot j holds what its view's slot j holds. k, v [L, P, ps, K, H / Hv] float32 or int8 (then k_scale, v_scale
// [L, P, ps, K]), table [B, NP] int32, visible [B, T, NP * ps].
ffi::Error PagedAttention(ffi::ThreadPool pool, float scale, float softcap, int32_t has_sink, ffi::Buffer<ffi::F32> q,
                          ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::F32> k_scale,
                          ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> table,
                          ffi::Buffer<ffi::PRED> visible, ffi::Buffer<ffi::F32> sink, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), td = table.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5 || td.size() != 2 || td[0] != qd[0] || kd[4] != qd[3] ||
      vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != kd[3] || kd[3] < 1 || qd[2] % kd[3])
    return ffi::Error::InvalidArgument("decode_attention_paged: q [B, T, N, H], k/v [L, P, ps, K, H], table [B, NP]");
  Fused d;
  if (ffi::Error e = dims(d, "decode_attention_paged", qd, td[1] * kd[2], kd[3], vd[4], kd[0], layer, scale, softcap,
                          has_sink, visible, sink);
      e.failure())
    return e;
  const bool* vis = reinterpret_cast<const bool*>(visible.untyped_data());
  const int32_t* tp = table.typed_data();
  if (k.element_type() == ffi::F32 && v.element_type() == ffi::F32) {
    const Gathered<float> at{static_cast<const float*>(k.untyped_data()), static_cast<const float*>(v.untyped_data()),
                             nullptr, nullptr, tp, kd[1], kd[2], td[1]};
    attend_chunks(d, pool, q.typed_data(), at, vis, sink.typed_data(), out->typed_data());
    return ffi::Error::Success();
  }
  if (k.element_type() == ffi::S8 && v.element_type() == ffi::S8) {
    if (static_cast<int64_t>(k_scale.element_count()) != kd[0] * kd[1] * kd[2] * kd[3] ||
        v_scale.element_count() != k_scale.element_count())
      return ffi::Error::InvalidArgument("decode_attention_paged: int8 storage needs scales [L, P, ps, K]");
    const Gathered<int8_t> at{static_cast<const int8_t*>(k.untyped_data()), static_cast<const int8_t*>(v.untyped_data()),
                              k_scale.typed_data(), v_scale.typed_data(), tp, kd[1], kd[2], td[1]};
    attend_chunks(d, pool, q.typed_data(), at, vis, sink.typed_data(), out->typed_data());
    return ffi::Error::Success();
  }
  return ffi::Error::InvalidArgument("decode_attention_paged: K/V storage must be float32 or int8");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(causal_lm_decode_attention_scores, Scores,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(causal_lm_decode_attention_values, Values,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(causal_lm_decode_attention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int32_t>("has_sink")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(causal_lm_decode_attention_paged, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int32_t>("has_sink")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

CLM_PARALLEL_STATE_SYMBOL
