"""marl/: the env registry, the jitted rollout and the QMIX learner, on real jaxmarl envs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl import algos, buffer, envs, rollout


@pytest.fixture(scope="module")
def smax3m():
    env = envs.make("smax:3m")
    config = algos.config_for("qmix", {"hidden": 16, "mixer_embed": 8, "hypernet_embed": 16,
                                       "batch_size": 4, "seq_len": 8})
    return env, algos.make_learner("qmix", env.spec, config)


def test_registry_specs():
    spec = envs.spec_of("smax:3m")
    assert spec.agents == ("ally_0", "ally_1", "ally_2")
    assert (spec.obs_dim, spec.state_dim, spec.n_actions) == (75, 72, 8)
    assert spec.discrete and spec.has_avail_actions and spec.episode_limit == 100
    assert envs.spec_of("smax:2s3z").n_agents == 5
    assert envs.spec_of("smax:5m_vs_6m").n_actions == 11
    mpe = envs.spec_of("mpe:simple_spread")
    assert (mpe.n_agents, mpe.obs_dim, mpe.state_dim, mpe.n_actions, mpe.episode_limit) == (3, 18, 54, 5, 25)
    cont = envs.spec_of("mpe:simple_spread", action_type="Continuous")
    assert not cont.discrete and cont.action_dim == 5
    pz = envs.spec_of("pz:mpe2.simple_spread_v3")
    assert pz.backend == "numpy" and pz.agents == mpe.agents and pz.obs_dim == 18
    assert set(envs.env_ids()) >= {"smax:3m", "smax:2s3z", "smax:5m_vs_6m", "mpe:simple_spread"}


@pytest.mark.parametrize("bad, words", [
    ("smax:4m", ["unknown env id 'smax:4m'", "smax:3m", "pz:<module>.<env>"]),
    ("gym:CartPole", ["unknown env id", "mpe:simple_spread"]),
    ("pz:no_such_pkg.env_v0", ["unknown PettingZoo env", "pz:mpe2.simple_spread_v3"]),
])
def test_registry_errors_are_one_line(bad, words):
    with pytest.raises(envs.EnvError) as err:
        envs.make(bad)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words)


def test_bad_env_kwarg_lists_valid_ones():
    with pytest.raises(envs.EnvError, match="unknown env kwarg.*max_steps"):
        envs.make("smax:3m", max_stepz=10)


def test_pettingzoo_env_steps_in_numpy_with_auto_reset():
    env = envs.make("pz:mpe2.simple_spread_v3", max_cycles=5)
    ts = env.reset(seed=0)
    assert ts.obs.shape == (3, 18) and ts.state.shape == (54,)
    dones = [bool(env.step(np.zeros(3, np.int64)).done) for _ in range(10)]
    assert dones == [False] * 4 + [True] + [False] * 4 + [True]


def test_collect_shapes_masks_and_episode_stats(smax3m):
    env, learner = smax3m
    init, collect = rollout.make_collector(env, learner.act, learner.init_carry, n_envs=8, n_steps=64)
    state = learner.init(jax.random.PRNGKey(0))
    rs = init(jax.random.PRNGKey(1))
    for epsilon in (1.0, 0.0):  # random and greedy actions both respect the masks
        rs, data, stats = collect(learner.policy_params(state), rs, {"epsilon": jnp.float32(epsilon)})
        assert data["obs"].shape == (64, 8, 3, 75) and data["state"].shape == (64, 8, 72)
        assert data["action"].shape == (64, 8, 3) and data["avail_actions"].shape == (64, 8, 3, 8)
        chosen = np.take_along_axis(np.asarray(data["avail_actions"]), np.asarray(data["action"])[..., None], -1)
        assert chosen.all(), "an unavailable action was chosen"
    assert int(stats["episodes"]) == int(np.asarray(data["done"]).sum())
    assert collect._cache_size() == 1, "the rollout recompiled on a later call"


def test_evaluate_counts_one_episode_per_env(smax3m):
    env, learner = smax3m
    evaluate = rollout.make_evaluator(env, learner.act, learner.init_carry, 8, learner.greedy)
    stats = evaluate(learner.policy_params(learner.init(jax.random.PRNGKey(0))), jax.random.PRNGKey(3))
    assert int(stats["episodes"]) == 8 and 0 < float(stats["length_mean"]) <= 100
    assert 0.0 <= float(stats["win_rate"]) <= 1.0


def test_mixer_is_monotonic_in_every_agent_q(smax3m):
    env, learner = smax3m
    params = learner.init(jax.random.PRNGKey(0))["params"]["mixer"]
    q = jax.random.normal(jax.random.PRNGKey(1), (64, 3))
    s = jax.random.normal(jax.random.PRNGKey(2), (64, 72))
    grads = jax.vmap(jax.grad(lambda q, s: learner.mixer.apply(params, q, s)))(q, s)
    assert grads.shape == (64, 3) and float(grads.min()) >= 0.0


def test_qmix_update_fits_a_batch_and_copies_target(smax3m):
    env, learner = smax3m
    init, collect = rollout.make_collector(env, learner.act, learner.init_carry, n_envs=4, n_steps=16)
    state = learner.init(jax.random.PRNGKey(0))
    _, data, _ = collect(learner.policy_params(state), init(jax.random.PRNGKey(1)), {"epsilon": jnp.float32(1.0)})
    fields = {k: (v.shape[2:], v.dtype) for k, v in data.items()}
    arrays, valid = buffer.empty(fields, n_slots=2, steps=16, n_envs=4)
    arrays, valid = buffer.insert(arrays, valid, 0, data)
    batch = buffer.sample_windows(jax.random.PRNGKey(2), arrays, valid, 4, 8)
    assert batch["obs"].shape == (4, 8, 3, 75)
    batch = {**batch, "done": batch["done"].astype(jnp.float32)}
    losses = []
    for _ in range(30):
        state, metrics = learner.update(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    interval = learner.config.target_update_interval
    state = {**state, "updates": jnp.array(interval - 1, jnp.int32)}
    state, _ = learner.update(state, batch)
    same = jax.tree.map(lambda a, b: bool(jnp.all(a == b)), state["params"], state["target_params"])
    assert all(jax.tree.leaves(same)), "target network not copied at the interval"


def test_sampling_only_touches_committed_slots():
    fields = {"x": ((), "int32")}
    arrays, valid = buffer.empty(fields, n_slots=4, steps=8, n_envs=2)
    region = {"x": jnp.full((8, 2), 7, jnp.int32)}
    arrays, valid = buffer.insert(arrays, valid, 2, region)
    batch = buffer.sample_windows(jax.random.PRNGKey(0), arrays, valid, 64, 4)
    assert bool(jnp.all(batch["x"] == 7))


def test_bad_algorithm_settings():
    with pytest.raises(algos.ConfigError, match="unknown qmix setting 'lrr'.*lr"):
        algos.config_for("qmix", {"lrr": "0.1"})
    with pytest.raises(algos.ConfigError, match="not a valid int"):
        algos.config_for("qmix", {"hidden": "wide"})
    assert algos.config_for("qmix", {"lr": "1e-3", "hidden": "32"}).lr == 1e-3


def test_lambda_returns_match_a_hand_computed_window():
    from marl.qmix import lambda_returns

    r = jnp.array([[1.0, 0.0, 2.0]])
    d = jnp.array([[0.0, 1.0, 0.0]])  # the episode ends after the 2nd transition
    v = jnp.array([[10.0, 20.0, 30.0]])  # target Q_tot of the next step
    one_step = lambda_returns(r, d, v, 0.5, 0.0)
    np.testing.assert_allclose(one_step, [[1 + 0.5 * 10, 0.0, 2 + 0.5 * 30]])
    g = lambda_returns(r, d, v, 0.5, 0.5)
    g2 = 2 + 0.5 * 30
    g1 = 0.0  # terminal: no bootstrap
    g0 = 1 + 0.5 * (0.5 * 10 + 0.5 * g1)
    np.testing.assert_allclose(g, [[g0, g1, g2]])
