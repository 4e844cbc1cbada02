"""What a trained QMIX mixer holds: per seed, on the states of a run's own replay.

    python bench/qmix_mixer_probe.py RUN_DIR [--regions 64]

For each seed of the run's latest checkpoint, the mixer is applied to the global states of
the store's last --regions regions (that seed's envs) with every agent's Q at 0: Q_tot(q=0) is
what the state's own terms (hypernetwork biases, V(s)) say alone, dQ_tot/dQ_i how far an
agent's Q moves Q_tot there. The same for a freshly initialised mixer on the same states,
for comparison. Prints a markdown table; no files written.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.saved_run import load_run, seed_params
from storage import open_replay


def mixer_terms(learner, mixer_params, states: jax.Array) -> dict[str, float]:
    n_agents = learner.spec.n_agents
    q0 = jnp.zeros((states.shape[0], n_agents))
    q_tot = learner.mixer.apply(mixer_params, q0, states)
    one = lambda q, s: learner.mixer.apply(mixer_params, q[None], s[None])[0]
    gain = jax.vmap(jax.grad(one))(q0, states)
    return {"q_tot_mean": float(q_tot.mean()), "q_tot_std": float(q_tot.std()),
            "gain_mean": float(gain.mean()), "gain_p10": float(jnp.percentile(gain, 10)),
            "gain_p90": float(jnp.percentile(gain, 90))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--regions", type=int, default=64, help="the store's last regions whose states are used")
    args = parser.parse_args()
    run = load_run(args.run_dir)
    learner = run.parts.learner
    if run.config.algo != "qmix":
        parser.error(f"{args.run_dir} is a {run.config.algo} run; the probe reads QMIX's mixer")
    replay = open_replay(os.path.join(args.run_dir, "replay"))
    last = replay.isel(step=slice(-args.regions * run.config.steps_per_region, None))
    seeds = np.asarray(last["seed"]) if "seed" in last.coords else np.zeros(last.sizes["env"], int)
    mixer = run.train_state["params"]["mixer"]
    fresh = learner.init(jax.random.PRNGKey(run.config.seed))["params"]["mixer"]
    print(f"{args.run_dir}: checkpoint {run.checkpoint} ({run.meta.get('env_steps', '?')} env steps), "
          f"states of the last {args.regions} regions")
    print("| seed | mixer | Q_tot(q=0) mean | std | dQ_tot/dQ_i mean | p10 | p90 |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for seed in range(run.config.n_seeds):
        states = jnp.asarray(last["state"].values[:, seeds == seed].reshape(-1, last.sizes["state_dim"]))
        for name, params in (("trained", seed_params(run, seed, mixer)), ("fresh init", seed_params(run, seed, fresh))):
            t = mixer_terms(learner, params, states)
            print(f"| {seed} | {name} | {t['q_tot_mean']:.3g} | {t['q_tot_std']:.3g} | {t['gain_mean']:.3g} "
                  f"| {t['gain_p10']:.3g} | {t['gain_p90']:.3g} |")


if __name__ == "__main__":
    main()
