"""`marl train` SIGKILLed while orbax writes a checkpoint, then the same command again.

The run has a local cluster of its own (`--workers 1`), so its worker, the process that
writes the checkpoint, is in the killed process group. orbax writes step N into
`N.orbax-checkpoint-tmp` and renames it to `N` when it is whole; the test stops the group
(SIGSTOP) the moment such a directory appears and kills it only if the rename has not
happened, so the kill always lands mid-write.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pipelines.config import make_run_config
from storage import Checkpointer, ReplayStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "qmix-smac-tiny"  # 2 collectors x 8 envs x 32 steps = 512 env steps per iteration
PARTIAL = ".orbax-checkpoint-tmp"  # orbax's suffix for a step it has not finished


def _listing(directory: str) -> tuple[list[int], list[str]]:
    """(complete steps, unfinished step directories) in `directory`."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(int(n) for n in names if n.isdigit()), [n for n in names if PARTIAL in n]


def _state_files(step_dir: str) -> list[str]:
    """The files of the learner's state (orbax's `state` item) under a step directory."""
    return [f for d, _, fs in os.walk(step_dir) for f in fs
            if os.path.relpath(d, step_dir).split(os.sep)[0].startswith("state")]


def _kill_mid_save(proc: subprocess.Popen, directory: str, timeout: float) -> tuple[int, int]:
    """SIGKILLs `proc`'s process group while orbax writes a step after the first complete
    one, once some of the state's files are on disk; returns (the step being written, the latest
    complete step)."""
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        complete, partial = _listing(directory)
        if complete and partial and _state_files(os.path.join(directory, partial[0])):
            os.killpg(proc.pid, signal.SIGSTOP)
            time.sleep(0.3)  # a rename already under way lands; then nothing moves
            complete, partial = _listing(directory)
            if partial:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
                return int(partial[0].split(".")[0]), complete[-1]
            os.killpg(proc.pid, signal.SIGCONT)  # the save finished first: wait for the next
        time.sleep(0.002)
    pytest.fail(f"no checkpoint write was caught (exit {proc.poll()})")


def test_marl_train_killed_mid_checkpoint_resumes_from_the_last_complete_one(tmp_path, prefect_server):
    from prefect.settings import PREFECT_API_URL

    iterations = 5
    config = make_run_config(TINY, run_dir=str(tmp_path / "run"), total_env_steps=iterations * 512)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(),
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    env.pop("MARL_DASK_SCHEDULER", None)
    command = [sys.executable, "-m", "flows.cli", "train", TINY, "--run-dir", config.run_dir, "--env-steps",
               str(iterations * 512), "--workers", "1", "--set", "checkpoint_every=1"]
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(command, cwd=tmp_path, env=env, start_new_session=True, stdout=log,
                                 stderr=subprocess.STDOUT)
    try:
        written, last = _kill_mid_save(first, config.checkpoint_dir, timeout=300)
    except BaseException:
        print((tmp_path / "first.log").read_text()[-3000:])
        raise
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(timeout=60)
    assert first.returncode == -signal.SIGKILL
    assert last == written - 1 and written < iterations  # a checkpoint every iteration
    assert _state_files(os.path.join(config.checkpoint_dir, f"{written}{PARTIAL}"))  # killed mid-write
    with Checkpointer(config.checkpoint_dir) as checkpoints:  # the unfinished step is not one
        assert checkpoints.latest_step() == last and written not in checkpoints.all_steps()
        assert int(checkpoints.metadata()["iteration"]) == last

    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in output and PARTIAL not in output, output
    # restored from the last complete step, never from the unfinished one
    assert f"resumed from iteration {last}" in done.stdout, output
    complete, partial = _listing(config.checkpoint_dir)
    assert complete[-1] == iterations and partial == []
    store = ReplayStore.open(config.store_path)
    assert [r for r, _ in store.committed()] == list(range(iterations * 2)) and store.verify()[0] == []
    with Checkpointer(config.checkpoint_dir) as checkpoints:
        state, meta = checkpoints.restore()
    per_iteration = 2 * config.algo_config().updates_per_region
    assert int(meta["iteration"]) == iterations and int(state["updates"]) == iterations * per_iteration


def test_a_save_removes_what_an_unfinished_one_left(tmp_path):
    """An unfinished step directory of a step never saved again (a run resumed with other
    settings) is not a checkpoint, and the next save removes it."""
    import shutil

    import numpy as np

    directory = str(tmp_path / "checkpoints")
    state = {"w": np.arange(4, dtype=np.float32)}
    with Checkpointer(directory) as checkpoints:
        checkpoints.save(1, state, {"iteration": 1})
    shutil.copytree(os.path.join(directory, "1"), os.path.join(directory, f"2{PARTIAL}"))
    with Checkpointer(directory) as checkpoints:
        assert checkpoints.all_steps() == [1]
        checkpoints.save(3, state, {"iteration": 3})
        assert _listing(directory) == ([1, 3], []) and checkpoints.metadata() == {"iteration": 3}
