"""MAPPO on PettingZoo's simple_spread (numpy envs on CPU Dask workers) against the same
learner on jaxmarl's MPE simple_spread (jitted envs), at equal env steps, through the
whole pipeline; and PettingZoo collect throughput with 1 and 2 CPU workers.

    python bench/mappo_pz_spread.py [--env-steps 200000] [--throughput-iterations 6]

Both training runs are the `mappo-pz-spread` preset (2 collectors x 32 envs x 128 steps
per iteration, one PPO update per iteration); only the env id differs. Returns are the
agents' mean reward summed over an episode (25 steps in both), greedy, on fresh episodes.

Writes bench/results/mappo_pz_spread.{json,md,png}.
"""

from __future__ import annotations

import argparse
import operator
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402  (bench/report.py)

PRESET = "mappo-pz-spread"
ENVS = {"pettingzoo (numpy, CPU workers)": "pz:mpe2.simple_spread_v3",
        "jaxmarl (jitted)": "mpe:simple_spread"}


def train(label: str, env: str, env_steps: int, run_dir: str, eval_every: int) -> dict:
    from flows import train as train_flow

    shutil.rmtree(run_dir, ignore_errors=True)
    rows, started = [], time.perf_counter()

    def record(row):
        rows.append({**row, "wall_s": time.perf_counter() - started})
        if "test_return" in row:
            print(f"[{label}] {row['env_steps']:>8,} steps {rows[-1]['wall_s']:6.0f} s  "
                  f"test return {row['test_return']:.2f}", flush=True)

    train_flow.ITERATION_HOOKS.append(record)
    try:
        result = train_flow.marl_train(preset=PRESET, env=env, env_steps=env_steps, run_dir=run_dir,
                                       overrides={"eval_every": str(eval_every), "eval_episodes": "64"})
    finally:
        train_flow.ITERATION_HOOKS.remove(record)
    evals = [r for r in rows if "test_return" in r]
    return {"label": label, "env": env, "env_steps": result["env_steps"], "wall_s": result["wall_s"],
            "final_test_return": result["final_eval"]["return_mean"],
            "last3_test_return": sum(r["test_return"] for r in evals[-3:]) / len(evals[-3:]),
            "curve": [{k: r[k] for k in ("env_steps", "wall_s", "test_return", "return")} for r in evals]}


def throughput(n_workers: int, iterations: int, run_dir: str) -> dict:
    """Env steps/s of the collect stage alone: 2 collect tasks per iteration on n CPU workers."""
    from distributed import Client

    from pipelines import stages
    from pipelines.cluster import make_cluster, workers as live_workers
    from pipelines.config import make_run_config

    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = make_run_config(PRESET, run_dir=run_dir, n_collectors=2).to_dict()
    with make_cluster(n_workers=n_workers, kind="cpu", dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        workers = sorted(live_workers(client))
        client.submit(stages.prepare_run, cfg, workers=[workers[0]], pure=False).result()
        params = client.submit(stages.policy_params, cfg, workers=[workers[0]], pure=False).result()
        params = client.scatter(params, broadcast=True)

        def one_iteration(iteration):
            futures = [client.submit(stages.collect, cfg, c, iteration, params, 0, 0,
                                     workers=[workers[c % len(workers)]], pure=False) for c in range(2)]
            # the regions' ids, not their arrays, come back: errors raise here
            return client.gather([client.submit(operator.itemgetter("region"), f) for f in futures])

        one_iteration(0)  # compiles the policy on every worker
        started = time.perf_counter()
        for iteration in range(1, iterations + 1):
            one_iteration(iteration)
        seconds = time.perf_counter() - started
    steps = iterations * 2 * cfg["envs_per_collector"] * cfg["steps_per_region"]
    return {"workers": n_workers, "env_steps": steps, "seconds": seconds, "env_steps_per_s": steps / seconds}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-steps", type=int, default=200_000)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--throughput-iterations", type=int, default=6)
    parser.add_argument("--run-root", default="runs/bench-mappo-pz")
    args = parser.parse_args()

    report.embedded_prefect(".prefect/bench-mappo-pz", startup_timeout_s=300)

    speed = [throughput(n, args.throughput_iterations, os.path.join(args.run_root, f"throughput-{n}"))
             for n in (1, 2)]
    ratio = speed[1]["env_steps_per_s"] / speed[0]["env_steps_per_s"]
    print(f"collect throughput: {speed[0]['env_steps_per_s']:,.0f} env steps/s on 1 worker, "
          f"{speed[1]['env_steps_per_s']:,.0f} on 2 (ratio {ratio:.2f})", flush=True)
    runs = [train(label, env, args.env_steps, os.path.join(args.run_root, env.replace(":", "-")),
                  args.eval_every) for label, env in ENVS.items()]

    rows = [[r["label"], r["env"], f"{r['env_steps']:,}", f"{r['final_test_return']:.2f}",
             f"{r['last3_test_return']:.2f}", f"{r['wall_s']:.0f}"] for r in runs]
    rows += [[f"collect only, {s['workers']} CPU worker(s)", ENVS_PZ, f"{s['env_steps']:,}", "", "",
              f"{s['seconds']:.1f} ({s['env_steps_per_s']:,.0f} env steps/s)"] for s in speed]
    plt = report.save(
        "mappo_pz_spread", {"runs": runs, "throughput": speed, "throughput_ratio_2_vs_1": ratio},
        ["run", "env", "env steps", "final test return", "mean of last 3 evaluations", "wall s"],
        ["---", "---", "---:", "---:", "---:", "---:"], rows)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        axes[0].plot([c["env_steps"] for c in r["curve"]], [c["test_return"] for c in r["curve"]], label=r["label"])
    axes[0].set_xlabel("env steps")
    axes[0].set_ylabel("greedy test return (agents' mean, per episode)")
    axes[0].legend()
    axes[1].bar([str(s["workers"]) for s in speed], [s["env_steps_per_s"] for s in speed])
    axes[1].set_xlabel("CPU workers")
    axes[1].set_ylabel("PettingZoo collect env steps/s")
    axes[1].set_title(f"2 vs 1 worker: x{ratio:.2f}")
    fig.suptitle("MAPPO on simple_spread: PettingZoo (CPU workers) vs jaxmarl")
    fig.tight_layout()
    fig.savefig(report.figure_path("mappo_pz_spread"), dpi=120)


ENVS_PZ = ENVS["pettingzoo (numpy, CPU workers)"]

if __name__ == "__main__":
    main()
