"""MAPPO/IPPO (marl/mappo.py): GAE, masking, bounds, an update, the stored hidden state, and
a tiny run through the real pipeline (Prefect flow, LocalCluster, Zarr store, orbax)."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl import algos, envs, mappo, rollout, transition
from pipelines.config import make_run_config
from storage import Checkpointer, ReplayStore, open_replay

TINY = "mappo-mpe-tiny"


def make(algo, env_id, env_kwargs=None, **overrides):
    env = envs.make(env_id, **(env_kwargs or {}))
    config = algos.config_for(algo, {"hidden": 16, "epochs": 2, "minibatches": 2, "lr": 3e-3, **overrides})
    return env, algos.make_learner(algo, env.spec, config)


def collect_sequences(env, learner, n_envs=8, n_steps=32, seed=0):
    """One collected region (data [T, N, ...], sequences [N, T, ...]) and the state that acted."""
    init, collect = rollout.make_collector(env, learner.act, learner.init_carry, n_envs, n_steps)
    state = learner.init(jax.random.PRNGKey(seed))
    _, data, _ = collect(learner.policy_params(state), init(jax.random.PRNGKey(seed + 1)),
                         learner.exploration(0))
    return state, data, {k: jnp.swapaxes(v, 0, 1) for k, v in data.items()}


@pytest.fixture(scope="module")
def feed_forward():
    """MAPPO, feed-forward actor, one region of 8 MPE envs x 32 steps."""
    env, learner = make("mappo", "mpe:simple_spread")
    return (env, learner, *collect_sequences(env, learner))


@pytest.fixture(scope="module")
def recurrent():
    """IPPO with a GRU actor, one region of 8 MPE envs x 32 steps (episodes end at step 25)."""
    env, learner = make("ippo", "mpe:simple_spread", recurrent=True)
    return (env, learner, *collect_sequences(env, learner))


def region(data):
    return {k: jnp.asarray(v)[None] for k, v in data.items()}  # [R=1, T, N, ...]


def test_gae_matches_a_hand_computed_example():
    # gamma 0.9, lambda 0.5; step 1 ends its episode, so steps 0-1 do not see V(2)
    reward = jnp.array([[1.0, 2.0, 3.0, 4.0]])[..., None]  # [B=1, L=4, agent=1]
    terminated = jnp.array([[False, True, False, False]])
    value = jnp.array([[0.5, 1.0, 1.5, 2.0, 2.5]])[..., None]
    adv, target = mappo.gae(reward, terminated, jnp.zeros_like(terminated), value, gamma=0.9, lam=0.5)
    # deltas: 1 + .9*1 - .5 = 1.4 | 2 - 1 = 1.0 | 3 + .9*2 - 1.5 = 3.3 | 4 + .9*2.5 - 2 = 4.25
    # A_3 = 4.25; A_2 = 3.3 + .45*4.25 = 5.2125; A_1 = 1.0 (episode end); A_0 = 1.4 + .45*1.0
    np.testing.assert_allclose(adv[0, :, 0], [1.85, 1.0, 5.2125, 4.25], rtol=1e-6)
    np.testing.assert_allclose(target[0, :, 0], [2.35, 2.0, 6.7125, 6.25], rtol=1e-6)


def test_an_unavailable_action_is_never_sampled(feed_forward):
    _, learner, state, _, _ = feed_forward
    n = 1024
    obs = jax.random.normal(jax.random.PRNGKey(1), (n, 3, 18))
    one = jax.nn.one_hot(jnp.array([4, 0, 2]), 5, dtype=bool)[None].repeat(n, axis=0)
    # random masks with at least one available action per agent
    some = jax.random.bernoulli(jax.random.PRNGKey(2), 0.4, (n, 3, 5)) | one
    for avail in (one, some):
        for seed in range(3):
            actions, _, extras = learner.act(learner.policy_params(state), learner.init_carry(n), obs,
                                             avail, jnp.ones(n, bool), jax.random.PRNGKey(seed),
                                             learner.exploration(0))
            chosen = np.take_along_axis(np.asarray(avail), np.asarray(actions)[..., None], -1)
            assert chosen.all(), "an unavailable action was sampled"
    actions, _, extras = learner.act(learner.policy_params(state), learner.init_carry(n), obs, one,
                                     jnp.ones(n, bool), jax.random.PRNGKey(9), learner.exploration(0))
    np.testing.assert_allclose(extras["logp"], 0.0, atol=1e-6)  # the one action has probability 1


def test_continuous_actions_stay_in_bounds_and_keep_the_raw_sample():
    env, learner = make("mappo", "mpe:simple_spread", {"action_type": "Continuous"}, log_std_init=1.0)
    spec, n = env.spec, 256
    state = learner.init(jax.random.PRNGKey(0))
    obs = jax.random.normal(jax.random.PRNGKey(1), (n, 3, 18))
    avail = jnp.ones((n, 3, 1), bool)
    action, _, extras = learner.act(learner.policy_params(state), learner.init_carry(n), obs, avail,
                                    jnp.ones(n, bool), jax.random.PRNGKey(2), learner.exploration(0))
    action, raw = np.asarray(action), np.asarray(extras["action_raw"])
    assert action.shape == raw.shape == (n, 3, 5)
    assert action.min() >= spec.action_low and action.max() <= spec.action_high
    assert (raw < spec.action_low).any() and (raw > spec.action_high).any()  # clipping did happen
    np.testing.assert_allclose(action, np.clip(raw, spec.action_low, spec.action_high))
    # the stored log-prob belongs to the unclipped sample: recomputing it gives it back
    no = jnp.zeros((n, 1), bool)
    window = {"obs": obs[:, None], "state": obs.reshape(n, 1, -1), "terminated": no, "truncated": no,
              "avail_actions": avail[:, None], "action_raw": extras["action_raw"][:, None],
              "logp": extras["logp"][:, None]}
    np.testing.assert_allclose(learner.score(state, window)["log_ratio"][0], 0.0, atol=1e-4)


@pytest.mark.parametrize("which", ["feed_forward", "recurrent"])
def test_one_update_on_a_fixed_batch_lowers_its_loss(which, request):
    _, learner, state, data, seq = request.getfixturevalue(which)
    loss = jax.jit(learner.loss_fn)
    old = state["params"]
    before, parts_before = loss(old, state, seq)
    new_state, metrics = learner.train(state, region(data), jnp.ones(1, bool), 1)
    after, parts_after = loss(new_state["params"], state, seq)
    assert int(new_state["updates"]) == 2 * 2  # epochs x minibatches
    assert float(after) < float(before)
    assert float(parts_after["value_loss"]) < float(parts_before["value_loss"])
    assert float(parts_after["actor_loss"]) < float(parts_before["actor_loss"])
    assert 0.0 < float(metrics["approx_kl"]) < 0.1, "the policy moved by an unreasonable amount"
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), old, new_state["params"])
    assert all(jax.tree.leaves(changed))


def test_a_lagged_region_gets_a_whole_trust_region_with_the_decoupled_clip(feed_forward):
    env, learner, state, data, seq = feed_forward
    decoupled = mappo.make_learner(env.spec, dataclasses.replace(learner.config, decoupled_clip=True))
    plain_loss, decoupled_loss = jax.jit(learner.loss_fn), jax.jit(decoupled.loss_fn)
    # where the learner's params are the ones that acted, it is plain PPO
    old = state["params"]
    (p, p_parts), (d, d_parts) = plain_loss(old, state, seq), decoupled_loss(old, state, seq)
    np.testing.assert_allclose(float(d), float(p), rtol=1e-5)
    np.testing.assert_allclose(float(d_parts["actor_loss"]), float(p_parts["actor_loss"]), rtol=1e-5, atol=1e-7)
    # the learner some updates ahead of the params that acted (max_policy_lag > 0): plain PPO
    # starts with ratios off 1 and some steps already clipped (no gradient), the decoupled
    # clip starts from ratio 1 everywhere
    ahead = state
    for _ in range(4):
        ahead, _ = learner.train(ahead, region(data), jnp.ones(1, bool), 1)
    _, lagged = plain_loss(ahead["params"], ahead, seq)
    _, fresh = decoupled_loss(ahead["params"], ahead, seq)
    assert float(lagged["clip_frac"]) > 0.0 and float(lagged["approx_kl"]) > 1e-4
    assert float(fresh["clip_frac"]) == 0.0 and abs(float(fresh["approx_kl"])) < 1e-6
    moved, _ = decoupled.train(ahead, region(data), jnp.ones(1, bool), 1)
    after, _ = decoupled_loss(moved["params"], ahead, seq)
    assert float(after) < float(decoupled_loss(ahead["params"], ahead, seq)[0])


def test_value_norm_learns_targets_in_their_running_moments_and_scores_on_the_returns_scale(feed_forward):
    env, learner, _, data, seq = feed_forward
    normed = mappo.make_learner(env.spec, dataclasses.replace(learner.config, value_norm=True))
    state = normed.init(jax.random.PRNGKey(0))
    critic_out = lambda s: normed.mixer.apply(s["params"]["critic"], seq["obs"], seq["state"])
    # before any target: mean 0 and the std at its floor, 0.1 (MAPPO's ValueNorm starts so)
    value = normed.score(state, seq)["value"][0]
    np.testing.assert_allclose(value, 0.1 * critic_out(state), rtol=1e-5)
    # the first train call's moments are those of its value targets (the steps the loss keeps)
    cut = transition.cut(seq)
    _, targets = mappo.gae(seq["reward"][:, :-1], seq["terminated"][:, :-1], cut, value,
                           learner.config.gamma, learner.config.gae_lambda)
    keep = jnp.broadcast_to((~cut)[..., None], targets.shape)
    want_mean = float(jnp.sum(jnp.where(keep, targets, 0.0)) / keep.sum())
    want_std = float(jnp.sqrt(jnp.sum(jnp.where(keep, (targets - want_mean) ** 2, 0.0)) / keep.sum()))
    trained, metrics = normed.train(state, region(data), jnp.ones(1, bool), 1)
    stats = trained["value_norm"]
    mean = float(stats["mean"] / stats["debias"])
    std = float(np.sqrt(stats["mean_sq"] / stats["debias"] - mean**2))
    assert want_std > 1.0 and mean == pytest.approx(want_mean, rel=1e-3) and std == pytest.approx(want_std, rel=1e-3)
    # the critic's outputs are in those moments' space; score gives them back on the return's scale
    np.testing.assert_allclose(normed.score(trained, seq)["value"][0], critic_out(trained) * std + mean,
                               rtol=1e-3, atol=1e-3)
    # the values the update started from, reported on the return's scale too
    assert float(metrics["value"]) == pytest.approx(float(value[:, :-1].mean()), rel=1e-3, abs=1e-5)


def test_the_agent_critic_sees_each_agents_own_obs_beside_the_state(feed_forward):
    """critic="agent" (MAPPO's agent-specific global state): agent 0's value follows agent
    0's own observation at a fixed state, which the central critic never sees; it trains."""
    _, _, _, data, seq = feed_forward
    for sees, follows in (("central", [False, False, False]), ("agent", [True, False, False]),
                          ("joint", [True, True, True])):
        _, learner = make("mappo", "mpe:simple_spread", critic=sees)
        state = learner.init(jax.random.PRNGKey(0))
        value = lambda obs: learner.mixer.apply(state["params"]["critic"], obs, seq["state"])
        moved = value(seq["obs"].at[..., 0, :].add(1.0)) != value(seq["obs"])  # [N, T, agent]
        assert [bool(m) for m in jnp.any(moved, axis=(0, 1))] == follows, sees
    loss = jax.jit(learner.loss_fn)
    trained, _ = learner.train(state, region(data), jnp.ones(1, bool), 1)
    before, parts_before = loss(state["params"], state, seq)
    after, parts_after = loss(trained["params"], state, seq)
    assert float(parts_after["value_loss"]) < float(parts_before["value_loss"]) and float(after) < float(before)


def test_the_joint_critic_reads_every_agents_obs_from_the_agents_own_place(feed_forward):
    """critic="joint" (MAPPO on every agent's observation): the state is not read, and each
    agent's row starts with its own observation. With the first layer kept only for that
    leading block, moving agent 1's observation moves agent 1's value alone."""
    _, _, _, data, seq = feed_forward
    _, learner = make("mappo", "mpe:simple_spread", critic="joint")
    params = learner.init(jax.random.PRNGKey(0))["params"]["critic"]
    value = lambda p, obs, state: learner.mixer.apply(p, obs, state)
    assert bool(jnp.all(value(params, seq["obs"], seq["state"] + 1.0) == value(params, seq["obs"], seq["state"])))
    obs_dim = seq["obs"].shape[-1]
    kernel = params["params"]["Dense_0"]["kernel"]  # [3 agents' obs + 3 ids, hidden]
    own_only = jax.tree.map(lambda x: x, params)
    own_only["params"]["Dense_0"]["kernel"] = kernel.at[obs_dim:].set(0.0)
    moved = value(own_only, seq["obs"].at[..., 1, :].add(1.0), seq["state"]) != value(own_only, seq["obs"], seq["state"])
    assert [bool(m) for m in jnp.any(moved, axis=(0, 1))] == [False, True, False]


def test_the_counterfactual_advantage_is_the_taken_q_minus_the_policy_s_expected_q():
    q = jnp.array([[1.0, 3.0, 5.0], [2.0, 2.0, 8.0]])  # [agent, action]
    logits = mappo.masked_logits(jnp.log(jnp.array([[0.5, 0.25, 0.25], [0.5, 0.5, 1.0]])),
                                 jnp.array([[True, True, True], [True, True, False]]))  # agent 1: action 2 unavailable
    adv = mappo.counterfactual_advantage(q, logits, jnp.array([2, 0]))
    # agent 0: 5 - (0.5 * 1 + 0.25 * 3 + 0.25 * 5) = 2.5; agent 1: 2 - (0.5 * 2 + 0.5 * 2) = 0
    np.testing.assert_allclose(adv, [2.5, 0.0], atol=1e-6)


def test_the_counterfactual_critic_reads_the_other_agents_actions_and_not_its_own(feed_forward):
    """critic="counterfactual" (COMA's baseline): agent i's Qs (one per own action) change
    with agent j's action and not with i's own; a train call fits the taken actions' Qs and
    moves the actor; continuous actions are refused in one line."""
    env, _, _, data, seq = feed_forward
    _, learner = make("mappo", "mpe:simple_spread", critic="counterfactual")
    state = learner.init(jax.random.PRNGKey(0))
    q = lambda action: learner.mixer.apply(state["params"]["critic"], seq["obs"], seq["state"], action)
    base = q(seq["action"])
    assert base.shape == (*seq["action"].shape, env.spec.n_actions)
    moved = q(seq["action"].at[..., 0].set((seq["action"][..., 0] + 1) % env.spec.n_actions)) != base
    assert [bool(m) for m in jnp.any(moved, axis=(0, 1, 3))] == [False, True, True]
    trained, metrics = learner.train(state, region(data), jnp.ones(1, bool), 1)
    assert np.isfinite(float(metrics["value_loss"])) and float(metrics["actor_grad_norm"]) > 0
    for _ in range(8):  # on one region, the taken actions' Q approaches its TD(lambda) targets
        trained, later = learner.train(trained, region(data), jnp.ones(1, bool), 1)
    assert float(later["value_loss"]) < 0.97 * float(metrics["value_loss"])  # (the value clip paces it)
    with pytest.raises(ValueError, match="critic=counterfactual .* continuous"):
        make("mappo", "mpe:simple_spread", {"action_type": "Continuous"}, critic="counterfactual")


def test_explained_variance_reads_how_much_of_the_targets_spread_a_prediction_explains(feed_forward):
    target = jnp.array([[1.0, 2.0, 3.0, 40.0]])
    keep = jnp.array([[1.0, 1.0, 1.0, 0.0]])  # the last step cut: left out
    assert float(mappo.explained_variance(target, target, keep)) == pytest.approx(1.0)
    assert float(mappo.explained_variance(target, jnp.full_like(target, 2.0), keep)) == pytest.approx(0.0)
    assert float(mappo.explained_variance(target, target + jnp.array([[1.0, -1.0, 1.0, 0.0]]), keep)) < 0.0
    # a train call reports it of the critic that acted, beside its losses
    _, learner, _, data, _ = feed_forward
    _, metrics = learner.train(learner.init(jax.random.PRNGKey(0)), region(data), jnp.ones(1, bool), 1)
    assert {"explained_variance", "entropy", "approx_kl", "value_loss"} <= set(metrics)
    assert float(metrics["explained_variance"]) <= 1.0


def test_the_lr_anneals_linearly_to_zero_over_its_train_calls(feed_forward):
    _, _, _, data, _ = feed_forward
    _, learner = make("mappo", "mpe:simple_spread", lr=1e-3, anneal_lr_iterations=4)
    state, lrs = learner.init(jax.random.PRNGKey(0)), []
    for _ in range(5):  # the lr the next call's updates take, after each call
        state, metrics = learner.train(state, region(data), jnp.ones(1, bool), 1)
        lrs.append(float(metrics["lr"]))
    assert lrs == pytest.approx([7.5e-4, 5e-4, 2.5e-4, 0.0, 0.0], abs=1e-9)


def test_the_decoupled_clip_follows_the_policy_lag_unless_set():
    decoupled = lambda preset, **o: getattr(make_run_config(preset, overrides=o).algo_config(), "decoupled_clip", None)
    assert decoupled("mappo-mpe") is False and decoupled("ippo-mpe", max_policy_lag="1") is True
    assert decoupled("mappo-mpe", max_policy_lag="2", decoupled_clip="false") is False
    assert decoupled("mappo-mpe", decoupled_clip="true") is True
    assert decoupled("qmix-smac", max_policy_lag="1") is None  # off-policy learners have no ratio


def test_the_reward_shaping_coefficient_falls_linearly_over_its_horizon():
    coef = mappo.reward_shaping(2_500_000)  # JaxMARL's REW_SHAPING_HORIZON for Overcooked
    for env_steps, want in [(0, 1.0), (625_000, 0.75), (1_250_000, 0.5), (2_500_000, 0.0), (5_000_000, 0.0)]:
        assert float(coef(env_steps)) == pytest.approx(want, abs=1e-6)


def test_reward_shaping_off_trains_as_before_and_on_adds_the_annealed_shaped_term(feed_forward):
    env, learner, state, data, _ = feed_forward  # 8 envs x 32 steps: 256 env steps per call
    same = lambda a, b: all(bool(jnp.all(x == y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    shaped = {**data, "shaped_reward": jnp.full_like(data["reward"], 3.0)}
    ring = jnp.ones(1, bool)
    plain, metrics = learner.train(state, region(data), ring, 1)
    assert "shaping_coef" not in metrics
    # horizon 0 (the default): a stored shaping term is not read, the update is bit for bit the same
    assert same(learner.train(state, region(shaped), ring, 1)[0], plain)
    config = dataclasses.replace(learner.config, reward_shaping_horizon=1024)
    on = mappo.make_learner(dataclasses.replace(env.spec, shaped_reward=True), config)
    zero, metrics = on.train(state, region({**data, "shaped_reward": jnp.zeros_like(data["reward"])}), ring, 1)
    assert float(metrics["shaping_coef"]) == 1.0 and same(zero, plain)  # reward + 1 x 0
    moved, _ = on.train(state, region(shaped), ring, 1)
    assert not same(moved["params"], plain["params"])
    _, metrics = on.train(moved, region(shaped), ring, 1)  # after 256 of the 1024 env steps
    assert float(metrics["shaping_coef"]) == pytest.approx(0.75)
    for refuse in (lambda: mappo.make_learner(env.spec, config), lambda: algos.check_env("mappo", env.spec, config)):
        with pytest.raises(ValueError, match="needs an env with a shaping term.*mpe:simple_spread has none"):
            refuse()


def test_active_masks_leave_an_agent_without_a_choice_out_of_the_loss(feed_forward):
    """With active_masks, an agent whose only available action is one (a dead SMAX unit) adds
    nothing to the loss: what it stored there can be anything; off (the default), it counts."""
    env, learner, state, _, seqs = feed_forward
    n_actions = seqs["avail_actions"].shape[-1]
    # agent 0 has one action left from step 16 of every sequence, and took it
    dead = (jnp.arange(seqs["obs"].shape[1]) >= 16)[None, :, None] & (jnp.arange(env.spec.n_agents) == 0)[None, None, :]
    batch = {**seqs, "avail_actions": jnp.where(dead[..., None], jnp.arange(n_actions) == 0, seqs["avail_actions"]),
             "action": jnp.where(dead, 0, seqs["action"])}
    # what the acting policy's log-probability was there moves that agent's PPO ratio only
    other = {**batch, "logp": jnp.where(dead, -1.0, batch["logp"])}
    losses = {}
    for masked in (False, True):
        on = mappo.make_learner(env.spec, dataclasses.replace(learner.config, active_masks=masked))
        losses[masked] = [float(on.loss_fn(state["params"], state, b)[0]) for b in (batch, other)]
    assert losses[False][0] != pytest.approx(losses[False][1], abs=1e-6)
    assert losses[True][0] == pytest.approx(losses[True][1], abs=1e-7)
    assert losses[True][0] != pytest.approx(losses[False][0], abs=1e-6)


def test_layer_norm_makes_actor_and_critic_blind_to_the_scale_of_their_inputs(feed_forward):
    """layer_norm (the MAPPO paper's feature normalisation and LayerNorm blocks): observations
    and states scaled and shifted give the same logits and values, which they do not without
    it; an update on a fixed batch still lowers the loss."""
    _, _, _, data, seq = feed_forward
    rescale = lambda x: 3.0 * x + 0.5
    for layer_norm in (False, True):
        _, learner = make("mappo", "mpe:simple_spread", layer_norm=layer_norm)
        state = learner.init(jax.random.PRNGKey(0))
        params = state["params"]
        logits = lambda obs: learner.agent.apply(params["actor"], None, obs)[1]
        value = lambda obs, s: learner.mixer.apply(params["critic"], obs, s)
        same_logits = jnp.allclose(logits(rescale(seq["obs"])), logits(seq["obs"]), atol=1e-4)
        same_values = jnp.allclose(value(rescale(seq["obs"]), rescale(seq["state"])), value(seq["obs"], seq["state"]), atol=1e-4)
        assert bool(same_logits) == layer_norm and bool(same_values) == layer_norm, layer_norm
    modules = {key.key for path, _ in jax.tree_util.tree_leaves_with_path(params) for key in path}
    assert {"LayerNorm_0", "LayerNorm_2"} <= modules  # the input's and each hidden layer's
    loss = jax.jit(learner.loss_fn)
    trained, _ = learner.train(state, region(data), jnp.ones(1, bool), 1)
    assert float(loss(trained["params"], state, seq)[0]) < float(loss(params, state, seq)[0])


def test_recurrent_actor_replays_the_behaviour_log_probs_from_stored_memory(recurrent):
    """Windows starting mid-region and crossing an episode end give back the stored log-probs."""
    _, learner, state, data, seq = recurrent
    assert data["actor_h"].shape == (32, 8, 3, 16)
    assert np.asarray(data["truncated"][5:30]).any()
    window = {k: v[:, 5:30] for k, v in seq.items()}
    scores = learner.score(state, window)
    np.testing.assert_allclose(scores["logp_current"][0], window["logp"], atol=1e-4)
    assert scores["value"][0].shape == (8, 25, 3) and scores["value"][1] == ("agent",)


def test_pettingzoo_collector_feeds_the_learner(feed_forward):
    _, learner, _, _, _ = feed_forward  # the same spec as PettingZoo's simple_spread_v3
    env = envs.make("pz:mpe2.simple_spread_v3")
    init, collect = rollout.make_numpy_collector(env, learner.act, learner.init_carry, 8, 32)
    state = learner.init(jax.random.PRNGKey(0))
    _, data, stats = collect(learner.policy_params(state), init(jax.random.PRNGKey(1)),
                             learner.exploration(0))
    assert data["logp"].shape == (32, 8, 3) and int(stats["episodes"]) == 8
    state, metrics = learner.train(state, region(data), jnp.ones(1, bool), 1)
    assert np.isfinite(float(metrics["loss"])) and int(state["updates"]) == 2 * 2


def test_bad_settings_are_refused(feed_forward):
    env, _, state, data, _ = feed_forward
    with pytest.raises(ValueError, match="critic='global' is not one of central, agent, joint, local"):
        algos.config_for("mappo", {"critic": "global"})
    _, learner = make("mappo", "mpe:simple_spread", minibatches=3)
    with pytest.raises(ValueError, match="minibatches=3 does not divide the 8 env sequences"):
        learner.train(state, region(data), jnp.ones(1, bool), 1)


def test_tiny_mappo_run_through_the_pipeline(tmp_path, prefect_server, dask_cluster):
    from flows.train import marl_train

    run_dir = str(tmp_path / "run")
    result = marl_train(preset=TINY, run_dir=run_dir, scheduler_address=dask_cluster.scheduler_address)
    config = make_run_config(TINY)
    algo = config.algo_config()
    # 1024 env steps = 4 iterations x 2 collectors x (8 envs x 16 steps)
    assert result["iterations"] == 4 and result["env_steps"] == 1024
    ds = open_replay(os.path.join(run_dir, "replay"))
    assert ds.logp.dims == ("step", "env", "agent") and ds.logp.shape == (4 * 16, 8, 3)
    assert np.isfinite(ds.logp.values).all() and (ds.logp.values <= 0).all()
    attrs = ReplayStore.open(os.path.join(run_dir, "replay")).attrs
    assert attrs["algorithm"] == "mappo" and attrs["env_id"] == "mpe:simple_spread"
    per_iteration = algo.epochs * algo.minibatches
    assert [h["total_updates"] for h in result["history"]] == [per_iteration * i for i in (1, 2, 3, 4)]
    checkpoints = Checkpointer(os.path.abspath(os.path.join(run_dir, "checkpoints")))
    try:
        assert checkpoints.latest_step() == 4 and checkpoints.metadata()["updates"] == 4 * per_iteration
    finally:
        checkpoints.close()
    assert np.isfinite(result["history"][-1]["loss"])
    assert result["final_eval"]["episodes"] == config.eval_episodes


def test_the_critic_probe_reads_a_saved_run_s_critic_on_fresh_data(tmp_path, dask_cluster, monkeypatch, capsys):
    """bench/mappo_critic_probe.py on a real saved run (2 seeds): one row per run, with the
    critic's explained variance and the share of the advantages' variance across agents."""
    import runpy
    import sys

    from flows.training import run_training

    run_dir = str(tmp_path / "run")
    config = make_run_config("mappo-mpe-tiny", run_dir=run_dir, overrides={"n_seeds": "2"})
    run_training(config, scheduler_address=dask_cluster.scheduler_address)
    monkeypatch.setattr(sys, "argv", ["mappo_critic_probe.py", run_dir, "--regions", "1"])
    runpy.run_path("bench/mappo_critic_probe.py", run_name="__main__")
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {run_dir}")]
    assert len(rows) == 1 and rows[0][1].strip() == "central" and rows[0][2].strip() == "1,024"
    explained = float(rows[0][3].split("±")[0])
    across = float(rows[0][6])
    assert explained <= 1.0 and 0.0 <= across <= 1.0
