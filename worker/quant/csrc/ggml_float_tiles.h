// ggml's float dot products (F32, BF16) over several activation rows at once, for ggml::linear.
//
// ggml's vec_dot takes one weight row and one activation row: at one row a linear reads its weights
// once, which is all a decode step of one sequence needs, but at several rows each dot product runs
// alone, bound by its accumulators' latency. Here a tile of weight rows and activation rows is
// computed together: each weight vector loaded serves every activation row of the tile and the
// independent accumulators keep the CPU's units busy. Each output is computed exactly as ggml's
// AVX-512 vec_dot computes it (the same accumulators over the same values in the same order, reduced
// the same way), so every output is bit for bit ggml's, whatever the row count of the call
// (tests/unit/test_ggml_kernel.py checks both against ggml's own vec_dot). Used only where ggml's
// library was built with that AVX-512 form (ggml_cpu_has_*) and the row length is whole 64-value
// steps (no scalar tail); elsewhere ggml::linear runs ggml's vec_dot per output.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "ggml-cpu.h"
#include "ggml.h"

namespace tiles {

constexpr int64_t STEP = 64;  // values per step of ggml's AVX-512 F32 and BF16 vec_dot
// One weight row per tile, streamed once as ggml's vec_dot streams it (two rows at once read DRAM
// slower at a few rows), against up to NX activation rows read from the L1 cache.
constexpr int NW = 1;

// ggml_vec_dot_bf16 (__AVX512BF16__): accumulator h takes the h-th 32-value half of every 64-value step
// (_mm512_dpbf16_ps), each is reduced with _mm512_reduce_add_ps and the two summed in double from 0.
struct BF16 {
  static constexpr int NX = 8;  // activation rows per tile: 2 * NW * NX accumulators
  template <int W, int X>
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))) static void tile(
      const uint8_t* w_bytes, const uint8_t* x_bytes, int64_t k, float* out) {
    const uint16_t* w = reinterpret_cast<const uint16_t*>(w_bytes);
    const uint16_t* x = reinterpret_cast<const uint16_t*>(x_bytes);
    __m512 acc[2][W][X];
    #pragma GCC unroll 8
    for (int h = 0; h < 2; ++h)
      #pragma GCC unroll 8
      for (int i = 0; i < W; ++i)
        #pragma GCC unroll 8
        for (int j = 0; j < X; ++j) acc[h][i][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k; p += STEP) {
      #pragma GCC unroll 8
      for (int h = 0; h < 2; ++h) {
        __m512i wv[W];
        #pragma GCC unroll 8
        for (int i = 0; i < W; ++i) wv[i] = _mm512_loadu_si512(w + i * k + p + 32 * h);
        #pragma GCC unroll 8
        for (int j = 0; j < X; ++j) {
          const __m512i xv = _mm512_loadu_si512(x + j * k + p + 32 * h);
          #pragma GCC unroll 8
          for (int i = 0; i < W; ++i) acc[h][i][j] = _mm512_dpbf16_ps(acc[h][i][j], (__m512bh)wv[i], (__m512bh)xv);
        }
      }
    }
    #pragma GCC unroll 8
    for (int i = 0; i < W; ++i)
      #pragma GCC unroll 8
      for (int j = 0; j < X; ++j) {
        double sum = 0;
        sum += static_cast<double>(_mm512_reduce_add_ps(acc[0][i][j]));
        sum += static_cast<double>(_mm512_reduce_add_ps(acc[1][i][j]));
        out[i * X + j] = static_cast<float>(sum);
      }
  }
};

// ggml_vec_dot_f32 (GGML_SIMD, __AVX512F__): accumulator a takes the a-th 16-value quarter of every
// 64-value step (_mm512_fmadd_ps), then 0 += 2, 1 += 3, 0 += 1 and _mm512_reduce_add_ps.
struct F32 {
  static constexpr int NX = 6;  // 4 * NW * NX accumulators of the 32 registers
  template <int W, int X>
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static void tile(const uint8_t* w_bytes,
                                                                                 const uint8_t* x_bytes, int64_t k,
                                                                                 float* out) {
    const float* w = reinterpret_cast<const float*>(w_bytes);
    const float* x = reinterpret_cast<const float*>(x_bytes);
    __m512 acc[4][W][X];
    #pragma GCC unroll 8
    for (int a = 0; a < 4; ++a)
      #pragma GCC unroll 8
      for (int i = 0; i < W; ++i)
        #pragma GCC unroll 8
        for (int j = 0; j < X; ++j) acc[a][i][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k; p += STEP) {
      #pragma GCC unroll 8
      for (int a = 0; a < 4; ++a) {
        __m512 wv[W];
        #pragma GCC unroll 8
        for (int i = 0; i < W; ++i) wv[i] = _mm512_loadu_ps(w + i * k + p + 16 * a);
        #pragma GCC unroll 8
        for (int j = 0; j < X; ++j) {
          const __m512 xv = _mm512_loadu_ps(x + j * k + p + 16 * a);
          #pragma GCC unroll 8
          for (int i = 0; i < W; ++i) acc[a][i][j] = _mm512_fmadd_ps(wv[i], xv, acc[a][i][j]);
        }
      }
    }
    #pragma GCC unroll 8
    for (int i = 0; i < W; ++i)
      #pragma GCC unroll 8
      for (int j = 0; j < X; ++j) {
        __m512 s0 = _mm512_add_ps(acc[0][i][j], acc[2][i][j]);
        const __m512 s1 = _mm512_add_ps(acc[1][i][j], acc[3][i][j]);
        s0 = _mm512_add_ps(s0, s1);
        out[i * X + j] = _mm512_reduce_add_ps(s0);
      }
  }
};

// Whether the tiles compute ggml's own vec_dot for weights of type t in rows of k values here.
inline bool serve(ggml_type t, int64_t k) {
  if (k % STEP != 0) return false;
  if (t == GGML_TYPE_BF16) return ggml_cpu_has_avx512_bf16() && __builtin_cpu_supports("avx512bf16");
  if (t == GGML_TYPE_F32) return ggml_cpu_has_avx512() && __builtin_cpu_supports("avx512f");
  return false;
}

template <class D, int W, int X>
void call(const uint8_t* w, const uint8_t* x, int64_t k, float* out) {
  D::template tile<W, X>(w, x, k, out);
}

constexpr int MAX_NX = 8;

// One tile of `w` weight rows (1..NW) and `x` activation rows (1..D::NX).
template <class D>
void tile(int w, int x, const uint8_t* wp, const uint8_t* xp, int64_t k, float* out) {
  using Fn = void (*)(const uint8_t*, const uint8_t*, int64_t, float*);
  static_assert(NW == 1 && D::NX <= MAX_NX, "the table below holds one weight row and up to MAX_NX rows");
  static const Fn table[MAX_NX] = {
      call<D, 1, 1>, call<D, 1, 2>, call<D, 1, 3>, call<D, 1, 4>,
      call<D, 1, 5>, call<D, 1, 6>, call<D, 1, std::min(7, D::NX)>, call<D, 1, std::min(8, D::NX)>,
  };
  table[x - 1](wp, xp, k, out);
}

// out(r, i) = the dot product of weight row i [w + i * w_bytes] and activation row r [x + r * x_bytes],
// for i < n and r < rows, over tiles split by weight rows in torch's thread pool.
template <class D, class Store>
void linear(const uint8_t* w, size_t w_bytes, int64_t n, const uint8_t* x, size_t x_bytes, int64_t rows,
            int64_t k, Store store) {
  at::parallel_for(0, (n + NW - 1) / NW, 16, [&](int64_t lo, int64_t hi) {
    float out[NW * MAX_NX];
    for (int64_t p = lo; p < hi; ++p) {
      const int64_t i = p * NW;
      const int nw = static_cast<int>(std::min<int64_t>(NW, n - i));
      for (int64_t r = 0; r < rows; r += D::NX) {
        const int nx = static_cast<int>(std::min<int64_t>(D::NX, rows - r));
        tile<D>(nw, nx, w + i * w_bytes, x + r * x_bytes, k, out);
        for (int a = 0; a < nw; ++a)
          for (int b = 0; b < nx; ++b) store(r + b, i + a, out[a * nx + b]);
      }
    }
  });
}

}  // namespace tiles
