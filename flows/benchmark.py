"""The `marl-benchmark` flow: train each suite entry at a fixed budget, keep the scores, flag regressions.

Each entry runs the real `marl-train` flow as a subflow in a fresh run dir under
`<results_dir>/runs/<suite>/`. One row per entry is appended to `<results_dir>/results.csv`
(kept across runs); `<results_dir>/trends.png` draws score and wall time per suite over runs;
a markdown artifact compares each entry with the previous run of the same suite at the same
budget (previous, current, delta, OK / REGRESSION).

Scheduled nightly by the `marl-benchmark/nightly` deployment in prefect.yaml; `marl benchmark`
runs it on the embedded default.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import math
import os
import platform
import shutil
import socket
import subprocess
import time

from matplotlib.figure import Figure
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run

from flows.artifacts import json_number, stable_key
from flows.train import marl_train
from marl.algos import ConfigError
from pipelines.config import PRESETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# how a suite is scored: name -> key of the final greedy evaluation (higher is better)
SCORE_METRICS = {"test_win_rate": "win_rate", "test_return": "return_mean"}


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    preset: str  # a key of pipelines.config.PRESETS
    env_id: str
    metric: str = "test_win_rate"  # a key of SCORE_METRICS
    env_steps: int = 300_000  # the nightly budget; the flow's env_steps overrides it
    nightly: bool = True  # run when the flow is given no suite list


# One entry per benchmark. Budgets are for a nightly run on 2 CPU cores: a fixed budget
# makes scores comparable from night to night, not necessarily converged. A nightly entry
# whose preset does not exist (yet) is skipped with a warning.
SUITES: dict[str, Suite] = {s.name: s for s in [
    # QMIX reaches >= 0.9 greedy test win rate on 3m at ~280k env steps (BENCHMARKS.md)
    Suite("qmix-3m", "qmix-smac", "smax:3m", "test_win_rate", 300_000),
    Suite("vdn-3m", "vdn-smax", "smax:3m", "test_win_rate", 300_000),
    Suite("iql-3m", "iql-smax", "smax:3m", "test_win_rate", 300_000),
    # MPE has no win: score the greedy mean episode return (higher is better)
    Suite("mappo-spread", "mappo-mpe", "mpe:simple_spread", "test_return", 500_000),
    Suite("maddpg-spread", "maddpg-mpe", "mpe:simple_spread", "test_return", 300_000),
    # seconds long: for tests and smoke runs of the benchmark machinery itself
    Suite("qmix-3m-tiny", "qmix-smac-tiny", "smax:3m", "test_win_rate", 512, nightly=False),
    Suite("mappo-spread-tiny", "mappo-mpe-tiny", "mpe:simple_spread", "test_return", 512, nightly=False),
]}

RESULT_COLUMNS = {  # name -> type, the header of results.csv
    "timestamp": str, "suite": str, "preset": str, "env": str, "algorithm": str,
    "env_steps_budget": int, "env_steps": int, "wall_s": float, "train_s": float,
    "score_metric": str, "score": float, "status": str, "git_commit": str, "hostname": str,
    "cpu_count": int, "platform": str, "gpu": str, "flow_run_id": str, "train_flow_run_id": str,
    "run_dir": str, "error": str,
}


def select_suites(names: list[str] | None) -> list[Suite]:
    """The named suite entries (all nightly ones for None), checked before anything runs."""
    if names is None:
        chosen = [s for s in SUITES.values() if s.nightly and s.preset in PRESETS]
    else:
        unknown = [n for n in names if n not in SUITES]
        if unknown:
            raise ConfigError(f"unknown benchmark suite {unknown[0]!r}; valid: {', '.join(SUITES)}")
        chosen = [SUITES[n] for n in dict.fromkeys(names)]
    for suite in chosen:
        if suite.preset not in PRESETS:
            raise ConfigError(f"suite {suite.name} names preset {suite.preset!r}, which does not exist; "
                              f"add it to pipelines/config.py PRESETS or fix SUITES in flows/benchmark.py")
        if suite.metric not in SCORE_METRICS:
            raise ConfigError(f"suite {suite.name} has score metric {suite.metric!r}; "
                              f"valid: {', '.join(SCORE_METRICS)}")
    if not chosen:
        raise ConfigError("no benchmark suite selected; pass suites=[...] (valid: " + ", ".join(SUITES) + ")")
    return chosen


# ------------------------------------------------------------------ the results table


def read_results(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return [{k: _parse(RESULT_COLUMNS.get(k, str), v) for k, v in row.items() if k is not None}
                for row in csv.DictReader(f)]


def append_results(path: str, rows: list[dict]) -> None:
    """Rewrite the table with `rows` added, atomically: a crash leaves the old file whole."""
    existing = read_results(path)
    columns = list(RESULT_COLUMNS) + [k for r in existing for k in r if k not in RESULT_COLUMNS]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(columns)), extrasaction="ignore")
        writer.writeheader()
        for row in existing + rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
    os.replace(tmp, path)


def _parse(kind, text: str | None):
    if text is None or text == "":
        return None
    try:
        return kind(float(text)) if kind is int else kind(text)
    except ValueError:
        return text


# ------------------------------------------------------------------ regressions


def previous_result(rows: list[dict], suite: str, env_steps_budget: int) -> dict | None:
    """The latest earlier row of `suite` at the same budget that produced a score."""
    same = [r for r in rows if r.get("suite") == suite and r.get("env_steps_budget") == env_steps_budget
            and _finite(r.get("score"))]
    return same[-1] if same else None


def compare(previous: dict | None, current: dict, score_tolerance: float = 0.10,
            score_abs_tolerance: float = 0.05, wall_tolerance: float = 0.5) -> dict:
    """REGRESSION when the score drops by more than max(score_tolerance x |previous|,
    score_abs_tolerance), or the wall time rises by more than wall_tolerance x previous."""
    out = {"suite": current["suite"], "metric": current["score_metric"],
           "previous": None, "current": current.get("score"), "delta": None,
           "previous_wall_s": None, "wall_s": current.get("wall_s"), "wall_delta_s": None,
           "previous_run": None, "status": "NEW", "reasons": ""}
    if current.get("error"):
        return {**out, "status": "FAILED", "reasons": current["error"]}
    if previous is None:
        return out
    reasons = []
    out.update(previous=previous["score"], previous_wall_s=previous.get("wall_s"),
               previous_run=f"{previous.get('timestamp')} ({previous.get('flow_run_id')})")
    if _finite(out["current"]):
        out["delta"] = out["current"] - previous["score"]
        if -out["delta"] > max(score_tolerance * abs(previous["score"]), score_abs_tolerance):
            reasons.append(f"score fell {-out['delta']:.3g}")
    else:
        reasons.append("no score")
    if _finite(out["wall_s"]) and _finite(out["previous_wall_s"]):
        out["wall_delta_s"] = out["wall_s"] - out["previous_wall_s"]
        if out["wall_delta_s"] > wall_tolerance * out["previous_wall_s"]:
            reasons.append(f"wall time rose {out['wall_delta_s'] / out['previous_wall_s']:.0%}")
    return {**out, "status": "REGRESSION" if reasons else "OK", "reasons": "; ".join(reasons)}


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


# ------------------------------------------------------------------ provenance


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def machine_info() -> dict:
    gpu = "none"
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
            gpu = ", ".join(names) if out.returncode == 0 and names else "none"
        except (OSError, subprocess.SubprocessError):
            pass
    return {"hostname": socket.gethostname(), "cpu_count": os.cpu_count() or 0,
            "platform": platform.platform(), "gpu": gpu}


# ------------------------------------------------------------------ plots and report


def plot_trends(rows: list[dict], path: str) -> str:
    """Score and wall time of each suite over its runs: one row of two panels per suite,
    since suites score on different scales (win rate, return)."""
    suites = list(dict.fromkeys(r["suite"] for r in rows)) or ["(no results yet)"]
    fig = Figure(figsize=(10, 1.2 + 2.4 * len(suites)), layout="constrained")
    axes = fig.subplots(len(suites), 2, squeeze=False)
    for (ax_score, ax_wall), suite in zip(axes, suites):
        mine = [r for r in rows if r["suite"] == suite]
        when = [datetime.datetime.fromisoformat(r["timestamp"]) for r in mine]
        ax_score.plot(when, [_nan(r.get("score")) for r in mine], "o-")
        ax_wall.plot(when, [_nan(r.get("wall_s")) for r in mine], "o-", color="tab:orange")
        metric = mine[-1]["score_metric"] if mine else "score"
        ax_score.set(title=f"{suite}: {metric}", ylabel=metric)
        ax_wall.set(title=f"{suite}: wall time", ylabel="seconds")
        for ax in (ax_score, ax_wall):
            ax.grid(alpha=0.3)
            ax.tick_params(axis="x", labelrotation=30, labelsize="small")
    fig.suptitle(f"marl-benchmark trends ({len(rows)} results)")
    fig.savefig(path, dpi=100)
    return path


def _nan(value) -> float:
    return float(value) if _finite(value) else float("nan")


def report_markdown(comparisons: list[dict], rows: list[dict], results_path: str, trends_png: str,
                    tolerances: dict) -> str:
    fmt = lambda v: "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
    sign = lambda v: "" if v is None else f"{v:+.3g}"
    machine = rows[0] if rows else {}
    lines = ["# marl-benchmark", "",
             f"commit `{machine.get('git_commit')}` on {machine.get('hostname')} "
             f"({machine.get('cpu_count')} CPUs, GPU {machine.get('gpu')}, {machine.get('platform')})", "",
             "| suite | metric | env steps | previous | current | delta | previous wall s | wall s | "
             "wall delta s | status | previous run |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for c, row in zip(comparisons, rows):
        status = f"**{c['status']}**" + (f" ({c['reasons']})" if c["reasons"] else "")
        lines.append(f"| {c['suite']} | {c['metric']} | {row.get('env_steps') or 0:,} | {fmt(c['previous'])} | "
                     f"{fmt(c['current'])} | {sign(c['delta'])} | {fmt(c['previous_wall_s'])} | "
                     f"{fmt(c['wall_s'])} | {sign(c['wall_delta_s'])} | {status} | {c['previous_run'] or ''} |")
    lines += ["", "REGRESSION: score fell by more than max({score_tolerance:.0%} of the previous, "
                  "{score_abs_tolerance}), or wall time rose by more than {wall_tolerance:.0%}; "
                  "compared with the previous run of the same suite at the same env-step budget.".format(**tolerances),
              "", f"- results table: `{os.path.abspath(results_path)}`",
              f"- trends: [{os.path.basename(trends_png)}]({_uri(trends_png)}) (`{os.path.abspath(trends_png)}`)"]
    lines += [f"- {row['suite']} run dir: `{row['run_dir']}`" for row in rows]
    return "\n".join(lines)


def _uri(path: str) -> str:
    from pathlib import Path

    return Path(path).resolve().as_uri()


# ------------------------------------------------------------------ the flow


@flow(name="marl-benchmark", log_prints=True)
def marl_benchmark(suites: list[str] | None = None, env_steps: int | None = None,
                   max_wall_s: float | None = None, results_dir: str = "runs/benchmarks",
                   score_tolerance: float = 0.10, score_abs_tolerance: float = 0.05,
                   wall_tolerance: float = 0.5, keep_runs: int = 3,
                   scheduler_address: str | None = None, n_workers: int = 2) -> dict:
    """Run `suites` (default: every nightly entry of SUITES), each for `env_steps` (default:
    the entry's budget) and at most `max_wall_s` seconds of training; keep the last
    `keep_runs` run dirs per suite (0 keeps all)."""
    logger = get_run_logger()
    chosen = select_suites(suites)
    if suites is None:
        for s in SUITES.values():
            if s.nightly and s.preset not in PRESETS:
                logger.warning("skipping suite %s: preset %s does not exist", s.name, s.preset)
    results_path = os.path.join(results_dir, "results.csv")
    earlier = read_results(results_path)
    provenance = {"git_commit": git_commit(), **machine_info(), "flow_run_id": flow_run.get_id() or ""}
    tolerances = dict(score_tolerance=score_tolerance, score_abs_tolerance=score_abs_tolerance,
                      wall_tolerance=wall_tolerance)
    rows, comparisons = [], []
    for suite in chosen:
        now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
        run_dir = os.path.join(results_dir, "runs", suite.name,
                               f"{now:%Y%m%dT%H%M%SZ}-{provenance['flow_run_id'][:8] or os.getpid()}")
        budget = env_steps or suite.env_steps
        logger.info("suite %s: %s on %s for %d env steps in %s", suite.name, suite.preset,
                    suite.env_id, budget, run_dir)
        began = time.perf_counter()
        state = marl_train(preset=suite.preset, env=suite.env_id, env_steps=budget, run_dir=run_dir,
                           overrides={"max_wall_s": str(max_wall_s)} if max_wall_s else None,
                           scheduler_address=scheduler_address, n_workers=n_workers, return_state=True)
        row = {"timestamp": now.isoformat(), "suite": suite.name, "preset": suite.preset,
               "env": suite.env_id, "algorithm": PRESETS[suite.preset]["algo"], "env_steps_budget": budget,
               "wall_s": round(time.perf_counter() - began, 2), "score_metric": suite.metric, **provenance,
               "train_flow_run_id": str(state.state_details.flow_run_id), "run_dir": os.path.abspath(run_dir)}
        if state.is_completed():
            result = state.result()
            row.update(env_steps=result["env_steps"], train_s=round(result["wall_s"], 2),
                       score=json_number(result["final_eval"].get(SCORE_METRICS[suite.metric])))
        else:
            row["error"] = " ".join(str(state.message or state.type.value).split())[:300]
            logger.error("suite %s failed: %s", suite.name, row["error"])
        comparison = compare(previous_result(earlier, suite.name, budget), row, **tolerances)
        row["status"] = comparison["status"]
        append_results(results_path, [row])  # now, so a later suite's crash keeps this result
        rows.append(row)
        comparisons.append(comparison)
        logger.info("suite %s: %s = %s (%s)", suite.name, suite.metric, row.get("score"), comparison["status"])
        _prune_runs(os.path.dirname(run_dir), keep_runs)

    trends_png = plot_trends(read_results(results_path), os.path.join(results_dir, "trends.png"))
    markdown = report_markdown(comparisons, rows, results_path, trends_png, tolerances)
    create_markdown_artifact(markdown, key=stable_key("marl-benchmark", results_dir, "report"),
                             description="scores against the previous run of each suite")
    create_table_artifact([{k: json_number(v) for k, v in c.items()} for c in comparisons],
                          key=stable_key("marl-benchmark", results_dir, "comparison"),
                          description="previous vs current score and wall time per suite")
    failed = [r["suite"] for r in rows if r.get("error")]
    if failed:
        raise RuntimeError(f"benchmark suites failed: {', '.join(failed)}; see {results_path} and their flow runs")
    return {"rows": rows, "comparisons": comparisons, "results": os.path.abspath(results_path),
            "trends": os.path.abspath(trends_png), "markdown": markdown}


def _prune_runs(suite_dir: str, keep: int) -> None:
    """Replay stores are large: keep only the newest `keep` run dirs of a suite."""
    if keep <= 0:
        return
    runs = sorted(d for d in os.listdir(suite_dir) if os.path.isdir(os.path.join(suite_dir, d)))
    for old in runs[:-keep]:
        shutil.rmtree(os.path.join(suite_dir, old), ignore_errors=True)
