// The element-wise steps of a decoder layer on a CPU, each one loop over its rows instead of a chain
// of PyTorch operators that each read their input from memory and write a new tensor:
//
//   rms_norm(x, w, eps)       out = w * (x / sqrt(mean(x^2) + eps))      one pass to sum, one to write
//   silu_and_mul(gate, up)    out = gate * sigmoid(gate) * up             (SwiGLU's activation)
//   rotary(x, cos, sin)       each (i, i + D/2) pair of a head rotated    (RoPE, for q or k)
//
// The inputs may be views with rows apart in memory (the q/k/v and gate/up products' outputs are
// split into views); the outputs are new contiguous tensors. Built without floating-point
// contraction (-ffp-contract=off, s00 cpu_ops.py), so RoPE's products and sums round exactly as
// PyTorch's do; the norm's sum and SiLU's exp differ from PyTorch's by float rounding only.
//
// Each takes float32 or bfloat16 tensors (one dtype per call) and computes in float32. In bfloat16
// a loop rounds wherever the chain of PyTorch operators it stands for would store a bfloat16 result
// (as_stored), so it gives the bits that chain gives, to the same exceptions as in float32.
//
// Registered as torch.ops.engine_cpu_ops.* (s00_foundation/cpu_ops.py builds and loads them).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_kernel.h"

namespace {

using namespace cpu_kernel;

constexpr int64_t GRAIN = 32768;  // values per thread at least: below that, a thread costs more than it saves

void check(const at::Tensor& t, int64_t dims, const char* what) {
  TORCH_CHECK(t.dim() == dims && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
                  t.device().is_cpu() && t.stride(-1) == 1,
              what);
}

void same_dtype(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), what, ": ", a.scalar_type(), " and ", b.scalar_type(), " differ");
}

// x [rows, N] (rows any distance apart), w [N] -> [rows, N]. PyTorch's chain (s00 model.py's
// RMSNorm): normalised in float32, stored as T, times the weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check(x, 2, "rms_norm: x must be a float32 or bfloat16 CPU [rows, N] with contiguous rows");
  check(w, 1, "rms_norm: weight must be a float32 or bfloat16 CPU [N]");
  same_dtype(x, w, "rms_norm: x and weight");
  const int64_t rows = x.size(0), N = x.size(1), ld = x.stride(0);
  TORCH_CHECK(w.size(0) == N, "rms_norm: weight has ", w.size(0), " entries for rows of ", N);
  const float e = static_cast<float>(eps);
  return for_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    at::Tensor out = at::empty({rows, N}, x.options());
    const T *xp = x.data_ptr<T>(), *wp = w.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, std::max<int64_t>(1, GRAIN / std::max<int64_t>(N, 1)), [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        const T* in = xp + r * ld;
        T* o = op + r * N;
        vec16 squares = vec16{};
        int64_t d = 0;
        for (; d + LANES <= N; d += LANES) squares += load16(in + d) * load16(in + d);
        float sum = hsum(squares);
        for (; d < N; ++d) sum += static_cast<float>(in[d]) * static_cast<float>(in[d]);
        const float inv = 1.f / std::sqrt(sum / static_cast<float>(N) + e);
        for (d = 0; d + LANES <= N; d += LANES) store16(o + d, load16(wp + d) * as_stored<T>(load16(in + d) * inv));
        for (; d < N; ++d) o[d] = static_cast<T>(static_cast<float>(wp[d]) * as_stored<T>(static_cast<float>(in[d]) * inv));
      }
    });
    return out;
  });
}

// gate, up [rows, N] (rows any distance apart) -> silu(gate) * up [rows, N]: F.silu stored as T, then the product.
at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  check(gate, 2, "silu_and_mul: gate must be a float32 or bfloat16 CPU [rows, N] with contiguous rows");
  check(up, 2, "silu_and_mul: up must be a float32 or bfloat16 CPU [rows, N] with contiguous rows");
  same_dtype(gate, up, "silu_and_mul: gate and up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "silu_and_mul: gate ", gate.sizes(), " and up ", up.sizes(), " differ");
  const int64_t rows = gate.size(0), N = gate.size(1), lg = gate.stride(0), lu = up.stride(0);
  return for_dtype(gate.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    at::Tensor out = at::empty({rows, N}, gate.options());
    const T *gp = gate.data_ptr<T>(), *up_ = up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, std::max<int64_t>(1, GRAIN / std::max<int64_t>(N, 1)), [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) {
        const T *g = gp + r * lg, *u = up_ + r * lu;
        T* o = op + r * N;
        int64_t d = 0;
        for (; d + LANES <= N; d += LANES) {
          // sigmoid(x) from e = exp(-|x|) <= 1, which never overflows: 1 / (1 + e) for x >= 0,
          // e / (1 + e) below (as e times the first: one division for both, the slowest operation here)
          const vec16 x = load16(g + d), negative_abs = x < 0 ? x : vec16{} - x;
          const vec16 e = exp16(negative_abs), r = 1.f / (1.f + e);
          const vec16 sigmoid = x < 0 ? e * r : r;
          store16(o + d, as_stored<T>(x * sigmoid) * load16(u + d));
        }
        for (; d < N; ++d) {
          const float x = static_cast<float>(g[d]);
          o[d] = static_cast<T>(as_stored<T>(x / (1.f + std::exp(-x))) * static_cast<float>(u[d]));
        }
      }
    });
    return out;
  });
}

// x [T, heads, D] (tokens and heads any distance apart), cos, sin [T, D] -> [T, heads, D]:
// out[i] = x[i] cos[i] - x[i + D/2] sin[i], out[i + D/2] = x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2]
// (each product stored as the dtype before the sum, as PyTorch's x * cos + rotated * sin does)
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check(x, 3, "rotary: x must be a float32 or bfloat16 CPU [T, heads, D] with contiguous heads");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == x.scalar_type() && t->is_contiguous() && t->size(0) == x.size(0) &&
                    t->size(1) == x.size(2),
                "rotary: cos and sin must be contiguous [T, D] of x's dtype for x ", x.sizes(), " (", x.scalar_type(), ")");
  const int64_t T_ = x.size(0), H = x.size(1), D = x.size(2), half = D / 2, st = x.stride(0), sh = x.stride(1);
  TORCH_CHECK(D % 2 == 0, "rotary: the head size must be even, got ", D);
  return for_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    at::Tensor out = at::empty({T_, H, D}, x.options());
    const T *xp = x.data_ptr<T>(), *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, T_, std::max<int64_t>(1, GRAIN / std::max<int64_t>(H * D, 1)), [&](int64_t first, int64_t last) {
      for (int64_t t = first; t < last; ++t) {
        const T *c = cp + t * D, *s = sp + t * D;
        for (int64_t h = 0; h < H; ++h) {
          const T* in = xp + t * st + h * sh;
          T* o = op + (t * H + h) * D;
          int64_t d = 0;
          for (; d + LANES <= half; d += LANES) {
            const vec16 x1 = load16(in + d), x2 = load16(in + half + d);
            store16(o + d, as_stored<T>(x1 * load16(c + d)) + as_stored<T>((-x2) * load16(s + d)));
            store16(o + half + d, as_stored<T>(x2 * load16(c + half + d)) + as_stored<T>(x1 * load16(s + half + d)));
          }
          for (; d < half; ++d) {
            const float x1 = static_cast<float>(in[d]), x2 = static_cast<float>(in[half + d]);
            o[d] = static_cast<T>(as_stored<T>(x1 * static_cast<float>(c[d])) +
                                  as_stored<T>((-x2) * static_cast<float>(s[d])));
            o[half + d] = static_cast<T>(as_stored<T>(x2 * static_cast<float>(c[half + d])) +
                                         as_stored<T>(x1 * static_cast<float>(s[half + d])));
          }
        }
      }
    });
    return out;
  });
}

}  // namespace

TORCH_LIBRARY(engine_cpu_ops, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(engine_cpu_ops, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
}
