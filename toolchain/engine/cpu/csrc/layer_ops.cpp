// The decoder layer's small float32 operations as one pass each, where torch runs several operations and
// temporaries for them (RMSNorm: eight ATen calls; the rotary embedding: five). At a decode step's few rows the
// arithmetic is microseconds and the calls were the cost: about 3 ms of a 124M-parameter model's step
// (benchmarks/cpu_engine.py, issue 41). No parallel region: waking a sleeping thread costs more than the work.
//
// Built with -ffp-contract=off, so every product and sum rounds as torch's separate operations do: `rotary` is
// bit for bit transformers' apply_rotary_pos_emb. `rms_norm` sums the squares in its own order, so it agrees
// with torch's to float32 rounding, not bit for bit.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

namespace {

typedef float f8 __attribute__((vector_size(32)));

inline f8 load8(const float* p) {
  f8 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension: transformers' LlamaRMSNorm, in its order.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                  weight.is_contiguous() && x.dim() >= 1 && x.size(-1) == weight.size(0),
              "rms_norm: float32 x [..., n] and weight [n]");
  const at::Tensor in = x.contiguous();
  auto out = at::empty_like(in);
  const int64_t n = in.size(-1), rows = n ? in.numel() / n : 0;
  const float* xp = in.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * n;
    f8 acc = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const f8 v = load8(xr + i);
      acc += v * v;
    }
    float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; ++i) sum += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + static_cast<float>(eps));
    float* o = op + r * n;
    for (int64_t j = 0; j < n; ++j) o[j] = wp[j] * (xr[j] * inv);
  }
  return out;
}

// x [rows, heads, head_size] (rows may be strided), cos/sin [rows, 1, head_size] or [rows, head_size]:
// x * cos + rotate_half(x) * sin, rotate_half pairing dimension i with i + head_size / 2 (the rope tables of
// rope.py). Returns a contiguous [rows, heads, head_size].
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary: float32 x [rows, heads, head_size] with unit stride in head_size");
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const at::Tensor c = cos.reshape({-1, d}).contiguous(), s = sin.reshape({-1, d}).contiguous();
  TORCH_CHECK(c.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat && c.size(0) == rows &&
                  s.size(0) == rows,
              "rotary: float32 cos and sin with one row of head_size per row of x");
  auto out = at::empty({rows, heads, d}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const float* xp = x.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xr = x.stride(0), xh = x.stride(1);
  for (int64_t r = 0; r < rows; ++r) {
    const float* cr = cp + r * d;
    const float* sr = sp + r * d;
    for (int64_t h = 0; h < heads; ++h) {
      const float* v = xp + r * xr + h * xh;
      float* o = op + (r * heads + h) * d;
      for (int64_t i = 0; i < half; ++i) o[i] = v[i] * cr[i] + (-v[i + half]) * sr[i];
      for (int64_t i = half; i < d; ++i) o[i] = v[i] * cr[i] + v[i - half] * sr[i];
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(toolchain_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(toolchain_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("rotary", rotary);
}
