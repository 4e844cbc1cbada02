"""Replay that fits the machine: the ring is fitted to the learner's memory budget before
anything is written, or the run is refused in one line with the store dir untouched; a
learner worker that Dask restarts for memory stops the run in one line instead of a hang."""

import os
import time

import numpy as np
import pytest

from marl.algos import ConfigError
from pipelines import memory, stages
from pipelines.config import make_run_config
from pipelines.dataflow import LIVENESS_S, RunStopped, Watch
from storage import ReplayStore

GiB = 2**30


def config_for(tmp_path, env="smax:8m", **overrides):
    return make_run_config("qmix-smac", env_id=env, run_dir=str(tmp_path / "run"),
                           overrides={k: str(v) for k, v in overrides.items()})


def test_the_bytes_come_from_the_env_spec_the_dtypes_and_the_seeds(tmp_path):
    from marl import algos, envs

    env = envs.make("smax:8m")
    learner = algos.make_learner("qmix", env.spec, make_run_config("qmix-smac").algo_config())
    fields = stages.replay_fields(env.spec, learner)
    per_step = memory.step_bytes(fields)
    # obs 8 x 205 and state 192 float32 dominate (the 7,498 B without actions etc.)
    assert 7_498 <= per_step < 7_498 + 200
    one, four = (memory.replay_memory(config_for(tmp_path, n_seeds=s), fields, False, 0, 24 * GiB)
                 for s in (1, 4))
    assert four.region_bytes == 4 * one.region_bytes == 4 * per_step * 32 * 32
    assert one.mirror_slots == 1_000_000 // (32 * 32)


def test_a_ring_too_big_is_fitted_and_resumes_as_fitted(tmp_path):
    config = config_for(tmp_path)  # smax:8m: a 1M-transition ring is ~7 GiB
    start = stages.prepare_run(config.to_dict(), memory_limit=4 * GiB)
    fitted = start["config"]["buffer_transitions"]
    assert 0 < fitted < config.buffer_transitions and fitted % (32 * 32) == 0
    note = start["replay_note"]
    assert note.startswith("replay ring fitted to the learner's memory") and "\n" not in note
    assert f"{fitted:,} transitions" in note and "2.00 GiB" in note  # the budget: half of 4 GiB
    store = ReplayStore.open(config.store_path)
    assert store.n_slots * 32 * 32 == fitted
    # the same request resumes the same ring, even on a worker with more memory
    again = stages.prepare_run(config.to_dict(), memory_limit=64 * GiB)
    assert again["config"]["buffer_transitions"] == fitted and again["replay_note"] is None
    # ... but not on one with too little for it
    with pytest.raises(ConfigError, match="takes .* GiB on the learner but its budget is"):
        stages.prepare_run(config.to_dict(), memory_limit=1 * GiB)


def test_a_ring_that_cannot_fit_is_refused_in_one_line_before_anything_is_written(tmp_path):
    config = config_for(tmp_path, env="smax:27m_vs_30m", n_seeds=4)
    with pytest.raises(ConfigError) as refused:
        stages.prepare_run(config.to_dict(), memory_limit=GiB)
    message = str(refused.value)
    assert "\n" not in message and "needs at least" in message and "budget is 0.50 GiB" in message
    assert "lower envs_per_collector to" in message and "replay_memory_fraction" in message
    assert not os.path.exists(config.run_dir)  # nothing written


def test_on_policy_learners_hold_one_iteration_whatever_the_ring(tmp_path):
    config = make_run_config("mappo-smax", env_id="smax:8m", run_dir=str(tmp_path / "run"),
                             overrides={"buffer_transitions": str(10**9)})
    start = stages.prepare_run(config.to_dict(), memory_limit=4 * GiB)
    assert start["replay_note"] is None  # one region of 64 x 128 is ~60 MiB
    stages.clear_caches()


def test_a_learner_worker_restarted_for_memory_stops_the_wait_in_one_line(tmp_path):
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None, memory_limit="1GiB") as cluster, Client(cluster) as client:
        learner = next(iter(client.scheduler_info()["workers"]))

        def hog():  # as a mirror too big for the worker would
            blocks = [np.ones(2**27) for _ in range(12)]  # 12 GiB over time; the nanny acts first
            time.sleep(60)
            return len(blocks)

        watch = Watch(client, learner, str(tmp_path / "run"))
        watch.doing = "train of iteration 3"
        began = time.monotonic()
        with pytest.raises(RunStopped) as stopped:
            watch.result(client.submit(hog, workers=[learner], pure=False))
        assert time.monotonic() - began < 30 + LIVENESS_S
    message = str(stopped.value)
    assert "\n" not in message
    assert f"the learner's worker {learner} was restarted by Dask for memory" in message
    assert "during train of iteration 3" in message and "lower buffer_transitions" in message
    assert "run the same command again to resume" in message
