// Decode attention over the CPU engine's paged KV pool, read in place through each request's slot table.
//
// The torch path (model.py _attend) gathers every request's keys and values out of the pool with index_select,
// then runs scaled_dot_product_attention on the copies: at 16 requests of about 100 tokens that is two copies of
// the cache read and written once more per layer, plus a dozen small operations, about a sixth of a decode step
// (benchmarks/README.md, issue 41). Here a request's keys and values are read once, straight from their pool
// slots, by all the query heads that share them (grouped-query attention), in float32 throughout.
//
// Semantics are those of the torch path for a decode row: one query per request at position n - 1 attends to
// the request's first n slots, or to its last `window` of them (TensorRT-LLM's max_attention_window, HF's
// sliding_window: the query's own key included). Softmax takes the row maximum first, as SDPA does. The float
// sums run in another order and e^x is Cephes' polynomial (exp8), so results agree with SDPA's to float32
// rounding, not bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

// Multiply-adds below which one thread finishes before a sleeping second one would wake (measured with
// benchmarks/cpu_engine.py's decode steps, OMP_WAIT_POLICY=PASSIVE).
constexpr int64_t kParallelWork = 1 << 18;

// Eight floats as one GCC vector: the compiler lowers it to the widest unit -march=native offers, and the
// sums below keep eight (or sixteen) independent lanes, which a plain loop may not reorder into.
typedef float f8 __attribute__((vector_size(32)));

inline f8 load8(const float* p) {
  f8 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline float dot(const float* a, const float* b, int64_t n) {
  f8 x = {0}, y = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    x += load8(a + i) * load8(b + i);
    y += load8(a + i + 8) * load8(b + i + 8);
  }
  for (; i + 8 <= n; i += 8) x += load8(a + i) * load8(b + i);
  x += y;
  float s = ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The lane sums of eight vectors as one vector, [sum(a[0]), ..., sum(a[7])]: three rounds of pairwise adds and
// shuffles, where eight separate horizontal sums would cost a chain of scalar adds each.
inline f8 sums8(const f8* a) {
  f8 b[4], c[2];
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)  // [a0 a0 a2 a2 a1 a1 a3 a3] and [a4 a4 a6 a6 a5 a5 a7 a7], two partial sums each
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  const f8 d = __builtin_shufflevector(c[0], c[1], 0, 2, 8, 10, 4, 6, 12, 14) +
               __builtin_shufflevector(c[0], c[1], 1, 3, 9, 11, 5, 7, 13, 15);  // [a0 a2 a4 a6 a1 a3 a5 a7]
  return __builtin_shufflevector(d, d, 0, 4, 1, 5, 2, 6, 3, 7);
}

typedef int32_t i8 __attribute__((vector_size(32)));

// e^x for eight floats x <= 0 (softmax's shifted scores): Cephes' expf, 2^n e^r with n = round(x / ln 2) and a
// degree-7 polynomial for e^r, within about an ulp of std::exp; 0 below e^-87.3, the smallest normal float.
inline f8 exp8(f8 x) {
  const f8 floor_x = f8{} - 87.33654f;
  const i8 under = x < floor_x;
  x = under ? floor_x : x;
  const f8 n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest (1.5 x 2^23)
  f8 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  f8 p = f8{} + 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.f;
  const i8 bits = (__builtin_convertvector(n, i8) + 127) << 23;
  f8 scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return under ? f8{} : p * scale;
}

// The step's new keys and values, k_new/v_new [n, kv_heads, head_size] (views of the QKV output), into their pool
// slots `write` [n]: what index_copy_ does, without its two calls per layer.
void write_rows(const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& write, const at::Tensor& k_pool,
                const at::Tensor& v_pool) {
  const int64_t kv_heads = k_pool.size(1), head_size = k_pool.size(2), pool_slots = k_pool.size(0);
  TORCH_CHECK(write.dim() == 1 && write.scalar_type() == at::kLong && write.is_contiguous(),
              "paged_decode_attention: write must be contiguous int64 [n]");
  const int64_t n = write.size(0);
  const at::Tensor* news[2] = {&k_new, &v_new};
  const at::Tensor* pools[2] = {&k_pool, &v_pool};
  for (int i = 0; i < 2; ++i) {
    const at::Tensor& x = *news[i];
    TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.size(0) == n && x.size(1) == kv_heads &&
                    x.size(2) == head_size && x.stride(2) == 1,
                "paged_decode_attention: new keys and values must be float32 [n, kv_heads, head_size] like the pool");
  }
  const int64_t* slot = write.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(slot[r] >= 0 && slot[r] < pool_slots, "paged_decode_attention: write slot ", slot[r],
                " is outside the pool of ", pool_slots);
  for (int i = 0; i < 2; ++i) {
    const at::Tensor& x = *news[i];
    const float* src = x.data_ptr<float>();
    float* dst = pools[i]->data_ptr<float>();
    for (int64_t r = 0; r < n; ++r)
      for (int64_t h = 0; h < kv_heads; ++h)
        std::copy_n(src + r * x.stride(0) + h * x.stride(1), head_size,
                    dst + (slot[r] * kv_heads + h) * head_size);
  }
}

// q [B, heads, head_size] (rows and heads may be strided, a view of the fused QKV output), pools [slots, kv_heads,
// head_size] contiguous, slots [B, S] int64, lengths [B] int64 (each request's keys, this token's included),
// window 0 for none. With `write`, first stores k_new/v_new there (write_rows). Returns [B, heads * head_size].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& slots, const at::Tensor& lengths, double scale, int64_t window,
                                  const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
                                  const std::optional<at::Tensor>& write) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1,
              "paged_decode_attention: q must be float32 [B, heads, head_size] with unit stride in head_size");
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.scalar_type() == at::kFloat && k_pool.is_contiguous() &&
                  v_pool.sizes() == k_pool.sizes() && v_pool.scalar_type() == at::kFloat && v_pool.is_contiguous(),
              "paged_decode_attention: the pools must be contiguous float32 [slots, kv_heads, head_size], alike");
  TORCH_CHECK(k_pool.size(2) == q.size(2) && k_pool.size(1) > 0 && q.size(1) % k_pool.size(1) == 0,
              "paged_decode_attention: heads must be a multiple of the pool's kv_heads, with the same head_size");
  TORCH_CHECK(slots.dim() == 2 && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.size(0) == q.size(0),
              "paged_decode_attention: slots must be contiguous int64 [B, S]");
  TORCH_CHECK(lengths.dim() == 1 && lengths.scalar_type() == at::kLong && lengths.is_contiguous() &&
                  lengths.size(0) == q.size(0),
              "paged_decode_attention: lengths must be contiguous int64 [B]");
  const int64_t batch = q.size(0), heads = q.size(1), head_size = q.size(2);
  const int64_t kv_heads = k_pool.size(1), group = heads / kv_heads, width = slots.size(1);
  const int64_t pool_slots = k_pool.size(0), row = kv_heads * head_size;
  const int64_t* lens = lengths.data_ptr<int64_t>();
  const int64_t* table = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= width, "paged_decode_attention: request ", b, " has ", lens[b],
                " keys; its slot table holds ", width);
    for (int64_t t = 0; t < lens[b]; ++t)
      TORCH_CHECK(table[b * width + t] >= 0 && table[b * width + t] < pool_slots,
                  "paged_decode_attention: slot ", table[b * width + t], " is outside the pool of ", pool_slots);
  }
  TORCH_CHECK(!write.has_value() || (k_new.has_value() && v_new.has_value()),
              "paged_decode_attention: write needs k_new and v_new");
  if (write.has_value()) write_rows(*k_new, *v_new, *write, k_pool, v_pool);
  auto out = at::empty({batch, heads * head_size}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const float* qp = q.data_ptr<float>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  // A work item is one request's keys for a range of its KV heads. The items walk the pool a key row at a time
  // (all the range's heads side by side, slots of a block adjacent): the hardware prefetcher follows that, where
  // a head at a time strides a row apart and waits on memory for every key. One request splits into as many
  // head ranges as there are threads when the batch alone cannot occupy them.
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::min<int64_t>(kv_heads, std::max<int64_t>(1, threads / std::max<int64_t>(batch, 1)));
  const int64_t span = (kv_heads + splits - 1) / splits;
  int64_t work = 0;
  for (int64_t b = 0; b < batch; ++b) work += lens[b];
  work *= heads * head_size;
  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, inv;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / splits, h0 = (item % splits) * span, h1 = std::min(kv_heads, h0 + span);
      if (h0 >= h1) continue;
      const int64_t n = lens[b], first = window > 0 ? std::max<int64_t>(0, n - window) : 0, keys = n - first;
      const int64_t* own = table + b * width + first;
      const int64_t qh0 = h0 * group, qh1 = h1 * group, nh = qh1 - qh0;
      const int64_t padded = (keys + 7) / 8 * 8;  // each head's scores in whole vectors, the tail at -inf
      scores.resize(nh * padded);
      acc.assign(nh * head_size, 0.f);
      inv.resize(nh);
      const float* qb = qp + b * q_row;
      if (head_size % 8 == 0) {
        // Eight keys at a time: their rows stay in L1 while every query head of the range scores them.
        for (int64_t t0 = 0; t0 < keys; t0 += 8) {
          const float* k[8];
          for (int64_t j = 0; j < 8; ++j) k[j] = kp + own[std::min(t0 + j, keys - 1)] * row;
          for (int64_t qh = qh0; qh < qh1; ++qh) {
            const float* qv = qb + qh * q_head;
            const int64_t at = (qh / group) * head_size;
            f8 a[8] = {};
            for (int64_t d = 0; d < head_size; d += 8) {
              const f8 x = load8(qv + d);
              for (int j = 0; j < 8; ++j) a[j] += x * load8(k[j] + at + d);
            }
            const f8 s8 = sums8(a) * fscale;
            __builtin_memcpy(scores.data() + (qh - qh0) * padded + t0, &s8, sizeof s8);
          }
        }
      } else {
        for (int64_t t = 0; t < keys; ++t) {
          const float* k = kp + own[t] * row;
          for (int64_t qh = qh0; qh < qh1; ++qh)
            scores[(qh - qh0) * padded + t] = dot(qb + qh * q_head, k + (qh / group) * head_size, head_size) * fscale;
        }
      }
      for (int64_t i = 0; i < nh; ++i) {
        float* s = scores.data() + i * padded;
        std::fill(s + keys, s + padded, -std::numeric_limits<float>::infinity());
        f8 top = f8{} - std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < padded; t += 8) {
          const f8 x = load8(s + t);
          top = x > top ? x : top;
        }
        const float m = std::max(std::max(std::max(top[0], top[1]), std::max(top[2], top[3])),
                                 std::max(std::max(top[4], top[5]), std::max(top[6], top[7])));
        f8 sum = {};
        for (int64_t t = 0; t < padded; t += 8) {
          const f8 e = exp8(load8(s + t) - m);
          __builtin_memcpy(s + t, &e, sizeof e);
          sum += e;
        }
        inv[i] = 1.f / (((sum[0] + sum[4]) + (sum[1] + sum[5])) + ((sum[2] + sum[6]) + (sum[3] + sum[7])));
      }
      for (int64_t t = 0; t < keys; ++t) {
        const float* v = vp + own[t] * row;
        if (t + 1 < keys) __builtin_prefetch(vp + own[t + 1] * row + h0 * head_size);
        for (int64_t qh = qh0; qh < qh1; ++qh) {
          const float p = scores[(qh - qh0) * padded + t];
          const float* vh = v + (qh / group) * head_size;
          float* a = acc.data() + (qh - qh0) * head_size;
          for (int64_t i = 0; i < head_size; ++i) a[i] += p * vh[i];
        }
      }
      for (int64_t qh = qh0; qh < qh1; ++qh) {
        float* o = op + b * heads * head_size + qh * head_size;
        const float* a = acc.data() + (qh - qh0) * head_size;
        for (int64_t i = 0; i < head_size; ++i) o[i] = a[i] * inv[qh - qh0];
      }
    }
  };
  // Waking the pool's threads costs tens of microseconds where they sleep between regions (OMP_WAIT_POLICY
  // PASSIVE, the serving default here): a small step's attention runs on the calling thread.
  if (work < kParallelWork || threads < 2)
    run(0, batch * splits);
  else
    at::parallel_for(0, batch * splits, 1, run);
  return out;
}

}  // namespace

TORCH_LIBRARY(toolchain_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor lengths, float scale, "
        "int window, Tensor? k_new=None, Tensor? v_new=None, Tensor? write=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(toolchain_cpu, CPU, m) { m.impl("paged_decode_attention", paged_decode_attention); }
