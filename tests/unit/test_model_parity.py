"""MLAForCausalLM against transformers' own classes on tiny random checkpoints (float32, ≤1e-4),
plus the attention-math pieces the engine shares with the training forward."""
from __future__ import annotations

import math

import pytest
import torch

from splash_rollout.models.attention_math import (absorbed_attention, indexer_scores, indexer_select,
                                                   merge_partial_attention)
from splash_rollout.models.config import PRESETS, ModelConfig
from splash_rollout.models.model import MLAForCausalLM
from tests.hf_tiny import save_hf_checkpoint

SEQ = 40
TOPK = 16  # < SEQ so the indexer really drops keys
BASE = dict(name="tiny", vocab_size=97, hidden_size=64, num_layers=3, num_heads=4, q_lora_rank=32,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=96,
            moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=128)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}

CONFIGS = {
    "deepseek_v3": ModelConfig(model_type="deepseek_v3", **BASE),
    "deepseek_v3_yarn_grouped": ModelConfig(model_type="deepseek_v3", **{**BASE, "max_position_embeddings": 64},
                                            n_group=4, topk_group=2, rope_scaling=YARN),
    "deepseek_v3_no_q_lora_half_rope": ModelConfig(model_type="deepseek_v3", **{**BASE, "q_lora_rank": None,
                                                   "n_shared_experts": 2}, rope_interleave=False),
    "deepseek_v32": ModelConfig(model_type="deepseek_v32", **BASE, index_n_heads=4, index_head_dim=16,
                                index_topk=TOPK),
    "glm_moe_dsa_shared": ModelConfig(model_type="glm_moe_dsa", **{**BASE, "num_layers": 4}, index_n_heads=4,
                                      index_head_dim=32, index_topk=TOPK, rms_norm_eps=1e-5,
                                      indexer_types=("full", "shared", "full", "shared")),
    "glm5_nano": PRESETS["glm5-nano"].replace(index_topk=TOPK),
}
MEASURED: dict[str, float] = {}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    cfg = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf_checkpoint(cfg, path, seed=1)
    return request.param, hf, MLAForCausalLM.from_pretrained(path)


def _batch(vocab: int):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2, SEQ), generator=gen)
    mask = torch.ones(2, SEQ, dtype=torch.bool)
    mask[1, 29:] = False  # right padding
    return ids, mask


def test_logits_match_transformers(pair):
    """DSA configs use tie_break="torch" here: transformers' own top-k choice among exact ties (the
    default "position" rule differs only where the k-th and (k+1)-th scores tie, see below)."""
    name, hf, ours = pair
    ours.set_indexer_tie_break("torch")
    ids, mask = _batch(ours.config.vocab_size)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask.long()).logits
        got = ours(ids, mask)
        ref1 = hf(input_ids=ids[:1]).logits  # no mask at all
        got1 = ours(ids[:1])
    diff = max((ref - got)[mask].abs().max().item(), (ref1 - got1).abs().max().item())
    MEASURED[name] = diff
    print(f"\n{name}: max |logits diff| = {diff:.2e}")
    assert ref.abs().max() > 1.0  # non-degenerate weights
    assert diff <= 1e-4


def test_position_tie_break_ignores_row_length():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 30, generator=gen).clamp(min=0)  # many exact-zero ties, as after the ReLU
    allowed = torch.rand(6, 30, generator=gen) > 0.2
    sel = indexer_select(scores, allowed, topk=8)
    assert (sel.sum(-1) == torch.minimum(allowed.sum(-1), torch.tensor(8))).all()
    # extra disallowed columns (longer padded rows) and a permutation-free crop change nothing
    wide = indexer_select(torch.cat([scores, torch.randn(6, 50, generator=gen)], 1),
                          torch.cat([allowed, torch.zeros(6, 50, dtype=torch.bool)], 1), topk=8)
    assert torch.equal(wide[:, :30], sel) and not wide[:, 30:].any()
    last = int(allowed.nonzero()[:, 1].max()) + 1
    assert torch.equal(indexer_select(scores[:, :last], allowed[:, :last], topk=8), sel[:, :last])
    # among equal scores the earlier position wins
    tie = indexer_select(torch.zeros(1, 5), torch.ones(1, 5, dtype=torch.bool), topk=2)
    assert tie.tolist() == [[True, True, False, False, False]]


def test_indexer_really_selects():
    cfg = CONFIGS["glm_moe_dsa_shared"]
    model = MLAForCausalLM.from_config(cfg, seed=0)
    attn = model.model.layers[0].self_attn
    assert attn.indexer is not None and not attn.uses_shared_topk
    assert model.model.layers[1].self_attn.indexer is None and model.model.layers[1].self_attn.uses_shared_topk
    hidden = torch.randn(1, SEQ, cfg.hidden_size)
    allowed = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None]
    _, selected = attn(hidden, torch.arange(SEQ), allowed, None)
    per_row = selected[0].sum(-1)
    assert torch.equal(per_row, torch.clamp(torch.arange(1, SEQ + 1), max=TOPK))
    assert not (selected & ~allowed).any()


def _step_by_step_logits(model: MLAForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Decode one token at a time through the engine-facing pieces with a latent cache."""
    cfg = model.config
    cache = [dict(c_kv=[], k_pe=[], index_k=[]) for _ in model.model.layers]
    logits = []
    for t in range(ids.shape[0]):
        pos = torch.tensor([t])
        hidden = model.model.embed_tokens(ids[t:t + 1])
        selected = None
        for layer, kv in zip(model.model.layers, cache):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q_nope, q_pe, q_a = attn.project_q(x, pos)
            c_kv, k_pe = attn.project_kv(x, pos)
            kv["c_kv"].append(c_kv), kv["k_pe"].append(k_pe)
            allowed = torch.ones(1, t + 1, dtype=torch.bool)
            if attn.indexer is not None:
                kv["index_k"].append(attn.indexer.index_k(x, pos))
                iq, iw = attn.indexer.index_q(x, q_a, pos)
                selected = indexer_select(indexer_scores(iq, iw, torch.cat(kv["index_k"])), allowed, cfg.index_topk)
            mask = selected if selected is not None else allowed
            q_abs = torch.einsum("nhd,hdr->nhr", q_nope, attn.w_uk())
            out, _ = absorbed_attention(q_abs, q_pe, torch.cat(kv["c_kv"]), torch.cat(kv["k_pe"]), mask,
                                        attn.softmax_scale)
            v = torch.einsum("nhr,hrv->nhv", out, attn.w_uv()).reshape(1, -1)
            hidden = hidden + attn.o_proj(v)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits.append(model.compute_logits(hidden))
    return torch.cat(logits)


@pytest.mark.parametrize("name", ["deepseek_v3_yarn_grouped", "glm_moe_dsa_shared"])
def test_engine_pieces_decode_matches_forward(name):
    model = MLAForCausalLM.from_config(CONFIGS[name], seed=3)
    with torch.no_grad():
        for p in model.parameters():  # larger weights so attention and routing are not uniform
            p.mul_(20.0) if p.dim() > 1 else None
        ids = torch.randint(3, model.config.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(1))
        full = model(ids[None])[0]
        steps = _step_by_step_logits(model, ids)
    assert (full - steps).abs().max() <= 1e-4


def test_absorbed_attention_matches_naive_and_lse():
    gen = torch.Generator().manual_seed(0)
    n, h, r, p, s = 5, 3, 8, 4, 7
    q, qp = torch.randn(n, h, r, generator=gen), torch.randn(n, h, p, generator=gen)
    c, kp = torch.randn(s, r, generator=gen), torch.randn(s, p, generator=gen)
    allowed = torch.rand(n, s, generator=gen) > 0.3
    allowed[2] = False  # a row with no key
    out, lse = absorbed_attention(q, qp, c, kp, allowed, 0.37)
    logits = 0.37 * (torch.einsum("nhr,sr->nhs", q, c) + torch.einsum("nhp,sp->nhs", qp, kp))
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    ok = allowed.any(-1)
    ref = torch.softmax(logits[ok], -1) @ c
    assert torch.allclose(out[ok], ref, atol=1e-6)
    assert torch.allclose(lse[ok], torch.logsumexp(logits[ok], -1), atol=1e-6)
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
    # exact merge over a split of the keys (one part empty for some rows)
    part = torch.zeros(s, dtype=torch.bool)
    part[:3] = True
    o1, l1 = absorbed_attention(q, qp, c, kp, allowed & part, 0.37)
    o2, l2 = absorbed_attention(q, qp, c, kp, allowed & ~part, 0.37)
    merged = merge_partial_attention([o1, o2], [l1, l2])
    assert torch.allclose(merged, out, atol=1e-6) and (merged[2] == 0).all()


def test_indexer_select_takes_all_when_fewer_allowed():
    scores = torch.randn(4, 10)
    allowed = torch.ones(4, 10, dtype=torch.bool).tril()
    sel = indexer_select(scores, allowed, topk=3)
    assert torch.equal(sel.sum(-1), torch.tensor([1, 2, 3, 3]))
    assert not (sel & ~allowed).any()
    top = scores.masked_fill(~allowed, -math.inf).topk(3, -1).indices[3]
    assert sel[3, top].all()


def test_indexer_select_equals_a_stable_descending_sort_under_ties():
    """The O(N·S) threshold selection is the position tie-break rule exactly: scores drawn from four
    values (ties everywhere), random allowed sets, k from 1 to past S."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(300):
        n, s = (int(x) for x in torch.randint(1, 24, (2,), generator=gen))
        k = int(torch.randint(1, s + 3, (1,), generator=gen))
        scores = torch.randint(0, 4, (n, s), generator=gen).float()
        allowed = torch.rand(n, s, generator=gen) < 0.7
        order = scores.masked_fill(~allowed, -math.inf).sort(dim=-1, descending=True, stable=True).indices
        ref = torch.zeros(n, s, dtype=torch.bool).scatter_(1, order[:, :min(k, s)], True) & allowed
        assert torch.equal(indexer_select(scores, allowed, k), ref)


def test_sparse_attention_over_a_top_k_selection_equals_dense():
    """A top-k selection over a long history takes the gathered path; it equals the dense masked
    form and does not change with padding keys appended after the history."""
    gen = torch.Generator().manual_seed(4)
    n, h, r, p, s, k = 40, 4, 16, 8, 300, 32
    q, qp = torch.randn(n, h, r, generator=gen), torch.randn(n, h, p, generator=gen)
    c, kp = torch.randn(s, r, generator=gen), torch.randn(s, p, generator=gen)
    causal = torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]
    sel = indexer_select(torch.randn(n, s, generator=gen), causal, k)
    sel[0] = False  # an empty row
    out, lse = absorbed_attention(q, qp, c, kp, sel, 0.2)
    logits = 0.2 * (torch.einsum("nhr,sr->nhs", q, c) + torch.einsum("nhp,sp->nhs", qp, kp))
    logits = logits.masked_fill(~sel[:, None], -math.inf)
    assert torch.allclose(out[1:], torch.softmax(logits[1:], -1) @ c, atol=1e-5)
    assert torch.allclose(lse[1:], torch.logsumexp(logits[1:], -1), atol=1e-5)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    pad = torch.cat([sel, torch.zeros(n, 50, dtype=torch.bool)], 1)
    out_pad, lse_pad = absorbed_attention(q, qp, torch.cat([c, torch.randn(50, r)]), torch.cat([kp, torch.randn(50, p)]),
                                          pad, 0.2)
    assert torch.equal(out_pad, out) and torch.equal(lse_pad, lse)


def test_random_init_is_seeded():
    cfg = CONFIGS["glm_moe_dsa_shared"]
    a = MLAForCausalLM.from_config(cfg, seed=7).state_dict()
    b = MLAForCausalLM.from_config(cfg, seed=7).state_dict()
    c = MLAForCausalLM.from_config(cfg, seed=8).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert (a["model.layers.1.mlp.gate.e_score_correction_bias"] == 0).all()
    assert (a["model.layers.0.input_layernorm.weight"] == 1).all()
    w = a["model.layers.0.self_attn.q_b_proj.weight"]
    assert 0.015 < w.std().item() < 0.025


def test_bf16_runs_and_tracks_fp32():
    cfg = CONFIGS["glm_moe_dsa_shared"]
    fp32 = MLAForCausalLM.from_config(cfg, seed=0)
    bf16 = MLAForCausalLM.from_config(cfg, seed=0, dtype=torch.bfloat16)
    assert bf16.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert bf16.model.layers[1].self_attn.q_b_proj.weight.dtype == torch.bfloat16
    ids, mask = _batch(cfg.vocab_size)
    with torch.no_grad():
        a, b = fp32(ids, mask), bf16(ids, mask)
    assert b.dtype == torch.bfloat16 and torch.isfinite(b).all()
    assert (a - b.float())[mask].abs().max() < 0.1 * a.abs().max() + 0.05


def test_training_forward_backprops():
    cfg = CONFIGS["glm_moe_dsa_shared"]
    model = MLAForCausalLM.from_config(cfg, seed=0)
    ids, mask = _batch(cfg.vocab_size)
    logits = model(ids, mask)
    loss = torch.nn.functional.cross_entropy(logits[mask][:-1], ids[mask][1:])
    loss.backward()
    for name in ("model.layers.0.self_attn.q_b_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight",
                 "model.layers.2.mlp.experts.0.down_proj.weight", "model.embed_tokens.weight", "lm_head.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_tied_embeddings_round_trip(tmp_path):
    from splash_rollout.models.weights import save_checkpoint

    cfg = CONFIGS["deepseek_v3"].replace(tie_word_embeddings=True)
    model = MLAForCausalLM.from_config(cfg, seed=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_checkpoint(model, tmp_path)
    again = MLAForCausalLM.from_pretrained(tmp_path)
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
