"""Draft quality offline: record a trained policy's rollouts once, replay drafters on them.

Verification is seed-exact: whatever is drafted, a sample writes the tokens it writes without
speculation, and a draft keeps exactly its common prefix with them. So a drafter can be judged
without the engine. The long-tail calls of ``benchmarks/speculative.py`` (``--calls`` calls of
8 prompts x 8 samples, temperature 1) run once with speculation off (their tokens and step log)
and once with ``always`` (its step log: what a drafted step costs). Then each drafter is replayed:
every request of a call steps together; each step every running request proposes (with
``SuffixDrafter`` as the engine builds it, or a variant), keeps the common prefix of its draft and
its recorded continuation plus one token, and the drafter observes what was kept. Step seconds come
from lines fitted to the recorded steps (fixed + per row, plain and drafted apart).

The policy's MTP module (when the policy carries one: the recipe trains it beside the policy) drafts
as an engine would (``MTPDrafter``): the first draft from the decoder's state and the last verified
token, later ones chained from the module's own state, each either the module's argmax or --
``coupled`` -- the engine sampler's draw from the module's distribution with the sample's own
uniform for that token, which is kept whenever the two distributions put that uniform on the same
token. Drafting's own cost is each chained pass: the module's layer, its norm and the head over one
new row per drafting request, timed here.

An argmax oracle drafts the policy's own most likely token at every position: its kept prefix is the
run of positions where the sampled token was the argmax (the model run over the recorded
sequences). It bounds argmax drafts, not coupled ones: drawn from the policy's own distribution with
the sample's uniform, a draft is the sampled token every time. Per drafter: target steps, drafted
tokens kept per drafted token, ``acceptance_len`` (tokens a verified request yields), the kept share
per draft position, and the estimated wall and tail (batch <= 1/8 of its peak) ratios against no
speculation.

    python benchmarks/draft_replay.py --policy P --json docs/results/draft_replay.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TAIL_FRACTION = 0.125


@dataclasses.dataclass
class Replayed:
    """A recorded sample replayed: the drafter sees ``output_ids`` grow toward ``truth``."""

    request_id: int
    prompt_ids: list[int]
    truth: list[int]
    output_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def prefix_key(self) -> tuple[int, ...]:
        return tuple(self.prompt_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Seconds of a step: ``fixed + per_row * rows``, plain and drafted steps fitted apart."""

    plain: tuple[float, float]
    drafted: tuple[float, float]

    def seconds(self, rows: int, drafted: bool) -> float:
        fixed, per_row = self.drafted if drafted else self.plain
        return fixed + per_row * rows

    @staticmethod
    def fit(steps: list, drafted: bool) -> tuple[float, float]:
        """Least squares over the decode steps (no prompt rows) of a step log."""
        pts = [(s.rows, s.seconds) for s in steps if not s.prefill_rows and (s.draft_tokens > 0) == drafted]
        rows, secs = np.array(pts, dtype=np.float64).T
        per_row, fixed = np.polyfit(rows, secs, 1)
        return float(fixed), float(per_row)


def replay(calls: list[list[dict]], propose, observe, finished, cost: StepCost, cap: int = 8,
           draft_seconds=None, projected_draft_seconds=None) -> dict:
    """Step every call's samples together under a drafter (``propose(request, room) -> draft``).
    ``draft_seconds(requests drafting, longest draft, rows)``: what drafting itself costs a step (a
    draft model's passes; None: nothing, as for the n-gram index); ``projected_draft_seconds``: the
    same priced another way, reported apart (``est_*_projected``)."""
    tot = dict(steps=0, steps_off=0, drafted=0, kept=0, verified=0, seconds=0.0, seconds_off=0.0, tail=0.0,
               tail_off=0.0, seconds_proj=0.0, tail_proj=0.0)
    reached, accepted = [0] * cap, [0] * cap
    """Per draft position j (0-based): verifications whose drafts 0..j-1 were all kept, and of those
    the ones that kept draft j as well."""
    rid = 0
    for call in calls:
        reqs = [Replayed(rid + i, s["prompt"], s["response"]) for i, s in enumerate(call)]
        rid += len(reqs)
        peak, lengths = len(reqs), [len(r.truth) for r in reqs]
        for t in range(max(lengths)):
            running = sum(n > t for n in lengths)
            sec = cost.seconds(running, False)
            tot["steps_off"] += 1
            tot["seconds_off"] += sec
            tot["tail_off"] += sec if running <= TAIL_FRACTION * peak else 0.0
        running = [r for r in reqs if r.truth]
        while running:
            drafts = {}
            for r in running:
                room = min(cap, len(r.truth) - len(r.output_ids) - 1)
                drafts[r.request_id] = tuple(propose(r, room)) if room > 0 else ()
            rows = sum(1 + len(d) for d in drafts.values())
            sec = proj = cost.seconds(rows, any(drafts.values()))
            if any(drafts.values()):
                drafting, longest = sum(bool(d) for d in drafts.values()), max(len(d) for d in drafts.values())
                sec += draft_seconds(drafting, longest, running) if draft_seconds is not None else 0.0
                proj += projected_draft_seconds(drafting, longest, running) if projected_draft_seconds else 0.0
            tail = len(running) <= TAIL_FRACTION * peak
            tot["steps"] += 1
            tot["seconds"] += sec
            tot["tail"] += sec if tail else 0.0
            tot["seconds_proj"] += proj
            tot["tail_proj"] += proj if tail else 0.0
            still = []
            for r in running:
                draft, at = drafts[r.request_id], len(r.output_ids)
                kept = 0
                while kept < len(draft) and r.truth[at + kept] == draft[kept]:
                    kept += 1
                r.output_ids = r.truth[: at + kept + 1]
                observe(r, len(draft), kept)
                for j in range(min(kept + 1, len(draft))):
                    reached[j] += 1
                    accepted[j] += j < kept
                tot["drafted"] += len(draft)
                tot["kept"] += kept
                tot["verified"] += bool(draft)
                if len(r.output_ids) < len(r.truth):
                    still.append(r)
                else:
                    finished(r)
            running = still
    return {"target_steps": tot["steps"], "target_steps_off": tot["steps_off"],
            "kept_per_drafted": tot["kept"] / max(1, tot["drafted"]),
            "acceptance_len": (tot["kept"] + tot["verified"]) / max(1, tot["verified"]),
            "est_wall_ratio": tot["seconds_off"] / tot["seconds"],
            "est_tail_ratio": tot["tail_off"] / max(1e-12, tot["tail"]),
            **({"est_wall_ratio_projected": tot["seconds_off"] / tot["seconds_proj"],
                "est_tail_ratio_projected": tot["tail_off"] / max(1e-12, tot["tail_proj"])}
               if projected_draft_seconds is not None else {}),
            "accept_by_position": [a / r for a, r in zip(accepted, reached) if r]}


def argmax_flags(calls: list[list[dict]], weights: dict, config) -> dict[tuple[int, int], list[bool]]:
    """(call, sample) -> per response position: was the sampled token the policy's argmax there."""
    import torch

    from splash_rollout.models.model import MLAForCausalLM

    model = MLAForCausalLM(config)
    model.load_state_dict(weights, strict=False)
    model.eval()
    flags = {}
    with torch.no_grad():
        for c, call in enumerate(calls):
            for i, s in enumerate(call):
                ids = torch.tensor([s["prompt"] + s["response"]])
                p = len(s["prompt"])
                best = model(ids)[0].argmax(-1)[p - 1: p - 1 + len(s["response"])].tolist()
                flags[(c, i)] = [a == t for a, t in zip(best, s["response"])]
    return flags


def policy_model(weights: dict):
    """The recipe's model holding ``weights`` (with its MTP module when they carry one)."""
    from splash_rollout.models.config import PRESETS
    from splash_rollout.models.model import MLAForCausalLM

    has_mtp = any(n.startswith("model.mtp_layers.") for n in weights)
    model = MLAForCausalLM(PRESETS["glm5-nano"].replace(num_mtp_layers=1 if has_mtp else 0))
    model.load_state_dict(weights, strict=True)
    return model.eval()


def mtp_pass_seconds(model, repeats: int = 30) -> tuple[float, float]:
    """(fixed, per row) seconds of one chained MTP pass -- the module's layer, its norm and the LM head
    over one new row per drafting request -- timed here at 1 to 32 rows and fitted: what each drafted
    position costs a step beyond its verified row."""
    import torch

    layer, head = model.model.mtp_layers[0], model.lm_head.weight
    points = []
    with torch.no_grad():
        for rows in (1, 4, 16, 32):
            x = torch.randn(rows, 1, model.config.hidden_size)
            allowed = torch.ones(rows, 1, 1, dtype=torch.bool)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                layer.head_logits(layer(x, torch.arange(1), allowed, None)[0], head)
                times.append(time.perf_counter() - t0)
            points.append((rows, min(times)))
    rows, secs = np.array(points, dtype=np.float64).T
    per_row, fixed = np.polyfit(rows, secs, 1)
    return float(fixed), float(per_row)


class OracleDrafter:
    """Drafts the policy's argmax: kept up to the first position where the sample was not it."""

    def __init__(self, calls: list[list[dict]], flags: dict[tuple[int, int], list[bool]]) -> None:
        self.flags, ids = {}, 0
        for c, call in enumerate(calls):
            for i in range(len(call)):
                self.flags[ids] = flags[(c, i)]
                ids += 1

    def propose(self, r: Replayed, room: int) -> list[int]:
        at, f = len(r.output_ids), self.flags[r.request_id]
        kept = 0
        while kept < room and f[at + kept]:
            kept += 1
        # the kept prefix is the sample's own tokens; the argmax drafts after the first miss stand as -1
        return r.truth[at: at + kept] + [-1] * (room - kept)

    def observe(self, r: Replayed, drafted: int, kept: int) -> None:
        pass

    def finished(self, r: Replayed) -> None:
        pass


class MTPDrafter:
    """Drafts from the policy's MTP module as an engine would: draft 1 for response token k from the
    decoder's final-normed state at the position before token k - 1 and that token (the module's
    teacher-forced row: both are verified by then); draft j > 1 chained from the module's own output
    state and draft j - 1, attending over the module's states of the verified positions. ``coupled``:
    each draft is the engine sampler's draw from the module's distribution with the sample's own
    uniform for that token (its seed, its response index); else the module's argmax. A draft is
    computed only as far as the kept prefix reaches: past the first miss every token is rejected
    whatever it is (proposed as -1)."""

    def __init__(self, calls: list[list[dict]], model, coupled: bool) -> None:
        import torch

        self.model, self.coupled, self.samples = model, coupled, {}
        self.draft_passes = 0
        """MTP-layer passes over one row that drafting took (the cost an engine would pay)."""
        rid = 0
        with torch.no_grad():
            for call in calls:
                for s in call:
                    ids = torch.tensor([s["prompt"] + s["response"]])
                    hidden, allowed = model._decoder(ids, None)
                    state, embeds = model.model.norm(hidden), model.model.embed_tokens(ids)
                    layer = model.model.mtp_layers[0]
                    x = layer.combine(embeds[:, 1:], state[:, :-1])  # row i: (state_i, token i + 1)
                    self.samples[rid] = (s, x[0], len(s["prompt"]))
                    rid += 1

    def _pick(self, logits, spec, draw: int) -> int:
        from splash_rollout.engine.mtp_drafter import coupled_drafts

        if self.coupled:
            return int(coupled_drafts(logits[None], [spec], [draw])[0])
        return int(logits.argmax())

    def propose(self, r: Replayed, room: int) -> list[int]:
        import torch

        s, rows, p = self.samples[r.request_id]
        at = len(r.output_ids)  # response tokens verified; the draft starts at response index ``at``
        if at < 1 or room <= 0:  # the prefill's step samples token 0: no module state before it
            return []
        layer, head = self.model.model.mtp_layers[0], self.model.lm_head.weight
        inputs = [rows[: p + at - 1]]  # teacher-forced rows 0 .. p + at - 2 (the last predicts token ``at``)
        draft: list[int] = []
        with torch.no_grad():
            while len(draft) < room:
                x = torch.cat(inputs)[None]
                n = x.shape[1]
                out, _ = layer(x, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril()[None], None)
                self.draft_passes += 1
                logits = layer.head_logits(out[0, -1], head)
                token = self._pick(logits, s["spec"], at + len(draft))
                draft.append(token)
                if token != s["response"][at + len(draft) - 1]:
                    break  # the rest is rejected whatever it is
                inputs.append(layer.combine(self.model.model.embed_tokens(torch.tensor([token])), out[0, -1:]))
        return draft + [-1] * (room - len(draft))

    def observe(self, r: Replayed, drafted: int, kept: int) -> None:
        pass

    def finished(self, r: Replayed) -> None:
        pass


def record(policy: str, calls: int, threads: int) -> tuple[list[list[dict]], list[dict], list[dict], dict]:
    """The long-tail calls with speculation off (tokens, step log) and always (step log)."""
    import torch

    torch.set_num_threads(threads)
    import splash_rollout.rollout.engine as rollout_engine
    from splash_rollout.models.tokenizer import load_tokenizer
    from splash_rollout.recipes.grpo.build import build_engine, data_options, max_prompt_len
    from splash_rollout.recipes.grpo.task_data import build_task_data
    from splash_rollout.rollout.types import SamplingParams
    from splash_rollout.run import compose_config

    overrides = ["+recipe=grpo_glm5", "engine.parallel.world_size=1", "engine.batching.max_num_seqs=64",
                 "engine.memory.memory_budget_gib=0.25", "engine.parallel.layout=tp", "data.task.max_steps=32",
                 "grpo.max_new_tokens=224", "eval.every=0"]
    cfg = compose_config(overrides + ["data.eval_size=0", "data.seed=1234"])
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name)
    data = build_task_data(data_options(cfg), tokenizer, max_prompt_len(cfg), need_eval=False, fresh_prompts=8 * calls)
    prompts = [e.prompt_ids for e in data.train]
    weights = torch.load(policy, map_location="cpu")
    logs: dict[str, list[dict]] = {"off": [], "always": []}
    captured: list[list] = []  # StepRecord lists
    build_timeline = rollout_engine.build_timeline

    def keep_steps(steps, *args, **kwargs):  # the call's step log, as the timeline receives it
        captured.append(steps)
        return build_timeline(steps, *args, **kwargs)

    rollout_engine.build_timeline = keep_steps
    recorded = []
    try:
        for arm in ("off", "always"):
            engine = build_engine(compose_config(overrides + [f"engine.compute.speculation={arm}"]))
            engine.update_weights(weights, version=1)
            for c in range(calls):
                params = SamplingParams(n=8, temperature=1.0, max_new_tokens=224, seed=100 + c,
                                        stop_token_ids=tuple(tokenizer.eos_token_ids))
                batch = engine.generate(prompts[8 * c: 8 * c + 8], params)
                logs[arm].extend(captured[-1])
                if arm == "off":
                    recorded.append([{"prompt": s.prompt_ids, "response": s.response_ids, "spec": s.spec}
                                     for s in batch.samples])
            engine.shutdown()
    finally:
        rollout_engine.build_timeline = build_timeline
    return recorded, logs["off"], logs["always"], weights


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", required=True, help="a policy.pt of the recipe (e.g. benchmarks/speculative.py's)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--mtp-from", help="a state dict (e.g. the run's sft_policy.pt) whose MTP module drafts instead "
                                        "of the policy's own: the module as it was, beside the one trained on")
    ap.add_argument("--project-layers", type=int, default=61,
                    help="also price each MTP pass as 1/N of a plain step (N: the layers of the model projected to; "
                         "DeepSeek-V3 has 61): est_*_projected")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()

    from splash_rollout.engine.drafter import SuffixDrafter
    from splash_rollout.models.config import PRESETS

    t0 = time.perf_counter()
    calls, off_steps, always_steps, weights = record(args.policy, args.calls, args.threads)
    cost = StepCost(StepCost.fit(off_steps, False), StepCost.fit(always_steps, True))
    print(f"recorded {sum(len(c) for c in calls)} samples in {time.perf_counter() - t0:.0f} s; step seconds: "
          f"plain {cost.plain[0] * 1e3:.2f} ms + {cost.plain[1] * 1e3:.3f} ms/row, drafted "
          f"{cost.drafted[0] * 1e3:.2f} ms + {cost.drafted[1] * 1e3:.3f} ms/row", flush=True)
    drafters = {"SuffixDrafter (the engine's)": {}, "min_match=1": {"min_match": 1},
                "min_confidence=0.1": {"min_confidence": 0.1}, "max_ngram=8": {"max_ngram": 8}}
    results = {}
    for name, kwargs in drafters.items():
        d = SuffixDrafter(**kwargs)
        results[name] = replay(calls, d.propose, d.observe, d.finished, cost)
    model = policy_model(weights)
    if args.mtp_from:  # another state's MTP module over this policy's decoder
        import torch

        other = torch.load(args.mtp_from, map_location="cpu")
        prefix = "model.mtp_layers."
        model.model.mtp_layers.load_state_dict({k[len(prefix):]: v for k, v in other.items() if k.startswith(prefix)})
    if model.model.mtp_layers:
        pass_fixed, pass_row = mtp_pass_seconds(model)
        print(f"an MTP pass (its layer, norm and the head): {pass_fixed * 1e3:.2f} ms + {pass_row * 1e3:.3f} ms/row",
              flush=True)
        for coupled in (False, True):
            for cap in (1, 2, 4):
                d = MTPDrafter(calls, model, coupled)
                name = f"MTP {'coupled' if coupled else 'argmax'}, cap {cap}"
                results[name] = replay(
                    calls, d.propose, d.observe, d.finished, cost, cap=cap,
                    draft_seconds=lambda n, k, running: k * (pass_fixed + pass_row * n),
                    # a model of ``--project-layers`` layers: a pass costs one layer's share of a plain step
                    projected_draft_seconds=lambda n, k, running: k * cost.seconds(len(running), False)
                    / args.project_layers)
                print(f"{name}: {d.draft_passes} chained passes", flush=True)
    else:
        print("the policy has no MTP module: no MTP drafts", flush=True)
    oracle = OracleDrafter(calls, argmax_flags(calls, weights, PRESETS["glm5-nano"]))
    for cap in (2, 4, 8):
        results[f"oracle argmax, cap {cap}"] = replay(calls, oracle.propose, oracle.observe, oracle.finished, cost,
                                                      cap=cap)
    for name, r in results.items():
        projected = (f" (a pass at 1/{args.project_layers} of a step: wall {r['est_wall_ratio_projected']:.2f}x, "
                     f"tail {r['est_tail_ratio_projected']:.2f}x)" if "est_wall_ratio_projected" in r else "")
        print(f"{name:32s} steps {r['target_steps_off']} -> {r['target_steps']}, kept/drafted "
              f"{r['kept_per_drafted']:.2f}, acceptance_len {r['acceptance_len']:.2f}, est. wall "
              f"{r['est_wall_ratio']:.2f}x, tail {r['est_tail_ratio']:.2f}x{projected}; kept by position "
              f"{[round(a, 2) for a in r['accept_by_position']]}")
    out = {"policy": args.policy, "mtp_from": args.mtp_from, "calls": args.calls, "samples": sum(len(c) for c in calls),
           "step_cost_s": dataclasses.asdict(cost), "results": results,
           "mtp_pass_s": [pass_fixed, pass_row] if model.model.mtp_layers else None,
           "project_layers": args.project_layers,
           "command": f"python benchmarks/draft_replay.py --policy P --calls {args.calls}"
                      + (" --mtp-from S" if args.mtp_from else "")}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
