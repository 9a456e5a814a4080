// The two products of decode attention over a cache read in place, for a few queries (causal_lm/model/kernels.py,
// `native_attention`): XLA:CPU runs them as small batched matmuls at a fifth of the memory bandwidth, and a decode
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
// threads; the AVX2 path and the scalar path (H or Hv not a multiple of 8) do exactly these operations.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CLM_AVX2 1
#endif

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

// Items 0..n-1 on the caller and XLA's pool; the caller waits only for items already running (no deadlock when the
// pool is busy or the caller is one of its threads).
template <typename F>
void parallel_items(int64_t n, ffi::ThreadPool& pool, F fn) {
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto s = std::make_shared<Shared>();
  auto work = [s, n, fn] {
    for (int64_t i; (i = s->next.fetch_add(1)) < n;) {
      fn(i);
      s->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), n) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work(); });
  work();
  while (s->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

ffi::Error Scores(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                  ffi::ResultBuffer<ffi::F32> s) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || qd[0] != kd[0] || qd[3] != kd[3] || kd[2] < 1 || qd[2] % kd[2])
    return ffi::Error::InvalidArgument("decode_attention_scores: q [B, T, K * G, H], k [B, S, K, H]");
  const Dims d{qd[0], qd[1], qd[2], kd[2], qd[2] / kd[2], kd[1], qd[3], 0};
  const float *qp = q.typed_data(), *kp = k.typed_data();
  float* sp = s->typed_data();
  parallel_items(d.B * d.K, pool, [&d, qp, kp, sp](int64_t i) { scores_item(d, qp, kp, sp, i / d.K, i % d.K); });
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
  parallel_items(d.B * d.K, pool, [&d, wp, vp, op](int64_t i) { values_item(d, wp, vp, op, i / d.K, i % d.K); });
  return ffi::Error::Success();
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
