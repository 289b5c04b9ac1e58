"""Ranks start from anywhere: a script with no main guard, a program on stdin; a rank that fails
to start raises on the caller with that rank's own traceback."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from splash_rollout.distributed.launch import RankFailure, WorkerGroup


def readme_example() -> str:
    """The README's "Using the engine" program as it stands (no main guard), with short responses,
    printing the first sample's tokens."""
    with open("README.md") as f:
        readme = f.read()
    block = re.search(r"## Using the engine\s+```python\n(.*?)```", readme, re.S)
    assert block, "README.md: no python block under '## Using the engine'"
    program, n = re.subn(r"max_new_tokens=\d+", "max_new_tokens=3", block.group(1))
    assert n >= 1 and "\"world_size\": 2" in program and "__main__" not in program
    return program + 'print("TOKENS", batch.groups[0].samples[0].response_ids)\n'


def tokens_printed(proc: subprocess.CompletedProcess) -> list[int]:
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = re.findall(r"^TOKENS \[([\d, ]+)\]$", proc.stdout, re.M)
    assert found, proc.stdout[-2000:]
    return [int(t) for t in found[0].split(",")]


def _python(args: list[str], cwd: str, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")  # this checkout's splash_rollout
    env.pop("SPLASH_FAULT", None)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, **kw)


def test_the_readme_example_runs_as_a_script_without_a_main_guard(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    assert 1 <= len(tokens_printed(_python([str(script)], cwd=os.getcwd()))) <= 3  # the second call's sample


def test_the_readme_example_runs_from_stdin(tmp_path):
    proc = _python(["-"], cwd=str(tmp_path), input=readme_example())  # from an unrelated working directory
    assert 1 <= len(tokens_printed(proc)) <= 3


@pytest.mark.parametrize("stage, message", [
    (0, r"rank 1 died during start \(exit code 1\)(.|\n)*Traceback(.|\n)*"),
    (1, r"rank 1 failed to start:\nTraceback(.|\n)*"),
], ids=["crash-before-hello", "raise-while-joining"])
def test_a_rank_that_fails_to_start_raises_with_its_traceback(stage, message, monkeypatch):
    monkeypatch.setenv("SPLASH_FAULT", f"rank_start:{stage}@1")
    with pytest.raises(RankFailure, match=message + rf"InjectedFault: SPLASH_FAULT=rank_start:{stage}@1: injected "
                                                    rf"failure in rank_start of stage {stage} on rank 1"):
        WorkerGroup(2, timeout_s=30, threads_per_rank=1)


GUARDED_SCRIPT = '''
from dataclasses import dataclass

from splash_rollout.distributed.launch import WorkerGroup


@dataclass
class Point:
    rank: int
    doubled: int


def double_on_rank(ctx, x):
    return Point(ctx.rank, 2 * x)


if __name__ == "__main__":
    with WorkerGroup(2, timeout_s=30, threads_per_rank=1) as group:
        print("POINTS", group.run(double_on_rank, 21))
'''


def test_a_function_and_a_class_from_a_guarded_scripts_main_run_on_the_ranks(tmp_path):
    script = tmp_path / "guarded.py"
    script.write_text(GUARDED_SCRIPT)
    proc = _python([str(script)], cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "POINTS [Point(rank=0, doubled=42), Point(rank=1, doubled=42)]" in proc.stdout


def rank_of(ctx):
    return ctx.rank


def _taken_ports(monkeypatch, count: int):
    """Make the group's next ``count`` rendezvous ports ones a listening socket holds."""
    import socket

    from splash_rollout.distributed import launch

    held = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        held.append(s)
    ports = [s.getsockname()[1] for s in held]
    real = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda: ports.pop(0) if ports else real())
    return held, ports


def test_a_start_whose_port_another_process_took_starts_again_on_a_new_one(monkeypatch):
    held, ports = _taken_ports(monkeypatch, 1)
    try:
        with WorkerGroup(2, timeout_s=30, threads_per_rank=1) as group:
            assert group.run(rank_of) == [0, 1]
    finally:
        for s in held:
            s.close()
    assert not ports  # the taken port was tried first


def test_a_port_lost_on_every_attempt_is_a_clear_error(monkeypatch):
    from splash_rollout.distributed import launch

    monkeypatch.setattr(launch, "START_ATTEMPTS", 1)
    held, _ = _taken_ports(monkeypatch, 1)
    try:
        with pytest.raises(RankFailure, match="rank 0 failed to start(.|\n)*EADDRINUSE"):
            WorkerGroup(2, timeout_s=30, threads_per_rank=1)
    finally:
        for s in held:
            s.close()
