"""A real `marl-train` flow run leaves a metrics table, a summary and a learning-curve PNG in Prefect."""

import json
import math
import os

import matplotlib.image

TINY = "qmix-smac-tiny"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_flow_run_artifacts(flow_run_id) -> dict:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {a.key: a for a in artifacts}


def test_train_run_publishes_table_summary_and_learning_curve(tmp_path, prefect_server, dask_cluster):
    from flows.artifacts import artifact_key
    from flows.train import marl_train
    from pipelines.config import make_run_config

    run_dir = str(tmp_path / "run")
    # 1024 env steps = 2 iterations; only the 2nd is evaluated, so the rows have different keys
    state = marl_train(preset=TINY, run_dir=run_dir, env_steps=1024,
                       scheduler_address=dask_cluster.scheduler_address, return_state=True)
    result = state.result()
    artifacts = read_flow_run_artifacts(state.state_details.flow_run_id)
    config = make_run_config(TINY, run_dir=run_dir)
    keys = {kind: artifact_key(config, kind) for kind in ("history", "summary", "learning-curve")}
    assert set(artifacts) == set(keys.values())
    assert [artifacts[keys[k]].type for k in keys] == ["table", "markdown", "markdown"]  # a link is markdown

    table = artifacts[keys["history"]].data
    table = json.loads(table) if isinstance(table, str) else table
    history = result["history"]
    assert len(history) == len(table) == 2 and "test_win_rate" not in history[0]
    for row, expected in zip(table, history):
        assert {k: row[k] for k in expected} == {k: None if isinstance(v, float) and math.isnan(v) else v
                                                 for k, v in expected.items()}
        assert all(row[k] is None for k in set(row) - set(expected))

    summary = artifacts[keys["summary"]].data
    for words in (os.path.abspath(result["store"]), result["checkpoint_dir"], "smax:3m", "qmix",
                  f"{result['env_steps']:,}", "learning_curve.png", result["dashboard"]):
        assert words in summary

    png = os.path.join(run_dir, "learning_curve.png")
    assert result["learning_curve"] == png and f"{png})" in artifacts[keys["learning-curve"]].data
    with open(png, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    height, width, _ = matplotlib.image.imread(png).shape
    assert height > 100 and width > 100


def test_history_table_makes_nan_valid_json():
    from flows.artifacts import history_table, stable_key

    rows = history_table([{"iteration": 1, "loss": float("nan"), "return": float("inf")},
                          {"iteration": 2, "loss": 0.5, "test_win_rate": 0.25, "extra": 3}])
    json.dumps(rows, allow_nan=False)
    assert rows[0]["loss"] is None and rows[0]["return"] is None and rows[0]["test_win_rate"] is None
    assert rows[1]["test_win_rate"] == 0.25 and rows[1]["extra"] == 3 and rows[0]["extra"] is None
    key = stable_key("QMIX_smac", "/tmp/Some Run.dir", "history")
    assert key == key.lower() and set(key) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")
