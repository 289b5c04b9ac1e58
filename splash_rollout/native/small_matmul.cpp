// Matrix products with few activation rows (decode steps, routed experts, the tail of a batch).
//
// Why: with M <= ~16 rows a product y = x W is bound by reading W, and the BLAS torch calls reads
// it at ~5 GB/s on the development machine (it repacks or walks W in a blocked order built for
// large M) while a plain stream reaches ~30 GB/s. Here W is read once, in storage order, by the
// thread that owns a block of its output columns; x (M x K, a few KiB) stays in L1.
//
//   y[b, m, n] = sum_k x[b, m, k] * W[b, n, k]     (+ bias[n])
//
// for b < batch (a batch of weights: one per head), with W stored either "NK" (each output's
// weights contiguous, nn.Linear's [out, in]: a dot product per output, 4 outputs x 4 rows per
// register tile) or "KN" (each input's weights contiguous, [in, out]: rows of W scaled and added,
// 4 rows x 64 outputs per register tile). Elements are float32 or bfloat16 (x, W, y the same);
// products accumulate in float32 and round once to y's dtype (nearest even), as torch's CPU
// matmul does. Work items are (weight batch, block of outputs), spread over the OpenMP threads
// of the runtime torch already loaded.
#include "small_matmul.h"

namespace {

template <typename T>
int run(const Shape& s, const T* x, const T* w, const T* bias, T* y) {
  const bool nk = s.w_sk == 1;
  if (!nk && s.w_sn != 1) return 2;
  if constexpr (sizeof(T) == 2 && kHasBf16Pairs) {
    if (nk) {  // bfloat16 pairs straight into vdpbf16ps, x not widened
      const int64_t blocks = (s.n + NK_BLOCK - 1) / NK_BLOCK, items = s.batch * blocks;
#pragma omp parallel for schedule(static) if (items > 1)
      for (int64_t item = 0; item < items; ++item) {
        const int64_t b = item / blocks, n0 = (item % blocks) * NK_BLOCK;
        const int64_t outs = s.n - n0 < NK_BLOCK ? s.n - n0 : NK_BLOCK;
        nk_item_pairs<T>(x + b * s.x_sb, s.x_sm, s.m, w + b * s.w_sb + n0 * s.w_sn, s.w_sn, s.k, bias ? bias + n0 : nullptr,
                        y + b * s.y_sb + n0, s.y_sm, outs);
      }
      return 0;
    }
  }
  // x as float32, [batch, m, k] contiguous (bfloat16 is widened once here, not per work item).
  std::vector<float> widened;
  const float* xf;
  int64_t xf_sb, xf_sm;
  if constexpr (sizeof(T) == 4) {
    xf = reinterpret_cast<const float*>(x); xf_sb = s.x_sb; xf_sm = s.x_sm;
  } else {
    widened.resize(s.batch * s.m * s.k);
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t i = 0; i < s.m; ++i)
        for (int64_t t = 0; t < s.k; ++t)
          widened[(b * s.m + i) * s.k + t] = widen(x[b * s.x_sb + i * s.x_sm + t]);
    xf = widened.data(); xf_sb = s.m * s.k; xf_sm = s.k;
  }
  const int64_t block = nk ? NK_BLOCK : KN_BLOCK;
  const int64_t blocks = (s.n + block - 1) / block;
  const int64_t items = s.batch * blocks;
#pragma omp parallel for schedule(static) if (items > 1)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t b = item / blocks, n0 = (item % blocks) * block;
    const int64_t outs = s.n - n0 < block ? s.n - n0 : block;
    const float* xb = xf + b * xf_sb;
    const T* wb = w + b * s.w_sb + n0 * s.w_sn;
    const T* bb = bias ? bias + n0 : nullptr;
    T* yb = y + b * s.y_sb + n0;
    if (nk) nk_item<T, T>(xb, xf_sm, s.m, wb, s.w_sn, s.k, bb, yb, s.y_sm, outs);
    else kn_item<T>(xb, xf_sm, wb, s.w_sk, s, bb, yb, outs);
  }
  return 0;
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16 (x, W, bias, y alike). Strides in elements. Returns 0, or non-zero
// for an unsupported dtype (1) or a W with neither stride 1 (2).
int splash_small_matmul(int dtype, int64_t batch, int64_t m, int64_t n, int64_t k, const void* x, int64_t x_sb,
                        int64_t x_sm, const void* w, int64_t w_sb, int64_t w_sn, int64_t w_sk, const void* bias,
                        void* y, int64_t y_sb, int64_t y_sm) {
  const Shape s{batch, m, n, k, x_sb, x_sm, w_sb, w_sn, w_sk, y_sb, y_sm};
  if (dtype == 0)
    return run<float>(s, static_cast<const float*>(x), static_cast<const float*>(w),
                      static_cast<const float*>(bias), static_cast<float*>(y));
  if (dtype == 1)
    return run<bf16>(s, static_cast<const bf16*>(x), static_cast<const bf16*>(w), static_cast<const bf16*>(bias),
                     static_cast<bf16*>(y));
  return 1;
}

}  // extern "C"
