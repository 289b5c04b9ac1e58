"""`+recipe=grpo_glm5_file` from the command line, as a user runs it: a JSONL file of chat prompts
written here, a reward function given by path (importable from PYTHONPATH), held-out eval before,
during and after training, the engine asleep around each optimizer step, and a run killed (SIGKILL)
after its first checkpoint and resumed, whose metrics.jsonl rows equal the uninterrupted run's."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from splash_rollout.recipes.grpo.data import ChainTaskConfig, make_dataset
from splash_rollout.recipes.grpo.metrics import is_wall_clock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REWARD = textwrap.dedent('''
    """The test's reward: 1 when the response ends with #<the row's meta.answer>."""
    import os, re, time

    def score(response, row, token_ids):
        gate = os.environ.get("HANG_ONCE_EXISTS")
        if gate and os.path.exists(gate):  # lets the test kill the run at a known point
            time.sleep(3600)
        m = re.search(r"#(-?\\d+)\\s*$", response)
        return {"reward": float(m is not None and int(m.group(1)) == row["meta"]["answer"]),
                "well_formed": float(m is not None)}
''')
SMOKE = ["+recipe=grpo_glm5_file", "data.label_key=meta.answer", "reward.fn=file_reward:score",
         "sft.steps=2", "sft.batch_size=8", "grpo.steps=3", "grpo.prompts_per_step=2", "grpo.n=2",
         "grpo.max_new_tokens=16", "eval.every=2", "eval.max_prompts=4", "eval.n=2", "eval.k=[1,2]",
         "eval.max_new_tokens=16", "trainer.save_every=2", "trainer.micro_batch_size=8", "logger=none",
         "engine.parallel.world_size=1", "hardware.threads=1", "engine.sleep_during_train=true", "grpo.kl_coef=0.01",
         "grpo.entropy_coef=0.001"]


def write_task(folder) -> str:
    rows = make_dataset(80, seed=11, task=ChainTaskConfig(max_steps=4))
    path = os.path.join(folder, "train.jsonl")
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({"messages": [{"role": "user", "content": r["prompt"]}],
                                "meta": {"answer": r["answer"]}, "solution": r["solution"]}) + "\n")
    with open(os.path.join(folder, "file_reward.py"), "w") as f:
        f.write(REWARD)
    return path


def start(tmp_path, data: str, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    log = open(tmp_path / f"log{len(list(tmp_path.glob('log*')))}.txt", "w")
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT]), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "splash_rollout.run", *SMOKE, f"data.path={data}", *overrides],
                            cwd=ROOT, env=environ, stdout=log, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, timeout_s: float = 400) -> None:
    assert proc.wait(timeout=timeout_s) == 0, open(proc.stdout.name).read()[-4000:]


def rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def reproducible(row: dict) -> dict:
    return {k: v for k, v in row.items() if not is_wall_clock(k)}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_file_recipe_smoke_and_kill_resume(tmp_path):
    data = write_task(str(tmp_path))
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    gate = killed / "checkpoints" / "step_000002" / "state.json"
    a = start(tmp_path, data, f"hydra.run.dir={straight}")
    b = start(tmp_path, data, f"hydra.run.dir={killed}", env={"HANG_ONCE_EXISTS": str(gate)})
    deadline = time.monotonic() + 400
    while not gate.exists():  # the killed run stops in its first reward call after checkpoint 2
        assert b.poll() is None, open(b.stdout.name).read()[-4000:]
        assert time.monotonic() < deadline, "no checkpoint at step 2"
        time.sleep(0.5)
    time.sleep(1.0)
    b.send_signal(signal.SIGKILL)
    assert b.wait(timeout=60) == -signal.SIGKILL
    finish(a)
    assert [r["grpo_step"] for r in rows(killed)] == [0, 1]
    finish(start(tmp_path, data, f"resume={killed}"))

    got, want = rows(killed), rows(straight)
    assert [r["grpo_step"] for r in want] == [0, 1, 2, 3]  # 3 steps and the eval after the last
    assert [reproducible(r) for r in got] == [reproducible(r) for r in want]

    # what the smoke run shows: held-out eval before / during / after, pass@k, reward extras, chat
    # prompts, engine memory released around each optimizer step, trainer == engine logprobs
    evals = [r for r in want if "eval/accuracy" in r]
    assert [r["grpo_step"] for r in evals] == [0, 2, 3]
    assert all({"eval/pass@1", "eval/pass@2", "eval/response_len/mean"} <= set(r) for r in evals)
    train_rows = want[:3]
    assert all(r["memory/engine_bytes_asleep"] == 0 < r["memory/engine_bytes_freed"] for r in train_rows)
    assert all(r["train/logprob_diff_max"] <= 1e-6 and "train/entropy" in r and "train/kl" in r for r in train_rows)
    assert all("reward/well_formed/mean" in r for r in train_rows)
    assert want[0]["data/eval_rows"] == 8 and want[0]["data/overlong_filtered/train"] == 0
    with open(straight / "samples.jsonl") as f:
        sample = json.loads(f.readline())
    assert sample["prompt"].startswith("<|user|>\n") and sample["prompt"].endswith("\n<|assistant|>\n")
    summary = json.loads((straight / "summary.json").read_text())
    assert [step for step, _ in summary["eval/accuracy_curve"]] == [0, 2, 3]
