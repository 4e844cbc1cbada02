"""Where a trained SMAX team's losses come from: each start replayed, so that the env's own
dice (SMAX draws every attack's cooldown at random, and the heuristic enemy some of its
choices) are told apart from starts that the policy loses every time.

    python bench/smax_replays.py --run RUN_DIR [--run ...] [--starts 256] [--replays 16]

For each seed of each run's latest checkpoint, greedy (no dice of its own): --starts fresh
starts, each played --replays times with other step keys. Per seed: the win rate; the share
of starts won on every replay, on none, and on some; the share won at least once (the win
rate if the dice always fell our way); and the share of the losses that fall on starts also
won on some replay (losses to the dice rather than to the start).

Writes bench/results/smax_replays.{json,md} (or --results-name's).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import report  # noqa: E402  (bench/report.py)
from marl import rollout, teams  # noqa: E402
from pipelines import saved_run  # noqa: E402


def replayed(run_dir: str, starts: int, replays: int) -> list[dict]:
    """One row per seed of the run's latest checkpoint: its starts' win rates over replays."""
    run = saved_run.load_run(run_dir)
    env, names, score = teams.scoring(run.parts.env)
    if names:
        raise SystemExit(f"{run_dir} is a team run; smax_replays plays one trained side against the "
                         f"heuristic enemy: pass a run without teams")
    learner = run.parts.single_seed
    evaluate = rollout.make_evaluator(env, learner.act, learner.init_carry, replays, learner.greedy, score)
    per_start = jax.jit(jax.vmap(evaluate, in_axes=(None, 0, 0)))
    rows = []
    for s in range(run.config.n_seeds):
        start_keys, step_keys = (jax.random.split(jax.random.PRNGKey(10_000 * part + s), starts) for part in (1, 2))
        win = np.asarray(per_start(saved_run.seed_params(run, s), step_keys, start_keys)["win_rate"])
        lost = 1.0 - win
        rows.append({"map": run.config.env_id.split(":", 1)[1], "run": run_dir, "seed": s,
                     "env_steps": int(run.meta.get("env_steps", 0)), "starts": starts, "replays": replays,
                     "win": float(win.mean()), "always": float((win == 1.0).mean()),
                     "never": float((win == 0.0).mean()), "sometimes": float(((win > 0) & (win < 1)).mean()),
                     "won_once": float((win > 0).mean()),
                     "losses_on_won_starts": float(lost[win > 0].sum() / max(lost.sum(), 1e-9))})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", required=True, help="a trained SMAX run dir (repeatable)")
    parser.add_argument("--starts", type=int, default=256)
    parser.add_argument("--replays", type=int, default=16)
    parser.add_argument("--results-name", default="smax_replays")
    args = parser.parse_args()
    results = [row for run_dir in args.run for row in replayed(run_dir, args.starts, args.replays)]
    rows = [[r["map"], f"{r['run']} seed {r['seed']}", f"{r['env_steps']:,}", f"{r['starts']} x {r['replays']}",
             f"{r['win']:.3f}", f"{r['always']:.3f}", f"{r['sometimes']:.3f}", f"{r['never']:.3f}",
             f"{r['won_once']:.3f}", f"{r['losses_on_won_starts']:.2f}"] for r in results]
    report.save(args.results_name, {"results": results},
                ["map", "policy", "env steps", "starts x replays", "win", "starts always won",
                 "sometimes", "never", "won at least once", "losses on starts won at least once"],
                ["---", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---:"], rows)


if __name__ == "__main__":
    main()
