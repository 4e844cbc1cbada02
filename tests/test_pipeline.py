"""The whole path for real: stages, a 2-worker LocalCluster, a Zarr store on disk, Prefect flow runs."""

import json
import os

import numpy as np
import pytest

from flows.checks import InputError
from marl.algos import ConfigError
from marl.envs import EnvError
from pipelines import stages
from pipelines.config import make_run_config
from storage import ReplayStore, open_replay

TINY = "qmix-smac-tiny"


def test_stages_run_as_plain_functions(tmp_path):
    config = make_run_config(TINY, run_dir=str(tmp_path / "run"), n_collectors=1, total_env_steps=512,
                             overrides={"learning_starts": "1"})
    cfg = config.to_dict()
    start = stages.prepare_run(cfg)
    assert {k: start[k] for k in ("iteration", "env_steps", "param_version")} == {"iteration": 0, "env_steps": 0, "param_version": 0}
    assert start["config"] == cfg and start["replay_note"] is None  # the tiny ring fits as asked
    params = stages.policy_params(cfg)
    for iteration in range(2):
        stats = stages.collect(cfg, 0, iteration, params, iteration, iteration * 256)
        assert stats["region"] == iteration and stats["steps"] == 256
        out = stages.train(cfg, iteration, (iteration + 1) * 256, iteration == 1, [stats])
        params = out["params"]
        assert out["metrics"]["updates"] == config.algo_config().updates_per_region
        assert out["metrics"]["lags"] == [0] and out["param_version"] == iteration + 1
    ev = stages.evaluate(cfg, params, 1)
    assert ev["episodes"] == config.eval_episodes
    # a train call run twice (a lost result recomputed) is refused, not trained from the checkpoint
    with pytest.raises(stages.LearnerOutOfStep, match="at iteration 2, asked to train iteration 1"):
        stages.train(cfg, 1, 512, False, [stats], previous=out["metrics"])
    with pytest.raises(stages.LearnerOutOfStep, match="checkpoint .* is at iteration 2, asked to train iteration 5"):
        stages.train(cfg, 5, 512, False, [stats])
    ds = open_replay(config.store_path)
    assert ds.obs.dims == ("step", "env", "agent", "obs_dim")
    assert ds.sizes["step"] == 64 and list(np.unique(ds.iteration)) == [0, 1]
    assert stages.prepare_run(cfg)["iteration"] == 2  # the checkpoint says where to resume
    stages.clear_caches()


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, prefect_server, dask_cluster):
    """A tiny flow run whose collect task of region 3 fails once after committing."""
    from flows.train import marl_train

    run_dir = str(tmp_path_factory.mktemp("flow") / "run")
    result = marl_train(preset=TINY, run_dir=run_dir, env_steps=2048,
                        overrides={"fail_regions_once": "3"},
                        scheduler_address=dask_cluster.scheduler_address)
    return run_dir, result


def test_flow_writes_a_labelled_store(first_run):
    run_dir, result = first_run
    ds = open_replay(os.path.join(run_dir, "replay"))
    # 2048 env steps = 4 iterations x 2 collectors x (8 envs x 32 steps)
    assert result["iterations"] == 4 and result["env_steps"] == 2048
    assert dict(ds.sizes) == {"step": 8 * 32, "env": 8, "agent": 3, "obs_dim": 75, "state_dim": 72, "n_actions": 8}
    assert ds.obs.dims == ("step", "env", "agent", "obs_dim")
    assert ds.state.dims == ("step", "env", "state_dim")
    assert ds.action.dims == ("step", "env", "agent") and ds.terminated.dims == ("step", "env")
    assert ds.truncated.dims == ds.first.dims == ("step", "env") and "done" not in ds
    assert ds.avail_actions.dims == ("step", "env", "agent", "n_actions")
    assert set(ds.coords) >= {"iteration", "collector", "param_version", "region"}
    attrs = ReplayStore.open(os.path.join(run_dir, "replay")).attrs
    assert attrs["env_id"] == "smax:3m" and attrs["algorithm"] == "qmix" and attrs["schema_version"] == 2
    assert result["final_eval"]["episodes"] == 16
    assert np.isfinite(result["history"][-1]["loss"])


def test_retried_collect_leaves_no_region_duplicated_or_missing(first_run):
    run_dir, _ = first_run
    assert os.path.exists(os.path.join(run_dir, "faults", "region-3")), "the fault was not injected"
    store = ReplayStore.open(os.path.join(run_dir, "replay"))
    regions = [r for r, _ in store.committed()]
    assert regions == list(range(8)) and store.total_regions_committed() == 8
    ds = open_replay(os.path.join(run_dir, "replay"))
    per_region = ds.region.to_series().value_counts()
    assert (per_region == 32).all() and len(per_region) == 8
    # region r = iteration * 2 + collector, each written by the collector that owns it
    pairs = {(int(r), int(i), int(c)) for r, i, c in zip(ds.region.values, ds.iteration.values, ds.collector.values)}
    assert pairs == {(i * 2 + c, i, c) for i in range(4) for c in range(2)}


def test_workers_forget_a_finished_run(first_run, dask_cluster):
    from distributed import Client

    run_dir, _ = first_run
    run_dir = os.path.abspath(run_dir)
    with Client(dask_cluster.scheduler_address) as client:
        keys = client.run(lambda: [k[1] for k in stages._STATES])
    assert keys and all(run_dir not in held for held in keys.values())


def test_flow_resumes_from_its_checkpoint(first_run, dask_cluster):
    from flows.train import marl_train

    run_dir, first = first_run
    result = marl_train(preset=TINY, run_dir=run_dir, env_steps=3072,
                        scheduler_address=dask_cluster.scheduler_address)
    assert result["resumed_from"] == first["iterations"] == 4
    assert result["iterations"] == 2 and result["env_steps"] == 3072
    assert [h["iteration"] for h in result["history"]] == [5, 6]
    store = ReplayStore.open(os.path.join(run_dir, "replay"))
    assert [r for r, _ in store.committed()] == list(range(12))
    # the learner continued from its checkpoint: its update counter carries on
    per_iteration = 2 * make_run_config(TINY).algo_config().updates_per_region
    assert first["history"][-1]["total_updates"] == 4 * per_iteration
    assert result["history"][0]["total_updates"] == 5 * per_iteration


def test_a_run_resumed_behind_its_replay_collects_the_later_regions_again(tmp_path, dask_cluster):
    """A run that collected past its last checkpoint (killed before the next one) has ring
    slots holding regions newer than the ones it resumes with: the resumed run forgets them
    and collects them again, each once, instead of refusing them as stale writes."""
    import shutil

    from flows.train import marl_train

    run_dir = str(tmp_path / "run")
    # 2 collectors, a ring of 2 slots, a checkpoint every iteration (orbax keeps the last 3)
    run = lambda: marl_train(preset="mappo-mpe-tiny", run_dir=run_dir, env_steps=1024,
                             overrides={"checkpoint_every": "1", "buffer_transitions": "256"},
                             scheduler_address=dask_cluster.scheduler_address)
    run()
    config = make_run_config("mappo-mpe-tiny", run_dir=run_dir)
    for step in ("3", "4"):  # as if killed after iteration 4's regions, before checkpoint 3
        shutil.rmtree(os.path.join(config.checkpoint_dir, step))
    result = run()
    assert result["resumed_from"] == 2 and [h["iteration"] for h in result["history"]] == [3, 4]
    store = ReplayStore.open(os.path.join(run_dir, "replay"))
    assert [r for r, _ in store.committed()] == [6, 7] and store.total_regions_committed() == 8
    assert store.verify()[0] == []


def test_a_killed_marl_train_process_resumes_with_every_region_once(tmp_path, prefect_server, dask_cluster):
    """SIGKILL to the whole `marl train` process group mid-run, then the same command again:
    it resumes from the last checkpoint and ends with every region committed once and the
    learner's update count exactly the regions' worth."""
    import signal
    import subprocess
    import sys
    import time

    from prefect.settings import PREFECT_API_URL

    from storage import Checkpointer

    iterations = 16
    config = make_run_config(TINY, run_dir=str(tmp_path / "killed"), total_env_steps=iterations * 512)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_HOME": str(tmp_path / "prefect")}
    command = [os.path.join(os.path.dirname(sys.executable), "marl"), "train", TINY, "--run-dir", config.run_dir,
               "--env-steps", str(iterations * 512), "--scheduler", dask_cluster.scheduler_address, "--quiet"]
    first = subprocess.Popen(command, env=env, cwd=tmp_path, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    steps = lambda: [int(d) for d in os.listdir(config.checkpoint_dir) if d.isdigit()] \
        if os.path.isdir(config.checkpoint_dir) else []
    deadline = time.time() + 300
    while first.poll() is None and time.time() < deadline and max(steps(), default=0) < 4:
        time.sleep(0.05)
    assert first.poll() is None, f"the run ended before it was killed: {first.stderr.read()}"
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    killed_at = max(steps())
    assert 4 <= killed_at < iterations
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    store = ReplayStore.open(config.store_path)
    assert [r for r, _ in store.committed()] == list(range(iterations * 2))
    with Checkpointer(config.checkpoint_dir) as checkpoints:
        state, meta = checkpoints.restore()
    per_iteration = 2 * make_run_config(TINY).algo_config().updates_per_region
    assert int(meta["iteration"]) == iterations and int(state["updates"]) == iterations * per_iteration


def _train_running(embedded_marl, run_dir, *args, ready=lambda run: True, **popen):
    """`marl train` of TINY on embedded Prefect, once it has written metrics.csv and `ready(run)` holds."""
    return embedded_marl("train", TINY, "--run-dir", str(run_dir), "--env-steps", str(64 * 512), "--quiet", *args,
                         ready=lambda run: (run_dir / "metrics.csv").exists() and ready(run), **popen)


@pytest.mark.parametrize("how, cluster", [("SIGTERM", "local"), ("SIGKILL", "scheduler")])
def test_a_stop_signalled_to_marl_train_s_group_takes_its_prefect_server_with_it(tmp_path, dask_cluster, embedded_marl,
                                                                                  how, cluster):
    """SIGTERM to the whole `marl train` process group mid-run, as `timeout`, Slurm and systemd
    send it: the run exits 143 with the one line saying how to resume (its temporary Prefect
    server, in a group of its own, outlives the signal to record the stop; in the run's group
    it died first and left a connection error's traceback), and nothing of the run is left
    after. SIGKILL to the group: the run cannot stop its server, and the kernel does."""
    import signal

    import psutil

    run_dir = tmp_path / "stopped"
    servers = lambda run: [p for p in psutil.Process(run.pid).children(recursive=True)
                           if "prefect.server.api.server" in " ".join(p.cmdline())]
    scheduler = ["--scheduler", dask_cluster.scheduler_address] if cluster == "scheduler" else []
    run = _train_running(embedded_marl, run_dir, *scheduler, ready=lambda run: bool(servers(run)),
                         start_new_session=True)
    left = [psutil.Process(run.pid), *psutil.Process(run.pid).children(recursive=True)]
    os.killpg(run.pid, getattr(signal, how))
    code = run.wait(timeout=120)
    err = run.stderr.read().decode()
    if how == "SIGTERM":
        assert code == 128 + signal.SIGTERM and "Traceback" not in err and "Restarting worker" not in err, err[-3000:]
        assert "caused the cluster to lose" not in err, err[-3000:]  # the closing cluster's lost results
        assert "Failed to communicate with scheduler" not in err, err[-3000:]  # a worker's, on it
        assert err.strip().splitlines()[-1] == \
            f"marl: stopped by SIGTERM; the same command resumes from {run_dir}'s last checkpoint"
    _, alive = psutil.wait_procs(left, timeout=30)
    assert not alive, f"left running after the run: {[p.cmdline()[:3] for p in alive]}"


def test_once_stopped_the_closing_cluster_s_lost_results_are_not_reported():
    """The scheduler's warning that removing a worker lost computed results is shown while a
    run goes on (a worker died), and dropped once SIGTERM or Ctrl-C has stopped the run: its
    cluster then closes with stages in flight, which the resumed run does again."""
    import subprocess
    import sys

    script = """
import logging, os, signal
import distributed  # its log format, as in a run
from flows import cli
cli._embedded_defaults()
log = logging.getLogger("distributed.scheduler")
lost = "Removing worker 'tcp://127.0.0.1:1' caused the cluster to lose already computed task(s), which will be recomputed elsewhere: {'train-1'}"
log.warning(lost + " (running)")
for sig, stop in ((signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, cli.Terminated)):
    cli.STOPPING.clear()
    try:
        os.kill(os.getpid(), sig)
    except stop:
        log.warning(lost + f" (after {sig.name})")
        log.warning(f"another warning after {sig.name}")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lost_note = ("Removing worker 'tcp://127.0.0.1:1' caused the cluster to lose already computed task(s), "
                 "which will be recomputed elsewhere: {'train-1'}")
    shown = [line.split(" - ")[-1] for line in done.stderr.splitlines() if "distributed.scheduler" in line]
    assert shown == [lost_note + " (running)", "another warning after SIGINT", "another warning after SIGTERM"], \
        done.stderr[-3000:]


def test_a_worker_signalled_to_stop_does_not_report_its_heartbeat_to_the_closed_scheduler():
    """In a local cluster's worker process (IgnoreGroupStops set up there), a heartbeat that
    fails on the scheduler is logged while the run goes on, and not once the group's SIGINT or
    SIGTERM has come: the closing scheduler is then the stop. Other worker errors still show."""
    import subprocess
    import sys

    script = """
import logging, os, signal
import distributed  # its log format, as in a worker
from pipelines import cluster
plugin = cluster.IgnoreGroupStops()
plugin.client_pid = -1  # as in a worker process, not the client's
plugin.setup(None)
log = logging.getLogger("distributed.worker")
def heartbeat_lost(when):
    try:
        raise OSError("Stream is closed")
    except OSError:
        log.exception("Failed to communicate with scheduler during heartbeat. " + when)
heartbeat_lost("(running)")
for sig in (signal.SIGINT, signal.SIGTERM):
    cluster.GROUP_STOP.clear()
    os.kill(os.getpid(), sig)  # ignored but noted (SIGTERM: ends the worker 60 s later)
    heartbeat_lost(f"(after {sig.name})")
    log.error(f"another error after {sig.name}")
signal.alarm(0)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    shown = [line.split(" - ")[-1] for line in done.stderr.splitlines() if "distributed.worker" in line]
    assert shown == ["Failed to communicate with scheduler during heartbeat. (running)",
                     "another error after SIGINT", "another error after SIGTERM"], done.stderr[-3000:]
    assert done.stderr.count("Traceback") == 1, done.stderr[-3000:]


@pytest.mark.parametrize("cluster", ["scheduler", "local"])
def test_a_ctrl_c_to_marl_train_stops_it_with_one_line(tmp_path, dask_cluster, embedded_marl, cluster):
    """Ctrl-C in a terminal signals the whole foreground process group: the run, Prefect's
    temporary server and, on the embedded default, the local cluster's workers. The run still
    exits 130 with the one line saying how to resume; its server outlives the signal to
    record the stop (a server gone first left a connection error), its workers too (each
    died with a traceback of its own); and nothing of the group is left after."""
    import signal
    import subprocess

    import psutil

    run_dir = tmp_path / "interrupted"
    scheduler = ["--scheduler", dask_cluster.scheduler_address] if cluster == "scheduler" else []
    # its own group with SIGINT at its default, as a terminal's foreground job (pytest started
    # as a background job of a shell without job control would hand it SIGINT ignored)
    run = _train_running(embedded_marl, run_dir, *scheduler, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    group = [psutil.Process(run.pid), *psutil.Process(run.pid).children(recursive=True)]
    os.killpg(run.pid, signal.SIGINT)
    try:
        code = run.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        pytest.fail(f"no exit 120 s after Ctrl-C: {run.stderr.read().decode()[-3000:]}")
    err = run.stderr.read().decode()
    assert code == 130 and "Traceback" not in err and "CancelledError" not in err, err[-3000:]
    assert "caused the cluster to lose" not in err, err[-3000:]
    assert "Failed to communicate with scheduler" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == f"marl: stopped by Ctrl-C; the same command resumes from {run_dir}'s last checkpoint"
    _, alive = psutil.wait_procs(group, timeout=30)
    assert not alive, f"left running after the run: {[p.cmdline()[:3] for p in alive]}"


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(env="smax:4m"), EnvError, "unknown env id 'smax:4m'"),
    (dict(preset="qmix-smax"), ConfigError, "unknown preset 'qmix-smax'"),
    (dict(overrides={"lrr": "1"}), ConfigError, "unknown setting 'lrr'"),
    (dict(overrides={"hidden": "wide"}), ConfigError, "not a valid int"),
    (dict(env="smax:2s3z"), InputError, "have env_id=smax:3m; want env_id=smax:2s3z"),
])
def test_bad_input_is_refused_and_the_store_stays_readable(first_run, dask_cluster, kwargs, error, words):
    from flows.train import marl_train

    run_dir, _ = first_run
    store_path = os.path.join(run_dir, "replay")
    before = open_replay(store_path)
    args = dict(preset=TINY, run_dir=run_dir, env_steps=4096, scheduler_address=dask_cluster.scheduler_address)
    with pytest.raises(error, match=words) as err:
        marl_train(**{**args, **kwargs})
    assert "\n" not in str(err.value)
    after = open_replay(store_path)
    assert after.sizes == before.sizes
    np.testing.assert_array_equal(after.obs.values, before.obs.values)


def test_cli_trains_and_reports_paths(tmp_path, prefect_server, dask_cluster, capsys):
    from flows.cli import main

    run_dir = tmp_path / "cli-run"
    code = main(["train", TINY, "--env-steps", "1024", "--run-dir", str(run_dir),
                 "--scheduler", dask_cluster.scheduler_address, "--set", "eval_every=1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "test win" in out and "replay store:" in out and "checkpoints:" in out
    assert main(["replay", "info", str(run_dir / "replay")]) == 0
    info = capsys.readouterr().out
    assert "env smax:3m" in info and "4 regions" in info
    assert main(["train", "no-such-preset"]) == 2
    assert "unknown preset 'no-such-preset'" in capsys.readouterr().err


def test_runs_started_together_on_a_fresh_prefect_home_create_its_database_once(tmp_path, embedded_env):
    """Two processes that start embedded runs at once on a new home: one creates the
    database under the home's lock, the other finds it made (each migrating it at once
    failed one run's temporary server)."""
    import sqlite3
    import subprocess
    import sys

    home = tmp_path / "prefect"  # embedded_env's
    command = [sys.executable, "-c", "from flows.cli import migrate_embedded_home; migrate_embedded_home()"]
    runs = [subprocess.Popen(command, env=embedded_env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for run in runs:
        assert run.wait(timeout=300) == 0, run.stderr.read()
    with sqlite3.connect(home / "prefect.db") as db:
        assert len(db.execute("select version_num from alembic_version").fetchall()) == 1
        assert db.execute("select count(*) from sqlite_master where name = 'flow_run'").fetchone()[0] == 1


def test_the_training_loop_runs_without_prefect(tmp_path, dask_cluster):
    """A machine without Prefect (the device machine) runs the same loop: flows.training in a
    process where importing prefect fails, on the real cluster, writes the run's metrics and
    checkpoint; bench/smax_maps.py loads there too (its --orchestrator none)."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    script = f"""
import sys
sys.modules["prefect"] = None  # an import of prefect now raises ImportError
from flows.training import run_training
from pipelines.config import make_run_config
config = make_run_config({TINY!r}, run_dir={str(run_dir)!r}, total_env_steps=1024)
result = run_training(config, scheduler_address={dask_cluster.scheduler_address!r})
print("iterations", result["iterations"], "env_steps", result["env_steps"])
import runpy
runpy.run_path("bench/smax_maps.py")  # its imports, not its main
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "iterations 2 env_steps 1024" in done.stdout
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("iteration,env_steps") and len(rows) == 3
    # beside the loss, the rest of what the learner reported, under train/
    header = rows[0].split(",")
    assert {"loss", "train/q_tot", "train/td_abs", "train/grad_norm", "train/lr"} <= set(header), header
    assert "train/loss" not in header
    assert os.listdir(run_dir / "checkpoints")
