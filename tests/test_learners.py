"""IQL and VDN beside QMIX, several seeds in one learner, and PettingZoo envs on CPU workers."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl import algos, buffer, envs, rollout, seeds
from pipelines import cluster, stages
from pipelines.config import make_run_config
from storage import Checkpointer, ReplayStore, open_replay

TINY = "qmix-smac-tiny"
SMALL = {"hidden": 16, "mixer_embed": 8, "hypernet_embed": 16, "batch_size": 4, "seq_len": 8}


@pytest.fixture(scope="module")
def smax_windows():
    """Windows of real SMAX 3m play, collected once with a random QMIX policy."""
    env = envs.make("smax:3m")
    learner = algos.make_learner("qmix", env.spec, algos.config_for("qmix", SMALL))
    init, collect = rollout.make_collector(env, learner.act, learner.init_carry, 4, 16)
    state = learner.init(jax.random.PRNGKey(0))
    _, data, _ = collect(learner.policy_params(state), init(jax.random.PRNGKey(1)),
                         learner.exploration(jnp.float32(0)))
    arrays = buffer.insert(buffer.empty({k: (v.shape[2:], v.dtype) for k, v in data.items()}, 1, 16, 4),
                           0, data)
    ring = buffer.ring({0: 0}, 1, 1)
    return env, arrays, ring, buffer.sample_windows(jax.random.PRNGKey(2), arrays, ring,
                                                    buffer.window_starts(arrays, ring, 8), 4, 8)


def test_vdn_mixes_by_sum_and_iql_keeps_one_target_per_agent(smax_windows):
    env, arrays, ring, windows = smax_windows
    out = {}
    for algo in ("qmix", "vdn", "iql"):
        learner = algos.make_learner(algo, env.spec, algos.config_for(algo, SMALL))
        assert learner.name == algo
        state = learner.init(jax.random.PRNGKey(0))
        out[algo] = learner.score(state, windows)
        state, metrics = learner.train(state, arrays, ring, 3)
        assert np.isfinite(float(metrics["loss"])) and int(state["updates"]) == 3
    vdn = out["vdn"]
    np.testing.assert_allclose(vdn["q_tot"][0], vdn["q_taken"][0].sum(-1), rtol=1e-5, atol=1e-5)
    assert out["vdn"]["td_error"][1] == () and out["qmix"]["td_error"][1] == ()
    assert out["iql"]["td_error"][0].shape == (4, 8, 3) and out["iql"]["td_error"][1] == ("agent",)
    # the last step of a window has no next step, hence no target
    assert np.isnan(out["iql"]["td_error"][0][:, -1]).all()
    assert np.isfinite(out["iql"]["td_error"][0][:, :-1]).all()


def test_qmix_mixer_init_scale_shrinks_the_mixer_and_its_default_keeps_flax_init(smax_windows):
    env = smax_windows[0]
    params = {scale: algos.make_learner("qmix", env.spec, algos.config_for("qmix", {**SMALL, "mixer_init_scale": scale}))
              .init(jax.random.PRNGKey(0))["params"] for scale in (1.0, 0.01)}
    # the default is Flax's own Dense init (LeCun normal), the same draws as before the setting
    default = jax.nn.initializers.lecun_normal()
    kernel = params[1.0]["mixer"]["params"]["Dense_0"]["kernel"]
    assert kernel.std() == pytest.approx(float(default(jax.random.PRNGKey(3), kernel.shape).std()), rel=0.2)
    for name, layer in params[1.0]["mixer"]["params"].items():
        small = params[0.01]["mixer"]["params"][name]["kernel"]
        np.testing.assert_allclose(small, 0.01 * layer["kernel"], rtol=1e-4, atol=1e-8)
    # the agents' network is not the mixer's: unchanged
    jax.tree.map(np.testing.assert_array_equal, params[1.0]["agent"], params[0.01]["agent"])


def test_qmix_lr_anneals_to_zero_over_its_iterations_and_stays_constant_by_default(smax_windows):
    env, arrays, ring, _ = smax_windows
    lrs = {}
    for anneal in (0, 2):
        config = algos.config_for("qmix", {**SMALL, "updates_per_region": 4, "anneal_lr_iterations": anneal})
        learner = algos.make_learner("qmix", env.spec, config)
        state = learner.init(jax.random.PRNGKey(0))
        lrs[anneal] = []
        for _ in range(3):  # three regions of 4 updates: the anneal spans the first two
            state, metrics = learner.train(state, arrays, ring, 4)
            lrs[anneal].append(float(metrics["lr"]))
    assert lrs[0] == pytest.approx([config.lr] * 3)
    # the mean lr of each region's updates (steps 0-3 of 8, 4-7, then past the anneal)
    assert lrs[2] == pytest.approx([config.lr * 13 / 16, config.lr * 5 / 16, 0.0], abs=1e-9)


@pytest.mark.parametrize("algo, env_id, settings, read", [
    ("qmix", "smax:3m", {"eps_start": 1.0, "eps_end": 0.05, "eps_decay_steps": 1000}, "epsilon"),
    ("maddpg", "mpe:simple_spread", {"noise_start": 0.5, "noise_end": 0.1, "noise_decay_steps": 1000}, "noise_std"),
])
def test_exploration_falls_linearly_over_its_env_steps_then_holds(algo, env_id, settings, read):
    env = envs.make(env_id)
    learner = algos.make_learner(algo, env.spec, algos.config_for(algo, settings))
    start, end = list(settings.values())[:2]
    got = [float(learner.exploration(jnp.float32(steps))[read]) for steps in (0, 250, 1000, 10**7)]
    assert got == pytest.approx([start, start + 0.25 * (end - start), end, end])


def test_seeds_split_and_join_envs_in_blocks():
    x = jnp.arange(2 * 3 * 6).reshape(2, 6, 3)  # [T, S*N, ...] with S=3, N=2
    split = seeds.split_envs(x, 3, axis=1)
    assert split.shape == (3, 2, 2, 3)
    np.testing.assert_array_equal(split[1], x[:, 2:4])  # seed 1 owns envs 2 and 3
    np.testing.assert_array_equal(seeds.join_envs(split, axis=1), x)


SEEDS_INIT = """
import jax, numpy as np
from marl import algos, envs, seeds
env = envs.make("smax:3m")
learner = algos.make_learner("mappo", env.spec, algos.config_for("mappo", {"recurrent": True, "hidden": 128}))
key = jax.random.PRNGKey(5)
state = jax.block_until_ready(seeds.vmap_seeds(learner, 3).init(key))
for s, k in enumerate(jax.random.split(key, 3)):  # each seed is that seed's own init
    one = learner.init(k)
    assert all(np.array_equal(a[s], b) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(one)))
print("initialised")
"""


def test_several_seeds_initialise_without_the_batched_qr_deadlock():
    """vmap over seeds of an init with orthogonal initialisers made XLA:CPU run batched QRs
    that deadlock its 2-thread pool (MAPPO's recurrent actor, 3 seeds: a hang on every try);
    seeds are initialised one by one. In a subprocess, so a hang fails instead of stalling."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SEEDS_INIT], capture_output=True, text=True, timeout=180,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0 and "initialised" in done.stdout, done.stderr[-2000:]


def test_flow_trains_independent_seeds_in_one_learner(tmp_path, prefect_server, dask_cluster):
    from flows.train import marl_train

    run_dir = str(tmp_path / "run")
    result = marl_train(preset=TINY, run_dir=run_dir, env_steps=1024, seeds=3,
                        overrides={"n_collectors": "1", "learning_starts": "1", "eval_every": "2"},
                        scheduler_address=dask_cluster.scheduler_address)
    # env steps count per seed: 1024 = 4 iterations x 8 envs x 32 steps, for each of 3 seeds
    assert result["iterations"] == 4 and result["env_steps"] == 1024
    ds = open_replay(os.path.join(run_dir, "replay"))
    assert ds.sizes["env"] == 3 * 8 and list(np.bincount(ds.seed.values)) == [8, 8, 8]
    final = result["final_eval"]
    assert len(final["win_rate_per_seed"]) == 3 and "return_mean_std" in final
    assert "test_win_rate_std" in result["history"][-1]
    checkpoints = Checkpointer(os.path.join(run_dir, "checkpoints"))
    try:
        template = jax.tree.map(np.asarray, seeds.vmap_seeds(
            algos.make_learner("qmix", envs.spec_of("smax:3m"), make_run_config(TINY).algo_config()), 3
        ).init(jax.random.PRNGKey(0)))
        state, meta = checkpoints.restore(target=template)
    finally:
        checkpoints.close()
    assert list(state["updates"]) == [8, 8, 8]  # 4 iterations x 2 updates, for every seed
    kernels = state["params"]["agent"]["params"]["Dense_0"]["kernel"]
    assert not np.allclose(kernels[0], kernels[1]) and not np.allclose(kernels[1], kernels[2])


def test_vdn_on_a_pettingzoo_env_collects_on_cpu_workers(tmp_path, prefect_server, dask_cluster):
    from flows.train import marl_train

    run_dir = str(tmp_path / "run")
    result = marl_train(preset=TINY, env="pz:mpe2.simple_spread_v3", run_dir=run_dir, env_steps=512,
                        overrides={"algo": "vdn", "n_collectors": "1", "learning_starts": "1",
                                   "env_kwargs": '{"max_cycles": 25}'},
                        scheduler_address=dask_cluster.scheduler_address)
    assert result["iterations"] == 2
    store = ReplayStore.open(os.path.join(run_dir, "replay"))
    assert store.attrs["env_id"] == "pz:mpe2.simple_spread_v3" and store.attrs["algorithm"] == "vdn"
    ds = open_replay(os.path.join(run_dir, "replay"))
    assert ds.sizes["step"] == 64 and ds.sizes["agent"] == 3
    # MPE episodes last max_cycles steps: in 64 steps every env ended exactly 2 of them,
    # each by PettingZoo's truncation; each env's next episode starts right after
    assert int(ds.truncated.sum()) == 2 * 8 and not bool(ds.terminated.any())
    first = ds.first.values
    assert first[0].all() and (first[1:] == ds.truncated.values[:-1]).all()
    assert result["final_eval"]["length_mean"] == 25.0
    with __import__("distributed").Client(dask_cluster.scheduler_address) as client:
        where = cluster.placement(client, env_backend=stages.env_backend(
            make_run_config(TINY, env_id="pz:mpe2.simple_spread_v3").to_dict()))
        resources = client.scheduler_info()["workers"]
        assert all(not resources[w]["resources"].get("gpu") for w in where["collectors"])


def test_every_training_deployment_names_a_preset():
    import yaml

    from pipelines.config import PRESETS

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "prefect.yaml")) as f:
        deployments = yaml.safe_load(f)["deployments"]
    train = {d["name"]: d for d in deployments if d["entrypoint"] == "flows/train.py:marl_train"}
    assert set(train) >= {"qmix-smac", "mappo-smax", "mappo-mpe", "maddpg-mpe", "ippo-mpe", "vdn-smax",
                          "mappo-pz-spread"}
    for name, d in train.items():
        assert d["parameters"]["preset"] == name and name in PRESETS
        assert d["work_pool"]["name"] == "marl-process"


def test_the_smax_maps_per_map_settings_are_valid_settings_of_their_preset():
    """bench/smax_maps.py's MAP_SETTINGS are what the table's met rows ran with: each one
    makes a checked run config of its algorithm's preset on its map, with those values."""
    import runpy

    from pipelines.config import make_run_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bench = runpy.run_path(os.path.join(root, "bench", "smax_maps.py"))
    assert ("qmix", "8m") in bench["MAP_SETTINGS"]
    for (algo, scenario), settings in bench["MAP_SETTINGS"].items():
        config = make_run_config(bench["PRESETS"][algo], env_id=f"smax:{scenario}",
                                 total_env_steps=bench["TARGETS"][scenario][0], overrides=settings)
        values = {**config.to_dict(), **config.to_dict()["algo_overrides"]}
        assert {key: str(values[key]) for key in settings} == settings


def test_smax_maps_refuses_to_resume_a_run_root_under_other_settings(tmp_path):
    """A run root is one trial: the same root asked for other --set values (a reused device
    /tmp once reported a finished run under the next trial's settings) stops in one line
    that names both, and the trial's wall log is left as it was."""
    import argparse
    import json
    import runpy

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bench = runpy.run_path(os.path.join(root, "bench", "smax_maps.py"))
    run_dir = tmp_path / "mappo-8m"
    run_dir.mkdir()
    log = {"sittings": [{"wall_s": 210.0}], "rows": {"244": {"wall_s": 209.0}}, "settings": {"ent_coef": "0.01"}}
    (run_dir / "bench_wall.json").write_text(json.dumps(log))
    args = argparse.Namespace(run_root=str(tmp_path), budget_scale=1.0)
    with pytest.raises(SystemExit) as stop:
        bench["train"]("mappo", "8m", args, {"clip_eps": "0.1"})
    message = str(stop.value)
    assert "{'ent_coef': '0.01'}" in message and "{'clip_eps': '0.1'}" in message
    assert "--run-root" in message and "\n" not in message
    assert json.loads((run_dir / "bench_wall.json").read_text()) == log


def test_smax_behaviour_measures_margins_targets_and_hurt_allies_on_hand_made_steps():
    """bench/smax_behaviour.py's measures on 3 hand-made steps of 2 envs (2 marines against 2):
    env 0 won at its second step, env 1 lost at its third."""
    import runpy

    import numpy as np

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    behaviour = runpy.run_path(os.path.join(root, "bench", "smax_behaviour.py"))["behaviour"]
    T, N, full = 3, 2, 45.0
    health = np.full((T, N, 4), full)  # [step, env, unit]: allies 0-1, enemies 2-3
    alive = np.ones((T, N, 4), bool)
    avail = np.zeros((T, N, 2, 7), bool)
    avail[..., :5] = avail[..., 5:] = True  # every move, stop and both enemies in reach
    action = np.full((T, N, 2), 4)
    health[0, 0, 2:] = 30, full  # step 0, env 0: both allies on enemy 0, the weaker
    action[0, 0] = 5, 5
    health[0, 1, 2:] = full, 20  # env 1: one ally on the weaker (enemy 1), one on the other
    action[0, 1] = 6, 5
    health[1, 0] = full, 10, 5, full  # step 1, env 0: ally 1 hurt and moving; ally 0 reaches enemy 1 alone
    avail[1, 0, 0, 5] = False
    action[1, 0] = 6, 0
    health[1, 1] = full, 10, full, 20  # env 1: hurt ally 1 attacks, both on the weaker enemy 1
    action[1, 1] = 6, 6
    health[2, 1, 1], alive[2, 1, 1] = 0.0, False  # step 2, env 1: ally 1 dead, the allies lose
    live = np.array([[True, True], [True, True], [False, True]])
    ended = np.array([[False, False], [True, False], [False, True]])
    won = np.array([[False, False], [True, False], [False, False]])
    m = behaviour({"action": action, "avail": avail, "health": health, "alive": alive, "live": live,
                   "ended": ended, "won": won}, 2)
    assert m["win"] == 0.5 and m["episodes"] == 2
    assert m["won_allies_alive"] == 2 and m["won_length"] == 2 and m["lost_enemies_alive"] == 2
    assert m["won_ally_health"] == pytest.approx((1 + 10 / 45) / 2)
    assert m["targets_per_attacker"] == pytest.approx((0.5 + 1.0 + 0.5) / 3)
    assert m["on_weakest"] == pytest.approx(6 / 7)
    assert m["hurt_moving"] == 0.5  # of the two hurt allies' steps in reach, one moved


def test_cpu_sized_presets_say_how_to_size_a_run_for_an_accelerator():
    from pipelines.config import accelerator_hint, make_run_config

    hint = accelerator_hint(make_run_config("mappo-mpe"))
    assert "mappo-mpe-accel or --set envs_per_collector=1024" in hint and "\n" not in hint
    assert "replay ratio" in accelerator_hint(make_run_config("qmix-smac"))  # off-policy: scale the updates too
    accel, cpu = make_run_config("mappo-mpe-accel"), make_run_config("mappo-mpe")
    assert accelerator_hint(accel) is None and accel.n_iterations == 20
    # the same learner and settings, only the run's size differs
    differ = {k for k, v in accel.to_dict().items() if cpu.to_dict()[k] != v}
    assert differ == {"preset", "run_dir", "envs_per_collector", "total_env_steps", "buffer_transitions"}
    # the off-policy accelerator presets keep their CPU preset's replay ratio (updates per env step)
    for name, slots in [("maddpg-mpe", 4), ("qmix-smac", 7)]:
        accel, cpu = make_run_config(name + "-accel"), make_run_config(name)
        assert accelerator_hint(accel) is None and f"{name}-accel or" in accelerator_hint(cpu)
        ratio = [c.algo_config().updates_per_region / c.transitions_per_region for c in (accel, cpu)]
        assert ratio[0] == ratio[1] and accel.n_slots == slots
