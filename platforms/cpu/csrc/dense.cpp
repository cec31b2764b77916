// Dense products y = x W^T (+ bias) against a weight packed once at load: W's rows in panels
// of two vectors of output features (16 on AVX2, 32 on AVX-512), each panel K-major, the last
// panel padded with zero rows. float32 panels hold W[f][k] for the panel's features f as
// consecutive floats at each k; bfloat16 panels (AVX512-BF16 only) hold the pair W[f][k],
// W[f][k + 1] for each feature at each even k, the operand order of `vdpbf16ps`, which
// multiplies 32 bf16 pairs and adds them to 16 float32 sums in one instruction.
//
// A register tile of up to 6 rows (AVX2) or 12 rows (AVX-512) x the panel's two vectors keeps
// three quarters of the vector registers as accumulators; each k step loads the
// panel's two vectors once and broadcasts one x value (bf16: one pair) per row. The threads
// split the (row block, panel) items; each item runs in K slices small enough to stay in L1
// while every row tile of its block passes over them, summing into a float32 tile that is
// rounded once into the output, so a decode step (one row block) reads each weight byte from
// memory once, the next slice asked for while the row tiles run.
//
// Written for hosts whose oneDNN small-row products run below the FMA peak (AVX2: 65-85 % at
// 64 rows on two Zen 3 cores; this kernel 81-96 % on two Zen 2 cores) and for weights read
// from memory, which oneDNN's products do not ask for ahead; which product a shape takes is
// timed per host (linear_choice.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

using namespace runtime_cpu;

constexpr int64_t kPanel = 2 * kLanes;               // output features per panel
constexpr int64_t kRowTile = kLanes == 16 ? 12 : 6;  // rows per register tile
constexpr int64_t kRowBlock = 120;  // rows per block, a multiple of both tiles: 120 rows of a
                                    // K slice (at most 120 KiB of x) stay in L2
constexpr int64_t kSliceBytes = 16 << 10;  // a K slice of a panel, held in L1

#if defined(__AVX512BF16__)
constexpr bool kBf16 = true;
#else
constexpr bool kBf16 = false;
#endif

// k values of one packed panel row: 1 for float32, a pair for bf16.
template <typename T>
constexpr int64_t kStep = std::is_same_v<T, float> ? 1 : 2;

// One float in every lane, loaded straight into the register: `vecf{} + *p` costs an add and a
// shuffle, and on Zen the shuffle takes an FMA port.
inline vecf broadcast(const float* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vecf>(_mm512_set1_ps(*p));
#elif defined(__AVX__)
  return reinterpret_cast<vecf>(_mm256_broadcast_ss(p));
#else
  return vecf{} + *p;
#endif
}

// acc[r] (kPanel floats per row, the tile's float32 sums) += the tile's rows of x times the
// panel's K slice of `depth` k values (`first`: = instead of +=). The block's `tiles` row tiles
// share asking for the next slice (`next`, null for none): tile `phase` asks for the packed
// rows whose index is `phase` modulo `tiles`, so the requests spread over the whole block (one
// tile asking for all of it at AVX-512's pace needed 37 GB/s a thread from memory).
template <int Rows, typename T>
inline void row_tile(const T* x, int64_t ldx, const T* panel, int64_t depth, float* acc,
                     bool first, const T* next, int64_t phase, int64_t tiles) {
  // One or two rows are 2-4 chains of dependent FMAs, too few to cover the FMA's latency:
  // they run 4 or 2 k steps at once into sets of accumulators, summed at the end.
  constexpr int kSets = Rows == 1 ? 4 : Rows == 2 ? 2 : 1;
  constexpr int64_t step = kStep<T>, row_bytes = kPanel * step * sizeof(T);
  vecf sums[kSets][Rows][2] = {};
  int64_t turn = phase;  // packed rows until this tile's next request
  const auto prefetch = [&](int64_t k) {
    if (next == nullptr || turn-- != 0) return;
    turn = tiles - 1;
    const char* line = reinterpret_cast<const char*>(next + k * kPanel);
    for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(line + off, 0, 2);
  };
  const auto at = [&](int set, int64_t k) {  // k: the slice's k, a multiple of step
    const T* w = panel + k * kPanel;
    prefetch(k);
    if constexpr (std::is_same_v<T, float>) {
      const vecf lo = loadv(w), hi = loadv(w + kLanes);
#pragma GCC unroll 12
      for (int r = 0; r < Rows; ++r) {
        const vecf xr = broadcast(x + r * ldx + k);
        sums[set][r][0] += xr * lo;
        sums[set][r][1] += xr * hi;
      }
    } else {
#if defined(__AVX512BF16__)
      const __m512bh lo = (__m512bh)_mm512_loadu_si512(w),
                     hi = (__m512bh)_mm512_loadu_si512(w + 2 * kLanes);
#pragma GCC unroll 12
      for (int r = 0; r < Rows; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * ldx + k, sizeof(pair));
        const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
        sums[set][r][0] = reinterpret_cast<vecf>(
            _mm512_dpbf16_ps(reinterpret_cast<__m512>(sums[set][r][0]), xr, lo));
        sums[set][r][1] = reinterpret_cast<vecf>(
            _mm512_dpbf16_ps(reinterpret_cast<__m512>(sums[set][r][1]), xr, hi));
      }
#endif
    }
  };
  int64_t k = 0;
  for (; k + kSets * step <= depth; k += kSets * step) {
#pragma GCC unroll 4
    for (int set = 0; set < kSets; ++set) at(set, k + set * step);
  }
  for (; k < depth; k += step) at(0, k);
#pragma GCC unroll 4
  for (int set = 1; set < kSets; ++set)
    for (int r = 0; r < Rows; ++r) {
      sums[0][r][0] += sums[set][r][0];
      sums[0][r][1] += sums[set][r][1];
    }
#pragma GCC unroll 12
  for (int r = 0; r < Rows; ++r) {
    float* a = acc + r * kPanel;
    storev(a, first ? sums[0][r][0] : loadv(a) + sums[0][r][0]);
    storev(a + kLanes, first ? sums[0][r][1] : loadv(a + kLanes) + sums[0][r][1]);
  }
}

template <typename T>
using RowTileFn = void (*)(const T*, int64_t, const T*, int64_t, float*, bool, const T*,
                           int64_t, int64_t);

template <typename T, size_t... R>
constexpr std::array<RowTileFn<T>, sizeof...(R) + 1> row_tiles(std::index_sequence<R...>) {
  return {nullptr, &row_tile<R + 1, T>...};
}

template <typename T>
constexpr auto kRowTiles = row_tiles<T>(std::make_index_sequence<kRowTile>{});

at::Tensor pack_dense_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat ||
                                    (kBf16 && weight.scalar_type() == at::kBFloat16)),
              "pack_dense_weight takes a 2-D float32 weight (out_features x in_features)",
              kBf16 ? " or a bfloat16 one" : "");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  const int64_t step = weight.scalar_type() == at::kFloat ? 1 : 2;
  // bf16 pairs read x two at a time: an odd in_features would read past each row.
  TORCH_CHECK(k % step == 0, "bfloat16 dense needs an even in_features, got ", k);
  at::Tensor padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, kPanel, k / step, step}).permute({0, 2, 1, 3}).contiguous();
}

// The tile's float32 sums (+ bias), rounded into `cols` columns of the output's rows.
template <typename T>
void store_rows(const float* acc, int64_t rows, T* out, int64_t ldo, int64_t cols,
                const float* bias) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = acc + r * kPanel;
    T* o = out + r * ldo;
    if (cols == kPanel) {
      for (int64_t j = 0; j < kPanel; j += kLanes)
        storev(o + j, bias == nullptr ? loadv(a + j) : loadv(a + j) + loadv(bias + j));
    } else {
      for (int64_t j = 0; j < cols; ++j)
        o[j] = static_cast<T>(bias == nullptr ? a[j] : a[j] + bias[j]);
    }
  }
}

template <typename T>
void run_dense(const T* xs, const T* ws, T* ys, const float* bias, int64_t rows, int64_t depth,
               int64_t panels, int64_t out_features) {
  // A K slice: kSliceBytes of the panel, whole packed rows (bf16: whole pairs).
  constexpr int64_t slice = kSliceBytes / (kPanel * static_cast<int64_t>(sizeof(T)));
  // Row blocks of equal height, a multiple of the tile's and at most kRowBlock (a multiple of
  // it), so none is empty; the threads split the (row block, panel) items, each taking a run of
  // panels of one block or a few.
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t block_height =
      ((rows + row_blocks - 1) / row_blocks + kRowTile - 1) / kRowTile * kRowTile;
  at::parallel_for(0, row_blocks * panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(block_height * kPanel);
    float bias_tail[kPanel] = {};
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r0 = item / panels * block_height, p = item % panels;
      const int64_t height = std::min(block_height, rows - r0);
      const int64_t col = p * kPanel, cols = std::min(kPanel, out_features - col);
      const T* panel = ws + p * depth * kPanel;
      const T* following = item + 1 < end ? ws + (item + 1) % panels * depth * kPanel : nullptr;
      const float* pbias = bias == nullptr ? nullptr : bias + col;
      if (pbias != nullptr && cols < kPanel) {
        std::copy(pbias, pbias + cols, bias_tail);
        pbias = bias_tail;
      }
      const int64_t tiles = (height + kRowTile - 1) / kRowTile;
      for (int64_t k0 = 0; k0 < depth; k0 += slice) {
        const int64_t d = std::min(slice, depth - k0);
        const T* next = k0 + d < depth ? panel + (k0 + d) * kPanel : following;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t r = t * kRowTile, tile = std::min(kRowTile, height - r);
          kRowTiles<T>[tile](xs + (r0 + r) * depth + k0, depth, panel + k0 * kPanel, d,
                             acc.data() + r * kPanel, k0 == 0, next, t, tiles);
        }
      }
      store_rows(acc.data(), height, ys + r0 * out_features + col, out_features, cols, pbias);
    }
  });
}

at::Tensor dense(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                 const std::optional<at::Tensor>& bias) {
  const auto dtype = packed.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || (kBf16 && dtype == at::kBFloat16),
              "dense takes a float32 weight", kBf16 ? " or a bfloat16 one" : "");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == dtype,
              "dense takes a contiguous 2-D input in the packed weight's dtype");
  const int64_t rows = x.size(0), depth = x.size(1), panels = packed.size(0);
  const int64_t step = dtype == at::kFloat ? 1 : 2;
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == kPanel &&
                  packed.size(3) == step && packed.size(1) * step == depth,
              "dense takes a weight from pack_dense_weight with the input's in_features");
  TORCH_CHECK(depth > 0, "dense needs in_features > 0");
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel,
              "out_features ", out_features, " does not match the packed weight");
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                    bias->scalar_type() == dtype,
                "bias must be a contiguous vector of out_features in the input's dtype");
    bias32 = bias->to(at::kFloat);
  }
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  if (dtype == at::kFloat) {
    run_dense(x.data_ptr<float>(), packed.data_ptr<float>(), out.data_ptr<float>(), b, rows,
              depth, panels, out_features);
  } else if constexpr (kBf16) {
    run_dense(x.data_ptr<c10::BFloat16>(), packed.data_ptr<c10::BFloat16>(),
              out.data_ptr<c10::BFloat16>(), b, rows, depth, panels, out_features);
  }
  return out;
}

// Whether `dense` takes bfloat16 on this build (AVX512-BF16); it always takes float32.
bool dense_takes_bf16() { return kBf16; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(runtime_cpu, m) {
  m.def("pack_dense_weight(Tensor weight) -> Tensor");
  m.def("dense(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("dense_takes_bf16() -> bool", &dense_takes_bf16);
}

TORCH_LIBRARY_IMPL(runtime_cpu, CPU, m) {
  m.impl("pack_dense_weight", &pack_dense_weight);
  m.impl("dense", &dense);
}
