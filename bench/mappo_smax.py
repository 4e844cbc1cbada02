"""MAPPO on SMAX 3m through the whole pipeline (Prefect flow, local Dask cluster, Zarr
replay, orbax checkpoints): env steps and wall time to a greedy test win rate >= 0.9 over
128 evaluation episodes, and the learning curve.

    python bench/mappo_smax.py [--env-steps 3000000] [--max-wall-s 1200] [--eval-every 5]
                               [--anneal] [--set KEY=VALUE ...]

Writes bench/results/mappo_smax.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402  (bench/report.py)

TARGET = 0.9


def run(env_steps: int, overrides: dict, run_dir: str, seed: int) -> dict:
    from flows import train as train_flow

    shutil.rmtree(run_dir, ignore_errors=True)
    rows, started = [], time.perf_counter()

    def record(row):
        rows.append({**row, "wall_s": time.perf_counter() - started})
        if "test_win_rate" in row:
            print(f"{row['env_steps']:>9,} steps {rows[-1]['wall_s']:7.1f} s  test win "
                  f"{row['test_win_rate']:.3f}  train win {row['win_rate']:.3f}", flush=True)

    train_flow.ITERATION_HOOKS.append(record)
    try:
        result = train_flow.marl_train(preset="mappo-smax", env_steps=env_steps, run_dir=run_dir,
                                       seed=seed, overrides={"eval_episodes": "128", **overrides})
    finally:
        train_flow.ITERATION_HOOKS.remove(record)
    evals = [r for r in rows if "test_win_rate" in r]
    first = next((r for r in evals if r["test_win_rate"] >= TARGET), None)
    return {"overrides": overrides, "seed": seed, "wall_s": time.perf_counter() - started,
            "env_steps": result["env_steps"],
            "final_test_win_rate": result["final_eval"].get("win_rate"),
            "best_test_win_rate": max((r["test_win_rate"] for r in evals), default=None),
            # does it hold? the mean of the last 10 evaluations, and how many of them reach the target
            "last10_mean_test_win_rate": sum(r["test_win_rate"] for r in evals[-10:]) / max(len(evals[-10:]), 1),
            "last10_at_target": sum(r["test_win_rate"] >= TARGET for r in evals[-10:]),
            "reached": first is not None,
            "steps_to_target": first["env_steps"] if first else None,
            "wall_s_to_target": first["wall_s"] if first else None,
            "env_steps_per_s": result["env_steps"] / max(result["wall_s"], 1e-9),
            "curve": [{k: r[k] for k in ("env_steps", "wall_s", "test_win_rate", "test_return", "win_rate")}
                      for r in evals]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-steps", type=int, default=3_000_000)
    parser.add_argument("--max-wall-s", type=float, default=1200.0, help="stop the run after this long")
    parser.add_argument("--eval-every", type=int, default=5, help="iterations between evaluations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-root", default="runs/bench-mappo-smax")
    parser.add_argument("--anneal", action="store_true",
                        help="decay the learning rate linearly to 0 over exactly --env-steps")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a preset override, as marl-train's --set")
    args = parser.parse_args()

    report.embedded_prefect()

    from pipelines.config import make_run_config

    overrides = {"eval_every": str(args.eval_every), "max_wall_s": str(args.max_wall_s)}
    if args.anneal:
        n_iterations = make_run_config("mappo-smax", total_env_steps=args.env_steps).n_iterations
        overrides["anneal_lr_iterations"] = str(n_iterations)
    overrides.update(kv.split("=", 1) for kv in args.set)
    r = run(args.env_steps, overrides, os.path.join(args.run_root, "ours"), args.seed)
    at = f"{r['steps_to_target']:,} steps, {r['wall_s_to_target']:.0f} s" if r["reached"] else "not reached"
    plt = report.save(
        "mappo_smax", {"target": TARGET, "result": r},
        ["run", "env steps", "wall s", "env steps/s", "first test win >= 0.9 at (steps, wall s)",
         "best test win", "mean of last 10 tests", "last 10 tests >= 0.9", "final test win"],
        ["---", "---:", "---:", "---:", "---", "---:", "---:", "---:", "---:"],
        [["mappo-smax (pipeline)", f"{r['env_steps']:,}", f"{r['wall_s']:.0f}", f"{r['env_steps_per_s']:,.0f}",
          at, f"{r['best_test_win_rate']:.3f}", f"{r['last10_mean_test_win_rate']:.3f}",
          f"{r['last10_at_target']}/10", f"{r['final_test_win_rate']:.3f}"]])

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    steps = [c["env_steps"] for c in r["curve"]]
    wall = [c["wall_s"] for c in r["curve"]]
    for ax, x, xlabel in zip(axes, (steps, wall), ("env steps", "wall time (s), 2-core CPU")):
        ax.plot(x, [c["test_win_rate"] for c in r["curve"]], label="greedy test win rate (128 episodes)")
        ax.plot(x, [c["win_rate"] for c in r["curve"]], label="training win rate (sampled actions)", alpha=0.6)
        ax.axhline(TARGET, color="gray", ls="--", lw=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("win rate")
        ax.set_ylim(-0.02, 1.02)
        ax.legend()
    fig.suptitle("MAPPO on SMAX 3m through the pipeline")
    fig.tight_layout()
    fig.savefig(report.figure_path("mappo_smax"), dpi=120)


if __name__ == "__main__":
    main()
