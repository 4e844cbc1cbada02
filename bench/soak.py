"""Soak run (issue 17): `marl train qmix-smac` on a Dask scheduler and 4 single-threaded
workers of its own (every listener on 127.0.0.1), with a random worker SIGKILLed every
--kill-every seconds and a fresh worker started in its place, for --minutes; then checks:

- the run finished: `marl train` exited 0 and its last checkpoint is its last iteration;
- every region exactly once: the store's commit log holds regions 0..R-1, each once, and
  `marl replay verify` finds no damage;
- the update count exact: the last checkpoint's `updates` equals what the preset's
  settings give for its iterations (updates_per_region per region once learning_starts
  env steps are stored), so no iteration was trained twice into the final state or skipped.

The run stops itself at --minutes (`--set max_wall_s`), so the kills hit collectors, the
evaluator and the learner (which moves from its last checkpoint, at most 3 times a run: a
fourth kill of the learner's worker stops the run in one line, by design). max_wall_s counts
from the run's start across moves. Kills happen only within the first --minutes.
This is a script, not a test: it takes as long as it is told.

    python bench/soak.py [--minutes 20] [--kill-every 120] [--workers 4] [--seed 0] [--learner-every N]

--learner-every N makes every Nth kill the learner's worker (the worker running or holding a
`train` task), so a soak covers learner moves whatever the random draws; the others stay random.

Writes bench/results/soak-<minutes>m.{json,md}; the run dir goes to a temp dir (removed
unless --keep).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "bench", "results")
PRESET = "qmix-smac"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    from pipelines.cluster import SCHEDULER_CONFIG, worker_environment

    env = {**os.environ, **worker_environment(),
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    env.update({"DASK_" + k.upper().replace(".", "__").replace("-", "_"): str(v)
                for k, v in SCHEDULER_CONFIG.items()})
    return env


def _spawn(cmd: list[str], log: str, env: dict) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _worker(address: str, work: str, n: int, env: dict) -> subprocess.Popen:
    # no nanny: a SIGKILL ends the worker for good, and the soak starts the replacement
    return _spawn([sys.executable, "-m", "dask", "worker", address, "--host", "127.0.0.1", "--nthreads", "1",
                   "--no-nanny", "--no-dashboard", "--dashboard-address", "127.0.0.1:0", "--resources", "cpu=1",
                   "--local-directory", os.path.join(work, "dask"), "--name", f"soak-{n}"],
                  os.path.join(work, f"worker-{n}.log"), env)


def _n_workers(address: str) -> int:
    from distributed import Client

    from pipelines.cluster import workers

    with Client(address, timeout=30) as client:
        return len(workers(client))


def _roles(address: str) -> dict[str, list[str]]:
    """Worker name -> the task prefixes it runs or holds results of now (a worker holding
    `train` is the learner's)."""
    from distributed import Client

    def roles(dask_scheduler):
        return {ws.name: sorted({ts.prefix.name for ts in (*ws.processing, *ws.has_what)})
                for ws in dask_scheduler.workers.values()}

    try:
        with Client(address, timeout=30) as client:
            return client.run_on_scheduler(roles)
    except Exception as e:  # a busy scheduler: the kill goes on without the roles
        return {"?": [f"{type(e).__name__}: {e}"]}


def expected_updates(config, iterations: int) -> int:
    """The learner's update count after `iterations` iterations, from the preset's settings
    (pipelines/stages.py train: updates_per_region per region once learning_starts env steps
    are in its ring mirror)."""
    algo = config.algo_config()
    upr = getattr(algo, "updates_per_region", 1)
    starts = getattr(algo, "learning_starts", 0)
    slots = config.n_slots
    total = 0
    for i in range(iterations):
        mirrored = min((i + 1) * config.n_collectors, slots)
        if mirrored * config.steps_per_region * config.envs_per_collector >= starts:  # as stages.train
            total += config.n_collectors * upr
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--kill-every", type=float, default=120.0, help="seconds between SIGKILLs (default 120)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="seed of the choice of worker to kill")
    ap.add_argument("--learner-every", type=int, default=0,
                    help="every Nth kill is the learner's worker (default 0: every kill random)")
    ap.add_argument("--keep", action="store_true", help="keep the run dir and logs")
    args = ap.parse_args(argv)

    from pipelines.config import RunConfig
    from storage import Checkpointer, ReplayStore

    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="marl-soak-")
    run_dir = os.path.join(work, "run")
    env = _env()
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []
    kills: list[dict] = []
    started = time.time()
    try:
        scheduler = _spawn([sys.executable, "-m", "dask", "scheduler", "--host", "127.0.0.1", "--port", str(port),
                            "--dashboard-address", "127.0.0.1:0"], os.path.join(work, "scheduler.log"), env)
        workers = [_worker(address, work, n, env) for n in range(args.workers)]
        names = {w.pid: f"soak-{n}" for n, w in enumerate(workers)}
        procs += [scheduler, *workers]
        deadline = time.monotonic() + 180
        while True:
            try:
                if _n_workers(address) >= args.workers:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"soak: the cluster did not come up; see {work}")
            time.sleep(1)
        cmd = [sys.executable, "-m", "flows.cli", "train", PRESET, "--run-dir", run_dir, "--scheduler", address,
               "--set", f"max_wall_s={args.minutes * 60:.0f}", "--quiet"]
        train = _spawn(cmd, os.path.join(work, "train.log"), env)
        procs.append(train)
        t0 = time.monotonic()
        next_kill = t0 + args.kill_every
        n = args.workers
        while train.poll() is None:
            # kills only within --minutes (the run's max_wall_s, counted from its start)
            if time.monotonic() >= next_kill and next_kill - t0 < args.minutes * 60:
                live = [w for w in workers if w.poll() is None]
                victim = rng.choice(live)
                roles = _roles(address)
                if args.learner_every and (len(kills) + 1) % args.learner_every == 0:
                    for _ in range(50):  # until a train task shows which worker is the learner's
                        learner = [w for w in live if "train" in roles.get(names[w.pid], [])]
                        if learner:
                            victim = learner[0]
                            break
                        time.sleep(0.2)
                        roles = _roles(address)
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait()
                replacement = _worker(address, work, n, env)
                n += 1
                workers = [w for w in workers if w is not victim] + [replacement]
                procs.append(replacement)
                name = names.pop(victim.pid)
                names[replacement.pid] = f"soak-{n - 1}"
                kills.append({"at_s": round(time.monotonic() - t0, 1), "worker": name, "pid": victim.pid,
                              "held": roles.get(name, []), "replacement": f"soak-{n - 1}"})
                print(f"soak: {kills[-1]['at_s']:.0f} s: SIGKILL {name} (pid {victim.pid}, held "
                      f"{kills[-1]['held']}), started soak-{n - 1}", flush=True)
                next_kill += args.kill_every
            time.sleep(1)
        wall = time.monotonic() - t0
        with open(os.path.join(work, "train.log")) as f:
            train_log = f.read()

        # --- the checks
        store = ReplayStore.open(os.path.join(run_dir, "replay"))
        config = RunConfig(**store.attrs["config"])  # as run (its ring fitted to the learner's memory)
        committed = sorted(r for r, _ in store.committed())
        damage, _ = store.verify()
        history = sorted(int(f) for f in os.listdir(os.path.join(run_dir, "replay", "commits")) if f.isdigit())
        with Checkpointer(os.path.join(run_dir, "checkpoints")) as checkpoints:
            state, meta = checkpoints.restore()
        iterations = int(meta["iteration"])
        updates = int(np.max(np.asarray(state["updates"])))  # per seed: one seed here
        want_updates = expected_updates(config, iterations)
        regions = iterations * config.n_collectors
        # the learner's worker runs prepare_run and train (results it may still hold)
        learner_kills = sum(bool({"train", "prepare_run"} & set(k["held"])) for k in kills)
        checks = {
            "finished": train.returncode == 0,
            # each region id committed (one marker each, none missing, none extra); the ring
            # holds the last n_slots of them
            "every_region_once": history == list(range(regions))
            and committed == list(range(max(0, regions - store.n_slots), regions)),
            "replay_verifies_clean": not damage,
            "updates_exact": updates == want_updates,
        }
        result = {
            "command": "python bench/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "preset": PRESET, "minutes": args.minutes, "kill_every_s": args.kill_every,
            "workers": args.workers, "train_wall_s": round(wall, 1), "exit_code": train.returncode,
            "kills": kills, "iterations": iterations, "env_steps": int(meta.get("env_steps", 0)),
            "regions_committed": len(committed), "regions_expected": regions,
            "commit_markers": len(history), "damage": len(damage),
            "updates": updates, "updates_expected": want_updates, "learner_kills": learner_kills,
            "checks": checks, "ok": all(checks.values()),
            "last_lines": [line for line in train_log.splitlines() if line.strip()][-5:],
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
            "load_at_end": os.getloadavg()[0],
        }
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"soak: run dir and logs kept in {work}")

    os.makedirs(RESULTS, exist_ok=True)
    name = f"soak-{args.minutes:g}m" + (f"-learner{args.learner_every}" if args.learner_every else "")
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    rows = "\n".join(f"| {k} | {'yes' if v else 'NO'} |" for k, v in checks.items())
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        targeted = f", every {args.learner_every}th the learner's" if args.learner_every else ""
        f.write(f"# Soak: {PRESET}, {args.minutes:g} min, a random worker of {args.workers} SIGKILLed every "
                f"{args.kill_every:g} s{targeted}\n\n`{result['command']}` ({result['date']})\n\n"
                f"{len(kills)} kills; {iterations} iterations, {result['env_steps']:,} env steps, "
                f"{len(history)} commit markers (expected {regions}; the ring holds the last {len(committed)}), "
                f"{learner_kills} kills of the learner's worker, updates {updates} "
                f"(expected {want_updates}), exit {train.returncode}, {wall:.0f} s\n\n"
                f"| check | passed |\n|---|---|\n{rows}\n")
    print(json.dumps({k: result[k] for k in ("checks", "ok", "iterations", "updates", "updates_expected",
                                             "regions_committed", "kills", "train_wall_s")}, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
