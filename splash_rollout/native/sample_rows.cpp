// The sampler's plain rows (no top-k, top-p or min-p) in one native call: per row the largest
// logit, the sum of exponentials and a scan of the running mass up to the drawn point -- three
// passes over a row that stays in cache, where torch's log_softmax, exp and cumsum each write an
// [R, V] float temporary and read it back (4.8 ms of a 128-row step on one thread here, ~7 % of a
// decode step of the benchmark model; with a 150k vocabulary those temporaries are 77 MB a pass).
//
// Row r: logits x [V] (float or bfloat16, widened to float), temperature t (1 on greedy rows), a
// uniform u in [0, 1) (random_draws.py), greedy flag g.
//   z_i = x_i / t,  m = max_i z_i,  s = sum_i exp(z_i - m)
//   refused (token -1, logprob NaN): a NaN or +inf among z, or no finite z
//   greedy: token = the first i with z_i = m
//   sampled: token = the first i whose running mass sum_{j <= i} exp(z_j - m) exceeds u * s; where
//            rounding leaves the whole mass at or below u * s, the last i with exp(z_i - m) > 0
//   logprob = z_token - m - log(s)
// The distribution of sampler.py's torch path, its sums taken in another order (fast numerics
// only): a draw can land next to torch's token only where u falls within rounding (~1e-7) of a
// boundary of the running mass.
#include <cmath>
#include <cstdint>
#include <limits>

#include "simd.h"

namespace {

struct RowStats {
  float max;
  double sum;  // of exp(z - max)
  bool usable;
};

// Passes 1 and 2: the largest z, whether the row is usable, and the sum of exp(z - max).
template <typename T> RowStats row_stats(const T* x, int64_t vocab, float temperature) {
  const float inf = std::numeric_limits<float>::infinity();
  typedef int32_t i16v __attribute__((vector_size(64)));
  f16v vmax = f16v{} - inf;
  i16v bad_lanes = i16v{};
  int64_t i = 0;
  for (; i + 16 <= vocab; i += 16) {
    const f16v z = load16<T>(x + i) / temperature;
    bad_lanes |= (z != z) | (z == inf);  // NaN or +inf
    vmax = z > vmax ? z : vmax;
  }
  float m = -inf;
  bool bad = false;
  for (int l = 0; l < 16; ++l) {
    m = vmax[l] > m ? vmax[l] : m;
    bad |= bad_lanes[l] != 0;
  }
  for (; i < vocab; ++i) {
    const float z = widen(x[i]) / temperature;
    bad |= std::isnan(z) || z == inf;
    m = z > m ? z : m;
  }
  if (bad || m == -inf) return {m, 0.0, false};
  f16v acc = f16v{};
  i = 0;
  for (; i + 16 <= vocab; i += 16) acc += exp16(load16<T>(x + i) / temperature - m);
  double s = 0;
  for (int l = 0; l < 16; ++l) s += acc[l];
  for (; i < vocab; ++i) s += std::exp(widen(x[i]) / temperature - m);
  return {m, s, true};
}

// Pass 3 of a sampled row: the token whose running mass first exceeds target.
template <typename T> int64_t draw(const T* x, int64_t vocab, float temperature, float m, double target) {
  double mass = 0;
  int64_t last_positive = -1;
  int64_t i = 0;
  for (; i + 16 <= vocab; i += 16) {
    const f16v e = exp16(load16<T>(x + i) / temperature - m);
    double chunk = 0;
    for (int l = 0; l < 16; ++l) chunk += e[l];
    if (mass + chunk > target) {  // the draw lands in this chunk: walk it
      for (int l = 0; l < 16; ++l) {
        mass += e[l];
        if (e[l] > 0) last_positive = i + l;
        if (mass > target) return i + l;
      }
    }
    mass += chunk;
    for (int l = 15; l >= 0; --l) {
      if (e[l] > 0) {
        last_positive = i + l;
        break;
      }
    }
  }
  for (; i < vocab; ++i) {
    const float e = std::exp(widen(x[i]) / temperature - m);
    mass += e;
    if (e > 0) last_positive = i;
    if (mass > target) return i;
  }
  return last_positive;
}

template <typename T> int64_t argmax_first(const T* x, int64_t vocab, float temperature, float m) {
  for (int64_t i = 0; i < vocab; ++i)
    if (widen(x[i]) / temperature == m) return i;
  return 0;
}

template <typename T> void sample_rows(int64_t rows, int64_t vocab, const T* logits, int64_t row_stride,
                                       const float* temperature, const double* uniform, const uint8_t* greedy,
                                       int64_t* tokens, float* logprobs) {
#pragma omp parallel for schedule(static) if (rows * vocab >= (1 << 15))
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = logits + r * row_stride;
    const float t = temperature[r];
    const RowStats st = row_stats<T>(x, vocab, t);
    if (!st.usable) {
      tokens[r] = -1;
      logprobs[r] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const int64_t token = greedy[r] ? argmax_first<T>(x, vocab, t, st.max)
                                    : draw<T>(x, vocab, t, st.max, uniform[r] * st.sum);
    tokens[r] = token;
    logprobs[r] = (float)((double)(widen(x[token]) / t - st.max) - std::log(st.sum));
  }
}

}  // namespace

// dtype: 0 float32, 1 bfloat16 (build.DTYPES); logits [rows, vocab] with row stride row_stride
// (elements contiguous); temperature [rows] float32; uniform [rows] float64; greedy [rows] uint8;
// out: tokens [rows] int64, logprobs [rows] float32. Returns 0, or 1 for an unknown dtype.
extern "C" int splash_sample_rows(int dtype, int64_t rows, int64_t vocab, const void* logits, int64_t row_stride,
                                  const float* temperature, const double* uniform, const uint8_t* greedy,
                                  int64_t* tokens, float* logprobs) {
  if (dtype == 0) {
    sample_rows<float>(rows, vocab, (const float*)logits, row_stride, temperature, uniform, greedy, tokens, logprobs);
  } else if (dtype == 1) {
    sample_rows<bf16>(rows, vocab, (const bf16*)logits, row_stride, temperature, uniform, greedy, tokens, logprobs);
  } else {
    return 1;
  }
  return 0;
}
