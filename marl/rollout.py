"""Rollouts: one jitted `lax.scan` over T steps of N vmapped JAX envs with auto-reset, and
the same contract for N numpy (PettingZoo) envs stepped on a CPU, outside `jit`.

A policy is a function
    act(params, carry, obs, avail, reset, key, explore) -> (actions, carry, extras)
over a batch of envs: obs [N, agent, obs_dim], avail [N, agent, mask], reset [N] (the
Timestep's `first`: True where obs start a new episode, so recurrent policies zero their
memory). `explore` holds
exploration settings such as epsilon; evaluation passes the greedy setting. `extras` is a
dict of [N, ...] arrays stored beside each transition (e.g. a behaviour log-probability).

Collectors emit one `marl.transition.Transition` per step and return the [T, N, ...]
Transitions flattened by `transition.to_record`: the dict the replay store writes and the
learners read.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from marl.envs import JaxEnv, PettingZooEnv, Timestep
from marl.transition import Transition, done, to_record


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

    data is the [T, N, ...] Transitions of the T steps as a flat dict (`to_record`): obs,
    state, avail_actions, action and first (what was seen and done at step t), reward,
    terminated, truncated and won (what step t led to), and the policy's extras.
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
                                            ts.first, act_key, explore)
        next_ts, env_state = jax.vmap(env.step)(jax.random.split(step_key, n_envs),
                                                rs.env_state, actions)
        transition = make_transition(ts, actions, next_ts, extras)
        ep_return = rs.episode_return + episode_reward(next_ts.reward)
        ep_length = rs.episode_length + 1
        ended = done(next_ts)
        rs = RolloutState(env_state, next_ts, policy_carry,
                          jnp.where(ended, 0.0, ep_return), jnp.where(ended, 0, ep_length), key)
        # episode bookkeeping, summarised below and not stored
        return (params, explore, rs), (transition, ep_return, ep_length)

    def collect(params, rstate: RolloutState, explore):
        (_, _, rstate), (transition, ep_return, ep_length) = jax.lax.scan(
            step, (params, explore, rstate), None, n_steps)
        return rstate, to_record(transition), episode_stats(transition, ep_return, ep_length, jnp)

    return jax.jit(init), jax.jit(collect)


def make_transition(ts: Timestep, actions, next_ts: Timestep, extras: dict) -> Transition:
    """The transition of step t: what was seen (`ts`) and done there, and what it led to."""
    return Transition(obs=ts.obs, state=ts.state, avail_actions=ts.avail_actions, action=actions,
                      reward=next_ts.reward, first=ts.first, terminated=next_ts.terminated,
                      truncated=next_ts.truncated, won=next_ts.won, extras=extras,
                      shaped_reward=next_ts.shaped_reward)


def episode_stats(transition: Transition, ep_return, ep_length, xp=jnp) -> dict:
    """Stats of the episodes that ended in [T, N] transitions, from the running return and
    length after each step."""
    ended = done(transition)
    n_done = ended.sum()
    per = lambda x: xp.where(n_done > 0, xp.sum(xp.where(ended, x, 0)) / xp.maximum(n_done, 1), xp.nan)
    return {"episodes": n_done, "return_mean": per(ep_return), "length_mean": per(ep_length),
            "win_rate": per(transition.won)}


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


def _stack(items: list):
    """[N] numpy Timesteps (or [T] Transitions) -> one whose leaves are stacked."""
    return jax.tree.map(lambda *xs: np.stack(xs), *items)


def make_numpy_collector(env: PettingZooEnv, act: Callable, init_carry: Callable, n_envs: int,
                         n_steps: int, seed: int = 0):
    """The collector contract for numpy envs: N PettingZoo instances stepped in a Python
    loop on a CPU, the policy jitted once per step over all N. Same data and stats as
    `make_collector`, as numpy arrays."""
    act = jax.jit(act)

    def init(key) -> NumpyRolloutState:
        instances, steps = fresh_numpy_envs(env, n_envs, key)
        return NumpyRolloutState(instances, _stack(steps), init_carry(n_envs), np.zeros(n_envs),
                                 np.zeros(n_envs, np.int32), key)

    def collect(params, rs: NumpyRolloutState, explore):
        transitions, returns, lengths = [], [], []
        carry, key, ts = rs.policy_carry, rs.key, rs.timestep
        ep_return, ep_length = rs.episode_return.copy(), rs.episode_length.copy()
        for _ in range(n_steps):
            key, act_key = jax.random.split(key)
            actions, carry, extras = act(params, carry, ts.obs, ts.avail_actions, ts.first,
                                         act_key, explore)
            actions = np.asarray(actions)
            next_ts = _stack([e.step(a) for e, a in zip(rs.envs, actions)])
            transitions.append(make_transition(ts, actions, next_ts,
                                               {k: np.asarray(v) for k, v in extras.items()}))
            ep_return = ep_return + episode_reward(next_ts.reward)
            ep_length = ep_length + 1
            returns.append(ep_return)
            lengths.append(ep_length)
            ended = done(next_ts)
            ep_return = np.where(ended, 0.0, ep_return)
            ep_length = np.where(ended, 0, ep_length)
            ts = next_ts
        transition = _stack(transitions)
        rs = NumpyRolloutState(rs.envs, ts, carry, ep_return, ep_length, key)
        return rs, to_record(transition), episode_stats(transition, np.stack(returns),
                                                        np.stack(lengths), np)

    return init, collect


def mean_reward_score(ts, env_state):
    """What an evaluator counts of one env's step by default: the agents' mean reward and the
    env's win flag."""
    return episode_reward(ts.reward), ts.won


def _per_lane(flags, like):
    """[N] flags shaped to broadcast over `like` ([N, ...])."""
    return flags.reshape(flags.shape + (1,) * (like.ndim - flags.ndim))


def make_evaluator(env: JaxEnv, act: Callable, init_carry: Callable, n_envs: int, explore,
                   score: Callable = mean_reward_score):
    """Returns jitted evaluate(params, key, start=None) -> stats over the first episode of
    each of N envs: N fresh starts, or with `start` (a reset key) N replays of that one start,
    which differ only by the env's own dice (the steps' keys).

    score(timestep, env_state) -> (reward, won) of one env's step; where it gives arrays (one
    entry per team, marl.teams.team_scores), return_mean and win_rate have their shape."""
    horizon = env.spec.episode_limit + 1

    def evaluate(params, key, start=None):
        key, reset_key = jax.random.split(key)
        reset_keys = jax.random.split(reset_key, n_envs) if start is None else jnp.broadcast_to(start, (n_envs, *start.shape))
        timestep, env_state = jax.vmap(env.reset)(reset_keys)

        def step(carry, _):
            env_state, ts, policy_carry, finished, ret, length, won, key = carry
            key, act_key, step_key = jax.random.split(key, 3)
            actions, policy_carry, _ = act(params, policy_carry, ts.obs, ts.avail_actions,
                                           ts.first, act_key, explore)
            ts, env_state = jax.vmap(env.step)(jax.random.split(step_key, n_envs), env_state, actions)
            reward, won_now = jax.vmap(score)(ts, env_state)
            live = ~finished
            ret = ret + jnp.where(_per_lane(live, reward), reward, 0.0)
            length = length + live
            won = won | (_per_lane(live, won_now) & won_now)
            finished = finished | done(ts)
            return (env_state, ts, policy_carry, finished, ret, length, won, key), None

        reward, won = jax.eval_shape(jax.vmap(score), timestep, env_state)
        init = (env_state, timestep, init_carry(n_envs), jnp.zeros(n_envs, bool), jnp.zeros(reward.shape),
                jnp.zeros(n_envs, jnp.int32), jnp.zeros(won.shape, bool), key)
        (_, _, _, finished, ret, length, won, _), _ = jax.lax.scan(step, init, None, horizon)
        return {"episodes": finished.sum(), "return_mean": ret.mean(axis=0),
                "length_mean": length.mean(), "win_rate": won.mean(axis=0)}

    return jax.jit(evaluate)


def make_numpy_evaluator(env: PettingZooEnv, act: Callable, init_carry: Callable, n_envs: int,
                         explore, score: Callable = mean_reward_score):
    """evaluate(params, key) -> stats over the first episode of each of N numpy envs;
    score(timestep, env instance) as in make_evaluator."""
    act = jax.jit(act)

    def evaluate(params, key):
        instances, steps = fresh_numpy_envs(env, n_envs, key)
        carry = init_carry(n_envs)
        finished = np.zeros(n_envs, bool)
        ret, length, won = 0.0, np.zeros(n_envs, np.int32), False
        ts = _stack(steps)
        while not finished.all():
            key, act_key = jax.random.split(key)
            actions, carry, _ = act(params, carry, ts.obs, ts.avail_actions, ts.first, act_key, explore)
            actions = np.asarray(actions)
            # finished envs idle on their own auto-reset episode, which is not counted
            steps = [e.step(a) for e, a in zip(instances, actions)]
            reward, won_now = (np.stack(x) for x in zip(*(score(s, e) for s, e in zip(steps, instances))))
            ts = _stack(steps)
            live = ~finished
            ret = ret + np.where(_per_lane(live, reward), reward, 0.0)
            length += live
            won = won | (_per_lane(live, won_now) & won_now)
            finished |= done(ts)
        return {"episodes": finished.sum(), "return_mean": np.mean(ret, axis=0),
                "length_mean": length.mean(), "win_rate": np.mean(won, axis=0)}

    return evaluate
