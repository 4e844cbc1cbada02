"""Prefect artifacts that a `marl-train` flow run leaves behind.

Per run: a table of the per-iteration metrics, a markdown summary (what ran, how long,
the final evaluation, where the store and checkpoints are) and a learning-curve PNG
written beside the store, `<run_dir>/learning_curve.png`, linked from the summary.
Keys derive from the preset and the run dir, so the runs of one run dir (a resumed run)
form one artifact history in the UI.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from pathlib import Path

from matplotlib.figure import Figure  # object API: Agg canvas, no pyplot backend switching
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

HISTORY_COLUMNS = ("iteration", "env_steps", "return", "win_rate", "loss", "total_updates",
                   "steps_per_s", "test_win_rate", "test_return")


def stable_key(label: str, path: str, kind: str) -> str:
    """`<label>-<dir name>-<hash of its absolute path>-<kind>`: lowercase letters, digits, dashes
    (what Prefect accepts), the same for every run on the same directory."""
    path = os.path.abspath(path)
    digest = hashlib.sha1(path.encode()).hexdigest()[:8]
    slug = re.sub(r"[^a-z0-9]+", "-", f"{label}-{os.path.basename(path)}".lower()).strip("-")
    return f"{slug[:60]}-{digest}-{kind}"


def artifact_key(config, kind: str) -> str:
    return stable_key(config.preset, config.run_dir, kind)


def json_number(value):
    """NaN/inf -> None, numpy scalars -> Python numbers and per-seed lists -> text, so the
    table is valid JSON."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, (list, tuple)):  # per-seed values: one readable cell
        return " ".join(f"{v:.3g}" for v in value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def history_table(history: list[dict]) -> list[dict]:
    """One row per iteration with the same columns; evaluated-only keys are None elsewhere."""
    extra = [k for row in history for k in row if k not in HISTORY_COLUMNS]
    columns = list(HISTORY_COLUMNS) + list(dict.fromkeys(extra))
    return [{k: json_number(row.get(k)) for k in columns} for row in history]


def plot_learning_curve(history: list[dict], path: str, title: str) -> str:
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    ax_return, ax_test = fig.subplots(1, 2)
    steps = [row["env_steps"] for row in history]
    ax_return.plot(steps, [_float(row.get("return")) for row in history], ".-", label="training return")
    evaluated = [row for row in history if "test_win_rate" in row or "test_return" in row]
    ax_return.plot([r["env_steps"] for r in evaluated], [_float(r.get("test_return")) for r in evaluated],
                   "o-", label="test return (greedy)")
    ax_return.set(xlabel="env steps", ylabel="return", title="return")
    ax_test.plot([r["env_steps"] for r in evaluated], [_float(r.get("test_win_rate")) for r in evaluated],
                 "o-", color="tab:green", label="test win rate (greedy)")
    ax_test.set(xlabel="env steps", ylabel="win rate", title="test win rate", ylim=(-0.02, 1.02))
    for ax in (ax_return, ax_test):
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    if not history:
        fig.text(0.5, 0.5, "no iterations ran (the checkpoint was already at the end)", ha="center")
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return path


def publish_run_artifacts(result: dict, config) -> dict:
    """Table, summary and learning curve of one `marl-train` run; returns their keys and the PNG path."""
    history = result["history"]
    png = plot_learning_curve(history, os.path.join(config.run_dir, "learning_curve.png"),
                              f"{config.preset}: {config.algo} on {config.env_id}")
    png_uri = Path(png).resolve().as_uri()
    keys = {kind: artifact_key(config, kind) for kind in ("history", "summary", "learning-curve")}
    create_table_artifact(history_table(history), key=keys["history"],
                          description=f"per-iteration metrics of {config.preset} in {config.run_dir}")
    create_link_artifact(png_uri, link_text="learning curve (PNG)", key=keys["learning-curve"],
                         description=f"training return and test win rate against env steps, {config.run_dir}")
    create_markdown_artifact(_summary_markdown(result, config, png, png_uri), key=keys["summary"],
                             description=f"{config.preset} on {config.env_id}")
    return {"keys": keys, "learning_curve": png}


def _summary_markdown(result: dict, config, png: str, png_uri: str) -> str:
    final = result.get("final_eval") or {}
    evaluation = ", ".join(f"{k} {_fmt(v)}" for k, v in final.items()) or "none"
    resumed = f" (resumed from iteration {result['resumed_from']})" if result.get("resumed_from") else ""
    rows = [
        ("preset", config.preset), ("algorithm", config.algo), ("env", config.env_id),
        ("env steps", f"{result['env_steps']:,}{resumed}"),
        ("iterations this run", result["iterations"]),
        ("wall time", f"{result['wall_s']:.1f} s"),
        *_dataflow_rows(result.get("dataflow")),
        ("final greedy evaluation", evaluation),
        ("run dir", f"`{os.path.abspath(config.run_dir)}`"),
        ("replay store", f"`{os.path.abspath(result['store'])}`"),
        ("checkpoints", f"`{result['checkpoint_dir']}`"),
        ("Dask dashboard", f"[{result['dashboard']}]({result['dashboard']})" if result.get("dashboard") else "n/a"),
        ("learning curve", f"[{os.path.basename(png)}]({png_uri}) (`{os.path.abspath(png)}`)"),
        *([("last evaluation's episode (GIF)", f"`{result['render']}` (the render artifact)")]
          if result.get("render") else []),
    ]
    lines = [f"# {config.preset}: {config.algo} on {config.env_id}", "", "| | |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    lines += ["", "Reopen the replay with `storage.open_replay(path)`, or `marl replay info PATH`."]
    return "\n".join(lines)


def _dataflow_rows(summary: dict | None) -> list[tuple[str, str]]:
    """How the stages shared the wall: busy fractions and the policy lag's distribution."""
    if not summary:
        return []
    lags = summary["policy_lag_histogram"]
    total = sum(lags.values()) or 1
    return [("learner busy", f"{summary['learner_busy']:.0%} of the wall"),
            ("collectors busy", f"{summary['collector_busy']:.0%} of the wall"),
            ("policy lag (regions)", ", ".join(f"{lag}: {n} ({n / total:.0%})" for lag, n in lags.items())
             or "none")]


def _float(value) -> float:
    return float("nan") if value is None else float(value)


def _fmt(value) -> str:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):  # names (a team run's teams)
        return ", ".join(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)
