"""Scripted baselines on SMAX maps: what a hand-written team wins against jaxmarl's heuristic
enemy, the floor a trained team must clear (bench/smax_maps.py's table reads beside it).

    python bench/smax_scripted.py [--maps 3m,8m,2s3z,3s5z] [--episodes 1024] [--retreat-below 0.35 ...]

Three policies, each unit acting on the env's true state (no partial observability):

    focus fire   attack the enemy in range with the least health left, else move toward
                 the nearest living enemy (SMAC's classic micro rule)
    closest      attack the nearest enemy in range, else move toward the nearest enemy
                 (what the heuristic enemy does: the mirror match)
    focus fire + retreat
                 focus fire, but a unit that an enemy shot at last step and whose health is
                 below --retreat-below steps away from its nearest enemy: the heuristic
                 enemy keeps its target only while it is in range, so the damage spreads
                 over our units while ours lands on one of theirs (at 0.35 it wins 2s3z and
                 3s5z outright and loses on the marine maps: BENCHMARKS.md)

Also the episode outcomes of a trained run's latest checkpoint (`--run RUN_DIR`, greedy):
won, lost with our side wiped out, or ended by the time limit.

Writes bench/results/smax_scripted.{json,md} (or --results-name's).
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

MOVES = 4  # SMAX's discrete actions: 4 moves, stop, then one attack per enemy


def scripted_policy(env: envs.JaxEnv, rule: str, retreat_below: float = 0.35):
    """(env state, avail [agent, actions]) -> actions [agent] for every ally; `retreat_below`
    is the retreat rule's health fraction (the other rules ignore it)."""
    raw = env.env
    n_allies, n_enemies = raw.num_allies, raw.num_enemies
    # the direction each move action takes a unit, as the env decodes it (up, right, down, left)
    directions = raw._decode_discrete_actions(jnp.arange(MOVES))[0]

    def act(env_state, avail):
        s = env_state.state  # the heuristic-enemy wrapper's inner SMAX state
        enemy_pos, enemy_alive = s.unit_positions[n_allies:], s.unit_alive[n_allies:]
        enemy_health = jnp.where(enemy_alive, s.unit_health[n_allies:], jnp.inf)
        if rule == "focus fire + retreat":
            # the ally each enemy attacked last step (an enemy numbers its targets in reverse)
            enemy_attack = s.prev_attack_actions[n_allies:]
            shot_at = (enemy_attack > MOVES) & enemy_alive
            enemy_target = jnp.where(shot_at, n_allies - 1 - (enemy_attack - MOVES - 1), -1)
            health = s.unit_health[:n_allies] / raw.unit_type_health[s.unit_types[:n_allies]]

        def one(i):
            in_range = avail[i, MOVES + 1:MOVES + 1 + n_enemies]
            distance = jnp.where(enemy_alive, jnp.linalg.norm(enemy_pos - s.unit_positions[i], axis=-1), jnp.inf)
            preference = distance if rule == "closest" else enemy_health
            target = jnp.argmin(jnp.where(in_range, preference, jnp.inf))
            to_nearest = enemy_pos[jnp.argmin(distance)] - s.unit_positions[i]
            action = jnp.where(in_range.any(), MOVES + 1 + target, jnp.argmax(directions @ to_nearest))
            if rule == "focus fire + retreat":
                retreat = jnp.any(enemy_target == i) & (health[i] < retreat_below)
                action = jnp.where(retreat, jnp.argmax(directions @ -to_nearest), action)
            return action

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
    parser.add_argument("--retreat-below", type=float, nargs="+", default=[0.35],
                        help="health fractions under which a shot-at unit of `focus fire + retreat` steps back")
    parser.add_argument("--run", action="append", default=[], help="a trained run dir (repeatable)")
    parser.add_argument("--results-name", default="smax_scripted")
    args = parser.parse_args()

    results, rows = [], []
    for scenario in args.maps.split(","):
        env = envs.make(f"smax:{scenario}")
        variants = [(rule, f"scripted {rule}", {}) for rule in ("focus fire", "closest")]
        variants += [("focus fire + retreat", f"scripted focus fire + retreat below {below:g}",
                      {"retreat_below": below}) for below in args.retreat_below]
        for rule, name, kwargs in variants:
            act = scripted_policy(env, rule, **kwargs)
            results.append({"map": scenario, "policy": name, **play(env, act, args.episodes)})
    for run_dir in args.run:
        results += trained(run_dir, args.episodes)
    for r in results:
        rows.append([r["map"], r["policy"], str(r["episodes"]), f"{r['win']:.3f}", f"{r['wiped_out']:.3f}",
                     f"{r['time_limit']:.3f}", f"{r['length_mean']:.1f}"])
    report.save(args.results_name, {"results": results},
                ["map", "policy", "episodes", "win", "lost: wiped out", "lost: time limit", "mean length"],
                ["---", "---", "---:", "---:", "---:", "---:", "---:"], rows)


if __name__ == "__main__":
    main()
