"""How well each MAPPO / IPPO run's critic predicts its own policy's returns, on fresh data.

    python bench/mappo_critic_probe.py RUN_DIR [RUN_DIR ...] [--regions 4]

For each seed of each run's latest checkpoint, that seed's policy collects --regions fresh
regions (the run's envs x steps, sampling as in training, the first region's episodes
started fresh), and on each:

- one train call of the seed's learner: its metrics are the critic's before the update, on
  data it has not trained on: the explained variance of the GAE targets (train/
  explained_variance in metrics.csv), the value loss;
- the advantages (GAE of the critic's values, the learner's gamma and lambda) of the agents
  still alive, split into their spread across the agents of one env step and the rest
  (between the steps' means): a central critic gives every agent of a step nearly one
  advantage (the team's), a local one each agent its own.

Prints a markdown table (mean over seeds and regions); no files written.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from marl import mappo, rollout, transition
from pipelines.saved_run import load_run, seed_params


def advantage_share_across_agents(learner, train_state, seq) -> float:
    """The share of the advantages' variance across the live agents of a step (the rest is
    between the steps' means), over steps with a target and agents with a choice (SMAX's dead
    units have one action; active masks leave their values untrained, so they would count noise)."""
    value = learner.score(train_state, seq)["value"][0]  # [N, T, agent], on the return's scale
    cut = transition.cut(seq)
    adv, _ = mappo.gae(seq["reward"][:, :-1], seq["terminated"][:, :-1], cut, value,
                       learner.config.gamma, learner.config.gae_lambda)
    live = np.asarray(seq["avail_actions"][:, :-1].sum(-1) > 1)  # [N, T-1, agent]
    keep = np.asarray(~cut, bool) & (live.sum(-1) >= 2)  # steps with a target and two live agents
    adv, live = np.asarray(adv)[keep], live[keep]  # [steps, agent]
    n = live.sum(1)
    step_mean = (adv * live).sum(1) / n
    within = ((adv - step_mean[:, None]) ** 2 * live).sum() / live.sum()
    total = ((adv - (adv * live).sum() / live.sum()) ** 2 * live).sum() / live.sum()
    return float(within / total)


def probe(run_dir: str, regions: int) -> dict[str, float]:
    run = load_run(run_dir)
    if run.config.algo not in ("mappo", "ippo"):
        raise SystemExit(f"{run_dir} is a {run.config.algo} run; the probe reads MAPPO / IPPO critics")
    learner, config = run.parts.single_seed, run.config
    init, collect = rollout.make_collector(run.parts.env, learner.act, learner.init_carry,
                                           config.envs_per_collector, config.steps_per_region)
    explore = learner.exploration(jnp.float32(run.meta.get("env_steps", 0)))
    rows = []
    for seed in range(config.n_seeds):
        train_state = seed_params(run, seed, run.train_state)
        params = learner.policy_params(train_state)
        rstate = init(jax.random.PRNGKey(1000 + seed))
        for _ in range(regions):
            rstate, data, _ = collect(params, rstate, explore)
            _, metrics = learner.train(train_state, {k: v[None] for k, v in data.items()}, jnp.ones(1, bool), 1)
            seq = {k: jnp.swapaxes(v, 0, 1) for k, v in data.items()}  # [N, T, ...]
            rows.append({"explained_variance": float(metrics["explained_variance"]),
                         "value_loss": float(metrics["value_loss"]), "entropy": float(metrics["entropy"]),
                         "adv_within_step": advantage_share_across_agents(learner, train_state, seq)})
    return {"critic": learner.config.critic, "env_steps": int(run.meta.get("env_steps", 0)),
            **{k: float(np.mean([r[k] for r in rows])) for k in rows[0]},
            "explained_variance_std": float(np.std([r["explained_variance"] for r in rows]))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--regions", type=int, default=4, help="fresh regions per seed")
    args = parser.parse_args()
    print("| run | critic | env steps | explained variance (± std over regions) | value loss | entropy "
          "| advantage variance across a step's agents (share) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for run_dir in args.run_dirs:
        p = probe(run_dir, args.regions)
        print(f"| {run_dir} | {p['critic']} | {p['env_steps']:,} | {p['explained_variance']:.3f} ± "
              f"{p['explained_variance_std']:.3f} | {p['value_loss']:.4f} | {p['entropy']:.3f} "
              f"| {p['adv_within_step']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
