// Q8_0 weights sixteen rows at a time against Q8_0 activations, for ggml::linear16, on CPUs with
// AVX-512 VNNI: the layout ik_llama.cpp's Q8_0_R8 (iqk_mul_mat) reads, widened to a 512-bit vector.
//
// ggml's vec_dot (and ggml::linear4, which reproduces it) holds a block's 32 products in the lanes of one
// vector, so every block pair ends in a conversion, a scale and a fused add of its own: at a prefill's
// 64 rows that, not the products, bounds the speed. Here the 16 rows of a group lie in the 16 lanes of
// one vector: the group's block is held as 8 slices of 16 rows by 4 quants (64 bytes), each multiplied by
// 4 quants of the activation block broadcast to every lane (one dpbusd), so after 8 of them each lane
// holds its row's whole block product, an exact integer; one conversion, one scale product and one
// fused add then serve 16 rows. Up to XMAX activation rows share each weight load.
//
// dpbusd multiplies unsigned bytes by signed ones: the weights are stored as w + 128 (w XOR 0x80; Q8_0's
// quants are within [-127, 127]) and the block's accumulator starts at -128 times the sum of the
// activation block's quants: sum((w + 128) * a) - 128 * sum(a) = sum(w * a), every term an exact 32-bit
// integer (at most 32 * 255 * 127 in magnitude), and the block's sum is exact in a float (below 2^24).
//
// Each output is  acc = fma(float(block sum), d_w * d_a, acc)  over its row's blocks in order, from
// acc = 0: the same operations whatever the rows beside it and whichever tile the row count selects, so
// the kernel is row-count invariant by construction. It is not ggml's vec_dot bit for bit (vec_dot
// scales each lane's part of a block apart and sums the lanes last): a kernel of its own, checked
// against the dequantized weights as every candidate is.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define LLAMADEPLOY_ROWS16 1
#endif

namespace rows16 {

constexpr int ROWS = 16;       // weight rows per group: one float lane each
constexpr int XMAX = 8;        // activation rows per tile
constexpr int SLICES = 8;      // 4-quant slices of a block of 32
constexpr size_t SCALES = 32;  // a group's block: 16 fp16 scales, then SLICES slices of 16 rows x 4 quants
constexpr size_t GROUP_BLOCK = SCALES + SLICES * ROWS * 4;  // 544 bytes: 16 Q8_0 blocks of 34
constexpr size_t A_BYTES = 34;                              // a Q8_0 activation block: fp16 scale, 32 quants

// What a tile reads of each activation block: its scale as a float and -128 times its quants' sum.
struct ActBlock {
  float d;
  int32_t bias;
};

#ifdef LLAMADEPLOY_ROWS16

// out[r * ROWS + j] = the product of weight row j of the group at w and activation row r (its blocks'
// scales and biases at act + r * nb)
template <int X>
void tile(int64_t nb, const uint8_t* w, const uint8_t* a, size_t a_bytes, const ActBlock* act, float* out) {
  __m512 acc[X];
#pragma GCC unroll 8
  for (int r = 0; r < X; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t ib = 0; ib < nb; ++ib) {
    const uint8_t* g = w + ib * GROUP_BLOCK;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
    __m512i wq[SLICES];
#pragma GCC unroll 8
    for (int s = 0; s < SLICES; ++s) wq[s] = _mm512_loadu_si512(g + SCALES + 64 * s);
#pragma GCC unroll 8
    for (int r = 0; r < X; ++r) {
      const uint8_t* q = a + r * a_bytes + ib * A_BYTES + 2;
      const ActBlock ab = act[r * nb + ib];
      // two chains of exact integer sums (their order cannot change the total), joined once
      __m512i even = _mm512_set1_epi32(ab.bias), odd = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int s = 0; s < SLICES; s += 2) {
        int32_t q0, q1;
        std::memcpy(&q0, q + 4 * s, 4);
        std::memcpy(&q1, q + 4 * s + 4, 4);
        even = _mm512_dpbusd_epi32(even, wq[s], _mm512_set1_epi32(q0));
        odd = _mm512_dpbusd_epi32(odd, wq[s + 1], _mm512_set1_epi32(q1));
      }
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
      acc[r] = _mm512_fmadd_ps(sum, _mm512_mul_ps(dw, _mm512_set1_ps(ab.d)), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < X; ++r) _mm512_storeu_ps(out + r * ROWS, acc[r]);
}

using Fn = void (*)(int64_t, const uint8_t*, const uint8_t*, size_t, const ActBlock*, float*);

inline Fn tile_of(int x) {
  static const Fn table[XMAX] = {tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, tile<8>};
  return table[x - 1];
}

constexpr bool built = true;

#else

using Fn = void (*)(int64_t, const uint8_t*, const uint8_t*, size_t, const ActBlock*, float*);
inline Fn tile_of(int) { return nullptr; }
constexpr bool built = false;

#endif

// BF16 weights, sixteen rows at a time, where the CPU has AVX512_BF16 (ggml::linear16 with a BF16 type).
//
// The same idea for a float weight: a group holds, for each pair of columns, the 16 rows' two values
// (64 bytes: worker/quant/ggml_kernel.py:pack16_float), and one vdpbf16ps adds both products of each
// row into its own lane against the activation's pair broadcast to every lane, so no output is summed
// across lanes at the end, as tinyBLAS's and ggml's bfloat16 dot products must. Each output is two
// float32 accumulators, the even and the odd column pairs in order, added once at the end: the same
// operations for a row whatever the rows beside it (row-invariant by construction).
#if defined(__AVX512F__) && defined(__AVX512BF16__)

// out[r * ROWS + j] = the dot product of weight row j of the group at w ([K / 2][16][2] bfloat16) and
// bfloat16 activation row r at a + r * k (k values, a multiple of 4)
template <int X>
void tile_bf16(int64_t k, const uint16_t* w, const uint16_t* a, float* out) {
  __m512 even[X], odd[X];
#pragma GCC unroll 8
  for (int r = 0; r < X; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k / 2; p += 2) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * 2 * ROWS);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + (p + 1) * 2 * ROWS);
#pragma GCC unroll 8
    for (int r = 0; r < X; ++r) {
      int32_t x0, x1;
      std::memcpy(&x0, a + r * k + 2 * p, 4);
      std::memcpy(&x1, a + r * k + 2 * p + 2, 4);
      even[r] = _mm512_dpbf16_ps(even[r], w0, (__m512bh)_mm512_set1_epi32(x0));
      odd[r] = _mm512_dpbf16_ps(odd[r], w1, (__m512bh)_mm512_set1_epi32(x1));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < X; ++r) _mm512_storeu_ps(out + r * ROWS, _mm512_add_ps(even[r], odd[r]));
}

using FnBF16 = void (*)(int64_t, const uint16_t*, const uint16_t*, float*);

inline FnBF16 tile_bf16_of(int x) {
  static const FnBF16 table[XMAX] = {tile_bf16<1>, tile_bf16<2>, tile_bf16<3>, tile_bf16<4>,
                                     tile_bf16<5>, tile_bf16<6>, tile_bf16<7>, tile_bf16<8>};
  return table[x - 1];
}

constexpr bool built_bf16 = true;

#else

using FnBF16 = void (*)(int64_t, const uint16_t*, const uint16_t*, float*);
inline FnBF16 tile_bf16_of(int) { return nullptr; }
constexpr bool built_bf16 = false;

#endif

}  // namespace rows16
