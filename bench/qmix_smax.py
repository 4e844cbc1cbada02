"""QMIX on SMAX 3m through the whole pipeline (Prefect flow, local Dask cluster, Zarr
replay, orbax checkpoints): wall time and env steps to a greedy test win rate >= 0.9 over
128 evaluation episodes. Side by side in the same run, the same pipeline and learner with
JaxMARL's reference QMIX-SMAX hyper-parameters, for the same wall time.

    python bench/qmix_smax.py [--env-steps 500000] [--reference-budget-s S] [--no-reference]

Writes bench/results/qmix_smax.{json,md,png}.
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

# JaxMARL's QMIX with its SMAX reference configuration, in this project's settings:
# GRU 512, 16 envs x 128 steps per collect, 8 updates ("epochs") per collect, LR 5e-5,
# whole 128-step trajectories as training sequences, epsilon over 10% of 10M steps.
REFERENCE = {
    "envs_per_collector": "16", "steps_per_region": "128", "buffer_transitions": "655360",
    "hidden": "512", "lr": "5e-5", "updates_per_region": "8", "seq_len": "128",
    "batch_size": "32", "eps_decay_steps": "1000000", "learning_starts": "10000",
    "target_update_interval": "200",
}


def run(label: str, env_steps: int, overrides: dict, run_dir: str, preset: str = "qmix-smac",
        env: str | None = None) -> dict:
    """One `marl-train` flow run of `preset`; its evaluations and when it first reached 0.9."""
    from flows import train as train_flow

    shutil.rmtree(run_dir, ignore_errors=True)
    rows, started = [], time.perf_counter()

    def record(row):
        rows.append({**row, "wall_s": time.perf_counter() - started})
        if "test_win_rate" in row:
            print(f"[{label}] {row['env_steps']:>9,} steps {rows[-1]['wall_s']:7.1f} s  "
                  f"test win {row['test_win_rate']:.3f}  return {row['test_return']:.3f}", flush=True)

    train_flow.ITERATION_HOOKS.append(record)
    try:
        result = train_flow.marl_train(preset=preset, env=env, env_steps=env_steps, run_dir=run_dir,
                                       overrides={"eval_episodes": "128", **overrides})
    finally:
        train_flow.ITERATION_HOOKS.remove(record)
    evals = [r for r in rows if "test_win_rate" in r]
    first = next((r for r in evals if r["test_win_rate"] >= TARGET), None)
    return {"label": label, "overrides": overrides, "wall_s": time.perf_counter() - started,
            "env_steps": result["env_steps"], "final_test_win_rate": result["final_eval"].get("win_rate"),
            "best_test_win_rate": max((r["test_win_rate"] for r in evals), default=None),
            "reached": first is not None,
            "steps_to_target": first["env_steps"] if first else None,
            "wall_s_to_target": first["wall_s"] if first else None,
            "env_steps_per_s": result["env_steps"] / max(result["wall_s"], 1e-9),
            "curve": [{k: r[k] for k in ("env_steps", "wall_s", "test_win_rate", "test_return")} for r in evals]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-steps", type=int, default=500_000)
    parser.add_argument("--eval-every", type=int, default=5, help="iterations between evaluations")
    parser.add_argument("--reference-budget-s", type=float, default=None,
                        help="wall time for the reference run (default: what ours took to reach 0.9)")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--run-root", default="runs/bench-qmix-smax")
    parser.add_argument("--results-name", default="qmix_smax", help="bench/results/<name>.{json,md,png}")
    args = parser.parse_args()

    report.embedded_prefect()

    ours = run("ours", args.env_steps, {"eval_every": str(args.eval_every)},
               os.path.join(args.run_root, "ours"))
    results = [ours]
    if not args.no_reference:
        budget = args.reference_budget_s or ours["wall_s_to_target"] or ours["wall_s"]
        ref = run("jaxmarl-reference-config", 10_000_000,
                  {**REFERENCE, "eval_every": "2", "max_wall_s": str(budget)},
                  os.path.join(args.run_root, "reference"))
        results.append(ref)

    rows = []
    for r in results:
        at = f"{r['steps_to_target']:,} steps, {r['wall_s_to_target']:.0f} s" if r["reached"] else "not reached"
        rows.append([r["label"], f"{r['env_steps']:,}", f"{r['wall_s']:.0f}", f"{r['env_steps_per_s']:,.0f}", at,
                     f"{r['best_test_win_rate']:.3f}", f"{r['final_test_win_rate']:.3f}"])
    plt = report.save(
        args.results_name, {"target": TARGET, "results": results},
        ["config", "env steps", "wall s", "env steps/s", "first test win >= 0.9 at (steps, wall s)",
         "best test win", "final test win"],
        ["---", "---:", "---:", "---:", "---", "---:", "---:"], rows)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        steps = [c["env_steps"] for c in r["curve"]]
        wall = [c["wall_s"] for c in r["curve"]]
        win = [c["test_win_rate"] for c in r["curve"]]
        axes[0].plot(steps, win, label=r["label"])
        axes[1].plot(wall, win, label=r["label"])
    for ax, xlabel in zip(axes, ("env steps", "wall time (s), 2-core CPU")):
        ax.axhline(TARGET, color="gray", ls="--", lw=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("greedy test win rate (128 episodes)")
        ax.set_ylim(-0.02, 1.02)
        ax.legend()
    fig.suptitle("QMIX on SMAX 3m through the pipeline")
    fig.tight_layout()
    fig.savefig(report.figure_path(args.results_name), dpi=120)


if __name__ == "__main__":
    main()
