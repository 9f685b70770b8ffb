// One decoding step (one new token a row) of one Llama-family layer on the CPU, float32.
//
// The same arithmetic as trainer/inference/cpu.py's `_block` at S = 1, with everything between the four
// matrix products done in one pass over each row instead of ~25 separate torch ops (each a dispatch,
// an allocation and a trip through memory: at batch 64 they cost more than the products). The
// products are gemm.h's dot form on the weights as the model stores them ([out, in]): nothing is
// transposed or packed per call. Results agree with `_block` up to float rounding; tests/test_fastgen.py
// checks that, and greedy tokens identical to HF `generate`'s through it.
//
// Built on first use by trainer/kernels.py (torch.utils.cpp_extension), registered as
// torch.ops.posttrain.decode_layer.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "gemm.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

using posttrain::gemm_nt;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kRowGrain = 8;  // rows a thread takes at least

float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  Vec acc(0.f);
  for (; i + Vec::size() <= n; i += Vec::size()) {
    acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// out = x / sqrt(mean(x^2) + eps) * w, as F.rms_norm computes it in float32.
void rms_norm(const float* x, const float* w, double eps, float* out, int64_t n) {
  float ss = dot(x, x, n);
  float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
  int64_t i = 0;
  Vec vinv(inv);
  for (; i + Vec::size() <= n; i += Vec::size()) {
    (Vec::loadu(x + i) * vinv * Vec::loadu(w + i)).store(out + i);
  }
  for (; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// HF's rotate-half rotary on one head vector, in place: x * cos + roll(x, hd / 2) * signed_sin.
void rotate(float* x, const float* cos, const float* sin, int64_t hd, float* tmp) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) tmp[i] = x[i] * cos[i] + x[i + half] * sin[i];
  for (int64_t i = half; i < hd; ++i) tmp[i] = x[i] * cos[i] + x[i - half] * sin[i];
  for (int64_t i = 0; i < hd; ++i) x[i] = tmp[i];
}

// Scores of one query over keys [t0, t0 + NV * W) of a transposed cache KT [hd, T]: s[t] = sum_d q[d] *
// KT[d, t]. NV vector accumulators stay in registers across the sweep over d (one independent chain
// each); only the first n_keys - t0 are stored. Loads stop at the row's end T.
template <int NV>
void scores_block(const float* q, const float* KT, int64_t T, int64_t hd, int64_t t0, int64_t n_keys, float* s) {
  constexpr int64_t W = Vec::size();
  Vec acc[NV];
  int64_t load[NV];
  bool full = true;
  for (int v = 0; v < NV; ++v) {
    acc[v] = Vec(0.f);
    load[v] = std::min<int64_t>(W, T - (t0 + v * W));
    full = full && load[v] == W;
  }
  const float* k = KT + t0;
  if (full) {
    for (int64_t d = 0; d < hd; ++d, k += T) {
      const Vec qd(q[d]);
      for (int v = 0; v < NV; ++v) acc[v] = at::vec::fmadd(qd, Vec::loadu(k + v * W), acc[v]);
    }
  } else {
    for (int64_t d = 0; d < hd; ++d, k += T) {
      const Vec qd(q[d]);
      for (int v = 0; v < NV; ++v) acc[v] = at::vec::fmadd(qd, Vec::loadu(k + v * W, load[v]), acc[v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t n = std::min<int64_t>(W, n_keys - (t0 + v * W));
    if (n == W) {
      acc[v].store(s + t0 + v * W);
    } else {
      acc[v].store(s + t0 + v * W, n);
    }
  }
}

void scores(const float* q, const float* KT, int64_t T, int64_t hd, int64_t n_keys, float* s) {
  constexpr int64_t W = Vec::size();
  for (int64_t t0 = 0; t0 < n_keys; t0 += 4 * W) {
    switch (std::min<int64_t>(4, (n_keys - t0 + W - 1) / W)) {  // vectors left, the last one maybe partial
      case 4: scores_block<4>(q, KT, T, hd, t0, n_keys, s); break;
      case 3: scores_block<3>(q, KT, T, hd, t0, n_keys, s); break;
      case 2: scores_block<2>(q, KT, T, hd, t0, n_keys, s); break;
      default: scores_block<1>(q, KT, T, hd, t0, n_keys, s); break;
    }
  }
}

// out[d0 : d0 + NV * W] = sum_t p[t] * V[t, d0 : ...] with the NV output vectors held in registers
// across the sweep over t (V [n_keys, hd] row-major; a zero weight is skipped).
template <int NV>
void weighted_rows_block(const float* p, const float* V, int64_t hd, int64_t n_keys, int64_t d0, float* out) {
  constexpr int64_t W = Vec::size();
  Vec acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = Vec(0.f);
  const float* row = V + d0;
  for (int64_t t = 0; t < n_keys; ++t, row += hd) {
    if (p[t] == 0.f) continue;
    const Vec pt(p[t]);
    for (int v = 0; v < NV; ++v) acc[v] = at::vec::fmadd(pt, Vec::loadu(row + v * W), acc[v]);
  }
  for (int v = 0; v < NV; ++v) acc[v].store(out + d0 + v * W);
}

void weighted_rows(const float* p, const float* V, int64_t hd, int64_t n_keys, float* out) {
  constexpr int64_t W = Vec::size();
  int64_t d0 = 0;
  for (; d0 + 4 * W <= hd; d0 += 4 * W) weighted_rows_block<4>(p, V, hd, n_keys, d0, out);
  switch ((hd - d0) / W) {
    case 3: weighted_rows_block<3>(p, V, hd, n_keys, d0, out); d0 += 3 * W; break;
    case 2: weighted_rows_block<2>(p, V, hd, n_keys, d0, out); d0 += 2 * W; break;
    case 1: weighted_rows_block<1>(p, V, hd, n_keys, d0, out); d0 += W; break;
    default: break;
  }
  for (; d0 < hd; ++d0) {  // a head_dim that is not a multiple of the vector width
    float acc = 0.f;
    for (int64_t t = 0; t < n_keys; ++t) acc += p[t] * V[t * hd + d0];
    out[d0] = acc;
  }
}

void check(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "decode_layer: ", name, " must be a contiguous float32 CPU tensor");
}

// h [B, H] is updated in place (the layer's residual stream); k/v of the new token are written at
// column `col` of kc [B, kv_heads, hd, T] (keys stored transposed, so that a query's scores over the
// cache are one vector sweep a dimension, not a horizontal sum a key) and vc [B, kv_heads, T, hd];
// valid [B, T] (bool) says which cache columns a row attends (pads do not); cos / sin [positions, hd]
// are the rotary tables (sin with rotate-half's sign), read at each row's `positions` entry.
void decode_layer(const at::Tensor& h, const at::Tensor& ln1, double eps1, const at::Tensor& wq, const at::Tensor& wk,
                  const at::Tensor& wv, const std::optional<at::Tensor>& bq, const std::optional<at::Tensor>& bk,
                  const std::optional<at::Tensor>& bv, const at::Tensor& wo, const std::optional<at::Tensor>& bo,
                  const at::Tensor& ln2, double eps2, const at::Tensor& wg, const at::Tensor& wu, const at::Tensor& wd,
                  const std::optional<at::Tensor>& qn, double qn_eps, const std::optional<at::Tensor>& kn,
                  double kn_eps, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                  const at::Tensor& kc, const at::Tensor& vc, int64_t col, const at::Tensor& valid, double scaling,
                  int64_t heads, int64_t kv_heads) {
  for (auto& [t, name] : {std::pair{&h, "h"}, {&ln1, "ln1"}, {&wq, "wq"}, {&wk, "wk"}, {&wv, "wv"}, {&wo, "wo"},
                          {&ln2, "ln2"}, {&wg, "wg"}, {&wu, "wu"}, {&wd, "wd"}, {&cos, "cos"}, {&sin, "sin"},
                          {&kc, "kc"}, {&vc, "vc"}}) {
    check(*t, name);
  }
  for (auto& [t, name] : {std::pair{&bq, "bq"}, {&bk, "bk"}, {&bv, "bv"}, {&bo, "bo"}}) {
    if (t->has_value()) check(**t, name);
  }
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.is_contiguous(), "decode_layer: valid must be contiguous bool");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "decode_layer: positions must be contiguous int64");
  const int64_t B = h.size(0), H = h.size(1), hd = kc.size(2), T = kc.size(3);
  const int64_t groups = heads / kv_heads, I = wg.size(0), Tv = valid.size(1), P = cos.size(0);
  // weights as a Linear stores them, [out, in]
  TORCH_CHECK(col < T && col < Tv && kc.size(0) == B && valid.size(0) == B && positions.size(0) == B &&
              vc.size(2) == T && vc.size(3) == hd && cos.size(1) == hd && sin.size(0) == P &&
              wq.size(0) == heads * hd && wk.size(0) == kv_heads * hd && wv.size(0) == kv_heads * hd &&
              wq.size(1) == H && wk.size(1) == H && wv.size(1) == H && wo.size(0) == H && wo.size(1) == heads * hd &&
              wu.size(0) == I && wg.size(1) == H && wu.size(1) == H && wd.size(0) == H && wd.size(1) == I &&
              (!bq.has_value() || bq->numel() == heads * hd) && (!bk.has_value() || bk->numel() == kv_heads * hd) &&
              (!bv.has_value() || bv->numel() == kv_heads * hd) && (!bo.has_value() || bo->numel() == H),
              "decode_layer: shapes disagree");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pos[b] >= 0 && pos[b] < P, "decode_layer: position ", pos[b], " is past the rotary table (", P, ")");
  }

  // attention half: norm, q/k/v, rotary, cache write, attention over the cache
  at::Tensor x = at::empty({B, H}, h.options());
  float* hp = h.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  const float* l1 = ln1.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) rms_norm(hp + b * H, l1, eps1, xp + b * H, H);
  const int64_t width = (heads + 2 * kv_heads) * hd;
  at::Tensor qkv = at::empty({B, width}, h.options());
  {
    float* out = qkv.data_ptr<float>();
    auto bias = [](const std::optional<at::Tensor>& b) { return b.has_value() ? b->data_ptr<float>() : nullptr; };
    gemm_nt(xp, H, wq.data_ptr<float>(), H, bias(bq), out, width, B, heads * hd, H);
    gemm_nt(xp, H, wk.data_ptr<float>(), H, bias(bk), out + heads * hd, width, B, kv_heads * hd, H);
    gemm_nt(xp, H, wv.data_ptr<float>(), H, bias(bv), out + (heads + kv_heads) * hd, width, B, kv_heads * hd, H);
  }
  float* qp = qkv.data_ptr<float>();
  float* kcp = kc.data_ptr<float>();
  float* vcp = vc.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const bool* vp = valid.data_ptr<bool>();
  at::Tensor o = at::empty({B, heads * hd}, h.options());
  float* op = o.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  const float ninf = -std::numeric_limits<float>::infinity();
  // rows are independent: torch's thread pool shares them out (its own OpenMP runtime)
  at::parallel_for(0, B, kRowGrain, [&](int64_t lo, int64_t hi) {
  std::vector<float> tmp(hd), probs(static_cast<size_t>(groups) * (col + 1));
  for (int64_t b = lo; b < hi; ++b) {
    float* row = qp + b * width;
    if (qn.has_value()) {
      const float* qw = qn->data_ptr<float>();
      for (int64_t n = 0; n < heads; ++n) rms_norm(row + n * hd, qw, qn_eps, row + n * hd, hd);
    }
    if (kn.has_value()) {
      const float* kw = kn->data_ptr<float>();
      for (int64_t n = heads; n < heads + kv_heads; ++n) rms_norm(row + n * hd, kw, kn_eps, row + n * hd, hd);
    }
    const float* cb = cp + pos[b] * hd;
    const float* sb = sp + pos[b] * hd;
    for (int64_t n = 0; n < heads + kv_heads; ++n) rotate(row + n * hd, cb, sb, hd, tmp.data());
    const bool* vis = vp + b * Tv;
    const int64_t n_keys = col + 1;
    for (int64_t j = 0; j < kv_heads; ++j) {
      float* KT = kcp + (b * kv_heads + j) * hd * T;  // [hd, T]
      float* V = vcp + (b * kv_heads + j) * T * hd;   // [T, hd]
      const float* knew = row + (heads + j) * hd;
      const float* vnew = row + (heads + kv_heads + j) * hd;
      for (int64_t d = 0; d < hd; ++d) {
        KT[d * T + col] = knew[d];
        V[col * hd + d] = vnew[d];
      }
      for (int64_t g = 0; g < groups; ++g) {
        const float* q = row + (j * groups + g) * hd;
        float* s = probs.data() + g * n_keys;
        scores(q, KT, T, hd, n_keys, s);
        float mx = ninf;
        for (int64_t t = 0; t < n_keys; ++t) {
          s[t] = vis[t] ? s[t] * scale : ninf;
          mx = std::max(mx, s[t]);
        }
        // softmax over the visible columns (the new token's own column always is)
        at::vec::map([mx](Vec v) { return (v - Vec(mx)).exp(); }, s, s, n_keys);
        float total = 0.f;
        for (int64_t t = 0; t < n_keys; ++t) total += s[t];
        const float inv = 1.f / total;
        for (int64_t t = 0; t < n_keys; ++t) s[t] *= inv;
        weighted_rows(s, V, hd, n_keys, op + b * heads * hd + (j * groups + g) * hd);
      }
    }
  }
  });
  at::Tensor proj = at::empty({B, H}, h.options());
  gemm_nt(op, heads * hd, wo.data_ptr<float>(), heads * hd, bo.has_value() ? bo->data_ptr<float>() : nullptr,
          proj.data_ptr<float>(), H, B, H, heads * hd);
  h.add_(proj);

  // MLP half: norm, gate/up, silu(gate) * up, down
  const float* l2 = ln2.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) rms_norm(hp + b * H, l2, eps2, xp + b * H, H);
  at::Tensor gu = at::empty({B, 2 * I}, h.options());
  gemm_nt(xp, H, wg.data_ptr<float>(), H, nullptr, gu.data_ptr<float>(), 2 * I, B, I, H);
  gemm_nt(xp, H, wu.data_ptr<float>(), H, nullptr, gu.data_ptr<float>() + I, 2 * I, B, I, H);
  at::Tensor act = at::empty({B, I}, h.options());
  float* gp = gu.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  at::parallel_for(0, B, kRowGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const float* gate = gp + b * 2 * I;
      const float* up = gate + I;
      float* a = ap + b * I;
      // silu(g) = g / (1 + exp(-g)), as torch's CPU kernel computes it
      at::vec::map2([](Vec g, Vec u) { return g / (Vec(1.f) + g.neg().exp()) * u; }, a, gate, up, I);
    }
  });
  gemm_nt(ap, I, wd.data_ptr<float>(), I, nullptr, proj.data_ptr<float>(), H, B, H, I);
  h.add_(proj);
}

// One sampled token a row of logits [B, V] at temperature T > 0, and its log-probability under the
// unmasked softmax(logits / T), as fastgen's torch-op path computes them: the probabilities
// softmax(logits / T) (EOS's set to 0 while `block_eos`), their cumulative sum in float64, and the
// first index whose cumulative sum exceeds u[b] times the total (u [B] float64 in [0, 1)). One pass a
// row instead of ~10 ops a decoding step.
std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits, double temperature, int64_t eos,
                                               bool block_eos, const at::Tensor& u) {
  check(logits, "logits");
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.is_contiguous() && u.dim() == 1 && logits.dim() == 2 &&
              u.size(0) == logits.size(0), "sample_rows: u must be contiguous float64 [rows]");
  TORCH_CHECK(temperature > 0, "sample_rows: temperature must be > 0 (greedy decoding takes the argmax)");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(eos >= 0 && eos < V, "sample_rows: eos ", eos, " is outside the vocabulary (", V, ")");
  at::Tensor tokens = at::empty({B}, logits.options().dtype(at::kLong));
  at::Tensor logp = at::empty({B}, logits.options());
  const float* lp = logits.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* op = logp.data_ptr<float>();
  const float temp = static_cast<float>(temperature);
  at::parallel_for(0, B, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> x(V), e(V);
    std::vector<double> cdf(V);
    for (int64_t b = lo; b < hi; ++b) {
      const float* row = lp + b * V;
      // the maximum the sampling softmax subtracts (EOS left out while held back, as torch's masked
      // softmax does), and the full row's for the log-probability
      float mx = -std::numeric_limits<float>::infinity(), smx = mx;
      for (int64_t v = 0; v < V; ++v) {
        x[v] = row[v] / temp;
        mx = std::max(mx, x[v]);
        if (!(block_eos && v == eos)) smx = std::max(smx, x[v]);
      }
      float total = 0.f, stotal = 0.f;  // sum exp(x - mx), and the sampling distribution's sum exp(x - smx)
      for (int64_t v = 0; v < V; ++v) {
        e[v] = (block_eos && v == eos) ? 0.f : std::exp(x[v] - smx);
        stotal += e[v];
      }
      if (smx == mx) {
        total = stotal + (block_eos ? std::exp(x[eos] - mx) : 0.f);
      } else {  // EOS alone is the row's maximum: the log-probability's sum needs its own shift
        for (int64_t v = 0; v < V; ++v) total += std::exp(x[v] - mx);
      }
      const float lse = mx + std::log(total);
      double run = 0.0;
      for (int64_t v = 0; v < V; ++v) {
        run += static_cast<double>(e[v] / stotal);
        cdf[v] = run;
      }
      const double target = up[b] * cdf[V - 1];
      const int64_t tok = std::upper_bound(cdf.begin(), cdf.end(), target) - cdf.begin();
      tp[b] = std::min(tok, V - 1);
      op[b] = x[tp[b]] - lse;
    }
  });
  return {tokens, logp};
}

}  // namespace

TORCH_LIBRARY(posttrain, m) {
  m.def("decode_layer", &decode_layer);
  m.def("sample_rows", &sample_rows);
}
