"""Offline tools on real replay stores: `marl replay info / episodes / reanalyze / export`.

A tiny real run (the stages as plain functions: 2 collectors x 3 iterations of SMAX 3m)
writes the store; its episode figures are checked against the stats the collect stage
returned, the reanalysis flow runs on the shared LocalCluster under the Prefect test
server, and the Minari export is read back with minari.
"""

import os

import numpy as np
import pytest

from pipelines import stages
from pipelines.config import make_run_config
from storage import Field, ReplayStore, open_replay
from storage.derived import open_derived
from storage.episodes import episodes, summarize

ITERATIONS, COLLECTORS = 3, 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run dir, the collect stage's stats per region) of a real tiny run with checkpoints."""
    run_dir = str(tmp_path_factory.mktemp("replay-tools") / "run")
    # no updates (learning_starts out of reach): the learner is checkpointed untrained,
    # which is all reanalysis needs, and the test skips compiling the update
    config = make_run_config("qmix-smac-tiny", run_dir=run_dir, n_collectors=COLLECTORS,
                             total_env_steps=ITERATIONS * COLLECTORS * 256,
                             overrides={"learning_starts": str(10**9)})
    cfg = config.to_dict()
    stages.prepare_run(cfg)
    params = stages.policy_params(cfg)
    stats = {}
    for iteration in range(ITERATIONS):
        collected = [stages.collect(cfg, c, iteration, params, iteration, iteration * 512)
                     for c in range(COLLECTORS)]
        stats.update({s["region"]: s for s in collected})
        params = stages.train(cfg, iteration, (iteration + 1) * 512, True, collected)["params"]
    stages.clear_caches()
    return run_dir, stats


def test_episodes_match_the_collectors_stats(run):
    run_dir, stats = run
    table = episodes(open_replay(os.path.join(run_dir, "replay")))
    assert table["complete"].all(), "no ring wrap: every episode starts in the store"
    assert sorted(set(table["region"])) == sorted(stats)
    for region, s in stats.items():
        mine = table[table["region"] == region]
        assert len(mine) == s["episodes"] > 0
        np.testing.assert_allclose(mine["return"].mean(), s["return_mean"], rtol=1e-5)
        assert mine["length"].mean() == pytest.approx(s["length_mean"], rel=1e-6)
        assert mine["won"].mean() == pytest.approx(s["win_rate"], abs=1e-7)
        assert (mine["collector"] == s["collector"]).all()
    # some episodes began in an earlier region of their collector and were joined
    assert (table["length"] > table["end_t"] + 1).any()
    by_iteration = summarize(table, "iteration")
    assert list(by_iteration.index) == list(range(ITERATIONS))
    assert by_iteration["episodes"].sum() == sum(s["episodes"] for s in stats.values())
    assert (by_iteration["partial"] == 0).all()


def _synthetic_store(path, n_slots, regions, with_first=False):
    """A real store of hand-made regions: [(region, iteration, collector, reward [T, N],
    end [T, N](, first [T, N]))]; env 0 ends terminated, env 1 truncated: both count."""
    fields = {"reward": Field((2,), "float32", ("agent",)), "terminated": Field((), "bool", ()),
              "truncated": Field((), "bool", ()), "won": Field((), "bool", ())}
    if with_first:
        fields["first"] = Field((), "bool", ())
    store = ReplayStore.create(path, fields=fields, n_envs=2, steps_per_region=4, n_slots=n_slots, attrs={})
    for region, iteration, collector, reward, end, *first in regions:
        end = np.asarray(end, bool)
        truncated = end & (np.arange(end.shape[1]) == 1)
        data = {"reward": np.repeat(np.asarray(reward, np.float32)[..., None], 2, -1),
                "terminated": end & ~truncated, "truncated": truncated, "won": end}
        if with_first:
            data["first"] = np.asarray(first[0], bool)
        store.write_region(region, data, iteration=iteration, collector=collector, param_version=iteration)
    return store


def test_episodes_join_regions_per_collector_and_mark_overwritten_starts_partial(tmp_path):
    # one collector, a ring of 2 slots, 3 regions: region 0 is overwritten by region 2.
    # env 0 ends at global steps 2, 6 and 9; env 1 only at 11. Reward = global step.
    g = np.arange(12.0)[:, None].repeat(2, 1)
    done = np.zeros((12, 2), bool)
    done[[2, 6, 9], 0] = True
    done[11, 1] = True
    _synthetic_store(tmp_path / "ring", 2, [(r, r, 0, g[4 * r:4 * r + 4], done[4 * r:4 * r + 4])
                                            for r in range(3)])
    t = episodes(open_replay(tmp_path / "ring"))
    rows = [(r["env"], r["region"], r["end_t"], r["return"], r["length"], r["complete"])
            for r in t.to_dict("records")]
    assert sorted(rows) == [
        (0, 1, 2, 4 + 5 + 6, 3, False),  # began at step 3, in the overwritten region 0
        (0, 2, 1, 7 + 8 + 9, 3, True),
        (1, 2, 3, sum(range(4, 12)), 8, False),  # began before region 1
    ]
    assert summarize(t)["partial"].to_dict() == {1: 1, 2: 1}

    # two collectors interleave (region = 2 * iteration + collector); each env's episodes
    # continue in its own collector's next region, not in the other collector's
    a, b = np.ones((4, 2)), 100 * np.ones((4, 2))
    end = np.zeros((4, 2), bool)
    end[1, 0] = True
    _synthetic_store(tmp_path / "two", 8, [(0, 0, 0, a, np.zeros((4, 2))), (1, 0, 1, b, end),
                                           (2, 1, 0, a, end), (3, 1, 1, b, np.zeros((4, 2)))])
    t = episodes(open_replay(tmp_path / "two"))
    got = sorted((r["collector"], r["region"], r["return"], r["length"], r["complete"])
                 for r in t.to_dict("records"))
    assert got == [(0, 2, 6.0, 6, True), (1, 1, 200.0, 2, True)]


def test_a_stored_first_starts_an_episode_where_a_collector_restarted(tmp_path):
    from storage.episodes import iter_episodes

    # one collector, 3 regions of 4 steps, reward = global step. The collector starts at
    # step 0 (first), env 0 ends at step 5; the collector restarts at step 8 (region 2,
    # first without an end) and env 0 ends at step 10; env 1 ends only at step 11.
    g = np.arange(12.0)[:, None].repeat(2, 1)
    end = np.zeros((12, 2), bool)
    end[[5, 10], 0] = True
    end[11, 1] = True
    first = np.zeros((12, 2), bool)
    first[[0, 8]] = True
    first[6, 0] = True  # after env 0's end
    _synthetic_store(tmp_path / "s", 4, [(r, r, 0, g[4 * r:4 * r + 4], end[4 * r:4 * r + 4],
                                          first[4 * r:4 * r + 4]) for r in range(3)], with_first=True)
    ds = open_replay(tmp_path / "s")
    t = episodes(ds)
    rows = sorted((r["env"], r["region"], r["end_t"], r["return"], r["length"], r["complete"])
                  for r in t.to_dict("records"))
    # the restart cut env 0's episode begun at step 6 and env 1's begun at 0: neither has an
    # end, so no row; the episodes that began at the restart are whole
    assert rows == [(0, 1, 1, sum(range(0, 6)), 6, True), (0, 2, 2, 8 + 9 + 10, 3, True),
                    (1, 2, 3, 8 + 9 + 10 + 11, 4, True)]
    got = sorted((row["env"], tuple(data["reward"][:, 0])) for row, data in iter_episodes(ds, ("reward",), t))
    assert got == [(0, (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)), (0, (8.0, 9.0, 10.0)), (1, (8.0, 9.0, 10.0, 11.0))]
    # without the marks, the restart joins env 1's two pieces into one episode of 12 steps
    _synthetic_store(tmp_path / "legacy", 4, [(r, r, 0, g[4 * r:4 * r + 4], end[4 * r:4 * r + 4])
                                              for r in range(3)])
    legacy = episodes(open_replay(tmp_path / "legacy"))
    assert sorted(legacy[legacy["env"] == 1]["length"]) == [12]


def test_replay_info_and_episodes_cli(run, tmp_path, capsys):
    from flows.cli import main

    run_dir, stats = run
    assert main(["replay", "info", run_dir]) == 0  # a run dir resolves to its store
    out = capsys.readouterr().out
    for words in ("env smax:3m", "6 regions", "3 agents", "obs_dim", "32x8x3x75", "zstd(level=1)",
                  "size on disk", "step,env,agent,obs_dim"):
        assert words in out, words
    assert main(["replay", "info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a replay store" in err and err.count("\n") == 1

    csv = tmp_path / "episodes.csv"
    assert main(["replay", "episodes", os.path.join(run_dir, "replay"), "--by", "collector",
                 "--csv", str(csv)]) == 0
    out = capsys.readouterr().out
    total = int(sum(s["episodes"] for s in stats.values()))
    assert "episodes by collector" in out and "win rate" in out
    assert [line.split("│")[2].strip() for line in out.splitlines() if "│ " in line and " all " in line] == [str(total)]
    import pandas as pd

    table = pd.read_csv(csv)
    assert len(table) == total and set(table.columns) >= {"return", "length", "won", "iteration"}


@pytest.fixture(scope="module")
def reanalysed(run, prefect_server, dask_cluster):
    """The reanalysis flow through the CLI, run once (not under capsys: Prefect's log
    handlers keep the stream that is current when the first flow runs)."""
    from flows.cli import main

    run_dir, _ = run
    assert main(["replay", "reanalyze", run_dir, "--scheduler", dask_cluster.scheduler_address]) == 0
    return os.path.join(run_dir, "reanalysis", "step-3")


def test_reanalysis_output_aligns_with_the_store(run, reanalysed):
    import xarray as xr

    run_dir, _ = run
    store = open_replay(os.path.join(run_dir, "replay"))
    derived = open_derived(reanalysed)
    assert derived.attrs["checkpoint_step"] == 3 and derived.attrs["kind"] == "reanalysis"
    assert derived.attrs["source_store"] == os.path.abspath(os.path.join(run_dir, "replay"))
    assert set(derived.data_vars) == {"q_taken", "q_max", "q_tot", "td_error"}
    assert derived.q_taken.dims == ("step", "env", "agent") and derived.td_error.dims == ("step", "env")
    for name in ("region", "iteration", "collector", "param_version"):
        np.testing.assert_array_equal(derived[name].values, store[name].values)
    merged = xr.merge([store, derived], compat="no_conflicts")
    assert dict(merged.sizes) == {**store.sizes}
    # the step axis is the store's: the TD error has no target at each region's last step only
    td = derived.td_error.values.reshape(6, 32, 8)
    assert np.isnan(td[:, -1]).all() and np.isfinite(td[:, :-1]).all()
    q = merged.q_taken.values
    assert np.isfinite(q).all() and (derived.q_max.values >= q - 1e-5).all()


def test_reanalyze_cli_reports_and_reruns_in_place(run, reanalysed, dask_cluster, capsys):
    from flows.cli import main

    run_dir, _ = run
    assert main(["replay", "reanalyze", run_dir, "--checkpoint", "99"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint for step 99" in err and err.count("\n") == 1
    before = open_derived(reanalysed).q_tot.values
    # a rerun with the same checkpoint rewrites the same blocks (a retried flow)
    assert main(["replay", "reanalyze", run_dir, "--checkpoint", "3",
                 "--scheduler", dask_cluster.scheduler_address]) == 0
    out = capsys.readouterr().out
    assert "reanalysed 6 of 6 regions" in out and reanalysed in out
    np.testing.assert_array_equal(open_derived(reanalysed).q_tot.values, before)
    assert main(["replay", "info", reanalysed]) == 0
    out = capsys.readouterr().out
    assert "reanalysis group" in out and "6 of 6 written" in out and "td_error" in out


def test_minari_export_reads_back(run, tmp_path, monkeypatch, capsys):
    minari = pytest.importorskip("minari")
    from flows.cli import main

    run_dir, stats = run
    out = tmp_path / "minari"
    assert main(["replay", "export", run_dir, "--minari", "marl/smax-3m-tiny-v0", "--out", str(out)]) == 0
    capsys.readouterr()
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(out))
    dataset = minari.load_dataset("marl/smax-3m-tiny-v0")
    table = episodes(open_replay(os.path.join(run_dir, "replay")))
    assert dataset.total_episodes == len(table) == sum(s["episodes"] for s in stats.values())
    assert dataset.total_steps == table["length"].sum()
    assert dataset.observation_space.shape == (3 * 75,)
    assert list(dataset.action_space.nvec) == [8, 8, 8]
    returns = sorted(float(e.rewards.sum()) for e in dataset.iterate_episodes())
    np.testing.assert_allclose(returns, sorted(table["return"]), rtol=1e-5, atol=1e-6)
    first = dataset[0]
    assert first.observations.shape[0] == len(first.rewards) + 1
    # every episode ends in a termination or a truncation at its last step only, as stored
    for e in dataset.iterate_episodes():
        ended = e.terminations | e.truncations
        assert ended[-1] and not ended[:-1].any() and not (e.terminations & e.truncations).any()
    # the same id again is refused in one line, and the dataset stays as it was
    assert main(["replay", "export", run_dir, "--minari", "marl/smax-3m-tiny-v0", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert minari.load_dataset("marl/smax-3m-tiny-v0").total_episodes == len(table)
