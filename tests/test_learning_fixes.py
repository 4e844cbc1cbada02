"""How episodes meet regions and time limits, on hand-made data: windows run across region
boundaries, a time limit bootstraps where a real end does not (QMIX, MAPPO, MADDPG), burn-in
steps carry no loss, and MADDPG's reanalysis scores its own n-step target."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl import algos, buffer, envs, maddpg, transition
from marl.mappo import gae

GAMMA = 0.5
GAMMA_Q = algos.config_for("vdn", {}).gamma


def flags(length: int, terminated=(), truncated=(), restarts=()):
    """[1, length] terminated, truncated and first, with `first` after every end (the envs
    auto-reset) and at each step in `restarts` (a collector that reset its envs)."""
    term, trunc, first = (np.zeros((1, length), bool) for _ in range(3))
    term[0, list(terminated)] = True
    trunc[0, list(truncated)] = True
    first[0, 0] = True
    first[0, [t + 1 for t in (*terminated, *truncated) if t + 1 < length]] = True
    first[0, list(restarts)] = True
    return {"terminated": jnp.asarray(term), "truncated": jnp.asarray(trunc), "first": jnp.asarray(first)}


# ----------------------------------------------------------------- windows across regions


def ring_of_regions(first=None):
    """A mirror of 3 slots x 8 steps x 2 envs holding regions 4, 5 and 6 of 2 collectors
    (region r's envs continue in region r + 2), x = 100 * region + step."""
    steps, envs_ = 8, 2
    region_of_slot = {0: 4, 1: 5, 2: 6}
    x = np.zeros((3, steps, envs_), np.int32)
    for slot, region in region_of_slot.items():
        x[slot] = 100 * region + np.arange(steps)[:, None]
    f = np.zeros((3, steps, envs_), bool) if first is None else first
    arrays = {"x": jnp.asarray(x), "first": jnp.asarray(f)}
    return arrays, buffer.ring(region_of_slot, 3, stride=2)


def test_windows_cross_into_the_same_collectors_next_region():
    arrays, ring = ring_of_regions()
    assert ring.next.tolist() == [2, -1, -1]  # 4 -> 6; 5 and 6 have no next region mirrored
    length = 4
    starts = buffer.window_starts(arrays, ring, length)
    x = np.asarray(buffer.sample_windows(jax.random.PRNGKey(0), arrays, ring, starts, 4096, length)["x"])
    region, step = x // 100, x % 100
    # every window is one env's consecutive steps: inside one region, or from the end of
    # region 4 into the start of region 6
    inside = (region == region[:, :1]).all(1) & (np.diff(step, axis=1) == 1).all(1)
    crossing = (region[:, 0] == 4) & (region[:, -1] == 6)
    assert (inside | crossing).all() and crossing.any()
    # every step of region 4 starts a window, its last one too (its next obs is region 6's
    # step 0); regions without a mirrored successor only start windows that end inside them
    assert set(step[region[:, 0] == 4, 0]) == set(range(8))
    assert set(step[region[:, 0] != 4, 0]) == set(range(8 - length + 1))
    # uniform over the allowed starts: 8 + 5 + 5 of them
    share = np.mean(region[:, 0] == 4)
    assert abs(share - 8 / 18) < 0.03


def test_episode_windows_start_where_an_episode_starts():
    first = np.zeros((3, 8, 2), bool)
    first[0, 6, 1] = first[1, 2, 0] = first[2, 6, 0] = True  # 2, 6 in region 6: too late for 4 steps
    arrays, ring = ring_of_regions(first)
    starts = buffer.window_starts(arrays, ring, 4, at_episode_starts=True)
    assert int(starts[-1]) == 2
    x = np.asarray(buffer.sample_windows(jax.random.PRNGKey(1), arrays, ring, starts, 256, 4)["x"])
    assert set(map(int, x[:, 0])) == {406, 502}
    assert set(map(int, x[x[:, 0] == 406, -1])) == {601}  # crossed into region 6


def test_a_window_longer_than_a_region_is_refused():
    arrays, ring = ring_of_regions()
    with pytest.raises(ValueError, match="longer than a region"):
        buffer.window_starts(arrays, ring, 9)


def test_cut_marks_time_limits_and_restarts_not_real_ends():
    w = flags(7, terminated=[1], truncated=[3], restarts=[6])
    # t=1 terminated: has a target (no bootstrap); t=3 truncated and t=5 (before a restart): none
    assert transition.cut(w)[0].tolist() == [False, False, False, True, False, True]


# ------------------------------------------------------------------ QMIX (VDN mixer)


@pytest.fixture(scope="module")
def vdn():
    spec = envs.spec_of("smax:3m")
    learner = algos.make_learner("vdn", spec, algos.config_for("vdn", {"hidden": "8", "td_lambda": "0"}))
    return spec, learner, learner.init(jax.random.PRNGKey(0))


def qmix_windows(spec, length, **episode):
    key = jax.random.PRNGKey(3)
    return {"obs": jax.random.normal(key, (1, length, spec.n_agents, spec.obs_dim)),
            "state": jnp.zeros((1, length, spec.state_dim)),
            "avail_actions": jnp.ones((1, length, spec.n_agents, spec.n_actions), bool),
            "action": jnp.zeros((1, length, spec.n_agents), jnp.int32),
            "reward": jnp.broadcast_to(jnp.arange(1.0, length + 1)[None, :, None], (1, length, spec.n_agents)),
            "won": jnp.zeros((1, length), bool), **flags(length, **episode)}


def test_qmix_bootstraps_through_a_time_limit_and_not_a_real_end(vdn):
    spec, learner, state = vdn
    w = qmix_windows(spec, 7, terminated=[2], truncated=[4], restarts=[6])
    out = {k: np.asarray(v) for k, (v, _) in learner.score(state, w).items()}
    q_tot, td = out["q_tot"][0], out["td_error"][0]
    # at init the target net is the online one, so double-Q's target value is VDN's sum of maxes
    next_value = out["q_max"][0].sum(-1)
    r = np.arange(1.0, 8.0)
    target = {0: r[0] + GAMMA_Q * next_value[1], 1: r[1] + GAMMA_Q * next_value[2],
              2: r[2],  # terminated: no bootstrap
              3: r[3] + GAMMA_Q * next_value[4]}  # bootstraps on the obs of the step that hit the limit
    for t, g in target.items():
        np.testing.assert_allclose(td[t], q_tot[t] - g, rtol=1e-5, atol=1e-5)
    # the truncated step (its next state was reset away), the step before a restart and the
    # window's last step have no target
    assert np.isnan(td[[4, 5, 6]]).all()


def test_qmix_without_time_limit_bootstrap_ends_at_a_time_limit(vdn):
    spec, _, state = vdn
    learner = algos.make_learner("vdn", spec, algos.config_for(
        "vdn", {"hidden": "8", "td_lambda": "0", "time_limit_bootstrap": "false"}))
    w = qmix_windows(spec, 7, terminated=[2], truncated=[4], restarts=[6])
    out = {k: np.asarray(v) for k, (v, _) in learner.score(state, w).items()}
    q_tot, td = out["q_tot"][0], out["td_error"][0]
    next_value = out["q_max"][0].sum(-1)
    r = np.arange(1.0, 8.0)
    # the time limit is terminal: the step that hit it has a target, its reward alone
    target = {2: r[2], 3: r[3] + GAMMA_Q * next_value[4], 4: r[4]}
    for t, g in target.items():
        np.testing.assert_allclose(td[t], q_tot[t] - g, rtol=1e-5, atol=1e-5)
    assert np.isnan(td[[5, 6]]).all()  # the step before a restart, the window's last


def test_burn_in_steps_carry_no_loss(vdn):
    spec, _, state = vdn
    burn = algos.make_learner("vdn", spec, algos.config_for("vdn", {"hidden": "8", "td_lambda": "0",
                                                                     "burn_in": "3"}))
    w = qmix_windows(spec, 8)
    loss = lambda batch: float(burn.loss_fn(state["params"], state["target_params"], batch)[0])
    changed_prefix = {**w, "reward": w["reward"].at[:, :3].add(100.0)}
    changed_after = {**w, "reward": w["reward"].at[:, 4].add(100.0)}
    assert loss(changed_prefix) == pytest.approx(loss(w))
    assert loss(changed_after) != pytest.approx(loss(w))
    # the burn-in still runs the GRU: the first counted step's Q depends on the prefix's obs
    changed_obs = {**w, "obs": w["obs"].at[:, 0].add(1.0)}
    assert loss(changed_obs) != pytest.approx(loss(w))


# -------------------------------------------------------------------------------- MAPPO


def test_mappo_advantages_bootstrap_through_a_time_limit_and_not_a_real_end():
    lam = 0.5
    w = flags(6, terminated=[1], truncated=[3])
    reward = jnp.arange(1.0, 6.0)[None]  # transitions 0..4, values of steps 0..5
    value = jnp.array([[10.0, 20.0, 30.0, 40.0, 50.0, 60.0]])
    cut = transition.cut(w)[:, :5]
    adv, target = gae(reward, w["terminated"][:, :5], cut, value, GAMMA, lam)
    adv = np.asarray(adv[0])
    d4 = 5 + GAMMA * 60 - 50
    d2 = 3 + GAMMA * 40 - 30
    expected = {4: d4,
                # step 3 hit the limit: no estimate (left out); step 2 bootstraps on V_3 and
                # carries no advantage across the cut
                2: d2,
                1: 2 - 20,  # terminated: r - V, nothing after it
                0: (1 + GAMMA * 20 - 10) + GAMMA * lam * (2 - 20)}
    for t, a in expected.items():
        assert adv[t] == pytest.approx(a), t
    np.testing.assert_allclose(target[0], adv + value[0, :5])


# ------------------------------------------------------------------------------- MADDPG


def test_maddpg_stops_n_step_sums_at_a_restart_and_bootstraps_there():
    w = {"obs": jnp.arange(6.0).reshape(1, 6, 1, 1), "action": jnp.zeros((1, 6, 1, 1)),
         "avail_actions": jnp.ones((1, 6, 1, 1), bool), "reward": jnp.arange(1.0, 7.0).reshape(1, 6, 1),
         **flags(6, restarts=[3])}
    out = maddpg.transitions(w, GAMMA, True, 3)  # starts 0, 1, 2
    # the envs were reset before step 3: sums stop after step 2 and bootstrap on obs 2
    np.testing.assert_allclose(out["reward"][:2, 0], [1 + GAMMA * 2, 2.0])
    np.testing.assert_allclose(out["discount"][:2], [GAMMA**2, GAMMA])
    np.testing.assert_allclose(out["next_obs"][:2, 0, 0], [2.0, 2.0])
    np.testing.assert_allclose(out["weight"], [1.0, 1.0, 0.0])


def test_maddpg_score_is_its_training_target():
    spec = envs.spec_of("mpe:simple_spread", action_type="Continuous")
    config = algos.config_for("maddpg", {"hidden": "8", "n_step": "3"})
    learner = algos.make_learner("maddpg", spec, config)
    state = learner.init(jax.random.PRNGKey(0))
    length = 7
    key = jax.random.PRNGKey(5)
    w = {"obs": jax.random.normal(key, (2, length, spec.n_agents, spec.obs_dim)),
         "state": jnp.zeros((2, length, spec.state_dim)),
         "avail_actions": jnp.ones((2, length, spec.n_agents, 1), bool),
         "action": jax.random.uniform(key, (2, length, spec.n_agents, spec.action_dim)),
         "reward": jax.random.normal(key, (2, length, spec.n_agents)),
         "won": jnp.zeros((2, length), bool),
         **jax.tree.map(lambda x: jnp.concatenate([x, x]), flags(length, truncated=[3]))}
    td, _ = learner.score(state, w)["td_error"]
    # the training loss's own terms on the same windows
    batch = maddpg.transitions(w, config.gamma, config.time_limit_bootstrap, config.n_step)
    loss, _ = learner.loss_fn(state["params"]["critic"], state["params"], state["target_params"], batch,
                              jax.random.PRNGKey(0))
    counted = np.isfinite(np.asarray(td))
    assert counted[:, :length - 3].sum() == 2 * (length - 3 - 1) * spec.n_agents  # start 3 is at the cut
    assert np.isnan(np.asarray(td)[:, length - 3:]).all()
    assert float(loss) == pytest.approx(float(np.nanmean(np.asarray(td) ** 2)), rel=1e-5)
