"""Rollouts: one jitted `lax.scan` over T steps of N vmapped JAX envs with auto-reset, and
the same contract for N numpy (PettingZoo) envs stepped on a CPU, outside `jit`.

A policy is a function
    act(params, carry, obs, avail, reset, key, explore) -> (actions, carry, extras)
over a batch of envs: obs [N, agent, obs_dim], avail [N, agent, mask], reset [N] (True where
obs start a new episode, so recurrent policies zero their memory). `explore` holds
exploration settings such as epsilon; evaluation passes the greedy setting. `extras` is a
dict of [N, ...] arrays stored beside each transition (e.g. a behaviour log-probability).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from marl.envs import JaxEnv, PettingZooEnv, Timestep


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
        actions, policy_carry, extras = act(params, rs.policy_carry, ts.obs, ts.avail_actions,
                                            ts.done, act_key, explore)
        next_ts, env_state = jax.vmap(env.step)(jax.random.split(step_key, n_envs),
                                                rs.env_state, actions)
        ep_return = rs.episode_return + episode_reward(next_ts.reward)
        ep_length = rs.episode_length + 1
        record = {
            "obs": ts.obs, "state": ts.state, "avail_actions": ts.avail_actions,
            "action": actions, "reward": next_ts.reward, "done": next_ts.done, "won": next_ts.won,
            **extras,
            # episode bookkeeping, summarised below and not stored
            "_return": ep_return, "_length": ep_length,
        }
        done = next_ts.done
        rs = RolloutState(env_state, next_ts, policy_carry,
                          jnp.where(done, 0.0, ep_return), jnp.where(done, 0, ep_length), key)
        return (params, explore, rs), record

    def collect(params, rstate: RolloutState, explore):
        (_, _, rstate), record = jax.lax.scan(step, (params, explore, rstate), None, n_steps)
        return rstate, *split_record(record, jnp)

    return jax.jit(init), jax.jit(collect)


def split_record(record: dict, xp=jnp):
    """[T, N] records -> (stored data, stats of the episodes that ended in them)."""
    done = record["done"]
    n_done = done.sum()
    per = lambda x: xp.where(n_done > 0, xp.sum(xp.where(done, x, 0)) / xp.maximum(n_done, 1), xp.nan)
    stats = {"episodes": n_done, "return_mean": per(record["_return"]),
             "length_mean": per(record["_length"]), "win_rate": per(record["won"])}
    return {k: v for k, v in record.items() if not k.startswith("_")}, stats


def fresh_numpy_envs(env: PettingZooEnv, n_envs: int, key):
    """N new instances of a numpy env, reset with distinct seeds drawn from `key`."""
    instances = [PettingZooEnv(env.factory, env.spec) for _ in range(n_envs)]
    first = int(jax.random.randint(key, (), 0, 2**30))
    return instances, [e.reset(seed=first + i) for i, e in enumerate(instances)]


class NumpyRolloutState(NamedTuple):
    envs: list  # N PettingZooEnv instances, each mid-episode
    timestep: Timestep  # stacked [N, ...] numpy
    policy_carry: Any
    episode_return: np.ndarray
    episode_length: np.ndarray
    key: jax.Array


def make_numpy_collector(env: PettingZooEnv, act: Callable, init_carry: Callable, n_envs: int,
                         n_steps: int, seed: int = 0):
    """The collector contract for numpy envs: N PettingZoo instances stepped in a Python
    loop on a CPU, the policy jitted once per step over all N. Same data and stats as
    `make_collector`, as numpy arrays."""
    act = jax.jit(act)
    stack = lambda steps: Timestep(*(np.stack(x) for x in zip(*steps)))

    def init(key) -> NumpyRolloutState:
        instances, steps = fresh_numpy_envs(env, n_envs, key)
        timestep = stack(steps)
        return NumpyRolloutState(instances, timestep, init_carry(n_envs), np.zeros(n_envs),
                                 np.zeros(n_envs, np.int32), key)

    def collect(params, rs: NumpyRolloutState, explore):
        records, carry, key, ts = [], rs.policy_carry, rs.key, rs.timestep
        ep_return, ep_length = rs.episode_return.copy(), rs.episode_length.copy()
        for _ in range(n_steps):
            key, act_key = jax.random.split(key)
            actions, carry, extras = act(params, carry, ts.obs, ts.avail_actions, ts.done,
                                         act_key, explore)
            actions = np.asarray(actions)
            next_ts = stack([e.step(a) for e, a in zip(rs.envs, actions)])
            ep_return = ep_return + episode_reward(next_ts.reward)
            ep_length = ep_length + 1
            records.append({"obs": ts.obs, "state": ts.state, "avail_actions": ts.avail_actions,
                            "action": actions, "reward": next_ts.reward, "done": next_ts.done,
                            "won": next_ts.won, **{k: np.asarray(v) for k, v in extras.items()},
                            "_return": ep_return, "_length": ep_length})
            ep_return = np.where(next_ts.done, 0.0, ep_return)
            ep_length = np.where(next_ts.done, 0, ep_length)
            ts = next_ts
        record = {k: np.stack([r[k] for r in records]) for k in records[0]}
        rs = NumpyRolloutState(rs.envs, ts, carry, ep_return, ep_length, key)
        return rs, *split_record(record, np)

    return init, collect


def make_evaluator(env: JaxEnv, act: Callable, init_carry: Callable, n_envs: int, explore):
    """Returns jitted evaluate(params, key) -> stats over the first episode of each of N envs."""
    horizon = env.spec.episode_limit + 1

    def evaluate(params, key):
        key, reset_key = jax.random.split(key)
        timestep, env_state = jax.vmap(env.reset)(jax.random.split(reset_key, n_envs))

        def step(carry, _):
            env_state, ts, policy_carry, finished, ret, length, won, key = carry
            key, act_key, step_key = jax.random.split(key, 3)
            actions, policy_carry, _ = act(params, policy_carry, ts.obs, ts.avail_actions,
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


def make_numpy_evaluator(env: PettingZooEnv, act: Callable, init_carry: Callable, n_envs: int,
                         explore):
    """evaluate(params, key) -> stats over the first episode of each of N numpy envs."""
    act = jax.jit(act)

    def evaluate(params, key):
        instances, steps = fresh_numpy_envs(env, n_envs, key)
        carry = init_carry(n_envs)
        finished = np.zeros(n_envs, bool)
        ret, length, won = np.zeros(n_envs), np.zeros(n_envs, np.int32), np.zeros(n_envs, bool)
        while not finished.all():
            ts = Timestep(*(np.stack(x) for x in zip(*steps)))
            key, act_key = jax.random.split(key)
            actions, carry, _ = act(params, carry, ts.obs, ts.avail_actions, ts.done, act_key, explore)
            actions = np.asarray(actions)
            # finished envs idle on their own auto-reset episode, which is not counted
            steps = [e.step(a) for e, a in zip(instances, actions)]
            live = ~finished
            reward = np.stack([s.reward for s in steps]).mean(axis=-1)
            done = np.array([s.done for s in steps])
            ret += np.where(live, reward, 0.0)
            length += live
            won |= live & np.array([s.won for s in steps])
            finished |= done
        return {"episodes": finished.sum(), "return_mean": ret.mean(),
                "length_mean": length.mean(), "win_rate": won.mean()}

    return evaluate
