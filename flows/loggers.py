"""Per-iteration metrics where researchers compare runs: CSV (on by default), TensorBoard,
MLflow and Weights & Biases.

    loggers = open_loggers(["csv", "tensorboard"], run_dir, start_iteration, config)
    for row in rows: [lg.log(row) for lg in loggers]        # one row per iteration
    [lg.finish(result) for lg in loggers]                   # a run that ended
    [lg.close() for lg in loggers]

A resumed run (start_iteration > 0, its checkpoint's iteration) appends: rows logged after
that checkpoint by the interrupted run are dropped first, so every iteration is in the
files exactly once. MLflow and W&B cannot take a logged value back, so they are sent a row
only once its iteration is in a checkpoint (every checkpoint_every iterations and at the
end): what an interrupted run trained after its last checkpoint never reaches them, and the
resumed run sends those iterations as it trains them again. Rows of metrics.csv up to the
checkpoint that a backend has not had yet (the logger newly enabled on a resumed run, or a
run stopped before it sent them) are sent when it opens, so each backend ends with the rows
of metrics.csv.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
from pathlib import Path

from flows.checks import InputError, one_line

# logger -> (module it needs, the pyproject extra that installs it)
LOGGERS = {"csv": (None, None), "tensorboard": ("tensorboardX", "tensorboard"), "mlflow": ("mlflow", "mlflow"),
           "wandb": ("wandb", "wandb")}
DEFAULT = ("csv",)
PIP_NAMES = {"mlflow": "mlflow-skinny"}  # the smallest distribution with the module


def parse_loggers(value) -> list[str]:
    """["csv", ...] from "csv,tensorboard" or a list; InputError (one line) for an unknown
    logger or one whose package is not installed."""
    if value is None:
        return list(DEFAULT)
    names = value.split(",") if isinstance(value, str) else list(value)
    names = [str(n).strip() for n in names if str(n).strip()]
    for name in names:
        if name not in LOGGERS:
            raise InputError(f"unknown logger {name!r}; valid: {', '.join(LOGGERS)}, e.g. --logger csv,tensorboard")
        module, extra = LOGGERS[name]
        if module and importlib.util.find_spec(module) is None:
            raise InputError(f"logger {name} needs {module}, which is not installed; "
                             f"pip install 'marl-dataflow[{extra}]' (or pip install {PIP_NAMES.get(module, module)})")
    return list(dict.fromkeys(names))


def _flat(row: dict) -> dict:
    """The row's scalars as they are, lists (per-seed values) as JSON; other values left out."""
    out = {}
    for k, v in row.items():
        if isinstance(v, (bool, int, float, str)) or v is None:
            out[k] = v
        elif isinstance(v, (list, tuple)):
            out[k] = json.dumps(v)
    return out


def _iteration(row: dict) -> float:
    """A stored row's iteration; a row without one (a torn last line) sorts after every checkpoint."""
    try:
        return int(row.get("iteration") or "")
    except ValueError:
        return math.inf


class CSVLogger:
    """<run_dir>/metrics.csv, one row per iteration; the header grows when a later row has
    new columns (the evaluated iterations), by rewriting the (small) file."""

    def __init__(self, run_dir: str, start_iteration: int, config: dict | None = None):
        self.path = os.path.join(run_dir, "metrics.csv")
        self.rows: list[dict] = []
        if os.path.exists(self.path):
            with open(self.path, newline="") as f:
                self.rows = [r for r in csv.DictReader(f) if _iteration(r) <= start_iteration]
        self.columns = list(dict.fromkeys(k for r in self.rows for k in r))
        self._rewrite()

    def _rewrite(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, self.columns, restval="")
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.path)  # a crash mid-write leaves the old file

    def log(self, row: dict):
        row = _flat(row)
        self.rows.append(row)
        new = [k for k in row if k not in self.columns]
        if new:
            self.columns += new
            self._rewrite()
            return
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.columns, restval="").writerow(row)

    def finish(self, result: dict):
        pass

    def close(self):
        pass


class TensorBoardLogger:
    """Event files under <run_dir>/tensorboard: every numeric metric against env steps, the
    run config as text and, once the run ends, as hyper-parameters, and the learning curve."""

    def __init__(self, run_dir: str, start_iteration: int, config: dict | None = None,
                 start_env_steps: int = 0):
        from tensorboardX import SummaryWriter

        self.config = config

        # purge_step: TensorBoard drops what an interrupted run wrote after its checkpoint
        self.writer = SummaryWriter(logdir=os.path.join(run_dir, "tensorboard"),
                                    purge_step=start_env_steps + 1 if start_iteration else None)
        if config is not None and not start_iteration:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, sort_keys=True) + "\n```", 0)

    def log(self, row: dict):
        step = int(row["env_steps"])
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "env_steps" and math.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def finish(self, result: dict):
        """The run config as hyper-parameters (TensorBoard's HParams tab) beside the last
        evaluation, and the learning-curve figure."""
        last = next((r for r in reversed(result["history"]) if "test_win_rate" in r), None)
        if last is not None:
            metrics = {f"final/{k}": last[k] for k in ("test_win_rate", "test_return")
                       if isinstance(last.get(k), (int, float)) and math.isfinite(last[k])}
            self.writer.add_hparams(hyper_parameters(self.config), metrics, name="hparams",
                                    global_step=int(result["env_steps"]))
        if result.get("learning_curve") and os.path.isfile(result["learning_curve"]):
            import matplotlib.image

            image = matplotlib.image.imread(result["learning_curve"])[..., :3]  # RGBA floats -> RGB
            self.writer.add_image("learning_curve", image, int(result["env_steps"]), dataformats="HWC")
        self.writer.flush()

    def close(self):
        self.writer.close()  # closing twice is harmless


def hyper_parameters(config: dict | None) -> dict:
    """The run config as flat scalars (algo_overrides.lr, ...); lists and None as text."""
    out = {}
    for k, v in (config or {}).items():
        if isinstance(v, dict) and k != "env_kwargs":
            out.update({f"{k}.{kk}": vv for kk, vv in hyper_parameters(v).items()})
        elif isinstance(v, (bool, int, float, str)):
            out[k] = v
        else:
            out[k] = json.dumps(v)
    return out


def _numbers(row: dict) -> dict:
    """The row's finite numbers (bools and per-seed lists left out)."""
    return {k: v for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _csv_value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            out = json.load(f)
        return out if isinstance(out, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_json(path: str, data: dict):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


class _CheckpointedRows:
    """A logger whose backend cannot take a row back (MLflow, W&B): rows wait until their
    iteration is in a checkpoint, then go out; the last env step sent is kept in the state
    file `<run_dir>/<state>` with the backend's run id, so a resumed run sends each row once."""

    state_file = ""

    def __init__(self, run_dir: str, start_iteration: int, config: dict | None, start_env_steps: int):
        from pipelines.config import RunConfig

        self.run_dir, self.config = run_dir, config or {}
        run = RunConfig(**config) if config else None
        self.checkpoint_every = run.checkpoint_every if run else 1
        self.n_iterations = run.n_iterations if run else 0
        self.state_path = os.path.join(run_dir, self.state_file)
        self.state = _read_json(self.state_path)
        self.pending: list[dict] = []
        self.finished = self.closed = False
        self.start_env_steps = start_env_steps

    def _backfill(self):
        """metrics.csv's rows up to the checkpoint that this backend has not had."""
        path = os.path.join(self.run_dir, "metrics.csv")
        if not os.path.exists(path):
            return
        sent = self.state.get("logged_to", -1)
        with open(path, newline="") as f:
            rows = [{k: _csv_value(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(f)]
        rows = [r for r in rows if isinstance(r.get("env_steps"), int) and sent < r["env_steps"] <= self.start_env_steps]
        if rows:
            self.pending = rows
            self._flush()

    def _checkpointed(self, row: dict) -> bool:
        i = int(row["iteration"])
        return i % self.checkpoint_every == 0 or i >= self.n_iterations

    def log(self, row: dict):
        self.pending.append(dict(row))
        if self._checkpointed(row):
            self._flush()

    def _flush(self):
        if not self.pending:
            return
        self._send(self.pending)
        self.state["logged_to"] = int(self.pending[-1]["env_steps"])
        _write_json(self.state_path, self.state)
        self.pending = []

    def finish(self, result: dict):
        """The run ended (its last iteration is in a checkpoint): the rest of the rows, the
        learning-curve figure, and the backend's run marked finished."""
        self._flush()
        self._finish(result)
        self.finished = True

    def close(self):
        """Rows not yet in a checkpoint are dropped: a resumed run trains them again."""
        self.pending = []
        if not self.closed:
            self.closed = True
            self._close()


class MLflowLogger(_CheckpointedRows):
    """An MLflow run: the run config as params, every numeric metric per row with step = env
    steps, the learning-curve PNG as an artifact. Tracking URI: $MLFLOW_TRACKING_URI, else a
    SQLite store in the run dir (<run_dir>/mlflow.db, artifacts under <run_dir>/mlruns; MLflow 3
    refuses new file stores); experiment $MLFLOW_EXPERIMENT_NAME, else "marl". The run id is
    kept in <run_dir>/mlflow_run.json, so a resumed run dir logs to the same MLflow run."""

    state_file = "mlflow_run.json"

    def __init__(self, run_dir: str, start_iteration: int, config: dict | None = None,
                 start_env_steps: int = 0):
        super().__init__(run_dir, start_iteration, config, start_env_steps)
        import logging

        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        # its store's table creation and migrations log at INFO on the terminal
        for name in ("mlflow.store.db.utils", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        own = not os.environ.get("MLFLOW_TRACKING_URI")
        uri = os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///" + os.path.abspath(os.path.join(run_dir, "mlflow.db"))
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "marl"
        try:
            import warnings

            with warnings.catch_warnings():  # SQLAlchemy's deprecation notes from MLflow's store
                warnings.simplefilter("ignore")
                self.client = client = MlflowClient(tracking_uri=uri)
                experiment = client.get_experiment_by_name(name)
            if experiment is None:
                artifacts = Path(run_dir, "mlruns").resolve().as_uri() if own else None
                experiment_id = client.create_experiment(name, artifact_location=artifacts)
            else:
                experiment_id = experiment.experiment_id
            run_id = self.state.get("run_id") if self.state.get("tracking_uri") == uri else None
            existing = self._run(run_id)
            if existing is None:
                c = self.config
                tags = {k: str(c[k]) for k in ("preset", "algo", "env_id") if k in c}
                run = client.create_run(experiment_id, run_name=os.path.basename(os.path.abspath(run_dir)),
                                        tags={**tags, "run_dir": os.path.abspath(run_dir)})
                self.run_id, had = run.info.run_id, {}
                self.state = {"tracking_uri": uri, "run_id": self.run_id, "experiment": name}
                _write_json(self.state_path, self.state)
            else:
                self.run_id, had = run_id, existing.data.params
                client.update_run(run_id, status="RUNNING")
            # params cannot change: a resumed run's new values (e.g. a larger total_env_steps) go
            # into the tag marl.config, the config of the run's latest start
            self._log_params({k: v for k, v in hyper_parameters(config).items() if k not in had})
            client.set_tag(self.run_id, "marl.config", json.dumps(self.config, sort_keys=True)[:8000])
        except MlflowException as e:
            raise InputError(f"MLflow cannot log to {uri}: {one_line(e)[:300]}; set MLFLOW_TRACKING_URI "
                             "to a store it accepts (e.g. sqlite:///mlflow.db or http://HOST:5000), "
                             "or leave it unset for one in the run dir") from None
        self._backfill()

    def _run(self, run_id):
        from mlflow.exceptions import MlflowException

        if not run_id:
            return None
        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            return None
        return run if run.info.lifecycle_stage == "active" else None

    def _log_params(self, params: dict):
        from mlflow.entities import Param

        items = [Param(k[:250], str(v)[:6000]) for k, v in params.items()]  # MLflow's limits
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def _send(self, rows: list[dict]):
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, int(row["env_steps"])) for row in rows
                   for k, v in _numbers(row).items() if k != "env_steps"]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def _finish(self, result: dict):
        if result.get("learning_curve") and os.path.isfile(result["learning_curve"]):
            self.client.log_artifact(self.run_id, result["learning_curve"])
        self.client.set_terminated(self.run_id, "FINISHED")

    def _close(self):
        if not self.finished:  # stopped, failed, or its learner moved (then it is reopened)
            self.client.set_terminated(self.run_id, "KILLED")


class WandbLogger(_CheckpointedRows):
    """A Weights & Biases run in <run_dir>/wandb: the run config as its config, every numeric
    metric per row with env steps as the x axis (and as W&B's step), the learning-curve figure.
    Mode $WANDB_MODE, else offline (nothing leaves the machine; `wandb sync` uploads it);
    project $WANDB_PROJECT, else "marl". The run id is kept in <run_dir>/wandb_run.json, so a
    resumed run dir continues the same W&B run."""

    state_file = "wandb_run.json"

    def __init__(self, run_dir: str, start_iteration: int, config: dict | None = None,
                 start_env_steps: int = 0):
        super().__init__(run_dir, start_iteration, config, start_env_steps)
        import wandb

        mode = os.environ.get("WANDB_MODE") or "offline"
        project = os.environ.get("WANDB_PROJECT") or "marl"
        resumed = bool(self.state.get("id"))
        if not resumed:
            import secrets
            import string

            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's form
            self.state = {"id": run_id, "project": project}
            _write_json(self.state_path, self.state)
        try:
            self.run = wandb.init(project=self.state.get("project", project), dir=os.path.abspath(run_dir),
                                  id=self.state["id"], resume="allow", mode=mode,
                                  name=os.path.basename(os.path.abspath(run_dir)),
                                  config=None if resumed else self.config,
                                  settings=wandb.Settings(silent=True, console="off"))
        except Exception as e:  # wandb's own errors have no common base
            raise InputError(f"W&B cannot start run {self.state['id']} in {mode} mode: {one_line(e)[:300]}; "
                             "for online mode set WANDB_API_KEY (or run `wandb login`), or leave "
                             "WANDB_MODE unset for an offline run in the run dir") from None
        if resumed:
            self.run.config.update(self.config, allow_val_change=True)
        self.run.define_metric("env_steps")
        self.run.define_metric("*", step_metric="env_steps")
        self._backfill()

    def _send(self, rows: list[dict]):
        for row in rows:
            self.run.log(_numbers(row), step=int(row["env_steps"]))

    def _finish(self, result: dict):
        if result.get("learning_curve") and os.path.isfile(result["learning_curve"]):
            import wandb

            self.run.log({"learning_curve": wandb.Image(result["learning_curve"])},
                         step=int(result["env_steps"]))
        self.run.finish(exit_code=0)

    def _close(self):
        if not self.finished:
            self.run.finish(exit_code=1)


def open_loggers(names: list[str], run_dir: str, start_iteration: int, config: dict,
                 start_env_steps: int = 0) -> list:
    """The loggers `names` (csv first where listed: the others read its rows back), opened for
    a run that starts at `start_iteration` (`start_env_steps`). On an error the ones already
    open are closed."""
    made = []
    kinds = {"csv": CSVLogger, "tensorboard": TensorBoardLogger, "mlflow": MLflowLogger, "wandb": WandbLogger}
    try:
        for name in sorted(names, key=lambda n: n != "csv"):
            if name == "csv":
                made.append(CSVLogger(run_dir, start_iteration, config))
            else:
                made.append(kinds[name](run_dir, start_iteration, config, start_env_steps))
    except BaseException:
        for logger in made:
            logger.close()
        raise
    return made
