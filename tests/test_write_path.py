"""The parallel, asynchronous replay write path: a region written while the collector's next
region rolls out is complete, committed once and byte-identical to a synchronous write; a
process killed between write and commit leaves nothing visible as committed; chunked and
durable stores hold the same data as the old one-chunk-per-region layout."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from pipelines import stages
from pipelines.config import make_run_config
from storage import ReplayStore, StoreError, open_replay
from storage.replay import steps_per_chunk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_storage import FIELDS, N_ENVS, T, make_store, region_data, write  # noqa: E402

TINY = "qmix-smac-tiny"  # 8 envs x 32 steps a region


def chunk_files(store_path: str, names) -> dict[str, bytes]:
    """{relative path: bytes} of the chunk files of the arrays `names`."""
    out = {}
    for name in names:
        root = os.path.join(store_path, name, "c")
        for d, _, files in os.walk(root):
            for f in files:
                with open(os.path.join(d, f), "rb") as fh:
                    out[os.path.relpath(os.path.join(d, f), store_path)] = fh.read()
    return out


def tiny_config(run_dir, **overrides):
    return make_run_config(TINY, run_dir=str(run_dir), n_collectors=1,
                           overrides={"learning_starts": "1", **overrides}).to_dict()


# ------------------------------------------------------------ the asynchronous collect


def test_regions_written_while_the_next_rollout_runs_match_a_synchronous_write(tmp_path, monkeypatch):
    from distributed import Client, LocalCluster

    n = 4
    sync_cfg, async_cfg = tiny_config(tmp_path / "sync"), tiny_config(tmp_path / "async")
    stages.prepare_run(sync_cfg)
    stages.prepare_run(async_cfg)
    params = stages.policy_params(sync_cfg)
    for i in range(n):  # plain calls: every write finishes before the next rollout starts
        stages.collect(sync_cfg, 0, i, params, 0, i * 256)

    real_write, real_commit = ReplayStore.write_region, ReplayStore._commit
    overlapped, commits = [], []

    def write_after_next_rollout(self, region_id, data, **kwargs):
        # region r's write goes on only once region r+1 has rolled out, which only happens
        # if the collect task left the worker's single thread to write
        if "async" in self.path and region_id < n - 1:
            state = next(s for k, s in stages._STATES.items() if k[0] == "collect" and "async" in k[1])
            deadline = time.monotonic() + 30
            while state.next_iteration <= region_id + 1 and time.monotonic() < deadline:
                time.sleep(0.005)
            overlapped.append(state.next_iteration > region_id + 1)
        return real_write(self, region_id, data, **kwargs)

    def counted_commit(self, slot, region_id, values):
        commits.append((self.path, region_id))
        return real_commit(self, slot, region_id, values)

    monkeypatch.setattr(ReplayStore, "write_region", write_after_next_rollout)
    monkeypatch.setattr(ReplayStore, "_commit", counted_commit)
    # in-process worker with one thread: the patches apply there, and only a task that
    # leaves the thread pool lets the next one start
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        futures = [client.submit(stages.collect, async_cfg, 0, i, params, 0, i * 256, pure=False)
                   for i in range(n)]
        results = client.gather(futures)
    stages.forget_run(async_cfg["run_dir"])
    stages.forget_run(sync_cfg["run_dir"])

    assert overlapped == [True] * (n - 1), "a region's write did not overlap the next rollout"
    assert [r["region"] for r in results] == list(range(n))
    a = ReplayStore.open(os.path.join(async_cfg["run_dir"], "replay"))
    s = ReplayStore.open(os.path.join(sync_cfg["run_dir"], "replay"))
    assert [r for r, _ in a.committed()] == list(range(n)) == [r for r, _ in s.committed()]
    assert sorted(r for p, r in commits if "async" in p) == list(range(n))  # each exactly once
    assert a.total_regions_committed() == n
    for r in range(n):
        got, want = a.read_region(r), s.read_region(r)
        for name in a.fields:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} of region {r}")
    names = [*a.fields, "region", "iteration", "collector", "param_version", "commit"]
    assert chunk_files(a.path, names) == chunk_files(s.path, names)  # byte for byte


def test_a_retried_write_rewrites_the_same_bytes_after_the_envs_moved_on(tmp_path):
    faulty, clean = tiny_config(tmp_path / "faulty", fail_regions_once="1"), tiny_config(tmp_path / "clean")
    for cfg in (faulty, clean):
        stages.prepare_run(cfg)
    params = stages.policy_params(clean)
    for i in range(3):
        stages.collect(clean, 0, i, params, 0, i * 256)
    stages.collect(faulty, 0, 0, params, 0, 0)
    rolled = stages.rollout(faulty, 0, 1, params, 0, 256)
    with pytest.raises(RuntimeError, match="injected fault after committing region 1"):
        stages.write(faulty, rolled)
    path = os.path.join(faulty["run_dir"], "replay")
    first_attempt = chunk_files(path, FIELD_NAMES)
    # the next region rolls out and is stored before the retry (as a K >= 1 dataflow may schedule it)
    stages.collect(faulty, 0, 2, params, 0, 512)
    stages.write(faulty, rolled)  # the retry (Dask's: the same task, the same rollout's arrays)
    after_retry = chunk_files(path, FIELD_NAMES)
    assert {k: v for k, v in after_retry.items() if k in first_attempt} == first_attempt
    want = chunk_files(os.path.join(clean["run_dir"], "replay"), FIELD_NAMES)
    assert after_retry == want  # regions 0-2 as an unfaulted run wrote them
    for cfg in (faulty, clean):
        stages.forget_run(cfg["run_dir"])


FIELD_NAMES = ("obs", "state", "action", "reward", "first", "terminated", "truncated", "avail_actions")


# ------------------------------------------------------------ crash between write and commit

_KILL_BEFORE_COMMIT = """
import os, signal, sys
sys.path[:0] = [{root!r}, {tests!r}]
from storage import ReplayStore
from test_storage import write
store = ReplayStore.open({path!r}, mode="r+", durable={durable})
ReplayStore._commit = lambda self, *args: os.kill(os.getpid(), signal.SIGKILL)
write(store, {region})
"""


@pytest.mark.parametrize("durable", [True, False])
@pytest.mark.parametrize("region", [3, 2], ids=["overwriting a committed slot", "into a fresh slot"])
def test_a_writer_killed_before_its_commit_leaves_nothing_visible(tmp_path, region, durable):
    path = str(tmp_path / "r")
    store = make_store(path, n_slots=3)
    write(store, 0)
    write(store, 1)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = _KILL_BEFORE_COMMIT.format(root=root, tests=os.path.join(root, "tests"), path=path,
                                        durable=durable, region=region)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr

    store = ReplayStore.open(path, mode="r+")
    slot = store.slot_of(region)
    # the region's data reached the store (the kill came after the write) ...
    import zarr

    raw = zarr.open_array(os.path.join(path, "obs"), mode="r")[slot * T:(slot + 1) * T]
    np.testing.assert_array_equal(raw, region_data(region)["obs"])
    # ... yet neither it nor what its slot held before is readable
    want = [(r, store.slot_of(r)) for r in (0, 1) if store.slot_of(r) != slot]
    assert store.committed() == want
    for gone in [region, *(r for r in (0, 1) if store.slot_of(r) == slot)]:
        with pytest.raises(StoreError, match="not committed"):
            store.read_region(gone)
    assert sorted(set(open_replay(path).region.values.tolist())) == [r for r, _ in want]
    assert store.total_regions_committed() == 2
    # a retry of the killed task commits it whole
    write(store, region)
    assert (region, slot) in store.committed()
    for name, arr in store.read_region(region).items():
        np.testing.assert_array_equal(arr, region_data(region)[name])


# ------------------------------------------------------------ layout


def test_large_fields_are_split_into_whole_chunks_along_the_step_axis(tmp_path):
    obs = FIELDS["obs"]  # 2 envs x 3 x 5 float32 = 120 bytes per step
    assert steps_per_chunk(T, N_ENVS, obs, chunk_bytes=10**9) == T
    assert steps_per_chunk(T, N_ENVS, obs, chunk_bytes=2 * 120) == 2
    assert steps_per_chunk(T, N_ENVS, obs, chunk_bytes=3 * 120) == 2  # a divisor of T
    assert steps_per_chunk(T, N_ENVS, obs, chunk_bytes=1) == 1
    with pytest.raises(StoreError, match="chunk_bytes must be a positive int"):
        ReplayStore.create(tmp_path / "bad", fields=FIELDS, n_envs=N_ENVS, steps_per_region=T,
                           n_slots=2, attrs={}, chunk_bytes=0)

    split = ReplayStore.create(tmp_path / "split", fields=FIELDS, n_envs=N_ENVS, steps_per_region=T,
                               n_slots=3, attrs={}, chunk_bytes=2 * 120)
    whole = ReplayStore.create(tmp_path / "whole", fields=FIELDS, n_envs=N_ENVS, steps_per_region=T,
                               n_slots=3, attrs={}, chunk_bytes=10**9, durable=False)
    assert split._arrays["obs"].chunks == (2, N_ENVS, 3, 5) and split._arrays["first"].chunks == (T, N_ENVS)
    assert whole._arrays["obs"].chunks == (T, N_ENVS, 3, 5)
    for store in (split, whole):
        for r in range(4):
            write(store, r)
    for path in (tmp_path / "split", tmp_path / "whole"):
        store = ReplayStore.open(path)
        assert store.committed() == [(1, 1), (2, 2), (3, 0)]
        for r in (1, 2, 3):
            for name, arr in store.read_region(r).items():
                np.testing.assert_array_equal(arr, region_data(r)[name], err_msg=name)
    # every chunk of a committed region is on disk, also one equal to the fill value
    assert os.path.isfile(tmp_path / "split" / "truncated" / "c" / "1" / "0")
    np.testing.assert_array_equal(open_replay(tmp_path / "split").obs.values,
                                  open_replay(tmp_path / "whole").obs.values)
