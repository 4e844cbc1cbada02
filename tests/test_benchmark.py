"""The `marl-benchmark` flow for real, twice on the tiny suite: results table, trends, regression report."""

import json
import os
import re

import pytest

from marl.algos import ConfigError

SUITE = "qmix-3m-tiny"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, prefect_server, dask_cluster):
    """The first run through the flow, the second through `marl benchmark`."""
    from flows.benchmark import marl_benchmark
    from flows.cli import main

    results_dir = str(tmp_path_factory.mktemp("bench"))
    first = marl_benchmark(suites=[SUITE], results_dir=results_dir,
                           scheduler_address=dask_cluster.scheduler_address)
    code = main(["benchmark", "--suites", SUITE, "--results-dir", results_dir,
                 "--scheduler", dask_cluster.scheduler_address])
    assert code == 0
    return results_dir, first


def test_each_run_appends_one_row_with_its_provenance(two_runs):
    from flows.benchmark import RESULT_COLUMNS, read_results

    results_dir, first = two_runs
    rows = read_results(os.path.join(results_dir, "results.csv"))
    assert len(rows) == 2 and list(rows[0]) == list(RESULT_COLUMNS)
    for row in rows:
        assert (row["suite"], row["preset"], row["env"], row["algorithm"]) == (SUITE, "qmix-smac-tiny", "smax:3m", "qmix")
        assert row["env_steps"] == row["env_steps_budget"] == 512 and row["score_metric"] == "test_win_rate"
        assert 0.0 <= row["score"] <= 1.0 and row["wall_s"] >= row["train_s"] > 0
        assert re.fullmatch(r"[0-9a-f]{40}|unknown", row["git_commit"]) and row["cpu_count"] == os.cpu_count()
        assert row["hostname"] and row["platform"] and row["gpu"] and row["timestamp"].endswith("+00:00")
        assert row["flow_run_id"] and row["train_flow_run_id"] and row["error"] is None
        assert os.path.exists(os.path.join(row["run_dir"], "replay"))
    assert rows[0]["flow_run_id"] == first["rows"][0]["flow_run_id"] != rows[1]["flow_run_id"]
    assert rows[0]["run_dir"] != rows[1]["run_dir"]  # each run trains from scratch
    assert [r["status"] for r in rows][0] == "NEW" and rows[1]["status"] in ("OK", "REGRESSION")


def test_trends_png_and_the_second_report_compares_with_the_first(two_runs):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.artifacts import stable_key
    from flows.benchmark import read_results

    results_dir, _ = two_runs
    with open(os.path.join(results_dir, "trends.png"), "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    first, second = read_results(os.path.join(results_dir, "results.csv"))
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[second["flow_run_id"]])))
    artifacts = {a.key: a.data for a in artifacts}
    report = artifacts[stable_key("marl-benchmark", results_dir, "report")]
    assert "| previous | current | delta |" in report and first["flow_run_id"] in report
    assert f"**{second['status']}**" in report and "trends.png" in report
    comparison = artifacts[stable_key("marl-benchmark", results_dir, "comparison")]
    comparison = json.loads(comparison) if isinstance(comparison, str) else comparison
    assert comparison[0]["previous"] == first["score"] and comparison[0]["status"] == second["status"]


def test_worse_score_or_slower_run_is_a_regression():
    from flows.benchmark import compare, previous_result

    rows = [dict(suite="s", env_steps_budget=100, score=0.9, wall_s=100.0, timestamp="t1", flow_run_id="a"),
            dict(suite="s", env_steps_budget=200, score=0.1, wall_s=100.0, timestamp="t2", flow_run_id="b"),
            dict(suite="s", env_steps_budget=100, score=None, wall_s=5.0, error="boom", timestamp="t3")]
    previous = previous_result(rows, "s", 100)  # same budget, latest with a score
    assert previous["flow_run_id"] == "a"
    now = dict(suite="s", score_metric="test_win_rate", wall_s=110.0)
    assert compare(previous, {**now, "score": 0.88})["status"] == "OK"  # within 10% / 0.05
    worse = compare(previous, {**now, "score": 0.5})
    assert worse["status"] == "REGRESSION" and "score fell 0.4" in worse["reasons"]
    assert worse["previous"] == 0.9 and worse["delta"] == pytest.approx(-0.4)
    assert compare(previous, {**now, "score": 0.9, "wall_s": 200.0})["reasons"] == "wall time rose 100%"
    assert compare(previous, {**now, "score": 0.85}, score_abs_tolerance=0.01, score_tolerance=0.01)["status"] == "REGRESSION"
    assert compare(None, {**now, "score": 0.5})["status"] == "NEW"
    assert compare(previous, {**now, "score": None, "error": "boom"})["status"] == "FAILED"


def test_unknown_suite_is_refused_before_anything_runs(capsys):
    from flows.benchmark import select_suites
    from flows.cli import main

    with pytest.raises(ConfigError, match="unknown benchmark suite 'qmix-9m'; valid: qmix-3m"):
        select_suites(["qmix-9m"])
    nightly = [s.name for s in select_suites(None)]
    assert "qmix-3m" in nightly and SUITE not in nightly
    assert main(["benchmark", "--suites", "qmix-9m"]) == 2
    assert "unknown benchmark suite 'qmix-9m'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["benchmark", "--help"])
    assert exit_.value.code == 0 and "--env-steps" in capsys.readouterr().out


def test_a_sigtermed_marl_benchmark_says_in_one_line_what_it_kept(tmp_path, dask_cluster, embedded_marl):
    """SIGTERM to the whole `marl benchmark` process group mid-entry (`timeout`'s stop of a
    scheduled benchmark), on embedded Prefect: exit 143 and one line saying that the entry in
    training has no row, no traceback, no Prefect crash lines, and nothing of it left running."""
    import signal

    import psutil

    results_dir = tmp_path / "bench"
    run = embedded_marl("benchmark", "--suites", SUITE, "--env-steps", str(64 * 512), "--results-dir", str(results_dir),
                        "--scheduler", dask_cluster.scheduler_address, start_new_session=True,
                        ready=lambda run: bool(list(results_dir.glob("runs/*/*/metrics.csv"))))
    left = [psutil.Process(run.pid), *psutil.Process(run.pid).children(recursive=True)]
    os.killpg(run.pid, signal.SIGTERM)
    code = run.wait(timeout=120)
    err = run.stderr.read().decode()
    assert code == 128 + signal.SIGTERM and err.strip().splitlines() == [
        f"marl: benchmark stopped by SIGTERM; {results_dir}/results.csv has a row for each entry finished before "
        "it, and the entry it was training is not in it (run the command again: each entry trains from scratch)"], err
    assert not (results_dir / "results.csv").exists()
    _, alive = psutil.wait_procs(left, timeout=30)
    assert not alive, f"left running after the benchmark: {[p.cmdline()[:3] for p in alive]}"
