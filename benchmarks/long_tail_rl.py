"""Long-tail RL: plain synchronous GRPO vs over-sampling + partial rollout, at equal trained samples.

The workload is the default recipe's (arithmetic chains, glm5-nano after the SFT warm start) with
the chains' power-law length reaching further (``data.task.max_steps``, default here 32 instead of
12) and a response budget far above the median response (``grpo.max_new_tokens`` 224), so a step's
responses are heavy-tailed: the JSON reports the median / p99 / max response lengths the plain arm
generated (every sample it asked for runs to its end there). The engine gets its own default KV
budget (``engine.memory.memory_budget_gib`` 0.25) instead of the recipe's KV-bound 6 MiB: under that budget
a step is a queue of admissions whose batch stays full until its last few samples, and the tail this
benchmark is about is hidden behind the queue.

1. SFT once (the recipe's SFT, ``grpo.steps=0``); both arms load its ``sft_policy.pt``
   (``--sft-policy P`` reuses the ``sft_policy.pt`` of such a run instead, e.g. this script's own
   ``<work dir>/sft`` from an earlier invocation).
2. Two arms, the same GRPO settings and steps, each training ``prompts_per_step`` x ``n`` samples
   per step:
   * ``plain``: each step generates ``prompts_per_step`` groups and waits for the last sample;
   * ``partial``: each step asks for ``oversample_groups`` groups (``grpo.filter=none``: every
     finished group counts, so the only difference is cutting the tail off), stops once
     ``prompts_per_step`` are done, and carries the cut-off groups into the next step
     (``grpo.partial_rollout``, staleness bound ``grpo.max_off_policy_steps``).
   The arms run at the same time, one thread each, so load from other processes hits both alike
   (the plain arm, slower, runs its last steps with the partial arm gone: that favours plain).
3. Per arm: wall time per trained sample (the steps' rollout + reward + train + weight push,
   ``timing_s/step``, summed over steps, over the trained samples), the run's total wall, the
   reward curve against cumulative trained samples, where each arm's engine time went (from the
   layout timeline: seconds with the running batch at or below 1/8 of the call's peak, the tail,
   and rows computed, which count a resumed sample's re-prefill), and held-out greedy accuracy (the same eval
   chains before the first and after the last step: the unbiased reward comparison, since the
   partial arm's trained groups lean to the ones that finish first). The 1-minute load average is
   sampled throughout.

    python benchmarks/long_tail_rl.py --json docs/results/long_tail_rl.json
    python benchmarks/long_tail_rl.py --quick --json /tmp/long_tail_quick.json   # smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FULL = dict(sft_steps=100, steps=8, prompts=8, oversample=16, n=8, max_new_tokens=224, max_chain=32, eval_size=32,
            max_off_policy_steps=2, memory_budget_gib=0.25, micro_batch_tokens=4096)
"""Sized for 2 shared CPU cores (under a load average near 7 one SFT step of 32 chains took 10-16 s):
a 100-step warm start and 8 GRPO steps of 8 groups x 8 per arm."""
QUICK = dict(sft_steps=20, steps=3, prompts=4, oversample=6, n=4, max_new_tokens=48, max_chain=32, eval_size=8,
             max_off_policy_steps=2, memory_budget_gib=0.25, micro_batch_tokens=4096)


def common(p: dict, threads: int) -> list[str]:
    return ["+recipe=grpo_glm5", "logger.kind=none", "engine.parallel.world_size=1", f"hardware.threads={threads}",
            # the settings its recorded results ran with: the 64-prompt pool, a constant lr
            "data.grpo_pool_size=64", "grpo.lr_schedule=constant", "grpo.min_lr_ratio=0.0", "grpo.summary_window=8",
            f"data.task.max_steps={p['max_chain']}", f"grpo.max_new_tokens={p['max_new_tokens']}",
            f"grpo.prompts_per_step={p['prompts']}", f"grpo.n={p['n']}", f"data.eval_size={p['eval_size']}",
            f"eval.max_new_tokens={p['max_new_tokens']}", f"engine.memory.memory_budget_gib={p['memory_budget_gib']}",
            f"trainer.micro_batch_tokens={'null' if p['micro_batch_tokens'] is None else p['micro_batch_tokens']}"]


def start(overrides: list[str], run_dir: str) -> tuple[subprocess.Popen, object, str]:
    """The recipe in a child process (``python -m splash_rollout.run``), output in ``run_dir``."""
    os.makedirs(run_dir, exist_ok=True)
    log = open(os.path.join(run_dir, "stdout.log"), "w")
    cmd = [sys.executable, "-m", "splash_rollout.run", *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log, run_dir


def wait_all(runs: dict[str, tuple[subprocess.Popen, object, str]], timeout_s: float) -> dict[str, float]:
    """Wait for every run; returns each one's seconds from now to its exit. A failed run, or one past
    ``timeout_s``, stops them all with its log's tail."""
    t0 = time.perf_counter()
    walls: dict[str, float] = {}
    try:
        while len(walls) < len(runs):
            for name, (proc, log, run_dir) in runs.items():
                if name in walls or proc.poll() is None:
                    continue
                walls[name] = time.perf_counter() - t0
                log.close()
                if proc.returncode != 0:
                    with open(os.path.join(run_dir, "stdout.log")) as f:
                        tail = f.read()[-3000:]
                    raise RuntimeError(f"{run_dir}: exited with {proc.returncode}:\n{tail}")
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"{sorted(set(runs) - set(walls))}: no result within {timeout_s:.0f} s "
                                   f"(see stdout.log in their run folders)")
            time.sleep(0.5)
    finally:
        for proc, _, _ in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return walls


def rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


class LoadSampler:
    """The 1-minute load average every few seconds, in a thread."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.values: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)

    def _run(self, every_s: float) -> None:
        while not self._stop.is_set():
            self.values.append(os.getloadavg()[0])
            self._stop.wait(every_s)

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def arm_summary(history: list[dict], wall_s: float, summary: dict) -> dict:
    steps = [r for r in history if "timing_s/step" in r]
    trained = np.array([r["train/trained_samples"] for r in steps])
    step_s = float(sum(r["timing_s/step"] for r in steps))
    rollout_s = float(sum(r["timing_s/rollout"] for r in steps))
    evals = [(int(r["grpo_step"]), r["eval/accuracy"]) for r in history if "eval/accuracy" in r]
    keys = ("rollout/resumed_groups", "rollout/resumed_samples", "rollout/carried_groups", "rollout/stale_dropped",
            "rollout/off_policy_tokens_frac", "rollout/max_token_lag")
    out = {"trained_samples": int(trained.sum()), "steps": len(steps),
           "step_s": step_s, "rollout_s": rollout_s, "train_s": float(sum(r["timing_s/train"] for r in steps)),
           "wall_s_per_trained_sample": step_s / max(trained.sum(), 1),
           "rollout_s_per_trained_sample": rollout_s / max(trained.sum(), 1),
           "run_wall_s": wall_s,
           "trained_response_len_mean": float(np.mean([r["rollout/response_len/mean"] for r in steps])),
           "reward_curve": [[int(c), float(r["reward/mean"])] for c, r in zip(np.cumsum(trained), steps)],
           "reward_mean_all_steps": float(np.mean([r["reward/mean"] for r in steps])),
           "eval_accuracy": evals}
    for k in keys:
        values = [r[k] for r in steps if k in r]
        if values:
            out[k] = {"sum": float(np.sum(values)), "max": float(np.max(values))}
    if "rollout/carried_at_end" in summary:
        out["carried_at_end"] = summary["rollout/carried_at_end"]
    return out


def tail_seconds(run_dir: str, fraction: float = 0.125) -> dict:
    """From the run's layout timeline: per GRPO step, the rollout seconds spent with the running batch
    at or below ``fraction`` of that call's peak (the tail: few samples per engine step, where a
    step's fixed cost is paid for a handful of tokens), the call's engine seconds, and the rows
    computed (prefill + decode; a resumed sample's prefill of its earlier tokens counts here)."""
    with open(os.path.join(run_dir, "timeline.json")) as f:
        calls = json.load(f)["steps"]
    tail, engine, rows_ = [], [], []
    for call in calls:
        curve = [point for phase in call["phases"] for point in phase["batch_curve"]]
        peak = max((b for _, b in curve), default=0)
        tail.append(sum(t1 - t0 for (t0, b0), (t1, _) in zip(curve, curve[1:]) if b0 <= fraction * peak))
        engine.append(call["phases"][-1]["t_end"] if call["phases"] else 0.0)
        rows_.append(sum(phase["tokens"] for phase in call["phases"]))
    return {"batch_fraction": fraction, "tail_s": float(sum(tail)), "engine_s": float(sum(engine)),
            "tail_share_of_engine": float(sum(tail) / max(sum(engine), 1e-9)), "rows": int(sum(rows_)),
            "tail_s_by_step": [round(t, 3) for t in tail]}


def plain_lengths(run_dir: str) -> dict:
    """Response lengths the plain arm generated, where every asked sample runs to its end: median and
    p99 over one sample per group (samples.jsonl with ``logger.samples_per_step`` above the groups),
    max over every sample (each step's record), and each step's p90 and max."""
    steps = [r for r in rows(run_dir) if "rollout/response_len/max" in r]
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        lens = np.array([json.loads(line)["response_len"] for line in f if line.strip()])
    longest = max([float(lens.max())] + [r["rollout/response_len/max"] for r in steps])  # over all samples
    return {"median": float(np.median(lens)), "p99": float(np.percentile(lens, 99)), "max": longest,
            "max_over_median": longest / max(float(np.median(lens)), 1.0), "samples_measured": int(lens.size),
            "step_max": [r["rollout/response_len/max"] for r in steps],
            "step_p90": [r["rollout/response_len/p90"] for r in steps]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny SFT, 3 steps, short responses")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps per arm")
    ap.add_argument("--max-chain", type=int, default=None, help="data.task.max_steps (the chains' longest)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="grpo.max_new_tokens (and the eval's)")
    ap.add_argument("--work-dir", default=None, help="where the runs go (default: a temporary folder)")
    ap.add_argument("--sft-policy", default=None,
                    help="an sft_policy.pt of this workload's SFT to start both arms from (skips the SFT)")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="per run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    p = dict(QUICK if args.quick else FULL)
    for key, value in (("steps", args.steps), ("max_chain", args.max_chain), ("max_new_tokens", args.max_new_tokens)):
        if value is not None:
            p[key] = value
    work = args.work_dir or tempfile.mkdtemp(prefix="long_tail_rl_")
    t_all = time.perf_counter()
    with LoadSampler() as load:
        if args.sft_policy:
            if not os.path.isfile(args.sft_policy):
                raise FileNotFoundError(f"--sft-policy: {args.sft_policy!r} does not exist")
            policy, sft_s = os.path.abspath(args.sft_policy), None
        else:
            sft_dir = os.path.join(work, "sft")
            sft_run = start(common(p, threads=1) + [f"sft.steps={p['sft_steps']}", "grpo.steps=0", "eval.every=0"],
                            sft_dir)
            sft_s = wait_all({"sft": sft_run}, args.timeout_s)["sft"]
            policy = os.path.join(sft_dir, "sft_policy.pt")
        load_after_sft = len(load.values)
        shared = common(p, threads=1) + [f"sft.load={policy}", f"grpo.steps={p['steps']}",
                                         f"eval.every={p['steps']}", "logger.samples_per_step=1000"]
        arms = {"plain": shared,
                "partial": shared + [f"grpo.oversample_groups={p['oversample']}", "grpo.filter=none",
                                     "grpo.partial_rollout=true",
                                     f"grpo.max_off_policy_steps={p['max_off_policy_steps']}"]}
        walls = wait_all({name: start(ov, os.path.join(work, name)) for name, ov in arms.items()}, args.timeout_s)
        arm_loads = load.values[load_after_sft:]
    sft_summary = os.path.join(os.path.dirname(policy), "summary.json")
    sft_info = {"policy": policy}
    if os.path.isfile(sft_summary):
        with open(sft_summary) as f:
            sft_info.update(json.load(f).get("sft", {}))
    out: dict = {"sft": sft_info, "workload": {**p, "task": "arith_chain (the default recipe's), data.task.max_steps="
                              f"{p['max_chain']}", "model": "glm5-nano after SFT",
                              "response_lengths_plain": plain_lengths(os.path.join(work, "plain"))}}
    for name in arms:
        with open(os.path.join(work, name, "summary.json")) as f:
            summary = json.load(f)
        out[name] = arm_summary(rows(os.path.join(work, name)), walls[name], summary)
        out[name]["engine_time"] = tail_seconds(os.path.join(work, name))
    plain, partial = out["plain"], out["partial"]
    out["speedup_per_trained_sample"] = {
        "wall": plain["wall_s_per_trained_sample"] / partial["wall_s_per_trained_sample"],
        "rollout_only": plain["rollout_s_per_trained_sample"] / partial["rollout_s_per_trained_sample"],
        "run_wall": (plain["run_wall_s"] / plain["trained_samples"]) / (partial["run_wall_s"] / partial["trained_samples"]),
        "target": 1.5,
        # what cutting the whole tail could give with nothing else changed: the plain arm's step
        # time without its tail seconds (training, re-prefill and over-sampling costs ignored)
        "plain_without_its_tail": plain["step_s"] / max(plain["step_s"] - plain["engine_time"]["tail_s"], 1e-9)}
    final = lambda arm: arm["eval_accuracy"][-1][1] if arm["eval_accuracy"] else float("nan")  # noqa: E731
    w = max(1, p["steps"] // 4)
    last = lambda arm: float(np.mean([r for _, r in arm["reward_curve"][-w:]]))  # noqa: E731
    out["reward"] = {"eval_accuracy_final": {"plain": final(plain), "partial": final(partial)},
                     "eval_accuracy_start": {k: out[k]["eval_accuracy"][0][1] if out[k]["eval_accuracy"] else None
                                             for k in arms},
                     f"train_reward_last_{w}_steps": {"plain": last(plain), "partial": last(partial)},
                     "partial_no_worse_on_eval": final(partial) >= final(plain)}
    out["load_average_1min"] = {"sft": float(np.mean(load.values[:load_after_sft] or [float("nan")])),
                                "arms_mean": float(np.mean(arm_loads or [float("nan")])),
                                "arms_max": float(np.max(arm_loads or [float("nan")])), "cores": os.cpu_count()}
    out["timing_s"] = {"sft": sft_s, "total": time.perf_counter() - t_all}
    out["work_dir"] = work
    out["command"] = " ".join(["python benchmarks/long_tail_rl.py"] + (["--quick"] if args.quick else []) + [
        f"--{flag} {value}" for flag, value in (("steps", args.steps), ("max-chain", args.max_chain),
                                                ("max-new-tokens", args.max_new_tokens), ("sft-policy", args.sft_policy))
        if value is not None])
    print(json.dumps({k: v for k, v in out.items() if k not in ("plain", "partial")}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
