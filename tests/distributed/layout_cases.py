"""Shared cases for the multi-rank layout tests: models, a mixed batch, and the runs on each side."""
from __future__ import annotations

import torch

from splash_rollout.scheduling.admission import AdmissionSettings
from splash_rollout.engine.rank_engine import Engine
from splash_rollout.rollout.build import engine_settings
from splash_rollout.rollout.config import EngineConfig
from splash_rollout.engine.request import Request, SamplingSpec
from splash_rollout.engine.request_scheduler import Scheduler
from splash_rollout.models.config import PRESETS
from splash_rollout.models.model import MLAForCausalLM

# glm5-nano with a small top-k so DSA really selects on these prompts; a DeepSeek-V3-shaped tiny model.
MODELS = {
    "glm5-nano": PRESETS["glm5-nano"].replace(index_topk=24),
    "tiny-v3": PRESETS["deepseek-v3"].replace(
        name="tiny-v3", vocab_size=512, hidden_size=128, num_layers=3, num_heads=8, q_lora_rank=64,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, intermediate_size=256,
        moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=4096,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
}
PROMPT_LENS = [1, 300, 17, 64, 5, 129, 33, 250, 2, 90]
PAGE_SIZE = 8
TOKEN_BUDGET = 96  # smaller than the longest prompt: chunked prefill


def make_requests(model: str, new_tokens: int = 6, temperature: float = 0.0) -> list[Request]:
    cfg = MODELS[model]
    g = torch.Generator().manual_seed(7)
    reqs = []
    for i, n in enumerate(PROMPT_LENS):
        ids = torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()
        spec = SamplingSpec(temperature=temperature, top_p=0.9 if temperature else 1.0,
                            max_new_tokens=new_tokens + i % 3, ignore_eos=True, seed=1000 + i)
        reqs.append(Request(i, ids, spec, cfg.max_position_embeddings, cfg.eos_token_ids))
    return reqs


def outputs(finished: list[Request]) -> dict[int, tuple[list[int], list[float]]]:
    return {r.request_id: (list(r.output_ids), list(r.output_logprobs)) for r in finished}


def single_rank(model: str, temperature: float = 0.0) -> dict:
    cfg = MODELS[model]
    engine = Engine.single(MLAForCausalLM.from_config(cfg, seed=3).eval(), cfg,
                           engine_settings(EngineConfig(model=cfg, memory=dict(num_pages=512, page_size=PAGE_SIZE),
                                                        batching=dict(max_num_batched_tokens=TOKEN_BUDGET),
                                                        compute=dict(speculation="off"))))
    return outputs(engine.serve(make_requests(model, temperature=temperature)))


def build_group_engine(ctx, model: str, layout: str, num_pages: int = 512, budget_bytes: int | None = None,
                       switch_schedule: dict[int, str] | None = None, attention_backend: str = "torch",
                       memory: dict | None = None, feed_forward: str = "sharded"):
    """Every rank: an engine of ``model`` in ``layout`` over the group; a memory budget of
    ``budget_bytes`` per rank (pages per layout) or ``num_pages``; ``memory``: more memory fields."""
    cfg = MODELS[model]
    torch.set_flush_denormal(True)
    pool = ({"memory_budget_gib": budget_bytes / 2**30} if budget_bytes is not None else {"num_pages": num_pages})
    config = EngineConfig(model=cfg, parallel=dict(world_size=ctx.world_size, layout=layout,
                                                   switch_schedule=switch_schedule, feed_forward=feed_forward),
                          memory=dict(page_size=PAGE_SIZE, **pool, **(memory or {})),
                          batching=dict(max_num_batched_tokens=TOKEN_BUDGET, max_num_seqs=64),
                          compute=dict(attention_backend=attention_backend, speculation="off"))
    return Engine(MLAForCausalLM.from_config(cfg, seed=3).eval(), cfg, ctx.groups, engine_settings(config))


def run_layout(ctx, model: str, layout: str, temperature: float = 0.0, attention_backend: str = "torch"):
    """On every rank: a fresh engine in ``layout`` serves the mixed batch; rank 0 returns outputs."""
    engine = build_group_engine(ctx, model, layout, attention_backend=attention_backend)
    finished = engine.serve(make_requests(model, temperature=temperature))
    pages_left = engine.scheduler.placement.pages_in_use if ctx.rank == 0 else None
    return (outputs(finished), pages_left) if ctx.rank == 0 else None


def memory_report(ctx, model: str, layout: str, budget_bytes: int):
    """Per rank: bytes read from the tensors, the pool in tokens, and how many long requests are
    admitted at once under a per-rank budget."""
    engine = build_group_engine(ctx, model, layout, budget_bytes=budget_bytes)
    report = dict(engine.resident_bytes(), pool_tokens=engine.state.pool.num_slots,
                  weights=engine.memory_stats()["weights"])
    if ctx.rank == 0:
        cfg = MODELS[model]
        long = [Request(i, [5] * 500, SamplingSpec(max_new_tokens=200, seed=i), cfg.max_position_embeddings)
                for i in range(64)]
        placement = engine.scheduler.placement
        held = Scheduler(placement, 10**6, 10**6, admission=AdmissionSettings(mode="worst_case"), prefix_sharing=False)
        for r in long:
            held.add(r)
        held.schedule()  # one step's admissions, each holding its whole cap
        report["admitted"] = len(held.running)
        report["pool_tokens_by_rank"] = [m.num_pages * PAGE_SIZE for m in placement.managers]
        held.abort_all()
    return report


def run_switch(ctx, model: str, src: str, dst: str, at_steps: list[int], blocking: bool = False,
               budget_bytes: int | None = None):
    """Serve the mixed batch starting in ``src`` and switching at the given steps (alternating
    dst, src, dst, ...). Returns, per rank, the switch bytes counted by the wrappers; rank 0 adds
    the outputs, the switch log and the pages left in use."""
    layouts = [dst, src] * len(at_steps)
    engine = build_group_engine(ctx, model, src, budget_bytes=budget_bytes, switch_schedule=dict(zip(at_steps, layouts)))
    finished = engine.serve(make_requests(model))
    counted = engine.comm.counter
    mine = {"sent": counted.total("switch/")[0], "received": counted.total("switch/")[1],
            "shards": [tuple(t.clone() for t in s.tensors().values()) for s in engine.state.shards]}
    if ctx.rank:
        return mine
    return dict(mine, outputs=outputs(finished), log=engine.switch_log,
                pages_left=engine.scheduler.placement.pages_in_use)


def kv_snapshot(engine) -> dict:
    """Every rank: {(request_id, position): KV row (all layers, + indexer keys)} for what it stores.
    Every rank's scheduler replica holds the page tables of the running requests."""
    tables = {r.request_id: (r.rank_pages, r.num_computed_tokens) for r in engine.scheduler.running}
    pool, ps, out = engine.state.pool, engine.page_size, {}
    for rid, (rank_pages, n) in tables.items():
        for pos in range(n):
            page = rank_pages[engine.rank][pos // ps]
            if page < 0:
                continue
            slot = page * ps + pos % ps
            rows = [pool.kv[i].view(-1, pool.kv[i].shape[-1])[slot] for i in range(len(pool.kv))]
            rows += [k.view(-1, k.shape[-1])[slot] for k in pool.index_k if k is not None]
            out[(rid, pos)] = torch.cat(rows).clone()
    return out


def round_trip(ctx, model: str, a: str, b: str):
    """A for 3 steps, one step in B, one back in A: KV of the positions that existed before and the
    projection shards must be bit-identical to what A held."""
    engine = build_group_engine(ctx, model, a)
    engine.serve(make_requests(model), max_steps=3)
    before_kv = kv_snapshot(engine)
    before_shards = [tuple(t.clone() for t in s.tensors().values()) for s in engine.state.shards]
    for layout in (b, a):
        engine.request_switch(layout)
        engine.serve(None, max_steps=1)
    after_kv = kv_snapshot(engine)
    after_shards = [tuple(s.tensors().values()) for s in engine.state.shards]
    same_kv = all(k in after_kv and torch.equal(v, after_kv[k]) for k, v in before_kv.items())
    same_shards = all(torch.equal(x, y) for p, q in zip(before_shards, after_shards) for x, y in zip(p, q))
    engine.serve(None)  # finish the batch
    return len(before_kv), same_kv, same_shards


def deferred_switch(ctx, model: str, src: str, dst: str, num_pages: int):
    """A switch into a layout whose pools cannot hold the running batch is deferred with a reason;
    serving goes on in the source layout and nothing is lost."""
    engine = build_group_engine(ctx, model, src, num_pages=num_pages, switch_schedule={6: dst})
    finished = engine.serve(make_requests(model))
    if ctx.rank:
        return None
    return outputs(finished), engine.switch_log, engine.scheduler.placement.pages_in_use


def run_schedule(ctx, model: str, start: str, schedule: dict[int, str]):
    """Serve the mixed batch from ``start`` with an arbitrary {step: layout} switch schedule."""
    engine = build_group_engine(ctx, model, start, switch_schedule=schedule)
    finished = engine.serve(make_requests(model))
    if ctx.rank:
        return None
    return outputs(finished), engine.switch_log, engine.scheduler.placement.pages_in_use
