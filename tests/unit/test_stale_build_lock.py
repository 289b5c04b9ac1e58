"""A JIT-build lock left by a killed DeepSpeed op build is refused with its path, not waited on forever."""
import os
import time

import pytest

from splash_rollout.recipes.grpo.trainer import refuse_stale_build_locks


def test_an_old_build_lock_is_refused_a_fresh_one_is_not(tmp_path):
    build = tmp_path / "py311_cpu" / "deepspeed_shm_comm"
    build.mkdir(parents=True)
    refuse_stale_build_locks(str(tmp_path))  # no lock: nothing to say
    lock = build / "lock"
    lock.touch()
    refuse_stale_build_locks(str(tmp_path))  # a build running now holds it
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with pytest.raises(RuntimeError, match=r"deepspeed_shm_comm/lock is 60 minutes old"):
        refuse_stale_build_locks(str(tmp_path))
