"""A device-resident mirror of the replay ring, and jitted sampling from it.

The Zarr store on disk is the truth; a learner copies each newly committed region into
`arrays[slot]` ([n_slots, T, N, ...]) once and then samples thousands of batches without
touching disk. `valid[slot]` says which slots hold a committed region.

With S seeds in one learner (marl/seeds.py) the mirror keeps each seed's envs apart,
[S, n_slots, T, N/S, ...], so the vmapped learner trains on seed s's block in place: an
[n_slots, T, S*N, ...] mirror would be split into a second, transposed copy of the whole ring
on every train call.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from marl.seeds import split_envs


def empty(fields: dict[str, tuple[tuple[int, ...], str]], n_slots: int, steps: int, n_envs: int,
          n_seeds: int = 1):
    """An empty mirror for regions of `n_envs` envs (all seeds' together)."""
    lead = (n_slots, steps, n_envs) if n_seeds == 1 else (n_seeds, n_slots, steps, n_envs // n_seeds)
    arrays = {name: jnp.zeros((*lead, *shape), dtype) for name, (shape, dtype) in fields.items()}
    return arrays, jnp.zeros((n_slots,), bool)


@partial(jax.jit, donate_argnums=(0, 1), static_argnames=("n_seeds",))
def insert(arrays, valid, slot, region, n_seeds: int = 1):
    """Writes one region ([T, n_envs, ...] per field) into `slot` in place (the old arrays
    are donated: ~1 s -> ms)."""
    if n_seeds == 1:
        arrays = {k: v.at[slot].set(region[k].astype(v.dtype)) for k, v in arrays.items()}
    else:
        arrays = {k: v.at[:, slot].set(split_envs(region[k], n_seeds, axis=1).astype(v.dtype))
                  for k, v in arrays.items()}
    return arrays, valid.at[slot].set(True)


def sample_windows(key, arrays, valid, batch: int, length: int):
    """[batch, length, ...] windows, each inside one committed region of one env."""
    n_slots, steps, n_envs = valid.shape[0], *next(iter(arrays.values())).shape[1:3]
    k_slot, k_env, k_start = jax.random.split(key, 3)
    # uniform over committed slots: invalid slots get -inf logits
    slot = jax.random.categorical(k_slot, jnp.where(valid, 0.0, -jnp.inf), shape=(batch,))
    env = jax.random.randint(k_env, (batch,), 0, n_envs)
    start = jax.random.randint(k_start, (batch,), 0, steps - length + 1)
    t = start[:, None] + jnp.arange(length)[None, :]
    return {k: v[slot[:, None], t, env[:, None]] for k, v in arrays.items()}
