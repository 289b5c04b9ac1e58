// A MoE block's routed experts in one call, for steps with few rows.
//
// Why: run through torch, each expert that got rows costs a gather, three products, SiLU, a
// product with the gating weight and a scatter-add: about fifteen small ops, a few microseconds
// of dispatch each, for a handful of rows. In a decode step of a few requests that dispatch is
// most of the block. Here the routing table is grouped by expert once, and every product runs on
// the small-row register tiles (small_matmul.h), all in one OpenMP region:
//
//   for each expert e with rows R_e (row r routed to e in its slot j, gating weight g[r, j]):
//     h_e   = silu(x[R_e] W_gate[e]^T) * (x[R_e] W_up[e]^T)      [|R_e|, inter]
//     y_e   = h_e W_down[e]^T                                     [|R_e|, hidden]
//   out[r] += g[r, j] * y_e[r]   for every (r, j), experts in ascending order (a fixed sum order)
//
// Products accumulate in float32; y stays float32 and h is rounded to the model dtype once (torch
// rounds after every op; in bfloat16 this is the more precise of the two). ``out`` is float32 [n, hidden],
// zeroed here. Experts outside [first_expert, first_expert + num_experts) contribute nothing (the
// other ranks' experts under expert parallelism).
#include "small_matmul.h"

#include <cmath>

namespace {

template <typename T>
int run_experts(int64_t n, int64_t hidden, int64_t inter, const T* x, int64_t x_sm, const int64_t* idx,
                const float* gate_weight, int64_t top_k, const int64_t* weights, int64_t num_experts,
                int64_t first_expert, float* out) {
  // Rows of each local expert, in row order: (row, slot).
  std::vector<std::vector<std::pair<int64_t, int64_t>>> rows(num_experts);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t e = idx[r * top_k + j] - first_expert;
      if (e >= 0 && e < num_experts) rows[e].emplace_back(r, j);
    }
  std::vector<int64_t> active, offset;  // experts with rows; their first row in the packed buffers
  int64_t packed = 0;
  for (int64_t e = 0; e < num_experts; ++e)
    if (!rows[e].empty()) { active.push_back(e); offset.push_back(packed); packed += (int64_t)rows[e].size(); }
  std::memset(out, 0, sizeof(float) * n * hidden);
  if (packed == 0) return 0;
  // x gathered per expert: widened to float32, or kept bfloat16 where the bfloat16 pair tile runs
  // (then SiLU(gate) * up is rounded to bfloat16 once before the down product, as torch rounds it).
  constexpr bool pairs = sizeof(T) == 2 && kHasBf16Pairs;
  std::vector<float> xs(pairs ? 0 : packed * hidden), gate(packed * inter), up(packed * inter), y(packed * hidden);
  std::vector<T> xs_t(pairs ? packed * hidden : 0), h_t(pairs ? packed * inter : 0);
  for (size_t a = 0; a < active.size(); ++a)
    for (size_t i = 0; i < rows[active[a]].size(); ++i) {
      const T* src = x + rows[active[a]][i].first * x_sm;
      if constexpr (pairs) {
        std::memcpy(xs_t.data() + (offset[a] + i) * hidden, src, sizeof(T) * hidden);
      } else {
        float* dst = xs.data() + (offset[a] + i) * hidden;
        for (int64_t t = 0; t < hidden; ++t) dst[t] = widen(src[t]);
      }
    }
  // One work item per expert (gate, up, SiLU, down: no barrier between them), then one fork/join:
  // a barrier costs a scheduler time slice when another process shares the cores.
  const int64_t num_active = (int64_t)active.size();
#pragma omp parallel for schedule(dynamic, 1) if (num_active > 1)
  for (int64_t a = 0; a < num_active; ++a) {
    const int64_t e = active[a], m = (int64_t)rows[e].size();
    const T* wg = reinterpret_cast<const T*>(weights[e * 3 + 0]);
    const T* wu = reinterpret_cast<const T*>(weights[e * 3 + 1]);
    const T* wd = reinterpret_cast<const T*>(weights[e * 3 + 2]);
    float* g = gate.data() + offset[a] * inter;
    float* u = up.data() + offset[a] * inter;
    float* ya = y.data() + offset[a] * hidden;
    if constexpr (pairs) {
      const T* xa = xs_t.data() + offset[a] * hidden;
      T* h = h_t.data() + offset[a] * inter;
      nk_item_pairs<float>(xa, hidden, m, wg, hidden, hidden, nullptr, g, inter, inter);
      nk_item_pairs<float>(xa, hidden, m, wu, hidden, hidden, nullptr, u, inter, inter);
      for (int64_t i = 0; i < m * inter; ++i) h[i] = narrow<T>(g[i] / (1.0f + std::exp(-g[i])) * u[i]);
      nk_item_pairs<float>(h, inter, m, wd, inter, inter, nullptr, ya, hidden, hidden);
    } else {
      const float* xa = xs.data() + offset[a] * hidden;
      nk_item<T, float>(xa, hidden, m, wg, hidden, hidden, nullptr, g, inter, inter);
      nk_item<T, float>(xa, hidden, m, wu, hidden, hidden, nullptr, u, inter, inter);
      for (int64_t i = 0; i < m * inter; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
      nk_item<T, float>(g, inter, m, wd, inter, inter, nullptr, ya, hidden, hidden);
    }
  }
  for (int64_t a = 0; a < num_active; ++a)  // weighted sum into out, experts in ascending order
    for (size_t i = 0; i < rows[active[a]].size(); ++i) {
      const auto [r, j] = rows[active[a]][i];
      const float g = gate_weight[r * top_k + j];
      const float* src = y.data() + (offset[a] + (int64_t)i) * hidden;
      float* dst = out + r * hidden;
      for (int64_t c = 0; c < hidden; ++c) dst[c] += g * src[c];
    }
  return 0;
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16 (x and every expert weight). weights: [num_experts, 3] addresses of
// each local expert's gate [inter, hidden], up [inter, hidden] and down [hidden, inter] weights,
// contiguous. idx [n, top_k] int64 global expert ids, gate_weight [n, top_k] float32, out [n, hidden]
// float32. Returns 0, or 1 for an unsupported dtype.
int splash_routed_experts(int dtype, int64_t n, int64_t hidden, int64_t inter, const void* x, int64_t x_sm,
                          const int64_t* idx, const float* gate_weight, int64_t top_k, const int64_t* weights,
                          int64_t num_experts, int64_t first_expert, float* out) {
  if (dtype == 0)
    return run_experts<float>(n, hidden, inter, static_cast<const float*>(x), x_sm, idx, gate_weight, top_k,
                              weights, num_experts, first_expert, out);
  if (dtype == 1)
    return run_experts<bf16>(n, hidden, inter, static_cast<const bf16*>(x), x_sm, idx, gate_weight, top_k,
                             weights, num_experts, first_expert, out);
  return 1;
}

}  // extern "C"
