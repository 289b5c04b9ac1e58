"""Where each rank's main thread spends a multi-rank run, from a py-spy raw profile taken with
``--subprocesses --idle``: python rank_waits.py PROFILE.txt

Per rank (a worker process's ``--rank N``; its reader thread left out): the share of samples under
each of the frames below (the first that matches a stack wins), then the shared-memory waits by
the collective that waited."""
import collections
import re
import sys

FRAMES = ("_wait (splash", "shm_channel.py", "_sample", "_postprocess", "_decide", "_schedule", "_batch",
          "attend_local", "run_experts", "sample_logits", "_forward")


def main(path: str) -> None:
    share = collections.defaultdict(collections.Counter)
    waits = collections.defaultdict(collections.Counter)
    for line in open(path):
        stack, n = line.rsplit(" ", 1)
        rank = re.search(r"--rank (\d+)", stack)
        if rank is None or "_read_caller" in stack:
            continue
        r, n = int(rank.group(1)), int(n)
        share[r][next((f for f in FRAMES if f in stack), "other")] += n
        if "_wait (splash" in stack:
            frames = [f.split(" (")[0] for f in stack.split(";")]
            at = max(i for i, f in enumerate(frames) if f == "ShmChannel._wait")
            waits[r][" < ".join(frames[at - 3: at][::-1])] += n
    for r in sorted(share):
        total = sum(share[r].values())
        print(f"rank {r}: {total} samples")
        for frame, n in share[r].most_common():
            print(f"  {100 * n / total:5.1f}%  {frame}")
        print("  waits by collective:")
        for where, n in waits[r].most_common(6):
            print(f"  {100 * n / total:5.1f}%  {where}")


if __name__ == "__main__":
    main(sys.argv[1])
