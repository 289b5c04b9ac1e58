"""Run under torchrun: every rank builds a RolloutEngine over the torchrun group and generates."""
import json
import sys

import torch.distributed as dist

from splash_rollout import EngineConfig, RolloutEngine, SamplingParams

if __name__ == "__main__":
    layout, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    engine = RolloutEngine(EngineConfig(model="glm5-nano", world_size=dist.get_world_size(), layout=layout,
                                        max_num_batched_tokens=64, page_size=8))
    batch = engine.generate([[5, 6, 7] * 30, [9] * 3, [11, 12] * 40],
                            SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=5, ignore_eos=True))
    got = [[s.response_ids for s in g.samples] for g in batch.groups]
    with open(f"{out}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(got, f)
    engine.shutdown()
    dist.destroy_process_group()
