"""storage/: Zarr replay store (real stores on disk) and orbax checkpoints."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import zarr

from storage import SCHEMA_VERSION, Checkpointer, ReplayStore, StoreError, open_replay
from storage.replay import Field

N_ENVS, T, N_AGENTS, OBS_DIM, STATE_DIM, N_ACTIONS = 2, 4, 3, 5, 7, 6

FIELDS = {
    "obs": Field((N_AGENTS, OBS_DIM), "float32", ("agent", "obs_dim")),
    "state": Field((STATE_DIM,), "float32", ("state_dim",)),
    "action": Field((N_AGENTS,), "int32", ("agent",)),
    "reward": Field((N_AGENTS,), "float32", ("agent",)),
    "first": Field((), "bool", ()),
    "terminated": Field((), "bool", ()),
    "truncated": Field((), "bool", ()),
    "avail_actions": Field((N_AGENTS, N_ACTIONS), "bool", ("agent", "n_actions")),
}


def attrs(env_id="smax:3m"):
    return {
        "env_id": env_id,
        "env_spec": {"n_agents": N_AGENTS, "obs_dim": OBS_DIM},
        "algorithm": "qmix",
        "seed": 0,
        "config": {"lr": 5e-4, "gamma": 0.99},
    }


def make_store(path, n_slots=4, env_id="smax:3m", n_envs=N_ENVS):
    return ReplayStore.create(
        path, fields=FIELDS, n_envs=n_envs, steps_per_region=T, n_slots=n_slots, attrs=attrs(env_id)
    )


def region_data(r, n_envs=N_ENVS, done_every=None):
    """Data whose values encode (region, step, env): obs[t, e, ...] = r*1000 + t*10 + e."""
    code = r * 1000 + np.arange(T)[:, None] * 10 + np.arange(n_envs)[None, :]  # (T, n_envs)
    done = np.zeros((T, n_envs), bool)
    if done_every:
        done[done_every - 1 :: done_every] = True
    first = np.zeros((T, n_envs), bool)
    first[1:] = done[:-1]
    return {
        "obs": np.broadcast_to(code[..., None, None], (T, n_envs, N_AGENTS, OBS_DIM)).astype("float32")
        + np.arange(OBS_DIM, dtype="float32") / 10,
        "state": np.broadcast_to(code[..., None], (T, n_envs, STATE_DIM)).astype("float32"),
        "action": np.broadcast_to((code % 6)[..., None], (T, n_envs, N_AGENTS)).astype("int32"),
        "reward": np.broadcast_to(code[..., None], (T, n_envs, N_AGENTS)).astype("float32") * -1,
        "first": first,
        "terminated": done,
        "truncated": np.zeros((T, n_envs), bool),
        "avail_actions": np.ones((T, n_envs, N_AGENTS, N_ACTIONS), bool),
    }


def write(store, r, **kw):
    return store.write_region(r, region_data(r, **kw), iteration=r // 2, collector=r % 2, param_version=r)


def snapshot(path, skip_slot=None):
    """{relative file: bytes} of a store, optionally leaving out one slot's chunks."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), path)
            parts = rel.split(os.sep)
            if skip_slot is not None and "c" in parts:
                i = parts.index("c")
                if i + 1 < len(parts) and parts[i + 1] == str(skip_slot):
                    continue
            with open(os.path.join(root, f), "rb") as fh:
                out[rel] = fh.read()
    return out


# ---------------------------------------------------------------- layout and xarray view
def test_create_write_open_replay(tmp_path):
    path = tmp_path / "replay"
    store = make_store(path)
    assert store.capacity == 4 * T and store.n_slots == 4 and store.steps_per_region == T
    assert store.attrs["env_id"] == "smax:3m" and store.attrs["schema_version"] == SCHEMA_VERSION
    assert [r for r in (write(store, r) for r in (1, 0, 2))] == [1, 0, 2]
    assert store.committed() == [(0, 0), (1, 1), (2, 2)]
    assert store.committed_steps() == 3 * T
    assert store.total_regions_committed() == 3

    # arrays on disk: chunks are whole regions, named dims, zstd, no consolidated metadata
    g = zarr.open_group(str(path), mode="r", zarr_format=3)
    assert g["obs"].chunks == (T, N_ENVS, N_AGENTS, OBS_DIM)
    assert g["obs"].metadata.dimension_names == ("step", "env", "agent", "obs_dim")
    assert type(g["obs"].compressors[0]).__name__ == "ZstdCodec"
    assert g.metadata.consolidated_metadata is None

    ds = open_replay(path)
    assert ds.obs.dims == ("step", "env", "agent", "obs_dim")
    assert ds.state.dims == ("step", "env", "state_dim")
    assert ds.action.dims == ("step", "env", "agent")
    assert ds.terminated.dims == ("step", "env") and ds.truncated.dims == ("step", "env")
    assert ds.first.dims == ("step", "env")
    assert ds.avail_actions.dims == ("step", "env", "agent", "n_actions")
    assert dict(ds.sizes) == {"step": 3 * T, "env": N_ENVS, "agent": N_AGENTS, "obs_dim": OBS_DIM,
                              "state_dim": STATE_DIM, "n_actions": N_ACTIONS}
    assert "commit" not in ds.variables and "slot" not in ds.dims
    assert set(ds.coords) >= {"region", "iteration", "collector", "param_version", "trained_version"}
    np.testing.assert_array_equal(ds.trained_version.values, np.full(3 * T, -1))
    assert ds.obs.chunks is not None  # lazy, dask-backed
    assert ds.attrs["env_id"] == "smax:3m" and ds.attrs["config"]["gamma"] == 0.99
    np.testing.assert_array_equal(ds.region.values, np.repeat([0, 1, 2], T))
    np.testing.assert_array_equal(ds.iteration.values, np.repeat([0, 0, 1], T))
    np.testing.assert_array_equal(ds.collector.values, np.repeat([0, 1, 0], T))
    np.testing.assert_array_equal(ds.param_version.values, np.repeat([0, 1, 2], T))
    for name in FIELDS:
        expect = np.concatenate([region_data(r)[name] for r in (0, 1, 2)])
        np.testing.assert_array_equal(ds[name].values, expect)
        assert ds[name].dtype == np.dtype(FIELDS[name].dtype)
    for name, arr in store.read_region(1).items():
        np.testing.assert_array_equal(arr, region_data(1)[name])

    reopened = ReplayStore.open(path)
    assert reopened.fields == FIELDS and reopened.n_envs == N_ENVS
    assert reopened.committed() == store.committed()


def test_empty_store_open_replay(tmp_path):
    make_store(tmp_path / "r")
    ds = open_replay(tmp_path / "r")
    assert ds.sizes["step"] == 0 and ds.obs.shape == (0, N_ENVS, N_AGENTS, OBS_DIM)
    assert ReplayStore.open(tmp_path / "r").committed() == []
    with pytest.raises(StoreError, match="no committed regions"):
        ReplayStore.open(tmp_path / "r").sample_sequences(np.random.default_rng(0), 2, 2)


def test_ring_overwrites_oldest(tmp_path):
    store = make_store(tmp_path / "r", n_slots=3)
    slots = [write(store, r) for r in range(5)]
    assert slots == [0, 1, 2, 0, 1]
    assert store.committed() == [(2, 2), (3, 0), (4, 1)]
    assert store.total_regions_committed() == 5
    assert store.committed_steps() == 3 * T
    ds = open_replay(tmp_path / "r")
    np.testing.assert_array_equal(ds.region.values, np.repeat([2, 3, 4], T))
    np.testing.assert_array_equal(ds.obs.values[:, :, 0, 0], np.concatenate(
        [region_data(r)["obs"][:, :, 0, 0] for r in (2, 3, 4)]))
    with pytest.raises(StoreError, match="region 0 is not committed"):
        store.read_region(0)
    # a stale retry of an overwritten region must not clobber the newer one
    with pytest.raises(StoreError, match="newer region 3"):
        write(store, 0)
    assert store.committed() == [(2, 2), (3, 0), (4, 1)]


def test_rewind_forgets_the_regions_after_a_checkpoint_so_a_resumed_run_rewrites_them(tmp_path):
    """A run killed after collecting regions 3-5 (5 half-written) whose checkpoint covers
    regions 0-2 resumes there: regions 3-5 are forgotten, and rewriting region 3 into slot 0
    (where region 0 was) is no stale write."""
    path = tmp_path / "r"
    store = make_store(path, n_slots=3)
    for r in range(5):
        write(store, r)
    write_failing(store, 5)  # killed mid-write: slot 2 holds half of region 5
    assert store.committed() == [(3, 0), (4, 1)]

    assert store.rewind(3) == [3, 4, 5]
    assert store.committed() == [] and store.total_regions_committed() == 3
    assert store.rewind(3) == []  # nothing left to forget
    for r in (3, 4, 5):  # the resumed run collects them again, same ids, same slots
        assert write(store, r) == r % 3
    assert store.committed() == [(3, 0), (4, 1), (5, 2)]
    assert store.total_regions_committed() == 6
    assert store.verify()[0] == []
    with pytest.raises(StoreError, match="newer region 5"):  # still guarded against stale tasks
        write(store, 2)


# ---------------------------------------------------------------- failures and retries
class _Boom(RuntimeError):
    pass


class _FailingArray:
    """Stands in for one field's zarr array: writes fail like a worker dying mid-region."""

    def __init__(self, arr):
        self._arr = arr

    def __getitem__(self, key):
        return self._arr[key]

    def __setitem__(self, key, value):
        raise _Boom("worker died")

    @property
    def async_array(self):  # the store writes a region's arrays through zarr's async API
        return self

    @property
    def chunks(self):  # (one write per chunk)
        return self._arr.chunks

    async def setitem(self, key, value):
        raise _Boom("worker died")


def write_failing(store, r, fail_field="reward"):
    saved = store._arrays[fail_field]
    store._arrays[fail_field] = _FailingArray(saved)
    try:
        with pytest.raises(_Boom):
            write(store, r)
    finally:
        store._arrays[fail_field] = saved


def test_half_written_slot_is_invisible_and_retry_is_idempotent(tmp_path):
    path = tmp_path / "r"
    store = make_store(path, n_slots=3)
    for r in range(3):
        write(store, r)
    before_others = snapshot(path, skip_slot=0)

    # region 3 (slot 0) dies after some fields were written: slot 0 is no longer readable
    write_failing(store, 3)
    assert store.committed() == [(1, 1), (2, 2)]
    assert store.total_regions_committed() == 3
    ds = open_replay(path)
    np.testing.assert_array_equal(ds.region.values, np.repeat([1, 2], T))
    with pytest.raises(StoreError, match="not committed"):
        store.read_region(3)
    with pytest.raises(StoreError, match="not committed"):
        store.read_region(0)

    # the retried task rewrites exactly its region and commits once
    assert write(store, 3) == 0
    assert store.committed() == [(1, 1), (2, 2), (3, 0)]
    assert store.total_regions_committed() == 4
    for name, arr in store.read_region(3).items():
        np.testing.assert_array_equal(arr, region_data(3)[name])
    # a duplicate retry after success changes nothing visible
    write(store, 3)
    assert store.committed() == [(1, 1), (2, 2), (3, 0)]
    assert store.total_regions_committed() == 4
    history = sorted(os.listdir(path / "commits"))
    assert [h for h in history if h.isdigit()] == ["0", "1", "2", "3"]
    assert not [h for h in history if h.endswith(".tmp")]

    after_others = snapshot(path, skip_slot=0)
    changed = {k for k in set(before_others) | set(after_others)
               if before_others.get(k) != after_others.get(k)}
    assert changed == {os.path.join("commits", "3")}  # only the new commit marker
    for r in (1, 2):
        for name, arr in store.read_region(r).items():
            np.testing.assert_array_equal(arr, region_data(r)[name])


def test_crash_after_data_before_commit(tmp_path, monkeypatch):
    store = make_store(tmp_path / "r")
    write(store, 0)

    def die(*a, **k):
        raise _Boom("died before commit")

    monkeypatch.setattr(store, "_commit", die)
    with pytest.raises(_Boom):
        write(store, 1)
    monkeypatch.undo()
    # data and coordinates of region 1 are on disk, but without the commit it is not readable
    assert int(zarr.open_array(str(tmp_path / "r" / "region"), mode="r")[T]) == 1
    assert store.committed() == [(0, 0)]
    assert open_replay(tmp_path / "r").sizes["step"] == T
    write(store, 1)
    assert store.committed() == [(0, 0), (1, 1)]


def _concurrent_writer(path, regions):
    store = ReplayStore.open(path, mode="r+")
    return [write(store, r) for r in regions]


def test_concurrent_writers(tmp_path):
    path = str(tmp_path / "r")
    make_store(path, n_slots=16)
    jobs = [list(range(w, 16, 4)) for w in range(4)]  # interleaved regions, distinct slots
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=4, mp_context=ctx) as pool:
        results = list(pool.map(_concurrent_writer, [path] * 4, jobs))
    assert results == jobs
    store = ReplayStore.open(path)
    assert store.committed() == [(r, r) for r in range(16)]
    assert store.total_regions_committed() == 16
    ds = open_replay(path)
    for name in FIELDS:
        expect = np.concatenate([region_data(r)[name] for r in range(16)])
        np.testing.assert_array_equal(ds[name].values, expect)
    np.testing.assert_array_equal(ds.collector.values, np.repeat([r % 2 for r in range(16)], T))


# ---------------------------------------------------------------- bad input
def test_bad_region_data_writes_nothing(tmp_path):
    path = tmp_path / "r"
    store = make_store(path)
    write(store, 0)
    before = snapshot(path)
    good = region_data(1)
    bad_inputs = {
        "missing field": {k: v for k, v in good.items() if k != "terminated"},
        "unknown field": {**good, "extra": good["terminated"]},
        "has shape": {**good, "obs": good["obs"][:, :, :2]},
        "dtype": {**good, "action": good["action"].astype("float32")},
    }
    for match, data in bad_inputs.items():
        with pytest.raises(StoreError, match=match):
            store.write_region(1, data, iteration=0, collector=0, param_version=0)
    with pytest.raises(StoreError, match="region_id"):
        store.write_region(-1, good, iteration=0, collector=0, param_version=0)
    assert snapshot(path) == before
    again = ReplayStore.open(path)
    assert again.committed() == [(0, 0)]
    np.testing.assert_array_equal(again.read_region(0)["obs"], region_data(0)["obs"])
    with pytest.raises(StoreError, match="read-only"):
        write(again, 1)


def test_open_or_create(tmp_path):
    path = tmp_path / "runs" / "x"
    kw = dict(fields=FIELDS, n_envs=N_ENVS, steps_per_region=T, n_slots=4, attrs=attrs("smax:3m"))
    store = ReplayStore.open_or_create(path, **kw)
    write(store, 0)
    before = snapshot(path)

    again = ReplayStore.open_or_create(path, **kw)
    assert again.mode == "r+" and again.committed() == [(0, 0)]
    write(again, 1)
    before = snapshot(path)

    with pytest.raises(StoreError) as e:
        ReplayStore.open_or_create(path, **{**kw, "attrs": attrs("smax:2s3z")})
    msg = str(e.value)
    assert "\n" not in msg
    assert f"replay store at {path} was made for env smax:3m (n_envs={N_ENVS}), not smax:2s3z (n_envs={N_ENVS})" in msg
    assert "use a new --run-dir or the original settings" in msg
    with pytest.raises(StoreError, match="n_envs=4"):
        ReplayStore.open_or_create(path, **{**kw, "n_envs": 4})
    with pytest.raises(StoreError, match="n_slots=8"):
        ReplayStore.open_or_create(path, **{**kw, "n_slots": 8})
    with pytest.raises(StoreError, match="fields obs"):
        ReplayStore.open_or_create(
            path, **{**kw, "fields": {**FIELDS, "obs": Field((N_AGENTS, 9), "float32", ("agent", "obs_dim"))}})
    assert snapshot(path) == before
    with pytest.raises(StoreError, match="already exists"):
        ReplayStore.create(path, **kw)
    assert snapshot(path) == before


def test_open_non_store(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hi")
    zarr.open_group(str(tmp_path / "plain"), mode="w", zarr_format=3)
    for p, match in [
        (tmp_path / "missing", "no such directory"),
        (tmp_path / "empty", "not a replay store"),
        (tmp_path / "junk", "not a replay store"),
        (tmp_path / "plain", "not a replay store"),
    ]:
        with pytest.raises(StoreError, match=match):
            ReplayStore.open(p)
        with pytest.raises(StoreError, match=match):
            open_replay(p)
    with pytest.raises(StoreError, match="not empty"):
        make_store(tmp_path / "junk")
    with pytest.raises(StoreError, match="mode"):
        ReplayStore.open(tmp_path / "plain", mode="w")


def test_create_validation(tmp_path):
    kw = dict(fields=FIELDS, n_envs=N_ENVS, steps_per_region=T, n_slots=4)
    with pytest.raises(StoreError, match=r"attrs\['config'\] is not JSON-serialisable"):
        ReplayStore.create(tmp_path / "a", **kw, attrs={"env_id": "x", "config": {"f": np.float32(1)}})
    with pytest.raises(StoreError, match="reserved"):
        ReplayStore.create(tmp_path / "b", **kw, attrs={"n_envs": 3})
    with pytest.raises(StoreError, match="dim 'agent' has size"):
        ReplayStore.create(tmp_path / "c", **{**kw, "fields": {
            **FIELDS, "reward": Field((4,), "float32", ("agent",))}}, attrs={})
    with pytest.raises(StoreError, match="field name 'region'"):
        ReplayStore.create(tmp_path / "d", **{**kw, "fields": {"region": Field((), "int32", ())}}, attrs={})
    with pytest.raises(StoreError, match="one dim name per"):
        Field((3,), "float32", ())
    with pytest.raises(StoreError, match="n_slots"):
        ReplayStore.create(tmp_path / "e", **{**kw, "n_slots": 0}, attrs={})
    assert sorted(os.listdir(tmp_path)) == []  # nothing created


# ---------------------------------------------------------------- sampling
def test_sample_sequences(tmp_path):
    store = make_store(tmp_path / "r", n_slots=3)
    for r in range(5):  # committed: 2, 3, 4
        write(store, r)
    rng = np.random.default_rng(0)
    length = 3
    batch = store.sample_sequences(rng, batch=16, length=length)
    assert set(batch) == set(FIELDS)
    assert batch["obs"].shape == (16, length, N_AGENTS, OBS_DIM)
    assert batch["terminated"].shape == (16, length) and batch["terminated"].dtype == bool
    assert batch["action"].dtype == np.int32
    code = batch["state"][:, :, 0].astype(int)  # r*1000 + t*10 + e
    regions, steps, envs = code // 1000, (code % 1000) // 10, code % 10
    assert set(regions.ravel()) <= {2, 3, 4}
    assert (regions == regions[:, :1]).all() and (envs == envs[:, :1]).all()
    np.testing.assert_array_equal(np.diff(steps, axis=1), 1)
    assert (steps[:, 0] >= 0).all() and (steps[:, -1] < T).all()
    np.testing.assert_array_equal(batch["reward"][..., 0], -code)
    full = store.sample_sequences(rng, batch=4, length=T)
    np.testing.assert_array_equal(full["state"][:, :, 0] % 1000 // 10, np.tile(np.arange(T), (4, 1)))
    with pytest.raises(StoreError, match="exceeds steps_per_region"):
        store.sample_sequences(rng, batch=2, length=T + 1)


def test_sample_episodes(tmp_path):
    store = make_store(tmp_path / "r")
    end = np.zeros((T, N_ENVS), bool)
    end[1, 0] = end[3, 0] = True  # env 0: episodes steps [0,1], [2,3]
    end[2, 1] = True               # env 1: episode [0,1,2]; step 3 is an unfinished tail
    first = np.zeros((T, N_ENVS), bool)
    first[0] = True  # the collector's first step
    first[2, 0] = first[3, 1] = True  # and after each end
    truncated = np.zeros((T, N_ENVS), bool)
    truncated[3, 0] = True  # the second episode of env 0 ended by time limit
    data = {**region_data(0), "first": first, "terminated": end & ~truncated, "truncated": truncated}
    store.write_region(0, data, iteration=0, collector=0, param_version=0)
    eps = store.sample_episodes(np.random.default_rng(0), batch=10)
    assert len(eps) == 3  # up to batch
    got = sorted((tuple((e["state"][:, 0] % 1000 // 10).astype(int)), int(e["state"][0, 0] % 10)) for e in eps)
    assert got == [((0, 1), 0), ((0, 1, 2), 1), ((2, 3), 0)]
    for e in eps:
        assert set(e) == set(FIELDS)
        ended = e["terminated"] | e["truncated"]
        assert ended[-1] and not ended[:-1].any()
        assert e["first"][0] and not e["first"][1:].any()
        assert e["obs"].shape == (len(ended), N_AGENTS, OBS_DIM)
    assert len(store.sample_episodes(np.random.default_rng(1), batch=2)) == 2


def test_sample_episodes_start_at_first_and_skip_cut_ones(tmp_path):
    store = make_store(tmp_path / "r")
    end = np.zeros((T, N_ENVS), bool)
    first = np.zeros((T, N_ENVS), bool)
    # env 0: the region begins mid-episode (no first at step 0): its head [0,1] is not whole;
    # then a whole episode [2,3]
    end[1, 0] = end[3, 0] = True
    first[2, 0] = True
    # env 1: an episode from step 0 is cut by a collector restart at step 2 (first without
    # an end before it): [0,1] is dropped, [2,3] is whole
    first[0, 1] = first[2, 1] = True
    end[3, 1] = True
    data = {**region_data(0), "first": first, "terminated": end}
    store.write_region(0, data, iteration=0, collector=0, param_version=0)
    eps = store.sample_episodes(np.random.default_rng(0), batch=10)
    got = sorted((tuple((e["state"][:, 0] % 1000 // 10).astype(int)), int(e["state"][0, 0] % 10)) for e in eps)
    assert got == [((2, 3), 0), ((2, 3), 1)]


def test_episode_starts_mark_firsts_and_steps_after_ends():
    from storage.replay import episode_starts

    end = np.array([[0, 0], [1, 0], [0, 0], [0, 1]], bool)
    first = np.array([[0, 1], [0, 0], [0, 1], [0, 0]], bool)
    np.testing.assert_array_equal(episode_starts(first, end), [[-1, 0], [-1, 0], [2, 2], [2, 2], [2, 4]])
    np.testing.assert_array_equal(episode_starts(None, end)[:, 1], [-1, -1, -1, -1, 4])


# ---------------------------------------------------------------- training marks
def test_mark_trained_first_write_wins_and_resets_with_the_slot(tmp_path):
    store = make_store(tmp_path / "r", n_slots=2)
    write(store, 0)
    write(store, 1)
    assert store.trained_versions() == {}
    assert store.mark_trained(0, 3) is True
    assert store.mark_trained(0, 5) is False  # the first training counts, not later ones
    assert store.mark_trained(1, 4) is True
    assert store.trained_versions() == {0: 3, 1: 4}
    assert ReplayStore.open(tmp_path / "r").trained_versions() == {0: 3, 1: 4}  # on disk
    with pytest.raises(StoreError, match="read-only"):
        ReplayStore.open(tmp_path / "r").mark_trained(1, 6)
    # region 2 overwrites slot 0: the new region is not trained on yet, and the old one,
    # which the slot no longer holds, cannot be marked
    write(store, 2)
    assert store.trained_versions() == {1: 4}
    assert store.mark_trained(0, 7) is False
    assert store.trained_versions() == {1: 4}
    assert store.mark_trained(2, 8) is True and store.trained_versions() == {1: 4, 2: 8}
    # a retried write of the same region resets its mark too (it may hold new data)
    write(store, 2)
    assert store.trained_versions() == {1: 4}
    # a region not committed (yet) is not marked
    assert store.mark_trained(3, 9) is False
    with pytest.raises(StoreError, match="version must be an int >= 0"):
        store.mark_trained(1, -1)


def test_open_replay_has_trained_version_along_step(tmp_path):
    store = make_store(tmp_path / "r", n_slots=3)
    for r in range(4):  # committed: 1, 2, 3 (region 3 in slot 0)
        write(store, r)
    store.mark_trained(1, 2)
    store.mark_trained(3, 4)
    ds = open_replay(tmp_path / "r")
    assert ds.trained_version.dims == ("step",) and "trained_version" in ds.coords
    np.testing.assert_array_equal(ds.region.values, np.repeat([1, 2, 3], T))
    np.testing.assert_array_equal(ds.trained_version.values, np.repeat([2, -1, 4], T))
    assert "slot" not in ds.dims
    g = zarr.open_group(str(tmp_path / "r"), mode="r", zarr_format=3)
    assert g["trained_version"].metadata.dimension_names == ("slot",) and g["trained_version"].chunks == (1,)
    assert g["trained_version"].fill_value == -1
    # the reserved name cannot be a field
    with pytest.raises(StoreError, match="field name 'trained_version'"):
        ReplayStore.create(tmp_path / "x", fields={"trained_version": Field((), "int64", ())}, n_envs=1,
                           steps_per_region=T, n_slots=1, attrs={})


def test_a_schema_1_store_is_refused_in_one_line(tmp_path):
    make_store(tmp_path / "r")
    g = zarr.open_group(str(tmp_path / "r"), mode="r+", zarr_format=3)
    g.attrs["schema_version"] = 1
    assert SCHEMA_VERSION == 2
    for opener in (ReplayStore.open, open_replay):
        with pytest.raises(StoreError) as e:
            opener(tmp_path / "r")
        assert "schema_version 1, this code reads 2" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- checkpoints
def test_checkpointer_roundtrip(tmp_path):
    import jax

    key = jax.random.PRNGKey(42)  # legacy uint32[2] key
    state = {
        "params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32)},
        "opt": {"count": np.array(7, np.int32), "mu": [np.ones(2), np.full(2, 2.0)]},
        "step": 10,
        "rng": np.asarray(key),
    }
    ckpt = Checkpointer(tmp_path / "checkpoints", max_to_keep=2)
    assert ckpt.latest_step() is None
    with pytest.raises(StoreError, match="no checkpoint"):
        ckpt.restore()
    for step in (10, 20, 30):
        ckpt.save(step, {**state, "step": step}, metadata={"env_id": "smax:3m", "step": step})
    assert ckpt.latest_step() == 30 and ckpt.all_steps() == [20, 30]  # max_to_keep
    ckpt.save(30, state)  # re-save of the latest step (retried task) is a no-op
    with pytest.raises(StoreError, match="older than the latest"):
        ckpt.save(5, state)
    ckpt.close()

    # a fresh process view; a leftover temp dir from a crashed save is not a checkpoint
    (tmp_path / "checkpoints" / "40.orbax-checkpoint-tmp-123").mkdir()
    ckpt = Checkpointer(tmp_path / "checkpoints", max_to_keep=2)
    assert ckpt.latest_step() == 30
    restored, meta = ckpt.restore()
    assert meta == {"env_id": "smax:3m", "step": 30}
    assert ckpt.metadata() == meta and ckpt.metadata(20) == {"env_id": "smax:3m", "step": 20}
    assert restored["step"] == 30
    np.testing.assert_array_equal(restored["params"]["w"], state["params"]["w"])
    np.testing.assert_array_equal(restored["rng"], np.asarray(key))
    assert np.asarray(restored["rng"]).dtype == np.uint32

    target = jax.tree.map(lambda x: np.zeros_like(x) if isinstance(x, np.ndarray) else 0, state)
    exact, meta20 = ckpt.restore(20, target=target)
    assert meta20["step"] == 20 and exact["step"] == 20
    assert jax.tree.structure(exact) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(exact), jax.tree.leaves({**state, "step": 20})):
        assert isinstance(a, type(b)) and np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(a, b)
    assert jax.random.uniform(jax.numpy.asarray(exact["rng"])) == jax.random.uniform(key)
    with pytest.raises(StoreError, match="step 99"):
        ckpt.restore(99)
    with pytest.raises(StoreError, match="typed jax PRNG key"):
        ckpt.save(50, {"rng": jax.random.key(0)})
    with pytest.raises(StoreError, match="JSON"):
        ckpt.save(50, state, metadata={"x": object()})
    ckpt.save(50, state, wait=False)
    ckpt.close()
    assert Checkpointer(tmp_path / "checkpoints").latest_step() == 50


def test_storage_imports_stay_light():
    code = (
        "import sys, storage; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'marl', 'pipelines', 'flows', 'jax', 'flax'}); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_image_fields_bigger_than_a_chunk_split_along_envs_and_keep_regions_apart(tmp_path):
    """One step of all envs of an image field over chunk_bytes: chunks are cut along the env
    axis (then the agents) to fit; regions still round-trip bit-exactly, a write touches only
    its own slot's chunks, and verify() finds a deleted chunk."""
    from storage.replay import chunk_shape

    n_envs, image = 5, (2, 6, 5, 3)  # 5 envs (no even split), 2 agents' 6x5 RGB crops
    fields = {"obs": Field(image, "uint8", ("agent", "obs_height", "obs_width", "obs_channel")),
              "state": Field((6, 5, 6), "uint8", ("state_height", "state_width", "state_channel")),
              "reward": Field((2,), "float32", ("agent",)), "first": Field((), "bool", ())}
    budget = 2 * 180  # two envs' images of one step: all 5 envs' (900 bytes) do not fit
    assert chunk_shape(T, n_envs, fields["obs"], budget) == (1, 2, *image)
    assert chunk_shape(T, n_envs, fields["obs"], 100) == (1, 1, 1, 6, 5, 3)  # one env's too big: agents
    assert chunk_shape(T, n_envs, fields["reward"], budget) == (T, n_envs, 2)  # small fields as before
    path = tmp_path / "images"
    store = ReplayStore.create(path, fields=fields, n_envs=n_envs, steps_per_region=T, n_slots=2,
                               attrs=attrs("pz:pettingzoo.butterfly.pistonball_v6"), chunk_bytes=budget)
    group = zarr.open_group(str(path), mode="r")
    for name in fields:
        chunk = group[name].chunks
        assert np.prod(chunk) * group[name].dtype.itemsize <= budget, (name, chunk)
        assert T % chunk[0] == 0  # a region is whole chunks along the step axis
    rng = np.random.default_rng(0)

    def data(r):
        return {"obs": rng.integers(0, 256, (T, n_envs, *image), dtype=np.uint8),
                "state": rng.integers(0, 256, (T, n_envs, 6, 5, 6), dtype=np.uint8),
                "reward": rng.standard_normal((T, n_envs, 2)).astype(np.float32),
                "first": rng.random((T, n_envs)) < 0.3}

    def files():
        return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}

    written = {}
    for r in range(3):  # region 2 overwrites region 0's slot
        before = files()
        written[r] = data(r)
        store.write_region(r, written[r], iteration=r, collector=0, param_version=r)
        changed = {k for k, v in files().items() if before.get(k) != v}
        slot_chunks = {k for name in [*fields, "region", "iteration", "collector", "param_version",
                                      "commit", "trained_version"] for k in store._chunk_keys(name, r % 2)}
        assert {k for k in changed if not k.startswith("commits/")} <= slot_chunks, sorted(changed - slot_chunks)
    assert [r for r, _ in store.committed()] == [1, 2]
    for r in (1, 2):
        for name, arr in store.read_region(r).items():
            assert arr.dtype == written[r][name].dtype
            np.testing.assert_array_equal(arr, written[r][name])
    ds = open_replay(path)  # ordered by region id
    for name in fields:
        np.testing.assert_array_equal(ds[name].values, np.concatenate([written[1][name], written[2][name]]))
    batch = store.sample_sequences(rng, batch=3, length=2)
    assert batch["obs"].shape == (3, 2, *image) and batch["obs"].dtype == np.uint8
    assert store.verify()[0] == []

    lost = store._chunk_keys("obs", store.slot_of(1))[3]  # one env part of one step of region 1
    os.remove(path / lost)
    damage, _ = store.verify()
    assert [(d.array, d.key, d.problem, d.region) for d in damage] == [("obs", lost, "is missing", 1)]
    with pytest.raises(StoreError, match="is damaged"):
        store.read_region(1)
    assert store.drop_damaged(damage) == [1]
    assert [r for r, _ in store.committed()] == [2] and store.verify()[0] == []
