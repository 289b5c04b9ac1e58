"""Run under torchrun by test_reliability.py (2 ranks host the engine in-process).

1. Different prompts on the two ranks: the same error on both, before any work.
2. A bad prompt on rank 1 only: rank 1 raises its own error, rank 0 says rank 1 rejected its input.
3. Then the same good call on both ranks works, and samples as a fresh engine's first call would
   (failed calls do not move the seed counters; engine-derived seeds make that visible).
4. A failure injected on rank 1 in a switch transfer: both ranks raise (rank 0 when its collective
   times out), and both refuse the next call, saying why.
Writes one JSON record per rank.
"""
import json
import os
import sys
import time

import torch.distributed as dist

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams

PROMPTS = [[5, 6, 7] * 10, [9] * 3]
SAMPLING = SamplingParams(n=2, max_new_tokens=6, ignore_eos=True)  # seeds from the engine's call counter


def attempt(fn):
    try:
        fn()
        return None
    except Exception as e:  # noqa: BLE001 - recorded for the test to check
        return f"{type(e).__name__}: {e}"


def tokens(batch):
    return [s.response_ids for s in batch.samples]


if __name__ == "__main__":
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    timeout = 5.0
    record = {"timeout_s": timeout}
    with RolloutEngine(EngineConfig(model="glm5-nano", page_size=8, max_num_batched_tokens=64)) as one:
        record["fresh"] = tokens(one.generate(PROMPTS, SAMPLING))
    engine = RolloutEngine(EngineConfig(model="glm5-nano", world_size=2, layout="dp", page_size=8,
                                        max_num_batched_tokens=64, rank_timeout_s=timeout))
    mine = PROMPTS if rank == 0 else [PROMPTS[0], [9] * 4]
    record["mismatch"] = attempt(lambda: engine.generate(mine, SAMPLING))
    bad = PROMPTS if rank == 0 else [[9999]] + PROMPTS[1:]
    record["bad_on_one"] = attempt(lambda: engine.generate(bad, SAMPLING))
    record["good"] = tokens(engine.generate(PROMPTS, SAMPLING))
    engine.switch_layout("tp")
    if rank == 1:
        os.environ["SPLASH_FAULT"] = "switch_transfer:1@1"
    start = time.monotonic()
    record["fault"] = attempt(lambda: engine.generate(PROMPTS, SAMPLING))
    record["fault_s"] = time.monotonic() - start
    os.environ.pop("SPLASH_FAULT", None)
    record["after_fault"] = attempt(lambda: engine.generate(PROMPTS, SAMPLING))
    engine.shutdown()
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()
