// ggml's CPU dot products as torch operators (namespace `ggml`), for weights held as ggml blocks.
//
// ggml::linear(x [T, K] float32|bfloat16, blocks [N, row_bytes] uint8, type, n) -> [T, N] in x's dtype:
// each activation row is quantized once with the weight type's `from_float` into its `vec_dot_type`
// (Q8_0 for Q8_0/Q4_0, Q8_1 for Q4_1, Q8_K for the K-quants; the float types F32, F16 and BF16 are their
// own, and rows of x already in it are read as they are), then `vec_dot` runs over the output rows
// in torch's own thread pool (at::parallel_for), never ggml's. Each output value is one vec_dot of one
// weight row with one activation row, so a row's result does not depend on how many rows share the call
// (F32 and BF16 weights at several rows: the same sums in tiles, ggml_float_tiles.h).
//
// ggml::linear4(x [T, K] float32|bfloat16, packed [N, row_bytes] uint8, type, n) -> [T, N] in x's dtype: the
// same values for Q8_0, Q4_0 and Q4_1 weights, bit for bit, over blocks packed in groups of four rows
// (worker/quant/ggml_kernel.py:pack4), four weight rows against up to four activation rows at a time
// (ggml_quant_rows.h). Raises where N is not whole groups or this build has no four-row form of the type.
//
// ggml::linear16(x [T, K] float32|bfloat16, packed [N, row_bytes] uint8, type, n) -> [T, N] in x's dtype:
// Q8_0 weights in groups of sixteen rows (worker/quant/ggml_kernel.py:pack16), each group's block the
// sixteen rows' lanes of one vector (ggml_rows16.h); activations quantized as for linear. Not vec_dot's
// values bit for bit (each block's sum is exact, then scaled: acc = fma(sum, d_w * d_a, acc) in block
// order), but each output's value whatever the row count. BF16 weights likewise (pack16_float: each
// pair of columns' 16 rows in one vector), against x rounded to bfloat16, the sums in float32. Raises
// where this build has no AVX-512 VNNI (Q8_0) or AVX512_BF16 (BF16) form, for another type, or where N
// is not whole groups.
//
// ggml::gemm(x [T, K] float32|bfloat16, blocks [N, row_bytes] uint8, type, n) -> [T, N] in x's dtype:
// the same product by llamafile's tinyBLAS (ggml_tinyblas.h) for F32, BF16, Q8_0 and Q4_0 weights, the
// activations converted as for linear (F32 weights: float32 rows; BF16: bfloat16 rows; Q8_0 / Q4_0: Q8_0
// blocks by from_float). Up to 8 rows of a float weight run a product computing each output as tinyBLAS
// does with the weight rows read in order (tinyblas::few_rows); tinyBLAS takes two rows or more, so one
// row of blocks goes in twice. Raises
// where this CPU's tinyBLAS does not take the type or sizes (llamafile_sgemm declines: a row length not
// whole vectors, F32 / BF16 weights whose row count is not a multiple of 4).
//
// ggml::quantize(w [N, K] float32, type) -> blocks [N, row_bytes] uint8 (ggml_quantize_chunk, no imatrix).
// ggml::dequantize(blocks [R, row_bytes] uint8, type, k) -> [R, k] float32 (the type's to_float).
// ggml::threads() -> how many of torch's threads this library's at::parallel_for loops run on.
//
// ggml_get_type_traits_cpu is internal to ggml: the version is pinned (worker/quant/ggml_build.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "ggml-cpu.h"
#include "ggml.h"
#include "ggml_float_tiles.h"  // F32 / BF16 weights at several rows: ggml's vec_dot, tiled
#include "ggml_quant_rows.h"   // Q8_0 / Q4_0 / Q4_1 weights: ggml's vec_dot, four weight rows at a time
#include "ggml_rows16.h"       // Q8_0 weights sixteen rows at a time, one lane each (AVX-512 VNNI)
#include "ggml_tinyblas.h"      // llamafile's sgemm, for ggml::gemm

namespace {

bool served(int64_t type) {
  switch (type) {
    case GGML_TYPE_Q8_0:
    case GGML_TYPE_Q4_0:
    case GGML_TYPE_Q4_1:
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q6_K:
    case GGML_TYPE_F32:  // float weights as they are (blocks: the rows' bytes)
    case GGML_TYPE_F16:
    case GGML_TYPE_BF16:
      return true;
    default:
      return false;
  }
}

ggml_type checked(int64_t type, int64_t k) {
  TORCH_CHECK(served(type), "ggml type ", type, " is not served by this operator");
  auto t = static_cast<ggml_type>(type);
  TORCH_CHECK(k % ggml_blck_size(t) == 0, "a row of ", k, " values is not whole ", ggml_type_name(t), " blocks of ",
              ggml_blck_size(t));
  return t;
}

// Rows of x quantized into the vec_dot_type's blocks: [T, row_size(vec_dot_type, K)] bytes.
std::vector<uint8_t> quantize_rows(const at::Tensor& x, const ggml_type_traits_cpu* traits) {
  const int64_t rows = x.size(0), k = x.size(1);
  const size_t row_bytes = ggml_row_size(traits->vec_dot_type, k);
  std::vector<uint8_t> out(rows * row_bytes);
  const auto from_float = ggml_get_type_traits_cpu(traits->vec_dot_type)->from_float;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* base = x.data_ptr();
  at::parallel_for(0, rows, 8, [&](int64_t lo, int64_t hi) {
    std::vector<float> widened(bf16 ? k : 0);
    for (int64_t t = lo; t < hi; ++t) {
      const float* row;
      if (bf16) {
        const c10::BFloat16* src = static_cast<const c10::BFloat16*>(base) + t * k;
        for (int64_t j = 0; j < k; ++j) widened[j] = static_cast<float>(src[j]);
        row = widened.data();
      } else {
        row = static_cast<const float*>(base) + t * k;
      }
      from_float(row, out.data() + t * row_bytes, k);
    }
  });
  return out;
}

// The checks both products make of their arguments; the weight's type. `op` names the operator in errors.
ggml_type checked_call(const char* op, const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), op, " takes x [T, K] on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              " takes float32 or bfloat16 activations");
  const int64_t k = x.size(1);
  const ggml_type t = checked(type, k);
  const size_t w_bytes = ggml_row_size(t, k);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.dim() == 2 &&
                  blocks.size(0) == n && blocks.size(1) == static_cast<int64_t>(w_bytes),
              op, ": blocks must be uint8 [", n, ", ", w_bytes, "] for ", ggml_type_name(t), " rows of ", k);
  return t;
}

// `packed`: blocks in groups of four rows, each group's blocks interleaved (pack4)
at::Tensor product(const at::Tensor& x_in, const at::Tensor& blocks, int64_t type, int64_t n, bool packed) {
  const ggml_type t = checked_call(packed ? "ggml::linear4" : "ggml::linear", x_in, blocks, type, n);
  TORCH_CHECK(!packed || (quant_rows::for_type(t, 1) != nullptr && n % quant_rows::ROWS == 0), "ggml::linear4 takes ",
              ggml_type_name(t), " weights of ", n, " rows only where this CPU runs the four-row product of Q8_0, ",
              "Q4_0 or Q4_1 and the rows are whole groups of ", quant_rows::ROWS);
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  const size_t w_bytes = ggml_row_size(t, k);
  const ggml_type_traits_cpu* traits = ggml_get_type_traits_cpu(t);
  const bool as_is = (traits->vec_dot_type == GGML_TYPE_F32 && x.scalar_type() == at::kFloat) ||
                     (traits->vec_dot_type == GGML_TYPE_BF16 && x.scalar_type() == at::kBFloat16);
  const std::vector<uint8_t> converted = as_is ? std::vector<uint8_t>() : quantize_rows(x, traits);
  const uint8_t* act = as_is ? static_cast<const uint8_t*>(x.data_ptr()) : converted.data();
  const size_t a_bytes = ggml_row_size(traits->vec_dot_type, k);
  const auto vec_dot = traits->vec_dot;
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  at::Tensor out = at::empty({rows, n}, x.options());
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  float* out_f = bf16 ? nullptr : out.data_ptr<float>();
  c10::BFloat16* out_b = bf16 ? out.data_ptr<c10::BFloat16>() : nullptr;
  auto store = [&](int64_t r, int64_t i, float s) {
    if (bf16) {
      out_b[r * n + i] = c10::BFloat16(s);
    } else {
      out_f[r * n + i] = s;
    }
  };
  if (rows > 1 && traits->vec_dot_type == t && tiles::serve(t, k)) {
    if (t == GGML_TYPE_BF16) {
      tiles::linear<tiles::BF16>(w, w_bytes, n, act, a_bytes, rows, k, store);
    } else {
      tiles::linear<tiles::F32>(w, w_bytes, n, act, a_bytes, rows, k, store);
    }
    return out;
  }
  if (packed) {  // groups of four weight rows, their blocks interleaved (read in order, as vec_dot reads a row)
    constexpr int64_t R = quant_rows::ROWS, X = quant_rows::XMAX;
    const int64_t blocks_per_row = k / ggml_blck_size(t);
    // the tile of X activation rows, and of the rows left after the last whole X (resolved once, not per tile)
    const quant_rows::Fn full = quant_rows::for_type(t, X);
    const quant_rows::Fn last = quant_rows::for_type(t, rows % X == 0 ? X : static_cast<int>(rows % X));
    at::parallel_for(0, n / R, 4, [&](int64_t lo, int64_t hi) {
      float s[R * X];
      for (int64_t g = lo; g < hi; ++g) {
        for (int64_t r = 0; r < rows; r += X) {
          const int x = static_cast<int>(std::min<int64_t>(X, rows - r));
          (x == X ? full : last)(blocks_per_row, w + g * R * w_bytes, act + r * a_bytes, a_bytes, s);
          for (int64_t j = 0; j < R; ++j)
            for (int b = 0; b < x; ++b) store(r + b, g * R + j, s[j * x + b]);
        }
      }
    });
    return out;
  }
  // a chunk of at least 16 output rows: below that the thread hand-off costs more than the dot products
  at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const uint8_t* wrow = w + i * w_bytes;
      for (int64_t r = 0; r < rows; ++r) {
        float s;
        vec_dot(static_cast<int>(k), &s, 0, wrow, 0, act + r * a_bytes, 0, 1);
        store(r, i, s);
      }
    }
  });
  return out;
}

// The [rows, n] output of a sixteen-row form (ggml_rows16.h) in the dtype of `options`:
// tile(g, r, x, s) writes the x activation rows from r against weight group g into s ([x][16] floats);
// the groups are shared over torch's threads, up to XMAX activation rows a tile.
template <typename Tile>
at::Tensor rows16_out(int64_t rows, int64_t n, const at::TensorOptions& options, const Tile& tile) {
  at::Tensor out = at::empty({rows, n}, options);
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  constexpr int64_t R = rows16::ROWS, X = rows16::XMAX;
  at::parallel_for(0, n / R, 1, [&](int64_t lo, int64_t hi) {
    alignas(64) float s[R * X];
    for (int64_t g = lo; g < hi; ++g) {
      for (int64_t r = 0; r < rows; r += X) {
        const int xr = static_cast<int>(std::min<int64_t>(X, rows - r));
        tile(g, r, xr, s);
        for (int b = 0; b < xr; ++b) {
          if (bf16) {
            c10::BFloat16* o = out.data_ptr<c10::BFloat16>() + (r + b) * n + g * R;
            for (int64_t j = 0; j < R; ++j) o[j] = c10::BFloat16(s[b * R + j]);
          } else {
            std::memcpy(out.data_ptr<float>() + (r + b) * n + g * R, s + b * R, R * sizeof(float));
          }
        }
      }
    }
  });
  return out;
}

// linear16 of BF16 weights: x's rows rounded to bfloat16 (as x.to(torch.bfloat16) rounds them), the
// sums in float32, returned in x's dtype
at::Tensor linear16_bf16(const at::Tensor& x_in, const at::Tensor& packed, int64_t n) {
  const int64_t k = x_in.size(1);
  TORCH_CHECK(rows16::built_bf16 && n % rows16::ROWS == 0 && k % 4 == 0, "ggml::linear16 takes BF16 weights of ",
              "whole groups of ", rows16::ROWS, " rows and rows of a multiple of 4 values where this CPU has ",
              "AVX512_BF16, not ", n, " rows of ", k, rows16::built_bf16 ? "" : " (this build has no AVX512_BF16)");
  const at::Tensor x = x_in.to(at::kBFloat16).contiguous();
  const int64_t rows = x.size(0);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<uint8_t>());
  const uint16_t* a = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  return rows16_out(rows, n, x_in.options(), [&](int64_t g, int64_t r, int xr, float* s) {
    rows16::tile_bf16_of(xr)(k, w + g * rows16::ROWS * k, a + r * k, s);
  });
}

at::Tensor linear16(const at::Tensor& x_in, const at::Tensor& packed, int64_t type, int64_t n) {
  const ggml_type t = checked_call("ggml::linear16", x_in, packed, type, n);
  if (t == GGML_TYPE_BF16) return linear16_bf16(x_in, packed, n);
  TORCH_CHECK(rows16::built && t == GGML_TYPE_Q8_0 && n % rows16::ROWS == 0, "ggml::linear16 takes Q8_0 weights ",
              "of whole groups of ", rows16::ROWS, " rows where this CPU has AVX-512 VNNI, not ", ggml_type_name(t),
              " weights of ", n, " rows", rows16::built ? "" : " (this build has no AVX-512 VNNI)");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), nb = k / ggml_blck_size(t);
  const std::vector<uint8_t> act = quantize_rows(x, ggml_get_type_traits_cpu(t));
  const size_t a_bytes = ggml_row_size(GGML_TYPE_Q8_0, k);
  std::vector<rows16::ActBlock> info(rows * nb);  // each activation block's scale and -128 * its quants' sum
  at::parallel_for(0, rows, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      for (int64_t ib = 0; ib < nb; ++ib) {
        const uint8_t* b = act.data() + r * a_bytes + ib * rows16::A_BYTES;
        int32_t sum = 0;
        for (int i = 0; i < 32; ++i) sum += static_cast<int8_t>(b[2 + i]);
        ggml_fp16_t d;
        std::memcpy(&d, b, sizeof d);
        info[r * nb + ib] = {ggml_fp16_to_fp32(d), -128 * sum};
      }
    }
  });
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const size_t group_bytes = static_cast<size_t>(nb) * rows16::GROUP_BLOCK;
  return rows16_out(rows, n, x.options(), [&](int64_t g, int64_t r, int xr, float* s) {
    rows16::tile_of(xr)(nb, w + g * group_bytes, act.data() + r * a_bytes, a_bytes, info.data() + r * nb, s);
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t n) {
  return product(x, blocks, type, n, false);
}

at::Tensor linear4(const at::Tensor& x, const at::Tensor& packed, int64_t type, int64_t n) {
  return product(x, packed, type, n, true);
}

bool tinyblas_type(int64_t type) {
  return type == GGML_TYPE_F32 || type == GGML_TYPE_BF16 || type == GGML_TYPE_Q8_0 || type == GGML_TYPE_Q4_0;
}

at::Tensor gemm(const at::Tensor& x_in, const at::Tensor& blocks, int64_t type, int64_t n) {
  TORCH_CHECK(tinyblas_type(type), "ggml::gemm serves F32, BF16, Q8_0 and Q4_0 weights, not ggml type ", type);
  const ggml_type t = checked_call("ggml::gemm", x_in, blocks, type, n);
  const int64_t k = x_in.size(1), rows = x_in.size(0);
  if (rows == 0) return at::empty({0, n}, x_in.options());
  const size_t w_bytes = ggml_row_size(t, k);
  const ggml_type_traits_cpu* traits = ggml_get_type_traits_cpu(t);
  const ggml_type b_type = traits->vec_dot_type;  // F32, BF16 or Q8_0
  const bool as_is = b_type == GGML_TYPE_F32 || b_type == GGML_TYPE_BF16;
  const int64_t lda = static_cast<int64_t>(w_bytes / ggml_type_size(t));
  if (rows <= tinyblas::FEW && as_is) {  // a few rows of a float weight: tinyBLAS's sums, weight rows in order
    const at::Tensor x = x_in.to(b_type == GGML_TYPE_F32 ? at::kFloat : at::kBFloat16).contiguous();
    at::Tensor sums = at::empty({rows, n}, x_in.options().dtype(at::kFloat));
    if (tinyblas::few_rows(t, rows, n, k, blocks.data_ptr<uint8_t>(), lda, x.data_ptr(), k, sums.data_ptr<float>())) {
      return sums.to(x_in.scalar_type());
    }
  }
  // tinyBLAS takes two activation rows or more: one row goes in twice (each output is its own sum)
  at::Tensor x = rows == 1 ? x_in.expand({2, k}).contiguous() : x_in.contiguous();
  if (b_type == GGML_TYPE_F32) x = x.to(at::kFloat);
  if (b_type == GGML_TYPE_BF16) x = x.to(at::kBFloat16);
  const std::vector<uint8_t> converted = as_is ? std::vector<uint8_t>() : quantize_rows(x, traits);
  const void* act = as_is ? x.data_ptr() : static_cast<const void*>(converted.data());
  const int64_t per = ggml_blck_size(t);  // k and the leading dimensions in elements of each type
  const int64_t ldb = static_cast<int64_t>(ggml_row_size(b_type, k) / ggml_type_size(b_type));
  at::Tensor sums = at::empty({x.size(0), n}, x_in.options().dtype(at::kFloat));
  TORCH_CHECK(tinyblas::gemm(n, x.size(0), k / per, blocks.data_ptr<uint8_t>(), lda, w_bytes, t, act, ldb, b_type,
                             sums.data_ptr<float>(), n),
              "ggml::gemm: llamafile's tinyBLAS does not take ", ggml_type_name(t), " weights [", n, ", ", k,
              "] on this CPU");
  if (rows == 1) sums = sums.narrow(0, 0, 1);
  return sums.to(x_in.scalar_type());
}

at::Tensor quantize(const at::Tensor& w_in, int64_t type) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.device().is_cpu(), "ggml::quantize takes w [N, K] on the CPU");
  const at::Tensor w = w_in.to(at::kFloat).contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const ggml_type t = checked(type, k);
  TORCH_CHECK(!ggml_quantize_requires_imatrix(t), ggml_type_name(t), " needs an importance matrix");
  const size_t row_bytes = ggml_row_size(t, k);
  at::Tensor out = at::empty({n, static_cast<int64_t>(row_bytes)}, w.options().dtype(at::kByte));
  const float* src = w.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  ggml_quantize_init(t);  // its tables once, before the threads (thread-safe, but each would wait on it)
  at::parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
    ggml_quantize_chunk(t, src, dst, lo * k, hi - lo, k, nullptr);
  });
  return out;
}

at::Tensor dequantize(const at::Tensor& blocks_in, int64_t type, int64_t k) {
  const at::Tensor blocks = blocks_in.contiguous();
  const ggml_type t = checked(type, k);
  const size_t row_bytes = ggml_row_size(t, k);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.size(1) == static_cast<int64_t>(row_bytes),
              "ggml::dequantize: blocks must be uint8 [R, ", row_bytes, "]");
  const int64_t rows = blocks.size(0);
  at::Tensor out = at::empty({rows, k}, blocks.options().dtype(at::kFloat));
  const auto to_float = ggml_get_type_traits(t)->to_float;
  TORCH_CHECK(to_float != nullptr, "ggml::dequantize: ", ggml_type_name(t), " has no to_float");
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) to_float(src + r * row_bytes, dst + r * k, k);
  });
  return out;
}

// The distinct threads a parallel_for over one index per torch thread runs on: torch's thread count
// where this file was compiled with OpenMP, 1 where it was not (ATen's parallel_for is an inline
// template: compiled without OpenMP it is a serial loop, whatever at::get_num_threads() says).
int64_t threads() {
  const int64_t n = at::get_num_threads();
  std::vector<char> seen(n, 0);
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen[at::get_thread_num()] = 1; });
  int64_t count = 0;
  for (char s : seen) count += s;
  return count;
}

// ggml's CPU tables (fp16 conversion, feature detection) before the first call.
struct Init {
  Init() { ggml_cpu_init(); }
} init;

}  // namespace

TORCH_LIBRARY(ggml, m) {
  m.def("linear(Tensor x, Tensor blocks, int type, int n) -> Tensor");
  m.def("linear4(Tensor x, Tensor packed, int type, int n) -> Tensor");
  m.def("linear16(Tensor x, Tensor packed, int type, int n) -> Tensor");
  m.def("gemm(Tensor x, Tensor blocks, int type, int n) -> Tensor");
  m.def("quantize(Tensor w, int type) -> Tensor");
  m.def("dequantize(Tensor blocks, int type, int k) -> Tensor");
  m.def("threads() -> int", &threads);
}

TORCH_LIBRARY_IMPL(ggml, CPU, m) {
  m.impl("linear", &linear);
  m.impl("linear4", &linear4);
  m.impl("linear16", &linear16);
  m.impl("gemm", &gemm);
  m.impl("quantize", &quantize);
  m.impl("dequantize", &dequantize);
}
