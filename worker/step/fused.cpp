// Fused CPU operators of a decode step (worker/step/fused.py builds and loads this file).
//
// Each operator computes every row on its own (no sum runs across rows), so a row's result does not
// depend on what else shares the step. Reads of bfloat16/half widen to float; every sum is in float.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>

#include "attention.h"  // paged::attention, and the dtype dispatch (by_float) and widening the operators share

namespace {

using paged::by_float;
using paged::widen;

template <typename T> inline void st(T* p, int64_t i, float v) { p[i] = static_cast<T>(v); }

// x [T, K] float32 -> x * rsqrt(mean(x^2) + eps) * w in out_dtype, per row.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat);
  auto xc = x.contiguous();
  const int64_t T = xc.size(0), K = xc.size(1);
  auto out = at::empty({T, K}, xc.options().dtype(out_dtype));
  const float* px = xc.data_ptr<float>();
  const float* pw = w.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  by_float(out_dtype, [&](auto* tag) {
    using O = std::remove_pointer_t<decltype(tag)>;
    O* po = static_cast<O*>(out.data_ptr());
    for (int64_t t = 0; t < T; ++t) {
      const float* r = px + t * K;
      float ss = 0.f;
      for (int64_t k = 0; k < K; ++k) ss += r[k] * r[k];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(K) + feps);
      for (int64_t k = 0; k < K; ++k) st(po + t * K, k, (r[k] * inv) * pw[k]);
    }
  });
  return out;
}

// Rotates q and k of qkv [T, (H + 2 KVH) * D] (any float dtype) by the rows `positions` of cos and
// sin_signed [P, D] (float32; sin's first half negated: rotate_half(x) * sin == roll(x, D/2) * sin'),
// each product and the sum rounded to `round` (the compute dtype, as the eager step's operations
// round), writes the rotated k and v at `slots` [T] of kv [S, 2, KVH, D] and returns the rotated q
// [T, H, D] in kv's dtype.
template <typename I, typename C, typename R>
void rope_rows(const I* pq, C* pkv, C* pq_out, const float* cos, const float* sin, const int64_t* pos,
               const int64_t* slots, int64_t T, int64_t H, int64_t KVH, int64_t D) {
  const int64_t width = (H + 2 * KVH) * D, half = D / 2;
  auto rnd = [](float v) { return static_cast<float>(static_cast<R>(v)); };
  for (int64_t t = 0; t < T; ++t) {
    const I* row = pq + t * width;
    const float* c = cos + pos[t] * D;
    const float* s = sin + pos[t] * D;
    C* kv = pkv + slots[t] * 2 * KVH * D;
    for (int64_t h = 0; h < H + KVH; ++h) {
      const I* v = row + h * D;
      C* dst = h < H ? pq_out + (t * H + h) * D : kv + (h - H) * D;
      for (int64_t j = 0; j < D; ++j) {
        const float a = rnd(widen(v[j]) * rnd(c[j]));
        const float b = rnd(widen(v[(j + half) % D]) * rnd(s[j]));
        st(dst, j, rnd(a + b));
      }
    }
    const I* vals = row + (H + KVH) * D;
    for (int64_t j = 0; j < KVH * D; ++j) st(kv + KVH * D, j, widen(vals[j]));
  }
}

at::Tensor rope_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                      at::Tensor& kv, const at::Tensor& slots, int64_t H, int64_t KVH, at::ScalarType round) {
  TORCH_CHECK(qkv.is_contiguous() && kv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous());
  const int64_t T = qkv.size(0), D = kv.size(3);
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D && kv.size(2) == KVH && D % 2 == 0);
  auto q = at::empty({T, H, D}, kv.options());
  auto pos = positions.contiguous();
  auto sl = slots.contiguous();
  by_float(qkv.scalar_type(), [&](auto* itag) {
    using I = std::remove_pointer_t<decltype(itag)>;
    by_float(kv.scalar_type(), [&](auto* ctag) {
      using C = std::remove_pointer_t<decltype(ctag)>;
      by_float(round, [&](auto* rtag) {
        using R = std::remove_pointer_t<decltype(rtag)>;
        rope_rows<I, C, R>(static_cast<const I*>(qkv.data_ptr()), static_cast<C*>(kv.data_ptr()),
                           static_cast<C*>(q.data_ptr()), cos.data_ptr<float>(), sin.data_ptr<float>(),
                           pos.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), T, H, KVH, D);
      });
    });
  });
  return q;
}

// gate_up [T, 2I] -> silu(gate) * up [T, I] in out_dtype: computed in float, SiLU and the product
// each rounded to `round` (the dtype the eager step computes them in).
at::Tensor silu_mul(const at::Tensor& gate_up, at::ScalarType round, at::ScalarType out_dtype) {
  auto gu = gate_up.contiguous();
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto out = at::empty({T, I}, gu.options().dtype(out_dtype));
  by_float(gu.scalar_type(), [&](auto* itag) {
    using In = std::remove_pointer_t<decltype(itag)>;
    by_float(out_dtype, [&](auto* otag) {
      using O = std::remove_pointer_t<decltype(otag)>;
      by_float(round, [&](auto* rtag) {
        using R = std::remove_pointer_t<decltype(rtag)>;
        auto rnd = [](float v) { return static_cast<float>(static_cast<R>(v)); };
        const In* p = static_cast<const In*>(gu.data_ptr());
        O* po = static_cast<O*>(out.data_ptr());
        for (int64_t t = 0; t < T; ++t)
          for (int64_t i = 0; i < I; ++i) {
            const float g = widen(p[t * 2 * I + i]);
            st(po, t * I + i, rnd(rnd(g / (1.f + std::exp(-g))) * widen(p[t * 2 * I + I + i])));
          }
      });
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows, written in out_dtype");
  m.def("rope_cache", &rope_cache, "RoPE on q and k, k and v written to the cache; returns q");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up");
  m.def("paged_attention", &paged::attention, "batch-invariant attention of any rows over their block tables");
}
