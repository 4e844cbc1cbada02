"""marl/: the env registry, the jitted rollout and the QMIX learner, on real jaxmarl envs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl import algos, buffer, envs, rollout, transition


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
    assert ts.first and not ts.terminated and not ts.truncated
    steps = [env.step(np.zeros(3, np.int64)) for _ in range(10)]
    # max_cycles ends every episode by PettingZoo's truncations: truncated, never terminated
    assert [bool(s.truncated) for s in steps] == [False] * 4 + [True] + [False] * 4 + [True]
    assert not any(s.terminated for s in steps)
    assert [bool(s.first) for s in steps] == [bool(s.truncated) for s in steps]  # auto-reset obs


class _EndsBy:
    """A stand-in PettingZoo env whose 2nd step ends the episode with the given flags."""

    def __init__(self, term, trunc):
        self.term, self.trunc = term, trunc
        self.possible_agents = ["a", "b"]

    def reset(self, seed=None):
        self.agents, self.t = list(self.possible_agents), 0
        return {a: np.zeros(2, np.float32) for a in self.agents}, {}

    def step(self, actions):
        self.t += 1
        end = self.t == 2
        obs = {a: np.zeros(2, np.float32) for a in self.agents}
        rew = {a: 0.0 for a in self.agents}
        term = {a: end and self.term[i] for i, a in enumerate(self.agents)}
        trunc = {a: end and self.trunc[i] for i, a in enumerate(self.agents)}
        if end:
            self.agents = []
        return obs, rew, term, trunc, {}


@pytest.mark.parametrize("term, trunc, expect", [
    ((True, True), (False, False), "terminated"),
    ((False, False), (True, True), "truncated"),
    ((True, False), (False, True), "truncated"),  # the limit cut off an agent still going
    ((True, True), (True, True), "terminated"),  # both: a real end
])
def test_pettingzoo_end_is_truncated_where_the_time_limit_cut_a_live_agent(term, trunc, expect):
    spec = envs.EnvSpec("pz:x", ("a", "b"), 2, 4, True, 2, 0, 0.0, 0.0, False, 2, "numpy")
    env = envs.PettingZooEnv(lambda: _EndsBy(term, trunc), spec)
    env.reset(seed=0)
    ts = env.step(np.zeros(2, np.int64))
    assert not (ts.first or ts.terminated or ts.truncated)
    ts = env.step(np.zeros(2, np.int64))
    assert ts.first and bool(ts.terminated) == (expect == "terminated") and bool(ts.truncated) == (expect == "truncated")


def _smax_step_from(env, edit, key=0):
    """One SMAX step (all agents no-op) from a fresh state changed by `edit`."""
    _, state = env.reset(jax.random.PRNGKey(key))
    state = state.replace(state=edit(state.state))
    return env.step(jax.random.PRNGKey(key + 1), state, jnp.zeros(3, jnp.int32))[0]


def test_smax_elimination_is_terminated_and_the_step_limit_truncated():
    env = envs.make("smax:3m")
    n = env.env.num_allies
    # the enemies are all dead: a won, terminated (not truncated) end
    ts = _smax_step_from(env, lambda s: s.replace(unit_health=s.unit_health.at[n:].set(0.0)))
    assert ts.terminated and not ts.truncated and ts.won and ts.first
    # the allies are all dead: a lost, terminated end
    ts = _smax_step_from(env, lambda s: s.replace(unit_health=s.unit_health.at[:n].set(0.0)))
    assert ts.terminated and not ts.truncated and not ts.won
    # the step limit with both sides alive: truncated, not terminated, not won
    ts = _smax_step_from(env, lambda s: s.replace(step=jnp.asarray(env.spec.episode_limit, s.step.dtype)))
    assert ts.truncated and not ts.terminated and not ts.won and ts.first
    # the limit on the step a side is wiped out: a real end
    ts = _smax_step_from(env, lambda s: s.replace(step=jnp.asarray(env.spec.episode_limit, s.step.dtype),
                                                  unit_health=s.unit_health.at[n:].set(0.0)))
    assert ts.terminated and not ts.truncated and ts.won
    # a mid-episode step
    ts = _smax_step_from(env, lambda s: s)
    assert not (ts.first or ts.terminated or ts.truncated)


def _episode_lengths(data):
    """(end steps' episode lengths, their terminated, truncated) over a [T, N] record whose
    collector started at step 0 (every env's first episode begins there)."""
    end = np.asarray(transition.done(data))
    first = np.asarray(data["first"])
    T, N = end.shape
    lengths, term, trunc = [], [], []
    for e in range(N):
        begin = 0
        for t in range(T):
            if first[t, e]:
                begin = t
            if end[t, e]:
                lengths.append(t + 1 - begin)
                term.append(bool(data["terminated"][t, e]))
                trunc.append(bool(data["truncated"][t, e]))
    return np.array(lengths), np.array(term), np.array(trunc)


def test_collected_smax_and_mpe_episodes_end_as_they_should(smax3m):
    _, learner = smax3m
    # SMAX with a 20-step limit: random play ends some episodes by elimination (terminated,
    # shorter than the limit) and the others at the limit (truncated, 21 steps as jaxmarl counts)
    env = envs.make("smax:3m", max_steps=20)
    init, collect = rollout.make_collector(env, learner.act, learner.init_carry, n_envs=16, n_steps=48)
    state = learner.init(jax.random.PRNGKey(0))
    _, data, _ = collect(learner.policy_params(state), init(jax.random.PRNGKey(1)), {"epsilon": jnp.float32(1.0)})
    lengths, term, trunc = _episode_lengths(data)
    assert not (term & trunc).any() and (term | trunc).all()
    assert term.any() and trunc.any()
    assert (lengths[trunc] == 21).all() and (lengths[term] <= 21).all()
    won = np.asarray(data["won"])
    assert not (won & ~np.asarray(data["terminated"])).any(), "a win that is not a real end"
    # MPE: every end is the time limit
    mpe = envs.make("mpe:simple_spread")
    qmix = algos.make_learner("qmix", mpe.spec, algos.config_for("qmix", {"hidden": 8}))
    init, collect = rollout.make_collector(mpe, qmix.act, qmix.init_carry, n_envs=4, n_steps=60)
    _, data, stats = collect(qmix.policy_params(qmix.init(jax.random.PRNGKey(0))), init(jax.random.PRNGKey(1)),
                             {"epsilon": jnp.float32(1.0)})
    lengths, term, trunc = _episode_lengths(data)
    assert len(lengths) == 4 * 2 and trunc.all() and not term.any() and (lengths == 26).all()
    assert int(stats["episodes"]) == 8


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
    done = np.asarray(transition.done(data))
    assert int(stats["episodes"]) == int(done.sum())
    assert collect._cache_size() == 1, "the rollout recompiled on a later call"
    # `first`: True at the collector's very first step (the first call's data are gone, so
    # check a fresh collector) and right after every end, also across calls (regions)
    first = np.asarray(data["first"])
    np.testing.assert_array_equal(first[1:], done[:-1])
    rs2, data2, _ = collect(learner.policy_params(state), rs, {"epsilon": jnp.float32(1.0)})
    np.testing.assert_array_equal(np.asarray(data2["first"])[0], done[-1])
    _, fresh, _ = collect(learner.policy_params(state), init(jax.random.PRNGKey(7)), {"epsilon": jnp.float32(1.0)})
    assert np.asarray(fresh["first"])[0].all()
    assert set(data) == set(transition.FIELDS), "a record holds exactly the Transition's fields"


def test_evaluate_counts_one_episode_per_env(smax3m):
    env, learner = smax3m
    evaluate = rollout.make_evaluator(env, learner.act, learner.init_carry, 8, learner.greedy)
    stats = evaluate(learner.policy_params(learner.init(jax.random.PRNGKey(0))), jax.random.PRNGKey(3))
    assert int(stats["episodes"]) == 8 and 0 < float(stats["length_mean"]) <= 100
    assert 0.0 <= float(stats["win_rate"]) <= 1.0


def test_evaluate_replays_one_start_where_given_one():
    """MPE's dynamics have no dice and the greedy policy none either, so N replays of one
    start score exactly as that start played once, whatever the steps' keys; fresh starts differ."""
    env = envs.make("mpe:simple_spread")
    learner = algos.make_learner("mappo", env.spec, algos.config_for("mappo", {"hidden": 8}))
    params = learner.policy_params(learner.init(jax.random.PRNGKey(0)))
    replays, once = (rollout.make_evaluator(env, learner.act, learner.init_carry, n, learner.greedy) for n in (4, 1))
    start = jax.random.PRNGKey(5)
    replayed = float(replays(params, jax.random.PRNGKey(1), start)["return_mean"])
    assert replayed == pytest.approx(float(once(params, jax.random.PRNGKey(2), start)["return_mean"]), rel=1e-5)
    fresh = [float(once(params, jax.random.PRNGKey(k))["return_mean"]) for k in (1, 2)]
    assert fresh[0] != pytest.approx(fresh[1], rel=1e-3)


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
    arrays = buffer.insert(buffer.empty(fields, n_slots=2, steps=16, n_envs=4), 0, data)
    ring = buffer.ring({0: 0}, 2, 1)
    batch = buffer.sample_windows(jax.random.PRNGKey(2), arrays, ring,
                                  buffer.window_starts(arrays, ring, 8), 4, 8)
    assert batch["obs"].shape == (4, 8, 3, 75)
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


@pytest.mark.parametrize("last_action", [False, True])
def test_greedy_acting_and_the_trained_unroll_see_the_same_q_values(smax3m, last_action):
    """A greedy fresh collector's region, unrolled as a training window from its first step
    (memory and previous action zeroed there, as acting had them), takes the argmax action at
    every step, across episode ends; with last_action the agents also see their own
    previous action, which the acting carry holds one-hot."""
    import dataclasses

    env, small = smax3m
    learner = algos.make_learner("qmix", env.spec, dataclasses.replace(small.config, last_action=last_action))
    init, collect = rollout.make_collector(env, learner.act, learner.init_carry, n_envs=4, n_steps=48)
    state = learner.init(jax.random.PRNGKey(0))
    rs, data, _ = collect(learner.policy_params(state), init(jax.random.PRNGKey(1)), learner.greedy)
    carry = np.asarray(rs.policy_carry)
    assert carry.shape == (4, 3, 16 + (8 if last_action else 0))
    if last_action:  # the last step's action, one-hot, unless that step ended its episode
        live = ~np.asarray(transition.done(data))[-1]
        np.testing.assert_array_equal(carry[live, :, 16:].argmax(-1), np.asarray(data["action"])[-1][live])
    assert np.asarray(transition.done(data)).any(), "no episode ended inside the region"
    scores = learner.score(state, {k: jnp.swapaxes(v, 0, 1) for k, v in data.items()})
    np.testing.assert_allclose(scores["q_taken"][0], scores["q_max"][0], rtol=1e-5, atol=1e-6)


def test_store_fields_derive_from_the_transition():
    spec = envs.spec_of("smax:3m")
    fields = transition.store_fields(spec, {"logp": ((3,), "float32", ("agent",))})
    assert list(fields) == [*transition.FIELDS, "logp"]
    assert "done" not in fields and fields["first"] == ((), "bool", ())
    assert fields["obs"] == ((3, 75), "float32", ("agent", "obs_dim"))
    assert fields["action"] == ((3,), "int32", ("agent",))
    cont = transition.store_fields(envs.spec_of("mpe:simple_spread", action_type="Continuous"), {})
    assert cont["action"] == ((3, 5), "float32", ("agent", "act_dim"))
    with pytest.raises(ValueError, match="extra field 'reward'"):
        transition.store_fields(spec, {"reward": ((), "float32", ())})
    # a Transition flattens to the record the store writes, and back
    t = transition.Transition(*range(9), extras={"logp": 9})
    record = transition.to_record(t)
    assert record == {**dict(zip(transition.FIELDS, range(9))), "logp": 9}
    assert transition.from_record(record) == t
    flags = {"terminated": np.array([True, False, False]), "truncated": np.array([False, True, False])}
    np.testing.assert_array_equal(transition.done(flags), [True, True, False])


def test_sampling_only_touches_committed_slots():
    fields = {"x": ((), "int32"), "first": ((), "bool")}
    arrays = buffer.empty(fields, n_slots=4, steps=8, n_envs=2)
    region = {"x": jnp.full((8, 2), 7, jnp.int32), "first": jnp.zeros((8, 2), bool)}
    arrays = buffer.insert(arrays, 2, region)
    ring = buffer.ring({2: 5}, 4, 1)
    batch = buffer.sample_windows(jax.random.PRNGKey(0), arrays, ring,
                                  buffer.window_starts(arrays, ring, 4), 64, 4)
    assert bool(jnp.all(batch["x"] == 7))


def test_a_mirror_of_several_seeds_keeps_each_seeds_envs_apart():
    # seed s owns envs [s*N, (s+1)*N) of a region; the mirror holds them at arrays[s]
    arrays = buffer.empty({"x": ((), "int32")}, n_slots=3, steps=2, n_envs=6, n_seeds=3)
    assert arrays["x"].shape == (3, 3, 2, 2)
    region = {"x": jnp.arange(12, dtype=jnp.int32).reshape(2, 6)}  # [T, S*N]
    arrays = buffer.insert(arrays, 1, region, n_seeds=3)
    for s in range(3):
        np.testing.assert_array_equal(arrays["x"][s, 1], region["x"][:, 2 * s:2 * s + 2])
    assert not bool(jnp.any(arrays["x"][:, 0]))


def test_bad_algorithm_settings():
    with pytest.raises(algos.ConfigError, match="unknown qmix setting 'lrr'.*lr"):
        algos.config_for("qmix", {"lrr": "0.1"})
    with pytest.raises(algos.ConfigError, match="not a valid int"):
        algos.config_for("qmix", {"hidden": "wide"})
    assert algos.config_for("qmix", {"lr": "1e-3", "hidden": "32"}).lr == 1e-3
    import dataclasses

    images = dataclasses.replace(envs.spec_of("smax:3m"), obs_shape=(8, 8, 3))
    with_last = algos.config_for("qmix", {"last_action": "true"})
    with pytest.raises(algos.ConfigError, match="needs vector observations and smax:3m gives images; --set last_action=false"):
        algos.check_env("qmix", images, with_last)  # before anything starts
    with pytest.raises(ValueError, match="needs vector observations"):
        algos.make_learner("qmix", images, with_last)


def test_lambda_returns_match_a_hand_computed_window():
    from marl.qmix import lambda_returns

    r = jnp.array([[1.0, 0.0, 2.0]])
    d = jnp.array([[0.0, 1.0, 0.0]])  # the episode ends after the 2nd transition
    v = jnp.array([[10.0, 20.0, 30.0]])  # target Q_tot of the next step
    last = jnp.array([[False, False, True]])  # only the window's last step has no G of its own
    one_step = lambda_returns(r, d, v, last, 0.5, 0.0)
    np.testing.assert_allclose(one_step, [[1 + 0.5 * 10, 0.0, 2 + 0.5 * 30]])
    g = lambda_returns(r, d, v, last, 0.5, 0.5)
    g2 = 2 + 0.5 * 30
    g1 = 0.0  # terminal: no bootstrap
    g0 = 1 + 0.5 * (0.5 * 10 + 0.5 * g1)
    np.testing.assert_allclose(g, [[g0, g1, g2]])
