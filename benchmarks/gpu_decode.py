"""GPU decode throughput: the engine per attention backend vs transformers ``generate``.

Workload: a random-init model with DeepSeek-V2-Lite's attention dimensions (16 heads, no q LoRA,
kv_lora_rank 512, rope 64, hidden 2048; dense FFN, ``--layers`` layers) in bfloat16, B prompts of
128 tokens, greedy, ``ignore_eos``; B in {1, 64, 256}. Decode-only rates: two runs of 8 and 72 new
tokens, the difference of their times over the 64 extra steps (prefill cancels). Next to each rate:
the step time at the HBM-bandwidth bound (every weight and every row's KV read once per step).
The measuring code is the device check's (scripts/device_check.py), so both report the same numbers.

    python benchmarks/gpu_decode.py --json OUT.json            # on a GPU
    python benchmarks/gpu_decode.py --json OUT.json --cpu --tiny  # the script itself, on a CPU

Writes ``{"backends": {name: {"B=..": {decode_tokens_per_s, step_s, bound_step_s, times_bound,
ratio_to_transformers}}}, "transformers": {...}}``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="output JSON path")
    ap.add_argument("--cpu", action="store_true", help="CPU with Triton's interpreter (a check of the script)")
    ap.add_argument("--tiny", action="store_true", help="small model and batches")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hbm-gbps", type=float, default=4800.0)
    args = ap.parse_args()
    if args.cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, ROOT)
    spec = importlib.util.spec_from_file_location("device_check", os.path.join(ROOT, "scripts", "device_check.py"))
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    flags = ["--layers", str(args.layers), "--hbm-gbps", str(args.hbm_gbps)] + ["--cpu"] * args.cpu + ["--tiny"] * args.tiny
    ctx = check.Ctx(check.parse_args(flags))
    engine = check.part_decode_throughput(ctx)
    peer = check.part_transformers_peer(ctx)
    backends = {name: engine[name] for name in check.BACKENDS}
    for rows in backends.values():
        for key, row in rows.items():
            if isinstance(row, dict) and isinstance(peer.get(key), dict) and "decode_tokens_per_s" in row:
                row["ratio_to_transformers"] = row["decode_tokens_per_s"] / peer[key]["decode_tokens_per_s"]
    result = {"model": engine["model"], "param_bytes": engine["param_bytes"], "backends": backends,
              "transformers": peer, "device": ctx.device}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    rates = {name: {key: round(row["decode_tokens_per_s"]) for key, row in rows.items()
                    if isinstance(row, dict) and "decode_tokens_per_s" in row} for name, rows in backends.items()}
    print(json.dumps({"decode_tokens_per_s": rates}))


if __name__ == "__main__":
    main()
