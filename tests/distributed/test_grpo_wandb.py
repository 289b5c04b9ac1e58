"""The recipe's W&B run holds what users read: the default logger (W&B, offline here) gets every
metric and, after the final eval, the layout timeline table and the plots -- logged at a step W&B
accepts. W&B drops (with a warning) anything logged at a step below its latest, which is how the
timeline once went missing from every run."""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["+recipe=grpo_glm5", "sft.steps=2", "sft.batch_size=8", "grpo.steps=3", "grpo.prompts_per_step=2", "grpo.n=2",
        "grpo.max_new_tokens=16", "eval.every=2", "eval.max_prompts=4", "eval.n=2", "eval.k=[1,2]",
        "eval.max_new_tokens=16", "trainer.micro_batch_size=8", "engine.parallel.world_size=1", "hardware.threads=1"]


@pytest.mark.slow
def test_the_timeline_reaches_the_wandb_run(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-m", "splash_rollout.run", *TINY, f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "less than the current step" not in output, output[-3000:]
    [run] = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*"))
    record_log = open(glob.glob(os.path.join(run, "run-*.wandb"))[0], "rb").read()
    for key in (b"timeline/phases", b"timeline/plot", b"reward/plot", b"eval/paired"):
        assert key in record_log, key
