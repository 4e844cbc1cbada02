"""Replay integrity (issue 17, item 3): damaged replay is found, named in one line, never
trained on, and can be dropped from the commit log so a run goes on.

One test per damage kind on a real store on disk (flipped bytes in a chunk, a truncated
chunk, a missing chunk, a missing array, damaged array metadata, damaged group metadata, a
damaged commit log): `marl replay verify`, `info` and `episodes`, each a real subprocess,
answer in one line (non-zero exit, no traceback, at most 2 lines on stderr) and leave the
store byte for byte as it was; `verify --drop-damaged` changes only the commit log (or
remakes the lost array) and the store then verifies clean. Also: a writer SIGKILLed mid-region
never leaves a half-written region committed; stores written before checksums still read;
and a resumed `marl train` on a damaged run dir stops with the one line, then resumes once
the damage is dropped.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
import os
import random
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from storage import ReplayDamaged, ReplayStore, StoreError, open_replay
from storage.replay import Field
from test_bad_input import TINY, run_dir, tree_digest  # noqa: F401  (run_dir: a tiny real run)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
T, N, N_SLOTS = 4, 2, 4
FIELDS = {"obs": Field((2, 3), "float32", ("agent", "obs_dim")), "reward": Field((2,), "float32", ("agent",)),
          "first": Field((), "bool", ()), "terminated": Field((), "bool", ()),
          "truncated": Field((), "bool", ()), "won": Field((), "bool", ())}
FIX = "--drop-damaged"


def region_data(r: int, t: int = T, n: int = N) -> dict:
    """Values that encode (region, step, env); odd regions end an episode at step 2."""
    code = (r * 100 + np.arange(t)[:, None] * 10 + np.arange(n)[None, :]).astype("float32")
    end = np.zeros((t, n), bool)
    if r % 2:
        end[2] = True
    first = np.zeros((t, n), bool)
    first[1:] = end[:-1]
    return {"obs": np.broadcast_to(code[..., None, None], (t, n, 2, 3)) + np.arange(3, dtype="float32"),
            "reward": np.broadcast_to(code[..., None], (t, n, 2)).copy(), "first": first,
            "terminated": end, "truncated": np.zeros((t, n), bool), "won": end}


def write(store: ReplayStore, r: int) -> int:
    return store.write_region(r, region_data(r), iteration=r // 2, collector=r % 2, param_version=r // 2)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    """Regions 1-4 committed in 4 slots (region 0 overwritten by the ring), 2 trained."""
    path = str(tmp_path_factory.mktemp("pristine") / "replay")
    store = ReplayStore.create(path, fields=FIELDS, n_envs=N, steps_per_region=T, n_slots=N_SLOTS,
                               attrs={"env_id": "test"})
    for r in range(5):
        write(store, r)
    store.mark_trained(2, 1)
    return path


def flip(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x5A
    open(path, "wb").write(bytes(data))


def truncate(path: str) -> None:
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


# kind -> (damage it (store path ->), what verify names, what --drop-damaged changes: the
# regions dropped, or None where the lost array is remade and every region dropped;
# "group" where nothing can be repaired)
KINDS = {
    "flipped-bytes": (lambda p: flip(f"{p}/reward/c/2/0/0"), "reward/c/2/0/0 fails its crc32c checksum", [2]),
    "truncated-chunk": (lambda p: truncate(f"{p}/obs/c/3/0/0/0"), "obs/c/3/0/0/0 fails its crc32c checksum", [3]),
    # region 4 ends no episode: its terminated chunk equals the fill value, yet missing is damage
    "missing-chunk": (lambda p: os.remove(f"{p}/terminated/c/0/0"), "terminated/c/0/0 is missing", [4]),
    "missing-array": (lambda p: shutil.rmtree(f"{p}/won"), "array 'won' is missing", None),
    "bad-array-metadata": (lambda p: truncate(f"{p}/reward/zarr.json"), "reward/zarr.json is damaged", None),
    "bad-group-metadata": (lambda p: flip(f"{p}/zarr.json"), "replay/zarr.json is damaged", "group"),
    "damaged-commit-log": (lambda p: flip(f"{p}/commit/c/1"), "commit/c/1 fails its crc32c checksum", [1]),
}


def marl(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@dataclasses.dataclass
class Answer:
    returncode: int
    stdout: str
    stderr: str


def cli(*args: str) -> Answer:
    """`marl ARGS` in this process (its main(), as `python -m flows.cli` runs it): a
    subprocess per call would cost a second of imports each; test_real_processes_answer_alike
    runs the same commands as real processes."""
    from flows.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code
    return Answer(int(code or 0), out.getvalue(), err.getvalue())


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def answers(pristine, tmp_path_factory):
    """Per damage kind: a damaged copy of the store, its digest, the answers of verify, info
    and episodes, the digest after them, then verify --drop-damaged and a second verify."""
    out = {}
    for kind, (damage, _, _) in KINDS.items():
        path = str(tmp_path_factory.mktemp(kind) / "replay")
        shutil.copytree(pristine, path)
        damage(path)
        before = tree_digest(path)
        got = {cmd: cli("replay", cmd, path) for cmd in ("verify", "info", "episodes")}
        after = tree_digest(path)
        dropped = cli("replay", "verify", path, FIX)
        out[kind] = dict(path=path, before=before, after=after, got=got, dropped=dropped,
                         dropped_digest=tree_digest(path), reverify=cli("replay", "verify", path),
                         info=cli("replay", "info", path))
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_damage_is_one_line_from_verify_info_and_episodes(kind, answers):
    _, names, _ = KINDS[kind]
    a = answers[kind]
    for cmd, proc in a["got"].items():
        output = proc.stdout + proc.stderr
        assert proc.returncode == 1, f"replay {cmd}: {output}"
        assert "Traceback" not in output, f"replay {cmd}: {output}"
        errors = lines(proc.stderr)
        assert len(errors) == 1, f"replay {cmd}: {proc.stderr}"
        fix = "restore the file from a backup" if kind == "bad-group-metadata" else "marl replay verify"
        assert fix in errors[0], errors[0]
        if cmd != "verify" or kind in ("missing-array", "bad-array-metadata", "bad-group-metadata"):
            assert names in errors[0], f"replay {cmd}: {errors[0]}"
            assert not proc.stdout.strip(), f"replay {cmd} printed more: {proc.stdout}"
    verify = a["got"]["verify"]
    if kind not in ("missing-array", "bad-array-metadata", "bad-group-metadata"):
        damaged = lines(verify.stdout)  # one line per damaged array, naming it and its regions
        assert len(damaged) == 1 and names in damaged[0], verify.stdout
        assert "1 of 4 committed regions damaged" in verify.stderr, verify.stderr
    assert a["after"] == a["before"], "a read-only command changed the store"


@pytest.mark.parametrize("kind", list(KINDS))
def test_drop_damaged_changes_only_the_commit_log_and_the_store_verifies_clean(kind, answers):
    _, names, dropped = KINDS[kind]
    a = answers[kind]
    proc, output = a["dropped"], a["dropped"].stdout + a["dropped"].stderr
    assert "Traceback" not in output, output
    if dropped == "group":  # the group's attributes are the store's schema: nothing to remake
        assert proc.returncode == 1 and len(lines(proc.stderr)) == 1 and names in proc.stderr, output
        assert a["dropped_digest"] == a["before"]
        return
    assert proc.returncode == 0, output
    changed = {k for k in set(a["before"]) | set(a["dropped_digest"])
               if a["before"].get(k) != a["dropped_digest"].get(k)}
    if dropped is None:  # the lost array is remade empty, every region uncommitted
        array = names.split("'")[1] if "'" in names else names.split("/")[0]
        assert f"{array}: array metadata missing or damaged; remade empty" in proc.stdout, output
        assert all(k.split(os.sep)[0] in (array, "commit", "trained_version") for k in changed), changed
        assert "0 committed regions" in a["reverify"].stdout
    else:
        slots = [r % N_SLOTS for r in dropped]
        assert f"dropped {len(dropped)} damaged region(s) ({', '.join(map(str, dropped))})" in proc.stdout, output
        # the slots' commit entries (and their trained marks, where one was set)
        assert {os.path.join("commit", "c", str(s)) for s in slots} <= changed <= {
            os.path.join(array, "c", str(s)) for s in slots for array in ("commit", "trained_version")}, changed
        assert f"{4 - len(dropped)} committed regions" in a["reverify"].stdout
        store = ReplayStore.open(a["path"])
        assert [r for r, _ in store.committed()] == [r for r in range(1, 5) if r not in dropped]
        for r, _ in store.committed():  # what is left reads back exactly
            for name, value in store.read_region(r).items():
                np.testing.assert_array_equal(value, region_data(r)[name])
    assert a["reverify"].returncode == 0 and len(lines(a["reverify"].stdout)) == 1, a["reverify"].stdout
    assert "no damage" in a["reverify"].stdout
    assert a["info"].returncode == 0, a["info"].stderr


def test_real_processes_answer_alike(pristine, tmp_path):
    """The same commands as real `python -m flows.cli` processes: one line, exit 1, no
    traceback, nothing written; the damage of one kind per command (in parallel)."""
    cases = {"verify": "damaged-commit-log", "info": "missing-chunk", "episodes": "flipped-bytes"}

    def run(cmd):
        path = str(tmp_path / cmd / "replay")
        shutil.copytree(pristine, path)
        KINDS[cases[cmd]][0](path)
        before = tree_digest(path)
        return cmd, marl("replay", cmd, path), before == tree_digest(path)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        for cmd, proc, unchanged in pool.map(run, cases):
            output = proc.stdout + proc.stderr
            assert proc.returncode == 1 and "Traceback" not in output and unchanged, output
            assert len(lines(proc.stderr)) == 1 and KINDS[cases[cmd]][1] in output, output


@pytest.mark.parametrize("kind", ["flipped-bytes", "truncated-chunk", "missing-chunk", "damaged-commit-log"])
def test_every_read_path_refuses_damage(kind, pristine, tmp_path):
    """Read_region (the learner, reanalysis), sampling, committed() and open_replay (xarray)
    raise ReplayDamaged; none returns the fill value or skips the region silently."""
    damage, names, (region,) = KINDS[kind]
    path = str(tmp_path / "replay")
    shutil.copytree(pristine, path)
    damage(path)
    store = ReplayStore.open(path)
    calls = [lambda: store.read_region(region), lambda: open_replay(path).load(),
             lambda: store.sample_sequences(np.random.default_rng(0), 64, 2),
             lambda: store.sample_episodes(np.random.default_rng(0), 8)]
    for call in calls:
        with pytest.raises(ReplayDamaged, match=names):
            call()
    writer = ReplayStore.open(path, mode="r+")
    with pytest.raises(StoreError):  # never a silent fill, never a write over damage
        write(writer, region + N_SLOTS) if kind == "damaged-commit-log" else writer.read_region(region)


# ------------------------------------------------------------ a writer killed mid-region

_WRITER = """
import os, signal, sys
sys.path[:0] = [{root!r}, {tests!r}]
import storage.replay as replay
from test_replay_integrity import region_data
store = replay.ReplayStore.open({path!r}, mode="r+")
kill_after, puts = {kill_after}, []
if kill_after:  # SIGKILL itself once that many files of the region are on disk
    put = replay._put_durable
    def counting(path, data):
        put(path, data)
        puts.append(path)
        if len(puts) == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    replay._put_durable = counting
for r in range({start}, 10**6):
    print("begin", r, flush=True)
    store.write_region(r, region_data(r, {t}, {n}), iteration=r, collector=0, param_version=r)
    print("end", r, flush=True)
"""


def _writer(path: str, start: int, kill_after: int = 0) -> subprocess.Popen:
    script = _WRITER.format(root=ROOT, tests=os.path.join(ROOT, "tests"), path=path, start=start,
                            kill_after=kill_after, t=16, n=4)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)


def _check_after_kill(path: str, in_flight: int) -> list[int]:
    """Nothing half-written is committed: every committed region reads back exactly and
    verifies clean; returns the committed region ids."""
    store = ReplayStore.open(path)
    assert store.verify()[0] == []
    committed = [r for r, _ in store.committed()]
    for r in committed:
        for name, value in store.read_region(r).items():
            np.testing.assert_array_equal(value, region_data(r, 16, 4)[name], err_msg=f"region {r} {name}")
    proc = cli("replay", "verify", path)
    assert proc.returncode == 0 and "no damage" in proc.stdout, proc.stdout + proc.stderr
    return committed


def test_a_writer_killed_mid_region_never_leaves_it_committed(tmp_path):
    path = str(tmp_path / "replay")
    # obs chunks of 4 steps, reward of 8: a region is 14 data files, so a kill can land between them
    store = ReplayStore.create(path, fields=FIELDS, n_envs=4, steps_per_region=16, n_slots=3, attrs={},
                               chunk_bytes=4 * 4 * 2 * 3 * 4)
    assert len([k for name in store._arrays for k in store._chunk_keys(name, 0)]) == 14 + 2
    for r in range(3):
        store.write_region(r, region_data(r, 16, 4), iteration=r, collector=0, param_version=r)
    # killed by itself after k files of region 3 (slot 0, which holds region 0): the first 2
    # reset its commit and trained mark, the next 14 are its data (in any order), then the commit
    base = str(tmp_path / "base")
    shutil.copytree(path, base)
    for kill_after in (3, 9, 16):
        shutil.rmtree(path)
        shutil.copytree(base, path)
        proc = _writer(path, 3, kill_after)
        proc.wait(timeout=120)
        assert proc.returncode == -signal.SIGKILL
        assert "end 3" not in proc.stdout.read()
        before, after = tree_digest(base), tree_digest(path)
        written = [k for k in after if k.split(os.sep)[0] not in ("commit", "trained_version", "commits")
                   and before.get(k) != after[k] and not k.endswith(".partial")]
        # region 3's data files on disk (those equal to region 0's bytes do not show): the
        # first kill lands mid-region (its writes run on a few threads: a few more may land)
        assert 0 < len(written) and (kill_after > 3 or len(written) < 12), written
        assert _check_after_kill(path, 3) == [1, 2]  # slot 0 holds neither region 0 nor 3
    # killed from outside at random moments while writing region after region
    rng, start = random.Random(0), 3
    for _ in range(3):
        proc = _writer(path, start)
        lines = []
        for line in proc.stdout:
            lines.append(line.split())
            if lines[-1][0] == "begin" and int(lines[-1][1]) >= start + 2:
                break
        time_in = rng.uniform(0, 0.05)
        import time

        time.sleep(time_in)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        lines += [line.split() for line in proc.stdout.read().splitlines()]  # up to the kill
        ended = max(int(r) for what, r in lines if what == "end")
        begun = max(int(r) for what, r in lines if what == "begin")
        committed = _check_after_kill(path, begun)
        # the last region the writer finished was whole and stays so (the writer may have
        # run several regions past the line the test waited for before the kill landed)
        assert ended in committed and max(committed) <= begun
        start = max(committed) + 1  # a restarted collector goes on after the last commit


# ------------------------------------------------------------ stores written before checksums


@pytest.mark.parametrize("recorded", [True, False], ids=["chunk-bytes-recorded", "store-made-before"])
def test_a_remade_array_gets_the_chunks_and_codecs_the_store_was_made_with(recorded, tmp_path):
    """A store made with its own chunk budget and codec: an array whose metadata is lost is
    remade with the chunks it had (not the default CHUNK_BYTES'), read from the group's
    chunk_bytes, or in a store made before that was recorded, from its intact fields'
    chunks; its compressors are the other fields'. The store then takes regions again."""
    import zarr

    path = str(tmp_path / "replay")
    budget = 4 * 4 * 2 * 3 * 4  # obs chunks of 4 steps, reward of 8, flags whole regions of 16
    codecs = (zarr.codecs.BloscCodec(cname="lz4", clevel=1),)
    store = ReplayStore.create(path, fields=FIELDS, n_envs=4, steps_per_region=16, n_slots=2, attrs={},
                               chunk_bytes=budget, compressors=codecs)
    made = {name: (tuple(a.chunks), a.compressors) for name, a in store._arrays.items()}
    assert made["obs"][0] == (4, 4, 2, 3) and made["reward"][0] == (8, 4, 2)
    store.write_region(0, region_data(0, 16, 4), iteration=0, collector=0, param_version=0)
    lost = "obs" if recorded else "reward"  # a store made before can tell reward's chunks from obs's
    if not recorded:
        group = zarr.open_group(path, mode="r+")
        del group.attrs["chunk_bytes"]
    os.remove(f"{path}/{lost}/zarr.json")
    with pytest.raises(ReplayDamaged, match=f"array '{lost}' is missing"):
        ReplayStore.open(path)
    assert ReplayStore.remake_damaged_arrays(path) == [lost]
    store = ReplayStore.open(path, mode="r+")
    assert {name: (tuple(a.chunks), a.compressors) for name, a in store._arrays.items()} == made
    assert store.committed() == []  # remade empty: every region dropped
    store.write_region(1, region_data(1, 16, 4), iteration=1, collector=0, param_version=1)
    np.testing.assert_array_equal(store.read_region(1)[lost], region_data(1, 16, 4)[lost])
    assert store.verify()[0] == []


@pytest.mark.parametrize("name", ["replay-before-every-chunk", "replay-before-checksums"])
def test_stores_written_before_checksums_still_read(name, tmp_path):
    """Stores made by earlier code (tests/data/README.md): their arrays' metadata name their
    codecs (no crc32c), and a chunk equal to the fill value may be absent (before every chunk
    was written). They read, verify and take new regions as before."""
    path = str(tmp_path / name)
    shutil.copytree(os.path.join(DATA, name), path)
    store = ReplayStore.open(path)
    assert [r for r, _ in store.committed()] == [1, 2, 3]
    old = {"reward", "terminated", "truncated", "first", "won"}
    for r in (1, 2, 3):
        got = store.read_region(r)
        want = region_data(r)
        for field in old:
            np.testing.assert_array_equal(got[field], want[field], err_msg=f"{name} region {r} {field}")
    assert store.trained_versions() == {2: 1}
    for cmd in ("verify", "info", "episodes"):
        proc = cli("replay", cmd, path)
        assert proc.returncode == 0 and not proc.stderr.strip(), proc.stdout + proc.stderr
    assert "a store made before checksums" in cli("replay", "verify", path).stdout
    writer = ReplayStore.open(path, mode="r+")
    writer.write_region(4, {k: v for k, v in region_data(4).items() if k in old}, iteration=2,
                        collector=0, param_version=2)
    assert [r for r, _ in writer.committed()] == [2, 3, 4]
    assert writer.verify()[0] == []


# ------------------------------------------------------------ a resumed run on damaged replay


def test_a_resumed_run_stops_on_damage_in_one_line_and_goes_on_once_it_is_dropped(run_dir, tmp_path):
    """The tiny run (regions 0 and 1 committed, checkpoint 1) resumed with region 0's reward
    chunk damaged: the learner stops with the one line naming the fix; after `verify
    --drop-damaged` the run resumes from its checkpoint without region 0."""
    run = str(tmp_path / "run")
    shutil.copytree(run_dir, run)
    store = ReplayStore.open(os.path.join(run, "replay"))
    keys = store._chunk_keys("reward", store.slot_of(0))
    flip(os.path.join(run, "replay", keys[0]))
    args = ("train", TINY, "--run-dir", run, "--env-steps", "1024", "--workers", "1")
    proc = marl(*args)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in output, output
    errors = lines(proc.stderr)
    assert len(errors) <= 2 and f"marl replay verify {os.path.join(run, 'replay')} --drop-damaged" in errors[-1], output
    assert f"region 0 (ring slot 0): chunk {keys[0]} fails its crc32c checksum" in errors[-1], output

    fixed = marl("replay", "verify", run, FIX)
    assert fixed.returncode == 0 and "dropped 1 damaged region(s) (0)" in fixed.stdout, fixed.stdout + fixed.stderr
    # the same resume, its stages as plain functions (a second `marl train` costs a minute)
    from pipelines import stages
    from pipelines.config import make_run_config

    cfg = make_run_config(TINY, run_dir=run, total_env_steps=1024).to_dict()
    start = stages.prepare_run(cfg)
    assert start["iteration"] == 1
    params = stages.policy_params(cfg)
    collected = [stages.collect(cfg, c, 1, params, 1, start["env_steps"]) for c in range(2)]
    stages.train(cfg, 1, 1024, True, collected)
    stages.forget_run(run)
    store = ReplayStore.open(os.path.join(run, "replay"))
    assert [r for r, _ in store.committed()] == [1, 2, 3]
    assert sorted(store.trained_versions()) == [1, 2, 3]  # region 0 never trained on again
    assert cli("replay", "verify", run).returncode == 0


# ------------------------------------------------------------ derived groups (reanalysis outputs)

DERIVED_KINDS = {  # kind -> (damage it (group path ->), what the one line names)
    "flipped-bytes": (lambda p: flip(f"{p}/score/c/1/0/0"), "score/c/1/0/0 fails its crc32c checksum"),
    "truncated-chunk": (lambda p: truncate(f"{p}/score/c/2/0/0"), "score/c/2/0/0 fails its crc32c checksum"),
    # block 3's flag chunk is all False, the fill value: still every chunk is on disk
    "missing-chunk": (lambda p: os.remove(f"{p}/flag/c/3/0"), "flag/c/3/0 is missing"),
    "damaged-coordinates": (lambda p: flip(f"{p}/region/c/0"), "region/c/0 fails its crc32c checksum"),
    "damaged-written-mark": (lambda p: flip(f"{p}/written/c/2"), "written/c/2 fails its crc32c checksum"),
    "missing-array": (lambda p: shutil.rmtree(f"{p}/flag"), "array 'flag' is missing"),
    "bad-array-metadata": (lambda p: truncate(f"{p}/score/zarr.json"), "score/zarr.json is damaged"),
}


@pytest.fixture(scope="module")
def derived(pristine, tmp_path_factory) -> str:
    """A derived group over the pristine store's regions 1-4, every block written."""
    from storage.derived import DerivedGroup

    path = str(tmp_path_factory.mktemp("derived") / "reanalysis")
    group = DerivedGroup.create(path, ReplayStore.open(pristine),
                                {"score": Field((2,), "float32", ("agent",)), "flag": Field((), "bool", ())},
                                {"checkpoint_step": 1}, kind="reanalysis")
    for r in group.regions:
        group.write_block(r, {"score": region_data(r)["reward"] + 0.5,
                              "flag": np.full((T, N), r % 2 == 1) & (r != 3)})
    return path


def test_derived_groups_carry_checksums_and_verify_clean(derived):
    import json

    from storage.derived import open_derived

    got = cli("replay", "verify", derived)
    assert got.returncode == 0 and lines(got.stdout) == [
        f"derived group at {derived}: 4 written blocks, 28 chunks checked, no damage"], got.stdout + got.stderr
    for name in ("score", "flag", "region", "written"):  # zstd, then crc32c
        with open(os.path.join(derived, name, "zarr.json")) as f:
            assert [c["name"] for c in json.load(f)["codecs"]][-2:] == ["zstd", "crc32c"]
    assert sorted(os.listdir(os.path.join(derived, "flag", "c"))) == ["0", "1", "2", "3"]  # fill chunks too
    ds = open_derived(derived)
    np.testing.assert_array_equal(ds.score.values[:T], region_data(1)["reward"] + 0.5)
    assert cli("replay", "info", derived).returncode == 0


@pytest.mark.parametrize("kind", list(DERIVED_KINDS))
def test_a_damaged_derived_group_is_one_line_from_verify_info_and_reads(kind, derived, tmp_path):
    """verify and info answer in one line naming the file and the fix (exit 1, nothing on
    stdout but verify's per-array line, the group byte for byte as it was); open_derived
    raises ReplayDamaged, never the fill value."""
    from storage.derived import open_derived

    damage, names = DERIVED_KINDS[kind]
    path = str(tmp_path / "reanalysis")
    shutil.copytree(derived, path)
    damage(path)
    before = tree_digest(path)
    for cmd in ("verify", "info"):
        got = cli("replay", cmd, path)
        output = got.stdout + got.stderr
        assert got.returncode == 1 and "Traceback" not in output, f"{cmd}: {output}"
        errors = lines(got.stderr)
        assert len(errors) == 1 and f"remove {path} and run the reanalysis again" in errors[0], f"{cmd}: {output}"
        if cmd == "verify" and kind not in ("missing-array", "bad-array-metadata"):
            assert len(lines(got.stdout)) == 1 and names in got.stdout, got.stdout  # the damaged array
        else:
            assert names in errors[0] and not got.stdout.strip(), f"{cmd}: {output}"
    with pytest.raises(ReplayDamaged):
        open_derived(path).load()
    assert tree_digest(path) == before


def test_reanalysis_of_a_damaged_store_stops_in_one_line_and_writes_nothing_partial(run_dir, tmp_path):
    """`marl replay reanalyze` on a run dir whose region 1 is damaged: exit 1, the one
    ReplayDamaged line with the fix, no output group, the run dir byte for byte as it was.
    Damage that appears after the output group was made (the stage's plain functions): the
    damaged region's score stops with ReplayDamaged, its block is never marked written, and
    the group shows (and verifies) only the complete blocks."""
    from pipelines import reanalyze
    from storage.derived import DerivedGroup, open_derived

    run = str(tmp_path / "run")
    shutil.copytree(run_dir, run)
    store = ReplayStore.open(os.path.join(run, "replay"))
    key = store._chunk_keys("obs", store.slot_of(1))[0]
    clean = str(tmp_path / "clean")
    shutil.copytree(run, clean)
    flip(os.path.join(run, "replay", key))
    before = tree_digest(run)
    got = cli("replay", "reanalyze", run)
    output = got.stdout + got.stderr
    assert got.returncode == 1 and "Traceback" not in output and not got.stdout.strip(), output
    assert len(lines(got.stderr)) == 1 and f"first {key} fails its crc32c checksum" in got.stderr, output
    assert f"marl replay verify {os.path.join(run, 'replay')} --drop-damaged" in got.stderr, output
    assert tree_digest(run) == before and not os.path.exists(os.path.join(run, "reanalysis"))

    job = reanalyze.prepare(reanalyze.plan(run_dir=clean))
    flip(os.path.join(clean, "replay", key))  # damaged after the group was made
    assert reanalyze.score_region(job, 0)["written"]
    with pytest.raises(ReplayDamaged, match=f"chunk {key} fails its crc32c"):
        reanalyze.score_region(job, 1)
    reanalyze.clear_caches()
    group = DerivedGroup.open(job["out"])
    assert group.regions == [0, 1] and group.written() == [0]
    assert group.check()["blocks"] == 1
    assert sorted(set(open_derived(job["out"]).region.values.tolist())) == [0]


# ------------------------------------------------------------ a full disk, a read-only run dir (item 4)


@contextlib.contextmanager
def _tmpfs(where, size: str):
    """A real tmpfs of `size` mounted on the directory `where` while in the block (needs root:
    mount); the test is skipped where it cannot be made."""
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture
def tiny_fs(tmp_path):
    """A real 1 MiB tmpfs (needs root: mount); skipped where it cannot be made."""
    where = tmp_path / "fs"
    where.mkdir()
    with _tmpfs(where, "1m"):
        yield where


def test_a_full_or_read_only_disk_stops_writes_in_one_line_and_keeps_what_is_committed(tiny_fs):
    path = str(tiny_fs / "replay")
    store = ReplayStore.create(path, fields=FIELDS, n_envs=64, steps_per_region=16, n_slots=64, attrs={})
    rng = np.random.default_rng(0)
    big = lambda r: {**region_data(r, 16, 64), "obs": rng.random((16, 64, 2, 3), dtype="float32")}  # noqa: E731
    written = {}
    with pytest.raises(StoreError) as full:
        for r in range(64):  # random obs do not compress: 1 MiB fills within a few dozen regions
            written[r] = big(r)
            store.write_region(r, written[r], iteration=r, collector=0, param_version=r)
    message = str(full.value)
    assert "No space left on device" in message and "\n" not in message and "resume" in message, message
    committed = [r for r, _ in ReplayStore.open(path).committed()]
    assert committed == list(range(len(written) - 1)) and len(committed) > 2
    reader = ReplayStore.open(path)
    assert reader.verify()[0] == []
    for r in committed:
        np.testing.assert_array_equal(reader.read_region(r)["obs"], written[r]["obs"])
    # read-only (as root, chmod would not stop a write): refused in one line, nothing changes
    subprocess.run(["mount", "-o", "remount,ro,size=8m", str(tiny_fs)], check=True)
    with pytest.raises(StoreError, match="Read-only file system"):
        store.write_region(committed[0] + 64, written[0], iteration=99, collector=0, param_version=99)
    assert [r for r, _ in ReplayStore.open(path).committed()] == committed
    # space again: the next start goes on with the region that failed
    subprocess.run(["mount", "-o", "remount,rw,size=8m", str(tiny_fs)], check=True)
    failed = len(written) - 1
    ReplayStore.open(path, mode="r+").write_region(failed, written[failed], iteration=failed, collector=0,
                                                   param_version=failed)
    assert [r for r, _ in ReplayStore.open(path).committed()] == [*committed, failed]
    assert ReplayStore.open(path).verify()[0] == []


def test_a_checkpoint_write_on_a_full_or_read_only_disk_is_one_line_and_keeps_the_last_one(tiny_fs):
    """Checkpointer.save on a real tmpfs, full and then read-only (both checked before orbax
    writes: its own errors are screens of tensorstore spec, and on a read-only disk its
    threads wait minutes for the step directory): StoreError naming the errno and the fix,
    the previous checkpoint restores; with space again the save goes on."""
    from storage import Checkpointer

    directory = str(tiny_fs / "checkpoints")
    subprocess.run(["mount", "-o", "remount,size=8m", str(tiny_fs)], check=True)
    state = {"w": np.arange(50_000, dtype="float32"), "step": np.ones(1, "int64")}
    with Checkpointer(directory) as checkpoints:
        checkpoints.save(1, state, {"iteration": 1})
    subprocess.run(["mount", "-o", "remount,size=1m", str(tiny_fs)], check=True)  # 200 KB of state: 1 MiB is full
    with Checkpointer(directory) as checkpoints, pytest.raises(StoreError) as full:
        checkpoints.save(2, {**state, "w": state["w"] + 1}, {"iteration": 2})
    subprocess.run(["mount", "-o", "remount,ro,size=8m", str(tiny_fs)], check=True)
    with Checkpointer(directory) as checkpoints, pytest.raises(StoreError) as read_only:
        checkpoints.save(2, {**state, "w": state["w"] + 1}, {"iteration": 2})
    for error, says in ((full, "No space left on device (ENOSPC"), (read_only, "Read-only file system (EROFS)")):
        message = str(error.value)
        assert says in message and "\n" not in message and len(message) < 300, message
        assert "checkpoint 1 is intact" in message and "run the same command to resume" in message, message
    subprocess.run(["mount", "-o", "remount,rw,size=8m", str(tiny_fs)], check=True)
    with Checkpointer(directory) as checkpoints:
        assert checkpoints.all_steps() == [1]
        restored, meta = checkpoints.restore(1, target=state)
        np.testing.assert_array_equal(restored["w"], state["w"]) and meta == {"iteration": 1}
        checkpoints.save(2, {**state, "w": state["w"] + 1}, {"iteration": 2})
        assert checkpoints.all_steps() == [1, 2]


@pytest.fixture
def full_checkpoints(run_dir, tmp_path):
    """A copy of the tiny run (regions 0 and 1, checkpoint 1) whose checkpoints/ is a real
    tmpfs with one checkpoint on it and 8 KiB free (needs root: mount); skipped where it
    cannot be made."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    saved = tmp_path / "saved"
    shutil.move(run / "checkpoints", saved)
    where = run / "checkpoints"
    where.mkdir()
    with _tmpfs(where, "16m"):
        shutil.copytree(saved, where, dirs_exist_ok=True)
        st = os.statvfs(where)
        used_kib = (st.f_blocks - st.f_bfree) * st.f_frsize // 1024
        subprocess.run(["mount", "-o", f"remount,size={used_kib + 8}k", str(where)], check=True)
        yield run


def test_a_checkpoint_write_on_a_full_disk_stops_marl_train_in_one_line_and_the_same_command_resumes(
        full_checkpoints):
    """A real `marl train` resuming the tiny run collects and trains iteration 1, then its
    checkpoint write fails for lack of space: one line naming it, non-zero exit, no
    traceback; checkpoint 1 still restores and the committed replay verifies clean. With
    space back, the same command resumes from checkpoint 1 and finishes the run."""
    from storage import Checkpointer

    run = str(full_checkpoints)
    cmd = [sys.executable, "-m", "flows.cli", "train", TINY, "--run-dir", run, "--env-steps", "1024",
           "--workers", "1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in output, output
    errors = lines(proc.stderr)
    assert len(errors) <= 2 and "No space left on device" in errors[-1], output
    assert "checkpoint 1 is intact" in errors[-1] and "run the same command to resume" in errors[-1], output
    with Checkpointer(os.path.join(run, "checkpoints")) as checkpoints:
        assert checkpoints.all_steps() == [1]
        assert checkpoints.metadata(1)
    store = ReplayStore.open(os.path.join(run, "replay"))
    assert store.verify()[0] == [] and [r for r, _ in store.committed()][:2] == [0, 1]

    subprocess.run(["mount", "-o", "remount,size=16m", os.path.join(run, "checkpoints")], check=True)
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stdout + again.stderr
    with Checkpointer(os.path.join(run, "checkpoints")) as checkpoints:
        assert checkpoints.all_steps()[-1] == 2
    store = ReplayStore.open(os.path.join(run, "replay"))
    assert [r for r, _ in store.committed()] == [0, 1, 2, 3] and store.verify()[0] == []
