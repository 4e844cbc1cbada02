"""Per-iteration metrics where researchers compare runs: CSV (on by default) and TensorBoard.

    loggers = open_loggers(["csv", "tensorboard"], run_dir, start_iteration, config)
    for row in rows: [lg.log(row) for lg in loggers]        # one row per iteration
    [lg.close() for lg in loggers]

A resumed run (start_iteration > 0, its checkpoint's iteration) appends: rows logged after
that checkpoint by the interrupted run are dropped first, so every iteration is in the
files exactly once.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os

from flows.checks import InputError

# logger -> (module it needs, the pyproject extra that installs it)
LOGGERS = {"csv": (None, None), "tensorboard": ("tensorboardX", "tensorboard")}
DEFAULT = ("csv",)


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
                             f"pip install 'marl-dataflow[{extra}]' (or pip install {module})")
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


def open_loggers(names: list[str], run_dir: str, start_iteration: int, config: dict,
                 start_env_steps: int = 0) -> list:
    made = []
    for name in names:
        if name == "csv":
            made.append(CSVLogger(run_dir, start_iteration, config))
        elif name == "tensorboard":
            made.append(TensorBoardLogger(run_dir, start_iteration, config, start_env_steps))
    return made
