"""S independent seeds as one learner, by `vmap` (JaxMARL's NUM_SEEDS).

The wrapped learner holds S train states stacked on a leading axis. Its policy runs S*N
envs, the envs of seed s being the block [s*N, (s+1)*N): `act` splits the batch into
seeds, runs each seed's policy on its own envs under `vmap`, and joins them again, so the
collectors and the replay store see ordinary [T, S*N, ...] regions. `train` takes a replay
mirror that keeps the seeds apart (marl/buffer.py) and updates every seed on its own data
in one jitted call.
Seeds never share data, parameters or randomness.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from marl.learner import Learner


def split_envs(x, n_seeds: int, axis: int = 0):
    """[..., S*N, ...] -> [S, ..., N, ...] (the env axis at `axis` split, seeds moved first)."""
    shape = x.shape[:axis] + (n_seeds, x.shape[axis] // n_seeds) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def join_envs(x, axis: int = 0):
    """The inverse of split_envs: [S, ..., N, ...] -> [..., S*N, ...]."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def vmap_seeds(learner: Learner, n_seeds: int) -> Learner:
    if n_seeds == 1:
        return learner
    split = lambda tree, axis=0: jax.tree.map(lambda x: split_envs(x, n_seeds, axis), tree)
    join = lambda tree, axis=0: jax.tree.map(lambda x: join_envs(x, axis), tree)

    def init(key):
        # one seed at a time, then stacked: under vmap, every orthogonal initialiser is a
        # batched QR, and XLA:CPU runs a batched QR by fanning its batch out into the same
        # intra-op pool its thunk runs on; two of them at once on a 2-thread pool wait for
        # each other forever (MAPPO's recurrent actor with 3 seeds hung on every try)
        states = [learner.init(k) for k in jax.random.split(key, n_seeds)]
        return jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)

    def init_carry(n_envs):
        return join(jax.vmap(lambda _: learner.init_carry(n_envs // n_seeds))(jnp.arange(n_seeds)))

    def act(params, carry, obs, avail, reset, key, explore):
        keys = jax.random.split(key, n_seeds)
        per_seed = jax.vmap(learner.act, in_axes=(0, 0, 0, 0, 0, 0, None))
        actions, carry, extras = per_seed(params, split(carry), split(obs), split(avail),
                                          split(reset), keys, explore)
        return join(actions), join(carry), join(extras)

    def train(train_state, arrays, ring, n_updates: int):
        # arrays: a mirror with the seeds apart, [S, slot, T, N, ...] (buffer.empty(n_seeds=S));
        # every seed sees the same slots (one ring)
        per_seed = jax.vmap(lambda state, seed_arrays: learner.train(state, seed_arrays, ring, n_updates))
        return per_seed(train_state, arrays)

    def score(train_state, batch):
        # windows [S*B, L, ...] where each seed's envs are a block of the batch
        dims = {}

        def arrays_only(state, seed_batch):
            out = learner.score(state, seed_batch)
            dims.update({k: d for k, (_, d) in out.items()})
            return {k: v for k, (v, _) in out.items()}

        out = jax.vmap(arrays_only)(train_state, split(batch))
        return {k: (join(v), dims[k]) for k, v in out.items()}

    return dataclasses.replace(
        learner, name=f"{learner.name}x{n_seeds}", init=init, act=act,
        init_carry=init_carry, policy_params=jax.vmap(learner.policy_params),
        update=jax.vmap(learner.update),
        train=jax.jit(train, static_argnums=3),
        score=score if learner.score else None)
