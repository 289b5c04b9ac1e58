// Prefill attention in expanded form on the CPU: per-head keys and values, causal or DSA-selected,
// without the padded copies scaled_dot_product_attention needs.
//
// Why: a prefill chunk's attention in expanded form scores qk-wide per-head keys (k_nope from kv_b,
// plus the rope key every head shares) and sums v-wide values. Through torch that took three
// copies of the keys and values per layer (k_nope and the broadcast rope key concatenated, values
// zero-padded to the qk width because the CPU flash kernel wants one head width) and then the
// flash kernel computed every masked score of a 128-row causal block and every padded value
// column: on the benchmark model (qk 128, v 64) it did 8/3 of the needed work. Here the keys are
// read where kv_b's product left them, the rope key once for all heads, each row tile scores only
// the keys it may see, and values are v wide.
//
// One work item is (request group entry g, head h): its Q query rows against its S keys. The
// item packs its keys transposed (Kt [qk][S], float) once, then per tile of RT rows:
//   logit[i][j] = scale * (q_nope[i] . k_nope[j] + q_pe[i] . k_pe[j])  for visible keys j
//   p[i][j]     = exp(logit[i][j] - max_i) / sum_j exp(...)            (0 where not visible)
//   out[i]      = sum_j p[i][j] * v[j]
// Visible: j <= S - Q + i (causal: the chunk's rows are the last Q positions of S), or where the
// row's DSA selection is set. A row that sees nothing gets zeros. Products accumulate in float;
// bfloat16 inputs are widened exactly and the output rounded once (as torch's kernel does).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

constexpr int W = 16;
constexpr int RT = 8;   // query rows per logit tile (broadcast operands)
constexpr int KV = 2;   // key vectors (of 16) per logit tile: RT x KV accumulators
constexpr int OR = 4;   // query rows per output tile
constexpr int OV = 4;   // value vectors per output tile: OR x OV accumulators

struct Problem {
  int64_t groups, q_len, s_len, heads, nope, rope, vdim;
  int64_t qn_sn, qn_sh, qp_sn, qp_sh;  // element strides (row, head) of q_nope, q_pe
  const int64_t* rows;                 // [groups * q_len] batch row of each query
  const uint8_t* selected;             // [batch rows, sel_sn] or null (causal)
  int64_t sel_sn;
  float scale;
};

// logits[i][j0 .. j0 + 16 * KVN) for RT packed query rows (q [RT][qk]) against Kt [qk][ld].
template <int KVN>
inline void logit_tile(const float* q, int64_t qk, const float* kt, int64_t ld, int64_t j0, float* logits,
                       int64_t lld) {
  f16v acc[RT][KVN];
  for (int i = 0; i < RT; ++i)
    for (int v = 0; v < KVN; ++v) acc[i][v] = f16v{};
  for (int64_t d = 0; d < qk; ++d) {
    f16v kv[KVN];
    for (int v = 0; v < KVN; ++v) {
      kv[v] = load16<float>(kt + d * ld + j0 + v * W);
      in_register(kv[v]);
    }
    for (int i = 0; i < RT; ++i) {
      const float qi = q[i * qk + d];
      for (int v = 0; v < KVN; ++v) acc[i][v] += qi * kv[v];
    }
  }
  for (int i = 0; i < RT; ++i)
    for (int v = 0; v < KVN; ++v) std::memcpy(logits + i * lld + j0 + v * W, &acc[i][v], sizeof(f16v));
}

// out rows [OR] (float, width vdim) += p[OR][0:keys] @ values (key j's values at vals + j * vs).
template <typename T, int OVN>
inline void output_tile(const float* p, int64_t pld, int rows, const T* vals, int64_t vs, int64_t keys, int64_t d0,
                        float* out, int64_t old) {
  f16v acc[OR][OVN];
  for (int i = 0; i < OR; ++i)
    for (int v = 0; v < OVN; ++v) acc[i][v] = f16v{};
  for (int64_t j = 0; j < keys; ++j) {
    f16v vv[OVN];
    for (int v = 0; v < OVN; ++v) {
      vv[v] = load16<T>(vals + j * vs + d0 + v * W);
      in_register(vv[v]);
    }
    for (int i = 0; i < OR; ++i) {
      const float pi = p[i * pld + j];
      for (int v = 0; v < OVN; ++v) acc[i][v] += pi * vv[v];
    }
  }
  for (int i = 0; i < rows; ++i)
    for (int v = 0; v < OVN; ++v) std::memcpy(out + i * old + d0 + v * W, &acc[i][v], sizeof(f16v));
}

template <typename T>
void attend_item(const Problem& pb, const T* q_nope, const T* q_pe, const T* kv, const T* k_pe, int64_t g, int64_t h,
                 T* out, std::vector<float>& kt, std::vector<float>& qs, std::vector<float>& logits,
                 std::vector<float>& acc) {
  const int64_t Q = pb.q_len, S = pb.s_len, qk = pb.nope + pb.rope, vd = pb.vdim;
  const int64_t row_kv = pb.heads * (pb.nope + vd);  // elements per key row of kv
  const int64_t ld = (S + KV * W - 1) / (KV * W) * (KV * W);  // keys padded to whole logit tiles
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // Kt [qk][ld]: this head's k_nope then the shared rope key, transposed; padding keys are zero
  kt.assign(qk * ld, 0.0f);
  for (int64_t j = 0; j < S; ++j) {
    const T* kn = kv + (g * S + j) * row_kv + h * (pb.nope + vd);
    const T* kp = k_pe + (g * S + j) * pb.rope;
    for (int64_t d = 0; d < pb.nope; ++d) kt[d * ld + j] = widen(kn[d]);
    for (int64_t d = 0; d < pb.rope; ++d) kt[(pb.nope + d) * ld + j] = widen(kp[d]);
  }
  const T* vals = kv + g * S * row_kv + h * (pb.nope + vd) + pb.nope;  // key j's values at vals + j * row_kv
  qs.resize(RT * qk);
  logits.resize(RT * ld);
  acc.resize(RT * vd);
  for (int64_t i0 = 0; i0 < Q; i0 += RT) {
    const int rows = (int)(Q - i0 < RT ? Q - i0 : RT);
    // this tile's queries, widened (rows past Q are zero)
    std::fill(qs.begin(), qs.end(), 0.0f);
    for (int i = 0; i < rows; ++i) {
      const int64_t n = pb.rows[g * Q + i0 + i];
      const T* qn = q_nope + n * pb.qn_sn + h * pb.qn_sh;
      const T* qp = q_pe + n * pb.qp_sn + h * pb.qp_sh;
      for (int64_t d = 0; d < pb.nope; ++d) qs[i * qk + d] = widen(qn[d]);
      for (int64_t d = 0; d < pb.rope; ++d) qs[i * qk + pb.nope + d] = widen(qp[d]);
    }
    // keys [0, keys) hold every key a row of the tile may see
    const int64_t keys = pb.selected ? S : std::min<int64_t>(S, S - Q + i0 + rows);
    for (int64_t j0 = 0; j0 < keys; j0 += KV * W) {
      if (keys - j0 > W)
        logit_tile<KV>(qs.data(), qk, kt.data(), ld, j0, logits.data(), ld);
      else
        logit_tile<1>(qs.data(), qk, kt.data(), ld, j0, logits.data(), ld);
    }
    // softmax per row over its visible keys; p overwrites the logits, zero where not visible
    for (int i = 0; i < rows; ++i) {
      float* l = logits.data() + i * ld;
      const uint8_t* sel = pb.selected ? pb.selected + pb.rows[g * Q + i0 + i] * pb.sel_sn : nullptr;
      const int64_t last = S - Q + i0 + i;  // causal: the row's own position
      float m = neg_inf;
      for (int64_t j = 0; j < keys; ++j) {
        const bool visible = sel ? sel[j] != 0 : j <= last;
        l[j] = visible ? l[j] * pb.scale : neg_inf;
        m = l[j] > m ? l[j] : m;
      }
      if (m == neg_inf) {  // sees nothing: zero output
        std::fill(l, l + keys, 0.0f);
        continue;
      }
      f16v sumv = f16v{};
      int64_t j = 0;
      for (; j + W <= keys; j += W) {
        f16v v = exp16(load16<float>(l + j) - m);
        std::memcpy(l + j, &v, sizeof(v));
        sumv += v;
      }
      float sum = 0;
      for (int k = 0; k < W; ++k) sum += sumv[k];
      for (; j < keys; ++j) {
        l[j] = std::exp(l[j] - m);
        sum += l[j];
      }
      const float inv = 1.0f / sum;
      for (j = 0; j < keys; ++j) l[j] *= inv;
    }
    for (int i = rows; i < RT; ++i) std::fill(logits.data() + i * ld, logits.data() + i * ld + keys, 0.0f);
    // out = p @ values, OR rows at a time, OV vectors of values at a time, scalar tail past them
    const int64_t vec_end = vd / W * W;
    for (int r0 = 0; r0 < rows; r0 += OR) {
      const int rn = rows - r0 < OR ? rows - r0 : OR;
      const float* p = logits.data() + r0 * ld;
      float* o = acc.data() + r0 * vd;
      int64_t d0 = 0;
      for (; d0 + OV * W <= vec_end; d0 += OV * W) output_tile<T, OV>(p, ld, rn, vals, row_kv, keys, d0, o, vd);
      for (; d0 < vec_end; d0 += W) output_tile<T, 1>(p, ld, rn, vals, row_kv, keys, d0, o, vd);
      for (int i = 0; i < rn; ++i)
        for (int64_t d = vec_end; d < vd; ++d) {
          float s = 0;
          for (int64_t j = 0; j < keys; ++j) s += p[i * ld + j] * widen(vals[j * row_kv + d]);
          o[i * vd + d] = s;
        }
    }
    for (int i = 0; i < rows; ++i) {
      T* dst = out + ((g * Q + i0 + i) * pb.heads + h) * vd;
      for (int64_t d = 0; d < vd; ++d) dst[d] = narrow<T>(acc[i * vd + d]);
    }
  }
}

template <typename T>
void attend(const Problem& pb, const T* q_nope, const T* q_pe, const T* kv, const T* k_pe, T* out) {
  const int64_t items = pb.groups * pb.heads;
#pragma omp parallel
  {
    std::vector<float> kt, qs, logits, acc;  // per thread, reused across its items
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it)
      attend_item<T>(pb, q_nope, q_pe, kv, k_pe, it / pb.heads, it % pb.heads, out, kt, qs, logits, acc);
  }
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16 (q, kv, k_pe and out). q_nope [N, H, nope] and q_pe [N, H, rope] with
// element strides (row, head), last dim contiguous; rows [groups * q_len] the batch row of each
// query; kv [groups * s_len, H, nope + vdim] contiguous (k_nope then v per head); k_pe
// [groups * s_len, rope] contiguous; selected [N, sel_sn] uint8 or null (causal); out
// [groups * q_len, H, vdim] contiguous. Returns 0, or 1 for an unsupported dtype.
int splash_expanded_attention(int dtype, int64_t groups, int64_t q_len, int64_t s_len, int64_t heads, int64_t nope,
                              int64_t rope, int64_t vdim, const void* q_nope, int64_t qn_sn, int64_t qn_sh,
                              const void* q_pe, int64_t qp_sn, int64_t qp_sh, const int64_t* rows, const void* kv,
                              const void* k_pe, const uint8_t* selected, int64_t sel_sn, double scale, void* out) {
  Problem pb{groups, q_len, s_len, heads, nope, rope, vdim, qn_sn, qn_sh, qp_sn, qp_sh, rows, selected, sel_sn,
             (float)scale};
  if (dtype == 0)
    attend<float>(pb, (const float*)q_nope, (const float*)q_pe, (const float*)kv, (const float*)k_pe, (float*)out);
  else if (dtype == 1)
    attend<bf16>(pb, (const bf16*)q_nope, (const bf16*)q_pe, (const bf16*)kv, (const bf16*)k_pe, (bf16*)out);
  else
    return 1;
  return 0;
}

}  // extern "C"
