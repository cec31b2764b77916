// Multi-LoRA for the CPU: punica's shrink (x @ A[slot].T) and expand (y += buf @ B[slot].T) over
// the step's tokens grouped by adapter slot (runs of `token_indices`, one per slot, computed once
// per step). Work is cut into (run, block of tokens, block of rows or columns) units, so each
// block of an adapter's matrix is read from memory once per block of tokens that uses it; sums
// are float32 whatever the dtype of x, y and the weights.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

using namespace runtime_cpu;

constexpr int64_t kTokenBlock = 16;  // tokens of one run sharing each block of weights
constexpr int64_t kTile = 4;         // tokens in registers at once
constexpr int64_t kRowTile = 4;      // rows of A in registers at once in shrink
constexpr int64_t kRowBlock = 16;    // rows of A per shrink unit
constexpr int64_t kColVecs = 4;      // vectors of y's columns per expand unit
// Below this many multiply-adds a call runs on the calling thread (waking the pool costs more).
// A decode step's calls (1-3M for SmolLM2 at batch 64) gain from the pool on a quiet host: with
// the threshold at 4M instead, 4 adapters' calls over 64 prompts x 40 tokens took 1.03 s instead
// of 0.80 s (2 threads, in the engine).
constexpr int64_t kParallelWork = int64_t(1) << 16;

// at::parallel_for's grain: every unit in one chunk (no parallel region) for small calls.
int64_t grain(int64_t units, int64_t work) { return work < kParallelWork ? units : 1; }

struct Runs {
  const int64_t* tokens;                       // the tokens with an adapter, grouped by slot
  std::vector<std::array<int64_t, 3>> blocks;  // (slot, begin, end) in `tokens`
};

Runs token_blocks(const at::Tensor& token_indices, const at::Tensor& seg_starts,
                  const at::Tensor& seg_slots) {
  TORCH_CHECK(token_indices.scalar_type() == at::kLong && seg_starts.scalar_type() == at::kLong &&
                  seg_slots.scalar_type() == at::kLong && token_indices.is_contiguous() &&
                  seg_starts.is_contiguous() && seg_slots.is_contiguous(),
              "token_indices, seg_starts and seg_slots must be contiguous int64");
  TORCH_CHECK(seg_starts.numel() == seg_slots.numel() + 1, "one more run start than slots");
  Runs runs{token_indices.data_ptr<int64_t>(), {}};
  const int64_t* starts = seg_starts.data_ptr<int64_t>();
  const int64_t* slots = seg_slots.data_ptr<int64_t>();
  for (int64_t g = 0; g < seg_slots.numel(); ++g)
    for (int64_t i = starts[g]; i < starts[g + 1]; i += kTokenBlock)
      runs.blocks.push_back({slots[g], i, std::min(i + kTokenBlock, starts[g + 1])});
  return runs;
}

// sums[k][m] = x[k] . a[m] for kTile tokens and kRowTile rows of A, in float32.
template <typename T>
inline void dot_tile(float (*sums)[kRowTile], const T* const* ar, const T* const* xr,
                     int64_t d_in) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (d_in % 32 == 0) {  // 32 bf16 products per instruction, summed in float32
      __m512 acc[kTile][kRowTile] = {};
      for (int64_t d = 0; d < d_in; d += 32) {
        __m512bh av[kRowTile];
        for (int64_t m = 0; m < kRowTile; ++m) av[m] = (__m512bh)_mm512_loadu_si512(ar[m] + d);
        for (int64_t k = 0; k < kTile; ++k) {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr[k] + d);
          for (int64_t m = 0; m < kRowTile; ++m)
            acc[k][m] = _mm512_dpbf16_ps(acc[k][m], av[m], xv);
        }
      }
      for (int64_t k = 0; k < kTile; ++k)
        for (int64_t m = 0; m < kRowTile; ++m) sums[k][m] = _mm512_reduce_add_ps(acc[k][m]);
      return;
    }
  }
#endif
  vecf acc[kTile][kRowTile] = {};
  for (int64_t d = 0; d < d_in; d += kLanes) {
    vecf av[kRowTile];
    for (int64_t m = 0; m < kRowTile; ++m) av[m] = loadv(ar[m] + d);
    for (int64_t k = 0; k < kTile; ++k) {
      const vecf xv = loadv(xr[k] + d);
      for (int64_t m = 0; m < kRowTile; ++m) acc[k][m] += av[m] * xv;
    }
  }
  for (int64_t k = 0; k < kTile; ++k)
    for (int64_t m = 0; m < kRowTile; ++m) sums[k][m] = hsum(acc[k][m]);
}

// out[s, t, r] = x[t] . a[slot, s, r] for row j = s * rank + r of the slot's A.
template <typename T>
void shrink_rows(float* out, const T* x, int64_t x_stride, const T* a, const Runs& runs,
                 int64_t rows, int64_t rank, int64_t d_in, int64_t num_tokens) {
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t units = static_cast<int64_t>(runs.blocks.size()) * row_blocks;
  const int64_t work = static_cast<int64_t>(runs.blocks.size()) * kTokenBlock * rows * d_in;
  at::parallel_for(0, units, grain(units, work), [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const auto& [slot, tb, te] = runs.blocks[u / row_blocks];
      const int64_t j0 = (u % row_blocks) * kRowBlock, j1 = std::min(j0 + kRowBlock, rows);
      for (int64_t i = tb; i < te; i += kTile) {
        const int64_t n = std::min(kTile, te - i);
        const T* xr[kTile];  // a short tile repeats its last token
        for (int64_t k = 0; k < kTile; ++k)
          xr[k] = x + runs.tokens[i + std::min(k, n - 1)] * x_stride;
        for (int64_t j = j0; j < j1; j += kRowTile) {
          const int64_t nr = std::min(kRowTile, j1 - j);
          const T* ar[kRowTile];
          for (int64_t m = 0; m < kRowTile; ++m)
            ar[m] = a + (slot * rows + j + std::min(m, nr - 1)) * d_in;
          float sums[kTile][kRowTile];
          dot_tile(sums, ar, xr, d_in);
          for (int64_t m = 0; m < nr; ++m) {
            float* o = out + ((j + m) / rank) * num_tokens * rank + (j + m) % rank;
            for (int64_t k = 0; k < n; ++k) o[runs.tokens[i + k] * rank] = sums[k][m];
          }
        }
      }
    }
  });
}

at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& a, const at::Tensor& token_indices,
                       const at::Tensor& seg_starts, const at::Tensor& seg_slots) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && a.dim() == 4 && a.is_contiguous(),
              "x must be [tokens, in] with contiguous rows, a contiguous [slots, slices, rank, in]");
  TORCH_CHECK(x.size(1) == a.size(3) && x.size(1) % kLanes == 0,
              "x and a must share the input size, a multiple of the vector width");
  TORCH_CHECK(x.scalar_type() == a.scalar_type(), "x and a must share one dtype");
  const Runs runs = token_blocks(token_indices, seg_starts, seg_slots);
  const int64_t num_tokens = x.size(0), rank = a.size(2);
  at::Tensor out = at::zeros({a.size(1), num_tokens, rank}, x.options().dtype(at::kFloat));
  RUNTIME_CPU_DISPATCH(x.scalar_type(), "lora_shrink", [&] {
    shrink_rows<scalar_t>(out.data_ptr<float>(), x.data_ptr<scalar_t>(), x.stride(0),
                          a.data_ptr<scalar_t>(), runs, a.size(1) * rank, rank, a.size(3),
                          num_tokens);
  });
  return out;
}

// y[t, c] += sum_r buf[s, t, r] * b[slot, c, r] for the columns c of slice s; b's columns are
// contiguous (it is stored [slots, rank, out]), so a unit's block of b is rank short rows,
// widened to float32 once for the unit's tokens.
template <typename T>
void expand_cols(T* y, int64_t y_stride, const float* buf, const T* b, int64_t b_slot_stride,
                 int64_t b_rank_stride, const Runs& runs, const std::vector<int64_t>& offsets,
                 int64_t rank, int64_t num_tokens) {
  constexpr int64_t width = kColVecs * kLanes;
  std::vector<std::array<int64_t, 3>> cols;  // (slice, first column, vectors)
  for (size_t s = 0; s + 1 < offsets.size(); ++s)
    for (int64_t c = offsets[s]; c < offsets[s + 1]; c += width)
      cols.push_back({static_cast<int64_t>(s), c, std::min(width, offsets[s + 1] - c) / kLanes});
  const int64_t col_blocks = static_cast<int64_t>(cols.size());
  const int64_t units = static_cast<int64_t>(runs.blocks.size()) * col_blocks;
  const int64_t work = static_cast<int64_t>(runs.blocks.size()) * kTokenBlock * rank *
                       offsets.back();
  at::parallel_for(0, units, grain(units, work), [&](int64_t begin, int64_t end) {
    std::vector<float> block(rank * width);
    for (int64_t u = begin; u < end; ++u) {
      const auto& [slot, tb, te] = runs.blocks[u / col_blocks];
      const auto& [s, c0, nv] = cols[u % col_blocks];
      const T* bcol = b + slot * b_slot_stride + c0;
      float* bl = block.data();
      for (int64_t r = 0; r < rank; ++r)
        for (int64_t v = 0; v < kColVecs; ++v)
          storev(bl + r * width + v * kLanes,
                 v < nv ? loadv(bcol + r * b_rank_stride + v * kLanes) : vecf{});
      for (int64_t i = tb; i < te; i += kTile) {
        const int64_t n = std::min(kTile, te - i);
        const float* bufrow[kTile];  // a short tile repeats its last token
        for (int64_t k = 0; k < kTile; ++k)
          bufrow[k] = buf + (s * num_tokens + runs.tokens[i + std::min(k, n - 1)]) * rank;
        vecf acc[kTile][kColVecs] = {};
        for (int64_t r = 0; r < rank; ++r) {
          vecf bv[kColVecs];
          for (int64_t v = 0; v < kColVecs; ++v) bv[v] = loadv(bl + r * width + v * kLanes);
          for (int64_t k = 0; k < kTile; ++k) {
            const vecf coef = vecf{} + bufrow[k][r];
            for (int64_t v = 0; v < kColVecs; ++v) acc[k][v] += coef * bv[v];
          }
        }
        for (int64_t k = 0; k < n; ++k) {
          T* yrow = y + runs.tokens[i + k] * y_stride + c0;
          for (int64_t v = 0; v < nv; ++v)
            storev(yrow + v * kLanes, loadv(yrow + v * kLanes) + acc[k][v]);
        }
      }
    }
  });
}

at::Tensor lora_expand(at::Tensor y, const at::Tensor& buf, const at::Tensor& b,
                       const at::Tensor& token_indices, const at::Tensor& seg_starts,
                       const at::Tensor& seg_slots, at::IntArrayRef offsets) {
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && b.dim() == 3 && b.stride(1) == 1,
              "y must be [tokens, out] with contiguous rows, b [slots, out, rank] stored with "
              "contiguous columns ([slots, rank, out])");
  TORCH_CHECK(buf.is_contiguous() && buf.scalar_type() == at::kFloat && buf.dim() == 3 &&
                  buf.size(1) == y.size(0) && buf.size(2) == b.size(2),
              "buf must be contiguous float32 [slices, tokens, rank]");
  TORCH_CHECK(y.scalar_type() == b.scalar_type(), "y and b must share one dtype");
  TORCH_CHECK(static_cast<int64_t>(offsets.size()) == buf.size(0) + 1 &&
                  offsets.back() == y.size(1) && y.size(1) == b.size(1),
              "offsets must bound each slice of y's columns");
  for (int64_t o : offsets)
    TORCH_CHECK(o % kLanes == 0, "slice offsets must be multiples of the vector width");
  const Runs runs = token_blocks(token_indices, seg_starts, seg_slots);
  const std::vector<int64_t> bounds(offsets.begin(), offsets.end());
  RUNTIME_CPU_DISPATCH(y.scalar_type(), "lora_expand", [&] {
    expand_cols<scalar_t>(y.data_ptr<scalar_t>(), y.stride(0), buf.data_ptr<float>(),
                          b.data_ptr<scalar_t>(), b.stride(0), b.stride(2), runs, bounds,
                          b.size(2), y.size(0));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(runtime_cpu, m) {
  m.def("lora_shrink(Tensor x, Tensor a, Tensor token_indices, Tensor seg_starts, "
        "Tensor seg_slots) -> Tensor");
  m.def("lora_expand(Tensor(a!) y, Tensor buf, Tensor b, Tensor token_indices, "
        "Tensor seg_starts, Tensor seg_slots, int[] offsets) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(runtime_cpu, CPU, m) {
  m.impl("lora_shrink", &lora_shrink);
  m.impl("lora_expand", &lora_expand);
}
