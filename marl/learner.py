"""The contract between a learner (marl/qmix.py, ...) and the pipelines that run it."""

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
    act: Any  # the rollout policy, see marl.rollout
    init_carry: Any  # n_envs -> recurrent policy state
    policy_params: Any  # train_state -> the parameters collectors need
    exploration: Any  # env_steps -> explore settings for collection
    greedy: Any  # explore settings for evaluation
    update: Any  # (train_state, batch) -> (train_state, metrics)
    train: Any  # (train_state, ring arrays, valid, n_updates) -> (train_state, metrics)
    loss_fn: Any = None
    agent: Any = None
    mixer: Any = None
