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
// llamafile_sgemm as thread 0 of 1 over its own slice of the weight rows, TILE rows per call (the
// kernel's largest row tile, so every call takes its tiles whole). A few activation rows of a float
// weight take few_rows instead: the same sums, the weight rows read in order.
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

// R activation rows b [R, k] (ldb apart) against weight rows a [m, k] (lda apart) into c [R, ldc]: each
// output computed as tinyBLAS's gemm_bloc computes it (sgemm.cpp: one accumulator D, zero to start,
// madd(load<V>(weight + l), load<V>(activation + l), acc) for l = 0, KN, ... < k, then hsum: the same
// functions, so the same value), the weight rows read in order, each vector of one used against the R
// activation rows: one stream the CPU's prefetchers follow, where tinyBLAS's tiles interleave four
// rows' short streams (and tinyBLAS itself takes two activation rows or more).
template <int KN, typename D, typename V, typename T, int R>
void rows_in_order(int64_t m, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb, float* c, int64_t ldc) {
  at::parallel_for(0, m, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      D acc[R] = {};
      const T* row = a + lda * i;
      for (int64_t l = 0; l < k; l += KN) {
        const V av = load<V>(row + l);
        for (int j = 0; j < R; ++j) acc[j] = madd(av, load<V>(b + ldb * j + l), acc[j]);
      }
      for (int j = 0; j < R; ++j) c[ldc * j + i] = hsum(acc[j]);
    }
  });
}

constexpr int64_t FEW = 8;  // activation rows up to which the weight rows are read in order
// ... while those rows take at most this many bytes: they are read again for every weight row and must
// stay in the L1 data cache (32 KiB and more on the x86 cores we serve on) beside the weight's stream
constexpr int64_t FEW_BYTES = 24 * 1024;

template <int KN, typename D, typename V, typename T>
bool few(int64_t rows, int64_t m, int64_t k, const void* a, int64_t lda, const void* b, int64_t ldb, float* c) {
  const auto* at = static_cast<const T*>(a);
  const auto* bt = static_cast<const T*>(b);
  if (k % KN != 0 || m % 4 != 0) return false;  // what tinyBLAS takes: whole vectors, whole 4-row tiles
  if (rows > 1 && rows * k * static_cast<int64_t>(sizeof(T)) > FEW_BYTES) return false;
  switch (rows) {
    case 1: return rows_in_order<KN, D, V, T, 1>(m, k, at, lda, bt, ldb, c, m), true;
    case 2: return rows_in_order<KN, D, V, T, 2>(m, k, at, lda, bt, ldb, c, m), true;
    case 3: return rows_in_order<KN, D, V, T, 3>(m, k, at, lda, bt, ldb, c, m), true;
    case 4: return rows_in_order<KN, D, V, T, 4>(m, k, at, lda, bt, ldb, c, m), true;
    case 5: return rows_in_order<KN, D, V, T, 5>(m, k, at, lda, bt, ldb, c, m), true;
    case 6: return rows_in_order<KN, D, V, T, 6>(m, k, at, lda, bt, ldb, c, m), true;
    case 7: return rows_in_order<KN, D, V, T, 7>(m, k, at, lda, bt, ldb, c, m), true;
    case 8: return rows_in_order<KN, D, V, T, 8>(m, k, at, lda, bt, ldb, c, m), true;
    default: return false;
  }
}

// rows_in_order for up to FEW rows of an F32 / BF16 weight [m, k] into c [rows, m], with the vector types
// llamafile_sgemm's tinyBLAS takes for it on this CPU (its own choice, sgemm.cpp: AVX-512 with or
// without avx512_bf16, AVX / AVX2); false where there is none here, k is not whole vectors, or rows is
// more than FEW or (beyond one) than FEW_BYTES hold (the caller then runs tinyBLAS).
inline bool few_rows(ggml_type t, int64_t rows, int64_t m, int64_t k, const void* a, int64_t lda, const void* b,
                     int64_t ldb, float* c) {
#if defined(__AVX512F__)
  if (t == GGML_TYPE_F32) return few<16, __m512, __m512, float>(rows, m, k, a, lda, b, ldb, c);
#elif defined(__AVX__) || defined(__AVX2__)
  if (t == GGML_TYPE_F32) return few<8, __m256, __m256, float>(rows, m, k, a, lda, b, ldb, c);
#endif
#if defined(__AVX512BF16__)
  if (t == GGML_TYPE_BF16) return few<32, __m512, __m512bh, ggml_bf16_t>(rows, m, k, a, lda, b, ldb, c);
#elif defined(__AVX512F__)
  if (t == GGML_TYPE_BF16) return few<16, __m512, __m512, ggml_bf16_t>(rows, m, k, a, lda, b, ldb, c);
#elif defined(__AVX2__)
  if (t == GGML_TYPE_BF16) return few<8, __m256, __m256, ggml_bf16_t>(rows, m, k, a, lda, b, ldb, c);
#endif
  return false;
}

}  // namespace tinyblas
