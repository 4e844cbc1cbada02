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


class CSVLogger:
    """<run_dir>/metrics.csv, one row per iteration; the header grows when a later row has
    new columns (the evaluated iterations), by rewriting the (small) file."""

    def __init__(self, run_dir: str, start_iteration: int, config: dict | None = None):
        self.path = os.path.join(run_dir, "metrics.csv")
        self.rows: list[dict] = []
        if os.path.exists(self.path):
            with open(self.path, newline="") as f:
                self.rows = [r for r in csv.DictReader(f) if int(r["iteration"]) <= start_iteration]
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

    def close(self):
        pass


class TensorBoardLogger:
    """Event files under <run_dir>/tensorboard: every numeric metric against env steps,
    the run config as text."""

    def __init__(self, run_dir: str, start_iteration: int, config: dict | None = None,
                 start_env_steps: int = 0):
        from tensorboardX import SummaryWriter

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

    def close(self):
        self.writer.close()


def open_loggers(names: list[str], run_dir: str, start_iteration: int, config: dict,
                 start_env_steps: int = 0) -> list:
    made = []
    for name in names:
        if name == "csv":
            made.append(CSVLogger(run_dir, start_iteration, config))
        elif name == "tensorboard":
            made.append(TensorBoardLogger(run_dir, start_iteration, config, start_env_steps))
    return made
