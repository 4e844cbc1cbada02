"""Bad input is refused before anything runs or is written (issue 17, item 2).

A table of bad inputs across `marl train`, `marl replay ...`, `marl stack ...`, `marl
benchmark` and the `marl-train` flow's parameters. Each CLI case runs as a real subprocess
and must exit non-zero with at most two lines of output, no traceback, and leave an
existing run dir byte for byte as it was (and create nothing it names). The cases run in
parallel threads: each is a process that mostly imports, so the table takes about as long
as its slowest few cases, not their sum.

Also: an error raised inside a Dask task reaches the user as one line naming the stage,
with the full traceback in a log file under the run dir.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import socket
import subprocess
import sys
import textwrap

import pytest

TINY = "qmix-smac-tiny"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Case:
    """`marl ARGS` must fail with an answer that contains `says` (RUN, NEW and the other
    {placeholders} are filled in per test run); NEW must not exist afterwards."""

    args: str
    says: str


CASES = {
    # marl train: options, --set values, combinations, resuming with other settings
    "train-no-preset": Case("train", "required: preset"),
    "train-workers-0": Case("train {TINY} --run-dir {RUN} --workers 0", "--workers 0 must be >= 1"),
    "train-workers-not-int": Case("train {TINY} --run-dir {RUN} --workers two", "invalid int value"),
    "train-seeds-0": Case("train {TINY} --run-dir {RUN} --seeds 0", "--seeds 0 must be >= 1"),
    "train-env-steps-negative": Case("train {TINY} --run-dir {RUN} --env-steps -5", "--env-steps -5 must be >= 1"),
    "train-collectors-0": Case("train {TINY} --run-dir {NEW} --collectors 0", "--collectors 0 must be >= 1"),
    "train-unknown-preset": Case("train qmix-nope --run-dir {RUN}", "unknown preset 'qmix-nope'"),
    "train-unknown-env": Case("train {TINY} --run-dir {NEW} --env smax:9z", "unknown env id 'smax:9z'"),
    "train-negative-hidden": Case("train {TINY} --run-dir {RUN} --set hidden=-4", "hidden=-4 must be >= 1"),
    "train-batch-size-0": Case("train {TINY} --run-dir {RUN} --set batch_size=0", "batch_size=0 must be >= 1"),
    "train-negative-lr": Case("train {TINY} --run-dir {RUN} --set lr=-0.001", "must be > 0"),
    "train-gamma-above-1": Case("train {TINY} --run-dir {NEW} --set gamma=1.5", "gamma=1.5 must be in [0, 1]"),
    "train-lr-not-a-number": Case("train {TINY} --run-dir {RUN} --set lr=fast", "is not a valid float"),
    "train-unknown-setting": Case("train {TINY} --run-dir {RUN} --set nosuch=1", "unknown setting 'nosuch'"),
    "train-set-without-value": Case("train {TINY} --run-dir {RUN} --set hidden", "write --set key=value"),
    "train-unknown-mixer": Case("train {TINY} --run-dir {NEW} --set mixer=max", "mixer='max' is not one of"),
    "train-seq-len-over-region": Case("train {TINY} --run-dir {RUN} --set seq_len=64", "exceeds steps_per_region"),
    "train-minibatches-vs-envs": Case("train mappo-mpe-tiny --run-dir {NEW} --set minibatches=3",
                                      "does not divide the 16 envs"),
    "train-negative-wall-time": Case("train {TINY} --run-dir {RUN} --set max_wall_s=-1", "max_wall_s=-1.0 must be >= 0"),
    "train-negative-seed": Case("train {TINY} --run-dir {NEW} --seed -1", "seed=-1 must be in"),
    "train-env-kwargs-not-object": Case("train {TINY} --run-dir {NEW} --set env_kwargs=[1]", "must be a JSON object"),
    "train-bad-fault-regions": Case("train {TINY} --run-dir {RUN} --set fail_regions_once=x", "must list region ids"),
    "train-scheduler-malformed": Case("train {TINY} --run-dir {RUN} --scheduler tcp//nowhere",
                                      "is not a Dask scheduler address"),
    "train-scheduler-unreachable": Case("train {TINY} --run-dir {RUN} --scheduler tcp://127.0.0.1:{CLOSED_PORT}",
                                        "no scheduler reachable"),
    "train-scheduler-and-workers": Case("train {TINY} --run-dir {RUN} --scheduler tcp://127.0.0.1:{CLOSED_PORT} "
                                        "--workers 3", "leave out one of them"),
    "train-unknown-cluster": Case("train {TINY} --run-dir {RUN} --cluster kubernetes", "is not a cluster kind"),
    "train-cluster-and-scheduler": Case("train {TINY} --run-dir {RUN} --cluster threads --scheduler "
                                        "tcp://127.0.0.1:{CLOSED_PORT}", "leave out one of them"),
    "train-run-dir-is-a-file": Case("train {TINY} --run-dir {RUN}/replay/zarr.json", "is a file"),
    "train-run-dir-under-a-file": Case("train {TINY} --run-dir {RUN}/replay/zarr.json/run", "which is a file"),
    "train-resume-other-preset": Case("train vdn-smax --run-dir {RUN}", "have preset=qmix-smac-tiny algo=qmix"),
    "train-resume-other-env": Case("train {TINY} --run-dir {RUN} --env smax:2s3z", "have env_id=smax:3m; want env_id=smax:2s3z"),
    "train-resume-other-hidden": Case("train {TINY} --run-dir {RUN} --set hidden=32", "have hidden=16; want hidden=32"),
    "train-unknown-env-kwarg": Case("train maddpg-mpe-tiny --run-dir {NEW} --set env_kwargs='{{\"max_step\": 9}}'",
                                    "unknown env kwarg(s) max_step"),
    "train-smax-continuous-actions": Case("train maddpg-mpe-tiny --run-dir {NEW} --env smax:3m",
                                          "smax:3m: bad env kwarg (Unknown action_type"),
    "train-qmix-on-continuous-env": Case(
        "train {TINY} --run-dir {NEW} --env mpe:simple_spread --set env_kwargs={CONTINUOUS}",
        "qmix needs discrete actions and mpe:simple_spread has continuous ones"),
    # marl replay ...
    "replay-no-subcommand": Case("replay", "required: replay_command"),
    "replay-info-missing-path": Case("replay info {NEW}", "no replay store at"),
    "replay-info-of-a-file": Case("replay info {RUN}/replay/zarr.json", "no replay store at"),
    "replay-episodes-bad-by": Case("replay episodes {RUN} --by agent", "invalid choice: 'agent'"),
    "replay-episodes-csv-into-store": Case("replay episodes {RUN} --csv {RUN}/replay/zarr.json", "lies inside the replay store"),
    "replay-episodes-csv-is-a-dir": Case("replay episodes {RUN} --csv {RUN}", "is a directory"),
    "replay-reanalyze-no-run": Case("replay reanalyze", "give a run dir"),
    "replay-reanalyze-no-such-checkpoint": Case("replay reanalyze {RUN} --checkpoint 999", "no checkpoint for step 999"),
    "replay-reanalyze-negative-checkpoint": Case("replay reanalyze {RUN} --checkpoint -1", "--checkpoint -1 must be >= 0"),
    "replay-reanalyze-workers-0": Case("replay reanalyze {RUN} --workers 0", "--workers 0 must be >= 1"),
    "replay-reanalyze-out-into-store": Case("replay reanalyze {RUN} --out {RUN}/replay/scores", "lies inside the replay store"),
    "replay-export-bad-dataset-id": Case("replay export {RUN} --minari 'not an id' --out {NEW}", "bad Minari dataset id"),
    "replay-export-out-into-store": Case("replay export {RUN} --minari marl/x-v0 --out {RUN}/replay/minari",
                                         "lies inside the replay store"),
    # marl stack ...
    "stack-no-subcommand": Case("stack", "required: stack_command"),
    "stack-up-home-is-a-file": Case("stack up --home {RUN}/replay/zarr.json", "is a file"),
    "stack-status-home-is-a-file": Case("stack status --home {RUN}/replay/zarr.json", "is not a directory"),
    "stack-down-home-is-a-file": Case("stack down --home {RUN}/replay/zarr.json", "is not a directory"),
    "stack-up-port-out-of-range": Case("stack up --home {NEW} --prefect-port 70000", "is not a port"),
    "stack-up-same-ports": Case("stack up --home {NEW} --prefect-port 4300 --scheduler-port 4300", "the ports must differ"),
    "stack-up-workers-0": Case("stack up --home {NEW} --workers 0", "--workers 0: give at least 1"),
    "stack-up-port-in-use": Case("stack up --home {NEW} --dashboard-port {BUSY_PORT}", "is in use by another process"),
    # marl benchmark
    "benchmark-unknown-suite": Case("benchmark --suites nope --results-dir {NEW}", "unknown benchmark suite 'nope'"),
    "benchmark-env-steps-0": Case("benchmark --env-steps 0 --results-dir {NEW}", "--env-steps 0 must be >= 1"),
    "benchmark-negative-wall-time": Case("benchmark --max-wall-s -1 --results-dir {NEW}", "--max-wall-s -1.0 must be > 0"),
    "benchmark-results-dir-is-a-file": Case("benchmark --results-dir {RUN}/replay/zarr.json", "is a file"),
}

# the flow's parameters, called as the flow function (its body: what a deployment run executes)
FLOW_CASES = {
    "flow-workers-0": (dict(n_workers=0), "--workers 0 must be >= 1"),
    "flow-seeds-0": (dict(seeds=0), "n_seeds=0 must be >= 1"),
    "flow-negative-hidden": (dict(overrides={"hidden": -1}), "hidden=-1 must be >= 1"),
    "flow-env-steps-not-int": (dict(env_steps="many"), "total_env_steps='many' is not a valid int"),
    "flow-overrides-not-a-dict": (dict(overrides="lr=0.1"), "must be a dict"),
    "flow-scheduler-malformed": (dict(scheduler_address="nowhere"), "is not a Dask scheduler address"),
    "flow-unknown-preset": (dict(preset="nope"), "unknown preset 'nope'"),
    "flow-resume-other-hidden": (dict(overrides={"hidden": "32"}), "have hidden=16; want hidden=32"),
}


def tree_digest(path: str) -> dict[str, str]:
    """Every file under `path` (relative name -> sha256 of its bytes), and every directory."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        rel = os.path.relpath(dirpath, path)
        out[rel + "/"] = "dir"
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                out[os.path.join(rel, name)] = hashlib.sha256(f.read()).hexdigest()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> str:
    """A small valid run dir of the tiny preset: one iteration (two regions) collected and
    trained, its store and checkpoint on disk. Built with the stages as plain functions: no
    cluster, no Prefect."""
    from pipelines import stages
    from pipelines.config import make_run_config

    path = str(tmp_path_factory.mktemp("bad-input") / "run")
    config = make_run_config(TINY, run_dir=path, total_env_steps=512)
    cfg = config.to_dict()
    stages.prepare_run(cfg)
    params = stages.policy_params(cfg)
    collected = [stages.collect(cfg, c, 0, params, 0, 0) for c in range(config.n_collectors)]
    stages.train(cfg, 0, config.steps_per_iteration, True, collected)
    stages.clear_caches()
    assert os.path.isdir(os.path.join(path, "checkpoints", "1"))
    return path


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def answers(run_dir, tmp_path_factory):
    """Runs every CLI case (in parallel threads); returns name -> (case, proc, run dir
    digest after it, whether NEW was left existing)."""
    work = tmp_path_factory.mktemp("bad-input-cwd")  # default run dirs, .prefect: not the repo
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    values = dict(TINY=TINY, RUN=run_dir, CLOSED_PORT=free_port(), BUSY_PORT=busy.getsockname()[1],
                  CONTINUOUS="'{\"action_type\": \"Continuous\"}'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    env.pop("MARL_DASK_SCHEDULER", None)

    def run(name: str, case: Case):
        new = str(work / f"new-{name}")
        args = case.args.format(NEW=new, **values)
        proc = subprocess.run(f"{sys.executable} -m flows.cli {args}", shell=True, cwd=work, env=env,
                              capture_output=True, text=True, timeout=120)
        return name, (case, args, proc, tree_digest(run_dir), os.path.exists(new))

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=(os.cpu_count() or 2) + 2) as pool:
            return dict(pool.map(lambda item: run(*item), CASES.items()))
    finally:
        busy.close()


@pytest.fixture(scope="module")
def original(run_dir):
    return tree_digest(run_dir)


@pytest.mark.parametrize("name", list(CASES))
def test_cli_refuses_bad_input_in_one_line(name, answers, original):
    case, args, proc, digest_after, new_exists = answers[name]
    output = proc.stdout + proc.stderr
    label = f"marl {args}"
    assert proc.returncode != 0, f"{label} exited 0:\n{output}"
    assert "Traceback" not in output, f"{label} printed a traceback:\n{output}"
    assert len(_lines(output)) <= 2, f"{label} printed more than 2 lines:\n{output}"
    assert case.says in output, f"{label} did not say {case.says!r}:\n{output}"
    assert digest_after == original, f"{label} changed the run dir"
    assert not new_exists, f"{label} created the path it was given"


@pytest.mark.parametrize("name", list(FLOW_CASES))
def test_flow_refuses_bad_parameters_before_anything_runs(name, run_dir, original):
    from flows.train import marl_train

    params, says = FLOW_CASES[name]
    params = {"preset": TINY, "run_dir": run_dir, **params}
    # .fn: the flow's body as a deployment run executes it, here without a Prefect server
    with pytest.raises(ValueError) as raised:
        marl_train.fn(**params)
    message = str(raised.value)
    assert says in message and "\n" not in message, message
    assert tree_digest(run_dir) == original


def test_every_numeric_algorithm_setting_has_a_range():
    from marl import algos

    for name, (module, _) in algos.ALGORITHMS.items():
        for field in dataclasses.fields(module.Config):
            if field.type in ("int", "float"):
                assert field.name in algos.RANGES, f"{name}: give {field.name} a range in marl.algos.RANGES"
            if field.type == "str":
                assert field.name in algos.CHOICES, f"{name}: give {field.name} its choices in marl.algos.CHOICES"


BAD_ENV = textwrap.dedent('''
    """A PettingZoo parallel env that builds and resets but fails on its first step."""
    import numpy as np
    from gymnasium import spaces


    class BadEnv:
        metadata = {"name": "badenv"}
        max_cycles = 10

        def __init__(self):
            self.possible_agents = ["a0", "a1"]
            self.agents = list(self.possible_agents)

        def observation_space(self, agent):
            return spaces.Box(-1.0, 1.0, (3,), np.float32)

        def action_space(self, agent):
            return spaces.Discrete(2)

        def reset(self, seed=None, options=None):
            self.agents = list(self.possible_agents)
            return {a: np.zeros(3, np.float32) for a in self.agents}, {a: {} for a in self.agents}

        def step(self, actions):
            raise RuntimeError("badenv cannot step")

        def close(self):
            pass


    def parallel_env():
        return BadEnv()
''')


def test_an_error_inside_a_task_is_one_line_and_a_log_file(tmp_path):
    """A user env that fails on its first step: valid when the run is checked (it builds
    and resets), fails inside every collect task (retried, then given up)."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "badenv.py").write_text(BAD_ENV)
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, str(tmp_path / "mods")) if p)}
    env.pop("MARL_DASK_SCHEDULER", None)
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "train", "mappo-mpe-tiny", "--env",
                           "pz:badenv.parallel_env", "--run-dir", str(run), "--env-steps", "256", "--workers", "1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert "Traceback" not in output and "Compute Failed" not in output, output
    errors = _lines(proc.stderr)
    assert len(errors) == 1 and len(_lines(output)) <= 2, output
    assert errors[0].startswith("marl: the collect stage failed: RuntimeError: badenv cannot step;"), output
    logs = os.listdir(run / "logs")
    assert len(logs) == 1 and str(run / "logs" / logs[0]) in errors[0]
    log = (run / "logs" / logs[0]).read_text()
    assert "Traceback" in log and "badenv cannot step" in log and "pipelines/stages.py" in log
