// Small SIMD helpers over GCC/Clang vector extensions, shared by the CPU kernels.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

// The dtypes the kernels take: float32, bfloat16, float16.
#define RUNTIME_CPU_DISPATCH(TYPE, NAME, ...)                         \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                       \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)         \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)      \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace runtime_cpu {

// GCC/Clang vector extensions: 8 floats, compiled to one AVX2 register, two SSE/NEON ones.
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline v8f load8(const c10::BFloat16* p) {  // bf16 is the top half of a float32
  v8u16 h;
  __builtin_memcpy(&h, p, sizeof(h));
  v8u32 w = __builtin_convertvector(h, v8u32) << 16;
  v8f v;
  __builtin_memcpy(&v, &w, sizeof(v));
  return v;
}

inline v8f load8(const c10::Half* p) {
#if defined(__F16C__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<v8f>(_mm256_cvtph_ps(h));
#else
  float f[8];
  for (int j = 0; j < 8; ++j) f[j] = static_cast<float>(p[j]);
  return load8(f);
#endif
}

inline void store8(float* p, v8f v) { __builtin_memcpy(p, &v, sizeof(v)); }

inline void store8(c10::BFloat16* p, v8f v) {  // round to nearest even, as c10 does
  v8u32 w;
  __builtin_memcpy(&w, &v, sizeof(w));
  w = (w + 0x7fffu + ((w >> 16) & 1u)) >> 16;
  v8u16 h = __builtin_convertvector(w, v8u16);
  __builtin_memcpy(p, &h, sizeof(h));
}

inline void store8(c10::Half* p, v8f v) {
#if defined(__F16C__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(reinterpret_cast<__m256>(v), _MM_FROUND_TO_NEAREST_INT));
#else
  for (int j = 0; j < 8; ++j) p[j] = static_cast<c10::Half>(v[j]);
#endif
}

inline float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

typedef int32_t v8i __attribute__((vector_size(32)));

// e^x on a float vector V with the same-width int32 vector I: Cody-Waite range reduction to r in
// [-ln2/2, ln2/2], a degree-5 polynomial for e^r (Cephes' coefficients), times 2^n. Inputs are
// clamped to [-87.3, 88.3].
template <typename V, typename I>
inline V exp_poly(V x) {
  const V lo = V{} - 87.3f, hi = V{} + 88.3f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  V y0 = x * 1.44269504088896341f;
  I n = __builtin_convertvector(y0 + (y0 >= 0 ? 0.5f : -0.5f), I);  // round(x / ln2)
  V nf = __builtin_convertvector(n, V);
  V r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  V y = p * r * r + r + 1.f;
  I bits = (n + 127) << 23;
  V scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

inline v8f exp8(v8f x) { return exp_poly<v8f, v8i>(x); }

// In place: row <- exp(row - m), m = max(row, sink); returns the sum plus exp(sink - m). A
// finite sink is an attention sink: one more logit in the denominator, with no value. With
// `max_out`, m is stored there (the log-sum-exp is m + log(sum)).
inline float softmax_numerator(float* row, int64_t n,
                               float sink = -std::numeric_limits<float>::infinity(),
                               float* max_out = nullptr) {
  // The maximum eight lanes at a time: a scalar max is a chain of dependent instructions
  // (it was 14 % of a decode attention call).
  v8f mx8 = v8f{} - std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8f x = load8(row + i);
    mx8 = mx8 > x ? mx8 : x;
  }
  float mx = sink;
  for (int j = 0; j < 8; ++j) mx = std::max(mx, mx8[j]);
  for (; i < n; ++i) mx = std::max(mx, row[i]);
  if (max_out) *max_out = mx;
  v8f sum8 = {};
  i = 0;
  for (; i + 8 <= n; i += 8) {
    v8f e = exp8(load8(row + i) - mx);
    store8(row + i, e);
    sum8 += e;
  }
  float sum = hsum(sum8);
  for (; i < n; ++i) {
    row[i] = std::exp(row[i] - mx);
    sum += row[i];
  }
  return sink == -std::numeric_limits<float>::infinity() ? sum : sum + std::exp(sink - mx);
}

// 16 floats: one AVX-512 register (the kernels use them only there, see `vecf`); bf16 and fp16
// convert in registers (vcvtneps2bf16 where AVX512-BF16 exists).
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));

inline v16f load16(const float* p) {
  v16f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline v16f bf16_bits_to_float(v16u16 h) {  // bf16 is the top half of a float32
#if defined(__AVX512F__)  // one widening move (GCC splits the generic one in two)
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(h)), 16);
  return reinterpret_cast<v16f>(_mm512_castsi512_ps(w));
#else
  v16u32 w = __builtin_convertvector(h, v16u32) << 16;
  v16f v;
  __builtin_memcpy(&v, &w, sizeof(v));
  return v;
#endif
}

inline v16u16 float_to_bf16_bits(v16f v) {  // round to nearest even, as c10 does
#if defined(__AVX512BF16__)
  return reinterpret_cast<v16u16>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(v)));
#else
  v16u32 w;
  __builtin_memcpy(&w, &v, sizeof(w));
  w = (w + 0x7fffu + ((w >> 16) & 1u)) >> 16;
  return __builtin_convertvector(w, v16u16);
#endif
}

inline v16f load16(const c10::BFloat16* p) {
  v16u16 h;
  __builtin_memcpy(&h, p, sizeof(h));
  return bf16_bits_to_float(h);
}

inline v16f load16(const c10::Half* p) {
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<v16f>(_mm512_cvtph_ps(h));
#else
  float f[16];
  for (int j = 0; j < 16; ++j) f[j] = static_cast<float>(p[j]);
  return load16(f);
#endif
}

inline void store16(float* p, v16f v) { __builtin_memcpy(p, &v, sizeof(v)); }

inline void store16(c10::BFloat16* p, v16f v) {
  v16u16 h = float_to_bf16_bits(v);
  __builtin_memcpy(p, &h, sizeof(h));
}

inline void store16(c10::Half* p, v16f v) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(reinterpret_cast<__m512>(v), _MM_FROUND_TO_NEAREST_INT));
#else
  for (int j = 0; j < 16; ++j) p[j] = static_cast<c10::Half>(v[j]);
#endif
}

// x rounded to T and back, in registers: the value a torch op in dtype T would have produced.
template <typename T>
inline v16f round16(v16f x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return bf16_bits_to_float(float_to_bf16_bits(x));
  } else {
#if defined(__AVX512F__)
    const __m512 v = reinterpret_cast<__m512>(x);
    return reinterpret_cast<v16f>(_mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)));
#else
    T tmp[16];
    store16(tmp, x);
    return load16(tmp);
#endif
  }
}

inline float hsum(v16f v) {  // shuffles, not memcpy: an accumulator whose address is taken
                              // would live on the stack through its whole loop
  const v8f lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const v8f hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return hsum(lo + hi);
}

// The element-wise kernels' vector: 16 lanes where that is one register (AVX-512), 8 elsewhere
// (GCC lowers a 16-lane generic vector badly without AVX-512: 2-5x slower on AVX2).
#if defined(__AVX512F__)
using vecf = v16f;
using veci = v16i;
#else
using vecf = v8f;
using veci = v8i;
#endif
constexpr int64_t kLanes = sizeof(vecf) / sizeof(float);

inline vecf expv(vecf x) { return exp_poly<vecf, veci>(x); }
inline vecf siluv(vecf x) { return x / (1.f + expv(vecf{} - x)); }

template <typename T>
inline vecf loadv(const T* p) {
  if constexpr (kLanes == 16) return load16(p); else return load8(p);
}

template <typename T>
inline void storev(T* p, vecf v) {
  if constexpr (kLanes == 16) store16(p, v); else store8(p, v);
}

// A store that bypasses the caches (no read for ownership) where p is aligned, for data the
// kernel will not read back, such as prefix-cache checkpoints.
inline void stream_storev(float* p, vecf v) {
#if defined(__AVX512F__)
  if (reinterpret_cast<uintptr_t>(p) % 64 == 0) {
    _mm512_stream_ps(p, reinterpret_cast<__m512>(v));
    return;
  }
#elif defined(__AVX__)
  if (reinterpret_cast<uintptr_t>(p) % 32 == 0) {
    _mm256_stream_ps(p, reinterpret_cast<__m256>(v));
    return;
  }
#endif
  storev(p, v);
}

// x rounded to T and back, in registers: the value a torch op in dtype T would have produced.
template <typename T>
inline vecf roundv(vecf x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (kLanes == 16) {
    return round16<T>(x);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {  // round to nearest even, as c10
    v8u32 w;
    __builtin_memcpy(&w, &x, sizeof(w));
    w = (w + 0x7fffu + ((w >> 16) & 1u)) & 0xffff0000u;
    __builtin_memcpy(&x, &w, sizeof(x));
    return x;
  } else {
    T tmp[8];
    store8(tmp, x);
    return load8(tmp);
  }
}

}  // namespace runtime_cpu
