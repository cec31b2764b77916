// Recurrent layer kernels for the CPU: the gated delta rule (and Kimi delta attention), the
// causal depthwise conv1d, Mamba 1's selective scan and Mamba 2's scan. Each takes a varlen
// batch through query_start_loc (decode: one token per sequence) and updates its states in
// place, row state_indices[s] for sequence s, so one kernel serves prefill (the caller passes a
// buffer of initial states) and decode (the state cache itself). Arithmetic is float32; outputs round to the activations' dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

using namespace runtime_cpu;

int64_t checked_sequences(const at::Tensor& query_start_loc, const at::Tensor& state_indices) {
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong && query_start_loc.is_contiguous(),
              "query_start_loc must be contiguous int64 [S + 1]");
  TORCH_CHECK(state_indices.scalar_type() == at::kLong && state_indices.is_contiguous() &&
                  state_indices.numel() == query_start_loc.numel() - 1,
              "state_indices must be contiguous int64 [S]");
  return state_indices.numel();
}

// q and k [T, Hk, K] -> float32, L2-normed if asked (eps 1e-6, as flash-linear-attention), q
// times the scale: once per token and key head, not once per work item below.
template <typename T>
void normed_qk(const T* q, const T* k, float* qn, float* kn, int64_t rows, int64_t dk,
               bool l2norm, float scale) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float qq = 0.f, kk = 0.f;
      for (int64_t i = 0; i < dk; ++i) {
        const float a = static_cast<float>(q[r * dk + i]), b = static_cast<float>(k[r * dk + i]);
        qn[r * dk + i] = a;
        kn[r * dk + i] = b;
        qq += a * a;
        kk += b * b;
      }
      const float qs = scale * (l2norm ? 1.f / std::sqrt(qq + 1e-6f) : 1.f);
      const float ks = l2norm ? 1.f / std::sqrt(kk + 1e-6f) : 1.f;
      for (int64_t i = 0; i < dk; ++i) {
        qn[r * dk + i] *= qs;
        kn[r * dk + i] *= ks;
      }
    }
  });
}

// Gated delta rule, per value head with state S [K, V] (V contiguous, float32):
// S = diag(a) S; S += k (beta (v - S^T k))^T; o = S^T q, with a = exp(g) one decay per head
// (g [T, Hv], log) or, kPerChannel (Kimi delta attention), one per key channel (g [T, Hv, K],
// already exp'd). Column j of S only ever meets v[j], so each work item owns a block of lanes
// of V and runs its sequence's tokens with that block of the state in L1, read twice and
// written once per token: S^T k is taken before the decay ((S^T (a k)), which the update then
// applies. Four accumulators keep the FMA chains apart.
// After each of the sorted `checkpoints` rows (a prefix-cache checkpoint), the item's block
// of the state is also copied into that row's entry of `kept` [C, Hv, K, V].
template <bool kPerChannel, typename T>
void gated_delta_rule_kernel(const float* q, const float* k, const T* v, const float* g,
                             const float* beta, const int64_t* loc, const int64_t* rows,
                             float* state, T* out, int64_t seqs, int64_t k_heads,
                             int64_t v_heads, int64_t dk, int64_t dv,
                             const int64_t* checkpoints, int64_t num_checkpoints, float* kept) {
  const int64_t blocks = dv / kLanes, group = v_heads / k_heads;
  at::parallel_for(0, seqs * v_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / (v_heads * blocks), h = item / blocks % v_heads;
      const int64_t col = item % blocks * kLanes, kh = h / group;
      float* S = state + (rows[s] * v_heads + h) * dk * dv + col;
      int64_t c = std::lower_bound(checkpoints, checkpoints + num_checkpoints, loc[s]) -
                  checkpoints;
      for (int64_t t = loc[s]; t < loc[s + 1]; ++t) {
        const float* qt = q + (t * k_heads + kh) * dk;
        const float* kt = k + (t * k_heads + kh) * dk;
        const float* channel_decay = kPerChannel ? g + (t * v_heads + h) * dk : g;
        const float head_decay = kPerChannel ? 1.f : std::exp(g[t * v_heads + h]);
        auto decay = [&](int64_t i) { return kPerChannel ? channel_decay[i] : head_decay; };
        const float b = beta[t * v_heads + h];
        vecf mem[4] = {};
        int64_t i = 0;
        for (; i + 4 <= dk; i += 4)
          for (int j = 0; j < 4; ++j)
            mem[j] += loadv(S + (i + j) * dv) * (kt[i + j] * decay(i + j));
        for (; i < dk; ++i) mem[0] += loadv(S + i * dv) * (kt[i] * decay(i));
        const vecf kv = (mem[0] + mem[1]) + (mem[2] + mem[3]);
        const vecf delta = (loadv(v + (t * v_heads + h) * dv + col) - kv) * b;
        vecf o[4] = {};
        for (i = 0; i + 4 <= dk; i += 4)
          for (int j = 0; j < 4; ++j) {
            const vecf row = loadv(S + (i + j) * dv) * decay(i + j) + delta * kt[i + j];
            storev(S + (i + j) * dv, row);
            o[j] += row * qt[i + j];
          }
        for (; i < dk; ++i) {
          const vecf row = loadv(S + i * dv) * decay(i) + delta * kt[i];
          storev(S + i * dv, row);
          o[0] += row * qt[i];
        }
        storev(out + (t * v_heads + h) * dv + col, (o[0] + o[1]) + (o[2] + o[3]));
        if (c < num_checkpoints && checkpoints[c] == t) {
          float* K = kept + (c * v_heads + h) * dk * dv + col;
          for (i = 0; i < dk; ++i) storev(K + i * dv, loadv(S + i * dv));
          ++c;
        }
      }
    }
  });
}

template <bool kPerChannel>
at::Tensor delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& g, const at::Tensor& beta,
                      const at::Tensor& query_start_loc, at::Tensor state,
                      const at::Tensor& state_indices, bool l2norm, double scale,
                      const c10::optional<at::Tensor>& checkpoint_rows,
                      const c10::optional<at::Tensor>& checkpoint_states) {
  const int64_t seqs = checked_sequences(query_start_loc, state_indices);
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              "q, k must be [T, Hk, K] and v [T, Hv, V]");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "q, k, v must be contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "q, k, v must share one dtype");
  const int64_t k_heads = q.size(1), dk = q.size(2), v_heads = v.size(1), dv = v.size(2);
  TORCH_CHECK(v_heads % k_heads == 0, "the value heads must be a multiple of the key heads");
  TORCH_CHECK(dv % 16 == 0, "the value head size must be a multiple of 16");
  TORCH_CHECK(g.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat &&
                  g.is_contiguous() && beta.is_contiguous() &&
                  beta.numel() == v.size(0) * v_heads &&
                  g.numel() == beta.numel() * (kPerChannel ? dk : 1),
              kPerChannel ? "decay (exp g) must be contiguous float32 [T, H, K], beta [T, H]"
                          : "g and beta must be contiguous float32 [T, Hv]");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 4 &&
                  state.size(1) == v_heads && state.size(2) == dk && state.size(3) == dv,
              "state must be contiguous float32 [slots, Hv, K, V]");
  const int64_t num_checkpoints = checkpoint_rows.has_value() ? checkpoint_rows->numel() : 0;
  TORCH_CHECK(checkpoint_rows.has_value() == checkpoint_states.has_value(),
              "checkpoint_rows and checkpoint_states go together");
  if (num_checkpoints) {
    TORCH_CHECK(checkpoint_rows->scalar_type() == at::kLong && checkpoint_rows->is_contiguous(),
                "checkpoint_rows must be contiguous int64 [C]");
    TORCH_CHECK(checkpoint_states->scalar_type() == at::kFloat &&
                    checkpoint_states->is_contiguous() &&
                    checkpoint_states->numel() == num_checkpoints * v_heads * dk * dv,
                "checkpoint_states must be contiguous float32 [C, Hv, K, V]");
  }
  at::Tensor out = at::empty_like(v);
  at::Tensor qn = at::empty(q.sizes(), q.options().dtype(at::kFloat)), kn = at::empty_like(qn);
  RUNTIME_CPU_DISPATCH(v.scalar_type(), "gated_delta_rule", [&] {
    normed_qk<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), qn.data_ptr<float>(),
                        kn.data_ptr<float>(), q.size(0) * k_heads, dk, l2norm,
                        static_cast<float>(scale));
    gated_delta_rule_kernel<kPerChannel, scalar_t>(
        qn.data_ptr<float>(), kn.data_ptr<float>(), v.data_ptr<scalar_t>(), g.data_ptr<float>(),
        beta.data_ptr<float>(), query_start_loc.data_ptr<int64_t>(),
        state_indices.data_ptr<int64_t>(), state.data_ptr<float>(), out.data_ptr<scalar_t>(),
        seqs, k_heads, v_heads, dk, dv,
        num_checkpoints ? checkpoint_rows->data_ptr<int64_t>() : nullptr, num_checkpoints,
        num_checkpoints ? checkpoint_states->data_ptr<float>() : nullptr);
  });
  return out;
}

// Depthwise causal conv1d, a block of kLanes channels per work item: the width - 1 previous
// inputs live in registers, the state (layout [dim, width - 1]) is read before the sequence's
// first token and written after its last.
constexpr int64_t kMaxWidth = 8;

template <typename T, typename St>
void causal_conv1d_kernel(const T* x, const float* weight, const float* bias,
                          const int64_t* loc, const int64_t* rows, const bool* has_initial,
                          St* state, T* out, int64_t seqs, int64_t dim, int64_t width,
                          bool silu) {
  const int64_t blocks = dim / kLanes, hist = width - 1;
  at::parallel_for(0, seqs * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / blocks, c0 = item % blocks * kLanes;
      St* st = state + rows[s] * dim * hist;
      vecf w[kMaxWidth], win[kMaxWidth] = {};
      for (int64_t i = 0; i < width; ++i)
        for (int64_t j = 0; j < kLanes; ++j) w[i][j] = weight[(c0 + j) * width + i];
      const vecf b = bias != nullptr ? loadv(bias + c0) : vecf{};
      if (has_initial[s])
        for (int64_t i = 0; i < hist; ++i)
          for (int64_t j = 0; j < kLanes; ++j)
            win[i][j] = static_cast<float>(st[(c0 + j) * hist + i]);
      for (int64_t t = loc[s]; t < loc[s + 1]; ++t) {
        win[hist] = loadv(x + t * dim + c0);
        vecf y = b;
        for (int64_t i = 0; i < width; ++i) y += w[i] * win[i];
        if (silu) y = siluv(y);
        storev(out + t * dim + c0, y);
        for (int64_t i = 0; i < hist; ++i) win[i] = win[i + 1];
      }
      for (int64_t i = 0; i < hist; ++i)
        for (int64_t j = 0; j < kLanes; ++j)
          st[(c0 + j) * hist + i] = static_cast<St>(win[i][j]);
    }
  });
}

at::Tensor causal_conv1d(const at::Tensor& x, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& bias,
                         const at::Tensor& query_start_loc, at::Tensor state,
                         const at::Tensor& state_indices, const at::Tensor& has_initial_state,
                         bool silu) {
  const int64_t seqs = checked_sequences(query_start_loc, state_indices);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 16 == 0,
              "x must be contiguous [T, dim] with dim a multiple of 16");
  const int64_t dim = x.size(1), width = weight.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(0) == dim && width >= 2 && width <= kMaxWidth,
              "weight must be contiguous float32 [dim, width], width 2 to 8");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                    bias->numel() == dim),
              "bias must be contiguous float32 [dim]");
  TORCH_CHECK(state.is_contiguous() && state.dim() == 3 && state.size(1) == dim &&
                  state.size(2) == width - 1 &&
                  (state.scalar_type() == at::kFloat || state.scalar_type() == x.scalar_type()),
              "state must be contiguous [slots, dim, width - 1] in float32 or x's dtype");
  TORCH_CHECK(has_initial_state.scalar_type() == at::kBool &&
                  has_initial_state.is_contiguous() && has_initial_state.numel() == seqs,
              "has_initial_state must be contiguous bool [S]");
  at::Tensor out = at::empty_like(x);
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  RUNTIME_CPU_DISPATCH(x.scalar_type(), "causal_conv1d", [&] {
    auto run = [&](auto* st) {
      causal_conv1d_kernel(x.data_ptr<scalar_t>(), weight.data_ptr<float>(), b,
                           query_start_loc.data_ptr<int64_t>(), state_indices.data_ptr<int64_t>(),
                           has_initial_state.data_ptr<bool>(), st, out.data_ptr<scalar_t>(),
                           seqs, dim, width, silu);
    };
    if (state.scalar_type() == at::kFloat) run(state.data_ptr<float>());
    else run(state.data_ptr<scalar_t>());
  });
  return out;
}

// Mamba 1's selective scan, per channel i with state h [N] (float32, N % 16 == 0):
// h = exp(dt A_i) h + dt x B;  y = C . h (D and the gate are the caller's). Each work item owns
// a block of channels of one sequence and runs its tokens with those rows of the state in L1.
// After each of the sorted `checkpoints` rows, the item's rows of the state are also copied
// into that row's entry of `kept` [C, D, N].
template <typename T>
void selective_scan_kernel(const T* x, const float* dt, const float* A, const T* B, const T* C,
                           const int64_t* loc, const int64_t* rows, float* state, float* out,
                           int64_t seqs, int64_t dim, int64_t n, const int64_t* checkpoints,
                           int64_t num_checkpoints, float* kept) {
  constexpr int64_t kChannels = 16;  // per work item
  const int64_t blocks = (dim + kChannels - 1) / kChannels;
  at::parallel_for(0, seqs * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / blocks, c0 = item % blocks * kChannels;
      const int64_t c1 = std::min(dim, c0 + kChannels);
      float* H = state + rows[s] * dim * n;
      int64_t c = std::lower_bound(checkpoints, checkpoints + num_checkpoints, loc[s]) -
                  checkpoints;
      for (int64_t t = loc[s]; t < loc[s + 1]; ++t) {
        const T* Bt = B + t * n;
        const T* Ct = C + t * n;
        for (int64_t i = c0; i < c1; ++i) {
          const float d = dt[t * dim + i], dx = d * static_cast<float>(x[t * dim + i]);
          vecf acc = {};
          for (int64_t j = 0; j < n; j += kLanes) {
            const vecf row = expv(loadv(A + i * n + j) * d) * loadv(H + i * n + j) +
                             loadv(Bt + j) * dx;
            storev(H + i * n + j, row);
            acc += row * loadv(Ct + j);
          }
          out[t * dim + i] = hsum(acc);
        }
        if (c < num_checkpoints && checkpoints[c] == t) {
          std::copy(H + c0 * n, H + c1 * n, kept + (c * dim + c0) * n);
          ++c;
        }
      }
    }
  });
}

at::Tensor selective_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                          const at::Tensor& B, const at::Tensor& C,
                          const at::Tensor& query_start_loc, at::Tensor state,
                          const at::Tensor& state_indices,
                          const c10::optional<at::Tensor>& checkpoint_rows,
                          const c10::optional<at::Tensor>& checkpoint_states) {
  const int64_t seqs = checked_sequences(query_start_loc, state_indices);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [T, D]");
  const int64_t tokens = x.size(0), dim = x.size(1);
  TORCH_CHECK(dt.scalar_type() == at::kFloat && dt.is_contiguous() && dt.sizes() == x.sizes(),
              "dt must be contiguous float32 [T, D]");
  TORCH_CHECK(A.scalar_type() == at::kFloat && A.is_contiguous() && A.dim() == 2 &&
                  A.size(0) == dim && A.size(1) % 16 == 0,
              "A must be contiguous float32 [D, N], N % 16 == 0");
  const int64_t n = A.size(1);
  TORCH_CHECK(B.dim() == 2 && B.sizes() == C.sizes() && B.size(0) == tokens && B.size(1) == n &&
                  B.is_contiguous() && C.is_contiguous() && B.scalar_type() == x.scalar_type() &&
                  C.scalar_type() == x.scalar_type(),
              "B and C must be contiguous [T, N] in x's dtype");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 3 &&
                  state.size(1) == dim && state.size(2) == n,
              "state must be contiguous float32 [slots, D, N]");
  const int64_t num_checkpoints = checkpoint_rows.has_value() ? checkpoint_rows->numel() : 0;
  TORCH_CHECK(num_checkpoints == 0 ||
                  (checkpoint_rows->scalar_type() == at::kLong &&
                   checkpoint_rows->is_contiguous() && checkpoint_states.has_value() &&
                   checkpoint_states->scalar_type() == at::kFloat &&
                   checkpoint_states->is_contiguous() &&
                   checkpoint_states->numel() == num_checkpoints * dim * n),
              "checkpoint_rows must be sorted int64 [C] with float32 checkpoint_states [C, D, N]");
  at::Tensor out = at::empty({tokens, dim}, x.options().dtype(at::kFloat));
  RUNTIME_CPU_DISPATCH(x.scalar_type(), "selective_scan", [&] {
    selective_scan_kernel<scalar_t>(
        x.data_ptr<scalar_t>(), dt.data_ptr<float>(), A.data_ptr<float>(),
        B.data_ptr<scalar_t>(), C.data_ptr<scalar_t>(), query_start_loc.data_ptr<int64_t>(),
        state_indices.data_ptr<int64_t>(), state.data_ptr<float>(), out.data_ptr<float>(), seqs,
        dim, n, num_checkpoints ? checkpoint_rows->data_ptr<int64_t>() : nullptr,
        num_checkpoints, num_checkpoints ? checkpoint_states->data_ptr<float>() : nullptr);
  });
  return out;
}

// Mamba 2 over a varlen batch (decode: one token per sequence), per head with state h [P, N]
// (N contiguous, float32): h = exp(dt A) h + dt x B^T; y = h C + D x. dt arrives final (bias,
// softplus and clamp done). Token by token, not the chunked quadratic form. Each work item owns
// a block of kRows rows of one head's state for one sequence. After each of the sorted
// `checkpoints` rows, the item's rows are also copied into that row's entry of `kept`
// [C, H, P, N].
constexpr int64_t kRows = 16;     // of the state, per work item
constexpr int64_t kSegment = 16;  // tokens a prefill item takes at a time
constexpr int64_t kStateRegs = kLanes == 16 ? 16 : 8;  // registers a row tile may hold
constexpr int64_t kMaxTiledState = 256;                // the largest N a prefill item tiles

// A tile of R state rows through `len` tokens, over NV vectors of columns from j0 (of N = n),
// with the state in registers: per token one load of B and C serves all R rows, and the state
// is read and written once per segment, not once per token. A row wider than one tile takes
// several, `first` to `last`, which carry each token's partial products of h C in `partial`
// [len, R]. x and out point at the tile's first row of the segment's first token, `stride`
// apart from token to token; Bf and Cf hold the segment's B and C in float32, [len, n].
template <int NV, int R, bool first, bool last, typename T>
void mamba2_tile(const float* Bf, const float* Cf, const float* dts, const float* decays,
                 int64_t len, int64_t n, int64_t j0, vecf* partial,
                 const T* x, T* out, int64_t stride, float d_skip, float* H, float* kept) {
  vecf h[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) h[r][v] = loadv(H + r * n + j0 + v * kLanes);
  for (int64_t k = 0; k < len; ++k) {
    const float decay = decays[k];
    float xs[R], u[R];
    vecf acc[R];
    for (int r = 0; r < R; ++r) {
      xs[r] = static_cast<float>(x[k * stride + r]);
      u[r] = dts[k] * xs[r];
      if constexpr (first) acc[r] = vecf{}; else acc[r] = partial[k * R + r];
    }
    for (int v = 0; v < NV; ++v) {
      const vecf b = loadv(Bf + k * n + j0 + v * kLanes);
      const vecf c = loadv(Cf + k * n + j0 + v * kLanes);
      for (int r = 0; r < R; ++r) {
        h[r][v] = h[r][v] * decay + b * u[r];
        acc[r] += h[r][v] * c;
      }
    }
    for (int r = 0; r < R; ++r) {
      if constexpr (last)
        out[k * stride + r] = static_cast<T>(hsum(acc[r]) + d_skip * xs[r]);
      else
        partial[k * R + r] = acc[r];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) {
      storev(H + r * n + j0 + v * kLanes, h[r][v]);
      if (kept != nullptr) stream_storev(kept + r * n + j0 + v * kLanes, h[r][v]);
    }
}

// R rows of the state, all n columns, in tiles of NV vectors.
template <int NV, int R, typename T>
void mamba2_row_tiles(const float* Bf, const float* Cf, const float* dts, const float* decays,
                      int64_t len, int64_t n, const T* x, T* out, int64_t stride, float d_skip,
                      float* H, float* kept) {
  constexpr int64_t width = NV * kLanes;
  if (n == width) {
    mamba2_tile<NV, R, true, true>(Bf, Cf, dts, decays, len, n, 0, nullptr, x, out, stride,
                                   d_skip, H, kept);
    return;
  }
  vecf partial[kSegment * R];
  mamba2_tile<NV, R, true, false>(Bf, Cf, dts, decays, len, n, 0, partial, x, out, stride,
                                  d_skip, H, kept);
  for (int64_t j0 = width; j0 + width < n; j0 += width)
    mamba2_tile<NV, R, false, false>(Bf, Cf, dts, decays, len, n, j0, partial, x, out, stride,
                                     d_skip, H, kept);
  mamba2_tile<NV, R, false, true>(Bf, Cf, dts, decays, len, n, n - width, partial, x, out,
                                  stride, d_skip, H, kept);
}

// One prefill item: rows [r0, r1) of head h's state H through tokens [t0, t1), in segments of
// kSegment tokens that also end after each checkpoint row. n is a multiple of NV vectors.
template <int NV, typename T>
void mamba2_prefill_rows(const T* x, const float* dt, float a, const T* B, const T* C,
                         float d_skip, int64_t t0, int64_t t1, int64_t r0, int64_t r1,
                         int64_t h, int64_t heads, int64_t p, int64_t grp, int64_t groups,
                         int64_t n, float* H, const int64_t* checkpoints,
                         int64_t num_checkpoints, int64_t c, float* kept, T* out) {
  constexpr int R = kStateRegs / NV > 0 ? kStateRegs / NV : 1;
  alignas(64) float Bf[kSegment * kMaxTiledState], Cf[kSegment * kMaxTiledState];
  float dts[kSegment], decays[kSegment];
  for (int64_t t = t0; t < t1;) {
    int64_t end = std::min(t1, t + kSegment);
    const bool checkpointed = c < num_checkpoints && checkpoints[c] < end;
    if (checkpointed) end = checkpoints[c] + 1;
    const int64_t len = end - t;
    for (int64_t k = 0; k < len; ++k) {
      for (int64_t j = 0; j < n; j += kLanes) {
        storev(Bf + k * n + j, loadv(B + ((t + k) * groups + grp) * n + j));
        storev(Cf + k * n + j, loadv(C + ((t + k) * groups + grp) * n + j));
      }
      dts[k] = dt[(t + k) * heads + h];
      decays[k] = std::exp(dts[k] * a);
    }
    float* kept_rows = checkpointed ? kept + (c * heads + h) * p * n : nullptr;
    const int64_t stride = heads * p;
    const T* xt = x + t * stride + h * p;
    T* yt = out + t * stride + h * p;
    int64_t i = r0;
    for (; i + R <= r1; i += R)
      mamba2_row_tiles<NV, R>(Bf, Cf, dts, decays, len, n, xt + i, yt + i, stride, d_skip,
                              H + i * n, kept_rows ? kept_rows + i * n : nullptr);
    for (; i < r1; ++i)
      mamba2_row_tiles<NV, 1>(Bf, Cf, dts, decays, len, n, xt + i, yt + i, stride, d_skip,
                              H + i * n, kept_rows ? kept_rows + i * n : nullptr);
    c += checkpointed;
    t = end;
  }
}

// One decode item (or a prefill item whose state size has no tile): token by token, each row's
// state streamed through once per token.
template <typename T>
void mamba2_rows_by_token(const T* x, const float* dt, float a, const T* B, const T* C,
                          float d_skip, int64_t t0, int64_t t1, int64_t r0, int64_t r1,
                          int64_t h, int64_t heads, int64_t p, int64_t grp, int64_t groups,
                          int64_t n, float* H, const int64_t* checkpoints,
                          int64_t num_checkpoints, int64_t c, float* kept, T* out) {
  for (int64_t t = t0; t < t1; ++t) {
    const float d = dt[t * heads + h], decay = std::exp(d * a);
    const T* Bt = B + (t * groups + grp) * n;
    const T* Ct = C + (t * groups + grp) * n;
    const T* xt = x + (t * heads + h) * p;
    T* yt = out + (t * heads + h) * p;
    for (int64_t i = r0; i < r1; ++i) {
      const float xi = static_cast<float>(xt[i]);
      vecf acc = {};
      for (int64_t j = 0; j < n; j += kLanes) {
        const vecf row = loadv(H + i * n + j) * decay + loadv(Bt + j) * (d * xi);
        storev(H + i * n + j, row);
        acc += row * loadv(Ct + j);
      }
      yt[i] = static_cast<T>(hsum(acc) + d_skip * xi);
    }
    if (c < num_checkpoints && checkpoints[c] == t) {
      std::copy(H + r0 * n, H + r1 * n, kept + ((c * heads + h) * p + r0) * n);
      ++c;
    }
  }
}

template <typename T>
void mamba2_scan_kernel(const T* x, const float* dt, const float* A, const T* B, const T* C,
                        const float* D, const int64_t* loc, const int64_t* rows, float* state,
                        T* out, int64_t seqs, int64_t heads, int64_t p, int64_t groups,
                        int64_t n, const int64_t* checkpoints, int64_t num_checkpoints,
                        float* kept) {
  const int64_t per_group = heads / groups, blocks = (p + kRows - 1) / kRows;
  at::parallel_for(0, seqs * heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / (heads * blocks), h = item / blocks % heads;
      const int64_t r0 = item % blocks * kRows, r1 = std::min(p, r0 + kRows);
      const int64_t grp = h / per_group, t0 = loc[s], t1 = loc[s + 1];
      float* H = state + (rows[s] * heads + h) * p * n;
      const int64_t c = std::lower_bound(checkpoints, checkpoints + num_checkpoints, t0) -
                        checkpoints;
      const float d_skip = D != nullptr ? D[h] : 0.f;
      auto tiled = [&](auto nv) {
        mamba2_prefill_rows<decltype(nv)::value>(x, dt, A[h], B, C, d_skip, t0, t1, r0, r1, h,
                                                 heads, p, grp, groups, n, H, checkpoints,
                                                 num_checkpoints, c, kept, out);
      };
      // The widest tile that divides a row, up to the registers a tile may hold.
      const bool prefill = t1 - t0 > 1 && n <= kMaxTiledState;
      if (prefill && n % (kStateRegs * kLanes) == 0) {
        tiled(std::integral_constant<int, kStateRegs>{});
      } else if (prefill && n % (8 * kLanes) == 0) {
        tiled(std::integral_constant<int, 8>{});
      } else if (prefill && n % (4 * kLanes) == 0) {
        tiled(std::integral_constant<int, 4>{});
      } else {
        mamba2_rows_by_token(x, dt, A[h], B, C, d_skip, t0, t1, r0, r1, h, heads, p, grp,
                             groups, n, H, checkpoints, num_checkpoints, c, kept, out);
      }
    }
  });
}

at::Tensor mamba2_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                       const at::Tensor& B, const at::Tensor& C,
                       const c10::optional<at::Tensor>& D, const at::Tensor& query_start_loc,
                       at::Tensor state, const at::Tensor& state_indices,
                       const c10::optional<at::Tensor>& checkpoint_rows,
                       const c10::optional<at::Tensor>& checkpoint_states) {
  const int64_t seqs = checked_sequences(query_start_loc, state_indices);
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "x must be contiguous [T, H, P]");
  const int64_t tokens = x.size(0), heads = x.size(1), p = x.size(2);
  TORCH_CHECK(B.dim() == 3 && B.sizes() == C.sizes() && B.size(0) == tokens &&
                  B.is_contiguous() && C.is_contiguous() && B.scalar_type() == x.scalar_type() &&
                  C.scalar_type() == x.scalar_type() && heads % B.size(1) == 0 &&
                  B.size(2) % 16 == 0,
              "B and C must be contiguous [T, G, N] in x's dtype, H % G == 0, N % 16 == 0");
  const int64_t groups = B.size(1), n = B.size(2);
  TORCH_CHECK(dt.scalar_type() == at::kFloat && dt.is_contiguous() &&
                  dt.numel() == tokens * heads,
              "dt must be contiguous float32 [T, H]");
  TORCH_CHECK(A.scalar_type() == at::kFloat && A.is_contiguous() && A.numel() == heads,
              "A must be contiguous float32 [H]");
  TORCH_CHECK(!D.has_value() || (D->scalar_type() == at::kFloat && D->is_contiguous() &&
                                 D->numel() == heads),
              "D must be contiguous float32 [H]");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 4 &&
                  state.size(1) == heads && state.size(2) == p && state.size(3) == n,
              "state must be contiguous float32 [slots, H, P, N]");
  const int64_t num_checkpoints = checkpoint_rows.has_value() ? checkpoint_rows->numel() : 0;
  TORCH_CHECK(num_checkpoints == 0 ||
                  (checkpoint_rows->scalar_type() == at::kLong &&
                   checkpoint_rows->is_contiguous() && checkpoint_states.has_value() &&
                   checkpoint_states->scalar_type() == at::kFloat &&
                   checkpoint_states->is_contiguous() &&
                   checkpoint_states->numel() == num_checkpoints * heads * p * n),
              "checkpoint_rows must be sorted int64 [C] with float32 checkpoint_states "
              "[C, H, P, N]");
  at::Tensor out = at::empty_like(x);
  RUNTIME_CPU_DISPATCH(x.scalar_type(), "mamba2_scan", [&] {
    mamba2_scan_kernel<scalar_t>(
        x.data_ptr<scalar_t>(), dt.data_ptr<float>(), A.data_ptr<float>(),
        B.data_ptr<scalar_t>(), C.data_ptr<scalar_t>(),
        D.has_value() ? D->data_ptr<float>() : nullptr, query_start_loc.data_ptr<int64_t>(),
        state_indices.data_ptr<int64_t>(), state.data_ptr<float>(), out.data_ptr<scalar_t>(),
        seqs, heads, p, groups, n,
        num_checkpoints ? checkpoint_rows->data_ptr<int64_t>() : nullptr, num_checkpoints,
        num_checkpoints ? checkpoint_states->data_ptr<float>() : nullptr);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(runtime_cpu, m) {
  m.def("gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
        "Tensor query_start_loc, Tensor(a!) state, Tensor state_indices, bool l2norm, "
        "float scale, Tensor? checkpoint_rows=None, Tensor(b!)? checkpoint_states=None) "
        "-> Tensor");
  m.def("kimi_delta_rule(Tensor q, Tensor k, Tensor v, Tensor decay, Tensor beta, "
        "Tensor query_start_loc, Tensor(a!) state, Tensor state_indices, bool l2norm, "
        "float scale, Tensor? checkpoint_rows=None, Tensor(b!)? checkpoint_states=None) "
        "-> Tensor");
  m.def("causal_conv1d(Tensor x, Tensor weight, Tensor? bias, Tensor query_start_loc, "
        "Tensor(a!) state, Tensor state_indices, Tensor has_initial_state, bool silu) -> Tensor");
  m.def("mamba2_scan(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, "
        "Tensor query_start_loc, Tensor(a!) state, Tensor state_indices, "
        "Tensor? checkpoint_rows=None, Tensor(b!)? checkpoint_states=None) -> Tensor");
  m.def("selective_scan(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
        "Tensor query_start_loc, Tensor(a!) state, Tensor state_indices, "
        "Tensor? checkpoint_rows=None, Tensor(b!)? checkpoint_states=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(runtime_cpu, CPU, m) {
  m.impl("gated_delta_rule", &delta_rule<false>);
  m.impl("kimi_delta_rule", &delta_rule<true>);
  m.impl("causal_conv1d", &causal_conv1d);
  m.impl("mamba2_scan", &mamba2_scan);
  m.impl("selective_scan", &selective_scan);
}
