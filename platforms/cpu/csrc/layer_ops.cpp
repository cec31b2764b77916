// Fused element-wise layer ops for the CPU: RMSNorm (with the residual add), the recurrent
// layers' gated RMSNorm, SiLU-and-mul and the rotary embedding.
// Each row is one pass over memory instead of the five to eight torch ops of the portable
// versions, 16 lanes at a time on AVX-512 (one register), 8 elsewhere. Every intermediate is
// rounded to the model dtype where the portable op (and transformers) rounds it, in registers,
// so bf16 results match them bit for bit up to exp's last ulp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "simd.h"

namespace {

using namespace runtime_cpu;

// out = weight * round(x / rms(x)); the sum of squares in float32. `sum` (optional) receives
// x + residual first, and x is that sum.
template <typename T>
void rms_norm_rows(T* out, T* sum, const T* x, const T* residual, const T* weight,
                   int64_t rows, int64_t hidden, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * hidden;
      T* outr = out + r * hidden;
      const T* src = xr;
      if (sum != nullptr) {
        T* sr = sum + r * hidden;
        const T* rr = residual + r * hidden;
        for (int64_t d = 0; d < hidden; d += kLanes)
          storev(sr + d, loadv(xr + d) + loadv(rr + d));
        src = sr;
      }
      vecf sq = {};
      for (int64_t d = 0; d < hidden; d += kLanes) {
        vecf v = loadv(src + d);
        sq += v * v;
      }
      const float inv = 1.f / std::sqrt(hsum(sq) / static_cast<float>(hidden) +
                                        static_cast<float>(eps));
      for (int64_t d = 0; d < hidden; d += kLanes)
        storev(outr + d, loadv(weight + d) * roundv<T>(loadv(src + d) * inv));
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(x.size(-1) == weight.size(0) && x.size(-1) % 16 == 0,
              "the hidden size must equal the weight's and be a multiple of 16");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share one dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  at::Tensor out = at::empty_like(x);
  const int64_t hidden = x.size(-1);
  RUNTIME_CPU_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), nullptr, x.data_ptr<scalar_t>(), nullptr,
                            weight.data_ptr<scalar_t>(), x.numel() / hidden, hidden, eps);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
                  residual.scalar_type() == x.scalar_type(),
              "residual must match x");
  at::Tensor out = at::empty_like(x), sum = at::empty_like(x);
  const int64_t hidden = x.size(-1);
  RUNTIME_CPU_DISPATCH(x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), sum.data_ptr<scalar_t>(),
                            x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                            weight.data_ptr<scalar_t>(), x.numel() / hidden, hidden, eps);
  });
  return {out, sum};
}

// The recurrent layers' gated RMSNorm, per row of x and gate [T, D] (rows `x_stride` and
// `gate_stride` apart) and per group of `group` channels: without `before`,
// weight * round(norm(x * silu(gate))); with it, round(weight * round(norm(x))) * silu(gate).
// `weight` is [hidden], or one [group] for every group (`shared_weight`).
template <typename T>
void gated_rms_norm_rows(T* out, const T* x, const T* gate, const T* weight, int64_t rows,
                         int64_t x_stride, int64_t gate_stride, int64_t hidden, int64_t group,
                         bool shared_weight, bool before, float eps) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(group);
    float* h = scratch.data();
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      const T* gr = gate + r * gate_stride;
      T* outr = out + r * hidden;
      for (int64_t g0 = 0; g0 < hidden; g0 += group) {
        vecf sq = {};
        for (int64_t j = 0; j < group; j += kLanes) {
          vecf v = loadv(xr + g0 + j);
          if (!before) {
            const vecf g = loadv(gr + g0 + j);
            v = v * siluv(g);
          }
          storev(h + j, v);
          sq += v * v;
        }
        const float inv = 1.f / std::sqrt(hsum(sq) / static_cast<float>(group) + eps);
        for (int64_t j = 0; j < group; j += kLanes) {
          const vecf w = loadv(weight + (shared_weight ? 0 : g0) + j);
          const vecf n = roundv<T>(loadv(h + j) * inv);
          if (before) {
            const vecf g = loadv(gr + g0 + j);
            storev(outr + g0 + j, roundv<T>(w * n) * siluv(g));
          } else {
            storev(outr + g0 + j, w * n);
          }
        }
      }
    }
  });
}

at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight,
                          double eps, int64_t group_size, bool norm_before_gate) {
  TORCH_CHECK(x.dim() == 2 && gate.sizes() == x.sizes() && x.stride(1) == 1 &&
                  gate.stride(1) == 1 && weight.is_contiguous() &&
                  (weight.numel() == x.size(1) || weight.numel() == group_size),
              "x and gate must be [T, D] with contiguous rows, weight [D] or [group_size]");
  TORCH_CHECK(gate.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "x, gate and weight must share one dtype");
  TORCH_CHECK(group_size > 0 && group_size % 16 == 0 && x.size(1) % group_size == 0,
              "the group size must be a multiple of 16 that divides D");
  at::Tensor out = at::empty(x.sizes(), x.options());
  RUNTIME_CPU_DISPATCH(x.scalar_type(), "gated_rms_norm", [&] {
    gated_rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                                  gate.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                                  x.size(0), x.stride(0), gate.stride(0), x.size(1), group_size,
                                  weight.numel() == group_size, norm_before_gate,
                                  static_cast<float>(eps));
  });
  return out;
}

// x = [gate | up] per row -> round(silu(gate)) * up.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 32 == 0,
              "x must be contiguous with a last dimension that is a multiple of 32");
  const int64_t d = x.size(-1) / 2, rows = x.numel() / x.size(-1);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = d;
  at::Tensor out = at::empty(shape, x.options());
  RUNTIME_CPU_DISPATCH(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = src + r * 2 * d;
        for (int64_t j = 0; j < d; j += kLanes) {
          vecf g = loadv(gate + j);
          vecf act = roundv<scalar_t>(siluv(g));
          storev(dst + r * d + j, act * loadv(gate + d + j));
        }
      }
    });
  });
  return out;
}

// Neox-style rotary embedding, in place on q and k: per head, the first rotary_dim / 2 lanes
// x1 and the next x2 become (x1 cos - x2 sin, x2 cos + x1 sin), each product rounded to the
// model dtype as the portable op does.
template <typename T>
void rotate_heads(T* x, int64_t num_heads, int64_t head_size, const float* cos, const float* sin,
                  int64_t half) {
  for (int64_t h = 0; h < num_heads; ++h) {
    T* x1 = x + h * head_size;
    T* x2 = x1 + half;
    for (int64_t i = 0; i < half; i += kLanes) {
      const vecf c = roundv<T>(loadv(cos + i)), s = roundv<T>(loadv(sin + i));
      const vecf a = loadv(x1 + i), b = loadv(x2 + i);
      storev(x1 + i, roundv<T>(a * c) - roundv<T>(b * s));
      storev(x2 + i, roundv<T>(b * c) + roundv<T>(a * s));
    }
  }
}

void rotary_embedding(const at::Tensor& positions, at::Tensor query, at::Tensor key,
                      const at::Tensor& cos_sin_cache, int64_t head_size) {
  const int64_t tokens = positions.numel(), rotary_dim = cos_sin_cache.size(1);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "positions must be contiguous int64");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous(),
              "cos_sin_cache must be contiguous float32 [max_position, rotary_dim]");
  TORCH_CHECK(rotary_dim % 32 == 0 && rotary_dim <= head_size,
              "rotary_dim must be a multiple of 32 and at most head_size");
  TORCH_CHECK(query.dim() == 2 && key.dim() == 2 && query.size(0) == tokens &&
                  key.size(0) == tokens && query.stride(1) == 1 && key.stride(1) == 1 &&
                  query.size(1) % head_size == 0 && key.size(1) % head_size == 0,
              "query and key must be [tokens, heads * head_size] with contiguous rows");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "query and key must share one dtype");
  const int64_t half = rotary_dim / 2;
  const int64_t q_heads = query.size(1) / head_size, k_heads = key.size(1) / head_size;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cache = cos_sin_cache.data_ptr<float>();
  RUNTIME_CPU_DISPATCH(query.scalar_type(), "rotary_embedding", [&] {
    scalar_t* q = query.data_ptr<scalar_t>();
    scalar_t* k = key.data_ptr<scalar_t>();
    const int64_t q_stride = query.stride(0), k_stride = key.stride(0);
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = cache + pos[t] * rotary_dim;
        rotate_heads(q + t * q_stride, q_heads, head_size, cos, cos + half, half);
        rotate_heads(k + t * k_stride, k_heads, head_size, cos, cos + half, half);
      }
    });
  });
}


// (value, index) a is the better maximum than b: larger, NaN above all (torch's max), the lower
// index on ties.
inline bool better(float a, int64_t ia, float b, int64_t ib) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && (!std::isnan(b) || ia < ib);
  return a > b || (a == b && ia < ib);
}

// One lane set's running maxima: `take` where v beats the lane's best (larger, or a first NaN).
inline void keep_max(vecf v, veci position, vecf& best, veci& index) {
  const veci take = (v > best) | ((v != v) & (best == best));
  best = take ? v : best;
  index = take ? position : index;
}

// The index of each row's first maximum (x [rows, n] float32, bfloat16 or float16, rows
// contiguous): two sets of running maxima per row, one per lane (two, so that the compare and
// blend chains overlap and the row streams at memory speed), merged at the end. The vector is
// the host's (`vecf`): a 16-lane generic vector on AVX2 ran 3.5x slower than torch's max.
// Widening to float32 is exact, so a bfloat16 row's answer is that of its float32 copy.
at::Tensor greedy_argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "x must be a non-empty [rows, n] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  RUNTIME_CPU_DISPATCH(x.scalar_type(), "greedy_argmax", [&] {
    const scalar_t* base = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = base + r * stride;
        float best = static_cast<float>(row[0]);
        int64_t index = 0, j = 0;
        if (n >= 2 * kLanes) {
          veci position0;
          for (int l = 0; l < kLanes; ++l) position0[l] = l;
          veci position1 = position0 + kLanes;
          vecf best0 = loadv(row), best1 = loadv(row + kLanes);
          veci index0 = position0, index1 = position1;
          for (j = 2 * kLanes; j + 2 * kLanes <= n; j += 2 * kLanes) {
            position0 += 2 * kLanes;
            position1 += 2 * kLanes;
            keep_max(loadv(row + j), position0, best0, index0);
            keep_max(loadv(row + j + kLanes), position1, best1, index1);
          }
          best = best0[0], index = index0[0];
          for (int l = 0; l < kLanes; ++l) {
            if (better(best0[l], index0[l], best, index)) best = best0[l], index = index0[l];
            if (better(best1[l], index1[l], best, index)) best = best1[l], index = index1[l];
          }
        }
        for (; j < n; ++j) {
          const float v = static_cast<float>(row[j]);
          if (better(v, j, best, index)) best = v, index = j;
        }
        dst[r] = index;
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(runtime_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gated_rms_norm(Tensor x, Tensor gate, Tensor weight, float eps, int group_size, "
        "bool norm_before_gate) -> Tensor");
  m.def("greedy_argmax(Tensor x) -> Tensor");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, "
        "Tensor cos_sin_cache, int head_size) -> ()");
}

TORCH_LIBRARY_IMPL(runtime_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gated_rms_norm", &gated_rms_norm);
  m.impl("greedy_argmax", &greedy_argmax);
  m.impl("rotary_embedding", &rotary_embedding);
}
