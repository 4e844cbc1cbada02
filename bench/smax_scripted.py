"""Scripted baselines on SMAX maps: what a hand-written team wins against jaxmarl's heuristic
enemy, the floor a trained team must clear (bench/smax_maps.py's table reads beside it).

    python bench/smax_scripted.py [--maps 3m,8m,2s3z,3s5z] [--episodes 1024]

Two policies, each unit acting on the env's true state (no partial observability):

    focus fire   attack the enemy in range with the least health left, else move toward
                 the nearest living enemy (SMAC's classic micro rule)
    closest      attack the nearest enemy in range, else move toward the nearest enemy
                 (what the heuristic enemy does: the mirror match)

Also the episode outcomes of a trained run's latest checkpoint (`--run RUN_DIR`, greedy):
won, lost with our side wiped out, or ended by the time limit.

Writes bench/results/smax_scripted.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import report  # noqa: E402  (bench/report.py)
from marl import envs  # noqa: E402

MOVES = 4  # SMAX's discrete actions: 4 diagonal moves, stop, then one attack per enemy
DIAGONALS = jnp.array([[1, 1], [1, -1], [-1, -1], [-1, 1]], jnp.float32)  # moves 0..3


def scripted_policy(env: envs.JaxEnv, rule: str):
    """(env state, avail [agent, actions]) -> actions [agent] for every ally."""
    raw = env.env
    n_allies, n_enemies = raw.num_allies, raw.num_enemies

    def act(env_state, avail):
        s = env_state.state  # the heuristic-enemy wrapper's inner SMAX state
        enemy_pos, enemy_alive = s.unit_positions[n_allies:], s.unit_alive[n_allies:]
        enemy_health = jnp.where(enemy_alive, s.unit_health[n_allies:], jnp.inf)

        def one(i):
            in_range = avail[i, MOVES + 1:MOVES + 1 + n_enemies]
            distance = jnp.where(enemy_alive, jnp.linalg.norm(enemy_pos - s.unit_positions[i], axis=-1), jnp.inf)
            preference = enemy_health if rule == "focus fire" else distance
            target = jnp.argmin(jnp.where(in_range, preference, jnp.inf))
            move = jnp.argmax(DIAGONALS @ (enemy_pos[jnp.argmin(distance)] - s.unit_positions[i]))
            return jnp.where(in_range.any(), MOVES + 1 + target, move)

        return jax.vmap(one)(jnp.arange(n_allies))

    return act


def play(env: envs.JaxEnv, act, episodes: int, seed: int = 0) -> dict:
    """First episode of each of `episodes` fresh envs: won, wiped out, or out of time."""
    limit = env.spec.episode_limit

    def episode(key):
        ts, state = env.reset(key)

        def step(carry, _):
            ts, state, key, over, won, length = carry
            key, step_key = jax.random.split(key)
            ts, state = env.step(step_key, state, act(state, ts.avail_actions))
            won = won | (~over & ts.won)
            length = length + ~over
            return (ts, state, key, over | ts.first, won, length), None

        init = (ts, state, key, jnp.array(False), jnp.array(False), jnp.array(0))
        (_, _, _, _, won, length), _ = jax.lax.scan(step, init, None, limit + 1)
        return won, length

    won, length = jax.jit(jax.vmap(episode))(jax.random.split(jax.random.PRNGKey(seed), episodes))
    return _outcomes(np.asarray(won), np.asarray(length), limit)


def _outcomes(won, length, limit) -> dict:
    timeout = ~won & (length >= limit)
    return {"episodes": int(won.size), "win": float(won.mean()), "wiped_out": float((~won & ~timeout).mean()),
            "time_limit": float(timeout.mean()), "length_mean": float(length.mean())}


def trained(run_dir: str, episodes: int) -> list[dict]:
    """Greedy episodes of each seed of a trained run's latest checkpoint, as outcome rows."""
    from pipelines import saved_run

    run = saved_run.load_run(run_dir)
    player = saved_run._episode_player(run)
    out = []
    for s in range(run.config.n_seeds):
        values = player(saved_run.seed_params(run, s), jax.random.PRNGKey(123 + s), episodes)
        won = values["win_rate"] > 0.5
        out.append({"map": run.config.env_id.split(":", 1)[1], "policy": f"{run_dir} seed {s}",
                    "env_steps": int(run.meta.get("env_steps", 0)),
                    **_outcomes(won, values["length"], run.parts.env.spec.episode_limit)})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maps", default="3m,8m,2s3z,3s5z")
    parser.add_argument("--episodes", type=int, default=1024)
    parser.add_argument("--run", action="append", default=[], help="a trained run dir (repeatable)")
    args = parser.parse_args()

    results, rows = [], []
    for scenario in args.maps.split(","):
        env = envs.make(f"smax:{scenario}")
        for rule in ("focus fire", "closest"):
            r = {"map": scenario, "policy": f"scripted {rule}", **play(env, scripted_policy(env, rule), args.episodes)}
            results.append(r)
    for run_dir in args.run:
        results += trained(run_dir, args.episodes)
    for r in results:
        rows.append([r["map"], r["policy"], str(r["episodes"]), f"{r['win']:.3f}", f"{r['wiped_out']:.3f}",
                     f"{r['time_limit']:.3f}", f"{r['length_mean']:.1f}"])
    report.save("smax_scripted", {"results": results},
                ["map", "policy", "episodes", "win", "lost: wiped out", "lost: time limit", "mean length"],
                ["---", "---", "---:", "---:", "---:", "---:", "---:"], rows)


if __name__ == "__main__":
    main()
