"""``python -m splash_rollout.sim``: GPU-scale simulation on the cost model.

Verbs: ``sweep`` (leading fixed layout per input length, paper §5.2), ``drain`` (a draining
rollout in each fixed layout and adaptively), ``fleet`` (the same drain over R replicas, each with
its share and its own layouts, placed round robin and by load; ``--replicas``), ``fit`` (θ of a platform fitted to some of the
published sweeps, written as a serving YAML) and ``paper`` (predicted vs measured throughput per
published point and layout, the chosen layout and its regret). ``--json`` writes the result,
``--png`` a figure.
Bad input prints one line naming the option and exits 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from splash_rollout.models.config import resolve_model
from splash_rollout.scheduling import Deployment, load_profile
from splash_rollout.sim.core import SimConfig
from splash_rollout.sim.runs import DEFAULT_INPUTS, drain, drain_workload, sweep

PROG = "python -m splash_rollout.sim"


class UsageError(Exception):
    """Bad command-line input; the message names the option."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise UsageError(message)


def _int(option: str, minimum: int = 1):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise UsageError(f"{option}: expected an integer, got {text!r}") from None
        if v < minimum:
            raise UsageError(f"{option}: expected an integer >= {minimum}, got {v}")
        return v
    return parse


def _ints(option: str):
    def parse(text: str) -> tuple[int, ...]:
        try:
            vals = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise UsageError(f"{option}: expected comma-separated integers, got {text!r}") from None
        if not vals or min(vals) < 1:
            raise UsageError(f"{option}: expected positive integers, got {text!r}")
        return vals
    return parse


def _nonneg(option: str):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise UsageError(f"{option}: expected a number, got {text!r}") from None
        if not v >= 0 or v == float("inf"):
            raise UsageError(f"{option}: expected a finite number >= 0, got {text!r}")
        return v
    return parse


def _pair(option: str):
    def parse(text: str) -> tuple[float, float]:
        parts = text.split(",")
        try:
            a, b = (float(x) for x in parts)
        except ValueError:
            raise UsageError(f"{option}: expected two comma-separated numbers, got {text!r}") from None
        if b < 0:
            raise UsageError(f"{option}: sigma must be non-negative, got {b}")
        return a, b
    return parse


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True, parser_class=_Parser)
    for name in ("fit", "paper"):
        s = sub.add_parser(name)
        s.add_argument("--platform", required=True, help="b200 | h200 | dcu")
        if name == "fit":
            s.add_argument("--train", required=True, help="comma list of sweep names (e.g. B16_in,64K_bs)")
            s.add_argument("--out", required=True, help="write the fitted serving YAML here")
            s.add_argument("--rank-weight", type=_nonneg("--rank-weight"), default=None,
                           help="weight of the fit's ordering term: a layout predicted ahead of the measured "
                                "leader by x costs rank_weight * x^2, like a relative error x (default 1; 0: plain "
                                "least squares)")
        else:
            s.add_argument("--profile", default=None, help="serving YAML from `fit`, or a platform's preset name "
                                                           "(default: the platform's fitted preset)")
            s.add_argument("--eval", default=None, help="comma list of sweeps to report (default: all)")
        s.add_argument("--json", dest="json_out", default=None, help="write the result here ('-': stdout)")
    for name in ("sweep", "drain", "fleet"):
        s = sub.add_parser(name)
        s.add_argument("--hardware", default="b200", help="b200 | h200 | h100 | cpu | b200-paper | h200-paper | dcu-paper | PROFILE.yaml")
        s.add_argument("--model", default="glm-5", help="preset name or checkpoint folder")
        s.add_argument("--chunk", type=_int("--chunk"), default=16384, help="prefill rows per step")
        s.add_argument("--json", dest="json_out", default=None, help="write the result here ('-': stdout)")
        s.add_argument("--png", default=None, help="write a figure here")
        if name == "fleet":
            s.add_argument("--replicas", type=_int("--replicas"), default=4, help="engines, each of the profile's T ranks")
        if name == "sweep":
            s.add_argument("--batch", type=_int("--batch"), default=16)
            s.add_argument("--inputs", type=_ints("--inputs"), default=DEFAULT_INPUTS)
            s.add_argument("--output-len", type=_int("--output-len"), default=1024)
        else:
            s.add_argument("--prompts", type=_int("--prompts"), default=512)
            s.add_argument("--samples", type=_int("--samples"), default=16)
            s.add_argument("--prompt-len", type=_ints("--prompt-len"), default=(2048,),
                           help="L or LO,HI (uniform per prompt)")
            s.add_argument("--response-lognormal", type=_pair("--response-lognormal"), default=(8.0, 1.0),
                           help="MU,SIGMA of the response length")
            s.add_argument("--max-response", type=_int("--max-response"), default=65536)
            s.add_argument("--seed", type=_int("--seed", 0), default=0)
            s.add_argument("--workload", default=None,
                           help="a named drain (paper, rl, wide-only, tail-only, long-prompt-only, oscillating) "
                                "instead of --prompts/--samples/...")
    return p


def _deployment(args) -> Deployment:
    try:
        model = resolve_model(args.model)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"--model: {e}") from None
    try:
        profile = load_profile(args.hardware)
    except ValueError as e:
        raise UsageError(f"--hardware: {e}") from None
    return Deployment.build(model, profile)


def _sweeps(option: str, text: str | None, platform: str):
    from splash_rollout.sim.paper import sweep_names
    if text is None:
        return None
    names = [x.strip() for x in text.split(",") if x.strip()]
    known = sweep_names(platform)
    bad = [n for n in names if n not in known]
    if not names or bad:
        raise UsageError(f"{option}: expected a comma list of {known}, got {text!r}")
    return names


def _paper_verb(args) -> tuple[dict, str]:
    from splash_rollout.scheduling.platforms import PLATFORMS, load_serving, save_serving
    from splash_rollout.sim import paper

    if args.platform.lower() not in PLATFORMS:
        raise UsageError(f"--platform: expected one of {sorted(PLATFORMS)}, got {args.platform!r}")
    plat = args.platform.lower()
    if args.verb == "fit":
        train = _sweeps("--train", args.train, plat)
        weight = paper.RANK_WEIGHT if args.rank_weight is None else args.rank_weight
        fitted, info = paper.fit(paper.base_serving(plat), paper.points(plat, train), rank_weight=weight)
        save_serving(fitted, args.out)
        info.update(platform=plat, train=train, out=args.out)
        return info, f"fitted {len(train)} sweeps ({info['train_points']} points): median |error| " \
                     f"{info['median_abs_error']:.1%}, training leaders missed {info['train_leaders_missed']}/" \
                     f"{info['train_points']} -> {args.out}"
    try:
        serving = load_serving(args.profile or plat)
    except ValueError as e:
        raise UsageError(f"--profile: {e}") from None
    pts = paper.points(plat, _sweeps("--eval", args.eval, plat))
    out = paper.report(serving, pts)
    out.update(platform=plat, profile=args.profile or plat)
    sm = out["summary"]
    return out, (f"{sm['points']} points: mean regret {sm['mean_regret']:.2%}, max {sm['max_regret']:.2%}, exact "
                 f"leaders {sm['exact_leaders']}/{sm['points']} (always {sm['best_constant']}: "
                 f"{sm['best_constant_mean_regret']:.2%})")


def main(argv=None) -> int:
    try:
        args = _parser().parse_args(argv)
        if args.verb in ("fit", "paper"):
            result, summary = _paper_verb(args)
            return _emit(args, result, summary)
        if args.verb == "fleet" and args.png:
            raise UsageError("--png: fleet has no figure; its --json has each replica's times and switches")
        dep = _deployment(args)
        cfg = SimConfig(chunk_tokens=args.chunk)
        if args.verb == "sweep":
            result = sweep(dep, args.batch, args.inputs, args.output_len, cfg)
            summary = "  ".join(f"{k}:{v}" for k, v in result["leaders"].items())
        else:
            pl = args.prompt_len
            if len(pl) > 2 or pl[0] > pl[-1]:
                raise UsageError(f"--prompt-len: expected L or LO,HI with LO <= HI, got {','.join(map(str, pl))}")
            if args.workload is not None:
                from splash_rollout.sim.runs import WORKLOADS, named_workload
                if args.workload not in WORKLOADS:
                    raise UsageError(f"--workload: expected one of {WORKLOADS}, got {args.workload!r}")
                work = named_workload(args.workload, args.seed)
            else:
                work = drain_workload(args.prompts, args.samples, (pl[0], pl[-1]), args.response_lognormal,
                                      args.max_response, args.seed)
            if args.verb == "fleet":
                from splash_rollout.sim.fleet import fleet_drain, summary_line

                from splash_rollout.sim.runs import group_size

                result = fleet_drain(dep, work, group_size(args.workload, args.samples), args.replicas, cfg)
                return _emit(args, result, summary_line(result))
            result = drain(dep, work, cfg)
            summary = (" ".join(f"{k}:{v:.0f}" for k, v in result["tokens_per_s"].items())
                       + f"  ratio={result['ratio_adaptive_vs_best_fixed']:.3f}"
                       + f" vs_dp={result['ratio_adaptive_vs_dp']:.3f}  path: {result['switch_path']}")
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return _emit(args, result, summary)


def _emit(args, result: dict, summary: str) -> int:
    text = json.dumps(result, indent=1)
    if args.json_out == "-":
        print(text)
    else:
        if args.json_out:
            with open(args.json_out, "w") as f:
                f.write(text)
        print(summary)
    if getattr(args, "png", None):
        from splash_rollout.sim.plots import plot_drain, plot_sweep
        (plot_sweep if args.verb == "sweep" else plot_drain)(result, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
