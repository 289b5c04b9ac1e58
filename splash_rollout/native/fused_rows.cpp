// RMSNorm and rotary embedding of activation rows, each in one pass on the CPU.
//
// Through torch an RMSNorm is six to eight kernels (cast, square, mean, add, rsqrt, two products,
// cast back) and a rotation seven (four products, a difference, a sum, a concatenation), each a
// pass over the rows, a temporary and, above a few thousand elements, an OpenMP barrier. A decode
// step runs 33 norms and 16 rotations of this size; with a handful of rows their dispatch is a
// tenth of the step. Here each is one pass.
//
// Rounding follows torch's order step by step, so the results equal the torch expressions in
// models/norm.py and models/rope.py bit for bit, except the norm's sum of squares, which is added in
// another order (a few ulp of the statistic; fast numerics only -- reproducible numerics keep the
// float64 torch path):
//   norm:  r = 1 / sqrt(sum(x * x) / d + eps),  y = round_T(x * r),  out = round_T(w * y)
//   rope:  out[:h] = round_T(round_T(a * c) - round_T(b * s)),  out[h:] = round_T(round_T(b * c) + round_T(a * s))
// with T the storage type (float32: every round is the float operation's own; bfloat16: to nearest even).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"

// Each rounding above is its own operation: no product may be fused into the add after it, which
// would round once where torch rounds twice (the other kernels keep their fused multiply-adds; a
// pragma reaches only this file).
#pragma GCC optimize("fp-contract=off")

namespace {


template <typename T> inline float round_to(float f) { return widen(narrow<T>(f)); }

// 16 elements of T as floats (load16, simd.h), and back.
typedef uint32_t u32x16 __attribute__((vector_size(64)));

// Each lane rounded to T's precision (kept as float), and 16 lanes stored as T.
template <typename T> inline f16v round16(f16v v);
template <> inline f16v round16<float>(f16v v) { return v; }
template <> inline f16v round16<bf16>(f16v v) {
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof(v));
  const u32x16 nan = (bits & 0x7fffffffu) > 0x7f800000u;  // lanes all ones where NaN
  const u32x16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  const u32x16 quiet = (bits | 0x400000u) & 0xffff0000u;
  const u32x16 out = (nan & quiet) | (~nan & rounded);
  f16v f;
  std::memcpy(&f, &out, sizeof(f));
  return f;
}
template <typename T> inline void store16(T* p, f16v v);
template <> inline void store16<float>(float* p, f16v v) { std::memcpy(p, &v, sizeof(v)); }
template <> inline void store16<bf16>(bf16* p, f16v v) {
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  u32x16 bits;
  const f16v r = round16<bf16>(v);
  std::memcpy(&bits, &r, sizeof(r));
  const u16x16 h = __builtin_convertvector(bits >> 16, u16x16);
  std::memcpy(p, &h, sizeof(h));
}

template <typename T> void rms_norm_rows(int64_t rows, int64_t dim, const T* x, int64_t x_stride, const T* weight,
                                         float eps, T* out) {
#pragma omp parallel for schedule(static) if (rows * dim >= (1 << 16))
  for (int64_t n = 0; n < rows; ++n) {
    const T* xr = x + n * x_stride;
    T* o = out + n * dim;
    f16v acc = f16v{};
    int64_t j = 0;
    for (; j + 16 <= dim; j += 16) {
      const f16v v = load16<T>(xr + j);
      acc += v * v;
    }
    float sum = 0;
    for (int i = 0; i < 16; ++i) sum += acc[i];
    for (; j < dim; ++j) sum += widen(xr[j]) * widen(xr[j]);
    const float r = 1.0f / std::sqrt(sum / (float)dim + eps);
    for (j = 0; j + 16 <= dim; j += 16) store16<T>(o + j, load16<T>(weight + j) * round16<T>(load16<T>(xr + j) * r));
    for (; j < dim; ++j) o[j] = narrow<T>(widen(weight[j]) * round_to<T>(widen(xr[j]) * r));
  }
}

// x [rows, heads, dim] (strides x_sn, x_sh; elements contiguous), cos / sin [rows, dim / 2]
// contiguous, out [rows, heads, dim] contiguous in layout [a | b].
template <typename T> void rope_rows(int64_t rows, int64_t heads, int64_t dim, const T* x, int64_t x_sn, int64_t x_sh,
                                     const T* cos, const T* sin, int interleaved, T* out) {
  const int64_t half = dim / 2, items = rows * heads;
  const int64_t vec_half = half / 16 * 16;
#pragma omp parallel for schedule(static) if (items * dim >= (1 << 16))
  for (int64_t it = 0; it < items; ++it) {
    const int64_t n = it / heads, h = it % heads;
    const T* xr = x + n * x_sn + h * x_sh;
    const T* c = cos + n * half;
    const T* s = sin + n * half;
    T* o = out + it * dim;
    int64_t i = 0;
    for (; i < vec_half; i += 16) {
      f16v a, b;
      if (interleaved) {  // pairs (x[2i], x[2i+1]): even lanes of two loads, odd lanes of them
        const f16v lo = load16<T>(xr + 2 * i), hi = load16<T>(xr + 2 * i + 16);
        a = __builtin_shufflevector(lo, hi, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        b = __builtin_shufflevector(lo, hi, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
      } else {
        a = load16<T>(xr + i);
        b = load16<T>(xr + half + i);
      }
      const f16v ci = load16<T>(c + i), si = load16<T>(s + i);
      store16<T>(o + i, round16<T>(a * ci) - round16<T>(b * si));
      store16<T>(o + half + i, round16<T>(b * ci) + round16<T>(a * si));
    }
    for (; i < half; ++i) {
      const float a = widen(interleaved ? xr[2 * i] : xr[i]);
      const float b = widen(interleaved ? xr[2 * i + 1] : xr[half + i]);
      const float ci = widen(c[i]), si = widen(s[i]);
      o[i] = narrow<T>(round_to<T>(a * ci) - round_to<T>(b * si));
      o[half + i] = narrow<T>(round_to<T>(b * ci) + round_to<T>(a * si));
    }
  }
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16 (x, weight and out alike). x rows of `dim` contiguous elements,
// `x_stride` elements apart; out [rows, dim] contiguous. Returns 0, or -1 for an unknown dtype.
int splash_rms_norm(int dtype, int64_t rows, int64_t dim, const void* x, int64_t x_stride, const void* weight,
                    double eps, void* out) {
  if (dtype == 0) rms_norm_rows<float>(rows, dim, (const float*)x, x_stride, (const float*)weight, (float)eps, (float*)out);
  else if (dtype == 1) rms_norm_rows<bf16>(rows, dim, (const bf16*)x, x_stride, (const bf16*)weight, (float)eps, (bf16*)out);
  else return -1;
  return 0;
}

// dtype as above for x, cos, sin and out; see rope_rows for the shapes.
int splash_rope(int dtype, int64_t rows, int64_t heads, int64_t dim, const void* x, int64_t x_sn, int64_t x_sh,
                const void* cos, const void* sin, int interleaved, void* out) {
  if (dtype == 0)
    rope_rows<float>(rows, heads, dim, (const float*)x, x_sn, x_sh, (const float*)cos, (const float*)sin, interleaved,
                     (float*)out);
  else if (dtype == 1)
    rope_rows<bf16>(rows, heads, dim, (const bf16*)x, x_sn, x_sh, (const bf16*)cos, (const bf16*)sin, interleaved,
                    (bf16*)out);
  else return -1;
  return 0;
}

}  // extern "C"
