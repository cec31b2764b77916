// Multi-head latent attention (MLA) decode on the CPU, absorbed: one query per sequence and
// head, already in the latent space ([kv_lora_rank | rope] wide), against the sequence's cached
// latents read straight from the paged cache (no gather). Every head of a sequence shares the
// one latent row per token (it is the KV "head" of all of them), so a work item takes up to
// kHeadChunk heads of one sequence and reads each cached row once for all of them: once for
// the scores (the whole row) and once for the weighted sum (its first kv_lora_rank values).
// Work is split over (sequence, head chunk) pairs with at::parallel_for, so it follows
// torch.set_num_threads. Accumulation is in float32 for every dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "simd.h"

namespace {

using namespace runtime_cpu;

constexpr int64_t kHeadChunk = 8;

// scores[g] = q[g] . row for the `heads` query rows of q (float32, `width` apart); the row is
// loaded once per vector for all of them. n is a multiple of 8.
template <typename C>
inline void dot_heads(const float* q, int64_t width, int64_t heads, const C* row, int64_t n,
                      float* scores) {
  vecf acc[kHeadChunk] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    const vecf r = loadv(row + d);
    for (int64_t g = 0; g < heads; ++g) acc[g] += loadv(q + g * width + d) * r;
  }
  for (int64_t g = 0; g < heads; ++g) scores[g] = hsum(acc[g]);
  if (d < n) {  // an 8-wide tail where vectors are 16 wide
    const v8f r = load8(row + d);
    for (int64_t g = 0; g < heads; ++g) scores[g] += hsum(load8(q + g * width + d) * r);
  }
}

template <typename T>
void decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t width = query.size(2), rank = out.size(2);
  const int64_t block_size = cache.size(1);
  const int64_t cb_stride = cache.stride(0), ct_stride = cache.stride(1);
  const int64_t qs_stride = query.stride(0), qh_stride = query.stride(1);
  const int64_t os_stride = out.stride(0), oh_stride = out.stride(1);
  const int64_t bt_stride = block_tables.stride(0);
  const int64_t chunks = (num_heads + kHeadChunk - 1) / kHeadChunk;
  const T* q_ptr = query.data_ptr<T>();
  const T* c_ptr = cache.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  const int32_t* bt_ptr = block_tables.data_ptr<int32_t>();
  const int32_t* len_ptr = seq_lens.data_ptr<int32_t>();
  const float q_scale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(kHeadChunk * width), acc(kHeadChunk * rank), scores, dots(kHeadChunk);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / chunks, h0 = (item % chunks) * kHeadChunk;
      const int64_t heads = std::min(kHeadChunk, num_heads - h0);
      const int64_t len = len_ptr[s];
      const int32_t* table = bt_ptr + s * bt_stride;
      for (int64_t g = 0; g < heads; ++g) {
        const T* src = q_ptr + s * qs_stride + (h0 + g) * qh_stride;
        for (int64_t d = 0; d < width; ++d) q[g * width + d] = static_cast<float>(src[d]) * q_scale;
      }
      scores.resize(heads * len);
      for (int64_t t = 0; t < len; ++t) {
        const T* row = c_ptr + table[t / block_size] * cb_stride + (t % block_size) * ct_stride;
        dot_heads(q.data(), width, heads, row, width, dots.data());
        for (int64_t g = 0; g < heads; ++g) scores[g * len + t] = dots[g];
      }
      float inv[kHeadChunk];
      for (int64_t g = 0; g < heads; ++g)
        inv[g] = 1.f / softmax_numerator(scores.data() + g * len, len);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* row = c_ptr + table[t / block_size] * cb_stride + (t % block_size) * ct_stride;
        for (int64_t d = 0; d < rank; d += 8) {
          const v8f r = load8(row + d);
          for (int64_t g = 0; g < heads; ++g) {
            float* a = acc.data() + g * rank + d;
            store8(a, load8(a) + scores[g * len + t] * r);
          }
        }
      }
      for (int64_t g = 0; g < heads; ++g) {
        T* dst = o_ptr + s * os_stride + (h0 + g) * oh_stride;
        for (int64_t d = 0; d < rank; ++d) dst[d] = static_cast<T>(acc[g * rank + d] * inv[g]);
      }
    }
  });
}

// out [num_seqs, num_heads, kv_lora_rank] <- softmax(scale * q . latents) . latents[:rank],
// q [num_seqs, num_heads, kv_lora_rank + rope] and the cache
// [num_blocks, block_size, kv_lora_rank + rope] in one dtype.
void mla_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& cache,
                const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && cache.dim() == 3 &&
                  out.size(0) == query.size(0) && out.size(1) == query.size(1) &&
                  query.size(2) == cache.size(2) && out.size(2) <= query.size(2),
              "query must be [num_seqs, num_heads, kv_lora_rank + rope], out [num_seqs, "
              "num_heads, kv_lora_rank], the cache [num_blocks, block_size, kv_lora_rank + rope]");
  TORCH_CHECK(query.scalar_type() == cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "query, out and the cache must share one dtype");
  TORCH_CHECK(query.size(2) % 8 == 0 && out.size(2) % 8 == 0,
              "kv_lora_rank and rope must be multiples of 8");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && cache.stride(2) == 1,
              "the latent dimension must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  seq_lens.is_contiguous() && block_tables.stride(1) == 1,
              "block_tables and seq_lens must be int32 with contiguous rows");
  RUNTIME_CPU_DISPATCH(query.scalar_type(), "mla_decode", [&] {
    decode<scalar_t>(out, query, cache, block_tables, seq_lens, scale);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(runtime_cpu, m) {
  m.def("mla_decode(Tensor(a!) out, Tensor query, Tensor cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(runtime_cpu, CPU, m) { m.impl("mla_decode", &mla_decode); }
