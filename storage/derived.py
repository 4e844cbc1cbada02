"""Derived groups: per-step variables computed from a replay store (e.g. a reanalysis),
kept in their own Zarr v3 group, aligned step for step with `open_replay(store)`.

Layout of one derived group at ``path``::

    zarr.json        attrs: kind, source_store, steps_per_region, n_envs, regions (the
                     store's committed region ids, in order, when the group was made),
                     variables, plus the caller's attrs (e.g. checkpoint_step)
    <variable>/      shape (len(regions)*T, n_envs, *shape), chunks (T, n_envs, *shape),
                     dimension_names ("step", "env", *dims): block k holds regions[k]
    region/ iteration/ collector/ param_version/
                     int64 (step,): copied from the store once, at create time
    written/         int64 (block,), chunk 1, fill -1: the region id of each written block

Each block is written whole by one task (chunk-aligned, so tasks can run concurrently),
`written[k]` is reset before and set after, so readers see only complete blocks and a
retried task rewrites exactly its own block.
"""

from __future__ import annotations

import os

import numpy as np
import zarr

from .replay import COORDS, ENV_DIM, STEP_DIM, Field, ReplayStore, StoreError, _check_json

KIND = "derived"
WRITTEN = "written"
BLOCK_DIM = "block"


class DerivedGroup:
    """A derived group on disk; make one with `create`, reopen with `open`."""

    def __init__(self, path: str, group: zarr.Group) -> None:
        self.path = path
        self._group = group
        self.attrs = dict(group.attrs)
        self.steps_per_region = int(self.attrs["steps_per_region"])
        self.n_envs = int(self.attrs["n_envs"])
        self.regions = [int(r) for r in self.attrs["regions"]]
        self.variables = {name: Field.from_json(f) for name, f in self.attrs["variables"].items()}

    @classmethod
    def create(cls, path, source: ReplayStore, variables: dict[str, Field], attrs: dict,
               kind: str = KIND) -> "DerivedGroup":
        """A new group for `variables` over the regions `source` has committed now.

        An existing group at `path` made from the same store, regions, variables and attrs
        is reused (a rerun rewrites its blocks); any other content there is refused.
        """
        path = os.fspath(path)
        _check_json(attrs, "attrs")
        variables = {str(k): v if isinstance(v, Field) else Field(**v) for k, v in variables.items()}
        clash = sorted(set(variables) & (set(COORDS) | {WRITTEN}))
        if clash:
            raise StoreError(f"derived variable names {clash} are reserved; rename them")
        regions = [r for r, _ in source.committed()]
        if not regions:
            raise StoreError(f"replay store at {source.path} has no committed regions; nothing to derive")
        want = {**attrs, "kind": kind, "source_store": os.path.abspath(source.path),
                "steps_per_region": source.steps_per_region, "n_envs": source.n_envs,
                "regions": regions, "variables": {n: f.to_json() for n, f in variables.items()}}
        if os.path.exists(os.path.join(path, "zarr.json")):
            existing = cls.open(path)
            if existing.attrs != want:
                raise StoreError(
                    f"{path} already holds a {existing.attrs.get('kind')} group made from other "
                    f"inputs (store regions, variables or settings differ); pass another output "
                    f"path or remove it")
            return existing
        if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
            raise StoreError(f"{path} exists and is not a derived group; pass a new output path")

        T, N = source.steps_per_region, source.n_envs
        n_steps = len(regions) * T
        group = zarr.open_group(path, mode="w-", zarr_format=3)
        for name, f in variables.items():
            group.create_array(name, shape=(n_steps, N, *f.shape), chunks=(T, N, *f.shape),
                               dtype=f.dtype, fill_value=np.nan if f.dtype.startswith("float") else 0,
                               dimension_names=(STEP_DIM, ENV_DIM, *f.dims))
        slots = np.concatenate([np.arange(source.slot_of(r) * T, (source.slot_of(r) + 1) * T)
                                for r in regions])
        for name in COORDS:
            values = source._arrays[name][:][slots]
            group.create_array(name, shape=(n_steps,), chunks=(T,), dtype="int64", fill_value=-1,
                               dimension_names=(STEP_DIM,))[:] = values
        group.create_array(WRITTEN, shape=(len(regions),), chunks=(1,), dtype="int64",
                           fill_value=-1, dimension_names=(BLOCK_DIM,))
        if not np.array_equal(group["region"][:].reshape(-1, T)[:, 0], regions):
            raise StoreError(f"replay store at {source.path} changed while {path} was being made "
                             f"(the ring moved on); rerun when collectors are idle")
        group.attrs.update(want)  # last: a group without attrs is an interrupted create
        return cls(path, group)

    @classmethod
    def open(cls, path, mode: str = "r") -> "DerivedGroup":
        path = os.fspath(path)
        if not os.path.isfile(os.path.join(path, "zarr.json")):
            raise StoreError(f"no derived group at {path} (no zarr.json); check the path")
        try:
            group = zarr.open_group(path, mode=mode, zarr_format=3)
        except Exception as e:  # zarr raises several kinds for "not a v3 group"
            raise StoreError(f"{path} is not a derived group ({type(e).__name__}: {e})") from None
        if "regions" not in group.attrs or "variables" not in group.attrs:
            raise StoreError(f"{path} is a Zarr group but not a derived group (no regions/variables "
                             f"attrs; maybe an interrupted create); remove it or use another path")
        return cls(path, group)

    def block_of(self, region_id: int) -> int:
        try:
            return self.regions.index(int(region_id))
        except ValueError:
            raise StoreError(f"region {region_id} is not in derived group {self.path} (it holds "
                             f"regions {self.regions[0]}..{self.regions[-1]})") from None

    def write_block(self, region_id: int, data: dict[str, np.ndarray]) -> int:
        """Writes one region's [T, N, ...] arrays of every variable; returns its block."""
        k = self.block_of(region_id)
        group = zarr.open_group(self.path, mode="r+", zarr_format=3)
        T = self.steps_per_region
        missing = sorted(set(self.variables) - set(data))
        if missing or set(data) - set(self.variables):
            raise StoreError(f"region {region_id}: pass exactly the variables {sorted(self.variables)}"
                             f" (missing {missing}, unknown {sorted(set(data) - set(self.variables))})")
        arrays = {}
        for name, f in self.variables.items():
            arr = np.asarray(data[name])
            if arr.shape != (T, self.n_envs, *f.shape):
                raise StoreError(f"region {region_id}: {name!r} has shape {arr.shape}, expected "
                                 f"{(T, self.n_envs, *f.shape)} (step, env, *{f.dims})")
            arrays[name] = np.ascontiguousarray(arr, dtype=f.dtype)
        group[WRITTEN][k] = -1
        for name, arr in arrays.items():
            group[name][k * T:(k + 1) * T] = arr
        group[WRITTEN][k] = int(region_id)
        return k

    def written(self) -> list[int]:
        """Region ids whose block is complete."""
        marks = self._group[WRITTEN][:]
        return [r for r, m in zip(self.regions, marks) if int(m) == r]


def open_derived(path):
    """A lazy xarray.Dataset of the complete blocks of a derived group, with the same step
    coordinates (region, iteration, collector, param_version) as `open_replay` of its store,
    so `xr.merge([open_replay(store), open_derived(path)])` lines up while the store still
    holds those regions (select `ds.region.isin(...)` on both otherwise)."""
    import xarray as xr

    derived = DerivedGroup.open(path)
    T = derived.steps_per_region
    done = set(derived.written())
    blocks = [k for k, r in enumerate(derived.regions) if r in done]
    idx = (np.concatenate([np.arange(k * T, (k + 1) * T) for k in blocks]) if blocks
           else np.zeros(0, dtype=np.int64))
    ds = xr.open_zarr(derived.path, consolidated=False, zarr_format=3,
                      use_zarr_fill_value_as_mask=False)
    ds = ds.drop_vars([WRITTEN]).set_coords(list(COORDS)).isel({STEP_DIM: idx})
    for name in COORDS:
        ds[name] = ds[name].load()
    return ds
