// Decode attention over a paged KV pool, read in place through the page table (causal_lm/model/paged_cache.py).
//
// The XLA form gathers each row's pages into a fresh [B, NP * page_size, K, H] copy per layer and then runs the
// score and value products over that copy; this kernel reads each visible key and value once, where it lies in the
// pool. The function is the one of kernels.py (`masked_softmax` and the grouped products):
//
//   out[b, t, n] = sum_s w[b, t, n, s] * v[b, s, n / G]
//   w = softmax_s(score) over the visible slots s (+ the sink logit in the denominator), float32
//   score = q[b, t, n] . k[b, s, n / G] * scale   (then softcap * tanh(score / softcap) when softcap > 0)
//
// where slot s of row b is slot s % page_size of page table[b, s / page_size] of the layer, `visible` [B, T, S] is
// the one mask function's output (computed in JAX: this kernel does no position arithmetic), a row that sees no key
// gets zeros (without a sink), and a page index outside [0, P) is a missing page (zero key and value, as the XLA
// gather's fill). int8 storage: each stored vector times its float32 scale [L, P, page_size, K].
//
// Each (row, KV head) is one work item, computed the same way whatever the other rows are (no cross-row blocking),
// so a row's result does not depend on the batch. Items are shared out over XLA's intra-op thread pool (parallel.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kMaskValue = -1e30f;  // kernels.MASK_VALUE

// Scores, softmax and the weighted sum of values are accumulated in double and rounded to float32 once: the result
// is then within an ulp or two of the exact value whatever the summation order, so the XLA forms it replaces (whose
// float32 sums run in their own orders) and this kernel agree as closely as two orders of float32 sums can.
// Keys stored as float32 or int8 (the int8 scale is applied by the caller).
template <typename K>
inline double Dot(const float* a, const K* b, int64_t n) {
  double p[4] = {0, 0, 0, 0};
  int64_t h = 0;
  for (; h + 4 <= n; h += 4)
    for (int i = 0; i < 4; ++i) p[i] += static_cast<double>(a[h + i]) * static_cast<double>(b[h + i]);
  double s = (p[0] + p[2]) + (p[1] + p[3]);
  for (; h < n; ++h) s += static_cast<double>(a[h]) * static_cast<double>(b[h]);
  return s;
}

inline void Axpy(double w, const float* x, double* y, int64_t n) {
  for (int64_t h = 0; h < n; ++h) y[h] += w * static_cast<double>(x[h]);
}

inline void Axpy(double w, const int8_t* x, double* y, int64_t n) {
  for (int64_t h = 0; h < n; ++h) y[h] += w * static_cast<double>(x[h]);
}

struct Shapes {
  int64_t B, T, N, H, Hv, K, G, P, ps, NP, S;
  int64_t layer;
  float scale, softcap;
  bool has_sink;
};

// One (row b, KV head kh): every query t of the row and every query head of the group.
template <typename E>
void Item(const Shapes& d, int64_t b, int64_t kh, const float* q, const E* k, const E* v, const float* ks,
          const float* vs, const int32_t* table, const bool* visible, const float* sink, float* out,
          std::vector<double>& scores, std::vector<int32_t>& slots) {
  const int64_t TG = d.T * d.G;
  const int64_t layer_slots = d.P * d.ps;
  // The slots any query of the row sees, as pool slot indices (-1: a missing page).
  slots.clear();
  std::vector<int64_t> cols;
  cols.reserve(d.S);
  for (int64_t s = 0; s < d.S; ++s) {
    bool any = false;
    for (int64_t t = 0; t < d.T; ++t) any |= visible[(b * d.T + t) * d.S + s];
    if (!any) continue;
    const int32_t page = table[b * d.NP + s / d.ps];
    slots.push_back(page >= 0 && page < d.P ? static_cast<int32_t>(page * d.ps + s % d.ps) : -1);
    cols.push_back(s);
  }
  const int64_t V = static_cast<int64_t>(slots.size());
  scores.assign(static_cast<size_t>(TG * std::max<int64_t>(V, 1)), 0.0);
  for (int64_t i = 0; i < V; ++i) {
    const int64_t slot = slots[i];
    if (slot < 0) continue;  // a missing page's key is zero: score 0
    const int64_t at = (d.layer * layer_slots + slot) * d.K + kh;
    const E* key = k + at * d.H;
    const double kscale = ks ? ks[at] : 1.0;
    for (int64_t t = 0; t < d.T; ++t)
      for (int64_t g = 0; g < d.G; ++g) {
        const float* qv = q + ((b * d.T + t) * d.N + kh * d.G + g) * d.H;
        scores[(t * d.G + g) * V + i] = Dot(qv, key, d.H) * kscale * d.scale;
      }
  }
  std::vector<double> acc(static_cast<size_t>(d.Hv));
  for (int64_t t = 0; t < d.T; ++t) {
    const bool* vis = visible + (b * d.T + t) * d.S;
    for (int64_t g = 0; g < d.G; ++g) {
      const int64_t n = kh * d.G + g;
      double* w = scores.data() + (t * d.G + g) * V;
      float* o = out + ((b * d.T + t) * d.N + n) * d.Hv;
      double m = kMaskValue;
      bool seen = false;
      for (int64_t i = 0; i < V; ++i) {
        if (d.softcap > 0) w[i] = std::tanh(w[i] / d.softcap) * d.softcap;
        if (vis[cols[i]]) {
          m = std::max(m, w[i]);
          seen = true;
        }
      }
      const double sink_logit = d.has_sink ? sink[n] : 0.0;
      if (d.has_sink) m = std::max(m, sink_logit);
      double denom = 0.0;
      for (int64_t i = 0; i < V; ++i) {
        w[i] = vis[cols[i]] ? std::exp(w[i] - m) : 0.0;
        denom += w[i];
      }
      if (d.has_sink) {
        denom += std::exp(sink_logit - m);
        denom = std::max(denom, 1.17549435e-38);
      } else if (!seen) {
        std::fill(o, o + d.Hv, 0.0f);
        continue;
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t i = 0; i < V; ++i) {
        if (w[i] == 0.0 || slots[i] < 0) continue;
        const int64_t at = (d.layer * layer_slots + slots[i]) * d.K + kh;
        Axpy(vs ? w[i] * vs[at] : w[i], v + at * d.Hv, acc.data(), d.Hv);
      }
      for (int64_t h = 0; h < d.Hv; ++h) o[h] = static_cast<float>(acc[h] / denom);
    }
  }
}

template <typename E>
ffi::Error Run(ffi::ThreadPool pool, const Shapes& d, const float* q, const E* k, const E* v, const float* ks,
               const float* vs, const int32_t* table, const bool* visible, const float* sink, float* out) {
  // Items (row, KV head) on the caller and XLA's pool (parallel.h), each thread with its own scratch.
  causal_lm_native::parallel_for(d.B * d.K, pool, [&](int64_t i) {
    thread_local std::vector<double> scores;
    thread_local std::vector<int32_t> slots;
    Item<E>(d, i / d.K, i % d.K, q, k, v, ks, vs, table, visible, sink, out, scores, slots);
  });
  return ffi::Error::Success();
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, float scale, float softcap, int32_t has_sink,
                              ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::F32> k_scale,
                              ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> table,
                              ffi::Buffer<ffi::PRED> visible, ffi::Buffer<ffi::F32> sink,
                              ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto vd = v.dimensions();
  auto td = table.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("paged_attention: q [B,T,N,H], k/v [L,P,ps,K,H], table [B,NP]");
  Shapes d;
  d.B = qd[0], d.T = qd[1], d.N = qd[2], d.H = qd[3];
  d.P = kd[1], d.ps = kd[2], d.K = kd[3], d.Hv = vd[4];
  d.NP = td[1], d.S = d.NP * d.ps;
  d.G = d.K ? d.N / d.K : 0;
  d.scale = scale, d.softcap = softcap, d.has_sink = has_sink != 0;
  d.layer = layer.typed_data()[0];
  if (kd[4] != d.H || d.K == 0 || d.N % d.K != 0 || td[0] != d.B || static_cast<int64_t>(visible.element_count()) != d.B * d.T * d.S)
    return ffi::Error::InvalidArgument("paged_attention: inconsistent shapes");
  if (d.layer < 0 || d.layer >= kd[0]) return ffi::Error::InvalidArgument("paged_attention: layer out of range");
  const bool* vis = reinterpret_cast<const bool*>(visible.untyped_data());
  if (k.element_type() == ffi::F32 && v.element_type() == ffi::F32)
    return Run<float>(pool, d, q.typed_data(), static_cast<const float*>(k.untyped_data()),
                      static_cast<const float*>(v.untyped_data()), nullptr, nullptr, table.typed_data(), vis,
                      sink.typed_data(), out->typed_data());
  if (k.element_type() == ffi::S8 && v.element_type() == ffi::S8) {
    if (static_cast<int64_t>(k_scale.element_count()) != kd[0] * d.P * d.ps * d.K ||
        v_scale.element_count() != k_scale.element_count())
      return ffi::Error::InvalidArgument("paged_attention: int8 storage needs scales [L, P, ps, K]");
    return Run<int8_t>(pool, d, q.typed_data(), static_cast<const int8_t*>(k.untyped_data()),
                       static_cast<const int8_t*>(v.untyped_data()), k_scale.typed_data(), v_scale.typed_data(),
                       table.typed_data(), vis, sink.typed_data(), out->typed_data());
  }
  return ffi::Error::InvalidArgument("paged_attention: K/V storage must be float32 or int8");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(causal_lm_paged_attention, PagedAttentionImpl,
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
