"""reward.png: the run's learning curve at a glance, next to timeline.png.

Top: the per-step mean reward (dots: one step's batch, noisy by which prompts it drew) and its
trailing moving average (``reward/mean_ma``, the line to read). Bottom: held-out greedy accuracy at
every eval with its 95 % interval (``eval/accuracy_low`` / ``eval/accuracy_high``), and in the
title the paired before/after comparison when the run has one.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_reward(path: str, history: Sequence[dict[str, Any]], window: int,
                paired: dict[str, float] | None = None) -> str:
    """``history``: the run's metrics rows (metrics.jsonl); writes a PNG, returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in history if "reward/mean" in r]
    evals = [r for r in history if "eval/accuracy" in r]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True,
                                      gridspec_kw={"height_ratios": [1.2, 1]})
    if steps:
        xs = [int(r["grpo_step"]) for r in steps]
        ys = [r["reward/mean"] for r in steps]
        top.plot(xs, ys, "o", ms=3, color="tab:blue", alpha=0.35, label="mean reward of the step")
        top.plot(xs, moving_average(ys, window), color="tab:blue", lw=2.2,
                 label=f"moving average ({window} steps)")
        if "reward/accuracy" in steps[0]:
            acc = [r["reward/accuracy"] for r in steps]
            top.plot(xs, moving_average(acc, window), color="tab:green", lw=1.4, ls="--",
                     label=f"rollout accuracy, moving average")
    top.set_ylabel("reward (train prompts)")
    top.set_ylim(0, 1)
    top.grid(alpha=0.3)
    top.legend(loc="lower right", fontsize=8)
    top.set_title("GRPO learning curve")
    if evals:
        xs = np.array([int(r["grpo_step"]) for r in evals])
        acc = np.array([r["eval/accuracy"] for r in evals])
        low = np.array([r.get("eval/accuracy_low", a) for r, a in zip(evals, acc)])
        high = np.array([r.get("eval/accuracy_high", a) for r, a in zip(evals, acc)])
        bottom.fill_between(xs, low, high, color="tab:red", alpha=0.15, lw=0, label="95 % interval")
        bottom.plot(xs, acc, "o-", color="tab:red", lw=2, label="held-out greedy accuracy")
        for x, a in zip(xs, acc):
            bottom.annotate(f"{a:.2f}", (x, a), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
        prompts = int(evals[0].get("eval/num_prompts", 0))
        bottom.set_ylim(max(0.0, float(low.min()) - 0.05), min(1.0, float(high.max()) + 0.08))
        bottom.legend(loc="lower right", fontsize=8)
        title = f"held-out ({prompts} prompts), eval before step s"
        if paired:
            title += (f"\nafter vs before GRPO: {paired['accuracy_before']:.3f} -> {paired['accuracy_after']:.3f}, "
                      f"+{paired['gained']} / -{paired['lost']} prompts, paired p = {paired['p_value']:.1e}")
        bottom.set_title(title, fontsize=9)
    else:
        bottom.text(0.5, 0.5, "no held-out eval (eval.every=0)", ha="center", va="center", transform=bottom.transAxes)
    bottom.set_ylabel("held-out accuracy")
    bottom.set_xlabel("GRPO step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
