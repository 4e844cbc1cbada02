"""The contract between a learner (marl/qmix.py, marl/mappo.py, ...) and the pipelines.

A policy is `act(params, carry, obs, avail, reset, key, explore) -> (actions, carry, extras)`
over a batch of envs (see marl.rollout); `extras` is a dict of per-env arrays that the
collector stores beside the transition (e.g. the behaviour log-probability for PPO),
named and shaped by `extra_fields`.

Off-policy learners train on windows sampled from the whole replay ring:
    train(train_state, ring arrays [slot, T, N, ...], buffer.Ring, n_updates)
On-policy learners train once on exactly the regions that the last collect wrote:
    train(train_state, regions [R, T, N, ...], buffer.Ring (unused), n_updates=R)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from marl.envs import EnvSpec


@dataclasses.dataclass(frozen=True)
class Learner:
    name: str
    config: Any  # the algorithm's frozen Config dataclass
    spec: EnvSpec
    init: Any  # key -> train_state (a pytree of arrays)
    act: Any  # the rollout policy, see above
    init_carry: Any  # n_envs -> recurrent policy state
    policy_params: Any  # train_state -> the parameters collectors need
    exploration: Any  # env_steps -> explore settings for collection
    greedy: Any  # explore settings for evaluation
    update: Any  # (train_state, batch) -> (train_state, metrics)
    train: Any  # see above
    on_policy: bool = False
    # name -> (shape per env, dtype, dim names): what act's extras hold, stored per step
    extra_fields: dict = dataclasses.field(default_factory=dict)
    # (train_state, windows {field: [B, L, ...]}) -> {name: (array [B, L, ...], dims after
    # (step, env))}: per-step values (Q-values, state values, TD errors) for reanalysis
    score: Any = None
    loss_fn: Any = None
    agent: Any = None
    mixer: Any = None
