"""Image observations (issue 20 item 4): PettingZoo's pistonball, whose pistons each see a
(457, 120, 3) uint8 crop and whose state() is the whole screen, through the registry id, a
real store, MAPPO, QMIX and MADDPG updates with the conv encoder, and `marl export` +
load_policy.

Tiny: 3 pistons, 5-step episodes, 2 envs x 8 steps per region, 16-unit networks; one
shared MAPPO run (collect, train, checkpoint, export), one QMIX run, and one MADDPG run
with `MARL_ALL_ENVS=1` (as tests/test_env_registry.py's slower envs).
"""

import json
import os
import sys

import jax
import numpy as np
import pytest
import zarr

from marl import envs
from pipelines import stages
from pipelines.config import make_run_config
from storage import ReplayStore, open_replay

ENV_ID = "pz:pettingzoo.butterfly.pistonball_v6"
KWARGS = {"n_pistons": 3, "continuous": False, "max_cycles": 5}
OBS, STATE = (457, 120, 3), (560, 40 * 3 + 80, 3)  # a piston's crop; the screen of 3 pistons
T, N, A = 8, 2, 3

pytestmark = pytest.mark.filterwarnings("ignore")


def tiny_run(tmp_path, preset, algo, **overrides):
    return make_run_config(preset, env_id=ENV_ID, run_dir=str(tmp_path / algo), overrides={
        "algo": algo, "env_kwargs": json.dumps(KWARGS), "n_collectors": "1", "envs_per_collector": str(N),
        "steps_per_region": str(T), "buffer_transitions": "64", "hidden": "16", **overrides})


def collect_and_train(config, checkpoint=False):
    """prepare, one collect into the store, one train call on it; the train call's result."""
    cfg = config.to_dict()
    stages.prepare_run(cfg)
    collected = stages.collect(cfg, 0, 0, stages.policy_params(cfg), 0, 0)
    return stages.train(cfg, 0, T * N, checkpoint, [collected])


@pytest.fixture(scope="module")
def mappo_run(tmp_path_factory):
    config = tiny_run(tmp_path_factory.mktemp("image"), "mappo-mpe-tiny", "mappo", epochs="1", minibatches="1")
    try:
        result = collect_and_train(config, checkpoint=True)
    finally:
        stages.clear_caches()
    return config, result


def test_the_spec_keeps_images_that_the_steps_give():
    env = envs.make(ENV_ID, **KWARGS)
    spec = env.spec
    assert (spec.obs_shape, spec.state_shape, spec.n_agents, spec.n_actions) == (OBS, STATE, A, 3)
    assert spec.agent_obs == (OBS, "uint8") and spec.global_state == (STATE, "uint8")
    assert spec.obs_dim == np.prod(OBS) and spec.state_dim == np.prod(STATE)
    assert envs.EnvSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    raw = env.factory()
    raw_obs, _ = raw.reset(seed=3)
    ts = env.reset(seed=3)
    for step in range(7):  # through a 5-step episode's end and the auto-reset
        assert ts.obs.shape == (A, *OBS) and ts.obs.dtype == np.uint8
        assert ts.state.shape == STATE and ts.state.dtype == np.uint8
        if step == 0:  # the pixels as the env gave them
            np.testing.assert_array_equal(ts.obs, np.stack([raw_obs[a] for a in spec.agents]))
            np.testing.assert_array_equal(ts.state, raw.state())
        ts = env.step(np.ones(A, np.int32))
    assert ts.obs.any()


def test_a_bad_kwarg_and_a_missing_extra_are_refused_in_one_line(monkeypatch):
    with pytest.raises(envs.EnvError, match=r"unknown env kwarg\(s\) n_piston; valid: .*n_pistons"):
        envs.make(ENV_ID, n_piston=3)
    # pymunk not importable (as without the extra): the id names the package and the extra
    monkeypatch.setitem(sys.modules, "pymunk", None)
    for name in [m for m in sys.modules if m.startswith("pettingzoo.butterfly.pistonball")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(envs.EnvError) as err:
        envs.make(ENV_ID, **KWARGS)
    assert str(err.value) == (f"{ENV_ID} needs pymunk, which is not installed; install the butterfly extra "
                              "(pip install 'marl-dataflow[butterfly]')")


def test_the_store_keeps_uint8_images_in_whole_image_chunks(mappo_run):
    config, _ = mappo_run
    store = ReplayStore.open(config.store_path)
    data = store.read_region(0)
    assert data["obs"].shape == (T, N, A, *OBS) and data["obs"].dtype == np.uint8
    assert data["state"].shape == (T, N, *STATE) and data["state"].dtype == np.uint8
    assert data["obs"].any() and data["state"].any()
    assert (data["terminated"] | data["truncated"]).any()  # 5-step episodes ended in 8 steps
    group = zarr.open_group(config.store_path, mode="r")
    # whole images of every env and agent; the region's 8 steps (under 16 MiB) in one chunk
    assert group["obs"].chunks == (T, N, A, *OBS) and group["state"].chunks == (T, N, *STATE)
    ds = open_replay(config.store_path)
    assert ds["obs"].dims == ("step", "env", "agent", "obs_height", "obs_width", "obs_channel")
    assert ds["state"].dims == ("step", "env", "state_height", "state_width", "state_channel")
    assert ds["obs"].dtype == np.uint8
    np.testing.assert_array_equal(ds["obs"].isel(step=3, env=1, agent=2).values, data["obs"][3, 1, 2])


def test_minari_export_keeps_the_images(mappo_run, tmp_path, monkeypatch):
    minari = pytest.importorskip("minari")
    from storage.minari_export import export_minari

    config, _ = mappo_run
    written = export_minari(config.store_path, "marl/pistonball-tiny-v0", out_dir=tmp_path)
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path))
    dataset = minari.load_dataset("marl/pistonball-tiny-v0")
    assert dataset.total_episodes == written["episodes"] > 0
    assert dataset.observation_space.shape == (A, *OBS) and dataset.observation_space.dtype == np.uint8
    episode = dataset[0]
    assert episode.observations.shape == (len(episode.rewards) + 1, A, *OBS)
    assert episode.observations.dtype == np.uint8 and episode.infos["state"].dtype == np.uint8
    data = ReplayStore.open(config.store_path).read_region(0)
    steps = len(episode.rewards)  # episode 0: env 0's first, from the region's first step
    np.testing.assert_array_equal(episode.observations[:steps], data["obs"][:steps, 0])
    np.testing.assert_array_equal(episode.infos["state"][:steps], data["state"][:steps, 0])


def test_mappo_updates_with_the_conv_encoder(mappo_run):
    _, result = mappo_run
    metrics = result["metrics"]
    assert metrics["updates"] == 1 and np.isfinite(metrics["learner"]["loss"])
    assert metrics["learner"]["actor_grad_norm"] > 0 and metrics["learner"]["critic_grad_norm"] > 0
    assert "encoder" in result["params"]["params"]  # the actor's conv encoder


def test_exported_policy_plays_like_its_learner(mappo_run, tmp_path, capsys):
    import marl
    from flows.cli import main
    from pipelines.saved_run import load_run

    config, _ = mappo_run
    out = tmp_path / "policy"
    assert main(["export", config.run_dir, "--out", str(out)]) == 0, capsys.readouterr().err
    policy = marl.load_policy(str(out))
    saved = load_run(config.run_dir)
    learner, params, env = saved.parts.single_seed, saved.params, saved.parts.env
    assert policy.spec == env.spec
    ts = env.reset(seed=1)
    carry = learner.init_carry(1)
    for _ in range(3):
        expected, carry, _ = learner.act(params, carry, ts.obs[None], ts.avail_actions[None], ts.first[None],
                                         jax.random.PRNGKey(0), learner.greedy)
        actions, _ = policy.act(ts.obs)  # one env, no batch axis
        np.testing.assert_array_equal(actions, np.asarray(expected)[0])
        ts = env.step(actions)
    with pytest.raises(marl.PolicyError, match=r"this policy takes \[env, 3 agents, 457, 120, 3\]"):
        policy.act(np.zeros((3, 10), np.float32))
    with pytest.raises(marl.PolicyError, match="obs are float32; this policy sees uint8 images"):
        policy.act(np.asarray(ts.obs, np.float32) / 255)


def test_qmix_updates_with_the_conv_encoder(tmp_path):
    config = tiny_run(tmp_path, "qmix-smac-tiny", "qmix", learning_starts="0", batch_size="2", seq_len="4",
                      updates_per_region="2", mixer_embed="4", hypernet_embed="8")
    try:
        result = collect_and_train(config)
    finally:
        stages.clear_caches()
    metrics = result["metrics"]
    assert metrics["updates"] == 2 and np.isfinite(metrics["learner"]["loss"]) and metrics["learner"]["grad_norm"] > 0
    assert "encoder" in result["params"]["params"]  # the agent network's conv encoder


@pytest.mark.skipif(not os.environ.get("MARL_ALL_ENVS"), reason="15 s on 2 cores; MARL_ALL_ENVS=1 runs it")
def test_maddpg_updates_with_conv_encoders_on_continuous_pistons(tmp_path):
    config = tiny_run(tmp_path, "maddpg-mpe-tiny", "maddpg", learning_starts="0", batch_size="4",
                      updates_per_region="1", n_step="1", twin_critics="false", actor_every="1",
                      env_kwargs=json.dumps({**KWARGS, "continuous": True}))
    try:
        result = collect_and_train(config)
    finally:
        stages.clear_caches()
    metrics = result["metrics"]
    assert metrics["updates"] == 1 and np.isfinite(metrics["learner"]["loss"])
    assert metrics["learner"]["actor_grad_norm"] > 0 and metrics["learner"]["critic_grad_norm"] > 0
    assert "encoder" in result["params"]["params"]  # each actor's conv encoder
