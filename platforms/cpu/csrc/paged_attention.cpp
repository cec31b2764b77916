// Paged attention for decode steps on the CPU: one query token per sequence, reading K and V
// straight from the paged cache (no gather), one pass of scores, softmax, weighted sum of V.
// Work is split over sequences (or, with few sequences, (sequence, KV head) pairs), one run of
// them per thread balanced by blocks read, with at::parallel_for, so it follows
// torch.set_num_threads. Accumulation is in float32 for every cache dtype.
//
// The cache is in the query's dtype, or in FP8 (e4m3fn or e5m2) holding K / k_scale and
// V / v_scale: FP8 rows are widened to float32 eight at a time in registers, k_scale is folded
// into the scaled query and v_scale into the softmax normaliser.
//
// Attention sinks (gpt-oss), when given, are one float32 logit per query head that joins the
// softmax's denominator and adds no value.
//
// With `lse` [num_seqs, num_heads] float32, each head's log-sum-exp of its scaled scores is
// stored there too (decode context parallel merges partial outputs by it); a sequence of
// length 0 then gets a zero output and an LSE of -inf.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

using namespace runtime_cpu;

// Eight FP8 values (sign, EXP exponent bits with bias BIAS, MANT mantissa bits) as float32, in
// integer registers: a normal number gets its exponent rebiased, a subnormal one is its
// mantissa times the smallest subnormal (no float32 subnormals, which are slow on x86).
template <int MANT, int BIAS>
inline v8f fp8_to_float(const void* p) {
  typedef uint8_t v8u8 __attribute__((vector_size(8)));
  v8u8 bytes;
  __builtin_memcpy(&bytes, p, sizeof(bytes));
  const v8i b = __builtin_convertvector(bytes, v8i);
  const v8i mag = b & 0x7f;
  v8i normal_bits = (mag << (23 - MANT)) + ((127 - BIAS) << 23);
  v8f normal, sub = __builtin_convertvector(mag, v8f) * std::ldexp(1.f, 1 - BIAS - MANT);
  __builtin_memcpy(&normal, &normal_bits, sizeof(normal));
  v8f value = (mag >> MANT) == 0 ? sub : normal;
  v8i bits;
  __builtin_memcpy(&bits, &value, sizeof(bits));
  bits |= (b & 0x80) << 24;
  __builtin_memcpy(&value, &bits, sizeof(value));
  return value;
}

using runtime_cpu::load8;  // the overloads below join simd.h's instead of hiding them
inline v8f load8(const c10::Float8_e4m3fn* p) { return fp8_to_float<3, 7>(p); }
inline v8f load8(const c10::Float8_e5m2* p) { return fp8_to_float<2, 15>(p); }

// A cache in the query's dtype is read 16 lanes at a time on AVX-512 (one register), an FP8
// one and any cache elsewhere 8.
template <typename C>
constexpr bool kFp8 = std::is_same_v<C, c10::Float8_e4m3fn> || std::is_same_v<C, c10::Float8_e5m2>;
template <typename C>
using CacheVec = std::conditional_t<kFp8<C> || kLanes == 8, v8f, v16f>;

template <typename V, typename T>
inline V load_vec(const T* p) {
  if constexpr (std::is_same_v<V, v16f>) return load16(p); else return load8(p);
}

template <typename V>
inline void store_vec(float* p, V v) {
  if constexpr (std::is_same_v<V, v16f>) store16(p, v); else store8(p, v);
}

// One head's rows of a block two ahead, loaded before the pass reaches them: a block is a jump
// in memory the hardware prefetcher does not follow, and a few threads alone keep too few misses
// in flight to reach the memory bandwidth otherwise. Plain loads, one byte of each line, rather
// than prefetch instructions: on a Zen 5 EPYC (a VM) prefetcht1 and prefetcht0 changed nothing
// (bf16, batch 64 x 192 tokens from DRAM, 2 threads: 698 us a call with them, 653 without),
// where loading the same lines took it to 499 us (fp32: 1319 -> 920 us; bf16 64 x 1024: 4258 ->
// 3486 us); an earlier AVX-512 EPYC had gained as much from prefetcht1 (26 -> 40 GB/s in fp32,
// 14 -> 32 in bf16 at 64 x 1024). Loading every other line gained nothing, and carrying the
// look-ahead across the passes and into the next sequence gained nothing more.
template <typename C>
inline void load_rows_ahead(const C* rows, int64_t count, int64_t stride, int64_t head_size) {
  const int64_t bytes = head_size * static_cast<int64_t>(sizeof(C));
  for (int64_t r = 0; r < count; ++r)
    for (int64_t off = 0; off < bytes; off += 64)
      static_cast<void>(*(reinterpret_cast<const volatile char*>(rows + r * stride) + off));
}

// Two accumulators break the FMA dependency chain; n is a multiple of 8.
template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  if constexpr (std::is_same_v<CacheVec<T>, v16f>) {
    v16f a0 = {}, a1 = {};
    int64_t d = 0;
    for (; d + 32 <= n; d += 32) {
      a0 += load16(q + d) * load16(k + d);
      a1 += load16(q + d + 16) * load16(k + d + 16);
    }
    if (d + 16 <= n) a0 += load16(q + d) * load16(k + d), d += 16;
    const float sum = hsum(a0 + a1);
    return d < n ? sum + hsum(load8(q + d) * load8(k + d)) : sum;
  }
  v8f a0 = {}, a1 = {};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    a0 += load8(q + d) * load8(k + d);
    a1 += load8(q + d + 8) * load8(k + d + 8);
  }
  if (d < n) a0 += load8(q + d) * load8(k + d);
  return hsum(a0 + a1);
}

// Lane t of the result: the sum of the 16 lanes of part[t]. Four levels of shuffles and adds
// for 16 sums, where 16 horizontal sums take four levels each.
inline v16f reduce_rows(const v16f* part) {
  v16f l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i)  // lanes 8i'..: 8 partial sums of rows 2i, 2i + 1
    l1[i] = __builtin_shufflevector(part[2 * i], part[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16,
                                    17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(part[2 * i], part[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15,
                                    24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // 4 partial sums of rows 4i .. 4i + 3
    l2[i] = __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                    18, 19, 24, 25, 26, 27) +
            __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                    22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // 2 partial sums of rows 8i .. 8i + 7
    l3[i] = __builtin_shufflevector(l2[2 * i], l2[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                    20, 21, 24, 25, 28, 29) +
            __builtin_shufflevector(l2[2 * i], l2[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                    22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(l3[0], l3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                 26, 28, 30) +
         __builtin_shufflevector(l3[0], l3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}

// The same for 8 rows of 8 lanes.
inline v8f reduce_rows(const v8f* part) {
  v8f l1[4], l2[2];
  for (int i = 0; i < 4; ++i)  // lanes 0-3: 4 partial sums of row 2i; 4-7: of row 2i + 1
    l1[i] = __builtin_shufflevector(part[2 * i], part[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
            __builtin_shufflevector(part[2 * i], part[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)  // lanes 2k, 2k + 1: 2 partial sums of row 4i + k
    l2[i] = __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
            __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(l2[0], l2[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(l2[0], l2[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

// Lane t: the dot product of q with the t-th of as many K rows `stride` apart as V has lanes
// (16 on AVX-512; 8 on AVX2 and for fp8 caches), one reduction for them all instead of a
// horizontal sum per row; HEAD is a multiple of the lane count.
template <int HEAD, typename V, typename C>
inline V dot_rows(const float* q, const C* k, int64_t stride) {
  constexpr int width = sizeof(V) / sizeof(float);
  V part[width];
  for (int t = 0; t < width; ++t) {
    const C* row = k + t * stride;
    V a = load_vec<V>(q) * load_vec<V>(row);
    for (int j = width; j < HEAD; j += width) a += load_vec<V>(q + j) * load_vec<V>(row + j);
    part[t] = a;
  }
  return reduce_rows(part);
}

#if defined(__AVX512BF16__)
// dot_rows for a bf16 query and cache on AVX512-BF16: 32 products per instruction (vdpbf16ps),
// summed in float32; the query stays unscaled (scaling it would round it again), the caller
// scales the scores.
template <int HEAD>
inline v16f dot16_bf16(const c10::BFloat16* q, const c10::BFloat16* k, int64_t stride) {
  __m512bh qv[HEAD / 32];
  for (int j = 0; j < HEAD / 32; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(q + 32 * j);
  v16f part[16];
  for (int t = 0; t < 16; ++t) {
    const c10::BFloat16* row = k + t * stride;
    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(row));
    for (int j = 1; j < HEAD / 32; ++j)
      a = _mm512_dpbf16_ps(a, qv[j], (__m512bh)_mm512_loadu_si512(row + 32 * j));
    part[t] = reinterpret_cast<v16f>(a);
  }
  return reduce_rows(part);
}
#endif

// acc[g] (HEAD floats each) += the sum over r < count of w[g * w_stride + r] x V row r, for TILE
// heads of a group: each row is loaded once for them all. TILE is a template argument so that
// the accumulators stay in registers (a tile size known only at run time left them on the
// stack, a load and a store around each FMA: bf16, batch 64 x 128 tokens, cache hot, one
// thread, 664 -> 516 us per call).
template <int TILE, int HEAD, typename V, typename C>
inline void weighted_rows(float* acc, const float* w, int64_t w_stride, const C* v,
                          int64_t v_stride, int64_t count) {
  constexpr int64_t width = sizeof(V) / sizeof(float), lanes = HEAD / width;
  V regs[TILE][lanes];
  for (int64_t g = 0; g < TILE; ++g)
    for (int64_t j = 0; j < lanes; ++j) regs[g][j] = load_vec<V>(acc + g * HEAD + width * j);
  for (int64_t r = 0; r < count; ++r, v += v_stride) {
    V row[lanes];
    for (int64_t j = 0; j < lanes; ++j) row[j] = load_vec<V>(v + width * j);
    for (int64_t g = 0; g < TILE; ++g) {
      const float weight = w[g * w_stride + r];
      for (int64_t j = 0; j < lanes; ++j) regs[g][j] += weight * row[j];
    }
  }
  for (int64_t g = 0; g < TILE; ++g)
    for (int64_t j = 0; j < lanes; ++j) store_vec(acc + g * HEAD + width * j, regs[g][j]);
}

// weighted_rows for a run-time tile of 1 .. TILE heads.
template <int TILE, int HEAD, typename V, typename C>
inline void weighted_rows_upto(int64_t tile, float* acc, const float* w, int64_t w_stride,
                               const C* v, int64_t v_stride, int64_t count) {
  if constexpr (TILE > 1)
    if (tile < TILE)
      return weighted_rows_upto<TILE - 1, HEAD, V, C>(tile, acc, w, w_stride, v, v_stride, count);
  weighted_rows<TILE, HEAD, V, C>(acc, w, w_stride, v, v_stride, count);
}

// The (sequence, run of KV heads) items of each of `parts` parts, `runs` per sequence, as
// bounds[p] .. bounds[p + 1]: cut where the running count of blocks read crosses an equal
// share, so that ragged contexts load the threads evenly (with equal item counts, the thread
// whose sequences happen to be the long ones finishes last). An item costs one block more than
// it reads: its set-up and its output.
std::vector<int64_t> split_items(const int32_t* lens, int64_t num_seqs, int64_t runs,
                                 int64_t block_size, int64_t sliding_window, int64_t parts) {
  std::vector<int64_t> cost(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = lens[s];
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
    const int64_t blocks = len > first ? (len - 1) / block_size - first / block_size + 1 : 0;
    cost[s + 1] = cost[s] + runs * (blocks + 1);
  }
  std::vector<int64_t> bounds(parts + 1, num_seqs * runs);
  bounds[0] = 0;
  int64_t s = 0;
  for (int64_t p = 1; p < parts; ++p) {
    const int64_t share = cost[num_seqs] * p / parts;
    while (s < num_seqs && cost[s + 1] <= share) ++s;
    const int64_t per_item = s < num_seqs ? (cost[s + 1] - cost[s]) / runs : 1;
    const int64_t item = s * runs + (share - cost[s]) / per_item;
    bounds[p] = std::clamp(item, bounds[p - 1], num_seqs * runs);
  }
  return bounds;
}

// Sequences per thread from which an item takes all of a sequence's KV heads.
constexpr int64_t kSeqsPerThread = 4;

// HEAD > 0 fixes the head size at compile time, so the loops unroll and the output rows
// stay in registers through a block; HEAD == 0 reads it at run time.
template <typename T, typename C, int HEAD>
void decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
            double scale, int64_t sliding_window, double k_scale, double v_scale,
            const float* sinks, float* lse) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t head_size = HEAD > 0 ? HEAD : query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t kb_stride = k_cache.stride(0), kt_stride = k_cache.stride(1),
                kh_stride = k_cache.stride(2);
  const int64_t vb_stride = v_cache.stride(0), vt_stride = v_cache.stride(1),
                vh_stride = v_cache.stride(2);
  const int64_t qs_stride = query.stride(0), qh_stride = query.stride(1);
  const int64_t os_stride = out.stride(0), oh_stride = out.stride(1);
  const int64_t bt_stride = block_tables.stride(0);
  const T* q_ptr = query.data_ptr<T>();
  const C* k_ptr = static_cast<const C*>(k_cache.data_ptr());
  const C* v_ptr = static_cast<const C*>(v_cache.data_ptr());
  const float q_scale = static_cast<float>(scale * k_scale);
  T* o_ptr = out.data_ptr<T>();
  const int32_t* bt_ptr = block_tables.data_ptr<int32_t>();
  const int32_t* len_ptr = seq_lens.data_ptr<int32_t>();
  // An item is one sequence's run of `span` KV heads: all of them where there are sequences
  // enough to keep every thread busy, so that each block is read as one run of memory (its
  // rows hold every head side by side), else one head, so that one long sequence still
  // spreads over the threads.
  const int64_t threads = at::get_num_threads();
  const int64_t span = num_seqs >= kSeqsPerThread * threads ? num_kv_heads : 1;
  const int64_t spans = num_kv_heads / span, heads = span * group;  // query heads of an item
  const int64_t items = num_seqs * spans;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  const std::vector<int64_t> bounds =
      split_items(len_ptr, num_seqs, spans, block_size, sliding_window, parts);

  // The rows of the item's KV heads in the block two ahead of block b of a pass, loaded.
  const auto load_ahead = [&](const C* cache, int64_t b_stride, int64_t t_stride,
                              int64_t h_stride, const int32_t* table, int64_t len, int64_t kvh0,
                              int64_t b) {
    if ((b + 2) * block_size >= len) return;
    for (int64_t h = kvh0; h < kvh0 + span; ++h)
      load_rows_ahead(cache + table[b + 2] * b_stride + h * h_stride, block_size, t_stride,
                      head_size);
  };

  at::parallel_for(0, parts, 1, [&](int64_t part_begin, int64_t part_end) {
    std::vector<float> q(heads * head_size), acc(heads * head_size), scores, sums(heads),
        maxes(heads);
    for (int64_t item = bounds[part_begin]; item < bounds[part_end]; ++item) {
      const int64_t s = item / spans, kvh0 = item % spans * span, h0 = kvh0 * group;
      const int64_t len = len_ptr[s];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const int64_t n = len - first;
      const int32_t* table = bt_ptr + s * bt_stride;
      if (n == 0) {  // an empty shard of a context (decode context parallel)
        for (int64_t h = h0; h < h0 + heads; ++h) {
          T* dst = o_ptr + s * os_stride + h * oh_stride;
          for (int64_t d = 0; d < head_size; ++d) dst[d] = static_cast<T>(0.f);
          if (lse) lse[s * num_heads + h] = -std::numeric_limits<float>::infinity();
        }
        continue;
      }
      const T* q_item = q_ptr + s * qs_stride + h0 * qh_stride;  // the item's first head
      for (int64_t g = 0; g < heads; ++g) {
        const T* src = q_item + g * qh_stride;
        for (int64_t d = 0; d < head_size; ++d)
          q[g * head_size + d] = static_cast<float>(src[d]) * q_scale;
      }
      scores.resize(heads * n);
      // Scores block by block: no division per token, and a block's rows are adjacent.
      for (int64_t b = first / block_size; b * block_size < len; ++b) {
        const int64_t lo = std::max(first, b * block_size);
        const int64_t hi = std::min(len, (b + 1) * block_size);
        load_ahead(k_ptr, kb_stride, kt_stride, kh_stride, table, len, kvh0, b);
        for (int64_t kvh = kvh0; kvh < kvh0 + span; ++kvh) {
          const int64_t g0 = (kvh - kvh0) * group;  // the KV head's first query head here
          const C* k = k_ptr + table[b] * kb_stride + kvh * kh_stride +
                       (lo - b * block_size) * kt_stride;
          float* row = scores.data() + g0 * n + (lo - first);
          int64_t t = lo;
#if defined(__AVX512BF16__)
          if constexpr (HEAD > 0 && HEAD % 32 == 0 && std::is_same_v<C, c10::BFloat16> &&
                        std::is_same_v<T, c10::BFloat16>) {
            const v16f scale16 = v16f{} + q_scale;
            for (; t + 16 <= hi; t += 16, k += 16 * kt_stride, row += 16)
              for (int64_t g = 0; g < group; ++g)
                store16(row + g * n,
                        scale16 * dot16_bf16<HEAD>(q_item + (g0 + g) * qh_stride, k, kt_stride));
          }
#endif
          if constexpr (HEAD > 0 && HEAD % 16 == 0 && std::is_same_v<CacheVec<C>, v16f>) {
            for (; t + 16 <= hi; t += 16, k += 16 * kt_stride, row += 16)
              for (int64_t g = 0; g < group; ++g)
                store16(row + g * n,
                        dot_rows<HEAD, v16f>(q.data() + (g0 + g) * head_size, k, kt_stride));
          }
          if constexpr (HEAD > 0 && HEAD % 8 == 0 && std::is_same_v<CacheVec<C>, v8f>) {
            for (; t + 8 <= hi; t += 8, k += 8 * kt_stride, row += 8)
              for (int64_t g = 0; g < group; ++g)
                store8(row + g * n,
                       dot_rows<HEAD, v8f>(q.data() + (g0 + g) * head_size, k, kt_stride));
          }
          for (; t < hi; ++t, k += kt_stride, ++row)
            for (int64_t g = 0; g < group; ++g)
              row[g * n] = dot(q.data() + (g0 + g) * head_size, k, head_size);
        }
      }
      const float no_sink = -std::numeric_limits<float>::infinity();
      for (int64_t g = 0; g < heads; ++g)
        sums[g] = softmax_numerator(scores.data() + g * n, n, sinks ? sinks[h0 + g] : no_sink,
                                    lse ? &maxes[g] : nullptr);
      if (lse)
        for (int64_t g = 0; g < heads; ++g)
          lse[s * num_heads + h0 + g] = maxes[g] + std::log(sums[g]);
      // The weighted sums of V rows, block by block: with the head size known, up to kTile
      // heads of a group at a time (weighted_rows), so that each V row is read from memory
      // once, and from L1 for the group's other tiles. A tile's accumulators take half the
      // vector registers (16 of AVX-512's 32, 8 of AVX2's 16): on AVX2 a tile of two 64-wide
      // heads took all 16 and spilled the V row.
      using V = CacheVec<C>;
      constexpr int64_t lanes = HEAD > 0 ? HEAD / (sizeof(V) / sizeof(float)) : 1;
      constexpr int kTile = HEAD > 0 ? std::max<int>(1, (kLanes == 16 ? 16 : 8) / lanes) : 1;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = first / block_size; b * block_size < len; ++b) {
        const int64_t lo = std::max(first, b * block_size);
        const int64_t hi = std::min(len, (b + 1) * block_size);
        load_ahead(v_ptr, vb_stride, vt_stride, vh_stride, table, len, kvh0, b);
        for (int64_t kvh = kvh0; kvh < kvh0 + span; ++kvh) {
          const C* v = v_ptr + table[b] * vb_stride + kvh * vh_stride +
                       (lo - b * block_size) * vt_stride;
          for (int64_t g0 = (kvh - kvh0) * group, g_end = g0 + group; g0 < g_end; g0 += kTile) {
            float* a = acc.data() + g0 * head_size;
            const float* w = scores.data() + g0 * n + (lo - first);
            if constexpr (HEAD > 0) {
              weighted_rows_upto<kTile, HEAD, V, C>(std::min<int64_t>(kTile, g_end - g0), a, w,
                                                    n, v, vt_stride, hi - lo);
            } else {
              const C* vr = v;
              for (int64_t r = 0; r < hi - lo; ++r, vr += vt_stride)
                for (int64_t d = 0; d < head_size; d += 8)
                  store8(a + d, load8(a + d) + w[r] * load8(vr + d));
            }
          }
        }
      }
      for (int64_t g = 0; g < heads; ++g) {
        T* dst = o_ptr + s * os_stride + (h0 + g) * oh_stride;
        const float inv = static_cast<float>(v_scale) / sums[g];
        for (int64_t d = 0; d < head_size; ++d)
          dst[d] = static_cast<T>(acc[g * head_size + d] * inv);
      }
    }
  });
}

template <typename T, typename C>
void decode_any_head(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, double scale, int64_t sliding_window,
                     double k_scale, double v_scale, const float* sinks, float* lse) {
  switch (query.size(2)) {
    case 64: return decode<T, C, 64>(out, query, k_cache, v_cache, block_tables, seq_lens,
                                     scale, sliding_window, k_scale, v_scale, sinks, lse);
    case 128: return decode<T, C, 128>(out, query, k_cache, v_cache, block_tables, seq_lens,
                                       scale, sliding_window, k_scale, v_scale, sinks, lse);
    default: return decode<T, C, 0>(out, query, k_cache, v_cache, block_tables, seq_lens,
                                    scale, sliding_window, k_scale, v_scale, sinks, lse);
  }
}

// The cache in the query's dtype T, or in one of the FP8 formats.
template <typename T>
void decode_any_cache(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, double scale, int64_t sliding_window,
                      double k_scale, double v_scale, const float* sinks, float* lse) {
  switch (k_cache.scalar_type()) {
    case at::kFloat8_e4m3fn:
      return decode_any_head<T, c10::Float8_e4m3fn>(out, query, k_cache, v_cache, block_tables,
                                                    seq_lens, scale, sliding_window, k_scale,
                                                    v_scale, sinks, lse);
    case at::kFloat8_e5m2:
      return decode_any_head<T, c10::Float8_e5m2>(out, query, k_cache, v_cache, block_tables,
                                                  seq_lens, scale, sliding_window, k_scale,
                                                  v_scale, sinks, lse);
    default:
      return decode_any_head<T, T>(out, query, k_cache, v_cache, block_tables, seq_lens, scale,
                                   sliding_window, k_scale, v_scale, sinks, lse);
  }
}

void paged_attention_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t sliding_window,
                            double k_scale, double v_scale,
                            const std::optional<at::Tensor>& sinks,
                            const std::optional<at::Tensor>& lse) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
              "query and out must be [num_seqs, num_heads, head_size]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_size]");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn ||
                   k_cache.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK((fp8 || query.scalar_type() == k_cache.scalar_type()) &&
                  v_cache.scalar_type() == k_cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "query and out must share one dtype, and the cache must be in it or in FP8");
  TORCH_CHECK(query.size(2) == k_cache.size(3) && query.size(1) % k_cache.size(2) == 0,
              "head sizes differ or num_heads is not a multiple of num_kv_heads");
  TORCH_CHECK(query.size(2) % 8 == 0, "head_size must be a multiple of 8");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  seq_lens.is_contiguous() && block_tables.stride(1) == 1,
              "block_tables and seq_lens must be int32 with contiguous rows");
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                         sinks->dim() == 1 && sinks->size(0) == query.size(1)),
              "sinks must be contiguous float32, one per query head");
  TORCH_CHECK(!lse || (lse->scalar_type() == at::kFloat && lse->is_contiguous() &&
                       lse->dim() == 2 && lse->size(0) == query.size(0) &&
                       lse->size(1) == query.size(1)),
              "lse must be contiguous float32 [num_seqs, num_heads]");
  const float* sink_ptr = sinks ? sinks->data_ptr<float>() : nullptr;
  float* lse_ptr = lse ? lse->data_ptr<float>() : nullptr;
  RUNTIME_CPU_DISPATCH(query.scalar_type(), "paged_attention_decode", [&] {
    decode_any_cache<scalar_t>(out, query, k_cache, v_cache, block_tables, seq_lens, scale,
                               sliding_window, k_scale, v_scale, sink_ptr, lse_ptr);
  });
}

// key and value [tokens, kv_heads, head_size] into the caches' slots: token t's row of head h
// goes to block slot / block_size, offset slot % block_size; the caches are strided views
// [num_blocks, block_size, num_kv_heads, head_size] of any layout, in the rows' dtype.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache,
                    at::Tensor v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes() && key.size(1) == k_cache.size(2) &&
                  key.size(2) == k_cache.size(3),
              "key and value must be [tokens, kv_heads, head_size], the caches [num_blocks, "
              "block_size, kv_heads, head_size]");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() &&
                  value.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "key, value and the caches must share one dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "slot_mapping must be contiguous int64, one slot per token");
  const int64_t tokens = key.size(0), heads = key.size(1);
  const int64_t block_size = k_cache.size(1), slots_total = k_cache.size(0) * block_size;
  const int64_t bytes = key.size(2) * key.element_size(), item = key.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < slots_total, "slot ", slots[t], " of token ", t,
                " is outside the cache's ", slots_total, " slots");
  struct Copy {  // one of K and V: where its rows are read and written, strides in bytes
    const char* src;
    int64_t token, head;
    char* dst;
    int64_t block, offset, cache_head;
  };
  auto copy_of = [item](const at::Tensor& rows, at::Tensor& cache) {
    return Copy{static_cast<const char*>(rows.data_ptr()), rows.stride(0) * item,
                rows.stride(1) * item, static_cast<char*>(cache.data_ptr()),
                cache.stride(0) * item, cache.stride(1) * item, cache.stride(2) * item};
  };
  const Copy copies[2] = {copy_of(key, k_cache), copy_of(value, v_cache)};
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      for (const Copy& c : copies)
        for (int64_t h = 0; h < heads; ++h)
          std::memcpy(c.dst + block * c.block + offset * c.offset + h * c.cache_head,
                      c.src + t * c.token + h * c.head, bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY(runtime_cpu, m) {
  m.def("paged_attention_decode(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int sliding_window, "
        "float k_scale=1.0, float v_scale=1.0, Tensor? sinks=None, Tensor(c!)? lse=None) -> ()");
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(runtime_cpu, CPU, m) {
  m.impl("paged_attention_decode", &paged_attention_decode);
  m.impl("write_kv_cache", &write_kv_cache);
}
