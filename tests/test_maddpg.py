"""MADDPG: the parts that can be wrong silently (soft target updates, masking, bounds, the
critic's TD step), on real jaxmarl MPE data, and a tiny preset through the real pipeline."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl import algos, buffer, envs, maddpg, rollout
from pipelines.config import make_run_config
from pipelines.stages import replay_fields
from storage import ReplayStore, open_replay

TINY = "maddpg-mpe-tiny"
SMALL = {"hidden": "16", "batch_size": "64", "tau": "0.25"}


def real_windows(env_kwargs: dict, overrides: dict, length: int = 2, batch: int = 64):
    """A learner and windows sampled from two regions of real simple spread rollouts."""
    env = envs.make("mpe:simple_spread", **env_kwargs)
    learner = algos.make_learner("maddpg", env.spec, algos.config_for("maddpg", overrides))
    train_state = learner.init(jax.random.PRNGKey(0))
    # 40-step regions of 26-step episodes: the second region has an episode end inside
    init, collect = rollout.make_collector(env, learner.act, learner.init_carry, 8, 40)
    fields = {k: (f.shape, f.dtype) for k, f in replay_fields(env.spec, learner).items()}
    arrays = buffer.empty(fields, 2, 40, 8)
    rstate = init(jax.random.PRNGKey(1))
    for slot in range(2):
        rstate, data, _ = collect(learner.policy_params(train_state), rstate,
                                  learner.exploration(jnp.float32(0)))
        arrays = buffer.insert(arrays, slot, data)
    ring = buffer.ring({0: 0, 1: 1}, 2, 1)
    windows = buffer.sample_windows(jax.random.PRNGKey(2), arrays, ring,
                                    buffer.window_starts(arrays, ring, length), batch, length)
    return env, learner, train_state, windows, data


@pytest.fixture(scope="module")
def continuous():
    return real_windows({"action_type": "Continuous"}, SMALL)


def test_target_networks_follow_by_exact_polyak_averaging(continuous):
    _, learner, state, windows, _ = continuous
    tau = learner.config.tau
    new, _ = learner.update(state, windows)
    leaves = lambda tree: jax.tree.leaves(jax.tree.map(np.asarray, tree))
    for target, online, old in zip(leaves(new["target_params"]), leaves(new["params"]),
                                   leaves(state["target_params"])):
        expected = (np.float32(1 - tau) * old + np.float32(tau) * online).astype(np.float32)
        np.testing.assert_allclose(target, expected, rtol=1e-6, atol=1e-7)
    # the online networks moved, so the check is not trivially target == online
    assert any(not np.allclose(t, o) for t, o in zip(leaves(new["target_params"]), leaves(new["params"])))
    assert int(new["updates"]) == 1


def test_continuous_actions_stay_in_bounds(continuous):
    env, learner, state, _, data = continuous
    low, high = env.spec.action_low, env.spec.action_high
    assert data["action"].shape == (40, 8, 3, env.spec.action_dim)
    assert float(data["action"].min()) >= low and float(data["action"].max()) <= high
    obs = jax.random.normal(jax.random.PRNGKey(3), (512, 3, env.spec.obs_dim)) * 50.0
    params, act = learner.policy_params(state), jax.jit(learner.act)
    taken = []
    for explore in ({"noise_std": jnp.float32(10.0), "sample": jnp.float32(1.0)}, learner.greedy):
        actions, _, _ = act(params, learner.init_carry(512), obs, jnp.ones((512, 3, 1), bool),
                            jnp.zeros(512, bool), jax.random.PRNGKey(4), explore)
        assert actions.shape == (512, 3, env.spec.action_dim)
        assert float(actions.min()) >= low and float(actions.max()) <= high
        taken.append(np.asarray(actions))
    assert (taken[0] != taken[1]).mean() > 0.5  # the noise explores; greedy has none
    # the noise scale decays from noise_start to noise_end
    stds = [float(learner.exploration(jnp.float32(s))["noise_std"]) for s in (0, 10**9)]
    np.testing.assert_allclose(stds, [learner.config.noise_start, learner.config.noise_end], rtol=1e-6)


def test_learned_std_actor_samples_in_training_and_is_deterministic_when_greedy(continuous):
    env, _, _, windows, _ = continuous
    learner = algos.make_learner("maddpg", env.spec, algos.config_for("maddpg", {**SMALL, "learned_std": "true"}))
    state = learner.init(jax.random.PRNGKey(0))
    # the actor's last layer has a mean and a log std per action dim
    assert jax.tree.leaves(state["params"]["actor"])[-1].shape[-1] == 2 * env.spec.action_dim
    obs = jax.random.normal(jax.random.PRNGKey(3), (256, 3, env.spec.obs_dim))
    params, act = learner.policy_params(state), jax.jit(learner.act)
    run = lambda explore, seed: np.asarray(act(params, learner.init_carry(256), obs, jnp.ones((256, 3, 1), bool),
                                              jnp.zeros(256, bool), jax.random.PRNGKey(seed), explore)[0])
    explore = learner.exploration(jnp.float32(0))
    greedy = [run(learner.greedy, s) for s in (4, 5)]
    sampled = [run(explore, s) for s in (4, 5)]
    np.testing.assert_array_equal(greedy[0], greedy[1])
    assert (sampled[0] != sampled[1]).mean() > 0.9 and (sampled[0] != greedy[0]).mean() > 0.9
    for a in (*greedy, *sampled):
        assert a.min() >= env.spec.action_low and a.max() <= env.spec.action_high
    new, metrics = learner.update(state, windows)
    assert np.isfinite(float(metrics["critic_loss"])) and np.isfinite(float(metrics["actor_loss"]))
    moved = [not np.allclose(a, b) for a, b in zip(jax.tree.leaves(new["params"]["actor"]),
                                                   jax.tree.leaves(state["params"]["actor"]))]
    assert all(moved)  # the log-std head is trained as well


def test_twin_critics_are_independent_and_bootstrap_on_the_smaller_target_q(continuous):
    env, _, _, windows, _ = continuous
    learner = algos.make_learner("maddpg", env.spec, algos.config_for("maddpg", {**SMALL, "twin_critics": "true"}))
    state = learner.init(jax.random.PRNGKey(0))
    kernel = np.asarray(jax.tree.leaves(state["params"]["critic"])[1])  # [agent net, twin, in, out]
    assert kernel.shape[1] == 2 and not np.allclose(kernel[:, 0], kernel[:, 1])

    def first_step_targets(train_state):  # Q1(s, a) - TD error = the bootstrapped target
        out = learner.score(train_state, windows)
        return np.asarray(out["q_taken"][0][:, 0] - out["td_error"][0][:, 0])

    both = first_step_targets(state)
    # with the second target critic a copy of the first, min(Q1', Q2') is Q1'
    copy_first = jax.tree.map(lambda p: p.at[:, 1].set(p[:, 0]), state["target_params"]["critic"])
    first_only = first_step_targets({**state, "target_params": {**state["target_params"], "critic": copy_first}})
    has_target = ~np.isnan(both)
    assert has_target.mean() > 0.5
    assert (both[has_target] <= first_only[has_target] + 1e-6).all()
    assert (both[has_target] < first_only[has_target] - 1e-4).mean() > 0.2


def test_delayed_actor_steps_every_other_update_and_the_critic_every_update(continuous):
    env, _, _, windows, _ = continuous
    learner = algos.make_learner("maddpg", env.spec, algos.config_for("maddpg", {**SMALL, "actor_every": "2"}))
    states = [learner.init(jax.random.PRNGKey(0))]
    for _ in range(3):
        states.append(learner.update(states[-1], windows)[0])
    moved = lambda net: [not np.allclose(jax.tree.leaves(a["params"][net])[0], jax.tree.leaves(b["params"][net])[0])
                         for a, b in zip(states, states[1:])]
    assert moved("actor") == [True, False, True] and moved("critic") == [True, True, True]


def test_n_step_targets_stop_at_a_truncation_as_a_time_limit_or_at_a_terminal_state():
    # one window of 5 steps, one agent: rewards 1, 2, 3, 4, 5, obs = the step index, and an
    # episode that ends by time limit at step 1 (its step 2 is the next episode's reset obs)
    g = 0.5
    end = jnp.array([[False, True, False, False, False]])
    no = jnp.zeros((1, 5), bool)
    windows = {"obs": jnp.arange(5.0).reshape(1, 5, 1, 1), "action": jnp.zeros((1, 5, 1, 1)),
               "avail_actions": jnp.ones((1, 5, 1, 1), bool), "reward": jnp.arange(1.0, 6.0).reshape(1, 5, 1),
               "terminated": no, "truncated": end}
    n = 3  # starts 0 and 1

    def transitions(w, *args):  # `first` as the collector writes it: after each end
        ends = w["terminated"] | w["truncated"]
        first = jnp.concatenate([jnp.zeros_like(ends[:, :1]), ends[:, :-1]], axis=1)
        return maddpg.transitions({**w, "first": first}, *args)

    limit = transitions(windows, g, True, n)
    # start 0: r0 and bootstrap on obs 1 (the step that hit the limit); start 1 (at the done) left out
    np.testing.assert_allclose(limit["reward"][:1, 0], [1.0])
    np.testing.assert_allclose(limit["discount"][:1], [g])
    np.testing.assert_allclose(limit["next_obs"][:1, 0, 0], [1.0])
    np.testing.assert_allclose(limit["weight"], [1.0, 0.0])
    # without time_limit_bootstrap every end is terminal; with it, a `terminated` end is
    for real_end, tlb in (({"terminated": no, "truncated": end}, False), ({"terminated": end, "truncated": no}, True),
                          ({"terminated": end, "truncated": no}, False)):
        terminal = transitions({**windows, **real_end}, g, tlb, n)
        # start 0: r0 + g r1, then nothing (terminal); start 1: its own reward only
        np.testing.assert_allclose(terminal["reward"][:, 0], [1.0 + g * 2, 2.0])
        np.testing.assert_allclose(terminal["discount"], [0.0, 0.0])
        np.testing.assert_allclose(terminal["weight"], [1.0, 1.0])
    # 2-step returns, a real end at step 2 (and a time limit at 4, after the last start):
    # start 0 bootstraps on the obs of step 2, a real state; start 1 stops at the real end
    # with no bootstrap; start 2 (at the real end) has its own reward only
    mixed = transitions({**windows, "terminated": jnp.array([[False, False, True, False, False]]),
                                "truncated": jnp.array([[False, False, False, False, True]])}, g, True, 2)
    np.testing.assert_allclose(mixed["reward"][:, 0], [1 + g * 2, 2 + g * 3, 3.0])
    np.testing.assert_allclose(mixed["discount"], [g**2, 0.0, 0.0])
    np.testing.assert_allclose(mixed["weight"], [1.0, 1.0, 1.0])
    # no end: the full n-step sum and its bootstrap
    clear = transitions({**windows, "truncated": no}, g, True, n)
    np.testing.assert_allclose(clear["reward"][:, 0], [1 + g * 2 + g**2 * 3, 2 + g * 3 + g**2 * 4])
    np.testing.assert_allclose(clear["discount"], [g**3, g**3])
    np.testing.assert_allclose(clear["next_obs"][:, 0, 0], [3.0, 4.0])
    # one step, as before: every start but the last
    one = transitions(windows, g, True)
    np.testing.assert_allclose(one["reward"][[0, 2, 3], 0], [1.0, 3.0, 4.0])  # start 1: no target
    np.testing.assert_allclose(one["weight"], [1.0, 0.0, 1.0, 1.0])
    with pytest.raises(algos.ConfigError, match="n_step=25 must be at least 1 and below steps_per_region=25"):
        make_run_config(TINY, overrides={"n_step": "25"})


def test_one_critic_update_on_a_fixed_batch_lowers_the_td_loss(continuous):
    _, learner, state, windows, _ = continuous
    batch = maddpg.transitions(windows, learner.config.gamma, learner.config.time_limit_bootstrap)
    key = jax.random.PRNGKey(5)
    loss = lambda s: float(learner.loss_fn(s["params"]["critic"], s["params"], state["target_params"], batch, key)[0])
    new, metrics = learner.update(state, windows)
    assert loss(new) < loss(state)
    assert np.isclose(float(metrics["critic_loss"]), loss(state), rtol=1e-4)


def test_gumbel_actions_never_pick_an_unavailable_action():
    # discrete simple spread, with one actor and critic shared by all agents
    env, learner, state, windows, _ = real_windows({}, {**SMALL, "share_params": "true"})
    assert jax.tree.leaves(state["params"]["actor"])[0].shape[0] == 1
    assert env.spec.discrete and env.spec.n_actions == 5
    n_envs, n_actions = 2048, env.spec.n_actions
    obs = jax.random.normal(jax.random.PRNGKey(6), (n_envs, 3, env.spec.obs_dim)) * 10.0
    avail = jax.random.bernoulli(jax.random.PRNGKey(7), 0.3, (n_envs, 3, n_actions))
    avail = avail.at[..., 0].set(avail[..., 0] | ~avail.any(-1))  # at least one available
    only = jax.nn.one_hot(jax.random.randint(jax.random.PRNGKey(8), (n_envs, 3), 0, n_actions), n_actions) > 0
    act = jax.jit(learner.act)
    params = learner.policy_params(state)
    for mask in (avail, only):
        for explore in (learner.exploration(jnp.float32(0)), learner.greedy):
            actions, _, _ = act(params, learner.init_carry(n_envs), obs, mask, jnp.zeros(n_envs, bool),
                                jax.random.PRNGKey(9), explore)
            assert bool(jnp.take_along_axis(mask, actions[..., None], -1).all())
    # the straight-through sample of the actor loss: one-hot on an available action, with
    # the soft sample's gradient, and no gradient into the logits of unavailable actions
    logits = jax.random.normal(jax.random.PRNGKey(10), (n_envs, 3, n_actions)) * 5.0
    sample = maddpg.gumbel_straight_through(jax.random.PRNGKey(11), logits, avail)
    np.testing.assert_allclose(sample.sum(-1), 1.0, atol=1e-5)
    assert bool((jnp.where(avail, 0.0, sample) == 0).all())
    chosen = jnp.argmax(sample, -1)
    assert bool(jnp.take_along_axis(avail, chosen[..., None], -1).all())
    grad = jax.grad(lambda lg: (maddpg.gumbel_straight_through(jax.random.PRNGKey(11), lg, avail)
                                * jnp.arange(n_actions)).sum())(logits)
    assert float(jnp.abs(grad).sum()) > 0 and bool((jnp.where(avail, 0.0, grad) == 0).all())
    # and a discrete update runs on the stored int actions
    new, metrics = learner.update(state, windows)
    assert np.isfinite(float(metrics["critic_loss"])) and np.isfinite(float(metrics["actor_loss"]))


def whole_region(data):
    """A collected region [T, N, ...] as N windows [N, T, ...]."""
    return {k: jnp.swapaxes(v, 0, 1) for k, v in data.items()}


def test_score_gives_per_agent_q_and_td_errors(continuous):
    _, learner, state, _, data = continuous
    long = whole_region(data)
    out = learner.score(state, long)
    assert set(out) == {"q_taken", "td_error"}
    q, dims = out["q_taken"]
    assert q.shape == (8, 40, 3) and dims == ("agent",) and bool(jnp.isfinite(q).all())
    td, _ = out["td_error"]
    cut = np.asarray(long["truncated"][:, :-1])  # time limits have no target (the default)
    assert bool(jnp.isnan(td[:, -1]).all()) and bool(jnp.isfinite(td[:, :-1][~cut]).all())


def test_truncations_leave_the_loss_but_not_the_bootstrap(continuous):
    env, _, state, _, data = continuous
    learner = algos.make_learner("maddpg", env.spec, algos.config_for(
        "maddpg", {**SMALL, "time_limit_bootstrap": "true"}))
    long = whole_region(data)
    td, _ = learner.score(state, long)["td_error"]
    done = np.asarray(long["truncated"][:, :-1])  # MPE: every end is a time limit
    assert done.any() and (~done).any() and not np.asarray(long["terminated"]).any()
    assert bool(jnp.isnan(td[:, :-1][done]).all()) and bool(jnp.isfinite(td[:, :-1][~done]).all())


def test_tiny_maddpg_preset_through_the_pipeline(tmp_path, prefect_server, dask_cluster):
    from flows.train import marl_train

    run_dir = str(tmp_path / "maddpg")
    result = marl_train(preset=TINY, run_dir=run_dir, scheduler_address=dask_cluster.scheduler_address)
    config = make_run_config(TINY)
    # 1,600 env steps = 4 iterations x 2 collectors x (8 envs x 25 steps)
    assert result["iterations"] == 4 and result["env_steps"] == 1600
    ds = open_replay(os.path.join(run_dir, "replay"))
    assert ds.action.dims == ("step", "env", "agent", "act_dim") and ds.sizes["act_dim"] == 5
    assert float(ds.action.min()) >= 0.0 and float(ds.action.max()) <= 1.0
    assert ReplayStore.open(os.path.join(run_dir, "replay")).attrs["algorithm"] == "maddpg"
    per_iteration = config.n_collectors * config.algo_config().updates_per_region
    # learning starts once 200 env steps are stored: from the first iteration (400 steps)
    assert result["history"][-1]["total_updates"] == 4 * per_iteration
    assert np.isfinite(result["history"][-1]["loss"])
    assert result["final_eval"]["episodes"] == config.eval_episodes
    assert result["final_eval"]["length_mean"] == 25  # max_steps=24: PARL's 25-step episodes
