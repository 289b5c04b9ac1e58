"""Matplotlib figures for the simulator: the leader map of a sweep (throughput per layout over input
length, the leader marked) and a drain's cumulative tokens over time (adaptive vs fixed layouts)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_COLORS = {"tp": "tab:blue", "cp": "tab:orange", "dp": "tab:green", "dop": "tab:red", "adaptive": "black"}


def plot_sweep(result: dict, path: str) -> None:
    inputs = sorted(int(k) for k in result["tokens_per_s"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for l in ("tp", "cp", "dp", "dop"):
        ax.plot(inputs, [result["tokens_per_s"][str(i)][l] / 1e3 for i in inputs], "o-", label=l, color=_COLORS[l])
    for i in inputs:
        lead = result["leaders"][str(i)]
        ax.annotate(lead, (i, result["tokens_per_s"][str(i)][lead] / 1e3), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=8, color=_COLORS[lead])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("input tokens per request")
    ax.set_ylabel("total throughput (10^3 tokens/s)")
    ax.set_title(f"{result['model']} on {result['hardware']}, B={result['batch']} (simulated)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_drain(result: dict, path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, run in result["runs"].items():
        if not run["progress"]:
            continue
        t, n = zip(*run["progress"])
        ax.plot(t, [x / 1e6 for x in n], label=f"{mode} ({run['tokens_per_s']:.0f} tok/s)",
                color=_COLORS.get(mode), lw=2 if mode == "adaptive" else 1)
    for s in result.get("switches", []):
        ax.axvline(s["t"], color="grey", ls=":", lw=0.8)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("tokens done (10^6)")
    ax.set_title(f"drain: {result['model']} on {result['hardware']}, {result['requests']} requests (simulated)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
