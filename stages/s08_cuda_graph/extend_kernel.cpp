// Extend (prefill) attention on a CPU, fused: each request's new tokens against its whole context in
// the paged KV pool, read in place through the request -> slots table (no gathered copy of K/V),
// causal, the query heads of a KV head together, the softmax online (flash attention's order).
//
//   for each task (request i, a block of its new tokens, KV head g), threads sharing tasks by cost:
//     rows r = (token, query head of g) of the block; Q^T [D][rows], scaled by 1 / sqrt(D)
//     for each block of BK keys (slots req_to_token[i][j0 : j0 + BK]) up to the block's last token:
//       S^T[j][r] = K[slot_j, g] . Q^T[:, r]                16 rows a vector, a key's floats broadcast
//       keys after a row's position masked (only in the blocks that reach past the first token)
//       online softmax per row: m (running max), l (running sum), O^T scaled by exp(m_old - m)
//       O^T[d][r] += sum_j V[slot_j, g][d] * P^T[j][r]
//     out[token, head] = O^T[:, r] / l[r]
//
// Why the rows sit in the vector lanes: a key is D floats in a row of the pool, and taking them one
// at a time as broadcast scalars against 16 query rows needs no transposed copy of K (nor of V);
// only Q (once per task) and the output (at its end) change layout. Both products run in register
// tiles of 8 keys (or 8 output floats) x 3 vectors of rows, 24 sums held in registers.
//
// The pool, q and the output are float32 or all bfloat16 (the loops are templates over T). The
// arithmetic is float32 either way: a bfloat16 block's keys and values are widened once into float32
// rows (exact, and a few operations per value where each is then used for 16 to 48 rows), the query
// is widened as it is laid out, and each output rounded once.
//
// Registered as torch.ops.engine_cpu.extend_attention (s08_cuda_graph/decode_kernel.py builds and
// loads it with the decode kernel).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_kernel.h"

namespace {

using namespace cpu_kernel;

constexpr int64_t BK = 64;            // keys per block: its S^T (64 keys x the rows) stays in L1
constexpr int64_t KT = 8;             // keys per register tile of the scores
constexpr int64_t DT = 8;             // output floats per register tile of the values
constexpr int64_t TASK_ROWS = 96;     // about this many (token, head) rows per task
constexpr int64_t TV = 3;             // vectors of 16 rows per register tile (8 x 3 = 24 sums in registers)

// S^T[j][rows] for KT keys and V vectors of rows, the sums over d in registers. qt: Q^T at the
// first row, rp floats per d; keys: KT key rows (this KV head's D floats each).
template <int V>
inline void score_tile(const float* qt, int64_t rp, const float* const* keys, int64_t D, float* st) {
  vec16 acc[KT][V] = {};
  for (int64_t d = 0; d < D; ++d) {
    vec16 qv[V];
    for (int v = 0; v < V; ++v) qv[v] = load16(qt + d * rp + v * LANES);
    for (int64_t j = 0; j < KT; ++j) {
      const float kd = keys[j][d];
      for (int v = 0; v < V; ++v) acc[j][v] += qv[v] * kd;
    }
  }
  for (int64_t j = 0; j < KT; ++j)
    for (int v = 0; v < V; ++v) store16(st + j * rp + v * LANES, acc[j][v]);
}

// O^T[d0 : d0 + N][rows] = O^T * alpha + sum over the block's nk keys of V[j][d] * P^T[j][rows].
template <int V, int N>
inline void value_tile(const float* pt, int64_t rp, const float* const* values, int64_t nk, int64_t d0,
                       const vec16* alpha, float* ot) {
  vec16 acc[N][V];
  for (int64_t d = 0; d < N; ++d)
    for (int v = 0; v < V; ++v) acc[d][v] = load16(ot + d * rp + v * LANES) * alpha[v];
  for (int64_t j = 0; j < nk; ++j) {
    vec16 p[V];
    for (int v = 0; v < V; ++v) p[v] = load16(pt + j * rp + v * LANES);
    const float* value = values[j] + d0;
    for (int64_t d = 0; d < N; ++d)
      for (int v = 0; v < V; ++v) acc[d][v] += p[v] * value[d];
  }
  for (int64_t d = 0; d < N; ++d)
    for (int v = 0; v < V; ++v) store16(ot + d * rp + v * LANES, acc[d][v]);
}

struct Task {
  int64_t req, q0, nq, g;  // request, its first new token of the block, how many, KV head
};

// One thread's buffers, sized for the largest task.
struct Scratch {
  std::vector<float> qt, ot, st, zeros, inv;
  std::vector<float> kblock, vblock;  // a bfloat16 block's keys and values, widened (BK rows of D)
  std::vector<vec16> m, l, alpha;
  std::vector<int32_t> pos;  // each row's position (its token's)
  std::vector<const float*> keys, values;
};

// Everything one call shares across its tasks.
template <typename T>
struct Call {
  const T *q, *k, *v;
  T* out;
  const int64_t* table;      // req_to_token, width W
  const int64_t *rows, *prefix, *qstart;
  int64_t W, H, G, D, row;   // row: values per slot (KVH * D)
  float scale;
};

// This KV head's D values (a key or a value) of slot `slot` as float32: in place for a float32 pool,
// else widened into `block`'s row j.
template <typename T>
inline const float* pool_row(const T* buffer, int64_t slot, const Call<T>& c, int64_t g, std::vector<float>& block,
                            int64_t j) {
  const T* x = buffer + slot * c.row + g * c.D;
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    float* row = block.data() + j * c.D;
    int64_t d = 0;
    for (; d + LANES <= c.D; d += LANES) store16(row + d, load16(x + d));
    for (; d < c.D; ++d) row[d] = static_cast<float>(x[d]);
    return row;
  }
}

template <typename T>
void run_task(const Call<T>& c, const Task& t, Scratch& s) {
  const int64_t R = t.nq * c.G, nrv = (R + LANES - 1) / LANES, rp = nrv * LANES, D = c.D;
  const int64_t first = c.prefix[t.req] + t.q0;  // position of the block's first token
  const int64_t kend = first + t.nq;             // keys 0 .. kend - 1 are seen by some row
  const int64_t* slots = c.table + c.rows[t.req] * c.W;
  s.qt.assign(D * rp, 0.f);
  s.ot.assign(D * rp, 0.f);
  s.st.resize(BK * rp);
  s.pos.assign(rp, static_cast<int32_t>(kend - 1));  // padding rows see every key
  for (int64_t r = 0; r < R; ++r) {
    const int64_t token = c.qstart[t.req] + t.q0 + r / c.G, head = t.g * c.G + r % c.G;
    const T* qr = c.q + (token * c.H + head) * D;
    for (int64_t d = 0; d < D; ++d) s.qt[d * rp + r] = static_cast<float>(qr[d]) * c.scale;
    s.pos[r] = static_cast<int32_t>(first + r / c.G);
  }
  s.m.assign(nrv, vec16{} - INFINITY);
  s.l.assign(nrv, vec16{});
  s.alpha.resize(nrv);
  const vec16 minus_inf = vec16{} - INFINITY;
  for (int64_t j0 = 0; j0 < kend; j0 += BK) {
    const int64_t nk = std::min(BK, kend - j0), tiles = (nk + KT - 1) / KT;
    for (int64_t j = 0; j < tiles * KT; ++j) {  // keys past nk: a row of zeros, never used after
      s.keys[j] = j < nk ? pool_row(c.k, slots[j0 + j], c, t.g, s.kblock, j) : s.zeros.data();
      s.values[j] = j < nk ? pool_row(c.v, slots[j0 + j], c, t.g, s.vblock, j) : s.zeros.data();
    }
    for (int64_t jt = 0; jt < tiles; ++jt)
      for (int64_t v = 0; v < nrv; v += TV) {
        const float* qt = s.qt.data() + v * LANES;
        const float* const* keys = &s.keys[jt * KT];
        float* st = &s.st[jt * KT * rp + v * LANES];
        const int64_t left = nrv - v;
        left >= 3 ? score_tile<3>(qt, rp, keys, D, st) : left == 2 ? score_tile<2>(qt, rp, keys, D, st) : score_tile<1>(qt, rp, keys, D, st);
      }
    const bool masked = j0 + nk - 1 > first;  // some key here comes after some row's position
    for (int64_t v = 0; v < nrv; ++v) {
      float* col = &s.st[v * LANES];
      vec16 mx = s.m[v];
      ivec16 pos;
      __builtin_memcpy(&pos, &s.pos[v * LANES], sizeof pos);
      for (int64_t j = 0; j < nk; ++j) {
        vec16 x = load16(col + j * rp);
        if (masked) {
          x = (ivec16{} + static_cast<int32_t>(j0 + j)) > pos ? minus_inf : x;
          store16(col + j * rp, x);
        }
        mx = x > mx ? x : mx;
      }
      s.alpha[v] = exp16(s.m[v] - mx);  // the first block: exp(-inf) ~ 0, and O, l are still 0
      vec16 sum = vec16{};
      for (int64_t j = 0; j < nk; ++j) {
        const vec16 x = load16(col + j * rp);
        vec16 p = exp16(x - mx);
        if (masked) p = x == minus_inf ? vec16{} : p;  // exp16 clamps at e^-87, a masked key adds exactly 0
        store16(col + j * rp, p);
        sum += p;
      }
      s.l[v] = s.l[v] * s.alpha[v] + sum;
      s.m[v] = mx;
    }
    for (int64_t v = 0; v < nrv; v += TV) {
      const int64_t left = nrv - v;
      const float* pt = &s.st[v * LANES];
      const float* const* values = s.values.data();
      int64_t d = 0;
      for (; d + DT <= D; d += DT) {
        float* ot = &s.ot[d * rp + v * LANES];
        left >= 3   ? value_tile<3, DT>(pt, rp, values, nk, d, &s.alpha[v], ot)
        : left == 2 ? value_tile<2, DT>(pt, rp, values, nk, d, &s.alpha[v], ot)
                    : value_tile<1, DT>(pt, rp, values, nk, d, &s.alpha[v], ot);
      }
      for (; d < D; ++d) {
        float* ot = &s.ot[d * rp + v * LANES];
        left >= 3   ? value_tile<3, 1>(pt, rp, values, nk, d, &s.alpha[v], ot)
        : left == 2 ? value_tile<2, 1>(pt, rp, values, nk, d, &s.alpha[v], ot)
                    : value_tile<1, 1>(pt, rp, values, nk, d, &s.alpha[v], ot);
      }
    }
  }
  s.inv.resize(rp);
  for (int64_t v = 0; v < nrv; ++v) store16(&s.inv[v * LANES], 1.f / s.l[v]);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t token = c.qstart[t.req] + t.q0 + r / c.G, head = t.g * c.G + r % c.G;
    T* o = c.out + (token * c.H + head) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(s.ot[d * rp + r] * s.inv[r]);
  }
}

// q [T, H, D], the new tokens of every request one after another; k_buffer, v_buffer [num_slots,
// KVH, D] with the new tokens' K/V already written, of q's dtype; req_to_token [rows, W];
// req_pool_indices, prefix_lens, extend_lens [n] int64 -> [T, H, D] of q's dtype.
at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                            const at::Tensor& prefix_lens, const at::Tensor& extend_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_buffer.dim() == 3 && v_buffer.sizes() == k_buffer.sizes(),
              "extend_attention: q [T, H, D], k_buffer and v_buffer [num_slots, KVH, D]");
  for (const at::Tensor* t : {&q, &k_buffer, &v_buffer})
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu(),
                "extend_attention: q, k_buffer, v_buffer must be contiguous CPU tensors");
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  k_buffer.scalar_type() == q.scalar_type() && v_buffer.scalar_type() == q.scalar_type(),
              "extend_attention: q, k_buffer and v_buffer must be all float32 or all bfloat16; got ", q.scalar_type(),
              ", ", k_buffer.scalar_type(), ", ", v_buffer.scalar_type());
  for (const at::Tensor* t : {&req_to_token, &req_pool_indices, &prefix_lens, &extend_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(),
                "extend_attention: req_to_token, req_pool_indices, prefix_lens, extend_lens must be contiguous int64");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k_buffer.size(1), S = k_buffer.size(0);
  TORCH_CHECK(k_buffer.size(2) == D && H % KVH == 0, "extend_attention: head_dim differs, or H is not a multiple of KVH");
  const int64_t n = req_pool_indices.numel();
  TORCH_CHECK(req_to_token.dim() == 2 && prefix_lens.numel() == n && extend_lens.numel() == n,
              "extend_attention: req_to_token [rows, W]; req_pool_indices, prefix_lens, extend_lens [n] each");
  const int64_t W = req_to_token.size(1), G = H / KVH;
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  const int64_t* rows = req_pool_indices.data_ptr<int64_t>();
  const int64_t* prefix = prefix_lens.data_ptr<int64_t>();
  const int64_t* extend = extend_lens.data_ptr<int64_t>();
  std::vector<int64_t> qstart(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < req_to_token.size(0), "extend_attention: request ", i, " names table row ",
                rows[i], ", outside the table's ", req_to_token.size(0));
    TORCH_CHECK(extend[i] >= 1 && prefix[i] >= 0 && prefix[i] + extend[i] <= W, "extend_attention: request ", i,
                " has prefix_len ", prefix[i], " and extend_len ", extend[i], " (need extend_len >= 1, prefix_len >= 0,",
                " their sum <= ", W, ", the table's width)");
    for (int64_t j = 0; j < prefix[i] + extend[i]; ++j)  // a slot outside the pool would read another process's memory
      TORCH_CHECK(table[rows[i] * W + j] >= 0 && table[rows[i] * W + j] < S, "extend_attention: request ", i,
                  " names slot ", table[rows[i] * W + j], ", outside the pool's ", S);
    qstart[i + 1] = qstart[i] + extend[i];
  }
  TORCH_CHECK(qstart[n] == T, "extend_attention: the extend_lens add up to ", qstart[n], " tokens, q has ", T);

  // Tasks: (request, block of `per` new tokens, KV head); a task's cost is its rows x its keys.
  const int64_t per = std::max<int64_t>(1, TASK_ROWS / G);
  std::vector<Task> tasks;
  std::vector<int64_t> cost{0};
  for (int64_t i = 0; i < n; ++i)
    for (int64_t q0 = 0; q0 < extend[i]; q0 += per)
      for (int64_t g = 0; g < KVH; ++g) {
        const int64_t nq = std::min(per, extend[i] - q0);
        tasks.push_back({i, q0, nq, g});
        cost.push_back(cost.back() + nq * (prefix[i] + q0 + nq));
      }
  at::Tensor out = at::empty_like(q);
  for_dtype(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const Call<T> call{q.data_ptr<T>(), k_buffer.data_ptr<T>(), v_buffer.data_ptr<T>(), out.data_ptr<T>(),
                       table, rows, prefix, qstart.data(), W, H, G, D, KVH * D, static_cast<float>(scale)};
    parallel_by_cost(cost, [&](int64_t first, int64_t last) {  // later blocks of a prompt see more keys
      Scratch s;
      s.zeros.assign(D, 0.f);
      s.keys.resize(BK);
      s.values.resize(BK);
      if constexpr (!std::is_same_v<T, float>) {
        s.kblock.resize(BK * D);
        s.vblock.resize(BK * D);
      }
      for (int64_t w = first; w < last; ++w) run_task(call, tasks[w], s);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(engine_cpu, m) {
  m.def("extend_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, Tensor req_pool_indices, "
        "Tensor prefix_lens, Tensor extend_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(engine_cpu, CPU, m) { m.impl("extend_attention", &extend_attention); }
