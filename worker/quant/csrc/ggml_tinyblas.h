// llamafile's tinyBLAS (ggml's prompt-processing GEMM, ggml/src/ggml-cpu/llamafile/sgemm.cpp of the pinned
// llama.cpp) for ggml::gemm, run in torch's thread pool.
//
// sgemm.cpp is compiled into this translation unit (the pinned ggml is built without GGML_LLAMAFILE, so
// its library has no llamafile_sgemm): llamafile_sgemm(params, m, n, k, A, lda, B, ldb, C, ldc, ...)
// multiplies weight rows A [m, k] by activation rows B [n, k] into C [n, ldc] float32 (C[j * ldc + i],
// the layout of a linear's output), k and the leading dimensions counted in A's and B's elements (blocks
// for the quantized types). Its float kernel (tinyBLAS: F32 with FMA, BF16 with avx512_bf16's dot
// products) keeps one accumulator per output over k in order and reduces it at the end, whatever tile
// the sizes select; its Q8_0 / Q4_0 kernel (tinyBLAS_Q0_AVX) likewise multiplies each pair of blocks
// and adds it to that output's accumulator in block order in every tile shape (gemm, gemm4xN, gemmMx4).
//
// Threads: the float kernel hands out tiles through params->threadpool (ggml_threadpool_chunk_set/add,
// ggml_barrier). ggml's thread pool must not run beside torch's OpenMP, so those three calls are
// redirected here to a counter of the calling thread's own (Chunks) and each torch thread runs
// llamafile_sgemm as thread 0 of 1 over its own slice of the weight rows (tile: rows per unit of a
// slice, the kernel's largest row tile, so every slice takes the kernel's tiles whole).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <immintrin.h>

#include "ggml-cpu-impl.h"
#include "ggml-cpu.h"
#include "ggml.h"

namespace tinyblas {

// One thread's tile counter, standing in for ggml's thread pool: the pool sgemm.cpp is handed is this.
struct Chunks {
  int next = 0;
};

inline void chunk_set(ggml_threadpool* tp, int value) { reinterpret_cast<Chunks*>(tp)->next = value; }

inline int chunk_add(ggml_threadpool* tp, int value) {
  Chunks* c = reinterpret_cast<Chunks*>(tp);
  const int old = c->next;
  c->next += value;
  return old;
}

}  // namespace tinyblas

#define ggml_threadpool_chunk_set(tp, value) tinyblas::chunk_set(tp, value)
#define ggml_threadpool_chunk_add(tp, value) tinyblas::chunk_add(tp, value)
#define ggml_barrier(tp) ((void)(tp))  // one thread: nothing to wait for
#include "llamafile/sgemm.cpp"
#undef ggml_barrier
#undef ggml_threadpool_chunk_add
#undef ggml_threadpool_chunk_set

namespace tinyblas {

constexpr int64_t TILE = 16;  // weight rows per call of llamafile_sgemm (tinyBLAS's RM * BM at most)

// Asks the CPU to bring bytes [p, p + n) into its L2 cache. tinyBLAS reads four weight rows at once,
// a cache line of each in turn: short interleaved streams that the hardware prefetchers barely follow,
// so a call at a few activation rows would wait on memory. The next TILE rows are requested while the
// current ones are multiplied.
inline void prefetch(const char* p, size_t n) {
  for (size_t off = 0; off < n; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

// C [n, ldc] = B [n, k] . A [m, k]^T, TILE weight rows per call of llamafile_sgemm, slices of them on
// torch's threads; false where llamafile_sgemm does not take these types and sizes on this CPU (it
// checks before computing anything).
inline bool gemm(int64_t m, int64_t n, int64_t k, const void* a, int64_t lda, size_t a_row_bytes,
                 ggml_type a_type, const void* b, int64_t ldb, ggml_type b_type, float* c, int64_t ldc) {
  const int64_t units = (m + TILE - 1) / TILE;
  const char* a_bytes = static_cast<const char*>(a);
  std::atomic<bool> ok{true};
  // a slice of at least 64 weight rows: fewer cost more to hand to a thread than they take to compute
  at::parallel_for(0, units, 4, [&](int64_t lo, int64_t hi) {
    Chunks chunks;
    ggml_compute_params params{};
    params.ith = 0;
    params.nth = 1;
    params.threadpool = reinterpret_cast<ggml_threadpool*>(&chunks);
    for (int64_t u = lo; u < hi && ok.load(std::memory_order_relaxed); ++u) {
      const int64_t first = u * TILE, rows = std::min(first + TILE, m) - first;
      if (u + 1 < hi) prefetch(a_bytes + (first + TILE) * a_row_bytes, std::min(TILE, m - first - TILE) * a_row_bytes);
      if (!llamafile_sgemm(&params, rows, n, k, a_bytes + first * a_row_bytes, lda, b, ldb, c + first, ldc, a_type,
                           b_type, GGML_TYPE_F32)) {
        ok.store(false);
      }
    }
  });
  return ok.load();
}

// One activation row b [k] against weight rows a [m, k] (lda apart) into c [m]: each output computed as
// tinyBLAS's gemm_bloc computes it (sgemm.cpp: one accumulator D, zero to start, madd(load<V>(weight + l),
// load<V>(activation + l), acc) for l = 0, KN, ... < k, then hsum: the same functions, so the same
// value), the weight rows read in order: one stream the CPU's prefetchers follow, where tinyBLAS's
// tiles interleave four rows' short streams (and tinyBLAS itself takes two activation rows or more).
template <int KN, typename D, typename V, typename T>
void gemv(int64_t m, int64_t k, const T* a, int64_t lda, const T* b, float* c) {
  at::parallel_for(0, m, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      D acc = {};
      const T* row = a + lda * i;
      for (int64_t l = 0; l < k; l += KN) acc = madd(load<V>(row + l), load<V>(b + l), acc);
      c[i] = hsum(acc);
    }
  });
}

// gemv with the vector types llamafile_sgemm's tinyBLAS takes for an F32 / BF16 weight on this CPU (its
// own choice, sgemm.cpp: AVX-512 with or without avx512_bf16, AVX / AVX2); false where there is none
// here or k is not whole vectors (the caller then runs tinyBLAS on the row given twice).
inline bool gemv_float(ggml_type t, int64_t m, int64_t k, const void* a, int64_t lda, const void* b, float* c) {
  const auto* af = static_cast<const float*>(a);
  const auto* bf = static_cast<const float*>(b);
  const auto* ah = static_cast<const ggml_bf16_t*>(a);
  const auto* bh = static_cast<const ggml_bf16_t*>(b);
#if defined(__AVX512F__)
  if (t == GGML_TYPE_F32 && k % 16 == 0) return gemv<16, __m512, __m512>(m, k, af, lda, bf, c), true;
#elif defined(__AVX__) || defined(__AVX2__)
  if (t == GGML_TYPE_F32 && k % 8 == 0) return gemv<8, __m256, __m256>(m, k, af, lda, bf, c), true;
#endif
#if defined(__AVX512BF16__)
  if (t == GGML_TYPE_BF16 && k % 32 == 0) return gemv<32, __m512, __m512bh>(m, k, ah, lda, bh, c), true;
#elif defined(__AVX512F__)
  if (t == GGML_TYPE_BF16 && k % 16 == 0) return gemv<16, __m512, __m512>(m, k, ah, lda, bh, c), true;
#elif defined(__AVX2__)
  if (t == GGML_TYPE_BF16 && k % 8 == 0) return gemv<8, __m256, __m256>(m, k, ah, lda, bh, c), true;
#endif
  (void)af, (void)bf, (void)ah, (void)bh;
  return false;
}

}  // namespace tinyblas
