// What the CPU kernels (s00 cpu_ops.cpp, s08 decode_kernel.cpp and extend_kernel.cpp) share: arithmetic on 16 floats at a
// time in the compiler's portable vector type, which GCC and clang lower to whatever the CPU has
// (one AVX-512 register, two AVX2 ones, four NEON ones), loads of 16 float32 or bfloat16 values as
// 16 floats, an exp of 16 floats, and the split of a call's work over torch's threads.

#pragma once

#include <ATen/Parallel.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace cpu_kernel {

constexpr int64_t LANES = 16;
typedef float vec16 __attribute__((vector_size(LANES * sizeof(float))));
typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vec4 __attribute__((vector_size(4 * sizeof(float))));
typedef int32_t ivec16 __attribute__((vector_size(LANES * sizeof(int32_t))));

inline vec16 load16(const float* p) {
  vec16 r;
  __builtin_memcpy(&r, p, sizeof r);  // unaligned load
  return r;
}
inline void store16(float* p, vec16 x) { __builtin_memcpy(p, &x, sizeof x); }

typedef uint16_t u16vec16 __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t u32vec16 __attribute__((vector_size(LANES * sizeof(uint32_t))));

// A bfloat16 is the upper half of a float32's bits, so widening one is exact: its 16 bits shifted
// into place. A KV pool in bfloat16 is half the bytes to stream, and the arithmetic stays in float32.
inline vec16 load16(const c10::BFloat16* p) {
  vec16 r;
#ifdef __AVX512F__
  // GCC 12 lowers the portable zero-extension below to two 8-lane halves joined again (five
  // instructions where AVX-512 has one): SiLU in bfloat16 took 1.15x as long
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16);
#else
  u16vec16 half;
  __builtin_memcpy(&half, p, sizeof half);
  const u32vec16 bits = __builtin_convertvector(half, u32vec16) << 16;
#endif
  __builtin_memcpy(&r, &bits, sizeof r);
  return r;
}

// 16 floats rounded to bfloat16 as PyTorch rounds (to nearest, ties to even): add just under half
// of the dropped part's last unit (one more when the kept part is odd) and clear the dropped half.
// A NaN stays a NaN (the addition could carry it into infinity). The bits stay float32's: the
// bfloat16 is their upper half, and as a float they are the rounded value itself.
inline u32vec16 rounded_bits(vec16 x) {
  u32vec16 bits;
  __builtin_memcpy(&bits, &x, sizeof bits);
  const u32vec16 rounded = (bits + (0x7FFFu + ((bits >> 16) & 1u))) & 0xFFFF0000u;
  return x != x ? u32vec16{} + 0x7FC00000u : rounded;
}
inline void store16(c10::BFloat16* p, vec16 x) {
  const u16vec16 half = __builtin_convertvector(rounded_bits(x) >> 16, u16vec16);
  __builtin_memcpy(p, &half, sizeof half);
}

// x as a tensor of T holds it: unchanged for float, rounded to bfloat16 for c10::BFloat16. A loop
// that stands for several PyTorch operators on T rounds where each of them would store its result.
template <typename T>
inline vec16 as_stored(vec16 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    const u32vec16 bits = rounded_bits(x);
    vec16 r;
    __builtin_memcpy(&r, &bits, sizeof r);
    return r;
  }
}
template <typename T>
inline float as_stored(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// f(T{}) with T the C++ type of `type` (float or c10::BFloat16): one loop written once for both.
template <typename F>
auto for_dtype(c10::ScalarType type, const F& f) {
  return type == c10::kBFloat16 ? f(c10::BFloat16{}) : f(float{});
}

// a * b + c, rounded once where the CPU has a fused multiply-add (a build may forbid the compiler to
// fuse on its own, as cpu_ops' does for RoPE's sake; here the rounding is this function's own)
inline vec16 fma16(vec16 a, vec16 b, vec16 c) {
#ifdef __AVX512F__
  return _mm512_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

inline float hsum(vec16 x) {  // the sum of the 16 lanes, halving: 16 -> 8 -> 4 -> 1
  vec8 lo, hi;
  __builtin_memcpy(&lo, &x, sizeof lo);
  __builtin_memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof lo, sizeof hi);
  const vec8 s8 = lo + hi;
  vec4 a, b;
  __builtin_memcpy(&a, &s8, sizeof a);
  __builtin_memcpy(&b, reinterpret_cast<const char*>(&s8) + sizeof a, sizeof b);
  const vec4 s4 = a + b;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// exp of 16 floats: x = k ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor series to r^7 (error
// within float32's rounding; Horner's rule, one fused multiply-add a term), times 2^k written
// straight into the exponent bits. Inputs here are score - max <= 0; below -87 the weight is under
// 1e-38 of the row's largest and comes out ~0.
inline vec16 exp16(vec16 x) {
  const vec16 lowest = vec16{} - 87.f;
  x = x < lowest ? lowest : x;
  const vec16 scaled = x * 1.44269504088896341f + 0.5f;  // x / ln2, rounded below by the floor
  ivec16 k = __builtin_convertvector(scaled, ivec16);      // truncates toward zero...
  k = k + (__builtin_convertvector(k, vec16) > scaled);    // ...so step down where that rounded up (true is -1)
  const vec16 kf = __builtin_convertvector(k, vec16);
  // r = x - k ln2, with ln2 in two parts (the first short enough that k times it is exact): r stays exact
  const vec16 r = fma16(kf, vec16{} + 2.12194440e-4f, fma16(kf, vec16{} - 0.693359375f, x));
  vec16 p = vec16{} + 1.f / 5040;
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = fma16(p, r, vec16{} + c);
  ivec16 bits;
  __builtin_memcpy(&bits, &p, sizeof bits);
  bits = bits + (k << 23);
  __builtin_memcpy(&p, &bits, sizeof p);
  return p;
}

// Runs body(first, last) on each of torch's threads over one contiguous range of work items, the
// ranges cut at equal shares of the total cost (cost[w]: what items 0 .. w-1 cost together, so
// cost[0] = 0 and cost has one entry more than there are items). An even split by count (OpenMP's
// static schedule) would leave one thread alone with the long rows.
template <typename Body>
void parallel_by_cost(const std::vector<int64_t>& cost, const Body& body) {
  const int64_t items = static_cast<int64_t>(cost.size()) - 1;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  std::vector<int64_t> cuts(threads + 1, items);
  cuts[0] = 0;
  for (int64_t w = 0, t = 1; w < items && t < threads; ++w)
    while (t < threads && cost[w + 1] * threads >= cost.back() * t) cuts[t++] = w + 1;
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) { body(cuts[first], cuts[last]); });
}

}  // namespace cpu_kernel
