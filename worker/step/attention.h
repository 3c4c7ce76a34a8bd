// Batch-invariant attention over the block-table KV cache (worker/step/fused.cpp includes this file;
// worker/step/fused.py builds both as one module and hashes both into its build key).
//
// One operator for every row of a step: a decode token, a prompt token of a prefill chunk, a token of
// the prefill that rebuilds a migrated sequence's cache. Row t attends to the first lens[t] keys of
// the block table tables[seq[t]], and its output is a function of its query, those keys and values
// and nothing else: every sum is written out here in one order that depends on the key position and
// the head size only, never on the step's rows, the table's width, the chunking or the threads (a
// thread computes whole rows of a KV head). The keys of a row are one split read in position order
// (the fixed-split recipe with one split: a row is never divided between threads, so no partial
// results are combined); the keys of a KV head are read once for the group's query heads, and for
// up to kMaxRows consecutive rows of one table (a prefill chunk's), which share them: what is shared
// is the load, never a sum.
//   * a score q . k sums D products in 16 lanes (lane l: the products at l, l + 16, ... in order),
//     then the lanes in a fixed tree (hsum);
//   * the softmax's maximum is taken over the row's scores (exact in any order);
//   * exp is one polynomial written out here (no libm call whose vector form could differ);
//   * the probabilities and the weighted values are summed over keys in position order.
// The 16 lanes are 16 separate float accumulators (a GCC/Clang vector type), so a compiler using one
// 512-bit register or two 256-bit ones computes the same sums. Built with -ffp-contract=off: no
// fused multiply-adds, so a build on another x86 CPU gives the same bits.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace paged {
namespace {  // internal: inlined, not exported through the PLT

constexpr int64_t kLanes = 16;  // independent partial sums of a dot product

template <typename T> inline float widen(T v) { return static_cast<float>(v); }

// Calls f with a typed null pointer for float32, bfloat16 or float16 (every operator of fused.cpp
// dispatches its dtypes through this).
template <typename F> void by_float(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: f(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::kHalf: f(static_cast<c10::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "fused step: unsupported dtype ", t, " (float32, bfloat16 or float16)");
  }
}

// exp(x) for x <= 0 (a score minus the row's maximum): Cephes' expf polynomial, ~1 ulp; below -87
// it returns about 1e-38 instead of 0 (a weight no float32 sum of ones can see).
inline float exp_neg(float x) {
  x = std::max(x, -87.0f);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return y * two_n;
}

// Sixteen float lanes as one value (GCC/Clang vector extension): each lane is its own accumulator,
// so the sums are the same whether the compiler uses one 512-bit register or two 256-bit ones.
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
static_assert(kLanes == 16, "v16 holds kLanes lanes");

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// GCC 12+ and Clang take lanes out of a vector with __builtin_shufflevector (hsum16 in registers); an
// older GCC (11, say) sums through memory, hsum by hsum: the same adds, slower.
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector) && !defined(LLAMADEPLOY_NO_SHUFFLE)
#define LLAMADEPLOY_SHUFFLE 1
#endif
#endif

// The lanes of `v` summed in a fixed tree: lane l += lane l + 8, then + 4, + 2, + 1 (hsum16 sums 16
// vectors this way at once; this form is its fallback).
inline float hsum(v16 v) {
  v8 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  const v8 a = lo + hi;
  v4 c, d;
  std::memcpy(&c, &a, sizeof c);
  std::memcpy(&d, reinterpret_cast<const char*>(&a) + sizeof c, sizeof d);
  const v4 b = c + d;
  const float e0 = b[0] + b[2], e1 = b[1] + b[3];
  return e0 + e1;
}

// hsum of 16 vectors at once: out[j] = hsum(v[j]), each lane's sum the same tree of the same adds
// (lane l + l + 8, then + 4, + 2, + 1), with 15 vector adds instead of 16 scalar trees. Each step
// pairs two vectors; one shuffle takes the lower lanes of each group of both, the other the upper.
inline v16 hsum16(v16* v) {
#ifdef LLAMADEPLOY_SHUFFLE
  v16 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // distance 8: w[i] = a(v[2i]) | a(v[2i + 1])
    w[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // distance 4 within each group of 8
    x[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // distance 2 within each group of 4
    y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  // distance 1: lane j = e0 + e1 of v[j]
  return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  float out[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) out[j] = hsum(v[j]);
  return load16(out);
#endif
}

// Up to 16 values of a cache row from `src` (n of them; the other lanes zero), widened to float.
// A full group of float32 or bfloat16 is read as one vector (built from scalars on the stack, a
// wide load after narrow stores would stall on store forwarding at every key).
template <typename C> inline v16 widen16(const C* src, int64_t n) {
  float t[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) t[l] = l < n ? widen(src[l]) : 0.f;
  return load16(t);
}

template <> inline v16 widen16<float>(const float* src, int64_t n) {
  if (n == kLanes) return load16(src);
  float t[kLanes] = {0.f};
  std::memcpy(t, src, n * sizeof(float));
  return load16(t);
}

typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

template <> inline v16 widen16<c10::BFloat16>(const c10::BFloat16* src, int64_t n) {
  u16x16 h = {};
  std::memcpy(&h, src, n * sizeof(uint16_t));  // bfloat16 is float32's upper half
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  v16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

constexpr int64_t kMaxChunks = 16;  // head_dim up to 256: a row of keys is at most 16 lane groups
constexpr int64_t kMaxGroup = 8;    // query heads per KV head whose value sums are kept in locals

// Scratch of one thread: the group's scaled queries and outputs [G, chunks] lane groups (zero
// past D), its scores [G, len].
struct Scratch {
  std::vector<float> q, out, scores;  // floats, read and written as v16 through memcpy (no alignment)
  Scratch(int64_t G, int64_t chunks, int64_t longest)
      : q(G * chunks * kLanes), out(G * chunks * kLanes), scores(G * longest) {}
};

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

constexpr int64_t kMaxRows = 8;  // rows of one block table attended together (their keys read once)

// total[g] = the sum of r[g * stride + p] over p < len, in position order, for N heads at once:
// N independent chains, each in its own order.
template <int N>
inline void sum_heads(const float* r, int64_t stride, int64_t len, float* total) {
  float t[N] = {};
  for (int64_t p = 0; p < len; ++p)
    for (int g = 0; g < N; ++g) t[g] += r[g * stride + p];
  for (int g = 0; g < N; ++g) total[g] = t[g];
}

// The softmax of G heads' scores (head g's at sc + g * stride, `len` of them), in place: each score
// minus its head's maximum, exponentiated (exp_neg); total[g] their sum in position order (four
// heads' sums at a time: separate chains).
inline void softmax_heads(float* sc, int64_t stride, int64_t len, int64_t G, float* total) {
  for (int64_t g = 0; g < G; ++g) {
    float* r = sc + g * stride;
    float top = r[0];
    for (int64_t p = 1; p < len; ++p) top = r[p] > top ? r[p] : top;
    for (int64_t p = 0; p < len; ++p) r[p] = exp_neg(r[p] - top);
  }
  for (int64_t g = 0; g < G; g += 4) {
    const float* r = sc + g * stride;
    switch (std::min<int64_t>(4, G - g)) {
      case 4: sum_heads<4>(r, stride, len, total + g); break;
      case 3: sum_heads<3>(r, stride, len, total + g); break;
      case 2: sum_heads<2>(r, stride, len, total + g); break;
      default: sum_heads<1>(r, stride, len, total + g);
    }
  }
}

// The cache row of position p of a block table.
template <typename C>
inline const C* at_position(const C* kv, const int64_t* table, int64_t p, int64_t block, int64_t row) {
  return kv + (table[p / block] * block + p % block) * row;
}

// R rows (1 <= R <= kMaxRows) of one block table, row r attending to its first lens[r] keys: their
// G query heads of KV head `kvh` each (queries in s.q, R * G vectors of `chunks` lane groups, zero
// past D) give s.out [R * G] softmax(scores) . values, unnormalised, and total [R * G] the softmax's
// sums. Keys, then values, are read 16 positions at a time, widened once for every row and head.
// Each score sums its D products in 16 lanes (lane l: the products at l, l + 16, ...), then the
// lanes in hsum's tree (hsum16: 16 scores at once, the same adds); each sum over keys runs in
// position order. So a vector's outputs are the same whatever R and whichever rows share its group.
// CH: the lane groups (D / 16) when known at compile time (the vectors then stay in registers), 0
// for any D; the arithmetic is the same either way.
template <typename C, int64_t CH>
void attend_rows(const C* kv, const int64_t* table, const int64_t* lens, int64_t R, int64_t block, int64_t KVH,
                 int64_t kvh, int64_t G, int64_t D, Scratch& s, float* total) {
  constexpr int64_t NC = CH ? CH : kMaxChunks;  // the arrays' lane groups
  const int64_t chunks = CH ? CH : (D + kLanes - 1) / kLanes, width = chunks * kLanes;
  const int64_t row = 2 * KVH * D, V = R * G;
  // lane group c of a cache row: its 16 values, or (any D) those left before D
  const auto take = [&](const C* src, int64_t c) {
    return widen16(src + c * kLanes, CH ? kLanes : std::min(kLanes, D - c * kLanes));
  };
  int64_t L = 0;
  for (int64_t r = 0; r < R; ++r) L = std::max(L, lens[r]);
  float* sc = s.scores.data();  // [V, L]
  v16 kb[kLanes][NC], acc[kLanes];
  for (int64_t p0 = 0; p0 < L; p0 += kLanes) {
    const int64_t n = std::min(kLanes, L - p0);
    for (int64_t j = 0; j < n; ++j) {
      const C* k = at_position(kv, table, p0 + j, block, row) + kvh * D;
      for (int64_t c = 0; c < chunks; ++c) kb[j][c] = take(k, c);
    }
    for (int64_t v = 0; v < V; ++v) {
      const int64_t nv = std::min(kLanes, lens[v / G] - p0);
      if (nv <= 0) continue;
      v16 qv[NC];
      for (int64_t c = 0; c < chunks; ++c) qv[c] = load16(s.q.data() + v * width + c * kLanes);
      for (int64_t j = 0; j < nv; ++j) {
        v16 a = qv[0] * kb[j][0];
        for (int64_t c = 1; c < chunks; ++c) a += qv[c] * kb[j][c];
        acc[j] = a;
      }
      for (int64_t j = nv; j < kLanes; ++j) acc[j] = v16{};
      const v16 scores = hsum16(acc);
      std::memcpy(sc + v * L + p0, &scores, nv * sizeof(float));
    }
  }
  for (int64_t r = 0; r < R; ++r) softmax_heads(sc + r * G * L, L, lens[r], G, total + r * G);
  if constexpr (CH > 0) {
    if (R == 1 && G <= kMaxGroup) {  // one row: its heads' sums in locals (registers) over all its keys
      v16 out[kMaxGroup][CH] = {};
      for (int64_t p = 0; p < L; ++p) {
        const C* x = at_position(kv, table, p, block, row) + (KVH + kvh) * D;
        for (int64_t c = 0; c < CH; ++c) kb[0][c] = take(x, c);
        for (int64_t g = 0; g < G; ++g) {
          const float w = sc[g * L + p];
          for (int64_t c = 0; c < CH; ++c) out[g][c] = out[g][c] + w * kb[0][c];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < CH; ++c) store16(s.out.data() + (g * CH + c) * kLanes, out[g][c]);
      return;
    }
  }
  std::fill(s.out.begin(), s.out.begin() + V * width, 0.f);
  for (int64_t p0 = 0; p0 < L; p0 += kLanes) {
    const int64_t n = std::min(kLanes, L - p0);
    for (int64_t j = 0; j < n; ++j) {
      const C* x = at_position(kv, table, p0 + j, block, row) + (KVH + kvh) * D;
      for (int64_t c = 0; c < chunks; ++c) kb[j][c] = take(x, c);
    }
    for (int64_t v = 0; v < V; ++v) {
      const int64_t nv = std::min(kLanes, lens[v / G] - p0);
      if (nv <= 0) continue;
      float* o = s.out.data() + v * width;
      const float* w = sc + v * L + p0;
      v16 a[NC];
      for (int64_t c = 0; c < chunks; ++c) a[c] = load16(o + c * kLanes);
      for (int64_t j = 0; j < nv; ++j)
        for (int64_t c = 0; c < chunks; ++c) a[c] = a[c] + w[j] * kb[j][c];
      for (int64_t c = 0; c < chunks; ++c) store16(o + c * kLanes, a[c]);
    }
  }
}

}  // namespace

// q [T, H, D] (rows may be strided; any float dtype) over kv [S, 2, KVH, D] (float32, bfloat16 or
// float16, contiguous): row t attends to the first lens[t] keys of block table tables[seq[t]]
// ([N, W] block ids of `block` tokens; seq empty: row t reads table t). Returns [T, H * D] in
// out_dtype. Work is split over (row, KV head) pairs in torch's thread pool.
inline at::Tensor attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables, const at::Tensor& seq,
                            const at::Tensor& lens, int64_t block, double scale, at::ScalarType out_dtype) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "paged attention: q [T, H, D] rows");
  TORCH_CHECK(kv.dim() == 4 && kv.is_contiguous() && kv.size(1) == 2 && kv.size(3) == q.size(2));
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = kv.size(2);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "paged attention: query heads not a multiple of KV heads");
  TORCH_CHECK(D <= kMaxChunks * kLanes, "paged attention: head_dim over ", kMaxChunks * kLanes);
  const int64_t G = H / KVH;
  auto tb = tables.to(at::kLong).contiguous();
  auto ln = lens.to(at::kLong).contiguous();
  auto sq = seq.to(at::kLong).contiguous();
  TORCH_CHECK(tb.dim() == 2 && ln.numel() == T && (sq.numel() == 0 || sq.numel() == T));
  const int64_t N = tb.size(0), W = tb.size(1), S = kv.size(0);
  const int64_t* pt = tb.data_ptr<int64_t>();
  const int64_t* pl = ln.data_ptr<int64_t>();
  const int64_t* ps = sq.numel() ? sq.data_ptr<int64_t>() : nullptr;
  int64_t longest = 1;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t i = ps ? ps[t] : t;
    TORCH_CHECK(i >= 0 && i < N, "paged attention: row ", t, " names table ", i, " of ", N);
    TORCH_CHECK(pl[t] >= 1 && pl[t] <= W * block, "paged attention: row ", t, "'s context is out of its table");
    longest = std::max(longest, pl[t]);
  }
  for (int64_t i = 0; i < N * W; ++i) TORCH_CHECK(pt[i] >= 0 && (pt[i] + 1) * block <= S, "paged attention: block id");
  auto out = at::empty({T, H * D}, q.options().dtype(out_dtype));
  auto qf = q.to(at::kFloat);  // widened once; the scale is applied to it, as SDPA scales q
  const int64_t qs = qf.stride(0);
  const float fscale = static_cast<float>(scale);
  const float* pq = qf.data_ptr<float>();
  // Rows in groups of up to kMaxRows consecutive rows of one table (a prefill chunk's), whose keys are
  // then read once for the group; a row's arithmetic does not depend on its group (attend_rows).
  std::vector<int64_t> starts;
  int64_t widest = 1;
  for (int64_t t = 0; t < T; ++t) {
    const bool same = !starts.empty() && t - starts.back() < kMaxRows && ps && ps[t] == ps[t - 1];
    if (!same) starts.push_back(t);
    widest = std::max(widest, t + 1 - starts.back());
  }
  starts.push_back(T);
  const int64_t groups = static_cast<int64_t>(starts.size()) - 1;
  const int64_t per_item = longest * G * D * widest;  // about the work of one (group, KV head)
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(per_item, 1));
  by_float(kv.scalar_type(), [&](auto* ctag) {
    using C = std::remove_pointer_t<decltype(ctag)>;
    by_float(out_dtype, [&](auto* otag) {
      using O = std::remove_pointer_t<decltype(otag)>;
      const C* pkv = static_cast<const C*>(kv.data_ptr());
      O* po = static_cast<O*>(out.data_ptr());
      at::parallel_for(0, groups * KVH, grain, [&](int64_t begin, int64_t end) {
        const int64_t chunks = (D + kLanes - 1) / kLanes;
        Scratch s(widest * G, chunks, longest);
        std::vector<float> total(widest * G), lanes(chunks * kLanes);
        for (int64_t i = begin; i < end; ++i) {
          const int64_t t0 = starts[i / KVH], R = starts[i / KVH + 1] - t0, kvh = i % KVH;
          for (int64_t v = 0; v < R * G; ++v) {
            const float* src = pq + (t0 + v / G) * qs + (kvh * G + v % G) * D;
            for (int64_t e = 0; e < chunks * kLanes; ++e) lanes[e] = e < D ? src[e] * fscale : 0.f;
            std::memcpy(s.q.data() + v * chunks * kLanes, lanes.data(), lanes.size() * sizeof(float));
          }
          const int64_t* table = pt + (ps ? ps[t0] : t0) * W;
          if (D == 64)
            attend_rows<C, 4>(pkv, table, pl + t0, R, block, KVH, kvh, G, D, s, total.data());
          else if (D == 128)
            attend_rows<C, 8>(pkv, table, pl + t0, R, block, KVH, kvh, G, D, s, total.data());
          else
            attend_rows<C, 0>(pkv, table, pl + t0, R, block, KVH, kvh, G, D, s, total.data());
          for (int64_t v = 0; v < R * G; ++v) {
            O* dst = po + (t0 + v / G) * H * D + (kvh * G + v % G) * D;
            std::memcpy(lanes.data(), s.out.data() + v * chunks * kLanes, lanes.size() * sizeof(float));
            for (int64_t e = 0; e < D; ++e) dst[e] = static_cast<O>(lanes[e] / total[v]);
          }
        }
      });
    });
  });
  return out;
}

}  // namespace paged
