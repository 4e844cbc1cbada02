"""A device-resident mirror of the replay ring, and jitted sampling from it.

The Zarr store on disk is the truth; a learner copies each newly committed region into
`arrays[slot]` ([n_slots, T, N, ...]) once and then samples thousands of batches without
touching disk. A `Ring` says which slots hold a committed region and, for each, which slot
holds the region that continues the same envs (a collector's next region), so windows run
across region boundaries and every stored step can start one.

With S seeds in one learner (marl/seeds.py) the mirror keeps each seed's envs apart,
[S, n_slots, T, N/S, ...], so the vmapped learner trains on seed s's block in place: an
[n_slots, T, S*N, ...] mirror would be split into a second, transposed copy of the whole ring
on every train call.
"""

from __future__ import annotations

from functools import partial
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from marl.seeds import split_envs


class Ring(NamedTuple):
    """Which mirror slots hold what: valid [slot] bool, a committed region is there; next
    [slot] int32, the slot holding the region whose step 0 follows this region's last step in
    every env (-1: not mirrored yet, or the ring overwrote it)."""

    valid: jax.Array
    next: jax.Array


def ring(region_of_slot: Mapping[int, int], n_slots: int, stride: int) -> Ring:
    """The Ring of a mirror whose slot s holds region `region_of_slot[s]`, where region r's
    envs continue in region r + stride (regions are numbered iteration * stride + collector)."""
    slot_of = {region: slot for slot, region in region_of_slot.items()}
    valid, nxt = np.zeros(n_slots, bool), np.full(n_slots, -1, np.int32)
    for slot, region in region_of_slot.items():
        valid[slot], nxt[slot] = True, slot_of.get(region + stride, -1)
    return Ring(jnp.asarray(valid), jnp.asarray(nxt))


def empty(fields: dict[str, tuple[tuple[int, ...], str]], n_slots: int, steps: int, n_envs: int,
          n_seeds: int = 1):
    """An empty mirror for regions of `n_envs` envs (all seeds' together)."""
    lead = (n_slots, steps, n_envs) if n_seeds == 1 else (n_seeds, n_slots, steps, n_envs // n_seeds)
    return {name: jnp.zeros((*lead, *shape), dtype) for name, (shape, dtype) in fields.items()}


@partial(jax.jit, donate_argnums=0, static_argnames=("n_seeds",))
def insert(arrays, slot, region, n_seeds: int = 1):
    """Writes one region ([T, n_envs, ...] per field) into `slot` in place (the old arrays
    are donated: ~1 s -> ms)."""
    if n_seeds == 1:
        return {k: v.at[slot].set(region[k].astype(v.dtype)) for k, v in arrays.items()}
    return {k: v.at[:, slot].set(split_envs(region[k], n_seeds, axis=1).astype(v.dtype))
            for k, v in arrays.items()}


def window_starts(arrays, ring: Ring, length: int, at_episode_starts: bool = False):
    """Where a window of `length` steps may start, as a running count over the flattened
    (slot, step, env) positions (what `sample_windows` draws from; compute it once per train
    call, the mirror does not change inside one). A window may start at any step of a valid
    slot whose next region is mirrored, else where it ends inside its own region; with
    `at_episode_starts`, only where an episode starts (`first`)."""
    first = arrays["first"]
    n_slots, steps, n_envs = first.shape
    if length > steps:
        raise ValueError(f"windows of {length} steps are longer than a region ({steps} steps); "
                         "shorten the window (seq_len, burn_in) or raise steps_per_region")
    t = jnp.arange(steps)
    fits = ring.valid[:, None] & ((ring.next >= 0)[:, None] | (t <= steps - length)[None, :])
    allowed = jnp.broadcast_to(fits[..., None], first.shape)
    if at_episode_starts:
        allowed = allowed & first
    return jnp.cumsum(allowed.reshape(-1).astype(jnp.int32))


def sample_windows(key, arrays, ring: Ring, starts, batch: int, length: int):
    """[batch, length, ...] windows of one env's consecutive steps, uniform over the starts
    that `window_starts` allows, continuing into the next region where they cross its end."""
    n_slots, steps, n_envs = arrays["first"].shape
    u = jax.random.randint(key, (batch,), 0, jnp.maximum(starts[-1], 1))
    position = jnp.minimum(jnp.searchsorted(starts, u, side="right"), starts.shape[0] - 1)
    slot, start, env = jnp.unravel_index(position, (n_slots, steps, n_envs))
    t = start[:, None] + jnp.arange(length)[None, :]
    crossed = t >= steps
    slot = jnp.where(crossed, ring.next[slot][:, None], slot[:, None])
    t = jnp.where(crossed, t - steps, t)
    return {k: v[slot, t, env[:, None]] for k, v in arrays.items()}
