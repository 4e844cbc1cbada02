"""A trained team's policy as plain files, and the object that plays it from NumPy.

    save_policy(out_dir, algo, algo_config, spec, params)   what `marl export` writes
    policy = load_policy(out_dir)
    actions, carry = policy.act(obs)                        obs [agent, obs_dim] or [env, agent, obs_dim]
                                                            (images: [.., agent, H, W, C] uint8)
    actions, carry = policy.act(next_obs, avail_actions, carry)

The files: policy.json (format, algorithm and its full Config: the network's shape),
env_spec.json (agents, obs and action sizes), params.msgpack (the actor's parameters,
flax.serialization's msgpack). Loading rebuilds the learner from them (marl.algos) and
calls its own greedy `act`, so an exported policy plays exactly as the learner does.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

from marl import algos
from marl.envs import EnvSpec

FORMAT = 1
FILES = ("policy.json", "env_spec.json", "params.msgpack")


class PolicyError(ValueError):
    """An export dir that cannot be loaded; the message names what is missing and the fix."""


def save_policy(out_dir: str, algo: str, algo_config, spec: EnvSpec, params, source: dict | None = None) -> list[str]:
    """Writes the three files into `out_dir` (made if missing); returns their paths.
    `params` is one seed's policy params (learner.policy_params); `source` is free JSON
    saying where they came from (run dir, checkpoint)."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, name) for name in FILES]
    meta = {"format": FORMAT, "algo": algo, "config": dataclasses.asdict(algo_config), "source": source or {}}
    with open(paths[0], "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    with open(paths[1], "w") as f:
        json.dump(spec.to_dict(), f, indent=2, sort_keys=True)
    with open(paths[2], "wb") as f:
        f.write(serialization.msgpack_serialize(jax.tree.map(np.asarray, params)))
    return paths


class Policy:
    """Greedy play of an exported team over a batch of envs (or one env, without the batch axis)."""

    def __init__(self, algo: str, learner, params, source: dict):
        self.algo, self.learner, self.params, self.source = algo, learner, params, source
        self.spec: EnvSpec = learner.spec
        self._act = jax.jit(learner.act)
        self._key = jax.random.PRNGKey(0)  # greedy acting draws nothing that matters

    def initial_carry(self, n_envs: int = 1):
        """The recurrent state at an episode's start (a placeholder for feed-forward actors)."""
        return self.learner.init_carry(n_envs)

    def act(self, obs, avail_actions=None, carry=None, first=None):
        """(actions, carry) for obs [env, agent, obs_dim] (or [agent, obs_dim] for one env).

        avail_actions: [.., agent, n_actions] bools, default all available. carry: what the
        previous call returned, None at an episode's start (the learner's memory resets).
        first: per-env bools, True where an env's episode starts now (envs that reset on
        their own); default: all where carry is None, none otherwise.
        Actions are int32 [.., agent] (discrete) or float32 [.., agent, action_dim]."""
        shape, dtype = self.spec.agent_obs  # images: [.., agent, H, W, C] uint8
        obs = np.asarray(obs)
        single = obs.ndim == 1 + len(shape)
        if single:
            obs = obs[None]
        if obs.shape[1:] != (self.spec.n_agents, *shape):
            dims = ", ".join(map(str, shape))
            raise PolicyError(f"obs has shape {obs.shape}; this policy takes [env, {self.spec.n_agents} agents, "
                              f"{dims}] or [{self.spec.n_agents}, {dims}]")
        if np.dtype(dtype) == np.uint8 and np.issubdtype(obs.dtype, np.floating):  # a cast would make [0, 1] floats black
            raise PolicyError(f"obs are {obs.dtype}; this policy sees uint8 images (0-255 pixels "
                              f"as the env draws them): pass the env's own observation")
        obs = obs.astype(dtype, copy=False)
        n_envs = obs.shape[0]
        if avail_actions is None:
            avail = np.ones((n_envs, self.spec.n_agents, self.spec.mask_width), bool)
        else:
            avail = np.asarray(avail_actions, bool)
            avail = avail[None] if single else avail
        reset = np.full(n_envs, carry is None) if first is None else np.asarray(first, bool).reshape(n_envs)
        carry = self.initial_carry(n_envs) if carry is None else carry
        actions, carry, _ = self._act(self.params, carry, jnp.asarray(obs), jnp.asarray(avail),
                                      jnp.asarray(reset), self._key, self.learner.greedy)
        actions = np.asarray(actions)
        return (actions[0] if single else actions), carry


def load_policy(path: str) -> Policy:
    """The policy exported into `path` by `marl export` (or save_policy)."""
    missing = [name for name in FILES if not os.path.isfile(os.path.join(path, name))]
    if missing:
        have = sorted(os.listdir(path)) if os.path.isdir(path) else None
        raise PolicyError(f"{path} is not an exported policy: no {', '.join(missing)} "
                          f"(it holds {', '.join(have) if have else 'nothing' if have is not None else 'nothing: no such directory'}); "
                          "make one with `marl export RUN_DIR --out DIR`")
    with open(os.path.join(path, "policy.json")) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise PolicyError(f"{path}/policy.json has format {meta.get('format')!r}, this code reads {FORMAT}; "
                          "export it again with this version")
    with open(os.path.join(path, "env_spec.json")) as f:
        spec = EnvSpec.from_dict(json.load(f))
    config = algos.config_for(meta["algo"], meta["config"])
    learner = algos.make_learner(meta["algo"], spec, config)
    with open(os.path.join(path, "params.msgpack"), "rb") as f:
        params = serialization.msgpack_restore(f.read())
    return Policy(meta["algo"], learner, jax.tree.map(jnp.asarray, params), meta.get("source", {}))
