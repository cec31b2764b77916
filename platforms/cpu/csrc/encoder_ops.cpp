// Prompt attention kernels for the CPU, and the encoders' elementwise ones: attention over packed
// variable-length sequences with no padding (encoders, and prompts whose chunk is their whole
// context, from the step's own K and V), attention of prefill chunks over their context in the
// paged KV cache (a chunk past a cached prefix or an earlier chunk), erf GELU, and the residual
// add fused into LayerNorm.
//
// Attention: per (sequence, head), K is widened to float32 and transposed to [D, L] and V
// widened to [L, D] in thread-local buffers; blocks of kRows queries then take their scores 16
// keys at a time (no horizontal sums), a float32 softmax, and P·V in register tiles of
// (query rows, lanes of D). A whole score row of kRows queries is kept: 8 x 4 KiB at a
// 1024-token context. Only the output is rounded to the model dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "simd.h"

namespace {

using namespace runtime_cpu;

constexpr int64_t kRows = 8;  // queries per block: K^T and V loads are shared by these
// P.V's register tile on AVX2: 2 query rows x 4 chunks of D, 8 of its 16 registers (a
// 16 x 512 causal prefill at D = 64 on two Zen 2 cores: 55 ms; 4 x 2 tiles 62 ms). AVX-512
// keeps the whole kRows x NC block, as measured there.
constexpr int64_t kValueRows = kLanes == 16 ? kRows : 2;
constexpr int64_t kValueChunks = kLanes == 16 ? 16 : 4;

inline float hmax(vecf v) {
  float m = v[0];
  for (int64_t i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

struct Buffers {
  std::vector<float> kt, vf, q, s;
  Buffers(int64_t max_len, int64_t d) {
    const int64_t lpad = (max_len + kLanes - 1) / kLanes * kLanes;
    kt.resize(d * (lpad + kLanes));
    vf.resize(max_len * d);
    q.resize(kRows * d);
    s.resize(kRows * lpad);
  }
};

// Where one head's key and value rows are: packed token rows `*_stride` elements apart (the
// step's own K and V), or rows of a paged cache reached through a block table.
template <typename T>
struct PackedRows {
  const T* k;
  int64_t k_stride;
  const T* v;
  int64_t v_stride;
  const T* key(int64_t j) const { return k + j * k_stride; }
  const T* value(int64_t j) const { return v + j * v_stride; }
};

template <typename T>
struct PagedRows {
  const T* k;  // the head's first row in block 0; each row's D contiguous
  const T* v;
  const int32_t* table;
  int64_t block_size, kb_stride, kt_stride, vb_stride, vt_stride;
  const T* key(int64_t j) const {
    return k + table[j / block_size] * kb_stride + (j % block_size) * kt_stride;
  }
  const T* value(int64_t j) const {
    return v + table[j / block_size] * vb_stride + (j % block_size) * vt_stride;
  }
};

// One (sequence, head): `q_rows` queries (rows `q_stride` apart, as those of out) at the last
// positions of `len` keys. NC = D / kLanes.
template <typename T, int NC, typename Rows>
void attend_head(T* out, int64_t out_stride, const T* q, int64_t q_stride, const Rows& keys,
                 int64_t len, int64_t q_rows, float scale, bool causal, Buffers& buf) {
  constexpr int64_t D = NC * kLanes;
  const int64_t lpad = (len + kLanes - 1) / kLanes * kLanes;
  // K^T's rows one vector longer than the keys: at a power-of-two length they would all map to
  // two L1 sets, and the transposing stores (one per row for each key) thrashed them.
  const int64_t kt_stride = lpad + kLanes;
  const int64_t first = len - q_rows;  // the first query's position
  float* kt = buf.kt.data();
  float* vf = buf.vf.data();
  for (int64_t j = 0; j < len; ++j) {
    const T* k = keys.key(j);
    const T* v = keys.value(j);
    for (int64_t d = 0; d < D; ++d) kt[d * kt_stride + j] = static_cast<float>(k[d]);
    for (int64_t c = 0; c < NC; ++c) storev(vf + j * D + c * kLanes, loadv(v + c * kLanes));
  }
  for (int64_t d = 0; d < D; ++d)
    for (int64_t j = len; j < lpad; ++j) kt[d * kt_stride + j] = 0.f;

  float* qf = buf.q.data();
  float* s = buf.s.data();
  for (int64_t i0 = 0; i0 < q_rows; i0 += kRows) {
    const int64_t rows = std::min(kRows, q_rows - i0);
    for (int64_t r = 0; r < kRows; ++r)  // a short last block repeats its last query
      for (int64_t c = 0; c < NC; ++c)
        storev(qf + r * D + c * kLanes,
               loadv(q + (i0 + std::min(r, rows - 1)) * q_stride + c * kLanes) * scale);
    const int64_t n = causal ? first + i0 + rows : len;  // the keys any row of the block sees
    const int64_t npad = (n + kLanes - 1) / kLanes * kLanes;
    for (int64_t j = 0; j < npad; j += kLanes) {
      vecf acc[kRows] = {};
      for (int64_t d = 0; d < D; ++d) {
        const vecf kv = loadv(kt + d * kt_stride + j);
        for (int64_t r = 0; r < kRows; ++r) acc[r] += qf[r * D + d] * kv;
      }
      for (int64_t r = 0; r < kRows; ++r) storev(s + r * lpad + j, acc[r]);
    }
    for (int64_t r = 0; r < kRows; ++r) {
      float* sr = s + r * lpad;
      const int64_t nr = causal ? std::min(first + i0 + r + 1, n) : n;
      for (int64_t j = nr; j < npad; ++j) sr[j] = -std::numeric_limits<float>::infinity();
      vecf mx = loadv(sr);
      for (int64_t j = kLanes; j < npad; j += kLanes) {
        const vecf x = loadv(sr + j);
        mx = x > mx ? x : mx;
      }
      const float m = hmax(mx);
      vecf sum = {};
      for (int64_t j = 0; j < npad; j += kLanes) {
        const vecf e = expv(loadv(sr + j) - m);
        storev(sr + j, e);
        sum += e;
      }
      for (int64_t j = nr; j < npad; ++j) sr[j] = 0.f;  // exp's clamp left ~1e-38 there
      const float inv = 1.f / hsum(sum);
      for (int64_t j = 0; j < npad; j += kLanes) storev(sr + j, loadv(sr + j) * inv);
    }
    // P.V in tiles of kValueRows rows x CT chunks (on AVX2 the whole kRows x NC block is 64
    // accumulators at D = 64, spilled at every FMA).
    constexpr int64_t CT = std::min<int64_t>(NC, kValueChunks);
    for (int64_t r0 = 0; r0 < rows; r0 += kValueRows) {
      for (int64_t c0 = 0; c0 < NC; c0 += CT) {
        vecf o[kValueRows][CT] = {};
        for (int64_t j = 0; j < n; ++j) {
          vecf vj[CT];
          for (int64_t c = 0; c < CT; ++c) vj[c] = loadv(vf + j * D + (c0 + c) * kLanes);
          for (int64_t r = 0; r < kValueRows; ++r) {
            const float p = s[(r0 + r) * lpad + j];
            for (int64_t c = 0; c < CT; ++c) o[r][c] += p * vj[c];
          }
        }
        for (int64_t r = 0; r < std::min(kValueRows, rows - r0); ++r)
          for (int64_t c = 0; c < CT; ++c)
            storev(out + (i0 + r0 + r) * out_stride + (c0 + c) * kLanes, o[r][c]);
      }
    }
  }
}

// The head size in kLanes-wide chunks, checked against those `with_chunks` instantiates.
int64_t checked_chunks(int64_t head_size) {
  const int64_t nc = head_size / kLanes;
  TORCH_CHECK(head_size % kLanes == 0 && (nc == 1 || nc == 2 || nc == 4 || nc == 8 || nc == 16),
              "head size must be 16, 32, 64 or 128");
  return nc;
}

// run(std::integral_constant<int, nc>) for a checked chunk count.
template <typename F>
void with_chunks(int64_t nc, F&& run) {
  switch (nc) {
    case 1: run(std::integral_constant<int, 1>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 4: run(std::integral_constant<int, 4>{}); break;
    case 8: run(std::integral_constant<int, 8>{}); break;
    default: run(std::integral_constant<int, 16>{}); break;
  }
}

template <typename T, int NC>
void encoder_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const int32_t* starts, int64_t num_seqs,
                            int64_t max_len, double scale, bool causal) {
  const int64_t heads = q.size(1), kv_heads = k.size(1), group = heads / kv_heads;
  const int64_t d = q.size(2);
  T* o = out.data_ptr<T>();
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  at::parallel_for(0, num_seqs * heads, 1, [&](int64_t begin, int64_t end) {
    Buffers buf(max_len, d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / heads, h = item % heads, kh = h / group;
      const int64_t t0 = starts[seq], len = starts[seq + 1] - t0;
      if (len == 0) continue;
      const PackedRows<T> keys{kp + t0 * k.stride(0) + kh * k.stride(1), k.stride(0),
                               vp + t0 * v.stride(0) + kh * v.stride(1), v.stride(0)};
      attend_head<T, NC>(o + t0 * out.stride(0) + h * out.stride(1), out.stride(0),
                         qp + t0 * q.stride(0) + h * q.stride(1), q.stride(0), keys, len, len,
                         static_cast<float>(scale), causal, buf);
    }
  });
}

// q [T, H, D], k/v [T, Hkv, D] (token rows may be strided, as slices of a fused qkv output
// are; each head's D contiguous), cu_seqlens [num_seqs + 1] int32 -> out [T, H, D].
at::Tensor encoder_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& cu_seqlens, int64_t max_seq_len, double scale,
                             bool causal) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [T, heads, D]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 &&
                  q.stride(1) == q.size(2) && k.stride(1) == k.size(2) &&
                  v.stride(1) == v.size(2),
              "each token's heads must be contiguous");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2) &&
                  q.size(1) % k.size(1) == 0,
              "k and v must be [T, Hkv, D] with Hkv dividing q's heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "q, k, v must share one dtype");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt && cu_seqlens.is_contiguous() &&
                  cu_seqlens.dim() == 1,
              "cu_seqlens must be contiguous int32 [num_seqs + 1]");
  const int64_t nc = checked_chunks(q.size(2));
  at::Tensor out = at::empty(q.sizes(), q.options());
  const int32_t* starts = cu_seqlens.data_ptr<int32_t>();
  const int64_t num_seqs = cu_seqlens.numel() - 1;
  RUNTIME_CPU_DISPATCH(q.scalar_type(), "encoder_attention", [&] {
    with_chunks(nc, [&](auto nc_const) {
      encoder_attention_impl<scalar_t, decltype(nc_const)::value>(
          out, q, k, v, starts, num_seqs, max_seq_len, scale, causal);
    });
  });
  return out;
}

template <typename T, int NC>
void prefill_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const int32_t* starts, const int32_t* lens, int64_t num_seqs,
                            int64_t max_len, double scale) {
  const int64_t heads = q.size(1), kv_heads = k_cache.size(2), group = heads / kv_heads;
  T* o = out.data_ptr<T>();
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  at::parallel_for(0, num_seqs * heads, 1, [&](int64_t begin, int64_t end) {
    Buffers buf(max_len, q.size(2));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / heads, h = item % heads, kh = h / group;
      const int64_t t0 = starts[seq], q_rows = starts[seq + 1] - t0;
      if (q_rows == 0) continue;
      const PagedRows<T> keys{kp + kh * k_cache.stride(2), vp + kh * v_cache.stride(2),
                              tables + seq * block_tables.stride(0), k_cache.size(1),
                              k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
                              v_cache.stride(1)};
      attend_head<T, NC>(o + t0 * out.stride(0) + h * out.stride(1), out.stride(0),
                         qp + t0 * q.stride(0) + h * q.stride(1), q.stride(0), keys, lens[seq],
                         q_rows, static_cast<float>(scale), true, buf);
    }
  });
}

// Causal attention of prefill chunks over their whole context in the paged cache (the chunk's
// own K and V already written there): q [T, H, D], each head's D contiguous; k_cache/v_cache
// [num_blocks, block_size, Hkv, D] (any strides but D's); block_tables [S, max_blocks] int32;
// cu_seqlens [S + 1] int32 over q's rows; seq_lens [S] int32, each at least its chunk's rows:
// chunk s's queries are the last positions of its seq_lens[s] tokens. -> out [T, H, D].
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& cu_seqlens, const at::Tensor& seq_lens,
                             int64_t max_seq_len, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, heads, D], D contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "k_cache and v_cache must be [num_blocks, block_size, Hkv, D], D contiguous");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0,
              "head sizes differ or Hkv does not divide q's heads");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() &&
                  q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share one dtype");
  const int64_t num_seqs = cu_seqlens.numel() - 1;
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt && cu_seqlens.is_contiguous() &&
                  seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.numel() == num_seqs && block_tables.scalar_type() == at::kInt &&
                  block_tables.stride(1) == 1 && block_tables.size(0) >= num_seqs,
              "cu_seqlens [S + 1], seq_lens [S] and block_tables [S, max_blocks] must be "
              "int32 with contiguous rows");
  const int64_t nc = checked_chunks(q.size(2));
  const int32_t* starts = cu_seqlens.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < num_seqs; ++s)
    TORCH_CHECK(starts[s + 1] - starts[s] <= lens[s] && lens[s] <= max_seq_len &&
                    (lens[s] + k_cache.size(1) - 1) / k_cache.size(1) <= block_tables.size(1),
                "chunk ", s, " has more queries than context, or more context than "
                "max_seq_len or its block table holds");
  at::Tensor out = at::empty(q.sizes(), q.options());
  RUNTIME_CPU_DISPATCH(q.scalar_type(), "prefill_attention", [&] {
    with_chunks(nc, [&](auto nc_const) {
      prefill_attention_impl<scalar_t, decltype(nc_const)::value>(
          out, q, k_cache, v_cache, block_tables, starts, lens, num_seqs, max_seq_len, scale);
    });
  });
  return out;
}

// erf as a rational function of x on [-4, 4] (Eigen's and XLA's float erf: a few ulp; beyond
// 4 erf is +-1 in float32): no exp, one division.
inline vecf erfv(vecf x) {
  x = x > 4.f ? vecf{} + 4.f : x;
  x = x < -4.f ? vecf{} - 4.f : x;
  const vecf x2 = x * x;
  vecf p = x2 * -2.72614225801306e-10f + 2.77068142495902e-08f;
  p = p * x2 - 2.10102402082508e-06f;
  p = p * x2 - 5.69250639462346e-05f;
  p = p * x2 - 7.34990630326855e-04f;
  p = p * x2 - 2.95459980854025e-03f;
  p = p * x2 - 1.60960333262415e-02f;
  vecf q = x2 * -1.45660718464996e-05f - 2.13374055278905e-04f;
  q = q * x2 - 1.68282697438203e-03f;
  q = q * x2 - 7.37332916720468e-03f;
  q = q * x2 - 1.42647390514189e-02f;
  return x * p / q;
}

// gelu(x) = x/2 (1 + erf(x / sqrt 2)) in float32, rounded once to the dtype, as torch's op.
at::Tensor gelu(const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 16 == 0,
              "x must be contiguous with a last dimension that is a multiple of 16");
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.numel();
  RUNTIME_CPU_DISPATCH(x.scalar_type(), "gelu", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, n / kLanes, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin * kLanes; i < end * kLanes; i += kLanes) {
        const vecf v = loadv(src + i);
        storev(dst + i, 0.5f * v * (1.f + erfv(v * 0.70710678118654752f)));
      }
    });
  });
  return out;
}

// LayerNorm(round(x + residual)) * weight + bias, the statistics in float32, rounded once.
at::Tensor add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                          const at::Tensor& weight, const at::Tensor& bias, double eps) {
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous() &&
                  bias.is_contiguous(),
              "inputs must be contiguous");
  TORCH_CHECK(residual.sizes() == x.sizes() && weight.numel() == hidden &&
                  bias.numel() == hidden && hidden % 16 == 0,
              "residual must match x; weight and bias [hidden], a multiple of 16");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() &&
                  weight.scalar_type() == x.scalar_type() &&
                  bias.scalar_type() == x.scalar_type(),
              "inputs must share one dtype");
  at::Tensor out = at::empty_like(x);
  const int64_t rows = x.numel() / hidden;
  RUNTIME_CPU_DISPATCH(x.scalar_type(), "add_layer_norm", [&] {
    using T = scalar_t;
    const T* xp = x.data_ptr<T>();
    const T* rp = residual.data_ptr<T>();
    const T* w = weight.data_ptr<T>();
    const T* b = bias.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> sum(hidden);
      for (int64_t r = begin; r < end; ++r) {
        vecf acc = {};
        for (int64_t d = 0; d < hidden; d += kLanes) {
          const vecf s = roundv<T>(loadv(xp + r * hidden + d) + loadv(rp + r * hidden + d));
          storev(sum.data() + d, s);
          acc += s;
        }
        const float mean = hsum(acc) / static_cast<float>(hidden);
        vecf sq = {};
        for (int64_t d = 0; d < hidden; d += kLanes) {
          const vecf c = loadv(sum.data() + d) - mean;
          sq += c * c;
        }
        const float rstd =
            1.f / std::sqrt(hsum(sq) / static_cast<float>(hidden) + static_cast<float>(eps));
        for (int64_t d = 0; d < hidden; d += kLanes)
          storev(op + r * hidden + d,
                 (loadv(sum.data() + d) - mean) * rstd * loadv(w + d) + loadv(b + d));
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(runtime_cpu, m) {
  m.def("encoder_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, int max_seq_len, "
        "float scale, bool causal) -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor cu_seqlens, Tensor seq_lens, int max_seq_len, float scale) -> Tensor");
  m.def("gelu(Tensor x) -> Tensor");
  m.def("add_layer_norm(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(runtime_cpu, CPU, m) {
  m.impl("encoder_attention", &encoder_attention);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("gelu", &gelu);
  m.impl("add_layer_norm", &add_layer_norm);
}
