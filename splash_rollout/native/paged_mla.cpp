// Paged absorbed-MLA attention on the CPU, reading the KV pool in place.
//
// One call attends every query row of a step over its request's history, page by page through the
// block table: no gathered copy of the history, no padding, no masked temporaries. Each row sees
// the positions of its own request that this rank stores (block-table entry >= 0), below the
// request's length, and either up to its own position (causal) or exactly the positions of its DSA
// selection. Per (row, head) the result is the reference's math in the same order of operations:
//   logit_s = scale * (q_nope_abs . c_s + q_pe . k_pe_s),  lse = log sum_s exp(logit_s),
//   out     = sum_s exp(logit_s - lse) * c_s,
// accumulated in Acc (float, or double under reproducible numerics, where the result does not
// depend on batching to ~1e-16 relative and rounds once in the caller). A row with no visible key
// gets out = 0 and lse = -inf, so partial results (context parallelism) merge exactly.
//
// Work items are (request, tile of its rows, group of heads), spread over OpenMP threads; a work
// item reads each key once per tile. Built at first use by the package (build.py) with the
// system C++ compiler and loaded with ctypes; the OpenMP runtime is the one torch already loaded.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

template <typename T> struct Vec;
template <> struct Vec<float> { typedef float type __attribute__((vector_size(64))); static constexpr int W = 16; };
template <> struct Vec<double> { typedef double type __attribute__((vector_size(64))); static constexpr int W = 8; };


template <typename Acc, typename KT> inline Acc scalar(const KT* p);
template <> inline float scalar<float, float>(const float* p) { return *p; }
template <> inline double scalar<double, float>(const float* p) { return (double)*p; }
template <> inline float scalar<float, bf16>(const bf16* p) {
  uint32_t bits = (uint32_t)(*p) << 16; float f; std::memcpy(&f, &bits, 4); return f;
}
template <> inline double scalar<double, bf16>(const bf16* p) { return (double)scalar<float, bf16>(p); }

// W consecutive key elements as one Acc vector.
template <typename Acc, typename KT> inline typename Vec<Acc>::type load(const KT* p);
template <> inline Vec<float>::type load<float, float>(const float* p) {
  Vec<float>::type v; std::memcpy(&v, p, sizeof(v)); return v;
}
template <> inline Vec<double>::type load<double, double>(const double* p) {
  Vec<double>::type v; std::memcpy(&v, p, sizeof(v)); return v;
}
template <> inline Vec<double>::type load<double, float>(const float* p) {
  typedef float f8 __attribute__((vector_size(32)));
  f8 v; std::memcpy(&v, p, sizeof(v)); return __builtin_convertvector(v, Vec<double>::type);
}
template <> inline Vec<float>::type load<float, bf16>(const bf16* p) {
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  u16x16 h; std::memcpy(&h, p, sizeof(h));
  u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  Vec<float>::type f; std::memcpy(&f, &w, sizeof(f)); return f;
}
template <> inline Vec<double>::type load<double, bf16>(const bf16* p) {
  typedef uint16_t u16x8 __attribute__((vector_size(16)));
  typedef uint32_t u32x8 __attribute__((vector_size(32)));
  typedef float f8 __attribute__((vector_size(32)));
  u16x8 h; std::memcpy(&h, p, sizeof(h));
  u32x8 w = __builtin_convertvector(h, u32x8) << 16;
  f8 f; std::memcpy(&f, &w, sizeof(f)); return __builtin_convertvector(f, Vec<double>::type);
}


template <typename Acc> inline Acc hsum(typename Vec<Acc>::type v) {
  Acc s = 0;
  for (int i = 0; i < Vec<Acc>::W; ++i) s += v[i];
  return s;
}


// l[k] = exp(l[k] - shift) for k < n; returns their sum (float accumulation, 16 lanes then a scalar tail).
inline float exp_shifted(float* l, int64_t n, float shift) {
  typedef Vec<float>::type V;
  constexpr int W = Vec<float>::W;
  V acc = V{};
  int64_t k = 0;
  for (; k + W <= n; k += W) {
    V v;
    std::memcpy(&v, l + k, sizeof(V));
    v = exp16(v - shift);
    std::memcpy(l + k, &v, sizeof(V));
    acc += v;
  }
  float sum = hsum<float>(acc);
  for (; k < n; ++k) {
    l[k] = std::exp(l[k] - shift);
    sum += l[k];
  }
  return sum;
}

constexpr int PREFETCH_TILES = 2;  // how many key tiles ahead the logit pass requests keys
constexpr int QB = 4;  // query vectors per logit micro-tile
constexpr int KB = 4;  // keys per logit micro-tile
constexpr int OB = 8;  // query vectors per output micro-tile

struct Problem {
  int64_t heads, r, rope, page_size, pages_per_seq, sel_width;
  int64_t qn_sn, qn_sh, qp_sn, qp_sh, out_sn, out_sh;  // element strides (row, head) of q_nope, q_pe, out
  const int64_t* block_table;  // [B, pages_per_seq]
  const int64_t* seq_lens;     // [B]
  const int64_t* row_start;    // [B + 1]
  const int64_t* positions;    // [N]
  const uint8_t* selected;     // [N, sel_width] or null (causal)
  double scale;
};

// Dot products of qn query segments (q[j][0:len]) with kn key segments (keys[k][off:off+len]),
// added to acc[j][k] (vector lanes) and tail[j][k] (the elements past the last full vector).
template <typename Acc, typename KT>
inline void dot_segment(const Acc* const* q, int qn, const KT* const* keys, int kn, int64_t off, int64_t len,
                        typename Vec<Acc>::type (&acc)[QB][KB], Acc (&tail)[QB][KB], const KT* const* ahead) {
  typedef typename Vec<Acc>::type V;
  constexpr int W = Vec<Acc>::W;
  const int64_t vec_end = len / W * W;
  if (qn == QB && kn == KB) {  // full tile: constant bounds, so the 4x4 accumulators stay in registers
    for (int64_t d = 0; d < vec_end; d += W) {
      V kv[KB];
      for (int k = 0; k < KB; ++k) kv[k] = load<Acc, KT>(keys[k] + off + d);
      if (ahead)  // the same line of the keys a few tiles on: a key is 36 lines, too short a stream
        for (int k = 0; k < KB; ++k) prefetch_l2(ahead[k] + off + d);  // for the hardware prefetcher
      for (int j = 0; j < QB; ++j) {
        V qv = load<Acc, Acc>(q[j] + d);
        in_register(qv);
        for (int k = 0; k < KB; ++k) acc[j][k] += qv * kv[k];
      }
    }
  } else {
    for (int64_t d = 0; d < vec_end; d += W) {
      V kv[KB];
      for (int k = 0; k < kn; ++k) kv[k] = load<Acc, KT>(keys[k] + off + d);
      for (int j = 0; j < qn; ++j) {
        V qv = load<Acc, Acc>(q[j] + d);
        for (int k = 0; k < kn; ++k) acc[j][k] += qv * kv[k];
      }
    }
  }
  for (int j = 0; j < qn; ++j)
    for (int k = 0; k < kn; ++k)
      for (int64_t d = vec_end; d < len; ++d) tail[j][k] += q[j][d] * scalar<Acc, KT>(keys[k] + off + d);
}

// Logits (unscaled) of qn query vectors -- latent part qn_[j][0:r], rope part qp[j][0:rope] --
// against kn keys (rows [r + rope] of KT), into logits[j * ld + k].
template <typename Acc, typename KT>
void logit_tile(const Acc* const* qn_, const Acc* const* qp, int qn, const KT* const* keys, int kn, int64_t r,
                int64_t rope, Acc* logits, int64_t ld, const KT* const* ahead) {
  typedef typename Vec<Acc>::type V;
  V acc[QB][KB];
  Acc tail[QB][KB];
  for (int j = 0; j < QB; ++j)
    for (int k = 0; k < KB; ++k) { acc[j][k] = V{}; tail[j][k] = 0; }
  dot_segment<Acc, KT>(qn_, qn, keys, kn, 0, r, acc, tail, ahead);
  dot_segment<Acc, KT>(qp, qn, keys, kn, r, rope, acc, tail, ahead);
  if constexpr (Vec<Acc>::W == 16) {  // float: the 16 horizontal sums of the tile in one add tree
    const f16v sums = hsum16(&acc[0][0]);
    for (int j = 0; j < qn; ++j)
      for (int k = 0; k < kn; ++k) logits[j * ld + k] = sums[j * KB + k] + tail[j][k];
  } else {
    for (int j = 0; j < qn; ++j)
      for (int k = 0; k < kn; ++k) logits[j * ld + k] = hsum<Acc>(acc[j][k]) + tail[j][k];
  }
}

// out[j][0:r] = sum_k p[j * ld + k] * keys[k][0:r] for qn query vectors, DV vectors of out at a
// time (two: a key load then serves 2 x qn FMAs instead of qn).
template <typename Acc, typename KT>
void output_tile(const Acc* p, int64_t ld, int qn, const KT* const* keys, int64_t kn, int64_t r, Acc* const* out) {
  typedef typename Vec<Acc>::type V;
  constexpr int W = Vec<Acc>::W, DV = 2;
  const int64_t wide_end = r / (DV * W) * (DV * W), vec_end = r / W * W;
  for (int64_t d = 0; d < wide_end; d += DV * W) {
    V acc[OB][DV];
    for (int j = 0; j < OB; ++j)
      for (int v = 0; v < DV; ++v) acc[j][v] = V{};
    for (int64_t k = 0; k < kn; ++k) {
      V kv[DV];
      for (int v = 0; v < DV; ++v) {
        kv[v] = load<Acc, KT>(keys[k] + d + v * W);
        in_register(kv[v]);
      }
      for (int j = 0; j < qn; ++j) {
        const Acc pj = p[j * ld + k];
        for (int v = 0; v < DV; ++v) acc[j][v] += pj * kv[v];
      }
    }
    for (int j = 0; j < qn; ++j) std::memcpy(out[j] + d, &acc[j][0], sizeof(V) * DV);
  }
  for (int64_t d = wide_end; d < vec_end; d += W) {
    V acc[OB];
    for (int j = 0; j < OB; ++j) acc[j] = V{};
    for (int64_t k = 0; k < kn; ++k) {
      V kv = load<Acc, KT>(keys[k] + d);
      for (int j = 0; j < qn; ++j) acc[j] += p[j * ld + k] * kv;
    }
    for (int j = 0; j < qn; ++j) std::memcpy(out[j] + d, &acc[j], sizeof(V));
  }
  for (int64_t d = vec_end; d < r; ++d)
    for (int j = 0; j < qn; ++j) {
      Acc s = 0;
      for (int64_t k = 0; k < kn; ++k) s += p[j * ld + k] * scalar<Acc, KT>(keys[k] + d);
      out[j][d] = s;
    }
}

// One work item: rows [row0, row1) of request b, heads [h0, h1).
template <typename Acc, typename KT>
void attend_item(const Problem& pb, const Acc* q_nope, const Acc* q_pe, const KT* cache, int64_t b, int64_t row0, int64_t row1,
                 int64_t h0, int64_t h1, Acc* out, Acc* lse) {
  const int64_t dim = pb.r + pb.rope, H = pb.heads, ps = pb.page_size;
  const int64_t seq_len = pb.seq_lens[b];
  int64_t last = seq_len - 1;  // the last key any row of the tile may see
  if (!pb.selected) {
    int64_t top = -1;
    for (int64_t n = row0; n < row1; ++n) top = pb.positions[n] > top ? pb.positions[n] : top;
    last = top < last ? top : last;
  } else if (pb.sel_width - 1 < last) {
    last = pb.sel_width - 1;
  }
  // the keys this tile may read: stored here, in position order
  std::vector<const KT*> keys;
  std::vector<int64_t> key_pos;
  const int64_t* table = pb.block_table + b * pb.pages_per_seq;
  for (int64_t s0 = 0; s0 <= last; s0 += ps) {
    const int64_t page = table[s0 / ps];
    if (page < 0) continue;
    const int64_t s1 = s0 + ps - 1 < last ? s0 + ps - 1 : last;
    for (int64_t s = s0; s <= s1; ++s) {
      if (pb.selected) {  // a DSA tile reads only the keys some row of it selected
        bool any = false;
        for (int64_t n = row0; n < row1 && !any; ++n) any = pb.selected[n * pb.sel_width + s] != 0;
        if (!any) continue;
      }
      keys.push_back(cache + (page * ps + (s - s0)) * dim);
      key_pos.push_back(s);
    }
  }
  const int64_t K = (int64_t)keys.size();
  const int64_t rows = row1 - row0, hn = h1 - h0, J = rows * hn;
  std::vector<const Acc*> qs(J), qps(J);
  std::vector<Acc*> os(J);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t h = 0; h < hn; ++h) {
      qs[i * hn + h] = q_nope + (row0 + i) * pb.qn_sn + (h0 + h) * pb.qn_sh;
      qps[i * hn + h] = q_pe + (row0 + i) * pb.qp_sn + (h0 + h) * pb.qp_sh;
      os[i * hn + h] = out + (row0 + i) * pb.out_sn + (h0 + h) * pb.out_sh;
    }
  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  if (K == 0) {
    for (int64_t j = 0; j < J; ++j) {
      std::memset(os[j], 0, sizeof(Acc) * pb.r);
      lse[(row0 + j / hn) * H + h0 + j % hn] = neg_inf;
    }
    return;
  }
  std::vector<Acc> logits(J * K);
  // Key tiles outer: a tile is read from memory once and serves every query tile from L1, while the
  // keys PREFETCH_TILES tiles on are requested.
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    const int kn = (int)(K - k0 < KB ? K - k0 : KB);
    const KT* const* ahead = k0 + (PREFETCH_TILES + 1) * KB <= K ? keys.data() + k0 + PREFETCH_TILES * KB : nullptr;
    for (int64_t j0 = 0; j0 < J; j0 += QB) {
      const int qn = (int)(J - j0 < QB ? J - j0 : QB);
      logit_tile<Acc, KT>(qs.data() + j0, qps.data() + j0, qn, keys.data() + k0, kn, pb.r, pb.rope,
                          logits.data() + j0 * K + k0, K, j0 == 0 ? ahead : nullptr);
    }
  }
  const Acc scale = (Acc)pb.scale;
  for (int64_t j = 0; j < J; ++j) {
    const int64_t n = row0 + j / hn;
    Acc* l = logits.data() + j * K;
    const int64_t pos = pb.positions[n];
    const uint8_t* sel = pb.selected ? pb.selected + n * pb.sel_width : nullptr;
    Acc m = neg_inf;
    for (int64_t k = 0; k < K; ++k) {
      const bool visible = sel ? sel[key_pos[k]] != 0 : key_pos[k] <= pos;
      l[k] = visible ? l[k] * scale : neg_inf;
      m = l[k] > m ? l[k] : m;
    }
    Acc* lse_at = lse + n * H + h0 + j % hn;
    if (m == neg_inf) {  // nothing visible: zero output, lse -inf
      *lse_at = neg_inf;
      for (int64_t k = 0; k < K; ++k) l[k] = 0;
      continue;
    }
    if constexpr (std::is_same<Acc, float>::value) {  // fast numerics: one vector exp pass, then scale
      const Acc sum = exp_shifted(l, K, m);
      *lse_at = m + std::log(sum);
      const Acc inv = 1 / sum;
      for (int64_t k = 0; k < K; ++k) l[k] *= inv;
    } else {  // reproducible: the reference's order, exp(l - lse), in double
      Acc sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += std::exp(l[k] - m);
      const Acc total = m + std::log(sum);
      *lse_at = total;
      for (int64_t k = 0; k < K; ++k) l[k] = std::exp(l[k] - total);  // exp(-inf) = 0
    }
  }
  for (int64_t j0 = 0; j0 < J; j0 += OB) {
    const int qn = (int)(J - j0 < OB ? J - j0 : OB);
    output_tile<Acc, KT>(logits.data() + j0 * K, K, qn, keys.data(), K, pb.r, os.data() + j0);
  }
}

template <typename Acc, typename KT>
void attend(const Problem& pb, int64_t num_seqs, const Acc* q_nope, const Acc* q_pe, const KT* cache, Acc* out, Acc* lse,
            int64_t row_tile, int64_t head_group) {
  // work items: (request, row tile, head group); decode requests are one tile each
  std::vector<int64_t> items;
  for (int64_t b = 0; b < num_seqs; ++b)
    for (int64_t r0 = pb.row_start[b]; r0 < pb.row_start[b + 1]; r0 += row_tile)
      for (int64_t h0 = 0; h0 < pb.heads; h0 += head_group) {
        items.push_back(b);
        items.push_back(r0);
        items.push_back(h0);
      }
  const int64_t count = (int64_t)items.size() / 3;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < count; ++i) {
    const int64_t b = items[3 * i], r0 = items[3 * i + 1], h0 = items[3 * i + 2];
    const int64_t r1 = r0 + row_tile < pb.row_start[b + 1] ? r0 + row_tile : pb.row_start[b + 1];
    const int64_t h1 = h0 + head_group < pb.heads ? h0 + head_group : pb.heads;
    attend_item<Acc, KT>(pb, q_nope, q_pe, cache, b, r0, r1, h0, h1, out, lse);
  }
}

}  // namespace

extern "C" {

// acc: 0 = float, 1 = double; kv: 0 = float32, 1 = bfloat16 (the pool's dtype). q_nope [N, H, r] and
// q_pe [N, H, rope] are in the accumulation type with the given element strides (row, head; the last
// dim contiguous); out [N, H, r] (strided likewise) and lse [N, H] (contiguous) are written in it.
// Returns 0, or -1 for an unsupported dtype pair.
int splash_paged_mla(int acc, int kv, const void* q_nope, int64_t qn_sn, int64_t qn_sh, const void* q_pe,
                     int64_t qp_sn, int64_t qp_sh, const void* cache, const int64_t* block_table,
                     int64_t pages_per_seq, const int64_t* seq_lens, const int64_t* row_start, int64_t num_seqs,
                     const int64_t* positions, const uint8_t* selected, int64_t sel_width, int64_t num_rows,
                     int64_t heads, int64_t r, int64_t rope, int64_t page_size, double scale, void* out,
                     int64_t out_sn, int64_t out_sh, void* lse, int64_t row_tile, int64_t head_group) {
  Problem pb{heads, r, rope, page_size, pages_per_seq, sel_width, qn_sn, qn_sh, qp_sn, qp_sh, out_sn,
             out_sh, block_table, seq_lens, row_start, positions, selected, scale};
#define SPLASH_RUN(A, K) attend<A, K>(pb, num_seqs, (const A*)q_nope, (const A*)q_pe, (const K*)cache, (A*)out, \
                                      (A*)lse, row_tile, head_group)
  if (acc == 0 && kv == 0) SPLASH_RUN(float, float);
  else if (acc == 0 && kv == 1) SPLASH_RUN(float, bf16);
  else if (acc == 1 && kv == 0) SPLASH_RUN(double, float);
  else if (acc == 1 && kv == 1) SPLASH_RUN(double, bf16);
  else return -1;
#undef SPLASH_RUN
  return 0;
}

}  // extern "C"
