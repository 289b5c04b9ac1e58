// Register tiles for products with few activation rows, shared by small_matmul.cpp (one product)
// and routed_experts.cpp (a MoE block's routed experts in one call). See small_matmul.cpp for why.
#pragma once
#include "simd.h"
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int W = 16;

struct Shape {
  int64_t batch, m, n, k;
  int64_t x_sb, x_sm;          // x [batch, m, k], unit stride in k
  int64_t w_sb, w_sn, w_sk;    // W [batch, n, k]; w_sk == 1 (NK) or w_sn == 1 (KN)
  int64_t y_sb, y_sm;          // y [batch, m, n], unit stride in n
};

constexpr int NK_ROWS = 4, NK_OUTS = 4, NK_BLOCK = 16;  // register tile; outputs per work item
constexpr int KN_ROWS = 4, KN_VECS = 4, KN_BLOCK = KN_VECS * W;

// NK tile: MR rows of x (float32, row stride xs) against NR weight rows; y gets MR x NR values.
template <typename T, int MR, int NR, typename O>
inline void nk_tile(const float* x, int64_t xs, const T* w, int64_t ws, int64_t k, const T* bias, O* y,
                    int64_t ys) {
  f16v acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = f16v{} ;
  int64_t kk = 0;
  for (; kk + W <= k; kk += W) {
    f16v wv[NR];
    for (int j = 0; j < NR; ++j) {
      prefetch_l2(w + (j + NR) * ws + kk);  // the next tile's rows: a weight row is a short stream
      wv[j] = load16<T>(w + j * ws + kk);
      in_register(wv[j]);
    }
    for (int i = 0; i < MR; ++i) {
      f16v xv = load16<float>(x + i * xs + kk);
      in_register(xv);
      for (int j = 0; j < NR; ++j) acc[i][j] += xv * wv[j];
    }
  }
  f16v flat[16] = {};
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) flat[i * NR + j] = acc[i][j];
  const f16v sums = hsum16(flat);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = sums[i * NR + j];
      for (int64_t t = kk; t < k; ++t) s += x[i * xs + t] * widen(w[j * ws + t]);
      if (bias) s += widen(bias[j]);
      y[i * ys + j] = narrow<O>(s);
    }
}

template <typename T, int MR, typename O>
inline void nk_rows(const float* x, int64_t xs, const T* w, int64_t ws, int64_t k, const T* bias, O* y,
                    int64_t ys, int64_t outs) {
  int64_t j = 0;
  for (; j + NK_OUTS <= outs; j += NK_OUTS)
    nk_tile<T, MR, NK_OUTS, O>(x, xs, w + j * ws, ws, k, bias ? bias + j : nullptr, y + j, ys);
  switch (outs - j) {
    case 1: nk_tile<T, MR, 1, O>(x, xs, w + j * ws, ws, k, bias ? bias + j : nullptr, y + j, ys); break;
    case 2: nk_tile<T, MR, 2, O>(x, xs, w + j * ws, ws, k, bias ? bias + j : nullptr, y + j, ys); break;
    case 3: nk_tile<T, MR, 3, O>(x, xs, w + j * ws, ws, k, bias ? bias + j : nullptr, y + j, ys); break;
    default: break;
  }
}

// One NK work item: m rows of x (float32, row stride xs) against outputs [n0, n0 + outs) of W
// (row stride ws, k inputs); y (row stride ys) gets m x outs values.
template <typename T, typename O>
void nk_item(const float* x, int64_t xs, int64_t m, const T* w, int64_t ws, int64_t k, const T* bias, O* y,
             int64_t ys, int64_t outs) {
  int64_t i = 0;
  for (; i + NK_ROWS <= m; i += NK_ROWS) nk_rows<T, NK_ROWS, O>(x + i * xs, xs, w, ws, k, bias, y + i * ys, ys, outs);
  switch (m - i) {
    case 1: nk_rows<T, 1, O>(x + i * xs, xs, w, ws, k, bias, y + i * ys, ys, outs); break;
    case 2: nk_rows<T, 2, O>(x + i * xs, xs, w, ws, k, bias, y + i * ys, ys, outs); break;
    case 3: nk_rows<T, 3, O>(x + i * xs, xs, w, ws, k, bias, y + i * ys, ys, outs); break;
    default: break;
  }
}

#if defined(__AVX512BF16__)
// bfloat16 x and W with AVX512-BF16: one vdpbf16ps multiplies 32 pairs and adds them into 16 float
// lanes, twice the products of a float FMA and no widening of W (the widening made the bfloat16
// products slower than float32 ones). Products of bfloat16 are exact in float32; the pairwise sums
// round as the instruction does (nearest even, denormals flushed), so results differ from the
// widened path by float32 rounding.
template <int MR, int NR, typename O>
inline void nk_tile_bf16(const bf16* x, int64_t xs, const bf16* w, int64_t ws, int64_t k, const bf16* bias, O* y,
                         int64_t ys) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t kk = 0;
  for (; kk + 2 * W <= k; kk += 2 * W) {
    __m512i wv[NR];
    for (int j = 0; j < NR; ++j) {
      prefetch_l2(w + (j + NR) * ws + kk);  // the next tile's rows: a weight row is a short stream
      wv[j] = _mm512_loadu_si512(w + j * ws + kk);
      asm("" : "+v"(wv[j]));
    }
    for (int i = 0; i < MR; ++i) {
      __m512i xv = _mm512_loadu_si512(x + i * xs + kk);
      asm("" : "+v"(xv));
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
    }
  }
  f16v flat[16] = {};
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) flat[i * NR + j] = (f16v)acc[i][j];
  const f16v sums = hsum16(flat);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = sums[i * NR + j];
      for (int64_t t = kk; t < k; ++t) s += widen(x[i * xs + t]) * widen(w[j * ws + t]);
      if (bias) s += widen(bias[j]);
      y[i * ys + j] = narrow<O>(s);
    }
}

template <int MR, typename O>
inline void nk_rows_bf16(const bf16* x, int64_t xs, const bf16* w, int64_t ws, int64_t k, const bf16* bias, O* y,
                         int64_t ys, int64_t outs) {
  int64_t j = 0;
  for (; j + NK_OUTS <= outs; j += NK_OUTS)
    nk_tile_bf16<MR, NK_OUTS, O>(x, xs, w + j * ws, ws, k, bias ? bias + j : nullptr, y + j, ys);
  switch (outs - j) {
    case 1: nk_tile_bf16<MR, 1, O>(x, xs, w + j * ws, ws, k, bias ? bias + j : nullptr, y + j, ys); break;
    case 2: nk_tile_bf16<MR, 2, O>(x, xs, w + j * ws, ws, k, bias ? bias + j : nullptr, y + j, ys); break;
    case 3: nk_tile_bf16<MR, 3, O>(x, xs, w + j * ws, ws, k, bias ? bias + j : nullptr, y + j, ys); break;
    default: break;
  }
}

template <typename O>
void nk_item_pairs(const bf16* x, int64_t xs, int64_t m, const bf16* w, int64_t ws, int64_t k, const bf16* bias, O* y,
                  int64_t ys, int64_t outs) {
  int64_t i = 0;
  for (; i + NK_ROWS <= m; i += NK_ROWS) nk_rows_bf16<NK_ROWS, O>(x + i * xs, xs, w, ws, k, bias, y + i * ys, ys, outs);
  switch (m - i) {
    case 1: nk_rows_bf16<1, O>(x + i * xs, xs, w, ws, k, bias, y + i * ys, ys, outs); break;
    case 2: nk_rows_bf16<2, O>(x + i * xs, xs, w, ws, k, bias, y + i * ys, ys, outs); break;
    case 3: nk_rows_bf16<3, O>(x + i * xs, xs, w, ws, k, bias, y + i * ys, ys, outs); break;
    default: break;
  }
}
constexpr bool kHasBf16Pairs = true;
#else
constexpr bool kHasBf16Pairs = false;
template <typename O>  // never called: the callers test kHasBf16Pairs at compile time
void nk_item_pairs(const bf16*, int64_t, int64_t, const bf16*, int64_t, int64_t, const bf16*, O*, int64_t, int64_t) {}
#endif

// KN tile: MR rows x (VR vectors of W lanes) of y, summing x[i, t] * W[t, :] over t.
template <typename T, int MR, int VR>
inline void kn_tile(const float* x, int64_t xs, const T* w, int64_t ws, int64_t k, const T* bias, T* y,
                    int64_t ys) {
  f16v acc[MR][VR];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < VR; ++v) acc[i][v] = bias ? load16<T>(bias + v * W) : f16v{};
  for (int64_t t = 0; t < k; ++t) {
    f16v wv[VR];
    for (int v = 0; v < VR; ++v) {
      wv[v] = load16<T>(w + t * ws + v * W);
      in_register(wv[v]);
    }
    for (int i = 0; i < MR; ++i) {
      float xi = x[i * xs + t];
      for (int v = 0; v < VR; ++v) acc[i][v] += xi * wv[v];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < VR; ++v)
      for (int l = 0; l < W; ++l) y[i * ys + v * W + l] = narrow<T>(acc[i][v][l]);
}

template <typename T, int MR>
inline void kn_rows(const float* x, int64_t xs, const T* w, int64_t ws, int64_t k, const T* bias, T* y,
                    int64_t ys, int64_t outs) {
  int64_t c = 0;
  for (; c + KN_BLOCK <= outs; c += KN_BLOCK)
    kn_tile<T, MR, KN_VECS>(x, xs, w + c, ws, k, bias ? bias + c : nullptr, y + c, ys);
  for (; c + W <= outs; c += W) kn_tile<T, MR, 1>(x, xs, w + c, ws, k, bias ? bias + c : nullptr, y + c, ys);
  for (; c < outs; ++c)  // fewer than W outputs left: one at a time
    for (int i = 0; i < MR; ++i) {
      float s = bias ? widen(bias[c]) : 0.0f;
      for (int64_t t = 0; t < k; ++t) s += x[i * xs + t] * widen(w[t * ws + c]);
      y[i * ys + c] = narrow<T>(s);
    }
}

template <typename T>
void kn_item(const float* x, int64_t xs, const T* w, int64_t ws, const Shape& s, const T* bias, T* y,
             int64_t outs) {
  int64_t i = 0;
  for (; i + KN_ROWS <= s.m; i += KN_ROWS)
    kn_rows<T, KN_ROWS>(x + i * xs, xs, w, ws, s.k, bias, y + i * s.y_sm, s.y_sm, outs);
  switch (s.m - i) {
    case 1: kn_rows<T, 1>(x + i * xs, xs, w, ws, s.k, bias, y + i * s.y_sm, s.y_sm, outs); break;
    case 2: kn_rows<T, 2>(x + i * xs, xs, w, ws, s.k, bias, y + i * s.y_sm, s.y_sm, outs); break;
    case 3: kn_rows<T, 3>(x + i * xs, xs, w, ws, s.k, bias, y + i * s.y_sm, s.y_sm, outs); break;
    default: break;
  }
}

}  // namespace
