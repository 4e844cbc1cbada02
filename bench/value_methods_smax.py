"""IQL, VDN and QMIX on SMAX 3m and 2s3z at equal env steps, through the whole pipeline.

The three differ only in the mixer (none, a sum, the monotonic hypernetwork); everything
else is the `qmix-smac` preset: same network, replay, TD(lambda) targets, exploration and
update budget. Each run is one `marl-train` flow (embedded Prefect, local Dask cluster,
Zarr replay), evaluated greedily on 128 fresh episodes every `--eval-every` iterations.

    python bench/value_methods_smax.py [--env-steps 300000] [--envs smax:3m smax:2s3z] [--results-name N]

Writes bench/results/value_methods_smax.{json,md,png} (or <N>.*).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402  (bench/report.py)
from qmix_smax import run  # noqa: E402

PRESETS = {"iql": "iql-smax", "vdn": "vdn-smax", "qmix": "qmix-smac"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-steps", type=int, default=300_000)
    parser.add_argument("--envs", nargs="+", default=["smax:3m", "smax:2s3z"])
    parser.add_argument("--algos", nargs="+", default=list(PRESETS))
    parser.add_argument("--eval-every", type=int, default=10, help="iterations between evaluations")
    parser.add_argument("--run-root", default="runs/bench-value-methods")
    parser.add_argument("--results-name", default="value_methods_smax",
                        help="bench/results/<name>.{json,md,png} (keeps other budgets' results)")
    args = parser.parse_args()

    report.embedded_prefect(".prefect/bench-value-methods", startup_timeout_s=300)

    results = []
    for env in args.envs:
        for algo in args.algos:
            label = f"{algo} {env}"
            r = run(label, args.env_steps, {"eval_every": str(args.eval_every)},
                    os.path.join(args.run_root, f"{algo}-{env.replace(':', '-')}"),
                    preset=PRESETS[algo], env=env)
            results.append({**r, "algo": algo, "env": env})

    rows = []
    for r in results:
        at = f"{r['steps_to_target']:,}" if r["reached"] else "not reached"
        rows.append([r["env"], r["algo"], f"{r['env_steps']:,}", f"{r['final_test_win_rate']:.3f}",
                     f"{r['best_test_win_rate']:.3f}", at, f"{r['wall_s']:.0f}"])
    plt = report.save(
        args.results_name, {"results": results},
        ["env", "algorithm", "env steps", "final test win", "best test win", "first >= 0.9 at steps",
         "wall s"], ["---", "---", "---:", "---:", "---:", "---:", "---:"], rows)

    fig, axes = plt.subplots(1, len(args.envs), figsize=(5.5 * len(args.envs), 4), squeeze=False)
    for ax, env in zip(axes[0], args.envs):
        for r in (r for r in results if r["env"] == env):
            ax.plot([c["env_steps"] for c in r["curve"]], [c["test_win_rate"] for c in r["curve"]],
                    label=r["algo"])
        ax.set_title(env)
        ax.set_xlabel("env steps")
        ax.set_ylabel("greedy test win rate (128 episodes)")
        ax.set_ylim(-0.02, 1.02)
        ax.legend()
    fig.tight_layout()
    fig.savefig(report.figure_path(args.results_name), dpi=120)


if __name__ == "__main__":
    main()
