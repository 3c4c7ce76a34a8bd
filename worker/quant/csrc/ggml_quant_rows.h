// ggml's x86 dot products of quantized blocks (Q8_0 and Q4_0 weights against Q8_0 activations, Q4_1
// against Q8_1) over weights held in groups of four rows, for ggml::linear4.
//
// ggml's vec_dot (ggml-cpu/arch/x86/quants.c, its __AVX2__ form) takes one weight row and one
// activation row and sums the blocks' products into one vector accumulator: each block's fused
// multiply-add waits for the one before it, so a short row (576 values are 18 blocks) runs at that
// accumulator's latency, not at the memory's bandwidth. Here four weight rows are summed together
// against up to four activation rows: up to sixteen independent accumulators, each weight block
// loaded once for every activation row and each activation block once for the four weight rows. The
// four rows' blocks are held interleaved (a group's first blocks, then its second blocks, ...; see
// worker/quant/ggml_kernel.py:pack4), so a group is read front to back as vec_dot reads one row: four
// rows read in place from four addresses at once streamed from memory 2-3x slower than one on the Zen 4
// box (docs/benchmarks/results.md, 2026-12-04 night).
//
// Each output is computed exactly as ggml's vec_dot computes it (the same integer products, the same
// scale products, its own accumulator over the blocks in the same order, reduced the same way), so
// every output is bit for bit ggml's whatever the rows beside it (tests/unit/test_ggml_packed.py checks
// each type against ggml's own vec_dot). Compiled where this file is built for AVX2 with FMA and F16C
// (ggml's own x86 form of these products); elsewhere for_type() is nullptr and the candidate using it
// is not offered.
#pragma once

#include <cstdint>
#include <cstring>

#include "ggml.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LLAMADEPLOY_QUANT_ROWS 1
#endif

namespace quant_rows {

constexpr int ROWS = 4;  // weight rows per group
constexpr int XMAX = 4;  // activation rows per tile

#ifdef LLAMADEPLOY_QUANT_ROWS

inline float half(const uint8_t* p) {  // GGML_CPU_FP16_TO_FP32 on x86 with F16C
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}

// ggml-cpu/arch/x86/quants.c's helpers, in the form its build for this CPU compiles
inline float hsum_float_8(const __m256 x) {
  __m128 res = _mm256_extractf128_ps(x, 1);
  res = _mm_add_ps(res, _mm256_castps256_ps128(x));
  res = _mm_add_ps(res, _mm_movehl_ps(res, res));
  res = _mm_add_ss(res, _mm_movehdup_ps(res));
  return _mm_cvtss_f32(res);
}

// Sums of four products of unsigned bytes `ax` by signed bytes `sy`, as floats. Each sum is exact (at
// most 4 * 255 * 127 in magnitude) whichever instruction computes it.
inline __m256 mul_sum_us8_pairs_float(const __m256i ax, const __m256i sy) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy));
#elif defined(__AVXVNNI__)
  return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ax, sy));
#else
  const __m256i dot = _mm256_maddubs_epi16(ax, sy);  // pairs: at most 2 * 128 * 127, no saturation
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), dot));
#endif
}

inline __m256i bytes_from_nibbles_32(const uint8_t* p) {
  const __m128i tmp = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i bytes = _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp);
  return _mm256_and_si256(_mm256_set1_epi8(0xF), bytes);
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// An activation block of Q8_0 / Q8_1: its quants (for SignedBlocks with VNNI, plus 128 as unsigned bytes),
// its scale (in every lane) and (Q8_1) its scaled sum.
struct Act {
  __m256i q;
  __m256 d;
  float s;
};

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define LLAMADEPLOY_QUANT_ROWS_OFFSET 1
// acc + the sums of four products of unsigned bytes `u` by signed bytes `s` per 32-bit lane, exact
inline __m256i dpbusd(const __m256i acc, const __m256i u, const __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#endif

// A Q8_0 or Q4_0 weight block against Q8_0: ggml_vec_dot_q8_0_q8_0 / ggml_vec_dot_q4_0_q8_0.
//
// vec_dot's integer step makes each of 8 lanes the sum of four products w * a, exactly (the sign
// trick: |w| times a signed as w). Where the CPU has VNNI's dpbusd (unsigned by signed bytes, added
// to an accumulator) the same lane sums take one instruction per pair instead of two: the activation
// is read as the unsigned a + 128 (its quants are within [-127, 127]) and the lane's accumulator
// starts at -128 times the sum of its four weights, computed once per weight block:
// sum(w * (a + 128)) - 128 * sum(w) = sum(w * a), every term an exact 32-bit integer. The lanes then go
// on as vec_dot's do (converted, scaled, summed), so the outputs are its values bit for bit.
template <bool Nibbles>
struct SignedBlocks {
  static constexpr size_t W_BYTES = Nibbles ? 18 : 34, A_BYTES = 34;
  struct W {
    __m256i x, ax;  // signed quants; their magnitudes (the sign trick), or -128 * each lane's sum (VNNI)
    __m256 d;       // its scale in every lane
  };
  static W weight(const uint8_t* b) {
    const __m256i x = Nibbles ? _mm256_sub_epi8(bytes_from_nibbles_32(b + 2), _mm256_set1_epi8(8)) : load32(b + 2);
#ifdef LLAMADEPLOY_QUANT_ROWS_OFFSET
    const __m256i sum128 = dpbusd(_mm256_setzero_si256(), _mm256_set1_epi8(static_cast<char>(0x80)), x);
    return {x, _mm256_sub_epi32(_mm256_setzero_si256(), sum128), _mm256_set1_ps(half(b))};
#else
    return {x, _mm256_sign_epi8(x, x), _mm256_set1_ps(half(b))};
#endif
  }
  static Act act(const uint8_t* b) {
#ifdef LLAMADEPLOY_QUANT_ROWS_OFFSET  // a + 128 as unsigned bytes: a XOR 0x80
    return {_mm256_xor_si256(load32(b + 2), _mm256_set1_epi8(static_cast<char>(0x80))), _mm256_set1_ps(half(b)), 0.0f};
#else
    return {load32(b + 2), _mm256_set1_ps(half(b)), 0.0f};
#endif
  }
  static void pair(const W& w, const Act& a, __m256& acc, float&) {
    const __m256 d = _mm256_mul_ps(w.d, a.d);  // in every lane ggml's set1(d_x * d_y): one rounding, the same
#ifdef LLAMADEPLOY_QUANT_ROWS_OFFSET
    acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dpbusd(w.ax, a.q, w.x)), acc);
#else
    acc = _mm256_fmadd_ps(d, mul_sum_us8_pairs_float(w.ax, _mm256_sign_epi8(a.q, w.x)), acc);
#endif
  }
  static float finish(const __m256 acc, float) { return hsum_float_8(acc); }
};

// A Q4_1 weight block against Q8_1: ggml_vec_dot_q4_1_q8_1. The blocks' minima times the activation
// blocks' sums are summed apart in a float and added last.
struct MinBlocks {
  static constexpr size_t W_BYTES = 20, A_BYTES = 36;
  struct W {
    __m256i x;  // unsigned quants
    __m256 d;   // its scale in every lane
    float m;
  };
  static W weight(const uint8_t* b) { return {bytes_from_nibbles_32(b + 4), _mm256_set1_ps(half(b)), half(b + 2)}; }
  static Act act(const uint8_t* b) { return {load32(b + 4), _mm256_set1_ps(half(b)), half(b + 2)}; }
  static void pair(const W& w, const Act& a, __m256& acc, float& summs) {
    summs += w.m * a.s;  // ggml's `summs += m * s`, compiled alike (its build multiplies, then adds)
    acc = _mm256_fmadd_ps(_mm256_mul_ps(w.d, a.d), mul_sum_us8_pairs_float(w.x, a.q), acc);
  }
  static float finish(const __m256 acc, float summs) { return hsum_float_8(acc) + summs; }
};

// out[j * X + r] = vec_dot(weight row j of the group at w, activation row r at a + r * a_bytes)
template <class T, int X>
void tile(int64_t nb, const uint8_t* w, const uint8_t* a, size_t a_bytes, float* out) {
  __m256 acc[ROWS][X];
  float summs[ROWS][X];
#pragma GCC unroll 4
  for (int j = 0; j < ROWS; ++j)
#pragma GCC unroll 4
    for (int r = 0; r < X; ++r) {
      acc[j][r] = _mm256_setzero_ps();
      summs[j][r] = 0.0f;
    }
  for (int64_t ib = 0; ib < nb; ++ib) {
    typename T::W wv[ROWS];
#pragma GCC unroll 4
    for (int j = 0; j < ROWS; ++j) wv[j] = T::weight(w + (ib * ROWS + j) * T::W_BYTES);
#pragma GCC unroll 4
    for (int r = 0; r < X; ++r) {
      const Act av = T::act(a + r * a_bytes + ib * T::A_BYTES);
#pragma GCC unroll 4
      for (int j = 0; j < ROWS; ++j) T::pair(wv[j], av, acc[j][r], summs[j][r]);
    }
  }
  for (int j = 0; j < ROWS; ++j)
    for (int r = 0; r < X; ++r) out[j * X + r] = T::finish(acc[j][r], summs[j][r]);
}

using Fn = void (*)(int64_t, const uint8_t*, const uint8_t*, size_t, float*);

template <class T>
Fn tile_of(int x) {
  static const Fn table[XMAX] = {tile<T, 1>, tile<T, 2>, tile<T, 3>, tile<T, 4>};
  return table[x - 1];
}

// The tile of up to XMAX activation rows for weights of type t, or nullptr where ggml::linear4 does not
// serve the type.
inline Fn for_type(ggml_type t, int x) {
  switch (t) {
    case GGML_TYPE_Q8_0:
      return tile_of<SignedBlocks<false>>(x);
    case GGML_TYPE_Q4_0:
      return tile_of<SignedBlocks<true>>(x);
    case GGML_TYPE_Q4_1:
      return tile_of<MinBlocks>(x);
    default:
      return nullptr;
  }
}

#else

using Fn = void (*)(int64_t, const uint8_t*, const uint8_t*, size_t, float*);
inline Fn for_type(ggml_type, int) { return nullptr; }

#endif

}  // namespace quant_rows
