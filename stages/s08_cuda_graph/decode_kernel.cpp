// Decode attention on a CPU, fused: one new query token per request against the paged KV pool,
// reading each key and value the request's table points at exactly once, with no copy of them.
//
//   for each (request i, KV head g), spread over torch's threads by total length:
//     scores[h][j] = scale * q[i, h] . K[slot_j, g]     for the G query heads h of KV head g
//     p[h]         = softmax(scores[h])                  (the row's own length: no padding, no mask)
//     out[i, h]    = sum_j p[h][j] * V[slot_j, g]
//
// The G query heads that share KV head g (grouped-query attention) are scored together (in groups
// of up to 4, their queries held in registers), so a key is read from memory once for all of them,
// not once per query head. A decode is bound by how fast the pool streams from memory, so the
// loops are written for that: the next keys are prefetched while the current ones are scored, and
// the arithmetic runs 16 floats at a time in the compiler's portable vector type (AVX-512, 2 x
// AVX2, 4 x NEON: whatever the CPU has). And it is kept to a few operations a key, or a bfloat16
// pool (half the bytes) would wait on it instead: sixteen keys' dot products are summed together
// (fold_keys), and a bfloat16 row is widened two operations per 32 values (load_row).
//
// The pool may hold float32 or bfloat16 (the loops are templates over the stored type T: a
// bfloat16 key is widened to float32 as it is loaded, which is exact), and the query and the output
// float32 or the pool's dtype (Q: a bfloat16 model's query is read as it is and its output rounded
// once, where converting both around the call cost two copies a layer); the arithmetic is float32.
// Registered as torch.ops.engine_cpu.decode_attention (s08_cuda_graph/decode_kernel.py
// builds and loads it).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_kernel.h"

namespace {

using namespace cpu_kernel;

constexpr int64_t PREFETCH_AHEAD = 8;   // keys ahead, into L1: this KV head's part of the key's row
// keys ahead, into L2: the whole row, for the other heads' passes (with each pass reading its own
// part from memory instead, a bfloat16 step took 1.3-1.5x as long; 32 or 64 rows ahead, no better)
constexpr int64_t PREFETCH_ROWS = 16;

template <typename Q, typename T>
inline float dot(const Q* a, const T* b, int64_t n) {
  vec16 acc = vec16{};
  int64_t d = 0;
  for (; d + LANES <= n; d += LANES) acc += load16(a + d) * load16(b + d);
  float s = hsum(acc);
  for (; d < n; ++d) s += static_cast<float>(a[d]) * static_cast<float>(b[d]);
  return s;
}

template <typename T>
inline void add_scaled(float* acc, float w, const T* x, int64_t n) {  // acc += w * x
  int64_t d = 0;
  for (; d + LANES <= n; d += LANES) store16(acc + d, load16(acc + d) + w * load16(x + d));
  for (; d < n; ++d) acc[d] += w * static_cast<float>(x[d]);
}

// fetch (below) calls this under its own `if (j + ahead < n)`: with the bounds checks moved in
// here, GCC 12 emitted no prefetch at all and a step took 1.4x as long.
template <typename T>
inline void prefetch(const T* p, int64_t n, bool to_l1) {  // one request per 64-byte cache line
  for (int64_t d = 0; d < n; d += 64 / sizeof(T)) {
    if (to_l1)
      __builtin_prefetch(p + d, 0, 3);
    else
      __builtin_prefetch(p + d, 0, 2);  // locality 2: into L2 and below, not L1
  }
}

// Softmax of a row of n scores in place; returns 1 / (sum of exp), applied to the output once.
float softmax_unnormalized(float* s, int64_t n) {
  vec16 maxes = vec16{} - INFINITY;  // 16 running maxima: one over all n would be a chain of n steps
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES) {
    const vec16 x = load16(s + j);
    maxes = x > maxes ? x : maxes;
  }
  float m = -INFINITY;
  for (int64_t l = 0; l < LANES; ++l) m = std::max(m, maxes[l]);
  for (; j < n; ++j) m = std::max(m, s[j]);
  vec16 sums = vec16{};
  j = 0;
  for (; j + LANES <= n; j += LANES) {
    const vec16 e = exp16(load16(s + j) - m);
    store16(s + j, e);
    sums += e;
  }
  float sum = hsum(sums);
  for (; j < n; ++j) sum += (s[j] = std::exp(s[j] - m));
  return 1.f / sum;
}

// Slot j's key (or value), offset to this KV head, once later ones are asked for (attend says which).
template <typename T>
__attribute__((always_inline)) inline const T* fetch(const T* base, const int64_t* slots, int64_t j, int64_t n,
                                                     int64_t row, int64_t D, bool first_pass) {
  if (first_pass && j + PREFETCH_ROWS < n) prefetch(base + slots[j + PREFETCH_ROWS] * row, row, false);
  if (j + PREFETCH_AHEAD < n) prefetch(base + slots[j + PREFETCH_AHEAD] * row, D, true);
  return base + slots[j] * row;
}

// A row of D = 16 * C values as C vectors of floats. A float32 row loads as it lies. A bfloat16 row
// is read 32 values at a time as 16 pairs: the even values shifted into place, the odd ones masked
// (two operations for 32 values, where widening them in order takes four), so its vectors hold the
// row in another order. load_query puts the query in that same order (a dot product does not mind
// the order), and store_row puts the output's sums back in place.
template <typename T, int64_t C>
__attribute__((always_inline)) inline void load_row(const T* p, vec16 (&x)[C]) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t c = 0; c < C; ++c) x[c] = load16(p + c * LANES);
  } else {
    static_assert(C % 2 == 0, "a bfloat16 row is read 32 values at a time");
    for (int64_t c = 0; c < C; c += 2) {
      u32vec16 pairs;
      __builtin_memcpy(&pairs, p + c * LANES, sizeof pairs);
      const u32vec16 even = pairs << 16, odd = pairs & 0xFFFF0000u;  // little-endian: value 2i is the low half
      __builtin_memcpy(&x[c], &even, sizeof even);
      __builtin_memcpy(&x[c + 1], &odd, sizeof odd);
    }
  }
}

template <typename T, int64_t C, typename Q>
__attribute__((always_inline)) inline void load_query(const Q* q, vec16 (&x)[C]) {
  for (int64_t c = 0; c < C; ++c) x[c] = load16(q + c * LANES);
  if constexpr (!std::is_same_v<T, float>)
    for (int64_t c = 0; c < C; c += 2) {
      const vec16 a = x[c], b = x[c + 1];
      x[c] = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      x[c + 1] = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    }
}

template <typename T, int64_t C, typename Q>
__attribute__((always_inline)) inline void store_row(Q* out, const vec16 (&x)[C], float w) {  // out = w * x
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t c = 0; c < C; ++c) store16(out + c * LANES, x[c] * w);
  } else {
    for (int64_t c = 0; c < C; c += 2) {
      const vec16 even = x[c] * w, odd = x[c + 1] * w;
      store16(out + c * LANES,
              __builtin_shufflevector(even, odd, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23));
      store16(out + (c + 1) * LANES,
              __builtin_shufflevector(even, odd, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31));
    }
  }
}

// A key's dot product with a query head ends as 16 partial sums, and adding up 16 lanes is a chain
// of shuffles: per key and head, as many operations as the products themselves. Sixteen keys'
// vectors are folded together instead, in pairs: halves, quarters, pairs of lanes, lanes (the
// order hsum adds in, so the sums are the same bits). Four folds leave one vector of the 16 keys'
// sums, lane i holding key bit_reversed(i): 15 shuffles and adds for 16 keys, not 16 hsums.
template <int Level>
__attribute__((always_inline)) inline vec16 fold(vec16 a, vec16 b) {
  if constexpr (Level == 1)
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  else if constexpr (Level == 2)
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  else if constexpr (Level == 3)
    return __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  else
    return __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// out[h]: the G heads' products with keys j .. j + 2^Level - 1, folded Level times (Level 0: one
// key's 16 partial sums). Depth first, so that few vectors are alive at once. Forced inline: called,
// the recursion kept its vectors in memory and a step took longer than with 16 hsums.
template <int Level, typename T, int64_t C, int64_t G>
__attribute__((always_inline)) inline void fold_keys(vec16 (&out)[G], const vec16 (&qv)[G][C], const T* k,
                                                     const int64_t* slots, int64_t j, int64_t n, int64_t row,
                                                     int64_t D, bool first_pass) {
  if constexpr (Level == 0) {
    vec16 kv[C];
    load_row(fetch(k, slots, j, n, row, D, first_pass), kv);
    for (int64_t h = 0; h < G; ++h) {
      out[h] = qv[h][0] * kv[0];
      for (int64_t c = 1; c < C; ++c) out[h] += qv[h][c] * kv[c];
    }
  } else {
    vec16 a[G], b[G];
    fold_keys<Level - 1>(a, qv, k, slots, j, n, row, D, first_pass);
    fold_keys<Level - 1>(b, qv, k, slots, j + (1 << (Level - 1)), n, row, D, first_pass);
    for (int64_t h = 0; h < G; ++h) out[h] = fold<Level>(a[h], b[h]);
  }
}

// A group of G query heads of one KV head of one request: q [G, D] and out [G, D] its query heads,
// slots its n table entries, k / v the pool buffers offset to this KV head (rows `row` values
// apart), scores [G * n] and sums [G * D] scratch. A token's row holds every KV head's D values
// side by side, and the passes over one request's KV heads run one after another on a thread: so
// the pass over head 0 (`first_pass`) also asks L2 for the whole row further ahead, and the later
// passes find their part there.
// G and C (D = 16 * C) are known to the compiler, so q's G x C vectors and the G x C output sums
// stay in registers while the keys and values stream past. With G read at run time every head's
// query and output went through memory for every key: 29% more time with the pool in cache, 5-7%
// more from memory. C = 0: any D, the same loops with a scalar tail, q and the sums in memory.
template <typename T, int64_t C, int64_t G, typename Q>
void attend(const Q* q, const T* k, const T* v, const int64_t* slots, int64_t n, int64_t row, int64_t D,
            float scale, float* scores, float* sums, Q* out, bool first_pass) {
  constexpr int64_t R = C > 0 ? C : 1;  // vectors per head held in registers (none used when C = 0)
  vec16 qv[G][R];
  if constexpr (C > 0)
    for (int64_t h = 0; h < G; ++h) load_query<T>(q + h * D, qv[h]);
  int64_t j = 0;
  if constexpr (C > 0)
    for (; j + LANES <= n; j += LANES) {
      vec16 dots[G];
      fold_keys<4>(dots, qv, k, slots, j, n, row, D, first_pass);
      // lane i holds key bit_reversed(i): put back in order (the reversal is its own inverse)
      for (int64_t h = 0; h < G; ++h)
        store16(scores + h * n + j, scale * __builtin_shufflevector(dots[h], dots[h], 0, 8, 4, 12, 2, 10, 6, 14, 1,
                                                                    9, 5, 13, 3, 11, 7, 15));
    }
  for (; j < n; ++j) {  // the last n % 16 keys one at a time (all of them when C = 0)
    if constexpr (C > 0) {
      vec16 dots[G];
      fold_keys<0>(dots, qv, k, slots, j, n, row, D, first_pass);
      for (int64_t h = 0; h < G; ++h) scores[h * n + j] = scale * hsum(dots[h]);
    } else {
      const T* key = fetch(k, slots, j, n, row, D, first_pass);
      for (int64_t h = 0; h < G; ++h) scores[h * n + j] = scale * dot(q + h * D, key, D);
    }
  }
  float inv[G];
  for (int64_t h = 0; h < G; ++h) inv[h] = softmax_unnormalized(scores + h * n, n);
  vec16 sum[G][R] = {};
  if constexpr (C == 0) std::fill(sums, sums + G * D, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const T* value = fetch(v, slots, j, n, row, D, first_pass);
    if constexpr (C > 0) {
      vec16 vv[C];
      load_row(value, vv);
      for (int64_t h = 0; h < G; ++h)
        for (int64_t c = 0; c < C; ++c) sum[h][c] += scores[h * n + j] * vv[c];
    } else {
      for (int64_t h = 0; h < G; ++h) add_scaled(sums + h * D, scores[h * n + j], value, D);
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    if constexpr (C > 0)
      store_row<T>(out + h * D, sum[h], inv[h]);
    else
      for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<Q>(sums[h * D + d] * inv[h]);
  }
}

template <typename T, typename Q>
using AttendFn = void (*)(const Q*, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, float, float*,
                          float*, Q*, bool);

// Heads per group: as many as keep a group's query (and, in the second pass, its sums) within
// half of AVX-512's 32 vector registers: 4 heads of 64 floats, 2 of 128. A KV head with more query
// heads (Llama 3 8B: 4 of 128) is taken in several groups; the later groups find its keys and
// values in L2.
inline int64_t heads_per_group(int64_t D) { return D == 128 ? 2 : 4; }

template <typename T, typename Q, int64_t C>
AttendFn<T, Q> attend_for_heads(int64_t heads) {  // heads in 1..4
  return heads == 1   ? attend<T, C, 1, Q>
         : heads == 2 ? attend<T, C, 2, Q>
         : heads == 3 ? attend<T, C, 3, Q>
                      : attend<T, C, 4, Q>;
}

// The loops for a group of `heads` query heads of size D: the common sizes unrolled (64, 128).
template <typename T, typename Q>
AttendFn<T, Q> attend_for(int64_t D, int64_t heads) {
  return D == 64    ? attend_for_heads<T, Q, 4>(heads)
         : D == 128 ? attend_for_heads<T, Q, 8>(heads)
                    : attend_for_heads<T, Q, 0>(heads);
}

// Every (request, KV head) over the threads; the arguments as decode_attention's, checked there.
template <typename T, typename Q>
void attend_all(const Q* qp, const T* kp, const T* vp, const int64_t* table, const int32_t* lens, Q* op, int64_t bs,
                int64_t H, int64_t KVH, int64_t D, int64_t L, float s) {
  const int64_t G = H / KVH, row = KVH * D;
  // Work item w = (request w / KVH, KV head w % KVH) costs about its request's length.
  std::vector<int64_t> cost(bs * KVH + 1, 0);
  for (int64_t w = 0; w < bs * KVH; ++w) cost[w + 1] = cost[w] + lens[w / KVH];
  // Each KV head's G query heads in groups of `per`, the last group maybe smaller.
  const int64_t per = std::min(G, heads_per_group(D));
  const AttendFn<T, Q> full = attend_for<T, Q>(D, per), last_group = attend_for<T, Q>(D, G % per ? G % per : per);
  parallel_by_cost(cost, [&](int64_t first, int64_t last) {
    std::vector<float> scores, sums(per * D);
    for (int64_t w = first; w < last; ++w) {
      const int64_t i = w / KVH, g = w % KVH, n = lens[i];
      scores.resize(per * n);
      for (int64_t h = 0; h < G; h += per) {
        const int64_t at = (i * H + g * G + h) * D;  // the group's first query head, in q and in out
        (h + per <= G ? full : last_group)(qp + at, kp + g * D, vp + g * D, table + i * L, n, row, D, s,
                                            scores.data(), sums.data(), op + at, g == 0 && h == 0);
      }
    }
  });
}

// q [bs, H, D]; k_buffer, v_buffer [num_slots, KVH, D]; kv_indices [bs, kv_len] (row i: request
// i's slots, the first seq_lens[i] of them used); seq_lens [bs] int32 -> [bs, H, D] of q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                            const at::Tensor& kv_indices, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_buffer.dim() == 3 && v_buffer.sizes() == k_buffer.sizes(),
              "decode_attention: q [bs, H, D], k_buffer and v_buffer [num_slots, KVH, D]");
  for (const at::Tensor* t : {&q, &k_buffer, &v_buffer})
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu(), "decode_attention: q, k_buffer, v_buffer must be contiguous CPU tensors");
  const bool bf16 = k_buffer.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || k_buffer.scalar_type() == at::kFloat) && v_buffer.scalar_type() == k_buffer.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == k_buffer.scalar_type()),
              "decode_attention: k_buffer and v_buffer must be both float32 or both bfloat16, and q float32 or "
              "their dtype; got q ", q.scalar_type(), ", k_buffer ", k_buffer.scalar_type(), ", v_buffer ",
              v_buffer.scalar_type());
  const int64_t bs = q.size(0), H = q.size(1), D = q.size(2), KVH = k_buffer.size(1), S = k_buffer.size(0);
  TORCH_CHECK(k_buffer.size(2) == D && H % KVH == 0, "decode_attention: head_dim differs, or H is not a multiple of KVH");
  TORCH_CHECK(kv_indices.dim() == 2 && kv_indices.size(0) == bs && kv_indices.scalar_type() == at::kLong &&
                  kv_indices.is_contiguous(),
              "decode_attention: kv_indices must be a contiguous int64 [bs, kv_len]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == bs && seq_lens.scalar_type() == at::kInt &&
                  seq_lens.is_contiguous(),
              "decode_attention: seq_lens must be a contiguous int32 [bs]");
  const int64_t L = kv_indices.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* table = kv_indices.data_ptr<int64_t>();
  for (int64_t i = 0; i < bs; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= L, "decode_attention: row ", i, " has seq_len ", lens[i],
                ", outside 1..", L, " (kv_indices' width)");
    for (int64_t j = 0; j < lens[i]; ++j)  // a slot outside the pool would read another process's memory
      TORCH_CHECK(table[i * L + j] >= 0 && table[i * L + j] < S, "decode_attention: row ", i, " names slot ",
                  table[i * L + j], ", outside the pool's ", S);
  }
  at::Tensor out = at::empty_like(q);
  const float s = static_cast<float>(scale);
  for_dtype(k_buffer.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T *kp = k_buffer.data_ptr<T>(), *vp = v_buffer.data_ptr<T>();
    if (q.scalar_type() == at::kFloat)
      attend_all(q.data_ptr<float>(), kp, vp, table, lens, out.data_ptr<float>(), bs, H, KVH, D, L, s);
    else
      attend_all(q.data_ptr<T>(), kp, vp, table, lens, out.data_ptr<T>(), bs, H, KVH, D, L, s);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(engine_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor kv_indices, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(engine_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
