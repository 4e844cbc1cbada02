"""`marl runs` and `marl compare`: the runs under a directory, and their learning curves side by side.

    marl runs [DIR] [--json]                     one row per run dir under DIR (default runs)
    marl compare RUN_DIR... [--out compare.png] [--metric NAME] [--separate] [--json]

Everything is read from what a run leaves in its dir: the run config in the replay store's
zarr.json, the checkpoints' metadata and the per-iteration rows of metrics.csv (flows/loggers.py).
Nothing is written but the figure. Runs that differ only in their seed (`marl train --seed S`)
are drawn as one curve, their mean +- std (unless --separate).
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import textwrap
import time

# a run whose metrics.csv or checkpoints changed this recently counts as running
# (a run leaves no other live mark; one iteration of the presets takes well under this)
RUNNING_WITHIN_S = 300
CURVES = ("test_win_rate", "test_return")  # compare's default panels
# run settings that do not change what is learned: runs that differ only in these and the
# seed are one experiment's seeds (max_wall_s: when it stopped, not what it trained)
NOT_THE_EXPERIMENT = ("seed", "run_dir", "max_wall_s", "render_every", "fail_regions_once")


def _fail(message) -> int:
    from flows.checks import one_line

    print(f"marl: {one_line(message)}", file=sys.stderr)
    return 2


def read_metrics(run_dir: str) -> list[dict]:
    """metrics.csv's rows, numbers as floats (NaN where a row has none: not evaluated there);
    per-seed lists stay text."""
    path = os.path.join(run_dir, "metrics.csv")
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path, newline="") as f:
        for raw in csv.DictReader(f):
            row = {}
            for k, v in raw.items():
                try:
                    row[k] = float(v) if v not in ("", None) else math.nan
                except ValueError:
                    row[k] = v
            if not math.isnan(row.get("env_steps", math.nan)):  # a torn last line has none
                rows.append(row)
    return rows


def _last(rows: list[dict], key: str) -> dict | None:
    return next((r for r in reversed(rows) if not math.isnan(r.get(key, math.nan))), None)


def describe(run_dir: str) -> dict | None:
    """What `marl runs` shows of one run dir; None if it is not a run dir."""
    from flows.checks import stored_run_config

    config = stored_run_config(run_dir)
    if config is None:
        return None
    from pipelines.config import RunConfig
    from storage import Checkpointer

    cfg = RunConfig(**config)
    checkpoint, meta = None, {}
    if os.path.isdir(cfg_dir := os.path.join(run_dir, "checkpoints")):
        with Checkpointer(cfg_dir) as checkpoints:
            checkpoint = checkpoints.latest_step()
            meta = checkpoints.metadata(checkpoint) if checkpoint is not None else {}
    rows = read_metrics(run_dir)
    tested = _last(rows, "test_win_rate")
    done = int(max(meta.get("env_steps", 0), rows[-1]["env_steps"] if rows else 0))
    marks = [os.path.join(run_dir, p) for p in ("metrics.csv", "checkpoints")]
    written = max((os.path.getmtime(p) for p in marks if os.path.exists(p)), default=0.0)
    if time.time() - written < RUNNING_WITHIN_S and meta.get("env_steps", 0) < cfg.total_env_steps:
        status = "running"
    elif meta.get("env_steps", 0) >= cfg.total_env_steps:
        status = "finished"
    else:
        status = "stopped"
    return {"run_dir": run_dir, "preset": cfg.preset, "env_id": cfg.env_id, "algo": cfg.algo,
            "n_seeds": cfg.n_seeds, "env_steps": done, "total_env_steps": cfg.total_env_steps,
            "checkpoint": checkpoint, "status": status,
            "test_win_rate": tested["test_win_rate"] if tested else None,
            "test_return": tested.get("test_return") if tested else None,
            "tested_at": int(tested["env_steps"]) if tested else None}


def find_runs(directory: str) -> list[dict]:
    """`directory` itself if it is a run dir, else its sub-directories that are."""
    own = describe(directory)
    if own is not None:
        return [own]
    found = (describe(os.path.join(directory, d)) for d in sorted(os.listdir(directory))
             if os.path.isdir(os.path.join(directory, d)))
    return [r for r in found if r is not None]


def _number(v, spec: str) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _console():
    from rich.console import Console

    return Console(markup=False) if sys.stdout.isatty() else Console(width=200, soft_wrap=True, markup=False)


def cmd_runs(args) -> int:
    if not os.path.isdir(args.dir):
        return _fail(f"{args.dir} is not a directory; pass the directory your runs are in (default runs), "
                     "e.g. marl runs runs")
    runs = find_runs(args.dir)
    if args.json:
        print(json.dumps(runs, indent=2))
        return 0
    if not runs:
        print(f"no runs under {args.dir} (a run dir holds replay/ with a run config); "
              "train one with `marl train PRESET --run-dir DIR`")
        return 0
    from rich.table import Table

    table = Table(title=f"runs under {args.dir}")
    for col in ("run", "preset", "env", "algo", "seeds", "env steps", "checkpoint", "test win", "test return",
                "status"):
        table.add_column(col, justify="right" if col in ("seeds", "env steps", "checkpoint", "test win",
                                                         "test return") else "left")
    for r in runs:
        table.add_row(os.path.relpath(r["run_dir"], args.dir) if r["run_dir"] != args.dir else r["run_dir"],
                      r["preset"], r["env_id"], r["algo"], str(r["n_seeds"]),
                      f"{r['env_steps']:,}/{r['total_env_steps']:,}", _number(r["checkpoint"], "d"),
                      _number(r["test_win_rate"], ".3f"), _number(r["test_return"], ".3f"), r["status"])
    _console().print(table)
    return 0


def summarize(run_dir: str, rows: list[dict], metrics) -> dict:
    """Final and best value of each metric (with the std over seeds where the run has several)."""
    out = {"run_dir": run_dir, "env_steps": int(rows[-1]["env_steps"])}
    for m in metrics:
        last = _last(rows, m)
        values = [r[m] for r in rows if not math.isnan(r.get(m, math.nan))]
        out[m] = {"final": last[m] if last else None, "final_std": last.get(f"{m}_std") if last else None,
                  "best": max(values) if values else None}
    return out


def run_curve(rows: list[dict], m: str):
    """(env steps, values, std over the run's seeds or None) of metric m where the run has it."""
    points = [r for r in rows if not math.isnan(r.get(m, math.nan))]
    std = [r.get(f"{m}_std", math.nan) for r in points]
    spread = std if points and not any(isinstance(v, str) or math.isnan(v) for v in std) else None
    return [r["env_steps"] for r in points], [r[m] for r in points], spread


def _samples(row: dict, m: str) -> list[float]:
    """A row's values of m: its seeds' (the per-seed column of a --seeds run), else its one value."""
    per_seed = row.get(f"{m}_per_seed")
    if isinstance(per_seed, str):
        try:
            values = [float(v) for v in json.loads(per_seed)]
            if values:
                return values
        except (ValueError, TypeError):
            pass
    value = row.get(m, math.nan)
    return [] if isinstance(value, str) or math.isnan(value) else [value]


def group_curve(members: list[list[dict]], m: str):
    """(env steps, mean, std, n) of m over the runs of a group (each --seeds run's seeds counted
    one by one), at the env steps where every run has it; std is the population std (as the
    evaluator's over seeds)."""
    import numpy as np

    by_step = [{r["env_steps"]: _samples(r, m) for r in rows} for rows in members]
    steps = sorted(set.intersection(*(set(s for s, v in b.items() if v) for b in by_step)))
    samples = [np.array([v for b in by_step for v in b[s]]) for s in steps]
    return (steps, [float(v.mean()) for v in samples], [float(v.std()) for v in samples],
            [len(v) for v in samples])


def group_runs(runs: list[tuple[str, dict, dict, list[dict]]]) -> list[list[int]]:
    """Indices of `runs` ((dir, info, stored config, rows)) grouped: runs whose configs are
    equal but for the seed (and NOT_THE_EXPERIMENT) and whose seeds differ go together, in
    the order first given; the same run given twice stays apart."""
    groups: list[tuple[str, list[int], set]] = []
    for i, (_, _, config, _) in enumerate(runs):
        key = json.dumps({k: v for k, v in config.items() if k not in NOT_THE_EXPERIMENT}, sort_keys=True)
        seed = config.get("seed")
        for k, members, seeds in groups:
            if k == key and seed not in seeds:
                members.append(i)
                seeds.add(seed)
                break
        else:
            groups.append((key, [i], {seed}))
    return [members for _, members, _ in groups]


def summarize_group(runs, members: list[int], metrics) -> dict:
    """Final and best of the group's mean curve of each metric, with the std and the number of
    seeds at the final point."""
    out = {"run_dirs": [runs[i][0] for i in members], "seeds": [runs[i][2].get("seed") for i in members]}
    for m in metrics:
        steps, mean, std, n = group_curve([runs[i][3] for i in members], m)
        out[m] = {"final": mean[-1] if steps else None, "final_std": std[-1] if steps else None,
                  "best": max(mean) if steps else None, "n": n[-1] if steps else 0,
                  "env_steps": int(steps[-1]) if steps else None}
    out["env_steps"] = int(min(runs[i][3][-1]["env_steps"] for i in members))
    return out


def plot_curves(curves: list[tuple[str, dict]], metrics, path: str) -> str:
    """One figure, a panel per metric: each curve over env steps ({metric: (x, y, std or None)}),
    a band of +- one std where it has one (over seeds: of a --seeds run or of a group of runs)."""
    from matplotlib.figure import Figure  # object API: no pyplot backend switching

    fig = Figure(figsize=(5 * len(metrics), 3.8), layout="constrained")
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    for ax, m in zip(axes, metrics):
        for label, by_metric in curves:
            x, y, std = by_metric[m]
            # long run dirs wrapped: a legend wider than its panel collapses the layout
            (line,) = ax.plot(x, y, "o-", markersize=3, label=textwrap.fill(label, 48))
            if std is not None and x:
                ax.fill_between(x, [a - s for a, s in zip(y, std)], [a + s for a, s in zip(y, std)],
                                color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set(xlabel="env steps", ylabel=m.replace("_", " "), title=m.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    fig.savefig(path, dpi=100)
    return path


def cmd_compare(args) -> int:
    from flows import checks

    metrics = tuple(args.metric) if args.metric else CURVES
    runs = []
    try:
        checks.check_writable_path(args.out, "--out", directory=False)
        for run_dir in args.run_dirs:
            if not os.path.isdir(run_dir):
                raise checks.InputError(f"run dir {run_dir} does not exist; pass run dirs of `marl train` "
                                        "(see `marl runs`)")
            info = describe(run_dir)
            if info is None:
                raise checks.InputError(f"{run_dir} is not a run dir (no replay store with a run config); "
                                        "pass run dirs of `marl train` (see `marl runs`)")
            rows = read_metrics(run_dir)
            if not rows:
                raise checks.InputError(f"{run_dir} has no metrics.csv rows to compare (it was trained "
                                        "without the csv logger, or has not finished an iteration); "
                                        "train it with --logger csv")
            missing = [m for m in metrics if m not in rows[0]]
            if missing:
                raise checks.InputError(f"{run_dir}/metrics.csv has no column {', '.join(missing)}; "
                                        f"its columns: {', '.join(k for k in rows[0] if k != 'iteration')}")
            runs.append((run_dir, info, checks.stored_run_config(run_dir) or {}, rows))
    except checks.InputError as e:
        return _fail(e)
    groups = [[i] for i in range(len(runs))] if args.separate else group_runs(runs)
    labels = [f"{os.path.normpath(d)} ({i['algo']}, {i['env_id']}"
              + (f", {i['n_seeds']} seeds)" if i["n_seeds"] > 1 else ")") for d, i, _, _ in runs]
    summary = [summarize(d, rows, metrics) for d, _, _, rows in runs]
    curves, table_rows, grouped = [], [], []
    for members in groups:
        if len(members) == 1:
            (i,) = members
            curves.append((labels[i], {m: run_curve(runs[i][3], m) for m in metrics}))
            table_rows.append((labels[i], summary[i]))
            continue
        info = runs[members[0]][1]
        g = summarize_group(runs, members, metrics)
        label = (f"{', '.join(os.path.normpath(runs[i][0]) for i in members)} ({info['algo']}, {info['env_id']}, "
                 f"seeds {', '.join(str(s) for s in g['seeds'])}: mean +- std)")
        curves.append((label, {m: group_curve([runs[i][3] for i in members], m)[:3] for m in metrics}))
        table_rows.append((label, g))
        grouped.append(g)
    plot_curves(curves, metrics, args.out)
    if args.json:
        print(json.dumps({"figure": args.out, "runs": summary, "groups": grouped}, indent=2))
        return 0
    from rich.table import Table

    table = Table(title="final (+- std over seeds) and best of each run, or of the mean of runs that "
                  "differ only in their seed")
    table.add_column("run")
    table.add_column("env steps", justify="right")
    for m in metrics:
        table.add_column(f"{m.replace('_', ' ')} final", justify="right")
        table.add_column("best", justify="right")
    for label, s in table_rows:
        cells = []
        for m in metrics:
            final = _number(s[m]["final"], ".3f")
            if s[m]["final_std"] is not None and not math.isnan(s[m]["final_std"]):
                final += f" +- {s[m]['final_std']:.3f}"
            cells += [final, _number(s[m]["best"], ".3f")]
        table.add_row(label, f"{s['env_steps']:,}", *cells)
    _console().print(table)
    print(f"learning curves: {args.out}")
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("runs", help="list the runs under a directory: preset, env, algorithm, env steps, "
                       "last evaluation, status",
                       description="List the run dirs under DIR (or DIR itself if it is one): preset, env, "
                       "algorithm, seeds, env steps done of the run's budget, latest checkpoint, its last "
                       "evaluation (test win rate and return from metrics.csv) and status: finished (its "
                       "checkpoint reached the budget it was created with), running (metrics.csv or "
                       f"checkpoints written in the last {RUNNING_WITHIN_S} s), else stopped.")
    p.add_argument("dir", metavar="DIR", nargs="?", default="runs", help="where the run dirs are (default runs)")
    p.add_argument("--json", action="store_true", help="print the runs as JSON instead of a table")
    p.set_defaults(fn=cmd_runs)

    p = sub.add_parser("compare", help="compare runs: their learning curves on one figure and a table of "
                       "final and best metrics",
                       description="Read each run's metrics.csv and draw their learning curves over env "
                       "steps on one figure (--out, a panel per metric, a band of +- one std over seeds "
                       "for --seeds runs), and print each run's final and best value of each metric. Runs "
                       "that differ only in their seed (marl train --seed S) are one curve, their mean +- "
                       "std over seeds, and one row (--separate: each on its own).")
    p.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", help="run dirs of `marl train`, e.g. runs/*")
    p.add_argument("--out", default="compare.png", help="the figure to write (default compare.png)")
    p.add_argument("--metric", action="append", metavar="NAME",
                   help="a metrics.csv column to draw (repeatable; default test_win_rate and test_return)")
    p.add_argument("--separate", action="store_true", help="draw every run on its own, also runs that differ "
                   "only in their seed (by default those are one curve: their mean +- std)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    p.set_defaults(fn=cmd_compare)
