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

Integrity, as in a replay store: every chunk of every array ends in its crc32c checksum
(zstd, then crc32c) and every chunk of a written block is on disk, so a chunk of a written
block that is altered, cut short or missing is damage, never the fill value. `verify()`
checks every written block (`marl replay verify PATH`), reads (`written`, `open_derived`)
raise ReplayDamaged naming the file; the fix is to remove the group and reanalyse again.
Groups made before checksums (no crc32c in an array's codecs) are checked by decoding.
"""

from __future__ import annotations

import json
import os

import numpy as np
import zarr

from .replay import (_WRITE_CONFIG, CODEC, COORDS, ENV_DIM, STEP_DIM, Damage, Field, ReplayDamaged,
                     ReplayStore, StoreError, _array_or_damage, _check_json, _CheckedLocalStore,
                     _crc_ok, _fmt_regions)

KIND = "derived"
WRITTEN = "written"
BLOCK_DIM = "block"


def _fix(path: str) -> str:
    return (f"remove {path} and run the reanalysis again (`marl replay reanalyze RUN_DIR --out {path}`) "
            f"to make it anew")


def _has_crc(array) -> bool:
    return bool(array.compressors) and isinstance(array.compressors[-1], zarr.codecs.Crc32cCodec)


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
        self._arrays = {}
        for name in (*self.variables, *COORDS, WRITTEN):
            node = _array_or_damage(path, group, name, kind="derived group", fix=_fix)
            if not isinstance(node, zarr.Array):
                raise node
            self._arrays[name] = node
        # groups made since checksums: every chunk ends in a crc32c and every chunk of a
        # written block is on disk
        self._crc = {name: _has_crc(a) for name, a in self._arrays.items()}

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
                               compressors=CODEC, dimension_names=(STEP_DIM, ENV_DIM, *f.dims))
        slots = np.concatenate([np.arange(source.slot_of(r) * T, (source.slot_of(r) + 1) * T)
                                for r in regions])
        for name in COORDS:
            values = source._arrays[name][:][slots]
            group.create_array(name, shape=(n_steps,), chunks=(T,), dtype="int64", fill_value=-1,
                               compressors=CODEC, config=_WRITE_CONFIG,
                               dimension_names=(STEP_DIM,))[:] = values
        group.create_array(WRITTEN, shape=(len(regions),), chunks=(1,), dtype="int64",
                           fill_value=-1, compressors=CODEC, dimension_names=(BLOCK_DIM,))
        if not np.array_equal(group["region"][:].reshape(-1, T)[:, 0], regions):
            raise StoreError(f"replay store at {source.path} changed while {path} was being made "
                             f"(the ring moved on); rerun when collectors are idle")
        group.attrs.update(want)  # last: a group without attrs is an interrupted create
        return cls(path, group)

    @classmethod
    def open(cls, path, mode: str = "r") -> "DerivedGroup":
        path = os.fspath(path)
        meta = os.path.join(path, "zarr.json")
        if not os.path.isfile(meta):
            raise StoreError(f"no derived group at {path} (no zarr.json); check the path")
        try:
            with open(meta, "rb") as fh:
                json.loads(fh.read())
        except ValueError as e:
            raise ReplayDamaged(f"derived group metadata {meta} is damaged (not JSON: {e}); "
                                f"{_fix(path)}") from None
        try:
            group = zarr.open_group(path, mode=mode, zarr_format=3)
        except Exception as e:  # zarr raises several kinds for "not a v3 group"
            raise StoreError(f"{path} is not a derived group ({type(e).__name__}: {e})") from None
        if "regions" not in group.attrs or "variables" not in group.attrs:
            raise StoreError(f"{path} is a Zarr group but not a derived group (no regions/variables "
                             f"attrs; maybe an interrupted create); remove it or use another path")
        try:
            return cls(path, group)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, ReplayDamaged):
                raise
            raise ReplayDamaged(f"derived group metadata {meta} is damaged (attributes: {e!r}); "
                                f"{_fix(path)}") from None

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
        mark = group[WRITTEN].with_config(_WRITE_CONFIG)
        mark[k] = -1
        for name, arr in arrays.items():  # every chunk on disk, also one equal to the fill value
            group[name].with_config(_WRITE_CONFIG)[k * T:(k + 1) * T] = arr
        mark[k] = int(region_id)
        return k

    def written(self) -> list[int]:
        """Region ids whose block is complete (a damaged mark raises ReplayDamaged)."""
        try:
            marks = self._arrays[WRITTEN][:]
        except Exception:
            damage = [d for d in self._mark_damage() if d.problem != "is missing"]
            if damage:
                raise self._damaged(damage) from None
            raise
        return [r for r, m in zip(self.regions, marks) if int(m) == r]

    # ------------------------------------------------------------------ integrity
    def _chunk_keys(self, name: str, block: int) -> list[str]:
        """Keys (paths under the group) of array `name`'s chunks that hold `block`."""
        array = self._arrays[name]
        return [f"{name}/{array.metadata.encode_chunk_key((block, *idx))}"
                for idx in np.ndindex(*array.cdata_shape[1:])]

    def _chunk_problem(self, name: str, key: str, required: bool = True) -> str | None:
        try:
            with open(os.path.join(self.path, key), "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return "is missing" if required and self._crc[name] else None
        if self._crc[name] and not _crc_ok(data):
            return "fails its crc32c checksum (altered or cut short)"
        return None

    def _block_problems(self, block: int, names) -> list[tuple[str, str, str]]:
        out = []
        T = self.steps_per_region
        for name in names:
            keys = self._chunk_keys(name, block)
            out += [(name, k, p) for k in keys if (p := self._chunk_problem(name, k))]
            if not self._crc[name] and not any(n == name for n, _, _ in out):
                try:  # a group made before checksums: decode it
                    self._arrays[name][block * T:(block + 1) * T]
                except Exception as e:
                    out.append((name, keys[0], f"cannot be decoded ({type(e).__name__}: {e})"))
        return out

    def _mark_damage(self) -> list[Damage]:
        """Damaged `written` marks (an absent one is a block never written, not damage)."""
        out = []
        for k, r in enumerate(self.regions):
            key = self._chunk_keys(WRITTEN, k)[0]
            problem = self._chunk_problem(WRITTEN, key, required=False)
            if problem is None and not self._crc[WRITTEN] and os.path.exists(os.path.join(self.path, key)):
                try:
                    self._arrays[WRITTEN][k]
                except Exception as e:
                    problem = f"cannot be decoded ({type(e).__name__}: {e})"
            if problem:
                out.append(Damage(WRITTEN, key, problem, k, r))
        return out

    def _damaged(self, damage: list[Damage]) -> ReplayDamaged:
        regions = sorted({d.region for d in damage if d.region is not None})
        first = damage[0]
        return ReplayDamaged(f"derived group {self.path} is damaged: {len(regions)} block(s) (regions "
                             f"{_fmt_regions(regions)}), {len(damage)} file(s), first {first.key} "
                             f"{first.problem}; {_fix(self.path)}")

    def verify(self) -> tuple[list[Damage], dict]:
        """Checks every written block of every array and the written marks: each chunk is on
        disk and passes its checksum, the block's `region` coordinates name its region.
        Returns the damage found (Damage.slot is the block) and counts {"blocks", "chunks",
        "checksums"}. Reads only."""
        damage = self._mark_damage()
        bad_marks = {d.slot for d in damage}
        marks = {k: int(self._arrays[WRITTEN][k]) for k in range(len(self.regions)) if k not in bad_marks}
        names = [*self.variables, *COORDS]
        blocks = chunks = 0
        T = self.steps_per_region
        for k, r in enumerate(self.regions):
            if k not in bad_marks and marks[k] != r:
                continue  # never written (or being written): nothing there is promised
            problems = self._block_problems(k, names)
            if not any(n == "region" for n, _, _ in problems):
                held = self._arrays["region"][k * T:(k + 1) * T]
                if not bool(np.all(held == r)):
                    problems.append(("region", self._chunk_keys("region", k)[0],
                                     f"says region {int(held.max())}, the group's block region {r}"))
            blocks += 1
            chunks += sum(len(self._chunk_keys(n, k)) for n in (*names, WRITTEN))
            damage += [Damage(name, key, problem, k, r) for name, key, problem in problems]
        return damage, {"blocks": blocks, "chunks": chunks, "checksums": all(self._crc.values())}

    def check(self) -> dict:
        """verify(), raising ReplayDamaged (one line) if anything is damaged."""
        damage, counts = self.verify()
        if damage:
            raise self._damaged(damage)
        return counts

    def _require_chunks(self, blocks) -> None:
        """ReplayDamaged if a chunk of a written block is not on disk (zarr would read the
        fill value)."""
        missing = [Damage(name, key, "is missing", k, self.regions[k])
                   for k in blocks for name in (*self.variables, *COORDS) if self._crc[name]
                   for key in self._chunk_keys(name, k) if not os.path.exists(os.path.join(self.path, key))]
        if missing:
            raise self._damaged(missing)


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
    derived._require_chunks(blocks)  # checksums are checked as the data are read
    idx = (np.concatenate([np.arange(k * T, (k + 1) * T) for k in blocks]) if blocks
           else np.zeros(0, dtype=np.int64))
    checked = _CheckedLocalStore(derived.path, [name for name, crc in derived._crc.items() if crc],
                                 what="derived group", fix=_fix)
    ds = xr.open_zarr(checked, consolidated=False, zarr_format=3, use_zarr_fill_value_as_mask=False)
    ds = ds.drop_vars([WRITTEN]).set_coords(list(COORDS)).isel({STEP_DIM: idx})
    for name in COORDS:
        ds[name] = ds[name].load()
    return ds
