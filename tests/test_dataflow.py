"""The asynchronous dataflow on real LocalClusters and real Zarr stores, without Prefect:
lock-step (K = 0) reproducible bit for bit across cluster sizes and kinds (worker processes,
worker threads of one process), the policy lag bounded
at K = 2 with the replay ratio held, and a killed collector's task resubmitted."""

import os
import signal
import threading
import time

import numpy as np
import pytest

from pipelines import stages
from pipelines.config import RunConfig, make_run_config
from pipelines.dataflow import Dataflow, Placement, run_moving
from storage import Checkpointer, ReplayStore, open_replay

TINY = "qmix-smac-tiny"  # 2 collectors x 8 envs x 32 steps per iteration


def run_dataflow(client, run_dir, env_steps, **overrides):
    config = make_run_config(TINY, run_dir=str(run_dir), total_env_steps=env_steps,
                             overrides={"learning_starts": "1", **overrides})
    start = client.submit(stages.prepare_run, config.to_dict(), pure=False).result()
    dataflow = Dataflow(client, config, start, Placement.on(client, config))
    rows = dataflow.run()
    client.run(stages.forget_run, config.run_dir)
    return config, rows, dataflow


@pytest.fixture(scope="module")
def three_workers():
    from distributed import Client

    from pipelines.cluster import make_cluster

    with make_cluster(n_workers=3, kind="cpu", dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        yield client


def final_train_state(config):
    with Checkpointer(config.checkpoint_dir) as checkpoints:
        state, _ = checkpoints.restore()
    return state


def test_lock_step_is_reproducible_across_cluster_sizes_and_kinds(tmp_path, dask_cluster, three_workers,
                                                                  monkeypatch):
    from distributed import Client

    from pipelines import cluster

    with Client(dask_cluster.scheduler_address) as client:
        config2, rows2, _ = run_dataflow(client, tmp_path / "two", 2048)
    config3, rows3, flow3 = run_dataflow(three_workers, tmp_path / "three", 2048)
    # a machine that refuses TCP listeners (the TPU machines): "auto" makes the workers threads
    # of this process over inproc, started without Dask's HTTP servers
    monkeypatch.setattr(cluster, "can_listen", lambda: False)
    with cluster.make_cluster(n_workers=3, kind="auto") as threads, Client(threads) as client:
        assert all(a.startswith("inproc://") for a in cluster.workers(client))
        assert not hasattr(threads.scheduler, "http_server")  # no HTTP server was started
        configt, rowst, flowt = run_dataflow(client, tmp_path / "threads", 2048)
    assert len(set(flow3.where.collectors)) == len(set(flowt.where.collectors)) == 2  # collectors apart
    assert [r["env_steps"] for r in rows2] == [r["env_steps"] for r in rows3] == [512, 1024, 1536, 2048]
    assert [r["env_steps"] for r in rowst] == [512, 1024, 1536, 2048]
    assert all(r["policy_lag_max"] == 0 for r in rows2 + rows3 + rowst)
    stores = [open_replay(c.store_path) for c in (config2, config3, configt)]
    two = stores[0]
    assert two.sizes["step"] == 8 * 32
    for other in stores[1:]:
        assert two.sizes == other.sizes
        for name in (*two.data_vars, "region", "iteration", "collector", "param_version"):
            np.testing.assert_array_equal(two[name].values, other[name].values, err_msg=name)
    leaves2 = _leaves(final_train_state(config2))
    assert leaves2
    for config in (config3, configt):
        leaves = _leaves(final_train_state(config))
        assert leaves2.keys() == leaves.keys()
        for path in leaves2:
            np.testing.assert_array_equal(leaves2[path], leaves[path], err_msg=path)
    assert rows2[-1]["total_updates"] == 8 * make_run_config(TINY).algo_config().updates_per_region


def test_lag_is_bounded_and_the_replay_ratio_held(tmp_path, dask_cluster):
    from distributed import Client

    with Client(dask_cluster.scheduler_address) as client:
        config, rows, dataflow = run_dataflow(client, tmp_path / "lag2", 4096, max_policy_lag="2")
    n_regions = 8 * 2
    store = ReplayStore.open(config.store_path)
    assert [r for r, _ in store.committed()] == list(range(n_regions))
    assert store.total_regions_committed() == n_regions  # none duplicated, none missing
    ds = open_replay(config.store_path)
    lag = (ds.trained_version - ds.param_version).values
    assert (ds.trained_version.values >= 0).all() and lag.max() <= 2 and lag.min() >= 0
    # collect(i) acts with version i - 2: collectors ran ahead of the learner
    assert dataflow.summary()["policy_lag_histogram"] == {0: 2, 1: 2, 2: n_regions - 4}
    per_region = make_run_config(TINY).algo_config().updates_per_region
    ratio = rows[-1]["total_updates"] / rows[-1]["env_steps"]
    configured = per_region / (config.envs_per_collector * config.steps_per_region)
    assert abs(ratio / configured - 1) < 0.05
    assert all(0 <= r["learner_busy"] <= 1 and 0 <= r["collector_busy"] <= 1 for r in rows)


def test_the_workers_are_asked_of_the_scheduler_not_of_a_cache_the_client_overwrites(dask_cluster):
    # client.scheduler_info() returns an attribute that the client's periodic refresh
    # overwrites with a worker-less summary: read at the wrong moment, it said "no worker is
    # left" with every worker up, and stopped runs on a loaded machine. A fast refresh makes
    # the race frequent; the liveness checks' own read never sees it.
    import dask
    from distributed import Client

    from pipelines import cluster

    with dask.config.set({"distributed.client.scheduler-info-interval": "5ms"}), \
            Client(dask_cluster.scheduler_address) as client:
        # (client.scheduler_info() read empty 4 times in 300 here, distributed 2026.7.1)
        assert all(len(cluster.workers(client)) == 2 for _ in range(300))


def test_a_killed_collector_is_resubmitted_and_every_region_lands_once(tmp_path, three_workers):
    client = three_workers
    config = make_run_config(TINY, run_dir=str(tmp_path / "killed"))
    where = Placement.on(client, config)
    victim = where.collectors[0]
    assert victim != where.learner
    pid = client.run(os.getpid, workers=[victim])[victim]
    store_path = config.store_path
    outcome = {}

    def train():
        try:
            outcome["result"] = run_dataflow(client, tmp_path / "killed", 16 * 512, max_policy_lag="1")
        except BaseException as error:  # reported below
            outcome["error"] = error

    thread = threading.Thread(target=train)
    thread.start()
    deadline = time.time() + 300
    while time.time() < deadline and thread.is_alive():
        if os.path.isdir(os.path.join(store_path, "commits")) and \
                len(os.listdir(os.path.join(store_path, "commits"))) >= 6:
            break
        time.sleep(0.05)
    # Dask's active memory manager drops surplus replicas, the computing worker's included:
    # a params version a collector fetched may then live only on that collector. Made so here
    # (it happened by itself in CI), the kill loses it, and Dask makes it again: never by
    # running a train call again (LearnerOutOfStep), always from what the learner still holds
    sources = client.run_on_scheduler(_drop_replicas_held_by_both, where.learner, victim)
    os.kill(pid, signal.SIGKILL)  # mid-run: later regions are still to come
    thread.join(timeout=600)
    assert not thread.is_alive() and "error" not in outcome, outcome.get("error")
    config, rows, _ = outcome["result"]
    assert rows[-1]["env_steps"] == 16 * 512
    store = ReplayStore.open(store_path)
    assert [r for r, _ in store.committed()] == list(range(32))
    assert store.total_regions_committed() == 32
    assert sources and all(holders == [[where.learner]] for holders in sources.values()), \
        "\n".join(f"{key} {holders}" for key, holders in sources.items())


def _drop_replicas_held_by_both(learner, victim, dask_scheduler=None):
    """Removes `learner`'s copy of every key `victim` also holds and no task on the learner
    is using (as the memory manager chooses). Returns, for each params key the run holds,
    where the learner result it was taken from is: the learner's worker, always."""
    keys = [key for key, ts in dask_scheduler.tasks.items()
            if ts.state == "memory" and {learner, victim} <= {ws.address for ws in ts.who_has}
            and not any(w.processing_on and w.processing_on.address == learner for w in ts.waiters or ())]
    if keys:
        dask_scheduler.request_remove_replicas(learner, keys, stimulus_id=f"test-drop-{time.time()}")
    return {key: [sorted(ws.address for ws in d.who_has or ()) for d in ts.dependencies]
            for key, ts in dask_scheduler.tasks.items()
            if ts.who_wants and ts.state == "memory"
            and ("itemgetter('params')" in str(key) or str(key).startswith("_alias"))}


_DISK = threading.Event()  # a disk that accepts nothing until the test lets it
_WRITES_BLOCKED: list[int] = []


def _slow_write_region(self, region_id, *args, **kwargs):
    _WRITES_BLOCKED.append(region_id)
    assert _DISK.wait(120), "the test never opened the disk"
    return _WRITE_REGION(self, region_id, *args, **kwargs)


_WRITE_REGION = ReplayStore.write_region


def test_the_learner_trains_past_a_stalled_disk_and_the_collectors_hold_back(tmp_path, monkeypatch):
    from distributed import Client

    from pipelines import cluster

    # worker threads of this process, so the store's write path can be held back from here
    monkeypatch.setattr(ReplayStore, "write_region", _slow_write_region)
    _DISK.clear()
    _WRITES_BLOCKED.clear()
    config = make_run_config(TINY, run_dir=str(tmp_path / "stalled"), total_env_steps=8 * 512,
                             overrides={"learning_starts": "1", "checkpoint_every": "100", "eval_every": "100"})
    outcome = {}
    with cluster.make_cluster(n_workers=3, kind="threads") as threads, Client(threads) as client:
        start = client.submit(stages.prepare_run, config.to_dict(), pure=False).result()
        flow = Dataflow(client, config, start, Placement.on(client, config))
        thread = threading.Thread(target=lambda: outcome.update(rows=flow.run()))
        thread.start()
        try:
            deadline = time.time() + 120
            while time.time() < deadline and flow.trained < 2:
                time.sleep(0.05)
            trained = flow.trained
            time.sleep(2.0)
            # at K = 0 the learner trained iteration 1 with no region of iteration 0 on disk (it
            # used to wait for them), then stopped: the collectors, whose first regions are still
            # being written, hold back (stages.PENDING_WRITES), so nothing piles up in memory
            assert flow.trained == trained >= 2, (trained, flow.trained)
            assert sorted(_WRITES_BLOCKED) == list(range(stages.PENDING_WRITES * config.n_collectors))
            assert flow.next_to_submit <= flow.trained + 2
        finally:
            _DISK.set()
            thread.join(timeout=120)
        client.run(stages.forget_run, config.run_dir)
    assert [r["iteration"] for r in outcome["rows"]] == list(range(1, 9))
    store = ReplayStore.open(config.store_path)
    assert [r for r, _ in store.committed()] == list(range(16))
    assert (open_replay(config.store_path).trained_version.values >= 0).all()  # every region's recorded


def test_a_killed_evaluator_mid_evaluation_is_resubmitted(tmp_path, three_workers):
    client = three_workers
    iterations = 12
    config = make_run_config(TINY, run_dir=str(tmp_path / "evaluator"))
    evaluator = Placement.on(client, config).evaluator
    pid = client.run(os.getpid, workers=[evaluator])[evaluator]
    outcome = {}

    def train():
        try:
            outcome["result"] = run_dataflow(client, tmp_path / "evaluator", iterations * 512,
                                             eval_every="1", eval_episodes="64")
        except BaseException as error:  # reported below
            outcome["error"] = error

    thread = threading.Thread(target=train)
    thread.start()
    evaluating = lambda: any(str(key).startswith("evaluate") for key in
                             client.processing(workers=[evaluator]).get(evaluator, ()))
    deadline = time.time() + 300
    while time.time() < deadline and thread.is_alive() and not evaluating():
        time.sleep(0.02)
    assert evaluating(), "no evaluation ran on the evaluator's worker"
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=300)
    assert not thread.is_alive() and "error" not in outcome, outcome.get("error")
    config, rows, _ = outcome["result"]
    assert [r["iteration"] for r in rows] == list(range(1, iterations + 1))
    assert all("test_win_rate" in r for r in rows)  # every evaluation, the killed one included
    store = ReplayStore.open(config.store_path)
    assert [r for r, _ in store.committed()] == list(range(iterations * 2))


def _run_killing(client, run_dir, victims):
    """A 24-iteration run whose `victims(client, learner)` workers are SIGKILLed once a
    checkpoint and 12 regions are on disk; returns (config, rows, [(start iteration, learner)])."""
    iterations = 24
    config = make_run_config(TINY, run_dir=str(run_dir), total_env_steps=iterations * 512,
                             overrides={"learning_starts": "1", "eval_every": "8"})
    cfg = config.to_dict()
    starts, outcome = [], {}
    first_learner = Placement.on(client, config).learner
    pids = client.run(os.getpid, workers=victims(client, first_learner))

    def prepare(worker):
        return client.submit(stages.prepare_run, cfg, workers=[worker], pure=False).result(timeout=120)

    def train():
        try:
            outcome["rows"], _ = run_moving(client, config, prepare, lambda start, where: starts.append(
                (start["iteration"], where.learner)))
        except BaseException as error:  # reported below
            outcome["error"] = error

    thread = threading.Thread(target=train)
    thread.start()
    commits = os.path.join(config.store_path, "commits")
    checkpointed = lambda: os.path.isdir(config.checkpoint_dir) and any(
        d.isdigit() for d in os.listdir(config.checkpoint_dir))
    while thread.is_alive() and not (checkpointed() and len(os.listdir(commits)) >= 12):
        time.sleep(0.05)
    for pid in pids.values():
        os.kill(pid, signal.SIGKILL)
    thread.join(timeout=300)
    assert not thread.is_alive(), "the run waited for its dead learner"
    assert "error" not in outcome, outcome
    rows = outcome["rows"]
    assert [r["iteration"] for r in rows] == list(range(1, iterations + 1))
    # every region committed, each once, and the learner trained each iteration once from
    # the checkpoint on: its update count is exactly the regions' worth
    store = ReplayStore.open(config.store_path)
    assert sorted(r for r, _ in store.committed()) == list(range(iterations * 2))
    assert int(final_train_state(config)["updates"]) == iterations * 2 * 2  # regions x updates_per_region
    # one move, from a checkpoint, to a live worker
    assert len(starts) == 2 and starts[0] == (0, first_learner)
    assert 0 < starts[1][0] < iterations and starts[1][1] != first_learner
    return config, rows, starts


def test_a_killed_learner_moves_to_another_worker_and_the_run_completes(tmp_path, three_workers):
    # its tasks are pinned to its worker, so Dask alone would wait for it forever: the
    # learner moves to another worker from its last checkpoint and the run goes on
    _run_killing(three_workers, tmp_path / "learner", lambda client, learner: [learner])


def test_every_worker_killed_at_once_the_run_goes_on_when_they_restart(tmp_path, three_workers):
    # (the module's last test: it kills the shared cluster's workers) the scheduler is left
    # with no worker for a moment; their nannies start new ones, and the learner moves there
    everyone = lambda client, learner: list(client.scheduler_info()["workers"])
    _run_killing(three_workers, tmp_path / "everyone", everyone)


def _leaves(tree, path=""):
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_leaves(v, f"{path}/{k}"))
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for i, v in enumerate(tree):
            out.update(_leaves(v, f"{path}/{i}"))
        return out
    return {path: np.asarray(tree)}


def test_a_region_leaves_the_device_raveled_per_step_with_its_bytes():
    """The host copy ravels each step's fields on the device ([T, N * ...]: dense rows that a
    TPU copies out without de-tiling, and that XLA compiles in seconds where a whole-field
    ravel took minutes); the host gets the same bytes back in the field's shape."""
    import jax.numpy as jnp

    region = {"obs": jnp.arange(2 * 4 * 3 * 5, dtype=jnp.float32).reshape(2, 4, 3, 5),
              "avail_actions": jnp.arange(2 * 4 * 3 * 8).reshape(2, 4, 3, 8) % 3 == 0,
              "first": jnp.arange(2 * 4).reshape(2, 4) % 2 == 0}
    copied = stages._start_host_copy(region)
    assert {k: v.shape for k, v in copied.items()} == {"obs": (2, 60), "avail_actions": (2, 96), "first": (2, 4)}
    on_host = stages._on_host({"data": region, "host_data": copied})
    for k, v in region.items():
        assert on_host[k].dtype == v.dtype
        np.testing.assert_array_equal(on_host[k], np.asarray(v))


def test_a_region_made_beside_the_learner_stays_on_the_device_until_written(tmp_path):
    """On a threads cluster the rollout hands the learner the device's arrays (no host round
    trip); the write copies them to the host and stores what the host path would."""
    import jax
    from distributed import Client

    from pipelines import cluster

    config = make_run_config(TINY, run_dir=str(tmp_path / "run"), total_env_steps=512)
    for dashboard in ("127.0.0.1:0", None):  # every HTTP listener on the loopback, dashboard or not
        with cluster.make_cluster(n_workers=1, kind="threads", dashboard_address=dashboard) as threads:
            servers = [threads.scheduler, *threads.workers.values()]
            bound = {s.getsockname()[0] for n in servers for s in n.http_server._sockets.values()}
            assert bound == {"127.0.0.1"}, bound
    with cluster.make_cluster(n_workers=1, kind="threads") as threads, Client(threads) as client:
        start = client.submit(stages.prepare_run, config.to_dict(), pure=False).result()
        config = RunConfig(**start["config"])  # its ring as fitted
        params = client.submit(stages.policy_params, config.to_dict(), pure=False).result()
        rolled = client.submit(stages.rollout, config.to_dict(), 0, 0, params, 0, 0, pure=False).result()
        assert all(isinstance(a, jax.Array) for a in rolled["data"].values())
        written = client.submit(stages.write, config.to_dict(), rolled, pure=False).result()
    assert written["committed"] and written["host_wait_s"] >= 0 and written["write_s"] > 0
    store = ReplayStore.open(config.store_path)
    host = store.conform(0, {k: np.asarray(v) for k, v in rolled["data"].items()})
    stored = store.read_region(0)
    assert stored.keys() == host.keys()
    for name in host:
        np.testing.assert_array_equal(stored[name], host[name], err_msg=name)
        assert stored[name].dtype == store.fields[name].dtype
