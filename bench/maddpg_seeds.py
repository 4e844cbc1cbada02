"""MADDPG variants x seeds on MPE simple spread, side by side in one run: each (variant,
seed) is bench/maddpg_mpe.py's plain jitted loop (same learner, collector and ring sampling
as the pipeline, no Dask, Prefect or Zarr), trained to --env-steps and scored on 1,000
fresh greedy episodes in every reward convention. One process per CPU core at a time.

    python bench/maddpg_seeds.py --preset maddpg-mpe-parl --seeds 0 1 2 3 4 --variant preset= \
        --variant parl=twin_critics=false,actor_every=1,actor_lr=1e-2,critic_lr=1e-2,gamma=0.95,n_step=1

A variant is NAME=key=value,key=value (empty: the preset as it is). Writes
bench/results/maddpg_seeds.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402  (bench/report.py)


def run_one(preset: str, settings: str, seed: int, env_steps: int, out: str):
    """One (variant, seed) in this process; its result goes to the JSON file `out`."""
    import maddpg_mpe

    maddpg_mpe.PRESET = preset
    overrides = dict(kv.split("=", 1) for kv in settings.split(",") if kv)
    result = maddpg_mpe.plain_loop(env_steps, 50, overrides, seed=seed, label=f"{settings or 'preset'} seed {seed}")
    with open(out, "w") as f:
        json.dump(result, f)


def run_all(jobs: list[tuple[str, str, int]], args) -> dict:
    """Runs the jobs as child processes, each pinned to one free core."""
    cores = sorted(os.sched_getaffinity(0))[: args.processes]
    results, running, pending = {}, {}, list(jobs)
    with tempfile.TemporaryDirectory() as tmp:
        while pending or running:
            while pending and len(running) < len(cores):
                name, settings, seed = pending.pop(0)
                core = next(c for c in cores if c not in {r[1] for r in running.values()})
                out = os.path.join(tmp, f"{name}-{seed}.json")
                command = [sys.executable, __file__, "--one", args.preset, settings, str(seed),
                           str(args.env_steps), out]
                proc = subprocess.Popen(command, preexec_fn=lambda c=core: os.sched_setaffinity(0, {c}))
                running[proc.pid] = (proc, core, name, seed, out)
            pid, status = os.wait()
            if pid not in running:
                continue
            _, _, name, seed, out = running.pop(pid)
            if status != 0:
                raise SystemExit(f"variant {name} seed {seed} failed (exit status {status}); see its output above")
            with open(out) as f:
                results[(name, seed)] = json.load(f)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="maddpg-mpe-parl")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variant", action="append", default=[], help="NAME=key=value,key=value")
    parser.add_argument("--env-steps", type=int, default=2_500_000)
    parser.add_argument("--processes", type=int, default=os.cpu_count())
    parser.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        preset, settings, seed, env_steps, out = args.one
        return run_one(preset, settings, int(seed), int(env_steps), out)

    variants = dict(v.split("=", 1) if "=" in v else (v, "") for v in args.variant or ["preset="])
    results = run_all([(name, settings, seed) for name, settings in variants.items() for seed in args.seeds], args)

    key = "parl_2022_pz_sum"
    rows, summary = [], {}
    for name, settings in variants.items():
        points = [results[(name, s)]["points"][0] for s in args.seeds]
        scores = np.array([p[key] for p in points])
        summary[name] = {"settings": settings, "seeds": args.seeds, "scores": scores.tolist(),
                         "mean": float(scores.mean()), "std": float(scores.std()),
                         "points": points, "curves": [results[(name, s)]["curve"] for s in args.seeds]}
        rows.append([name, f"`{settings}`" if settings else "(preset)", f"{points[0]['env_steps']:,}",
                     " / ".join(f"{x:.1f}" for x in scores), f"**{scores.mean():.1f}** ± {scores.std():.1f}",
                     f"{np.mean([p['mean_landmark_dist_sum'] for p in points]):.3f}",
                     f"{np.mean([p['parl_2021_openai_sum'] for p in points]):.1f}",
                     f"{np.mean([p['wall_s'] for p in points]):.0f}"])
    plt = report.save(
        "maddpg_seeds", {"preset": args.preset, "env_steps": args.env_steps, "variants": summary},
        ["variant", "settings", "env steps", f"PARL 2022 convention, seeds {' / '.join(map(str, args.seeds))}",
         "mean ± std", "D per step (mean)", "PARL 2021 convention (mean)", "wall s per seed"],
        ["---", "---", "---:", "---:", "---:", "---:", "---:", "---:"], rows)

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, s in summary.items():
        steps = [c["env_steps"] for c in s["curves"][0]]
        returns = np.array([[c["test_return"] for c in curve] for curve in s["curves"]])
        line, = ax.plot(steps, returns.mean(0), label=f"{name} (mean of {len(args.seeds)} seeds)")
        ax.fill_between(steps, returns.min(0), returns.max(0), color=line.get_color(), alpha=0.2)
    ax.set_xlabel("env steps")
    ax.set_ylabel("greedy test return per agent (trained reward)")
    ax.legend()
    ax.set_title(f"MADDPG variants on {args.preset}, min-max over seeds")
    fig.tight_layout()
    fig.savefig(report.figure_path("maddpg_seeds"), dpi=120)


if __name__ == "__main__":
    main()
