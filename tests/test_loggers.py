"""The MLflow and W&B loggers on their real stores (an MLflow SQLite store read back with
MlflowClient, a W&B offline run read back from its .wandb file), without a flow: rows go out
once their iteration is in a checkpoint, so an interrupted run's rows past its checkpoint
never reach them and the resumed run's do, once. The flow's own use is in
test_after_training.py."""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import struct

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("wandb")


@pytest.fixture(autouse=True)
def local_only(monkeypatch):
    """Whatever the machine's settings: the run dir's own MLflow store, W&B offline."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")


def csv_rows(run_dir) -> dict[int, dict[str, float]]:
    """metrics.csv as env steps -> {metric: value}, the finite numbers only."""
    out = {}
    with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
        for row in csv.DictReader(f):
            values = {}
            for k, v in row.items():
                try:
                    values[k] = float(v)
                except (TypeError, ValueError):
                    continue
            step = int(values.pop("env_steps"))
            out[step] = {k: v for k, v in values.items() if math.isfinite(v)}
    return out


def mlflow_rows(run_dir):
    """The run dir's MLflow run: (env steps -> {metric: value} from each metric's history, the run)."""
    from mlflow import MlflowClient

    with open(os.path.join(run_dir, "mlflow_run.json")) as f:
        state = json.load(f)
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    run = client.get_run(state["run_id"])
    rows: dict[int, dict] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            assert key not in rows.get(m.step, {}), f"{key} logged twice at step {m.step}"
            rows.setdefault(m.step, {})[key] = m.value
    return rows, run, client


def wandb_records(path):
    """The records of a W&B .wandb file (a LevelDB-style log: 32 KiB blocks of chunks with a
    7-byte header; full, first, middle and last chunks) as wandb's Record protos."""
    from wandb.proto import wandb_internal_pb2

    data, block = open(path, "rb").read(), 32 * 1024
    assert data[:4] == b":W&B"
    i, chunk = 7, b""
    while i + 7 <= len(data):
        if block - i % block < 7:  # the block's tail is padding
            i += block - i % block
            continue
        _, n, kind = struct.unpack("<IHB", data[i:i + 7])
        if kind == 0 and n == 0:
            i += block - i % block
            continue
        chunk += data[i + 7:i + 7 + n]
        i += 7 + n
        if kind in (1, 4):  # full or last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def wandb_run(run_dir):
    """The run dir's W&B run, read from every offline run file of its id (a resumed run dir
    has one per attempt): (env steps -> {metric: value}, config, other logged values, ids).
    Two attempts started within one second share a timestamp, and W&B names the second's
    folder with a "-1" after the id."""
    with open(os.path.join(run_dir, "wandb_run.json")) as f:
        run_id = json.load(f)["id"]
    files = sorted(glob.glob(os.path.join(run_dir, "wandb", f"offline-run-*-{run_id}*", f"run-{run_id}.wandb")))
    rows: dict[int, dict] = {}
    config, other, ids = {}, {}, set()
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "config":
                config.update({u.key: json.loads(u.value_json) for u in record.config.update})
            elif kind == "history":
                items = {}
                for i in record.history.item:  # a logged dict (an image) comes as nested keys
                    key = i.key or i.nested_key[0]
                    value = json.loads(i.value_json)
                    if i.nested_key[1:]:
                        items.setdefault(key, {})["/".join(i.nested_key[1:])] = value
                    else:
                        items[key] = value
                step = items.pop("env_steps", None)
                for k, v in items.items():
                    if k.startswith("_"):
                        continue
                    if isinstance(v, (int, float)):
                        assert step is not None and k not in rows.get(step, {}), f"{k} logged twice at {step}"
                        rows.setdefault(int(step), {})[k] = float(v)
                    else:
                        other[k] = (record.history.step.num, v)
    return rows, config, other, ids, files


def test_interrupted_rows_never_reach_mlflow_or_wandb_and_the_resumed_ones_do_once(tmp_path):
    from flows.loggers import open_loggers
    from pipelines.config import make_run_config

    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    # 4 iterations of 512 env steps, a checkpoint every 2
    cfg = make_run_config("qmix-smac-tiny", run_dir=run_dir, total_env_steps=2048).to_dict()
    row = lambda i, r: {"iteration": i, "env_steps": 512 * i, "return": r, "loss": math.nan if i == 1 else 1 / i,
                        "test_win_rate_per_seed": [0.5]}
    loggers = open_loggers(["mlflow", "wandb", "csv"], run_dir, 0, cfg, 0)
    for i in (1, 2, 3):
        for lg in loggers:
            lg.log(row(i, 99.0 if i == 3 else 0.1 * i))
    for lg in loggers:  # killed after iteration 3; its checkpoint is at 2
        lg.close()
    assert set(mlflow_rows(run_dir)[0]) == {512, 1024}

    loggers = open_loggers(["csv", "mlflow", "wandb"], run_dir, 2, cfg, 1024)
    for r in (row(3, 0.3), {**row(4, 0.4), "test_win_rate": 0.25}):
        for lg in loggers:
            lg.log(r)
    for lg in loggers:
        lg.finish({"env_steps": 2048, "history": [], "learning_curve": None})
        lg.close()

    expected = csv_rows(run_dir)
    assert sorted(expected) == [512, 1024, 1536, 2048] and expected[1536]["return"] == 0.3
    rows, run, _ = mlflow_rows(run_dir)
    assert rows == expected and run.info.status == "FINISHED"
    assert run.data.params["algo_overrides.hidden"] == "16" and run.data.params["preset"] == "qmix-smac-tiny"
    rows, config, _, ids, files = wandb_run(run_dir)
    assert rows == expected and len(files) == 2 and len(ids) == 1  # one W&B run, resumed
    assert config["algo_overrides"]["hidden"] == 16


def test_a_logger_enabled_on_a_resumed_run_gets_the_earlier_rows_from_metrics_csv(tmp_path):
    from flows.loggers import open_loggers
    from pipelines.config import make_run_config

    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    cfg = make_run_config("qmix-smac-tiny", run_dir=run_dir, total_env_steps=2048).to_dict()
    (csv_logger,) = open_loggers(["csv"], run_dir, 0, cfg, 0)
    for i in (1, 2, 3):
        csv_logger.log({"iteration": i, "env_steps": 512 * i, "return": float(i)})
    loggers = open_loggers(["csv", "mlflow"], run_dir, 2, cfg, 1024)  # resumed at 2, now with MLflow
    assert mlflow_rows(run_dir)[0] == {512: {"iteration": 1.0, "return": 1.0},
                                       1024: {"iteration": 2.0, "return": 2.0}}
    for lg in loggers:
        lg.close()
    assert mlflow_rows(run_dir)[1].info.status == "KILLED"


def test_a_tracking_uri_mlflow_refuses_is_one_line(tmp_path, monkeypatch):
    from flows.checks import InputError
    from flows.loggers import open_loggers

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://x")
    with pytest.raises(InputError, match=r"MLflow cannot log to nosuchscheme://x: .*MLFLOW_TRACKING_URI") as e:
        open_loggers(["mlflow"], str(tmp_path), 0, None, 0)
    assert "\n" not in str(e.value)
