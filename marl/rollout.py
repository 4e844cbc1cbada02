"""Jitted rollouts: one `lax.scan` over T steps of N vmapped JAX envs with auto-reset.

A policy is a function
    act(params, carry, obs, avail, reset, key, explore) -> (actions, carry)
over a batch of envs: obs [N, agent, obs_dim], avail [N, agent, mask], reset [N] (True where
obs start a new episode, so recurrent policies zero their memory). `explore` holds
exploration settings such as epsilon; evaluation passes the greedy setting.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from marl.envs import JaxEnv, Timestep


class RolloutState(NamedTuple):
    """What a collector carries between calls so episodes continue across regions."""

    env_state: Any
    timestep: Timestep  # the latest timestep of each env, leaves [N, ...]
    policy_carry: Any  # recurrent state [N, agent, hidden] (or an empty array)
    episode_return: jax.Array  # [N], running return of the unfinished episode
    episode_length: jax.Array  # [N]
    key: jax.Array


def episode_reward(reward):
    """One number per env step: the agents' mean reward (SMAX's team reward)."""
    return reward.mean(axis=-1)


def make_collector(env: JaxEnv, act: Callable, init_carry: Callable, n_envs: int, n_steps: int):
    """Returns jitted (init(key) -> RolloutState, collect(params, rstate, explore) -> (rstate, data, stats)).

    data holds [T, N, ...] arrays in the replay schema: obs, state, avail_actions, action
    (what was seen and done at step t) and reward, done (what step t led to).
    """

    def init(key) -> RolloutState:
        key, reset_key = jax.random.split(key)
        timestep, env_state = jax.vmap(env.reset)(jax.random.split(reset_key, n_envs))
        return RolloutState(env_state, timestep, init_carry(n_envs),
                            jnp.zeros(n_envs), jnp.zeros(n_envs, jnp.int32), key)

    def step(carry, _):
        params, explore, rs = carry
        key, act_key, step_key = jax.random.split(rs.key, 3)
        ts = rs.timestep
        actions, policy_carry = act(params, rs.policy_carry, ts.obs, ts.avail_actions,
                                    ts.done, act_key, explore)
        next_ts, env_state = jax.vmap(env.step)(jax.random.split(step_key, n_envs),
                                                rs.env_state, actions)
        ep_return = rs.episode_return + episode_reward(next_ts.reward)
        ep_length = rs.episode_length + 1
        record = {
            "obs": ts.obs, "state": ts.state, "avail_actions": ts.avail_actions,
            "action": actions, "reward": next_ts.reward, "done": next_ts.done,
            # episode bookkeeping, summarised below and not stored
            "_return": ep_return, "_length": ep_length, "_won": next_ts.won,
        }
        done = next_ts.done
        rs = RolloutState(env_state, next_ts, policy_carry,
                          jnp.where(done, 0.0, ep_return), jnp.where(done, 0, ep_length), key)
        return (params, explore, rs), record

    def collect(params, rstate: RolloutState, explore):
        (_, _, rstate), record = jax.lax.scan(step, (params, explore, rstate), None, n_steps)
        done = record["done"]
        n_done = done.sum()
        per = lambda x: jnp.where(n_done > 0, jnp.sum(jnp.where(done, x, 0)) / jnp.maximum(n_done, 1), jnp.nan)
        stats = {"episodes": n_done, "return_mean": per(record["_return"]),
                 "length_mean": per(record["_length"]), "win_rate": per(record["_won"])}
        data = {k: v for k, v in record.items() if not k.startswith("_")}
        return rstate, data, stats

    return jax.jit(init), jax.jit(collect)


def make_evaluator(env: JaxEnv, act: Callable, init_carry: Callable, n_envs: int, explore):
    """Returns jitted evaluate(params, key) -> stats over the first episode of each of N envs."""
    horizon = env.spec.episode_limit + 1

    def evaluate(params, key):
        key, reset_key = jax.random.split(key)
        timestep, env_state = jax.vmap(env.reset)(jax.random.split(reset_key, n_envs))

        def step(carry, _):
            env_state, ts, policy_carry, finished, ret, length, won, key = carry
            key, act_key, step_key = jax.random.split(key, 3)
            actions, policy_carry = act(params, policy_carry, ts.obs, ts.avail_actions,
                                        ts.done, act_key, explore)
            ts, env_state = jax.vmap(env.step)(jax.random.split(step_key, n_envs), env_state, actions)
            live = ~finished
            ret = ret + jnp.where(live, episode_reward(ts.reward), 0.0)
            length = length + live
            won = won | (live & ts.won)
            finished = finished | ts.done
            return (env_state, ts, policy_carry, finished, ret, length, won, key), None

        zeros = jnp.zeros(n_envs)
        init = (env_state, timestep, init_carry(n_envs), jnp.zeros(n_envs, bool), zeros,
                jnp.zeros(n_envs, jnp.int32), jnp.zeros(n_envs, bool), key)
        (_, _, _, finished, ret, length, won, _), _ = jax.lax.scan(step, init, None, horizon)
        return {"episodes": finished.sum(), "return_mean": ret.mean(),
                "length_mean": length.mean(), "win_rate": won.mean()}

    return jax.jit(evaluate)
