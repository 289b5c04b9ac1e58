"""The native few-row kernels (small products, routed experts), the native sampler and the expanded
prefill attention against float64 references and the torch paths they stand in for; where they must
not apply, they decline (None) instead of guessing."""
import pytest
import torch
import torch.nn.functional as F

from splash_rollout.engine.random_draws import uniform
from splash_rollout.engine.request import SamplingSpec
from splash_rollout.engine.sampler import NO_TOKEN, SamplingBatch, sample, sample_torch
from splash_rollout.models.moe import DenseMLP, run_experts
from splash_rollout.models.numerics import head_matmul, linear, numerics
from splash_rollout.native import routed_experts as routed_module
from splash_rollout.native.routed_experts import routed_experts
from splash_rollout.native.expanded_attention import expanded_attention
from splash_rollout.native.sample_rows import sample_plain
from splash_rollout.native import native_available
from splash_rollout.native.small_matmul import MAX_ROWS, small_matmul

pytestmark = pytest.mark.skipif(not native_available(), reason="no C++ compiler for the native kernels")

TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 7, 5), (3, 33, 100), (4, 64, 512), (16, 20, 48)])
def test_small_matmul_both_weight_orders_and_bias(dtype, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).to(dtype)
    w_nk = torch.randn(n, k, generator=g).to(dtype)  # nn.Linear's [out, in]
    w_kn = torch.randn(k, n, generator=g).to(dtype)  # [in, out], passed transposed
    bias = torch.randn(n, generator=g).to(dtype)
    ref = x.double() @ w_nk.double().T + bias.double()
    y = small_matmul(x, w_nk, bias)
    assert y.shape == (m, n) and y.dtype == dtype
    assert _rel(y, ref) < TOL[dtype]
    assert _rel(small_matmul(x, w_kn.T), x.double() @ w_kn.double()) < TOL[dtype]


def test_small_matmul_batched_per_head_equals_einsum():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 8, 64, generator=g)  # [N, H, K]
    w = torch.randn(8, 64, 96, generator=g)  # [H, K, M]
    ref = torch.einsum("nhk,hkm->nhm", x.double(), w.double())
    with torch.inference_mode():
        assert _rel(head_matmul(x, w), ref) < TOL[torch.float32]
        assert _rel(head_matmul(x, w.transpose(1, 2).contiguous().transpose(1, 2)), ref) < TOL[torch.float32]


def test_small_matmul_declines_what_it_does_not_do():
    x, w = torch.randn(MAX_ROWS + 1, 8), torch.randn(4, 8)
    assert small_matmul(x, w) is None  # too many rows: torch's blocked matmul is faster
    assert small_matmul(x[:2].double(), w.double()) is None  # float64: reproducible numerics' business
    assert small_matmul(x[:2], w.requires_grad_()) is None  # autograd needs torch's op
    assert small_matmul(x[:2, :7], w.detach()) is None  # inner sizes differ


def test_fast_linear_takes_the_kernel_and_agrees_with_torch():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 256, generator=g), torch.randn(128, 256, generator=g)
    with torch.inference_mode():
        assert torch.allclose(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
        with numerics("reproducible"):  # float64 accumulation: exact rounding, the kernel stays out
            y = linear(x, w)
    assert torch.equal(y, (x.double() @ w.double().T).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_routed_experts_equal_the_expert_loop(dtype, rows):
    torch.manual_seed(rows)
    experts = torch.nn.ModuleList(DenseMLP(48, 32) for _ in range(8)).to(dtype)
    x = torch.randn(rows, 48).to(dtype)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(rows)])
    weight = torch.rand(rows, 2)
    ref = torch.zeros(rows, 48, dtype=torch.float64)
    for r in range(rows):
        for j in range(2):
            e = experts[int(idx[r, j])]
            h = F.silu(x[r].double() @ e.gate_proj.weight.double().T) * (x[r].double() @ e.up_proj.weight.double().T)
            ref[r] += float(weight[r, j]) * (h @ e.down_proj.weight.double().T)
    with torch.inference_mode():
        fused = routed_experts(x, idx, weight, experts, 0)
        assert fused.dtype == torch.float32 and _rel(fused, ref) < TOL[dtype]
        # a rank holding experts [2, 6) adds only theirs
        held = ((idx >= 2) & (idx < 6)).to(torch.float32) * weight
        part = routed_experts(x, idx, weight, experts[2:6], 2)
        full_of_held = routed_experts(x, idx, held, experts, 0)
        assert torch.allclose(part, full_of_held, rtol=1e-6, atol=1e-6)
        assert _rel(run_experts(x, idx, weight, experts).to(torch.float64), ref) < TOL[dtype]


def test_routed_experts_decline_autograd_and_wide_batches():
    experts = torch.nn.ModuleList(DenseMLP(16, 8) for _ in range(4))
    x, idx, w = torch.randn(3, 16, requires_grad=True), torch.zeros(3, 2, dtype=torch.int64), torch.rand(3, 2)
    assert routed_experts(x, idx, w, experts, 0) is None
    with torch.inference_mode():
        n = routed_module.MAX_ROWS + 1
        wide = torch.randn(n, 16)
        assert routed_experts(wide, torch.zeros(n, 2, dtype=torch.int64), torch.rand(n, 2), experts, 0) is None


def _plain_batch(rows: int, temperature: float, seed0: int = 0) -> SamplingBatch:
    specs = [SamplingSpec(temperature=temperature, max_new_tokens=8, seed=seed0 + i) for i in range(rows)]
    return SamplingBatch.make(specs, [i % 5 for i in range(rows)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
@pytest.mark.parametrize("vocab", [4096, 1003])  # 1003: a tail past the last 16-wide chunk
def test_native_sampler_draws_the_torch_paths_tokens(dtype, temperature, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = (3 * torch.randn(96, vocab, generator=g)).to(dtype)
    params = _plain_batch(96, temperature)
    got = sample_plain(logits, params.temperature, uniform(params.seed, params.draw_index), params.greedy)
    assert got is not None
    ref_tokens, ref_logprobs = sample_torch(logits, params)
    assert torch.equal(got[0], ref_tokens)
    assert got[1].dtype == torch.float32 and float((got[1] - ref_logprobs).abs().max()) < 1e-5
    tokens, _ = sample(logits, params)  # fast numerics: sample() takes the kernel
    assert torch.equal(tokens, ref_tokens)


def test_native_sampler_refuses_non_finite_rows_and_never_draws_a_masked_token():
    logits = torch.randn(5, 300)
    logits[0, 7] = float("nan")
    logits[1, 299] = float("inf")
    logits[2] = float("-inf")
    logits[3, :290] = float("-inf")  # only the last ten tokens (inside the scalar tail) are possible
    logits[4, 1::2] = float("-inf")
    params = _plain_batch(5, 1.0, seed0=11)
    tokens, logprobs = sample_plain(logits, params.temperature, uniform(params.seed, params.draw_index),
                                    params.greedy)
    assert tokens[:3].tolist() == [NO_TOKEN] * 3 and torch.isnan(logprobs[:3]).all()
    assert 290 <= int(tokens[3]) < 300 and int(tokens[4]) % 2 == 0
    ref_tokens, ref_logprobs = sample_torch(logits, params)
    assert torch.equal(tokens, ref_tokens)
    assert torch.allclose(logprobs[3:], ref_logprobs[3:], atol=1e-6)


def test_native_sampler_greedy_takes_the_first_of_tied_maxima():
    logits = torch.zeros(2, 64)
    logits[0, [5, 40]] = 2.0
    logits[1, [17, 33]] = 2.0
    params = _plain_batch(2, 0.0)
    tokens, logprobs = sample_plain(logits, params.temperature, uniform(params.seed, params.draw_index),
                                    params.greedy)
    assert tokens.tolist() == [5, 17]
    assert torch.allclose(logprobs, sample_torch(logits, params)[1], atol=1e-6)


def test_sampler_keeps_the_torch_path_where_the_kernel_must_not_apply():
    logits = torch.randn(4, 512)
    params = _plain_batch(4, 1.0)
    with numerics("reproducible"):  # float64 sums: the torch path, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(sample(logits, params), sample_torch(logits, params)))
    truncated = SamplingBatch.make([SamplingSpec(temperature=1.0, max_new_tokens=8, top_k=3, seed=i) for i in range(4)],
                                   [0] * 4)
    assert all(torch.equal(a, b) for a, b in zip(sample(logits, truncated), sample_torch(logits, truncated)))
    assert sample_plain(logits.half(), params.temperature, uniform(params.seed, params.draw_index),
                        params.greedy) is None


def _expanded_reference(q_nope, q_pe, rows, kv, k_pe, q_len, s_len, v, selected, scale):
    """float64 softmax attention of each request's q_len rows over its s_len keys (the rows are its
    last positions; a row sees keys up to its own, or its selection)."""
    h, nope = q_nope.shape[1], q_nope.shape[2]
    g = rows.numel() // q_len
    kv = kv.double().view(g, s_len, h, -1)
    k = torch.cat([kv[..., :nope], k_pe.double().view(g, s_len, 1, -1).expand(-1, -1, h, -1)], -1)
    q = torch.cat([q_nope, q_pe], -1)[rows].double().view(g, q_len, h, -1)
    logits = torch.einsum("gqhd,gshd->ghqs", q, k) * scale
    if selected is None:
        visible = torch.ones(q_len, s_len, dtype=torch.bool).tril(s_len - q_len)
    else:
        visible = selected[rows, :s_len].view(g, 1, q_len, s_len)
    p = logits.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("ghqs,gshd->gqhd", p, kv[..., nope:]).reshape(g * q_len, h, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len,s_len,dims,dsa", [
    (70, 70, (32, 16, 24), False),   # whole prompts: row tiles, key tiles of 32 and 16, a scalar value tail
    (20, 53, (64, 64, 64), False),   # a chunk after 33 earlier positions, the benchmark model's widths
    (9, 40, (48, 16, 32), True),     # DSA selection, one row seeing nothing
], ids=["prompts", "chunk", "dsa"])
def test_expanded_attention_equals_the_float64_reference(dtype, q_len, s_len, dims, dsa):
    nope, rope, v = dims
    h, groups, extra = 3, 2, 5  # extra batch rows that are no request's queries
    g = torch.Generator().manual_seed(q_len * 100 + s_len)
    n = groups * q_len + extra
    q_nope = torch.randn(n, h, nope, generator=g).to(dtype)
    q_pe = torch.randn(n, 2 * h, rope, generator=g).to(dtype)[:, ::2]  # a head stride the kernel follows
    rows = torch.randperm(n, generator=g)[: groups * q_len]
    kv = torch.randn(groups * s_len, h, nope + v, generator=g).to(dtype)
    k_pe = torch.randn(groups * s_len, rope, generator=g).to(dtype)
    selected = None
    if dsa:
        selected = torch.rand(n, s_len + 3, generator=g) < 0.4
        selected[rows[0]] = False
    scale = (nope + rope) ** -0.5
    out = expanded_attention(q_nope, q_pe, rows, kv, k_pe, q_len, s_len, v, selected, scale)
    ref = _expanded_reference(q_nope, q_pe, rows, kv, k_pe, q_len, s_len, v, selected, scale)
    assert out.shape == (groups * q_len, h, v) and out.dtype == dtype
    assert _rel(out, ref) < (2e-6 if dtype == torch.float32 else 1e-2)
    if dsa:
        assert not out[0].any()  # the row that selected nothing


def test_expanded_attention_declines_mixed_dtypes_and_autograd_and_refuses_a_short_selection():
    q = torch.randn(4, 2, 8)
    rows, kv, k_pe = torch.arange(4), torch.randn(4, 2, 16), torch.randn(4, 8)
    assert expanded_attention(q, q.bfloat16(), rows, kv, k_pe, 4, 4, 8, None, 0.1) is None
    assert expanded_attention(q.requires_grad_(), q, rows, kv, k_pe, 4, 4, 8, None, 0.1) is None
    with pytest.raises(ValueError, match="selected must be"):  # a selection narrower than the keys
        expanded_attention(q.detach(), q.detach(), rows, kv, k_pe, 4, 4, 8, torch.ones(4, 3, dtype=torch.bool), 0.1)
