"""The Triton attention backend against ``torch_ref`` on the CPU, under Triton's interpreter.

Pools are NaN-filled outside the written history, so a kernel that loads one key it must not see
(past a row's position, another request's page, a page another rank stores, the tail of a page)
returns NaN. Shapes are small (the interpreter runs each program instance in Python): page sizes
16 and 64, up to 4 heads, batches mixing decode rows and prefill chunks, float32 and float16.
"""
from __future__ import annotations

import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels run on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

import triton  # noqa: E402,F401  (the dev extra installs it; the CPU path without it is tested below)

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402
from splash_rollout.engine.attention import get_backend  # noqa: E402
from splash_rollout.engine.attention.triton_backend import TritonBackend, selected_slots  # noqa: E402
from splash_rollout.engine.forward_batch import ForwardBatch  # noqa: E402
from splash_rollout.engine.kv_pool import KVPool, KVPoolSpec  # noqa: E402
from splash_rollout.models.attention_math import indexer_select  # noqa: E402
from splash_rollout.models.config import PRESETS  # noqa: E402

R, ROPE, H = 16, 8, 3
# (history length after the step, rows this step): decode rows, a prefill chunk, a fresh prompt
REQUESTS = [(11, 1), (70, 1), (9, 4), (1, 1)]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def make_batch(seed: int, page: int, dtype: torch.dtype, stored_elsewhere: bool,
               requests=REQUESTS) -> tuple[KVPool, ForwardBatch]:
    """A NaN-filled pool with each request's history at scattered pages; with ``stored_elsewhere``
    every even logical page is -1 (another rank holds it, CP-style): requests shorter than one page
    see no key here."""
    g = torch.Generator().manual_seed(seed)
    spec = KVPoolSpec(kv_lora_rank=R, qk_rope_head_dim=ROPE, index_head_dims=(0,))
    num_pages = sum(-(-s // page) for s, _ in requests) + 2
    pool = KVPool(spec, num_pages=num_pages, page_size=page, dtype=dtype)
    pool.fill_(float("nan"))
    free = torch.randperm(num_pages, generator=g).tolist()
    items = []
    for s, n in requests:
        pages = [free.pop() for _ in range(-(-s // page))]
        if stored_elsewhere:
            pages = [-1 if i % 2 == 0 else p for i, p in enumerate(pages)]
        for pos in range(s):
            if pages[pos // page] >= 0:
                slot = torch.tensor([pages[pos // page] * page + pos % page])
                pool.write_kv(0, slot, torch.randn(1, R, generator=g), torch.randn(1, ROPE, generator=g))
        items.append((list(range(n)), s - n, n, pages, True))
    return pool, ForwardBatch.build(items, page_size=page)


def queries(batch: ForwardBatch, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch.num_tokens, H, R, generator=g).to(dtype),
            torch.randn(batch.num_tokens, H, ROPE, generator=g).to(dtype))


def assert_matches(out, lse, ref_out, ref_lse, tol):
    assert out.dtype == ref_out.dtype and lse.dtype == ref_lse.dtype and out.shape == ref_out.shape
    finite = torch.isfinite(ref_lse)  # a row that sees no key here has lse -inf and out 0
    assert not torch.isnan(out).any() and torch.equal(finite, torch.isfinite(lse))
    err = (out.float() - ref_out.float()).abs().max().item()
    assert err <= tol, err
    assert (lse[finite] - ref_lse[finite]).abs().max().item() <= tol
    assert torch.equal(out[~finite.all(-1)], torch.zeros_like(out[~finite.all(-1)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("topk", [None, 5], ids=["causal", "dsa-5"])
def test_matches_reference(dtype, page, topk):
    pool, batch = make_batch(0, page, dtype, stored_elsewhere=False)
    q, q_pe = queries(batch, dtype)
    selected = None if topk is None else indexer_select(
        torch.randn(batch.num_tokens, batch.max_seq_len, generator=torch.Generator().manual_seed(2)),
        batch.causal(), topk)
    ref = get_backend("torch_ref").forward(0, q, q_pe, pool, batch, selected, 0.3)
    got = TritonBackend(max_splits=3).forward(0, q, q_pe, pool, batch, selected, 0.3)
    assert_matches(*got, *ref, TOL[dtype])


@pytest.mark.parametrize("topk", [None, 6], ids=["causal", "dsa-6"])
def test_partial_lse_with_pages_elsewhere(topk):
    """CP: half the pages live on another rank; out and lse stay in float32 for the exact merge,
    and one split or several give the same answer."""
    pool, batch = make_batch(3, 16, torch.float32, stored_elsewhere=True)
    q, q_pe = queries(batch, torch.float32, seed=4)
    selected = None if topk is None else indexer_select(
        torch.randn(batch.num_tokens, batch.max_seq_len, generator=torch.Generator().manual_seed(5)),
        batch.causal(), topk)
    ref = get_backend("torch_ref").forward(0, q, q_pe, pool, batch, selected, 0.25, partial=True)
    for backend in (TritonBackend(max_splits=1), TritonBackend(max_splits=4)):
        got = backend.forward(0, q, q_pe, pool, batch, selected, 0.25, partial=True)
        assert_matches(*got, *ref, 2e-5)
    finite = torch.isfinite(ref[1]).all(-1)
    assert finite.any() and not finite.all()  # rows with keys here and rows with none


def test_selected_slots_mark_invalid_with_minus_one():
    pool, batch = make_batch(6, 16, torch.float32, stored_elsewhere=True)
    selected = batch.causal()  # everything visible; pages elsewhere must come out as -1
    slots = selected_slots(batch, selected)
    assert slots.dtype == torch.int32 and slots.shape[0] == batch.num_tokens
    stored = batch.key_stored().index_select(0, batch.row_seq) & selected
    assert torch.equal((slots >= 0).sum(1), stored.sum(1))
    assert torch.isfinite(pool.kv[0].view(-1, R + ROPE)[slots[slots >= 0].long()]).all()


def test_registry_builds_it_and_bad_settings_are_named():
    assert get_backend("triton").name == "triton"
    with pytest.raises(ValueError, match="block_n"):
        TritonBackend(block_n=24)
    with pytest.raises(ValueError, match="max_splits"):
        TritonBackend(max_splits=0)


def test_cpu_path_complete_without_triton():
    """With triton unimportable the package, the registry and the torch backends still work, and
    asking for the triton backend names the install command."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "from splash_rollout.engine.attention import available_backends, get_backend\n"
            "assert 'triton' in available_backends() and get_backend('torch').name == 'torch'\n"
            "try:\n    get_backend('triton')\nexcept ImportError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert "pip install triton" in done.stdout


def test_split_count_fills_the_gpu_without_empty_ranges():
    backend = TritonBackend(max_splits=16, block_h=16, block_n=16)
    assert backend.num_splits(rows=1, heads=16, max_keys=4096) == 16
    assert backend.num_splits(rows=1, heads=16, max_keys=20) == 2  # never more ranges than key blocks
    assert backend.num_splits(rows=256, heads=16, max_keys=4096) == 2
    assert backend.num_splits(rows=1024, heads=128, max_keys=4096) == 1


TINY_GLM = PRESETS["glm5-nano"].replace(
    name="tiny-glm-triton", hidden_size=64, num_layers=2, num_heads=4, q_lora_rank=32, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128, moe_intermediate_size=32,
    n_routed_experts=4, num_experts_per_tok=2, index_n_heads=4, index_head_dim=16, index_topk=8,
    indexer_types=("full", "shared"), max_position_embeddings=128)


@pytest.mark.parametrize("model", [TINY_GLM, "deepseek-v3"], ids=["dsa", "dense"])
def test_engine_greedy_tokens_equal_reference_backend(model):
    """A whole engine (prefill then decode, T = 1, NaN-filled pool) samples the same greedy tokens
    and logprobs with the Triton kernels as with the reference backend."""
    if model == "deepseek-v3":
        model = PRESETS["deepseek-v3"].replace(
            name="tiny-dsv3-triton", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, q_lora_rank=32,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
            moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
            topk_group=1, first_k_dense_replace=1, rope_scaling=None, max_position_embeddings=128)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, model.vocab_size, (n,), generator=g).tolist() for n in (3, 12, 21)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    results = {}
    for backend in ("torch_ref", "triton"):
        with RolloutEngine(EngineConfig(model=model, dtype="float32", page_size=16, num_pages=16,
                                        attention_backend=backend)) as eng:
            assert eng.local_engine.state.backend.name == backend
            eng.local_engine.state.pool.fill_(float("nan"))
            out = eng.generate(prompts, sampling)
        results[backend] = [(s.response_ids, s.response_logprobs) for s in out.samples]
    for (ids, lps), (ref_ids, ref_lps) in zip(results["triton"], results["torch_ref"]):
        assert ids == ref_ids
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_indexer_logits_equal_the_executor_scores(dtype):
    """The indexer kernel against the torch path the single-rank executor runs, over a NaN-filled
    indexer cache: equal at every stored position, 0 (not NaN) where nothing is stored."""
    from splash_rollout.engine.executors.single import index_scores

    g = torch.Generator().manual_seed(7)
    d, hi, page = 16, 4, 16
    requests = [(11, 1), (40, 1), (9, 4), (23, 1)]
    num_pages = sum(-(-s // page) for s, _ in requests) + 2
    pool = KVPool(KVPoolSpec(R, ROPE, (d,)), num_pages, page, dtype=dtype)
    pool.fill_(float("nan"))
    free = torch.randperm(num_pages, generator=g).tolist()
    items = []
    for s, n in requests:
        pages = [free.pop() for _ in range(-(-s // page))]
        pages = [-1 if len(pages) > 2 and i == 1 else p for i, p in enumerate(pages)]  # one page elsewhere
        for pos in range(s):
            if pages[pos // page] >= 0:
                pool.write_index_k(0, torch.tensor([pages[pos // page] * page + pos % page]), torch.randn(1, d, generator=g))
        items.append((list(range(n)), s - n, n, pages, True))
    batch = ForwardBatch.build(items, page_size=page)
    index_q = torch.randn(batch.num_tokens, hi, d, generator=g).to(dtype)
    index_w = torch.randn(batch.num_tokens, hi, generator=g)
    got = TritonBackend().index_scores(pool, 0, index_q, index_w, batch)
    want = index_scores(pool, 0, index_q, index_w, batch)
    stored = batch.key_stored().index_select(0, batch.row_seq)  # [N, S]
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.allclose(got[stored], want[stored], atol=1e-4, rtol=1e-5 if dtype == torch.float32 else 1e-3)
    assert torch.equal(got[~stored], torch.zeros_like(got[~stored])) and (~stored).any()
