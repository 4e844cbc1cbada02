"""Zarr v3 replay store: a ring of chunk-aligned regions with a per-slot commit log.

Layout of one store (a Zarr v3 group at ``path``)::

    zarr.json                 group attributes: schema_version, env_id, env_spec, algorithm,
                              seed, config, n_envs, steps_per_region, n_slots, fields,
                              chunk_bytes (the budget below; remake_damaged_arrays reuses it)
    <field>/                  one array per field, shape (n_slots*T, n_envs, *field.shape),
                              chunks (t, n_envs, *field.shape) with t the largest divisor of
                              T whose chunk holds at most CHUNK_BYTES: a region is T/t whole
                              chunks (one chunk for a CPU run's small regions), encoded and
                              written in parallel; where one step of all envs is bigger
                              (images of many envs), one step cut along the env axis (then
                              the field's own axes) to fit (chunk_shape); dimension_names
                              ("step", "env", *field.dims);
                              codecs zstd level 1 (chosen by bench/write_throughput.py) then
                              crc32c (every array), every chunk written (also one equal to the
                              fill value)
    region/ iteration/ collector/ param_version/
                              int64 (step,), chunk T, fill -1: who wrote each step
    commit/                   int64 (slot,), chunk 1, fill -1: region id committed in each slot
    trained_version/          int64 (slot,), chunk 1, fill -1: the learner's parameter version
                              when it first trained on the region in each slot (-1 = not yet);
                              written by the learner (`mark_trained`), reset by the writer
    commits/                  a Zarr sub-group holding one tiny marker file per committed
                              region id (append-only history; never read-modify-write)

Concurrency rules (see shared/notes/orchestration.md section 4): every writer touches only
whole chunks of its own slot, array metadata is written once at create time and never
again, nothing is consolidated, and the commit log is one chunk per slot plus one file per
region, so many processes can commit different slots at once.

Write protocol for region r in slot s = r % n_slots:
  1. commit[s] = -1 (the slot is no longer readable), trained_version[s] = -1,
  2. write every field's chunks for slot s and the slot's coordinates (region, iteration,
     collector, param_version), every chunk of every array at once (one gather on zarr's
     event loop, whose thread pool encodes and stores the chunks; zstd releases the GIL),
  3. commit[s] = r, then the marker file commits/<r> (tmp file + os.replace).
Each step's files are on disk before the next step starts: a writable store writes every
file to a temp file, fsyncs it, renames it into place and fsyncs its directory (zarr's own
LocalStore does the rename but no fsync), so not even a power loss can leave a commit on
disk whose data are not (``durable=False`` skips the fsyncs: a killed process still leaves
no torn file, a power loss may). Chunk files are replaced whole, never patched in place.
A reader trusts slot s for region r only if the slot's ``region`` coordinates all equal r
*and then* commit[s] == r; reads of data re-check commit[s] afterwards. The learner marks
a committed region trained (trained_version[s] = v) only while the slot holds it and only
once (first training wins), and re-checks the commit afterwards.

Integrity: every chunk of every array ends in its crc32c checksum (the codec chain's last
codec), and the group attribute ``every_chunk_written`` says that every chunk of a written
slot is on disk, so a missing chunk of a committed region is damage, never the fill value.
Reads that meet damage raise ReplayDamaged (one line naming the file, the array and the
region, and `marl replay verify PATH --drop-damaged` as the fix); ``verify()`` checks every
committed region, ``drop_damaged()`` uncommits the damaged ones. Stores made before checksums
(no crc32c in an array's codecs, no every_chunk_written) read as before: their chunks are
checked by decoding them, and a missing field chunk there may be a legitimate fill.

Episodes: the bool fields ``terminated`` and ``truncated`` (of the transition schema) mark
the step that ended an episode, ``first`` the step whose observation starts one (also after
a collector restart, which resets its envs without an end).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import google_crc32c  # zarr's own crc32c codec uses it
import numpy as np
import zarr
from zarr.core.sync import sync  # runs a coroutine on zarr's own event loop
from zarr.storage import LocalStore

SCHEMA_VERSION = 2  # 2: first/terminated/truncated instead of done; trained_version

STEP_DIM = "step"
ENV_DIM = "env"
SLOT_DIM = "slot"
COORDS = ("region", "iteration", "collector", "param_version")
COMMIT = "commit"
TRAINED = "trained_version"
HISTORY = "commits"
_RESERVED_NAMES = frozenset(COORDS) | {COMMIT, TRAINED, HISTORY}
_RESERVED_DIMS = frozenset({STEP_DIM, ENV_DIM, SLOT_DIM})
EVERY_CHUNK = "every_chunk_written"  # group attribute: a written slot has all its chunks on disk
CHUNK_BYTES_KEY = "chunk_bytes"  # group attribute: the chunk_bytes the store was made with
_STORE_KEYS = ("schema_version", "n_envs", "steps_per_region", "n_slots", "fields", EVERY_CHUNK,
               CHUNK_BYTES_KEY)
# Largest uncompressed chunk of a field. Smaller chunks let many cores encode one region at
# once (a GPU run's regions are GBs); on 2 cores 16 MiB and whole-region chunks measured the
# same and 1 MiB chunks at half the speed (per-chunk overhead), see bench/write_throughput.py.
CHUNK_BYTES = 16 * 2**20
# zstd level 1: faster than zarr's default level (0 = 3) in every region measured (1.1-1.4x
# on SMAX regions, 12-16x smaller either way; 1.5x on MPE's float regions, 1.6x smaller
# either way, where level 3's encode held the write to a third of a TPU machine's disk), and
# faster than no compression once the bytes must reach the disk; blosc-lz4 without shuffle
# wrote faster still but kept 1.3-2.3x the bytes (bench/write_throughput.py, BENCHMARKS.md)
# then a crc32c checksum of the compressed bytes (4 bytes per chunk), checked on every read
CHECKSUM = zarr.codecs.Crc32cCodec()
CODEC = (zarr.codecs.ZstdCodec(level=1), CHECKSUM)
# zarr's all-equal-to-fill scan of every chunk before writing it cost more than zstd itself;
# and a committed region then has every chunk on disk
_WRITE_CONFIG = {"write_empty_chunks": True}


class StoreError(ValueError):
    """A replay store or checkpoint problem; the message names the problem and the fix."""


class ReplayDamaged(StoreError):
    """Stored data or metadata that fail their checks (a checksum, a missing chunk of a
    committed region, unreadable metadata): one line naming the file and the fix. Readers
    that skip regions overwritten meanwhile (a plain StoreError) must not skip this."""


@dataclass(frozen=True)
class Field:
    """One per-step variable: its trailing shape, dtype and dim names after (step, env)."""

    shape: tuple[int, ...]
    dtype: str
    dims: tuple[str, ...]

    def __post_init__(self) -> None:
        try:
            shape = tuple(int(n) for n in self.shape)
        except (TypeError, ValueError):
            raise StoreError(f"field shape {self.shape!r} is not a tuple of ints; pass e.g. shape=(3, 8)") from None
        try:
            dt = np.dtype(self.dtype)
        except TypeError:
            raise StoreError(f"field dtype {self.dtype!r} is not a numpy dtype; pass e.g. dtype='float32'") from None
        if dt.kind not in "biuf":
            raise StoreError(f"field dtype {dt.name!r} is not supported; use a bool, integer or float dtype")
        if isinstance(self.dims, str):
            raise StoreError(f"field dims {self.dims!r} must be a tuple of names, e.g. dims=('agent',)")
        dims = tuple(str(d) for d in self.dims)
        if len(dims) != len(shape):
            raise StoreError(
                f"field has shape {shape} but dims {dims}; give one dim name per trailing axis"
            )
        if any(n < 0 for n in shape):
            raise StoreError(f"field shape {shape} has a negative size; use sizes >= 0")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dt.name)
        object.__setattr__(self, "dims", dims)

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype, "dims": list(self.dims)}

    @classmethod
    def from_json(cls, d: Mapping) -> "Field":
        return cls(shape=tuple(d["shape"]), dtype=d["dtype"], dims=tuple(d["dims"]))

    @property
    def nbytes(self) -> int:
        """Bytes of one step of one env."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


def _as_field(name: str, f: Any) -> Field:
    if isinstance(f, Field):
        return f
    if isinstance(f, Mapping):
        try:
            return Field(shape=tuple(f["shape"]), dtype=f["dtype"], dims=tuple(f.get("dims", ())))
        except KeyError as e:
            raise StoreError(f"field {name!r} is missing {e.args[0]!r}; pass a storage.replay.Field") from None
    raise StoreError(f"field {name!r} is a {type(f).__name__}; pass a storage.replay.Field(shape, dtype, dims)")


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise StoreError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _index(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 0:
        raise StoreError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def _check_json(attrs: Mapping, what: str) -> None:
    if not isinstance(attrs, Mapping):
        raise StoreError(f"{what} must be a dict, got {type(attrs).__name__}")
    for key, value in attrs.items():
        if not isinstance(key, str):
            raise StoreError(f"{what} key {key!r} is not a string; use string keys")
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise StoreError(
                f"{what}[{key!r}] is not JSON-serialisable ({e}); convert it to plain "
                f"str/int/float/bool/list/dict first"
            ) from None


def _has_zarr_json(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "zarr.json"))


def _fmt_regions(regions: list[int]) -> str:
    if not regions:
        return "none"
    if len(regions) <= 6:
        return ", ".join(map(str, regions))
    return f"{regions[0]}..{regions[-1]} ({len(regions)} regions)"


def _open_group(path: str, mode: str, durable: bool) -> zarr.Group:
    store = _DurableLocalStore(path) if mode == "r+" and durable else path
    return zarr.open_group(store, mode=mode, zarr_format=3)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _put_durable(path: Path, data) -> None:
    """Writes one file so that it is on disk, under its name, when this returns."""
    created = []  # directories this write makes: their entries must reach the disk too
    parent = path.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{uuid.uuid4().hex}.partial")  # zarr's own temp-file naming
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    for directory in (path.parent, *(d.parent for d in created)):
        _fsync_dir(directory)


class _DurableLocalStore(LocalStore):
    """zarr's LocalStore whose `set` returns only once the file is on disk (see the module
    docstring): the replay store's writers use it, readers need nothing special."""

    async def set(self, key: str, value) -> None:
        if not self._is_open:
            await self._open()
        self._check_writable()
        await asyncio.to_thread(_put_durable, self.root / key, value.as_buffer_like())


def _crc_ok(data: bytes) -> bool:
    """Whether a chunk file written with the crc32c codec last ends in its checksum."""
    return len(data) >= 4 and google_crc32c.value(data[:-4]) == int.from_bytes(data[-4:], "little")


class _CheckedLocalStore(LocalStore):
    """A read-only LocalStore that checks each chunk's crc32c as it is read (open_replay's and
    open_derived's lazy xarray reads): damage raises ReplayDamaged naming the file, not zarr's
    bare checksum error. `checked`: the arrays whose chunks end in a checksum; `what` and
    `fix`: the damaged thing and the cure, for the message."""

    def __init__(self, root, checked=frozenset(), what: str = "replay store at", fix=None) -> None:
        super().__init__(root, read_only=True)
        self.checked = frozenset(checked)
        self.what, self.fix = what, fix or _fix

    async def get(self, key, prototype=None, byte_range=None):
        buf = await super().get(key, prototype, byte_range)
        name, _, rest = key.partition("/")
        if buf is not None and byte_range is None and rest.startswith("c/") and name in self.checked \
                and not _crc_ok(buf.to_bytes()):
            raise ReplayDamaged(f"{self.what} {self.root} is damaged: chunk {key} fails its crc32c "
                                f"checksum (altered or cut short); {self.fix(str(self.root))}")
        return buf


async def _gather(awaitables):
    # every write ends before an error is raised: a retry must not race a leftover write
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def chunk_shape(steps_per_region: int, n_envs: int, field: "Field",
                chunk_bytes: int = CHUNK_BYTES) -> tuple[int, ...]:
    """The chunk shape of `field`'s array, (steps, envs, *field.shape) cut to hold at most
    `chunk_bytes`: the largest divisor of steps_per_region whose chunk fits, so a region is
    whole chunks along the step axis. Where one step of all envs is still too big (an image
    field of many envs), a chunk is one step cut into equal parts along the env axis, and
    where one env's step is too big, along the field's own axes in turn."""
    sizes = (steps_per_region, n_envs, *field.shape)
    chunks = list(sizes)
    for axis, size in enumerate(sizes):
        # bytes of one index of this axis, the axes after it whole
        inner = np.dtype(field.dtype).itemsize * int(np.prod(sizes[axis + 1:], dtype=np.int64))
        if inner > chunk_bytes and axis < len(sizes) - 1:
            chunks[axis] = 1  # even one index is too big: cut the next axis too
            continue
        fits = max(1, chunk_bytes // max(inner, 1))
        if axis == 0:  # a region's steps are whole chunks, its own and no other region's
            chunks[0] = max(t for t in range(1, size + 1) if size % t == 0 and t <= fits)
        elif size:  # as few parts as fit, each as small as that many allow
            chunks[axis] = -(-size // -(-size // fits))
        break
    return tuple(chunks)


def steps_per_chunk(steps_per_region: int, n_envs: int, field: "Field",
                    chunk_bytes: int = CHUNK_BYTES) -> int:
    """The steps of one chunk of `field` (see chunk_shape)."""
    return chunk_shape(steps_per_region, n_envs, field, chunk_bytes)[0]


@dataclass(frozen=True)
class Damage:
    """One damaged chunk or commit marker that ReplayStore.verify found."""

    array: str  # the array (or "commits": a commit marker)
    key: str  # the file, relative to the store
    problem: str  # e.g. "is missing"
    slot: int | None  # the ring slot it belongs to (None: a marker)
    region: int | None  # the region the slot holds as far as can be told


def _array_specs(fields: dict[str, "Field"], n_envs: int, T: int, n_slots: int,
                 chunk_bytes: int = CHUNK_BYTES, compressors=None) -> dict[str, dict]:
    """name -> zarr create_array keywords of every array of a store (create, remake)."""
    compressors = CODEC if compressors is None else tuple(compressors)
    if not compressors or not isinstance(compressors[-1], zarr.codecs.Crc32cCodec):
        compressors = (*compressors, CHECKSUM)  # every chunk carries its checksum
    specs = {}
    for name, f in fields.items():
        specs[name] = dict(
            shape=(n_slots * T, n_envs, *f.shape),
            chunks=chunk_shape(T, n_envs, f, chunk_bytes),
            dtype=f.dtype,
            compressors=compressors,
            fill_value=False if f.dtype == "bool" else 0,
            dimension_names=(STEP_DIM, ENV_DIM, *f.dims),
        )
    for name in COORDS:
        specs[name] = dict(shape=(n_slots * T,), chunks=(T,), dtype="int64", compressors=CODEC,
                           fill_value=-1, dimension_names=(STEP_DIM,))
    per_slot = {
        COMMIT: "region id committed in each ring slot; -1 = none",
        TRAINED: "parameter version of the learner when it first trained on the region in "
                 "each ring slot; -1 = not yet",
    }
    for name, description in per_slot.items():  # one chunk per slot: written independently
        specs[name] = dict(shape=(n_slots,), chunks=(1,), dtype="int64", compressors=CODEC,
                           fill_value=-1, dimension_names=(SLOT_DIM,),
                           attributes={"description": description})
    return specs


def _chunk_bytes_of(arrays: dict[str, zarr.Array], fields: dict[str, "Field"], T: int, n_envs: int) -> int:
    """The chunk_bytes of a store made before it was recorded, from its intact field arrays'
    chunks: CHUNK_BYTES where it gives every one of them, else the largest of their chunks'
    bytes (which gives each of them again: chunk_shape takes the largest chunk that fits)."""
    def fits(chunk_bytes: int) -> bool:
        return all(tuple(a.chunks) == chunk_shape(T, n_envs, fields[name], chunk_bytes) for name, a in arrays.items())

    if fits(CHUNK_BYTES):
        return CHUNK_BYTES
    return max(int(np.prod(a.chunks)) * a.dtype.itemsize for a in arrays.values())


def _fix(path: str) -> str:
    return (f"run `marl replay verify {path} --drop-damaged` to drop the damaged regions from "
            f"the commit log, then resume")


def _remake_fix(path: str) -> str:
    return (f"run `marl replay verify {path} --drop-damaged` to remake the array empty and drop "
            f"every region, or restore it from a backup")


def _array_or_damage(path: str, group: zarr.Group, name: str, kind: str = "replay store",
                     fix=_remake_fix):
    """The array `name` of the group at `path`, or the ReplayDamaged that says why not;
    `kind` and `fix(path)` name the damaged thing and its cure (a replay store's by default,
    a derived group's for storage/derived.py)."""
    meta = os.path.join(path, name, "zarr.json")
    try:
        node = group[name]
    except KeyError:
        node = None
    except Exception as e:  # zarr raises JSON, key and value errors for a damaged file
        return ReplayDamaged(f"{kind} metadata {meta} is damaged ({type(e).__name__}: {e}); {fix(path)}")
    if isinstance(node, zarr.Array):
        return node
    what = "is damaged (not a Zarr array)" if os.path.isfile(meta) else f"is missing (no {meta})"
    return ReplayDamaged(f"{kind} at {path} is damaged: array {name!r} {what}; {fix(path)}")


class ReplayStore:
    """A bounded ring of chunk-aligned regions of (step, env, ...) data in one Zarr v3 group."""

    def __init__(self, path: str, group: zarr.Group, mode: str) -> None:
        # Use ReplayStore.create / open / open_or_create.
        self.path = path
        self.mode = mode
        self._group = group
        self.attrs: dict = dict(group.attrs)
        try:
            self.n_envs = int(self.attrs["n_envs"])
            self.steps_per_region = int(self.attrs["steps_per_region"])
            self.n_slots = int(self.attrs["n_slots"])
            self.fields: dict[str, Field] = {
                name: Field.from_json(f) for name, f in self.attrs["fields"].items()
            }
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StoreError(
                f"replay store at {path} has broken attributes ({e!r}); it was not made by "
                f"ReplayStore.create, use a new path"
            ) from None
        self._arrays: dict[str, zarr.Array] = {}
        for name in (*self.fields, *COORDS, COMMIT, TRAINED):
            node = _array_or_damage(path, group, name)
            if not isinstance(node, zarr.Array):
                raise node
            self._arrays[name] = node.with_config(_WRITE_CONFIG) if mode == "r+" else node
        self._history_dir = os.path.join(path, HISTORY)
        self._durable = isinstance(group.store, _DurableLocalStore)
        self._every_chunk = bool(self.attrs.get(EVERY_CHUNK))
        # arrays whose chunks end in a crc32c checksum (all of them, in stores made since)
        self._crc = {name: bool(a.compressors) and isinstance(a.compressors[-1], zarr.codecs.Crc32cCodec)
                     for name, a in self._arrays.items()}

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls,
        path,
        *,
        fields: dict[str, Field],
        n_envs: int,
        steps_per_region: int,
        n_slots: int,
        attrs: dict,
        chunk_bytes: int = CHUNK_BYTES,
        durable: bool = True,
        compressors=None,
    ) -> "ReplayStore":
        """A new, empty store at `path` (a new or empty directory). Each field's chunks hold
        at most `chunk_bytes` (see steps_per_chunk) and are compressed with `compressors`
        (zarr codecs; default CODEC; a crc32c checksum is always the last one); `durable`
        as in open()."""
        path = os.fspath(path)
        n_envs = _positive_int(n_envs, "n_envs")
        chunk_bytes = _positive_int(chunk_bytes, "chunk_bytes")
        T = _positive_int(steps_per_region, "steps_per_region")
        n_slots = _positive_int(n_slots, "n_slots")
        if not isinstance(fields, Mapping) or not fields:
            raise StoreError("fields must be a non-empty dict of name -> Field")
        fields = {str(k): _as_field(str(k), v) for k, v in fields.items()}
        dim_sizes: dict[str, tuple[int, str]] = {}
        for name, f in fields.items():
            if not name or "/" in name or name.startswith((".", "_")) or name in _RESERVED_NAMES:
                raise StoreError(
                    f"field name {name!r} is not allowed (reserved: {sorted(_RESERVED_NAMES)}; "
                    f"no '/', no leading '.' or '_'); rename the field"
                )
            for dim, size in zip(f.dims, f.shape):
                if dim in _RESERVED_DIMS:
                    raise StoreError(f"field {name!r} uses reserved dim name {dim!r}; rename that dim")
                if dim in dim_sizes and dim_sizes[dim][0] != size:
                    other_size, other = dim_sizes[dim]
                    raise StoreError(
                        f"dim {dim!r} has size {size} in field {name!r} but {other_size} in field "
                        f"{other!r}; give different sizes different dim names"
                    )
                dim_sizes.setdefault(dim, (size, name))
        _check_json(attrs, "attrs")
        clash = sorted(set(attrs) & set(_STORE_KEYS))
        if clash:
            raise StoreError(f"attrs keys {clash} are reserved by the replay store; rename them")

        if os.path.exists(path):
            if not os.path.isdir(path):
                raise StoreError(f"{path} is a file, not a directory; pass a new directory for the replay store")
            if _has_zarr_json(path):
                raise StoreError(
                    f"a Zarr store already exists at {path}; use ReplayStore.open_or_create "
                    f"to continue it or a new path"
                )
            if os.listdir(path):
                raise StoreError(
                    f"directory {path} is not empty and holds no replay store; pass an empty "
                    f"or new directory (e.g. <run_dir>/replay)"
                )

        group = zarr.open_group(path, mode="w-", zarr_format=3)
        for name, spec in _array_specs(fields, n_envs, T, n_slots, chunk_bytes, compressors).items():
            group.create_array(name, **spec)
        group.create_group(
            HISTORY,
            attributes={"description": "one marker file per committed region id (append-only)"},
        )
        # Attributes last: a create interrupted before this line leaves a group without
        # schema_version, which open() rejects instead of trusting.
        group.attrs.update(
            {
                **attrs,
                "schema_version": SCHEMA_VERSION,
                "n_envs": n_envs,
                "steps_per_region": T,
                "n_slots": n_slots,
                "fields": {name: f.to_json() for name, f in fields.items()},
                EVERY_CHUNK: True,
                CHUNK_BYTES_KEY: chunk_bytes,  # an array remade later gets the same chunks
            }
        )
        return cls(path, _open_group(path, "r+", durable), "r+")

    @classmethod
    def open(cls, path, mode: str = "r", durable: bool = True) -> "ReplayStore":
        """An existing store; mode "r" or "r+". A store opened "r+" with `durable` (the
        default) fsyncs every file it writes before the next protocol step (see the module
        docstring); durable=False leaves that to the OS."""
        path = os.fspath(path)
        return cls(path, cls._checked_group(path, mode, durable), mode)

    @staticmethod
    def _checked_group(path: str, mode: str, durable: bool) -> zarr.Group:
        """The store's Zarr group once its own metadata is a replay store's (open())."""
        if mode not in ("r", "r+"):
            raise StoreError(f"mode must be 'r' or 'r+', got {mode!r}")
        if not os.path.isdir(path):
            raise StoreError(
                f"no replay store at {path} (no such directory); check the path or make one "
                f"with ReplayStore.create"
            )
        if not _has_zarr_json(path):
            raise StoreError(
                f"{path} is not a replay store (no zarr.json); check the path or make one with "
                f"ReplayStore.create"
            )
        meta = os.path.join(path, "zarr.json")
        try:
            with open(meta, "rb") as fh:
                json.load(fh)
        except ValueError as e:  # not JSON (also not UTF-8): the file was altered or cut short
            raise ReplayDamaged(
                f"replay store metadata {meta} is damaged (not JSON: {e}); restore the file from "
                f"a backup, or start a new run dir (the store cannot be read without it)"
            ) from None
        except OSError as e:
            raise StoreError(f"cannot read {meta} ({e.strerror}); check its permissions") from None
        try:
            group = _open_group(path, mode, durable)
        except Exception as e:  # zarr raises several kinds for "not a v3 group"
            raise StoreError(
                f"{path} is not a replay store ({type(e).__name__}: {e}); check the path or "
                f"make one with ReplayStore.create"
            ) from None
        version = group.attrs.get("schema_version")
        if version is None:
            raise StoreError(
                f"{path} is a Zarr group but not a replay store (no schema_version; maybe an "
                f"interrupted create); remove it or use a new path"
            )
        if version != SCHEMA_VERSION:
            raise StoreError(
                f"replay store at {path} has schema_version {version}, this code reads "
                f"{SCHEMA_VERSION}; use the matching code version or a new run dir"
            )
        return group

    @classmethod
    def open_or_create(cls, path, **create_kwargs) -> "ReplayStore":
        path = os.fspath(path)
        if not _has_zarr_json(path):
            return cls.create(path, **create_kwargs)
        durable = create_kwargs.pop("durable", True)
        for layout in ("chunk_bytes", "compressors"):  # an existing store keeps its own
            create_kwargs.pop(layout, None)
        existing = cls.open(path, mode="r")
        existing._check_matches(**create_kwargs)
        return cls.open(path, mode="r+", durable=durable)

    def _check_matches(
        self,
        *,
        fields: dict[str, Field],
        n_envs: int,
        steps_per_region: int,
        n_slots: int,
        attrs: dict,
    ) -> None:
        want_fields = {str(k): _as_field(str(k), v) for k, v in fields.items()}
        have_env, want_env = self.attrs.get("env_id"), (attrs or {}).get("env_id")
        have = {"steps_per_region": self.steps_per_region, "n_slots": self.n_slots}
        want = {"steps_per_region": int(steps_per_region), "n_slots": int(n_slots)}
        diffs_have, diffs_want = [], []
        for k in have:
            if have[k] != want[k]:
                diffs_have.append(f"{k}={have[k]}")
                diffs_want.append(f"{k}={want[k]}")
        if want_fields != self.fields:
            names = sorted(set(want_fields) | set(self.fields))
            bad = [n for n in names if want_fields.get(n) != self.fields.get(n)]
            diffs_have.append(
                "fields " + ", ".join(f"{n}:{self.fields[n].describe() if n in self.fields else '-'}" for n in bad)
            )
            diffs_want.append(
                "fields " + ", ".join(f"{n}:{want_fields[n].describe() if n in want_fields else '-'}" for n in bad)
            )
        if have_env == want_env and self.n_envs == int(n_envs) and not diffs_have:
            return

        def desc(env, n, extra):
            return f"{env} (n_envs={n}{''.join(', ' + d for d in extra)})"

        raise StoreError(
            f"replay store at {self.path} was made for env {desc(have_env, self.n_envs, diffs_have)}, "
            f"not {desc(want_env, int(n_envs), diffs_want)}; use a new --run-dir or the original settings"
        )

    # ------------------------------------------------------------------ properties
    @property
    def capacity(self) -> int:
        return self.n_slots * self.steps_per_region

    def slot_of(self, region_id: int) -> int:
        return _index(region_id, "region_id") % self.n_slots

    def _steps(self, slot: int) -> slice:
        T = self.steps_per_region
        return slice(slot * T, (slot + 1) * T)

    def __repr__(self) -> str:
        return (
            f"ReplayStore({self.path!r}, mode={self.mode!r}, env_id={self.attrs.get('env_id')!r}, "
            f"n_envs={self.n_envs}, steps_per_region={self.steps_per_region}, n_slots={self.n_slots})"
        )

    # ------------------------------------------------------------------ writing
    def conform(self, region_id: int, data: Mapping) -> dict[str, np.ndarray]:
        """`data` as this store holds region `region_id`: exactly its fields, each a C-contiguous
        array of the field's dtype and [steps_per_region, n_envs, *shape] (what read_region
        returns); a one-line StoreError naming the field and the fix otherwise."""
        if not isinstance(data, Mapping):
            raise StoreError(f"region {region_id}: data must be a dict of field name -> array")
        missing = [n for n in self.fields if n not in data]
        extra = sorted(str(n) for n in data if n not in self.fields)
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing field(s) {missing}")
            if extra:
                parts.append(f"unknown field(s) {extra}")
            raise StoreError(
                f"region {region_id}: data has {' and '.join(parts)}; pass exactly the store's "
                f"fields {list(self.fields)}"
            )
        out = {}
        for name, f in self.fields.items():
            arr = np.asarray(data[name])
            expect = (self.steps_per_region, self.n_envs, *f.shape)
            if arr.shape != expect:
                raise StoreError(
                    f"region {region_id}: field {name!r} has shape {arr.shape}, expected {expect} "
                    f"(steps_per_region, n_envs, *{f.dims}); fix the collector's output shape"
                )
            if not np.can_cast(arr.dtype, f.dtype, casting="same_kind"):
                raise StoreError(
                    f"region {region_id}: field {name!r} has dtype {arr.dtype}, the store holds "
                    f"{f.dtype}; cast it before writing"
                )
            out[name] = np.ascontiguousarray(arr, dtype=f.dtype)
        return out

    def _require_writable(self) -> None:
        if self.mode != "r+":
            raise StoreError(
                f"replay store at {self.path} is open read-only; open it with mode='r+' to write"
            )

    def _set_all(self, writes: dict[str, tuple[Any, Any]]) -> None:
        """{array: (selection, value)} written at once: one trip to zarr's event loop, which
        encodes and stores every chunk of every array concurrently on its thread pool (a
        thread per array costs more than the write itself for a CPU run's small regions)."""
        self._set_each([(name, sel, value) for name, (sel, value) in writes.items()])

    def _set_each(self, writes: list[tuple[str, Any, Any]]) -> None:
        sync(_gather([self._arrays[name].async_array.setitem(sel, value) for name, sel, value in writes]))

    def _chunk_writes(self, name: str, steps: slice, value: np.ndarray) -> list[tuple[str, Any, Any]]:
        """A slot's write of array `name` as one write per chunk. zarr stores a write of exactly
        one chunk as it is; a write spanning several it copies into a new fill-valued buffer
        per chunk, on its event loop's one thread (that, not the codec, bounded a large region's
        write: bench/profile_summary.py on bench/write_throughput.py's region)."""
        chunks = self._arrays[name].chunks
        out = []
        for corner in itertools.product(*(range(0, n, c) for n, c in zip(value.shape, chunks))):
            local = tuple(slice(o, min(o + c, n)) for o, c, n in zip(corner, chunks, value.shape))
            at = (slice(steps.start + local[0].start, steps.start + local[0].stop), *local[1:])
            out.append((name, at, value[local]))
        return out

    def _mark_uncommitted(self, slot: int) -> None:
        # trained_version too: the region that comes is not trained on yet
        self._set_all({COMMIT: (slot, -1), TRAINED: (slot, -1)})

    def _write_fields(self, slot: int, arrays: dict[str, np.ndarray], values: dict[str, int]) -> None:
        """Every field's chunks and the coordinates of the slot."""
        steps = self._steps(slot)
        coords = {name: np.full(self.steps_per_region, values[name], dtype=np.int64) for name in COORDS}
        self._set_each([write for name, value in {**arrays, **coords}.items()
                        for write in self._chunk_writes(name, steps, value)])

    def _commit(self, slot: int, region_id: int, values: dict[str, int]) -> None:
        self._arrays[COMMIT][slot] = region_id  # one chunk per slot, written atomically by zarr
        marker = json.dumps({**values, "slot": slot}).encode()
        final = os.path.join(self._history_dir, str(region_id))
        if self._durable:
            _put_durable(Path(final), marker)
            return
        os.makedirs(self._history_dir, exist_ok=True)
        tmp = os.path.join(self._history_dir, f".{region_id}.{uuid.uuid4().hex}.tmp")
        with open(tmp, "wb") as fh:
            fh.write(marker)
        os.replace(tmp, final)

    def write_region(
        self,
        region_id: int,
        data: dict[str, np.ndarray],
        *,
        iteration: int,
        collector: int,
        param_version: int,
    ) -> int:
        """Write one region (T steps of all envs) into its ring slot and commit it; returns the slot.

        Idempotent: a retry with the same region_id rewrites the same chunks and commits once.
        """
        self._require_writable()
        region_id = _index(region_id, "region_id")
        values = {
            "region": region_id,
            "iteration": _index(iteration, "iteration"),
            "collector": _index(collector, "collector"),
            "param_version": _index(param_version, "param_version"),
        }
        arrays = self.conform(region_id, data)
        slot = self.slot_of(region_id)
        try:
            held = max(int(v) for v in sync(_gather([self._arrays[COMMIT].async_array.getitem(slot),
                self._arrays["region"].async_array.getitem(slot * self.steps_per_region)])))
        except Exception:
            problems = self._slot_problems(slot, [COMMIT, "region"])
            if problems:  # refuse to guess what the slot held: a damaged store stops the run
                raise self._damaged(problems, slot) from None
            raise
        if held > region_id:
            raise StoreError(
                f"region {region_id} maps to slot {slot}, which already holds newer region {held}; "
                f"a stale task must not overwrite it (raise n_slots or keep fewer regions in flight)"
            )
        try:
            self._mark_uncommitted(slot)
            self._write_fields(slot, arrays, values)
            self._commit(slot, region_id, values)
        except OSError as e:  # a full disk, a read-only or unwritable run dir
            raise StoreError(
                f"cannot write region {region_id} to replay store at {self.path} "
                f"({e.strerror or e}{': ' + str(e.filename) if e.filename else ''}); the regions "
                f"committed before stay readable; free disk space or make it writable, then resume"
            ) from e
        return slot

    # ------------------------------------------------------------------ integrity
    def _selection(self, name: str, slot: int):
        return slot if name in (COMMIT, TRAINED) else self._steps(slot)

    def _chunk_keys(self, name: str, slot: int) -> list[str]:
        """Store keys (paths under the store) of array `name`'s chunks that hold ring slot `slot`."""
        array = self._arrays[name]
        if name in (COMMIT, TRAINED):
            first, stop = slot, slot + 1
        else:
            t, T = array.chunks[0], self.steps_per_region
            first, stop = slot * T // t, -(-(slot + 1) * T // t)
        rest = itertools.product(*(range(n) for n in array.cdata_shape[1:]))
        return [f"{name}/{array.metadata.encode_chunk_key((i, *idx))}"
                for idx in rest for i in range(first, stop)]

    def _required(self, name: str) -> bool:
        """Whether every chunk of `name` must be on disk for a committed slot: always for the
        coordinates and the commit (never equal to their fill value -1 there), and for every
        array in stores made since every chunk is written."""
        return self._every_chunk or name in COORDS or name == COMMIT

    def _chunk_problem(self, name: str, key: str) -> str | None:
        """What is wrong with one chunk file of a committed slot, None if nothing is."""
        try:
            with open(os.path.join(self.path, key), "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return "is missing" if self._required(name) else None
        if self._crc[name] and not _crc_ok(data):
            return "fails its crc32c checksum (altered or cut short)"
        return None

    def _slot_problems(self, slot: int, names) -> list[tuple[str, str, str]]:
        """[(array, chunk key, problem)] of the chunks of `names` that hold `slot`. Arrays
        without checksums (stores made before them) are checked by decoding them."""
        out = []
        for name in names:
            keys = self._chunk_keys(name, slot)
            out += [(name, k, p) for k in keys if (p := self._chunk_problem(name, k))]
            if not self._crc[name] and not any(n == name for n, _, _ in out):
                try:
                    self._arrays[name][self._selection(name, slot)]
                except Exception as e:
                    out.append((name, keys[0], f"cannot be decoded ({type(e).__name__}: {e})"))
        return out

    def _region_in(self, slot: int) -> int | None:
        """The region id slot `slot` holds as far as the commit log or the coordinates can
        still tell (for messages), else None."""
        for name, sel in ((COMMIT, slot), ("region", slot * self.steps_per_region)):
            try:
                r = int(self._arrays[name][sel])
            except Exception:
                continue
            if r >= 0:
                return r
        return None

    def _damaged(self, problems: list[tuple[str, str, str]], slot: int) -> ReplayDamaged:
        name, key, problem = problems[0]
        region = self._region_in(slot)
        what = f"region {region} (ring slot {slot})" if region is not None else f"ring slot {slot}"
        more = f" (and {len(problems) - 1} more damaged chunk(s))" if len(problems) > 1 else ""
        return ReplayDamaged(f"replay store at {self.path} is damaged: {what}: chunk {key} "
                             f"{problem}{more}; {_fix(self.path)}")

    def _get(self, name: str, sel, slots):
        """array[sel], where a chunk that fails to decode raises ReplayDamaged naming it."""
        try:
            return self._arrays[name][sel]
        except Exception:
            for slot in slots:
                problems = self._slot_problems(slot, [name])
                if problems:
                    raise self._damaged(problems, slot) from None
            raise

    def _require_chunks(self, slot: int, names) -> None:
        """Raises ReplayDamaged if a chunk of `names` holding committed `slot` is not on disk
        (zarr would read it as the fill value)."""
        if not self._every_chunk:
            return  # an older store: an absent chunk may be a legitimate fill
        missing = [(name, key, "is missing") for name in names for key in self._chunk_keys(name, slot)
                   if not os.path.exists(os.path.join(self.path, key))]
        if missing:
            raise self._damaged(missing, slot)

    def verify(self) -> tuple[list["Damage"], dict]:
        """Checks every committed region of every array and the commit log: each chunk of a
        committed slot is on disk and passes its checksum, the slot's coordinates name the
        committed region, every commit marker is JSON. Returns the damage found (one entry
        per damaged chunk or marker) and counts {"regions", "chunks", "checksums"}. Reads
        only; run it while no writer is busy for exact answers (an overwrite in flight may
        show as damage of that slot)."""
        damage: list[Damage] = []
        regions = chunks = 0
        names = [*self.fields, *COORDS, TRAINED]
        for slot in range(self.n_slots):
            commit_key = self._chunk_keys(COMMIT, slot)[0]
            has_commit = os.path.exists(os.path.join(self.path, commit_key))
            problems = self._slot_problems(slot, [COMMIT]) if has_commit else []
            region = None if problems else int(self._arrays[COMMIT][slot])
            if region is not None and region < 0:  # not committed: nothing there is promised,
                # unless its commit chunk is gone: a written slot always has one (step 1 of
                # the protocol), so coordinates without it are a lost commit entry
                if has_commit or not self._every_chunk or self._slot_problems(slot, ["region"]):
                    continue
                held = self._arrays["region"][self._steps(slot)]
                if not bool(np.all((held >= 0) & (held % self.n_slots == slot))):
                    continue
                problems, region = [(COMMIT, commit_key, "is missing")], int(held[0])
            elif region is None:  # the commit chunk itself is damaged
                region = self._region_in(slot)
            else:
                problems = self._slot_problems(slot, names)
                if not any(n == "region" for n, _, _ in problems):
                    held = self._arrays["region"][self._steps(slot)]
                    if not bool(np.all(held == region)):
                        problems.append(("region", self._chunk_keys("region", slot)[0],
                                         f"says region {int(held.max())}, the commit log region {region}"))
            regions += 1
            chunks += sum(len(self._chunk_keys(n, slot)) for n in (*names, COMMIT))
            damage += [Damage(name, key, problem, slot, region) for name, key, problem in problems]
        for name in sorted(os.listdir(self._history_dir)) if os.path.isdir(self._history_dir) else ():
            if not name.isdigit():
                continue
            key = f"{HISTORY}/{name}"
            try:
                with open(os.path.join(self.path, key), "rb") as fh:
                    ok = json.loads(fh.read()).get("region") == int(name)
            except (ValueError, AttributeError):
                ok = False
            if not ok:
                damage.append(Damage(HISTORY, key, "is not the JSON marker of its region", None, int(name)))
        checksums = all(self._crc.values())
        return damage, {"regions": regions, "chunks": chunks, "checksums": checksums,
                        "every_chunk_written": self._every_chunk}

    def check(self) -> dict:
        """verify(), raising ReplayDamaged (one line: how many regions, the first damaged
        file, the fix) if anything is damaged; else returns verify's counts."""
        damage, counts = self.verify()
        if damage:
            regions = sorted({d.region for d in damage if d.slot is not None and d.region is not None})
            first = damage[0]
            raise ReplayDamaged(
                f"replay store at {self.path} is damaged: {len(regions)} region(s) "
                f"({_fmt_regions(regions)}), {len(damage)} file(s), first {first.key} {first.problem}; "
                f"{_fix(self.path)}")
        return counts

    def drop_damaged(self, damage: list["Damage"]) -> list[int]:
        """Uncommits every ring slot that `damage` (from verify) names, rewriting its commit
        and trained_version chunks, and rewrites damaged commit markers (history only: the
        region still counts as written once). Returns the region ids dropped (-1 where the
        slot's region could not be told). Run it while no run uses the store."""
        self._require_writable()
        slots = {}
        for d in damage:
            if d.slot is not None:
                slots[d.slot] = d.region if d.region is not None else -1
        for slot in sorted(slots):
            self._mark_uncommitted(slot)
        for d in damage:
            if d.array == HISTORY:
                marker = json.dumps({"region": d.region, "slot": self.slot_of(d.region),
                                     "rebuilt": "the original marker was damaged"}).encode()
                _put_durable(Path(self.path) / d.key, marker)
        return sorted(slots.values())

    @classmethod
    def remake_damaged_arrays(cls, path) -> list[str]:
        """Remakes, empty, every array whose metadata is missing or damaged (from the group's
        attributes, with the chunk shape and compressors the store's own arrays have) and
        uncommits every slot: the store then opens, holds no region, and a resumed run refills
        it. Returns the arrays remade. Group metadata cannot be remade."""
        path = os.fspath(path)
        group = cls._checked_group(path, "r+", True)  # raises for damaged group metadata
        attrs = dict(group.attrs)
        fields = {name: Field.from_json(f) for name, f in attrs["fields"].items()}
        T, n_envs, n_slots = int(attrs["steps_per_region"]), int(attrs["n_envs"]), int(attrs["n_slots"])
        arrays = {name: _array_or_damage(path, group, name) for name in (*fields, *COORDS, COMMIT, TRAINED)}
        intact = {name: a for name, a in arrays.items() if name in fields and isinstance(a, zarr.Array)}
        chunk_bytes = int(attrs.get(CHUNK_BYTES_KEY) or _chunk_bytes_of(intact, fields, T, n_envs))
        broken = [name for name, a in arrays.items() if not isinstance(a, zarr.Array)]
        for name in broken:
            # the fields' own compressors (all alike at create; a codec such as blosc is fitted
            # to the dtype, so one of the same dtype's first), where a field's metadata is left
            like = sorted(intact.values(), key=lambda a: name not in fields or a.dtype != fields[name].dtype)
            compressors = like[0].compressors if like else None
            spec = _array_specs(fields, n_envs, T, n_slots, chunk_bytes, compressors)[name]
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)
            group.create_array(name, **spec)
        if broken:
            store = cls(path, _open_group(path, "r+", True), "r+")
            store._set_all({COMMIT: (slice(None), -1), TRAINED: (slice(None), -1)})
        return broken

    # ------------------------------------------------------------------ reading
    def _slot_holds(self, slot: int, region_id: int) -> bool:
        # Coordinates first, then the commit: commit[slot] is reset before any data changes,
        # so seeing it == region_id after the coordinates means the slot was complete then.
        coords = self._get("region", self._steps(slot), [slot])
        if not bool(np.all(coords == region_id)):
            if int(self._get(COMMIT, slot, [slot])) == region_id:
                self._check_coords(slot, region_id)  # damage, or a writer that just finished
            return False
        return int(self._get(COMMIT, slot, [slot])) == region_id

    def _check_coords(self, slot: int, region_id: int) -> None:
        """The commit log says `slot` holds `region_id` but its coordinates did not: raises
        ReplayDamaged unless a writer changed the slot meanwhile. The commit is reset before
        any coordinate changes, so commit, coordinates, commit all read the same region id
        unless the coordinate chunk is damaged."""
        coords = self._get("region", self._steps(slot), [slot])
        if bool(np.all(coords == region_id)) or int(self._get(COMMIT, slot, [slot])) != region_id:
            return
        problems = self._slot_problems(slot, ["region"]) or [
            ("region", self._chunk_keys("region", slot)[0],
             f"says region {int(coords.max())}, the commit log region {region_id}")]
        raise self._damaged(problems, slot)

    def committed(self) -> list[tuple[int, int]]:
        """Sorted [(region_id, slot)] of regions that are readable now."""
        slots = range(self.n_slots)
        coords = self._get("region", slice(None), slots).reshape(self.n_slots, self.steps_per_region)
        commit = self._get(COMMIT, slice(None), slots)
        out = []
        for slot in slots:
            r = int(commit[slot])
            if r >= 0 and r % self.n_slots == slot:
                if bool(np.all(coords[slot] == r)):
                    out.append((r, slot))
                else:
                    self._check_coords(slot, r)
            elif r < 0 and self._every_chunk and bool(np.all((coords[slot] >= 0) & (coords[slot] % self.n_slots == slot))):
                # a written slot always has its commit chunk (step 1 of the protocol): one
                # that is gone lost the slot's commit entry
                self._require_chunks(slot, [COMMIT])
        out.sort()
        return out

    def rewind(self, first_lost: int) -> list[int]:
        """Forgets every region from `first_lost` on, committed or half-written: a run resumed
        from a checkpoint that ends before them collects them again into the same slots (which
        a newer region would otherwise guard against its "stale" rewrite), and nothing may
        train on them meanwhile. Returns the forgotten region ids."""
        self._require_writable()
        first_lost = _index(first_lost, "first_lost")
        slots = range(self.n_slots)
        coords = self._get("region", slice(None), slots).reshape(self.n_slots, self.steps_per_region)
        commit = self._get(COMMIT, slice(None), slots)
        held = {slot: max(int(commit[slot]), int(coords[slot].max())) for slot in slots}
        lost = [slot for slot in slots if held[slot] >= first_lost]
        for slot in lost:  # uncommitted first, as a write does: a crash between leaves no commit naming a wiped slot
            self._mark_uncommitted(slot)
            self._set_all({"region": (self._steps(slot), np.full(self.steps_per_region, -1, np.int64))})
        forgotten = sorted(held[slot] for slot in lost)
        for region_id in forgotten:  # its commit marker: "ever committed" counts it again when rewritten
            try:
                os.remove(os.path.join(self._history_dir, str(region_id)))
            except FileNotFoundError:
                pass
        if forgotten and self._durable and os.path.isdir(self._history_dir):
            _fsync_dir(Path(self._history_dir))
        return forgotten

    def committed_steps(self) -> int:
        return len(self.committed()) * self.steps_per_region

    def mark_trained(self, region_id: int, version: int) -> bool:
        """Records that the learner first trained on committed region `region_id` with
        parameter version `version`; returns whether it wrote. Only the first training
        counts (a slot already marked keeps its version) and only while the slot still
        holds that region (a region the ring overwrote is not marked). One learner per
        store writes these; write_region resets its slot's mark."""
        self._require_writable()
        region_id = _index(region_id, "region_id")
        version = _index(version, "version")
        slot = self.slot_of(region_id)
        if not self._slot_holds(slot, region_id) or int(self._get(TRAINED, slot, [slot])) != -1:
            return False
        self._arrays[TRAINED][slot] = version
        if int(self._arrays[COMMIT][slot]) != region_id:
            # a writer took the slot meanwhile; its reset may have come before this write
            self._arrays[TRAINED][slot] = -1
            return False
        return True

    def trained_versions(self) -> dict[int, int]:
        """{region id: version of its first training} of the committed regions that a
        learner has trained on."""
        trained = self._get(TRAINED, slice(None), range(self.n_slots))
        return {r: int(trained[s]) for r, s in self.committed() if trained[s] >= 0}

    def total_regions_committed(self) -> int:
        """Regions ever committed (including those since overwritten by the ring)."""
        try:
            names = os.listdir(self._history_dir)
        except FileNotFoundError:
            return 0
        return sum(1 for n in names if n.isdigit())

    def read_region(self, region_id: int) -> dict[str, np.ndarray]:
        region_id = _index(region_id, "region_id")
        slot = self.slot_of(region_id)
        if not self._slot_holds(slot, region_id):
            have = [r for r, _ in self.committed()]
            raise StoreError(
                f"region {region_id} is not committed in replay store at {self.path} "
                f"(committed: {_fmt_regions(have)}); read one of committed()"
            )
        steps = self._steps(slot)
        out = {name: self._get(name, steps, [slot]) for name in self.fields}
        if int(self._get(COMMIT, slot, [slot])) == region_id:
            self._require_chunks(slot, self.fields)  # never the fill value for a lost chunk
        if int(self._get(COMMIT, slot, [slot])) != region_id:
            raise StoreError(
                f"region {region_id} was overwritten while it was being read from {self.path}; "
                f"read a newer region from committed()"
            )
        return out

    def _require_committed(self) -> list[tuple[int, int]]:
        com = self.committed()
        if not com:
            raise StoreError(
                f"replay store at {self.path} has no committed regions yet; wait for collectors "
                f"to write at least one region"
            )
        return com

    def sample_sequences(
        self, rng: np.random.Generator, batch: int, length: int
    ) -> dict[str, np.ndarray]:
        """Uniform fixed-length windows, each inside one committed region: {field: [batch, length, ...]}."""
        batch = _positive_int(batch, "batch")
        length = _positive_int(length, "length")
        T = self.steps_per_region
        if length > T:
            raise StoreError(
                f"sequence length {length} exceeds steps_per_region {T}; sample length <= {T}"
            )
        for _attempt in range(8):
            com = self._require_committed()
            which = rng.integers(len(com), size=batch)
            env = rng.integers(self.n_envs, size=batch)
            start = rng.integers(T - length + 1, size=batch)
            out = {
                name: np.empty((batch, length, *f.shape), dtype=f.dtype) for name, f in self.fields.items()
            }
            try:
                for k in np.unique(which):
                    sel = np.flatnonzero(which == k)
                    data = self.read_region(com[k][0])
                    steps = start[sel, None] + np.arange(length)[None, :]  # [n, length]
                    envs = env[sel, None]
                    for name in self.fields:
                        out[name][sel] = data[name][steps, envs]
            except ReplayDamaged:
                raise
            except StoreError:
                continue  # a sampled region was overwritten meanwhile: draw again
            return out
        raise StoreError(
            f"replay store at {self.path} kept overwriting sampled regions; use more n_slots "
            f"than regions written per sampling call"
        )

    def sample_episodes(self, rng: np.random.Generator, batch: int) -> list[dict[str, np.ndarray]]:
        """Up to `batch` whole episodes inside committed regions, split at the bool fields
        "terminated" | "truncated" (an episode's last step) and "first" (its first step).

        An episode runs from a step marked `first` (or the step after an end) up to and
        including the next end. Incomplete ones are not returned: the tail after a region's
        last end, a segment cut short by a `first` (a collector restart), and the head of a
        region that began in an earlier one (a store without a `first` field cannot tell,
        and returns the steps from the region start to its first end as an episode).
        Regions are visited in random order until at least `batch` episodes are found,
        then `batch` of those are drawn without replacement.
        """
        batch = _positive_int(batch, "batch")
        need = ("terminated", "truncated")
        bad = [n for n in need if n not in self.fields or self.fields[n].dtype != "bool"
               or self.fields[n].shape != ()]
        if bad:
            raise StoreError(
                f"sample_episodes needs bool fields {list(need)} of shape (); the store at "
                f"{self.path} has {list(self.fields)}; add them or use sample_sequences"
            )
        has_first = "first" in self.fields
        com = self._require_committed()
        pool: list[tuple[dict, int, int, int]] = []
        for k in rng.permutation(len(com)):
            try:
                data = self.read_region(com[k][0])
            except ReplayDamaged:
                raise
            except StoreError:
                continue  # overwritten since committed(): skip it
            end = data["terminated"] | data["truncated"]
            starts = episode_starts(data["first"] if has_first else None, end)
            for e in range(self.n_envs):
                for t in np.flatnonzero(end[:, e]):
                    begin = int(starts[t, e])
                    if begin >= 0 or not has_first:
                        pool.append((data, e, max(begin, 0), int(t) + 1))
            if len(pool) >= batch:
                break
        pick = rng.permutation(len(pool))[:batch]
        return [
            {name: np.array(d[name][b:e, env]) for name in self.fields}
            for d, env, b, e in (pool[i] for i in pick)
        ]


def episode_starts(first, end) -> np.ndarray:
    """[T + 1, N]: at t, where the episode that step t belongs to began in this region
    (the latest step <= t marked `first` or following an end), or -1 where it began in an
    earlier region. Row T is the open tail's start (T itself if step T-1 ended an episode).
    `first` ([T, N] bool, or None where the data have none) and `end` ([T, N] bool:
    terminated | truncated)."""
    end = np.asarray(end, bool)
    T, N = end.shape
    marker = np.zeros((T + 1, N), bool)
    marker[1:] = end
    if first is not None:
        marker[:T] |= np.asarray(first, bool)
    t = np.arange(T + 1)[:, None]
    return np.maximum.accumulate(np.where(marker, t, -1), axis=0)


def open_replay(path):
    """A lazy (dask-backed) xarray.Dataset of the committed steps, ordered by region id.

    Data variables carry the named dims (step, env, agent, ...); region, iteration, collector,
    param_version and trained_version (the learner's parameter version when it first trained
    on the step's region, -1 where it has not) are coordinates along step. Later ring
    overwrites are not reflected in (and may race with) a dataset opened earlier: reopen for
    a fresh view.
    """
    store = ReplayStore.open(path, mode="r")
    import xarray as xr

    com = store.committed()
    trained = store._get(TRAINED, slice(None), range(store.n_slots))
    for _, slot in com:  # zarr would read a lost chunk as the fill value; checksums are
        store._require_chunks(slot, store.fields)  # checked as the data are read
    T = store.steps_per_region
    if com:
        idx = np.concatenate([np.arange(s * T, (s + 1) * T) for _, s in com])
    else:
        idx = np.zeros(0, dtype=np.int64)
    checked = _CheckedLocalStore(store.path, [name for name, crc in store._crc.items() if crc])
    ds = xr.open_zarr(checked, consolidated=False, zarr_format=3, use_zarr_fill_value_as_mask=False)
    ds = ds.drop_vars([COMMIT, TRAINED]).set_coords(list(COORDS)).isel({STEP_DIM: idx})
    for name in COORDS:  # small: load so they describe exactly the snapshot taken above
        ds[name] = ds[name].load()
    ds = ds.assign_coords({TRAINED: (STEP_DIM, np.repeat(
        np.array([trained[s] for _, s in com], dtype=np.int64), T))})
    n_seeds = int(store.attrs.get("n_seeds", 1))
    if n_seeds > 1:  # several seeds share each region: seed s owns a block of envs
        ds = ds.assign_coords(seed=("env", np.arange(store.n_envs) // (store.n_envs // n_seeds)))
    return ds
