"""How a trained SMAX team fights: the margins of its wins and how it picks targets, so that two
learners at different win rates (IPPO and MAPPO on 8m) can be told apart by what they do.

    python bench/smax_behaviour.py RUN_DIR [RUN_DIR ...] [--episodes 512]

For each seed of each run's latest checkpoint, greedy, --episodes fresh starts played to their
end. Per run (mean over seeds): the win rate; in won episodes, the allies left alive and their
health left (each unit's over its full health, summed over the allies, over their number) and
the length; in lost ones, the enemies left alive; of the steps where two or more allies chose
an attack, the distinct targets per attacker (1 / attackers: all on one enemy; 1: each its
own) and the share of attacks on the weakest enemy the attacker could reach; and of the steps
of allies under a third of their health with an enemy in reach, the share spent moving away
from the fight's front (a move action, not attack or stop).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pipelines.saved_run import load_run, seed_params  # noqa: E402

N_MOVES = 5  # SMAX's actions: 4 moves and stop, then one attack per enemy


def play(run, seed: int, episodes: int) -> dict[str, np.ndarray]:
    """Every step of `episodes` greedy episodes of one seed: actions, what each ally could
    attack, every unit's health and whether each env's episode is still on."""
    env, learner = run.parts.env, run.parts.single_seed
    params = seed_params(run, seed)
    horizon = env.spec.episode_limit + 1

    @jax.jit
    def rollout(key):
        key, reset_key = jax.random.split(key)
        ts, env_state = jax.vmap(env.reset)(jax.random.split(reset_key, episodes))

        def step(carry, _):
            env_state, ts, policy_carry, finished, key = carry
            key, act_key, step_key = jax.random.split(key, 3)
            actions, policy_carry, _ = learner.act(params, policy_carry, ts.obs, ts.avail_actions,
                                                   ts.first, act_key, learner.greedy)
            units = getattr(env_state, "state", env_state)
            record = {"action": actions, "avail": ts.avail_actions, "health": units.unit_health,
                      "alive": units.unit_alive, "live": ~finished}
            ts, env_state = jax.vmap(env.step)(jax.random.split(step_key, episodes), env_state, actions)
            ended = ts.terminated | ts.truncated
            record.update(ended=ended & ~finished, won=ts.won & ~finished)
            return (env_state, ts, policy_carry, finished | ended, key), record

        init = (env_state, ts, learner.init_carry(episodes), jnp.zeros(episodes, bool), key)
        return jax.lax.scan(step, init, None, horizon)[1]

    return jax.tree.map(np.asarray, rollout(jax.random.PRNGKey(20_000 + seed)))


def behaviour(steps: dict[str, np.ndarray], n_allies: int) -> dict[str, float]:
    """The docstring's measures, from one seed's steps ([T, N, ...]; `play`'s)."""
    live, ended, won = steps["live"], steps["ended"], steps["won"]
    # the last step of each episode (the state before its final step: SMAX resets on the end)
    last = np.argmax(ended, axis=0)  # [N]
    n = np.arange(live.shape[1])
    health, alive = steps["health"][last, n], steps["alive"][last, n]  # [N, units]
    full = steps["health"][0]  # [N, units]: every unit starts at its type's full health
    was_won = won.any(0)
    allies_alive = alive[:, :n_allies].sum(1)
    ally_health = (np.clip(health[:, :n_allies], 0, None) / full[:, :n_allies]).mean(1)
    enemies_alive = alive[:, n_allies:].sum(1)
    # targets: the allies on an attack at a live step
    action, avail = steps["action"], steps["avail"]  # [T, N, agent], [T, N, agent, A]
    attacking = (action >= N_MOVES) & live[..., None] & steps["alive"][..., :n_allies]
    attackers = attacking.sum(-1)  # [T, N]
    target = np.where(attacking, action - N_MOVES, -1)
    n_enemies = avail.shape[-1] - N_MOVES
    distinct = (target[..., None] == np.arange(n_enemies)).any(-2).sum(-1)  # [T, N]
    many = attackers >= 2
    enemy_health = steps["health"][..., n_allies:]  # [T, N, enemy]
    reach = avail[..., N_MOVES:].astype(bool)  # [T, N, agent, enemy]
    reach_health = np.where(reach, enemy_health[:, :, None, :], np.inf)
    weakest = reach_health.min(-1)  # [T, N, agent]
    chosen = np.take_along_axis(enemy_health[:, :, None, :], np.clip(target, 0, None)[..., None], -1)[..., 0]
    on_weakest = (chosen <= weakest + 1e-6)[attacking]
    hurt = (steps["alive"][..., :n_allies] & live[..., None]
            & (steps["health"][..., :n_allies] < full[None, :, :n_allies] / 3) & reach.any(-1))
    moving = (action < N_MOVES - 1)[hurt]  # actions 0-3 move, 4 stops
    return {"win": float(was_won.mean()), "episodes": int(ended.any(0).sum()),
            "won_allies_alive": float(allies_alive[was_won].mean()) if was_won.any() else float("nan"),
            "won_ally_health": float(ally_health[was_won].mean()) if was_won.any() else float("nan"),
            "won_length": float((last + 1)[was_won].mean()) if was_won.any() else float("nan"),
            "lost_enemies_alive": float(enemies_alive[~was_won].mean()) if (~was_won).any() else float("nan"),
            "targets_per_attacker": float((distinct[many] / attackers[many]).mean()),
            "on_weakest": float(on_weakest.mean()), "hurt_moving": float(moving.mean()) if moving.size else float("nan")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--episodes", type=int, default=512, help="greedy episodes per seed")
    args = parser.parse_args()
    keys = ["win", "won_allies_alive", "won_ally_health", "won_length", "lost_enemies_alive",
            "targets_per_attacker", "on_weakest", "hurt_moving"]
    print("| run | algo, critic | env steps | " + " | ".join(keys) + " |")
    print("|---|---|---:|" + "---:|" * len(keys))
    for run_dir in args.run_dirs:
        run = load_run(run_dir)
        if run.parts.env.family != "smax":
            raise SystemExit(f"{run_dir} is a {run.config.env_id} run; this probe reads SMAX battles")
        n_allies = run.parts.env.env.num_allies
        rows = [behaviour(play(run, s, args.episodes), n_allies) for s in range(run.config.n_seeds)]
        mean = {k: np.nanmean([r[k] for r in rows]) for k in keys}
        critic = getattr(run.parts.single_seed.config, "critic", "")
        print(f"| {run_dir} | {run.config.algo} {critic} | {int(run.meta.get('env_steps', 0)):,} | "
              + " | ".join(f"{mean[k]:.3f}" for k in keys) + " |", flush=True)


if __name__ == "__main__":
    main()
