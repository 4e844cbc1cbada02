"""The dataflow against a plain loop: QMIX smax:3m, MAPPO and MADDPG mpe:simple_spread at
their presets' settings, the same env-step budget, side by side in one run.

    plain     the same learner code in one process: jitted collect, then update, then
              (on the preset's cadence) evaluate; no Dask, no Zarr
    K=k,C=c   `marl train` (Prefect flow, LocalCluster of c + 1 single-threaded workers:
              the learner's and one per collector) with max_policy_lag k and c collectors
    K=k,C=c,W=w  the same on w workers (W=1: every stage in the learner's worker process)
    K=k,C=c,threads  the same on a threads cluster (workers as threads of the driver's process)

Throughput is steady state: env steps and updates after the first evaluation (by then
every stage has compiled) over the wall time since it. Each seed runs every setting back to
back, and "x plain" and "x K=0" are the mean over seeds of each seed's ratio (with the seeds'
range), so load that comes and goes on the machine cancels within a seed. The final score is the last greedy evaluation at
the same env steps (test win rate for SMAX, test return for MPE).

    python bench/dataflow.py [--algos qmix mappo maddpg] [--seeds 0 1 2]
                             [--settings plain K=0,C=1 K=1,C=1 ...] [--env-steps qmix=100000 ...]
                             [--results-name dataflow] [--report-only] [--set KEY=VALUE ...]

Busy fractions are of the whole wall (start-up compile included); the learner's also of the
steady state (the iterations after the first evaluation; the learner trains them in order,
so each iteration's train time over the time since the previous one is its busy share).
The collectors' has no per-iteration equivalent: with K >= 1 a region is collected while
earlier iterations train.

Writes bench/results/dataflow.{json,md,png}; --report-only rebuilds the table and figure
from that JSON.
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

# mappo_pz: MAPPO on PettingZoo's simple spread, whose envs step in Python on CPU workers,
# the collector-bound case (not run by default: --algos mappo_pz)
PRESETS = {"qmix": "qmix-smac", "mappo": "mappo-mpe", "maddpg": "maddpg-mpe", "mappo_pz": "mappo-pz-spread"}
# env steps per run; each leaves 50 (QMIX, MADDPG) or 10 (MAPPO) iterations, 20-25 s, after the
# first evaluation for the steady state
BUDGET = {"qmix": 61_440, "mappo": 327_680, "maddpg": 192_000, "mappo_pz": 81_920}
DEFAULT_ALGOS = ["qmix", "mappo", "maddpg"]
SETTINGS = ["plain", "K=0,C=1", "K=1,C=1", "K=2,C=1", "K=1,C=2", "K=2,C=2"]
PARTS = ("rollout_s", "host_copy_s", "write_s", "read_s", "update_s", "publish_s", "checkpoint_s")


def plain_loop(preset: str, env_steps: int, seed: int, overrides: dict | None = None) -> dict:
    """The preset's learner in one process: collect, update, evaluate, no Dask, no Zarr."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marl import algos, buffer, envs, rollout
    from pipelines.config import make_run_config
    from pipelines.stages import replay_fields

    # one process collects every env of an iteration (the pipeline's rows set their collectors)
    config = make_run_config(preset, total_env_steps=env_steps, seed=seed, n_collectors=1, overrides=overrides)
    env = envs.make(config.env_id, **config.env_kwargs)
    learner = algos.make_learner(config.algo, env.spec, config.algo_config())
    jax_env = env.spec.backend == "jax"  # else PettingZoo: stepped in NumPy, as its collectors do
    make_collector = rollout.make_collector if jax_env else rollout.make_numpy_collector
    make_evaluator = rollout.make_evaluator if jax_env else rollout.make_numpy_evaluator
    init, collect = make_collector(env, learner.act, learner.init_carry,
                                   config.envs_per_region, config.steps_per_region)
    evaluate = make_evaluator(env, learner.act, learner.init_carry, config.eval_episodes, learner.greedy)
    fields = {n: (f.shape, f.dtype) for n, f in replay_fields(env.spec, learner).items()}
    n_slots = config.n_collectors if learner.on_policy else config.n_slots
    arrays, mirrored = buffer.empty(fields, n_slots, config.steps_per_region, config.envs_per_region), {}
    state = learner.init(jax.random.PRNGKey(seed))
    rstate = init(jax.random.fold_in(jax.random.PRNGKey(seed), 0))
    rows, began = [], time.perf_counter()
    for i in range(config.n_iterations):
        env_steps_done = i * config.steps_per_iteration
        rstate, data, stats = collect(learner.policy_params(state), rstate,
                                      learner.exploration(jnp.float32(env_steps_done)))
        slot = 0 if learner.on_policy else i % n_slots
        arrays = buffer.insert(arrays, slot, data)
        mirrored[slot] = i
        stored = len(mirrored) * config.steps_per_region * config.envs_per_collector
        if learner.on_policy:
            n_updates = 1
        else:
            n_updates = learner.config.updates_per_region
            if stored < learner.config.learning_starts:
                n_updates = 0
        if n_updates:
            state, _ = learner.train(state, arrays, buffer.ring(mirrored, n_slots, 1), n_updates)
        row = {"env_steps": env_steps_done + config.steps_per_iteration,
               "total_updates": int(np.max(state["updates"]))}
        if i == config.n_iterations - 1 or (i + 1) % config.eval_every == 0:
            key = jax.random.fold_in(jax.random.PRNGKey(config.seed + 10_000), i)
            ev = evaluate(learner.policy_params(state), key)
            row.update(test_win_rate=float(ev["win_rate"]), test_return=float(ev["return_mean"]))
        jax.block_until_ready(state)
        row["wall_s"] = time.perf_counter() - began
        rows.append(row)
    return {"rows": rows}


def pipeline(preset: str, env_steps: int, seed: int, lag: int, collectors: int, run_dir: str,
             workers: int | None = None, cluster: str = "auto", overrides: dict | None = None) -> dict:
    from flows import train as train_flow

    shutil.rmtree(run_dir, ignore_errors=True)
    rows, began = [], time.perf_counter()

    def record(row):
        rows.append({**row, "wall_s": time.perf_counter() - began})

    train_flow.ITERATION_HOOKS.append(record)
    try:
        result = train_flow.marl_train(preset=preset, env_steps=env_steps, seed=seed, run_dir=run_dir,
                                       collectors=collectors, n_workers=workers or collectors + 1,
                                       overrides={**(overrides or {}), "max_policy_lag": str(lag)},
                                       cluster=cluster)
    finally:
        train_flow.ITERATION_HOOKS.remove(record)
    return {"rows": rows, "dataflow": result["dataflow"]}


def steady_rows(rows: list[dict]) -> list[dict]:
    """The rows from the first evaluation on (by then every stage has compiled)."""
    first = next((i for i, r in enumerate(rows[:-1]) if "test_return" in r), 0)
    return rows[first:]


def steady(rows: list[dict]) -> dict:
    """Env steps/s and updates/s from the first evaluation on to the end; the last
    evaluation's scores."""
    first, last = steady_rows(rows)[0], rows[-1]
    wall = max(last["wall_s"] - first["wall_s"], 1e-9)
    evaluated = [r for r in rows if "test_return" in r]
    final = evaluated[-1] if evaluated else {}
    return {"env_steps": last["env_steps"], "wall_s": last["wall_s"],
            "env_steps_per_s": (last["env_steps"] - first["env_steps"]) / wall,
            "updates_per_s": (last["total_updates"] - first["total_updates"]) / wall,
            "test_win_rate": final.get("test_win_rate"), "test_return": final.get("test_return")}


def steady_learner_busy(rows: list[dict]) -> float:
    """The learner's busy fraction over the iterations after the first evaluation, weighted
    by each iteration's wall time."""
    rows = steady_rows(rows)
    spans = [(b["wall_s"] - a["wall_s"], b["learner_busy"]) for a, b in zip(rows, rows[1:])]
    return sum(w * busy for w, busy in spans) / (sum(w for w, _ in spans) or 1e-9)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algos", nargs="+", default=DEFAULT_ALGOS, choices=list(PRESETS))
    parser.add_argument("--settings", nargs="+", default=SETTINGS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--env-steps", nargs="*", default=[], help="algo=steps, e.g. qmix=200000")
    parser.add_argument("--run-root", default="runs/bench-dataflow")
    parser.add_argument("--results-name", default="dataflow")
    parser.add_argument("--report-only", action="store_true", help="rebuild the table and figure from the JSON")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a preset override for every row, plain and pipeline alike (as marl train's --set)")
    args = parser.parse_args()
    overrides = dict(kv.split("=", 1) for kv in args.set)
    budget = {**BUDGET, **{k: int(v) for k, v in (kv.split("=") for kv in args.env_steps)}}
    if args.report_only:
        import json

        with open(os.path.join(report.RESULTS, f"{args.results_name}.json")) as f:
            saved = json.load(f)
        write_report(args, saved["budget"], saved["results"], command=saved["command"])
        return

    report.embedded_prefect()

    results = []
    for algo in args.algos:
        preset = PRESETS[algo]
        # each seed's settings run back to back, so what else slows this machine for minutes
        # at a time hits one seed's settings alike: the ratios are taken within a seed
        for seed in args.seeds:
            for setting in args.settings:
                started = time.perf_counter()
                if setting == "plain":
                    out = plain_loop(preset, budget[algo], seed, overrides)
                else:
                    parts = dict(part.split("=") if "=" in part else (part, "") for part in setting.split(","))
                    out = pipeline(preset, budget[algo], seed, int(parts["K"]), int(parts["C"]),
                                   os.path.join(args.run_root, f"{algo}-{setting}-{seed}".replace(",", "-")),
                                   workers=int(parts["W"]) if "W" in parts else None,
                                   cluster="threads" if "threads" in parts else "auto", overrides=overrides)
                results.append({"algo": algo, "setting": setting, "seed": seed, **steady(out["rows"]),
                                "dataflow": out.get("dataflow"), "rows": out["rows"],
                                "total_wall_s": time.perf_counter() - started})
                r = results[-1]
                print(f"[{algo} {setting} seed {seed}] {r['env_steps_per_s']:,.0f} env steps/s, "
                      f"{r['updates_per_s']:,.1f} updates/s, test return {r['test_return']}", flush=True)
    write_report(args, budget, results)


def write_report(args, budget: dict, results: list[dict], command: str | None = None):
    # what the results hold, in the order they ran (--report-only needs no --algos/--settings)
    args.algos = list(dict.fromkeys(r["algo"] for r in results))
    args.settings = list(dict.fromkeys(r["setting"] for r in results))
    rows = []
    for algo in args.algos:
        mine = [r for r in results if r["algo"] == algo]
        for setting in args.settings:
            runs = [r for r in mine if r["setting"] == setting]
            if not runs:
                continue
            sps = _mean(r["env_steps_per_s"] for r in runs)
            flows = [r["dataflow"] for r in runs if r["dataflow"]]
            busy = lambda k: f"{_mean(f[k] for f in flows):.2f}" if flows else "-"
            steady = [steady_learner_busy(r["rows"]) for r in runs if r["dataflow"]]
            score = "win" if algo == "qmix" else "return"  # SMAX: win rate; MPE: return
            values = [r[f"test_{score}_rate" if algo == "qmix" else "test_return"] for r in runs]
            lags = {}
            for f in flows:
                for lag, n in f["policy_lag_histogram"].items():
                    lags[lag] = lags.get(lag, 0) + n
            rows.append([algo, setting, f"{runs[0]['env_steps']:,}", f"{sps:,.0f}",
                         f"{_mean(r['updates_per_s'] for r in runs):,.1f}",
                         _paired(mine, runs, "plain"), _paired(mine, runs, "K=0,C=1"),
                         f"{busy('learner_busy')} / {_mean(steady):.2f}" if steady else "-",
                         busy("collector_busy"),
                         " ".join(f"{k}:{v}" for k, v in sorted(lags.items(), key=lambda kv: int(kv[0]))) or "-",
                         _fmt_scores(score, values)])
    plt = report.save(
        args.results_name, {"budget": budget, "results": results},
        ["algo", "setting", "env steps", "env steps/s", "updates/s", "x plain", "x K=0",
         "learner busy (wall / steady)", "collectors busy (wall)", "policy lag (regions)",
         "final score (seeds)"],
        ["---", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---", "---"], rows,
        command=command)

    print("\nwhere the pipeline's time went (seconds, summed over the run):")
    for r in results:
        if r["dataflow"]:
            parts = r["dataflow"]["breakdown_s"]
            waiting = r["dataflow"]["wall_s"] * (1 - r["dataflow"]["learner_busy"])
            print(f"  {r['algo']:<6} {r['setting']:<8} seed {r['seed']}: "
                  + ", ".join(f"{p[:-2]} {parts.get(p, 0):.1f}" for p in PARTS)
                  + f", evaluate {r['dataflow']['evaluate_s']:.1f}, learner waiting {waiting:.1f}"
                  + f" of {r['dataflow']['wall_s']:.1f}")

    fig, axes = plt.subplots(1, len(args.algos), figsize=(5 * len(args.algos), 3.8), squeeze=False)
    for ax, algo in zip(axes[0], args.algos):
        settings = [s for s in args.settings if any(r["algo"] == algo and r["setting"] == s for r in results)]
        values = [_mean(r["env_steps_per_s"] for r in results if r["algo"] == algo and r["setting"] == s)
                  for s in settings]
        ax.bar(settings, values, color=["gray"] + ["tab:blue"] * (len(settings) - 1))
        ax.set_title(f"{algo} ({PRESETS[algo]})")
        ax.set_ylabel("env steps/s (steady state), 2-core CPU")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(report.figure_path(args.results_name), dpi=120)


def _paired(mine: list[dict], runs: list[dict], reference: str) -> str:
    """The mean over seeds of each seed's env steps/s against the same seed's `reference`
    run, with the seeds' range where there are several."""
    ref = {r["seed"]: r["env_steps_per_s"] for r in mine if r["setting"] == reference}
    ratios = [r["env_steps_per_s"] / ref[r["seed"]] for r in runs if r["seed"] in ref]
    if not ratios:
        return "-"
    spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
    return f"{_mean(ratios):.2f}{spread}"


def _fmt_scores(kind: str, values: list) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    import numpy as np

    spread = f" +- {np.std(values):.3f}" if len(values) > 1 else ""
    return f"{kind} {np.mean(values):.3f}{spread} (n={len(values)})"


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


if __name__ == "__main__":
    main()
