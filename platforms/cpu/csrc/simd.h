// Small SIMD helpers over GCC/Clang vector extensions, shared by the CPU kernels.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

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
  float f[8];
  for (int j = 0; j < 8; ++j) f[j] = static_cast<float>(p[j]);
  return load8(f);
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
  for (int j = 0; j < 8; ++j) p[j] = static_cast<c10::Half>(v[j]);
}

// x rounded to T and back: the value a torch op in dtype T would have produced.
template <typename T>
inline v8f round_to(v8f x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    T tmp[8];
    store8(tmp, x);
    return load8(tmp);
  }
}

inline float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

typedef int32_t v8i __attribute__((vector_size(32)));

// e^x: Cody-Waite range reduction to r in [-ln2/2, ln2/2], a degree-5 polynomial for e^r
// (Cephes' coefficients), times 2^n. Inputs are clamped to [-87.3, 88.3].
inline v8f exp8(v8f x) {
  const v8f lo = v8f{} - 87.3f, hi = v8f{} + 88.3f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  v8f y0 = x * 1.44269504088896341f;
  v8i n = __builtin_convertvector(y0 + (y0 >= 0 ? 0.5f : -0.5f), v8i);  // round(x / ln2)
  v8f nf = __builtin_convertvector(n, v8f);
  v8f r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  v8f p = v8f{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  v8f y = p * r * r + r + 1.f;
  v8i bits = (n + 127) << 23;
  v8f scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// In place: row <- exp(row - max(row)); returns the sum.
inline float softmax_numerator(float* row, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, row[i]);
  v8f sum8 = {};
  int64_t i = 0;
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
  return sum;
}

}  // namespace runtime_cpu
