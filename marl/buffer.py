"""A device-resident mirror of the replay ring, and jitted sampling from it.

The Zarr store on disk is the truth; a learner copies each newly committed region into
`arrays[slot]` ([n_slots, T, N, ...]) once and then samples thousands of batches without
touching disk. `valid[slot]` says which slots hold a committed region.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def empty(fields: dict[str, tuple[tuple[int, ...], str]], n_slots: int, steps: int, n_envs: int):
    arrays = {name: jnp.zeros((n_slots, steps, n_envs, *shape), dtype)
              for name, (shape, dtype) in fields.items()}
    return arrays, jnp.zeros((n_slots,), bool)


@partial(jax.jit, donate_argnums=(0, 1))
def insert(arrays, valid, slot, region):
    """Writes one region into `slot` in place (the old arrays are donated: ~1 s -> ms)."""
    arrays = {k: v.at[slot].set(region[k].astype(v.dtype)) for k, v in arrays.items()}
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
