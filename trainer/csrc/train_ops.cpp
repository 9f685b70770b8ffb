// The elementwise pieces of a Llama-family layer's training forward and backward on the CPU, float32:
// RMSNorm, rotary embedding and SwiGLU, each one pass over its rows forward and one backward (torch
// runs each as 3 to 10 separate ops, every one a trip through memory, and autograd keeps their
// intermediates). The matrix products and attention stay torch's. trainer/fasttrain.py wraps them in
// autograd Functions; tests/test_fasttrain.py holds their gradients to torch's own.
//
// Built with decode_layer.cpp into one library by trainer/kernels.py (torch.ops.posttrain.*).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kGrain = 16;  // rows a thread takes at least

void check(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), op, ": ", name,
              " must be a contiguous float32 CPU tensor");
}

float sum_squares(const float* x, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec v = Vec::loadu(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// Sums per-thread partial rows [threads, n] into one [n] tensor.
at::Tensor reduce_partials(const at::Tensor& partials) { return partials.sum(0); }

// y = w * (x / sqrt(mean(x^2) + eps)) over the last dimension of x [R, H]; also 1 / sqrt(...) per row.
std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& w, double eps) {
  check(x, "rms_norm_fwd", "x");
  check(w, "rms_norm_fwd", "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0), "rms_norm_fwd: shapes disagree");
  const int64_t R = x.size(0), H = x.size(1);
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty({R}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* rp = rstd.data_ptr<float>();
  at::parallel_for(0, R, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* xr = xp + r * H;
      const float inv = 1.f / std::sqrt(sum_squares(xr, H) / static_cast<float>(H) + static_cast<float>(eps));
      rp[r] = inv;
      const Vec vinv(inv);
      at::vec::map2([vinv](Vec a, Vec b) { return b * (a * vinv); }, yp + r * H, xr, wp, H);
    }
  });
  return {y, rstd};
}

// Gradients of rms_norm_fwd: dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * w, xhat = x * rstd;
// dw = sum over rows of dy * xhat.
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                const at::Tensor& rstd) {
  for (auto& [t, name] : {std::pair{&dy, "dy"}, {&x, "x"}, {&w, "w"}, {&rstd, "rstd"}}) check(*t, "rms_norm_bwd", name);
  TORCH_CHECK(dy.sizes() == x.sizes() && x.dim() == 2 && rstd.size(0) == x.size(0) && w.size(0) == x.size(1),
              "rms_norm_bwd: shapes disagree");
  const int64_t R = x.size(0), H = x.size(1);
  at::Tensor dx = at::empty_like(x);
  const int threads = at::get_num_threads();
  at::Tensor partial = at::zeros({threads, H}, x.options());
  const float* dyp = dy.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* rp = rstd.data_ptr<float>();
  float* dxp = dx.data_ptr<float>();
  float* pp = partial.data_ptr<float>();
  at::parallel_for(0, R, kGrain, [&](int64_t lo, int64_t hi) {
    float* dw = pp + at::get_thread_num() * H;
    for (int64_t r = lo; r < hi; ++r) {
      const float* g = dyp + r * H;
      const float* xr = xp + r * H;
      const float inv = rp[r];
      float dot = 0.f;  // sum of g * w * xhat
      for (int64_t i = 0; i < H; ++i) {
        const float xhat = xr[i] * inv;
        dot += g[i] * wp[i] * xhat;
        dw[i] += g[i] * xhat;
      }
      const float mean = dot / static_cast<float>(H);
      float* out = dxp + r * H;
      for (int64_t i = 0; i < H; ++i) out[i] = inv * (g[i] * wp[i] - xr[i] * inv * mean);
    }
  });
  return {dx, reduce_partials(partial)};
}

// HF's rotate-half rotary on the first `rotated` heads of each row of x [R, width] (heads of head_dim
// hd side by side; the rest of the row, the values, is copied): y = x * cos + roll(x, hd / 2) * sin,
// with sin carrying rotate-half's sign (cat(-sin1, sin2)); cos / sin are [R, hd]. `inverse` gives the
// backward (the rotation's transpose): dx = dy * cos + roll(dy * sin, hd / 2).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t rotated, int64_t hd,
                  bool inverse) {
  for (auto& [t, name] : {std::pair{&x, "x"}, {&cos, "cos"}, {&sin, "sin"}}) check(*t, "rotary", name);
  TORCH_CHECK(x.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.size(1) == hd &&
              hd % 2 == 0 && rotated * hd <= x.size(1), "rotary: shapes disagree");
  const int64_t R = x.size(0), width = x.size(1), half = hd / 2;
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* c = cp + r * hd;
      const float* s = sp + r * hd;
      for (int64_t n = 0; n < rotated; ++n) {
        const float* a = xp + r * width + n * hd;
        float* b = yp + r * width + n * hd;
        if (!inverse) {
          for (int64_t i = 0; i < half; ++i) b[i] = a[i] * c[i] + a[i + half] * s[i];
          for (int64_t i = half; i < hd; ++i) b[i] = a[i] * c[i] + a[i - half] * s[i];
        } else {
          for (int64_t i = 0; i < half; ++i) b[i] = a[i] * c[i] + a[i + half] * s[i + half];
          for (int64_t i = half; i < hd; ++i) b[i] = a[i] * c[i] + a[i - half] * s[i - half];
        }
      }
      const int64_t done = rotated * hd;
      std::copy(xp + r * width + done, xp + (r + 1) * width, yp + r * width + done);
    }
  });
  return y;
}

// act = silu(gate) * up over gu [R, 2I] = cat(gate, up) along the last dimension.
at::Tensor swiglu_fwd(const at::Tensor& gu) {
  check(gu, "swiglu_fwd", "gu");
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "swiglu_fwd: gu must be [rows, 2 * intermediate]");
  const int64_t R = gu.size(0), I = gu.size(1) / 2;
  at::Tensor act = at::empty({R, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  at::parallel_for(0, R, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* g = gp + r * 2 * I;
      // silu(g) = g / (1 + exp(-g)), as torch's CPU kernel computes it
      at::vec::map2([](Vec a, Vec b) { return a / (Vec(1.f) + a.neg().exp()) * b; }, ap + r * I, g, g + I, I);
    }
  });
  return act;
}

// Gradient of swiglu_fwd: d gate = d act * up * sig * (1 + gate * (1 - sig)), d up = d act * silu(gate).
at::Tensor swiglu_bwd(const at::Tensor& dact, const at::Tensor& gu) {
  check(dact, "swiglu_bwd", "dact");
  check(gu, "swiglu_bwd", "gu");
  TORCH_CHECK(gu.dim() == 2 && dact.dim() == 2 && dact.size(0) == gu.size(0) && gu.size(1) == 2 * dact.size(1),
              "swiglu_bwd: shapes disagree");
  const int64_t R = gu.size(0), I = dact.size(1);
  at::Tensor dgu = at::empty_like(gu);
  const float* dp = dact.data_ptr<float>();
  const float* gp = gu.data_ptr<float>();
  float* op = dgu.data_ptr<float>();
  at::parallel_for(0, R, kGrain, [&](int64_t lo, int64_t hi) {
    const Vec one(1.f);
    for (int64_t r = lo; r < hi; ++r) {
      const float* d = dp + r * I;
      const float* g = gp + r * 2 * I;
      const float* u = g + I;
      float* dg = op + r * 2 * I;
      float* du = dg + I;
      int64_t i = 0;
      for (; i + Vec::size() <= I; i += Vec::size()) {
        const Vec gv = Vec::loadu(g + i), uv = Vec::loadu(u + i), dv = Vec::loadu(d + i);
        const Vec sig = one / (one + gv.neg().exp());
        (dv * uv * sig * (one + gv * (one - sig))).store(dg + i);
        (dv * gv * sig).store(du + i);
      }
      for (; i < I; ++i) {
        const float sig = 1.f / (1.f + std::exp(-g[i]));
        dg[i] = d[i] * u[i] * sig * (1.f + g[i] * (1.f - sig));
        du[i] = d[i] * g[i] * sig;
      }
    }
  });
  return dgu;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(posttrain, m) {
  m.def("rms_norm_fwd", &rms_norm_fwd);
  m.def("rms_norm_bwd", &rms_norm_bwd);
  m.def("rotary", &rotary);
  m.def("swiglu_fwd", &swiglu_fwd);
  m.def("swiglu_bwd", &swiglu_bwd);
}
