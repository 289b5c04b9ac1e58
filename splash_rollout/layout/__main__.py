"""``python -m splash_rollout.layout``: the ownership model from the command line.

Verbs: ``footprint`` (per-rank weights and KV pool per layout), ``limits`` (longest feasible nominal
input per layout, Appendix B) and ``switches`` (the 12 directed switches). ``--json`` prints the
public JSON shapes other tools read; bad input prints one line naming the option and exits 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from splash_rollout.layout.arith import GiB, MiB
from splash_rollout.layout.bytes import KV_FORMATS, WEIGHT_DTYPES, AttentionBytes
from splash_rollout.layout.footprint import (FEED_FORWARD_PLACEMENTS, VOCAB_PLACEMENTS, RankBudget, footprints,
                                             other_weight_bytes_per_rank)
from splash_rollout.layout.layouts import ALL_LAYOUTS, Layout
from splash_rollout.layout.limits import CohortSpec, longest_feasible_input
from splash_rollout.layout.switch_plan import BatchKV, all_switches
from splash_rollout.models.config import ModelConfig, resolve_model

PROG = "python -m splash_rollout.layout"


class UsageError(Exception):
    """Bad command-line input; the message names the option."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints the whole usage)
        raise UsageError(message)


def _positive_int(option: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise UsageError(f"{option}: expected a positive integer, got {text!r}") from None
        if value < 1:
            raise UsageError(f"{option}: expected a positive integer, got {value}")
        return value
    return parse


def _positive_float(option: str, allow_zero: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise UsageError(f"{option}: expected a number, got {text!r}") from None
        if value < 0 or (value == 0 and not allow_zero):
            raise UsageError(f"{option}: expected a {'non-negative' if allow_zero else 'positive'} number, got {text}")
        return value
    return parse


def _model(text: str) -> ModelConfig:
    try:
        return resolve_model(text)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise UsageError(f"--model: {str(e).removeprefix('model: ')}") from None


def _add_footprint_options(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--model", type=_model, required=required, help="preset name or HF checkpoint folder")
    p.add_argument("--memory-gib", type=_positive_float("--memory-gib"), required=required,
                   help="device memory per rank, GiB")
    p.add_argument("--mem-fraction", type=_positive_float("--mem-fraction"), default=0.9,
                   help="share of memory the engine may use (default 0.9)")
    p.add_argument("--reserve-gib", type=_positive_float("--reserve-gib", allow_zero=True), default=0.0,
                   help="transient reserve kept out of the pool, GiB")
    p.add_argument("--weight-dtype", choices=WEIGHT_DTYPES, default="fp8")
    p.add_argument("--kv-format", choices=KV_FORMATS, default="fp8-flashmla")
    p.add_argument("--page-size", type=_positive_int("--page-size"), default=64)
    p.add_argument("--feed-forward", choices=FEED_FORWARD_PLACEMENTS, default="sharded",
                   help="MLP / MoE weights over the ranks: 1/T each (sharded) or whole on every rank (replicated)")
    p.add_argument("--vocab", choices=VOCAB_PLACEMENTS, default="replicated",
                   help="embeddings and LM head over the ranks: whole on every rank (replicated: this engine) or "
                        "split over the vocabulary (sharded: vocab-parallel deployments)")
    p.add_argument("--attention-only", action="store_true",
                   help="the budget holds attention weights and KV only (no MLP/MoE/embedding shards)")
    p.add_argument("--attention-weights-gib", type=_positive_float("--attention-weights-gib"),
                   help="override W_A (all switchable projections, whole) with a stated size, GiB")
    p.add_argument("--kv-bytes-per-token", type=_positive_int("--kv-bytes-per-token"),
                   help="override the KV bytes per token (all layers) with a stated size")


def _sizes(args) -> AttentionBytes:
    sizes = AttentionBytes.from_model(args.model, args.weight_dtype, args.kv_format)
    if args.attention_weights_gib is not None or args.kv_bytes_per_token is not None:
        # a stated scenario: one lumped layer carries the stated totals, no replicated extras
        w_a = int(args.attention_weights_gib * GiB) if args.attention_weights_gib is not None else sizes.w_a
        kv = args.kv_bytes_per_token or sizes.kv_bytes_per_token_total
        rep = 0 if args.attention_weights_gib is not None else sizes.w_replicated
        sizes = AttentionBytes((w_a,), (rep,), (kv,), sizes.num_heads, sizes.weight_dtype, sizes.kv_format)
    return sizes


def _check_world_size(config: ModelConfig, world_size: int) -> None:
    if config.num_heads % world_size:
        raise UsageError(f"--world-size: {world_size} does not divide num_heads={config.num_heads} of {config.name}")


def _footprints(args):
    _check_world_size(args.model, args.world_size)
    sizes = _sizes(args)
    other = 0 if args.attention_only else other_weight_bytes_per_rank(args.model, args.world_size, args.weight_dtype,
                                                                         args.feed_forward, args.vocab)
    budget = RankBudget.from_gib(args.memory_gib, args.mem_fraction, args.reserve_gib, other)
    if budget.attention_bytes <= 0:
        raise UsageError(f"--memory-gib: {args.memory_gib} GiB x {args.mem_fraction} leaves nothing after "
                         f"{other / GiB:.2f} GiB of non-attention weights and {args.reserve_gib} GiB reserve")
    return footprints(sizes, args.world_size, budget, args.page_size), budget


def cmd_footprint(args) -> dict:
    fps, budget = _footprints(args)
    return {"model": args.model.name, "world_size": args.world_size,
            "attention_budget_bytes_per_rank": budget.attention_bytes,
            "layouts": {l.value: fp.to_dict() for l, fp in fps.items()}}


def _parse_pools(text: str) -> dict[Layout, int]:
    pools: dict[Layout, int] = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        try:
            layout = Layout.parse(name, "--pool-tokens")
        except ValueError as e:
            raise UsageError(str(e)) from None
        try:
            pools[layout] = int(value)
        except ValueError:
            raise UsageError(f"--pool-tokens: expected {name}=TOKENS, got {item!r}") from None
        if pools[layout] < 0:
            raise UsageError(f"--pool-tokens: {name} must be non-negative, got {pools[layout]}")
    missing = [l.value for l in ALL_LAYOUTS if l not in pools]
    if missing:
        raise UsageError(f"--pool-tokens: missing {', '.join(missing)} (expected tp=N,dp=N,cp=N,dop=N)")
    return pools


def cmd_limits(args) -> dict:
    if args.pool_tokens:
        pools = _parse_pools(args.pool_tokens)
    elif args.model is not None and args.memory_gib is not None:
        fps, _ = _footprints(args)
        pools = {l: fp.pool_tokens_per_rank for l, fp in fps.items()}
    else:
        raise UsageError("--pool-tokens: give the pools, or --model and --memory-gib to derive them")
    try:
        spec = CohortSpec(cohorts=args.cohorts, seed=args.seed, target=args.target)
    except ValueError as e:
        raise UsageError(f"--{str(e).split(':')[0]}: {str(e).split(':', 1)[1].strip()}") from None
    start = time.perf_counter()
    limits = {}
    for layout in ALL_LAYOUTS:
        limits[layout.value] = longest_feasible_input(layout, pools[layout], args.world_size, args.batch, spec)
        if not args.json and sys.stderr.isatty():  # progress on a terminal; the table follows on stdout
            print(f"  {layout.title:>12}: {limits[layout.value]:>10,} tokens ({limits[layout.value] / 1024:.2f}k)",
                  file=sys.stderr)
    return {"limits": limits, "pool_tokens": {l.value: pools[l] for l in ALL_LAYOUTS},
            "world_size": args.world_size, "batch": args.batch, "cohorts": spec.cohorts, "seed": spec.seed,
            "target": spec.target, "seconds": round(time.perf_counter() - start, 2)}


def cmd_switches(args) -> dict:
    _check_world_size(args.model, args.world_size)
    sizes = AttentionBytes.from_model(args.model, args.weight_dtype, args.kv_format)
    batch = BatchKV.uniform(args.batch, args.context, args.world_size, args.page_size)
    plans = all_switches(sizes, batch, args.world_size)
    return {"model": args.model.name, "world_size": args.world_size, "batch": args.batch,
            "context": args.context, "switches": [p.to_dict() for p in plans]}


def _print_human(verb: str, out: dict) -> None:
    if verb == "footprint":
        print(f"{out['model']}  T={out['world_size']}  attention budget/rank "
              f"{out['attention_budget_bytes_per_rank'] / GiB:.2f} GiB")
        print(f"{'layout':>8} {'weights GiB/rank':>17} {'KV B/token':>11} {'pool tokens/rank':>17} {'distinct tokens':>16}")
        for name, fp in out["layouts"].items():
            print(f"{name:>8} {fp['weight_bytes_per_rank'] / GiB:>17.3f} {fp['kv_bytes_per_token']:>11,}"
                  f" {fp['pool_tokens_per_rank']:>17,} {fp['distinct_tokens']:>16,}")
    elif verb == "limits":
        print(f"T={out['world_size']} B={out['batch']} cohorts={out['cohorts']:,} target={out['target']} "
              f"({out['seconds']} s)")
        for name, tokens in out["limits"].items():
            print(f"{name:>8} {tokens:>10,} tokens  {tokens / 1024:>8.2f}k")
    else:
        print(f"{out['model']}  T={out['world_size']}  B={out['batch']}  context={out['context']:,}")
        print(f"{'switch':>10} {'weights':>11} {'kv':>11} {'MiB/rank/layer':>15} {'MiB/rank':>12} network")
        for s in out["switches"]:
            print(f"{s['src'] + '->' + s['dst']:>10} {s['weights']:>11} {s['kv']:>11}"
                  f" {s['bytes_per_rank_per_layer'] / MiB:>15.2f} {s['bytes_per_rank'] / MiB:>12.2f} {s['network']}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True, parser_class=_Parser)
    fp = verbs.add_parser("footprint", help="per-rank weights and KV pool per layout")
    _add_footprint_options(fp, required=True)
    lim = verbs.add_parser("limits", help="longest feasible nominal input per layout (Appendix B)")
    lim.add_argument("--batch", type=_positive_int("--batch"), required=True)
    lim.add_argument("--pool-tokens", help="tp=N,dp=N,cp=N,dop=N (tokens per rank)")
    _add_footprint_options(lim, required=False)
    lim.add_argument("--cohorts", type=_positive_int("--cohorts"), default=200_000)
    lim.add_argument("--seed", type=int, default=20260922)
    lim.add_argument("--target", type=_positive_float("--target"), default=0.99)
    sw = verbs.add_parser("switches", help="the 12 directed switches")
    sw.add_argument("--model", type=_model, required=True)
    sw.add_argument("--batch", type=_positive_int("--batch"), required=True)
    sw.add_argument("--context", type=_positive_int("--context"), required=True, help="tokens per request")
    sw.add_argument("--weight-dtype", choices=WEIGHT_DTYPES, default="fp8")
    sw.add_argument("--kv-format", choices=KV_FORMATS, default="fp8-flashmla")
    sw.add_argument("--page-size", type=_positive_int("--page-size"), default=64)
    for p in (fp, lim, sw):
        p.add_argument("--world-size", type=_positive_int("--world-size"), required=True, help="ranks T")
        p.add_argument("--json", action="store_true", help="print the JSON contract instead of a table")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        out = {"footprint": cmd_footprint, "limits": cmd_limits, "switches": cmd_switches}[args.verb](args)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print_human(args.verb, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
