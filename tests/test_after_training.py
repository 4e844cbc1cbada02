"""After training, on one tiny real run (real checkpoints, real store): `marl eval`, `marl eval
--render` (GIFs drawn by the envs' own visualisers), `marl export` + `marl.load_policy` (same
actions as the learner), the metric loggers read back (CSV, TensorBoard, MLflow, W&B),
including a resumed run that appends, the flow's GIF artifact (render_every), and `marl
compare` averaging runs that differ only in their seed."""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import struct
import subprocess
import sys

import jax
import numpy as np
import pytest

from flows.cli import main

TINY = "qmix-smac-tiny"


LOCAL_ONLY = {"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": None, "MLFLOW_EXPERIMENT_NAME": None,
              "WANDB_PROJECT": None}  # the run dir's own MLflow store and W&B files, whatever the machine's


@pytest.fixture(scope="module")
def run(tmp_path_factory, prefect_server, dask_cluster):
    """2 iterations of QMIX on smax:3m (checkpoint at 2, evaluated at 2), CSV, TensorBoard
    and MLflow on (W&B joins when the run resumes), the last evaluation rendered as a GIF."""
    from flows.train import marl_train

    run_dir = str(tmp_path_factory.mktemp("after") / "run")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in LOCAL_ONLY.items():
            mp.setenv(name, value) if value else mp.delenv(name, raising=False)
        state = marl_train(preset=TINY, run_dir=run_dir, env_steps=1024, loggers="csv,tensorboard,mlflow",
                           overrides={"render_every": "1"}, scheduler_address=dask_cluster.scheduler_address,
                           return_state=True)
    return {**state.result(), "run_dir": run_dir, "flow_run_id": state.state_details.flow_run_id}


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_eval_reports_each_seed_with_intervals(run, capsys):
    code, out, err = cli(capsys, "eval", run["run_dir"], "--episodes", 4, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert (report["checkpoint"], report["env_id"], report["algo"]) == (2, "smax:3m", "qmix")
    assert report["episodes_per_seed"] == 4 and len(report["per_seed"]) == 1
    for m in ("win_rate", "return", "length"):
        lo, hi = report["mean"][f"{m}_ci95"]
        assert lo <= report["mean"][m] <= hi
    assert 0 <= report["mean"]["win_rate"] <= 1 and report["mean"]["length"] > 0
    table = render(report)
    assert "win rate [95% CI]" in table and "checkpoint 2" in table and "mean +- std" not in table


def render(report) -> str:
    from rich.console import Console

    from flows.eval_cli import eval_table

    out = io.StringIO()
    Console(file=out, width=200, markup=False).print(eval_table(report))
    return out.getvalue()


def test_eval_of_pettingzoo_seeds_reports_their_spread():
    """Numpy envs played one episode after another; two seeds get a mean +- std row."""
    import jax

    from pipelines import stages
    from pipelines.config import make_run_config
    from pipelines.saved_run import SavedRun, evaluate_run

    config = make_run_config("mappo-pz-spread", run_dir="unused", overrides={"hidden": "16", "n_seeds": "2"})
    parts = stages.RunParts.build(config)
    params = parts.learner.policy_params(parts.learner.init(jax.random.PRNGKey(0)))
    report = evaluate_run(SavedRun(config, parts, 0, {"env_steps": 0}, params), episodes=3)
    returns = [r["return"] for r in report["per_seed"]]
    assert len(returns) == 2 and returns[0] != returns[1]
    assert report["mean"]["return"] == pytest.approx(np.mean(returns))
    assert report["mean"]["return_std"] == pytest.approx(np.std(returns))
    assert [r["length"] for r in report["per_seed"]] == [25.0, 25.0]  # simple_spread_v3's max_cycles
    assert "mean +- std" in render(report)


def test_eval_and_export_answer_bad_input_in_one_line(run, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a run")
    for args, words in ((["eval", tmp_path], ["not a run dir", "notes.txt"]),
                        (["eval", tmp_path / "missing"], ["does not exist"]),
                        (["eval", run["run_dir"], "--checkpoint", 7], ["no checkpoint for step 7", "it has 2"]),
                        (["export", run["run_dir"], "--out", tmp_path / "x", "--checkpoint", 9], ["no checkpoint for step 9"]),
                        (["eval", run["run_dir"], "--episodes", 0], ["--episodes 0 must be >= 1"]),
                        (["eval", run["run_dir"], "--render", tmp_path / "team.png"], ["write a .gif or an .mp4"]),
                        (["eval", run["run_dir"], "--render", tmp_path / "notes.txt" / "a.gif"], ["which is a file"]),
                        (["eval", run["run_dir"], "--render", tmp_path / "a.gif", "--render-episodes", 0],
                         ["--render-episodes 0 must be >= 1"])) + no_mp4(tmp_path):
        code, out, err = cli(capsys, *args)
        assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, (args, err)
        assert all(w in err for w in words), (args, err)


def no_mp4(tmp_path):
    """Without ffmpeg an .mp4 is a one-line error naming it (with it, the .mp4 is written)."""
    from matplotlib import animation

    return () if animation.writers.is_available("ffmpeg") else \
        ((["eval", "unused-run-dir", "--render", tmp_path / "team.mp4"], ["needs ffmpeg", "or write a .gif"]),)


def gif(path):
    from PIL import Image

    with Image.open(path) as im:
        return im.format, im.size, im.n_frames


def test_render_writes_a_gif_of_the_trained_team(run, tmp_path, capsys):
    """SMAX: jaxmarl's renderer draws 4 of the 8 world sub-steps of each env step."""
    from pipelines.render import SMAX_DPI

    out = tmp_path / "gifs" / "team.gif"  # its dir is made
    code, stdout, err = cli(capsys, "eval", run["run_dir"], "--render", out, "--render-episodes", 1,
                            "--render-steps", 3, "--json")
    assert code == 0 and err == "", err
    done = json.loads(stdout)
    assert (done["checkpoint"], done["frames"], done["fps"]) == (2, 12, 8)
    assert [e["length"] for e in done["episodes"]] == [3]
    fmt, size, frames = gif(out)
    assert fmt == "GIF" and frames > 1 and size == (done["width"], done["height"]) == (6 * SMAX_DPI, 5 * SMAX_DPI)
    code, stdout, err = cli(capsys, "eval", run["run_dir"], "--render", out, "--render-episodes", 1,
                            "--render-steps", 1)
    assert code == 0 and stdout.startswith(f"wrote {out}: 1 greedy episode(s) of qmix on smax:3m (checkpoint 2")
    assert "4 frames of 480x400" in stdout and gif(out)[2] > 1


@pytest.mark.parametrize("preset", ["mappo-mpe-tiny", "mappo-pz-spread"])
def test_render_of_mpe_and_pettingzoo(preset, tmp_path):
    """MPE: jaxmarl's MPEVisualizer (a 5x5 in figure at 100 dpi); PettingZoo: the env's own
    rgb_array frames, pixel for pixel. Fresh (untrained) params: the drawing is under test."""
    from pipelines import stages
    from pipelines.config import make_run_config
    from pipelines.render import render_run
    from pipelines.saved_run import SavedRun

    config = make_run_config(preset, run_dir="unused")
    parts = stages.RunParts.build(config)
    params = parts.learner.policy_params(parts.learner.init(jax.random.PRNGKey(0)))
    done = render_run(SavedRun(config, parts, 0, {"env_steps": 0}, params), str(tmp_path / "a.gif"),
                      episodes=2, max_steps=3)
    assert done["frames"] == 6 and [e["length"] for e in done["episodes"]] == [3, 3]
    if parts.env.spec.backend == "numpy":
        from marl import envs

        env = envs.make(config.env_id, render_mode="rgb_array")
        env.reset(seed=0)
        height, width, _ = env.env.render().shape
    else:
        width, height = 500, 500
    fmt, size, frames = gif(tmp_path / "a.gif")
    assert fmt == "GIF" and frames > 1 and size == (done["width"], done["height"]) == (width, height)


def play_both(policy, learner, params, env, n_envs=4, steps=12):
    """Steps n_envs envs with the learner's greedy actions; the exported policy must pick
    the same ones, its carry threaded through `act` as a user would."""
    key = jax.random.PRNGKey(3)
    ts, state = jax.vmap(env.reset)(jax.random.split(key, n_envs))
    carry, policy_carry = learner.init_carry(n_envs), None
    for t in range(steps):
        key, act_key, step_key = jax.random.split(key, 3)
        expected, carry, _ = learner.act(params, carry, ts.obs, ts.avail_actions, ts.first, act_key, learner.greedy)
        first = None if policy_carry is None else np.asarray(ts.first)
        actions, policy_carry = policy.act(np.asarray(ts.obs), np.asarray(ts.avail_actions), policy_carry, first=first)
        np.testing.assert_allclose(actions, np.asarray(expected), rtol=1e-6, atol=1e-6)
        ts, state = jax.vmap(env.step)(jax.random.split(step_key, n_envs), state, expected)
    np.testing.assert_allclose(np.asarray(policy_carry), np.asarray(carry), rtol=1e-5, atol=1e-6)


def test_exported_qmix_plays_like_its_learner(run, tmp_path, capsys):
    import marl
    from pipelines.saved_run import load_run

    out = tmp_path / "qmix"
    code, stdout, err = cli(capsys, "export", run["run_dir"], "--out", out)
    assert code == 0, err
    assert sorted(os.listdir(out)) == ["env_spec.json", "params.msgpack", "policy.json"]
    policy = marl.load_policy(str(out))
    saved = load_run(run["run_dir"])
    assert policy.source["checkpoint"] == 2 and policy.spec == saved.parts.env.spec
    play_both(policy, saved.parts.single_seed, saved.params, saved.parts.env)  # a GRU carry

    one_env, _ = policy.act(np.zeros((3, policy.spec.obs_dim), np.float32))  # no batch axis
    assert one_env.shape == (3,)
    # plain Python: no Dask, Prefect or store in the process that plays it
    script = ("import sys, numpy as np, marl; p = marl.load_policy(sys.argv[1]); "
              "a, c = p.act(np.zeros((2, 3, p.spec.obs_dim), np.float32)); a, c = p.act(np.zeros((2, 3, p.spec.obs_dim)), carry=c); "
              "assert a.shape == (2, 3); "
              "print(sorted(m for m in ('dask', 'distributed', 'prefect', 'zarr') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


def test_qmix_mixer_probe_reads_the_restored_mixer_on_the_runs_own_states(run, monkeypatch, capsys):
    import runpy

    monkeypatch.setattr(sys, "argv", ["qmix_mixer_probe.py", run["run_dir"], "--regions", "2"])
    runpy.run_path("bench/qmix_mixer_probe.py", run_name="__main__")
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| 0 |")]
    assert [r[1].strip() for r in rows] == ["trained", "fresh init"]
    trained, fresh = ([float(x) for x in r[2:]] for r in rows)
    assert np.isfinite(trained + fresh).all() and trained != fresh  # the checkpoint's mixer, not a new one


@pytest.mark.parametrize("preset", ["mappo-mpe-tiny", "maddpg-mpe-tiny"])
def test_exported_mappo_and_maddpg_play_like_their_learners(preset, tmp_path):
    import marl
    from marl import algos, envs
    from marl.policy import save_policy
    from pipelines.config import make_run_config

    config = make_run_config(preset)
    env = envs.make(config.env_id, **config.env_kwargs)
    learner = algos.make_learner(config.algo, env.spec, config.algo_config())
    params = learner.policy_params(learner.init(jax.random.PRNGKey(1)))
    save_policy(str(tmp_path), config.algo, learner.config, env.spec, params)
    play_both(marl.load_policy(str(tmp_path)), learner, params, env, steps=5)


def test_load_policy_of_a_dir_that_is_not_one(tmp_path):
    import marl

    with pytest.raises(marl.PolicyError, match="no policy.json, env_spec.json, params.msgpack .*marl export"):
        marl.load_policy(str(tmp_path))


def read_csv(run_dir):
    with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
        return list(csv.DictReader(f))


def read_events(pattern):
    """The events of TensorBoard event files (TFRecord framing, tensorboardX's Event proto)."""
    from tensorboardX.proto import event_pb2

    for path in sorted(glob.glob(pattern)):
        data, i = open(path, "rb").read(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            yield event


def read_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the run's TensorBoard files: tag -> [(step, value)], honouring a
    resumed run's purge step."""
    scalars: dict[str, list] = {}
    for event in read_events(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*")):
        if event.HasField("session_log") and event.session_log.status == event.session_log.START:
            scalars = {t: [(s, v) for s, v in vs if s < event.step] for t, vs in scalars.items()}
        for value in event.summary.value:
            if value.HasField("simple_value"):
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_loggers_write_every_iteration_and_the_evaluation(run):
    rows, history = read_csv(run["run_dir"]), run["history"]
    assert [int(r["iteration"]) for r in rows] == [1, 2]
    assert rows[0]["test_win_rate"] == "" and float(rows[1]["test_win_rate"]) == history[1]["test_win_rate"]
    assert {"env_steps", "return", "loss", "steps_per_s", "policy_lag"} <= set(rows[0])
    scalars = read_scalars(run["run_dir"])
    assert [s for s, _ in scalars["return"]] == [512, 1024]
    assert scalars["test_win_rate"] == [(1024, pytest.approx(history[1]["test_win_rate"]))]
    images = [(e.step, v.image) for e in read_events(os.path.join(run["run_dir"], "tensorboard", "events.*"))
              for v in e.summary.value if v.tag == "learning_curve"]
    assert len(images) == 1 and images[0][0] == 1024 and images[0][1].height > 100
    assert images[0][1].encoded_image_string.startswith(b"\x89PNG")
    hparams = [v for e in read_events(os.path.join(run["run_dir"], "tensorboard", "hparams", "events.*"))
               for v in e.summary.value if v.metadata.plugin_data.plugin_name == "hparams"]
    assert hparams and b"algo_overrides.hidden" in hparams[0].metadata.plugin_data.content

    from test_loggers import csv_rows, mlflow_rows

    logged, mlflow_run, client = mlflow_rows(run["run_dir"])  # its SQLite store in the run dir
    assert logged == csv_rows(run["run_dir"]) and sorted(logged) == [512, 1024]
    assert logged[1024]["test_win_rate"] == history[1]["test_win_rate"] and mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params["algo_overrides.hidden"] == "16" and mlflow_run.data.params["render_every"] == "1"
    assert [a.path for a in client.list_artifacts(mlflow_run.info.run_id)] == ["learning_curve.png"]


def test_missing_or_unknown_logger_is_one_line(monkeypatch, capsys):
    import importlib.util

    from flows.checks import InputError
    from flows.loggers import parse_loggers

    assert parse_loggers(None) == ["csv"] and parse_loggers("csv, tensorboard") == ["csv", "tensorboard"]
    code, out, err = cli(capsys, "train", TINY, "--logger", "csv,mlflw")
    assert code == 2 and err.count("\n") == 1 and "unknown logger 'mlflw'" in err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboardX" else real(name, *a))
    with pytest.raises(InputError, match=r"marl-dataflow\[tensorboard\]"):
        parse_loggers("csv,tensorboard")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("mlflow", "wandb") else real(name, *a))
    for name, words in (("mlflow", "pip install 'marl-dataflow[mlflow]' (or pip install mlflow-skinny)"),
                        ("wandb", "pip install 'marl-dataflow[wandb]' (or pip install wandb)")):
        with pytest.raises(InputError) as e:
            parse_loggers(f"csv,{name}")
        assert str(e.value) == f"logger {name} needs {name}, which is not installed; {words}"
    code, out, err = cli(capsys, "train", TINY, "--set", "render_every=-1")
    assert code == 2 and err.count("\n") == 1 and "render_every=-1 must be >= 0" in err


def test_runs_lists_the_run_and_compare_draws_its_curves(run, tmp_path, capsys):
    parent = os.path.dirname(run["run_dir"])
    code, out, err = cli(capsys, "runs", parent, "--json")
    assert code == 0, err
    (listed,) = json.loads(out)
    rows = read_csv(run["run_dir"])
    assert {k: listed[k] for k in ("run_dir", "preset", "env_id", "algo", "n_seeds", "env_steps", "checkpoint",
                                   "status")} == {"run_dir": run["run_dir"], "preset": TINY, "env_id": "smax:3m",
                                                  "algo": "qmix", "n_seeds": 1, "env_steps": 1024, "checkpoint": 2,
                                                  "status": "finished"}
    assert listed["test_win_rate"] == float(rows[1]["test_win_rate"]) and listed["tested_at"] == 1024
    code, out, err = cli(capsys, "runs", parent)
    assert code == 0 and "qmix-smac-tiny" in out and "1,024/1,024" in out and "finished" in out

    figure = tmp_path / "curves.png"
    code, out, err = cli(capsys, "compare", run["run_dir"], run["run_dir"], "--out", figure, "--metric", "return",
                         "--metric", "test_return", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["figure"] == str(figure) and figure.read_bytes().startswith(b"\x89PNG")
    returns = [float(r["return"]) for r in rows]
    assert report["runs"][0]["return"] == {"final": returns[-1], "final_std": None, "best": max(returns)}
    assert report["runs"][0]["test_return"]["final"] == float(rows[1]["test_return"])
    code, out, err = cli(capsys, "compare", run["run_dir"], "--out", figure)
    assert code == 0 and "test win rate final" in out and out.endswith(f"learning curves: {figure}\n")
    for args, words in ((["compare", parent], ["is not a run dir"]),
                        (["compare", run["run_dir"], "--metric", "wins"], ["no column wins", "test_win_rate"]),
                        (["runs", tmp_path / "missing"], ["is not a directory"])):
        code, out, err = cli(capsys, *args)
        assert code == 2 and out == "" and err.count("\n") == 1 and all(w in err for w in words), (args, err)


def test_training_flow_attaches_the_last_evaluations_gif(run):
    """render_every=1: the (only, last) evaluation at iteration 2 drawn from checkpoint 2 on a
    worker, kept in the run dir and shown inline (a data: URL) in a Prefect markdown artifact."""
    import base64
    import re

    from flows.artifacts import artifact_key
    from pipelines.config import make_run_config
    from pipelines.render import SMAX_DPI, TRAINING_RENDER_STEPS
    from test_artifacts import read_flow_run_artifacts

    config = make_run_config(TINY, run_dir=run["run_dir"])
    artifacts = read_flow_run_artifacts(run["flow_run_id"])
    render = artifacts[artifact_key(config, "render")]
    assert render.type == "markdown" and render.description == "qmix on smax:3m, checkpoint 2: one greedy episode"
    (encoded,) = re.findall(r"!\[one greedy episode\]\(data:image/gif;base64,([A-Za-z0-9+/=]+)\)", render.data)
    path = os.path.join(run["run_dir"], "renders", "iteration-2.gif")
    with open(path, "rb") as f:
        assert base64.b64decode(encoded) == f.read()
    fmt, size, frames = gif(path)
    assert fmt == "GIF" and size == (6 * SMAX_DPI, 5 * SMAX_DPI) and 1 < frames
    assert "| policy | checkpoint 2 (1,024 env steps), greedy |" in render.data and f"| file | `{path}` |" in render.data
    steps = int(re.search(r"\| episode \| (\d+) env steps, return", render.data).group(1))
    drawn = int(re.search(r"\| frames \| (\d+) of 480x400 at 8 fps \|", render.data).group(1))
    assert 1 <= steps <= TRAINING_RENDER_STEPS and drawn == 4 * steps >= frames  # (Pillow merges equal frames)
    assert run["render"] == path and path in artifacts[artifact_key(config, "summary")].data


def test_training_renders_come_every_nth_evaluation_from_the_checkpoint_at_or_before_it(run):
    """Which evaluations are drawn, and from which checkpoint: the run has checkpoint 2 only."""
    from flows.renders import TrainingRenders
    from pipelines.config import make_run_config
    from pipelines.render import render_checkpoint

    every_2nd = TrainingRenders(None, make_run_config(TINY, overrides={"render_every": "2"}), None)  # eval_every=2
    assert [i for i in range(1, 13) if every_2nd.due({"iteration": i, "test_win_rate": 0.0})] == [4, 8, 12]
    assert not every_2nd.due({"iteration": 4}) and not TrainingRenders(None, make_run_config(TINY), None).due(
        {"iteration": 4, "test_win_rate": 0.0})
    assert render_checkpoint(run["run_dir"], 1) is None  # no checkpoint yet at iteration 1
    done = render_checkpoint(run["run_dir"], 3, max_steps=2)
    assert (done["iteration"], done["checkpoint"], done["env_steps"]) == (3, 2, 1024)
    assert done["gif"].startswith(b"GIF8") and done["frames"] == 4 * done["episodes"][0]["length"] <= 8


@pytest.fixture(scope="module")
def seed_1_run(run, tmp_path_factory, dask_cluster):
    """The shared run's settings with --seed 1 (no GIF: render_every is not the experiment)."""
    from flows.train import marl_train

    run_dir = str(tmp_path_factory.mktemp("seed1") / "run")
    marl_train(preset=TINY, run_dir=run_dir, env_steps=1024, seed=1, scheduler_address=dask_cluster.scheduler_address)
    return run_dir


def test_compare_averages_runs_that_differ_only_in_their_seed(run, seed_1_run, tmp_path, capsys):
    figure = tmp_path / "seeds.png"
    code, out, err = cli(capsys, "compare", run["run_dir"], seed_1_run, "--out", figure, "--metric", "return",
                         "--metric", "test_return", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert [r["run_dir"] for r in report["runs"]] == [run["run_dir"], seed_1_run]  # each run's own, as before
    (group,) = report["groups"]
    assert group["run_dirs"] == [run["run_dir"], seed_1_run] and group["seeds"] == [0, 1]
    rows = [read_csv(run["run_dir"]), read_csv(seed_1_run)]
    for m in ("return", "test_return"):
        finals = [float(r[-1][m]) for r in rows]
        assert group[m]["final"] == pytest.approx(np.mean(finals)) and group[m]["n"] == 2
        assert group[m]["final_std"] == pytest.approx(np.std(finals))
    assert rows[0][-1]["return"] != rows[1][-1]["return"]  # two seeds, two results
    means = [np.mean([float(r[i]["return"]) for r in rows]) for i in range(2)]
    assert group["return"]["best"] == pytest.approx(max(means))
    assert figure.read_bytes().startswith(b"\x89PNG")

    code, out, err = cli(capsys, "compare", run["run_dir"], seed_1_run, "--out", figure)
    assert code == 0 and "seeds 0, 1: mean +- std" in out and out.count(" +- ") >= 2
    code, out, err = cli(capsys, "compare", run["run_dir"], seed_1_run, "--out", figure, "--separate", "--json")
    assert code == 0 and json.loads(out)["groups"] == []


def test_resumed_run_appends_and_marl_train_prints_only_the_bar_the_table_and_the_paths(run, dask_cluster, tmp_path):
    """Next to last in this module: it trains the shared run on, through `marl train` in a
    fresh process (its own imports, so banners and log lines would show), on the tests'
    cluster and Prefect server. An interrupted run may have logged an iteration after its
    last checkpoint; the resumed run replaces that row."""
    import re

    from prefect.settings import PREFECT_API_URL

    path = os.path.join(run["run_dir"], "metrics.csv")
    with open(path, "a") as f:
        f.write("3,1536,99.0\n4,20")  # logged, then killed mid-line before checkpoint 4
    env = {**{k: v for k, v in os.environ.items() if k not in LOCAL_ONLY}, "WANDB_MODE": "offline",
           "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_HOME": str(tmp_path / "prefect")}
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "marl"), "train", TINY, "--run-dir",
                           run["run_dir"], "--env-steps", "2048", "--logger", "csv,tensorboard,mlflow,wandb", "--scheduler",
                           dask_cluster.scheduler_address], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    wanted = (r"iter +4  steps +2,048  test win .*steps/s +[\d,]+", r"training ━+ 2,048/2,048 env steps [\d:]+",
              rf"{TINY} on smax:3m", r"[┏┃┡│└].*[┓┃┩│┘]", "resumed from iteration 2",
              rf"replay store: {re.escape(run['run_dir'])}/replay", rf"checkpoints:  {re.escape(run['run_dir'])}/checkpoints")
    for line in lines:
        assert any(re.fullmatch(w, line.strip()) for w in wanted), (line, done.stdout)
    assert sum("resumed from iteration 2" in line for line in lines) == 1 and lines[-1].startswith("checkpoints:")

    rows = read_csv(run["run_dir"])
    assert [int(r["iteration"]) for r in rows] == [1, 2, 3, 4]
    printed = re.search(r"iter +4 .* return +(-?[\d.]+)", done.stdout).group(1)
    assert f"{float(rows[3]['return']):.3f}" == printed and rows[2]["return"] != "99.0"
    assert [s for s, _ in read_scalars(run["run_dir"])["return"]] == [512, 1024, 1536, 2048]
    # MLflow: the same run, now with iterations 3 and 4 (never the interrupted 99.0); W&B, enabled
    # only now: iterations 1 and 2 from metrics.csv, then 3 and 4 as they were trained
    from test_loggers import csv_rows, mlflow_rows, wandb_run

    expected = csv_rows(run["run_dir"])
    logged, mlflow_run, _ = mlflow_rows(run["run_dir"])
    assert logged == expected and sorted(expected) == [512, 1024, 1536, 2048]
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.data.params["total_env_steps"] == "1024"
    assert json.loads(mlflow_run.data.tags["marl.config"])["total_env_steps"] == 2048  # params: its first config
    logged, config, other, ids, files = wandb_run(run["run_dir"])
    assert logged == expected and len(ids) == len(files) == 1
    assert config["total_env_steps"] == 2048 and config["algo_overrides"]["hidden"] == 16
    assert other["learning_curve"][0] == 2048 and other["learning_curve"][1]["_type"] == "image-file"


def test_quiet_train_prints_one_line(run, dask_cluster, capsys):
    """Asked for no more env steps than the shared run has done, --quiet says so in one line."""
    done = int(read_csv(run["run_dir"])[-1]["env_steps"])
    code, out, err = cli(capsys, "train", TINY, "--run-dir", run["run_dir"], "--env-steps", done, "--quiet",
                         "--scheduler", dask_cluster.scheduler_address)
    assert code == 0 and out == f"{TINY} on smax:3m: {done:,} env steps; run dir {run['run_dir']}\n", (out, err)
    with pytest.raises(SystemExit) as exit:  # argparse's error, in one line
        main(["train", TINY, "--quiet", "--verbose"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "not allowed with argument --quiet" in err and err.count("\n") == 1
