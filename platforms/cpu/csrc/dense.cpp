// float32 dense products y = x W^T (+ bias) against a weight packed once at load: W's rows in
// panels of 16 output features, each panel K-major (panel p holds W[16p .. 16p+15][k] for
// every k as 16 consecutive floats), the last panel padded with zero rows. A register tile of
// up to 6 rows x 16 features keeps 12 8-lane accumulators; each k step loads the panel's two
// vectors once and broadcasts one x value per row. The threads split the (row block, panel)
// items; each item runs in K slices small enough to stay in L1 while every row tile of its
// block passes over them, so a decode step (one row block) reads each weight byte from memory
// once.
//
// Written for hosts whose oneDNN small-row products run below the FMA peak (AVX2: 65-85 % at
// 64 rows on two Zen 3 cores; this kernel 81-96 % on two Zen 2 cores); which product a shape
// takes is timed per host (linear_choice.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "simd.h"

namespace {

using namespace runtime_cpu;

constexpr int64_t kPanel = 16;      // output features per panel: two 8-lane vectors
constexpr int64_t kRowTile = 6;     // rows per register tile: 12 accumulators of 16 registers
constexpr int64_t kDepth = 256;     // K per block: a 16 KiB slice of a panel, held in L1
constexpr int64_t kRowBlock = 120;  // rows per block: 120 x 256 floats of x (120 KiB) in L2

// One float in all 8 lanes, loaded straight into the register: `v8f{} + *p` costs an add and a
// shuffle, and on Zen the shuffle takes an FMA port.
inline v8f broadcast8(const float* p) {
#if defined(__AVX__)
  return reinterpret_cast<v8f>(_mm256_broadcast_ss(p));
#else
  const float s = *p;
  return v8f{s, s, s, s, s, s, s, s};
#endif
}

// c[r][0..cols) (+)= the tile's rows of x times the panel slice; `first` stores (with the bias,
// when there is one), later K blocks add. The next slice is prefetched into L2 while the first
// row tile runs.
template <int Rows>
inline void row_tile(const float* x, int64_t ldx, const float* panel, int64_t depth, float* c,
                     int64_t ldc, int64_t cols, bool first, const float* bias,
                     const float* next) {
  // One or two rows are 2-4 chains of dependent FMAs, too few to cover the FMA's latency:
  // they run 4 or 2 k steps at once into sets of accumulators, summed at the end.
  constexpr int kSets = Rows == 1 ? 4 : Rows == 2 ? 2 : 1;
  v8f acc[kSets][Rows][2] = {};
  const auto step = [&](int set, int64_t k) {
    const v8f lo = load8(panel + k * kPanel), hi = load8(panel + k * kPanel + 8);
    if (next != nullptr) __builtin_prefetch(next + k * kPanel, 0, 2);
#pragma GCC unroll 6
    for (int r = 0; r < Rows; ++r) {
      const v8f xr = broadcast8(x + r * ldx + k);
      acc[set][r][0] += xr * lo;
      acc[set][r][1] += xr * hi;
    }
  };
  int64_t k = 0;
  for (; k + kSets <= depth; k += kSets) {
#pragma GCC unroll 4
    for (int set = 0; set < kSets; ++set) step(set, k + set);
  }
  for (; k < depth; ++k) step(0, k);
#pragma GCC unroll 4
  for (int set = 1; set < kSets; ++set) {
    for (int r = 0; r < Rows; ++r) {
      acc[0][r][0] += acc[set][r][0];
      acc[0][r][1] += acc[set][r][1];
    }
  }
  float spill[kPanel];
#pragma GCC unroll 6
  for (int r = 0; r < Rows; ++r) {
    float* out = c + r * ldc;
    const bool whole = cols == kPanel;
    float* dst = whole ? out : spill;
    if (first) {
      v8f lo = acc[0][r][0], hi = acc[0][r][1];
      if (bias != nullptr) {
        lo += load8(bias);
        hi += load8(bias + 8);
      }
      store8(dst, lo);
      store8(dst + 8, hi);
    } else {
      if (!whole) std::copy(out, out + cols, spill);
      store8(dst, load8(dst) + acc[0][r][0]);
      store8(dst + 8, load8(dst + 8) + acc[0][r][1]);
    }
    if (!whole) std::copy(spill, spill + cols, out);
  }
}

using RowTileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t,
                           int64_t, bool, const float*, const float*);
constexpr RowTileFn kRowTiles[kRowTile + 1] = {nullptr,      row_tile<1>, row_tile<2>,
                                               row_tile<3>,  row_tile<4>, row_tile<5>,
                                               row_tile<6>};

at::Tensor pack_dense_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_dense_weight takes a 2-D float32 weight (out_features x in_features)");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

at::Tensor dense(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                 const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "dense takes a contiguous 2-D float32 input");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kPanel &&
                  packed.size(1) == x.size(1) && packed.scalar_type() == at::kFloat,
              "dense takes a weight from pack_dense_weight with the input's in_features");
  const int64_t rows = x.size(0), depth = x.size(1), panels = packed.size(0);
  TORCH_CHECK(depth > 0, "dense needs in_features > 0");
  TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel,
              "out_features ", out_features, " does not match the packed weight");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat,
                "bias must be a contiguous float32 vector of out_features");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const float* xs = x.data_ptr<float>();
  const float* ws = packed.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  // Row blocks of equal height, a multiple of the tile's and at most kRowBlock (a multiple of
  // it), so none is empty; the threads split the (row block, panel) items, each taking a run of
  // panels of one block or a few.
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t block_height =
      ((rows + row_blocks - 1) / row_blocks + kRowTile - 1) / kRowTile * kRowTile;
  at::parallel_for(0, row_blocks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r0 = item / panels * block_height, p = item % panels;
      const int64_t height = std::min(block_height, rows - r0);
      const int64_t col = p * kPanel, cols = std::min(kPanel, out_features - col);
      const float* panel = ws + p * depth * kPanel;
      const float* following = item + 1 < end ? ws + (item + 1) % panels * depth * kPanel
                                              : nullptr;
      const float* pbias = b == nullptr ? nullptr : b + col;
      float bias_tail[kPanel] = {};
      if (pbias != nullptr && cols < kPanel) {
        std::copy(pbias, pbias + cols, bias_tail);
        pbias = bias_tail;
      }
      for (int64_t k0 = 0; k0 < depth; k0 += kDepth) {
        const int64_t d = std::min(kDepth, depth - k0);
        const float* next = k0 + d < depth ? panel + (k0 + d) * kPanel : following;
        for (int64_t r = 0; r < height; r += kRowTile) {
          const int64_t tile = std::min(kRowTile, height - r);
          kRowTiles[tile](xs + (r0 + r) * depth + k0, depth, panel + k0 * kPanel, d,
                          ys + (r0 + r) * out_features + col, out_features, cols, k0 == 0,
                          pbias, r == 0 ? next : nullptr);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(runtime_cpu, m) {
  m.def("pack_dense_weight(Tensor weight) -> Tensor");
  m.def("dense(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(runtime_cpu, CPU, m) {
  m.impl("pack_dense_weight", &pack_dense_weight);
  m.impl("dense", &dense);
}
