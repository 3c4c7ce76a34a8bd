// Fused CPU operators of a decode step (worker/step/fused.py builds and loads this file).
//
// Each operator computes every row on its own (no sum runs across rows), so a row's result does not
// depend on what else shares the step. Reads of bfloat16/half widen to float; every sum is in float.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "attention.h"  // paged::attention, and the dtype dispatch (by_float) and widening the operators share

// SLEEF's vector expf, exported by libtorch_cpu (torch's Vectorized<float>::exp calls it). Weak: a
// torch that does not export it leaves the pointer null and SiLU·up takes std::exp (the module still
// loads).
extern "C" {
#if defined(__AVX512F__)
__m512 Sleef_expf16_u10(__m512) __attribute__((weak));
#elif defined(__AVX2__)
__m256 Sleef_expf8_u10(__m256) __attribute__((weak));
#endif
}

namespace {

using paged::by_float;
using paged::widen;

// v's bits rounded to bfloat16 (in the high half): c10's round_to_nearest_even (NaN to its quiet NaN
// 0x7FC0), written without a branch so that a loop of it vectorizes (c10::BFloat16's constructor
// does not)
inline uint32_t bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return v != v ? UINT32_C(0x7FC00000) : (u + UINT32_C(0x7FFF) + ((u >> 16) & 1)) & UINT32_C(0xFFFF0000);
}

// v rounded to bfloat16 and widened back
inline float round_bf16(float v) {
  const uint32_t u = bf16_bits(v);
  float out;
  std::memcpy(&out, &u, sizeof out);
  return out;
}

template <typename T> inline void st(T* p, int64_t i, float v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    p[i] = c10::BFloat16(static_cast<uint16_t>(bf16_bits(v) >> 16), c10::BFloat16::from_bits());
  } else {
    p[i] = static_cast<T>(v);
  }
}

// v rounded to R and widened back to float
template <typename R> inline float round_to(float v) {
  if constexpr (std::is_same_v<R, c10::BFloat16>) {
    return round_bf16(v);
  } else {
    return static_cast<float>(static_cast<R>(v));
  }
}

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

// The residual add and the next RMSNorm in one call: x [T, K] float32 += delta [T, K] (any float
// dtype, widened: the float32 sum torch's x += delta computes), in place, then rms_norm(x, w, eps,
// out_dtype). The same values as the two operations; one call instead of two.
at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& delta, const at::Tensor& w, double eps,
                        at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat);
  TORCH_CHECK(delta.sizes() == x.sizes(), "add_rms_norm: delta ", delta.sizes(), " for x ", x.sizes());
  auto d = delta.contiguous();
  float* px = x.data_ptr<float>();
  const int64_t n = x.numel();
  by_float(d.scalar_type(), [&](auto* tag) {
    using D = std::remove_pointer_t<decltype(tag)>;
    const D* pd = static_cast<const D*>(d.data_ptr());
    for (int64_t i = 0; i < n; ++i) px[i] = px[i] + widen(pd[i]);
  });
  return rms_norm(x, w, eps, out_dtype);
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
      // rotate_half's partner of value j is j + D/2 (first half) or j - D/2 (second): two loops
      // instead of one with a modulo, so the compiler vectorises them (the same operations)
      for (int64_t j = 0; j < half; ++j)
        st(dst, j, rnd(rnd(widen(v[j]) * rnd(c[j])) + rnd(widen(v[j + half]) * rnd(s[j]))));
      for (int64_t j = half; j < D; ++j)
        st(dst, j, rnd(rnd(widen(v[j]) * rnd(c[j])) + rnd(widen(v[j - half]) * rnd(s[j]))));
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

// exp(-g) for n values of `g` into `e`: SLEEF's expf (1-ulp), the function torch's own SiLU kernel
// calls on this CPU (Vectorized<float>::exp: the 16-lane form with AVX-512, the 8-lane one with
// AVX2; libtorch_cpu exports both), so a lane's value is what torch computes for it; a row's tail
// past the last full vector takes std::exp, as torch's kernel does.
void exp_neg_row(const float* g, float* e, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if (Sleef_expf16_u10 != nullptr)
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(e + i, Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_loadu_ps(g + i))));
#elif defined(__AVX2__)
  if (Sleef_expf8_u10 != nullptr)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(e + i, Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_loadu_ps(g + i))));
#endif
  for (; i < n; ++i) e[i] = std::exp(-g[i]);
}

// gate_up [T, 2I] -> silu(gate) * up [T, I] in out_dtype: computed in float, SiLU (gate / (1 +
// exp(-gate)), torch's formula) and the product each rounded to `round` (the dtype the eager step
// computes them in).
at::Tensor silu_mul(const at::Tensor& gate_up, at::ScalarType round, at::ScalarType out_dtype) {
  auto gu = gate_up.contiguous();
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto out = at::empty({T, I}, gu.options().dtype(out_dtype));
  std::vector<float> g(I), e(I);
  by_float(gu.scalar_type(), [&](auto* itag) {
    using In = std::remove_pointer_t<decltype(itag)>;
    by_float(out_dtype, [&](auto* otag) {
      using O = std::remove_pointer_t<decltype(otag)>;
      by_float(round, [&](auto* rtag) {
        using R = std::remove_pointer_t<decltype(rtag)>;
        auto rnd = [](float v) { return round_to<R>(v); };
        const In* p = static_cast<const In*>(gu.data_ptr());
        O* po = static_cast<O*>(out.data_ptr());
        for (int64_t t = 0; t < T; ++t) {
          const In* gate = p + t * 2 * I;
          const In* up = gate + I;
          for (int64_t i = 0; i < I; ++i) g[i] = widen(gate[i]);
          exp_neg_row(g.data(), e.data(), I);
          for (int64_t i = 0; i < I; ++i) st(po, t * I + i, rnd(rnd(g[i] / (1.f + e[i])) * widen(up[i])));
        }
      });
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows, written in out_dtype");
  m.def("add_rms_norm", &add_rms_norm, "x += delta in place, then RMSNorm of x in out_dtype");
  m.def("rope_cache", &rope_cache, "RoPE on q and k, k and v written to the cache; returns q");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up");
  m.def("paged_attention", &paged::attention, "batch-invariant attention of any rows over their block tables");
}
