"""Every env id `marl envs` lists: its spec against what the real env returns, one tiny
collect into a real replay store for a subset with each learner whose action space fits,
heterogeneous agents padded with masks, and the one-line refusals (a bad id, a missing
extra, a learner that cannot act in the env).

Shapes and dtypes of every JAX id are checked on the traced reset and step (no compile);
the envs of the collects step for real, jitted inside the collector. Every JAX id stepped
for real under jit takes minutes on 2 cores: `MARL_ALL_ENVS=1 pytest tests/test_env_registry.py`
(the `all_envs` tests) runs those, and the collects of the slower envs, too.
"""

import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flows import checks
from flows.envs_cli import describe
from marl import algos, envs
from pipelines import stages
from pipelines.config import make_run_config
from storage import ReplayStore

ALL_IDS = envs.env_ids()
JAX_IDS = [i for i in ALL_IDS if not envs.why_not(i) and not i.startswith("pz:")]
all_envs = pytest.mark.skipif(not os.environ.get("MARL_ALL_ENVS"),
                              reason="minutes on 2 cores; MARL_ALL_ENVS=1 runs it")

pytestmark = pytest.mark.filterwarnings("ignore")  # jaxmarl's deprecation and dtype notes


def _check_timestep(ts, spec: envs.EnvSpec, batch: tuple = ()):
    """A Timestep (arrays or ShapeDtypeStructs) has the spec's shapes and dtypes."""
    a = spec.n_agents
    (obs_shape, obs_dtype), (state_shape, state_dtype) = spec.agent_obs, spec.global_state  # images: uint8
    want = {"obs": ((a, *obs_shape), obs_dtype), "state": (state_shape, state_dtype),
            "avail_actions": ((a, spec.mask_width), jnp.bool_), "reward": ((a,), jnp.float32),
            "first": ((), jnp.bool_), "terminated": ((), jnp.bool_), "truncated": ((), jnp.bool_),
            "won": ((), jnp.bool_)}
    for name, (shape, dtype) in want.items():
        leaf = getattr(ts, name)
        assert tuple(leaf.shape) == batch + shape, (spec.env_id, name, leaf.shape)
        assert jnp.dtype(leaf.dtype) == jnp.dtype(dtype), (spec.env_id, name, leaf.dtype)


def _random_actions(key, spec: envs.EnvSpec, avail):
    """Uniform valid actions for [..., agent] envs: available discrete ones, or in the bounds."""
    if spec.discrete:
        return jax.random.categorical(key, jnp.where(avail, 0.0, -jnp.inf)).astype(jnp.int32)
    return jax.random.uniform(key, (*avail.shape[:-1], spec.action_dim), minval=spec.action_low,
                              maxval=spec.action_high)


def _check_flags(first, terminated, truncated, timesteps=False):
    """An end is terminated or truncated, never both; after an end the next obs are first:
    in stored transitions the step after the end, in Timesteps the end's own (the env
    has already reset)."""
    first, terminated, truncated = map(np.asarray, (first, terminated, truncated))
    assert not (terminated & truncated).any()
    assert first[0].all()
    ended = terminated | truncated
    np.testing.assert_array_equal(first[1:], ended[1:] if timesteps else ended[:-1])


@pytest.mark.parametrize("env_id", ALL_IDS)
def test_every_listed_env_makes_a_spec_that_its_steps_keep(env_id):
    why = envs.why_not(env_id)
    row = describe(env_id)  # what `marl envs` prints for it
    if why:  # a missing package or an env not adapted: one line naming what would work
        assert row["unavailable"] == why
        with pytest.raises(envs.EnvError) as err:
            envs.make(env_id)
        assert "\n" not in str(err.value) and why in str(err.value) and ("use" in why or "install" in why)
        return
    env = envs.make(env_id)
    spec = env.spec
    assert (row["agents"], row["obs"], row["state"]) == (spec.n_agents, spec.obs_dim, spec.state_dim)
    assert spec.episode_limit > 0 and spec.n_agents == len(set(spec.agents))
    assert (spec.n_actions > 0) == spec.discrete and (spec.action_dim > 0) != spec.discrete
    if spec.backend == "jax":
        assert row["backend"] == "JAX"
        key = jax.random.PRNGKey(0)
        ts, state = jax.eval_shape(env.reset, key)
        _check_timestep(ts, spec)
        actions = jax.eval_shape(lambda k: _random_actions(k, spec, jnp.ones((spec.n_agents, spec.mask_width), bool)), key)
        ts, _ = jax.eval_shape(env.step, key, state, actions)
        _check_timestep(ts, spec)
        return
    # PettingZoo: real steps in numpy, cheap
    assert row["backend"] == "CPU"
    steps = [env.reset(seed=0)]
    rng = np.random.default_rng(0)
    for _ in range(spec.episode_limit + 2):  # through one episode end
        avail = steps[-1].avail_actions
        if spec.discrete:
            actions = np.array([rng.choice(np.flatnonzero(m)) for m in avail])
        else:
            actions = rng.uniform(spec.action_low, spec.action_high, (spec.n_agents, spec.action_dim))
        steps.append(env.step(actions))
    for ts in steps:
        _check_timestep(ts, spec)
    _check_flags(*(np.stack([getattr(s, f) for s in steps]) for f in ("first", "terminated", "truncated")), timesteps=True)
    assert any(s.truncated or s.terminated for s in steps)


@all_envs
@pytest.mark.parametrize("env_id", JAX_IDS)
def test_every_jax_env_steps_for_real_under_jit(env_id):
    env = envs.make(env_id)
    spec, n = env.spec, 2
    reset, step = jax.jit(jax.vmap(env.reset)), jax.jit(jax.vmap(env.step))
    ts, state = reset(jax.random.split(jax.random.PRNGKey(0), n))
    seen = [ts]
    for i in range(4):
        key = jax.random.PRNGKey(i + 1)
        ts, state = step(jax.random.split(key, n), state, _random_actions(key, spec, ts.avail_actions))
        seen.append(ts)
    for ts in seen:
        _check_timestep(ts, spec, batch=(n,))
        assert np.isfinite(np.asarray(ts.obs)).all() and np.isfinite(np.asarray(ts.state)).all()
        assert np.asarray(ts.avail_actions).any(axis=-1).all()  # every agent may do something
    _check_flags(*(np.stack([getattr(s, f) for s in seen]) for f in ("first", "terminated", "truncated")),
                 timesteps=True)


# (env id, env kwargs, preset, algorithm): one tiny collect each into a real store, each
# learner whose action space fits at least once, each family at least once
COLLECTS = [
    ("jaxmarl:hanabi", {}, "mappo-mpe-tiny", "mappo"),  # legal-move masks
    ("jaxmarl:MPE_simple_speaker_listener_v4", {}, "qmix-smac-tiny", "qmix"),  # 3 and 5 actions
    ("jaxmarl:overcooked", {"layout": "cramped_room", "max_steps": 5}, "mappo-mpe-tiny", "ippo"),  # images
    ("jaxmarl:coin_game", {"num_inner_steps": 2, "num_outer_steps": 2}, "qmix-smac-tiny", "vdn"),
    ("jaxmarl:switch_riddle", {}, "qmix-smac-tiny", "iql"),  # multi-discrete obs, ends by "tell"
    ("jaxmarl:storm", {"num_inner_steps": 4}, "mappo-mpe-tiny", "ippo"),  # agents by index, obs over agents
    ("pz:mpe2.simple_speaker_listener_v4", {}, "mappo-mpe-tiny", "mappo"),  # the same padding on CPU
    ("pz:pettingzoo.butterfly.knights_archers_zombies_v11", {"max_cycles": 5}, "mappo-mpe-tiny", "mappo"),  # agents die
]
# 15-35 s each on 2 cores (a slow step or MADDPG's learner to compile): MARL_ALL_ENVS=1
SLOW_COLLECTS = [
    ("jaxmarl:MPE_simple_world_comm_v3", {}, "maddpg-mpe-tiny", "maddpg"),  # 9 and 5 action dims
    ("jaxmarl:jaxnav", {"lidar_num_beams": 8, "max_steps": 5}, "mappo-mpe-tiny", "ippo"),  # per-dim bounds
    ("jaxmarl:SMAX", {"scenario": "3m"}, "qmix-smac-tiny", "qmix"),  # both sides as agents
    ("jaxmarl:coin_game", {"num_inner_steps": 2, "num_outer_steps": 2}, "maddpg-mpe-tiny", "maddpg"),
    ("jaxmarl:overcooked_v2", {"max_steps": 5}, "mappo-mpe-tiny", "mappo"),
    ("jaxmarl:MPE_simple_tag_v3", {"max_steps": 5}, "maddpg-mpe-tiny", "maddpg"),
    ("jaxmarl:MPE_simple_facmac_3a_v1", {}, "mappo-mpe-tiny", "mappo"),
    ("pz:pettingzoo.butterfly.cooperative_pong_v6", {"max_cycles": 5}, "qmix-smac-tiny", "qmix"),  # images
]
TIME_LIMIT_ONLY = ("overcooked", "coin_game", "storm", "MPE_", "pz:mpe2")


def _tiny_run(tmp_path, env_id, env_kwargs, preset, algo, **overrides):
    return make_run_config(preset, env_id=env_id, run_dir=str(tmp_path / "run"), overrides={
        "algo": algo, "env_kwargs": json.dumps(env_kwargs), "n_collectors": "1", "envs_per_collector": "2",
        "steps_per_region": "8", "buffer_transitions": "64", "hidden": "16", **overrides})


def _collect_into_a_store(tmp_path, env_id, env_kwargs, preset, algo, train=False):
    """One tiny collect into a real store, checked; with `train` one train call on it too,
    which must update the policy (see TRAINS)."""
    config = _tiny_run(tmp_path, env_id, env_kwargs, preset, algo, **(TRAIN_SETTINGS[preset] if train else {}))
    spec = checks.check_env(config)  # the learner fits: no refusal
    cfg = config.to_dict()
    try:
        stages.prepare_run(cfg)
        before = stages.policy_params(cfg)
        collected = stages.collect(cfg, 0, 0, before, 0, 0)
        if train:
            out = stages.train(cfg, 0, config.steps_per_region * config.envs_per_region, False, [collected])
    finally:
        stages.clear_caches()
    if train:
        metrics = out["metrics"]
        assert metrics["updates"] == 1 and all(np.isfinite(v) for v in metrics["learner"].values())
        moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), before, out["params"])
        assert max(jax.tree.leaves(moved)) > 0  # the train call changed the policy
    store = ReplayStore.open(config.store_path)
    assert envs.EnvSpec.from_dict(store.attrs["env_spec"]) == spec
    data = store.read_region(0)
    T, N, A = config.steps_per_region, config.envs_per_region, spec.n_agents
    (obs_shape, obs_dtype), (state_shape, state_dtype) = spec.agent_obs, spec.global_state  # images: uint8
    assert data["obs"].shape == (T, N, A, *obs_shape) and data["obs"].dtype == obs_dtype
    assert data["state"].shape == (T, N, *state_shape) and data["state"].dtype == state_dtype
    assert data["avail_actions"].shape == (T, N, A, spec.mask_width) and data["avail_actions"].dtype == bool
    assert data["avail_actions"].any(axis=-1).all()
    assert np.isfinite(data["obs"]).all() and np.isfinite(data["reward"]).all()
    action = data["action"]
    if spec.discrete:
        assert action.shape == (T, N, A)
        taken = np.take_along_axis(data["avail_actions"], action[..., None].astype(np.int64), axis=-1)
        assert taken.all()  # never an unavailable or padded action
    else:
        assert action.shape == (T, N, A, spec.action_dim)
        assert (action >= spec.action_low).all() and (action <= spec.action_high).all()
    if spec.shaped_reward:  # Overcooked: the env's shaping term, stored beside the sparse reward
        shaped = data["shaped_reward"]
        assert shaped.shape == (T, N, A) and shaped.dtype == np.float32 and (shaped >= 0).all()
    else:
        assert "shaped_reward" not in data
    _check_flags(data["first"], data["terminated"], data["truncated"])
    ended = data["terminated"] | data["truncated"]
    if any(k in env_id for k in TIME_LIMIT_ONLY):
        assert not data["terminated"].any()  # their episodes end only at the time limit
    inner_episodes = env_kwargs.get("num_inner_steps", 99) * env_kwargs.get("num_outer_steps", 1)  # coin game, STORM
    if min(env_kwargs.get("max_steps", 99), env_kwargs.get("max_cycles", 99), inner_episodes) < T:
        assert ended.any()  # the short episodes ended inside the region
    return spec, data


@pytest.mark.parametrize("env_id, env_kwargs, preset, algo", COLLECTS, ids=[c[0] for c in COLLECTS])
def test_a_tiny_collect_into_a_real_store(tmp_path, env_id, env_kwargs, preset, algo):
    spec, data = _collect_into_a_store(tmp_path, env_id, env_kwargs, preset, algo)
    if "speaker_listener" in env_id:  # the speaker has 3 actions and 3 obs, the listener 5 and 11
        speaker = spec.agents.index("speaker_0")
        assert (data["avail_actions"][..., speaker, :] == [True, True, True, False, False]).all()
        assert (data["action"][..., speaker] < 3).all()
        assert (data["obs"][..., speaker, 3:] == 0).all()
    if env_id == "jaxmarl:hanabi":  # only the player to move has more than the one legal no-op
        assert (data["avail_actions"].sum(-1) > 1).sum(-1).max() == 1
    assert spec.shaped_reward == (env_id == "jaxmarl:overcooked")


def test_overcooked_gives_its_shaped_reward_to_the_agent_that_earned_it():
    """cramped_room: agent_0 takes an onion from the pile on its left and puts it in the pot
    (3, jaxmarl's PLACEMENT_IN_POT_REW) while agent_1 stays; the sparse reward stays 0."""
    env = envs.make("jaxmarl:overcooked", layout="cramped_room")
    step = jax.jit(env.step)
    ts, state = env.reset(jax.random.PRNGKey(0))
    np.testing.assert_array_equal(ts.shaped_reward, [0.0, 0.0])
    left, interact, right, up, stay = 3, 5, 2, 0, 4  # jaxmarl Overcooked's action_set order
    for i, action in enumerate([left, interact, right, up, interact]):
        ts, state = step(jax.random.PRNGKey(i), state, jnp.array([action, stay]))
    np.testing.assert_array_equal(ts.shaped_reward, [3.0, 0.0])
    np.testing.assert_array_equal(ts.reward, [0.0, 0.0])


def test_smax_own_health_lost_shaping_gives_each_ally_its_own_loss_and_the_team_term_their_mean():
    """own_health_lost_shaping: each ally's term is its own health lost (over its full health)
    over the number of allies, so allies hit differently get different terms and their sum is
    the team form's term on the same step. Asking for both forms is one line naming them."""
    own, team = envs.make("smax:3m", own_health_lost_shaping=True), envs.make("smax:3m", health_lost_shaping=True)
    assert own.spec.shaped_reward
    steps = [jax.jit(e.step) for e in (own, team)]
    ts, state = own.reset(jax.random.PRNGKey(0))
    totals, key, differed = np.zeros(3), jax.random.PRNGKey(1), False
    for _ in range(own.spec.episode_limit + 1):  # one episode, random play (3m: lost)
        key, k_act, k_step = jax.random.split(key, 3)
        action = jax.random.categorical(k_act, jnp.where(ts.avail_actions, 0.0, -jnp.inf))
        (ts, next_state), (ts_team, _) = (step(k_step, state, action) for step in steps)
        assert (ts.shaped_reward <= 0).all()
        np.testing.assert_allclose(ts_team.shaped_reward, np.full(3, ts.shaped_reward.sum()), rtol=1e-5, atol=1e-7)
        differed |= bool(ts.shaped_reward.min() != ts.shaped_reward.max())
        totals += np.asarray(ts.shaped_reward)
        state = next_state
        if ts.first:
            break
    assert ts.first and ts.terminated and not ts.won
    assert differed  # some step hit one ally and not another
    np.testing.assert_allclose(totals, -1 / 3, atol=1e-5)  # every ally died: each lost its whole health
    with pytest.raises(envs.EnvError, match="pass one of them"):
        envs.make("smax:3m", own_health_lost_shaping=True, health_lost_shaping=True)


def test_smax_health_lost_shaping_is_opt_in_and_a_lost_episode_sums_to_minus_one():
    """The opt-in SMAX shaping term is the team's own health lost: the same for every ally,
    never positive, and over an episode the allies lose (every ally dead) it sums to -1."""
    assert not envs.make("smax:3m").spec.shaped_reward
    env = envs.make("smax:3m", health_lost_shaping=True)
    assert env.spec.shaped_reward
    step = jax.jit(env.step)
    ts, state = env.reset(jax.random.PRNGKey(0))
    total, key = 0.0, jax.random.PRNGKey(1)
    for _ in range(env.spec.episode_limit + 1):  # one episode, random play (3m: lost)
        key, k_act, k_step = jax.random.split(key, 3)
        action = jax.random.categorical(k_act, jnp.where(ts.avail_actions, 0.0, -jnp.inf))
        ts, state = step(k_step, state, action)
        assert (ts.shaped_reward == ts.shaped_reward[0]).all() and ts.shaped_reward[0] <= 0
        total += float(ts.shaped_reward[0])
        if ts.first:
            break
    assert ts.first and ts.terminated and not ts.won
    assert total == pytest.approx(-1.0, abs=1e-5)


def test_the_scripted_smax_baseline_moves_each_ally_toward_its_nearest_enemy():
    """bench/smax_scripted.py's teams move as SMAX decodes its move actions (up, right, down,
    left): out of range at the start, every ally's first step goes within 45 degrees of the
    line to its nearest enemy."""
    import runpy

    scripted = runpy.run_path("bench/smax_scripted.py")
    env = envs.make("smax:3m")
    act, step, n = scripted["scripted_policy"](env, "focus fire"), jax.jit(env.step), env.env.num_allies
    for key in range(4):  # enemies above and below the allies' line
        ts, state = env.reset(jax.random.PRNGKey(key))
        actions = act(state, ts.avail_actions)
        assert (np.asarray(actions) < scripted["MOVES"]).all()  # nobody in range yet: all move
        before = np.asarray(state.state.unit_positions)
        moved = np.asarray(step(jax.random.PRNGKey(0), state, actions)[1].state.unit_positions[:n]) - before[:n]
        for i in range(n):
            to_enemies = before[n:] - before[i]
            nearest = to_enemies[np.argmin(np.linalg.norm(to_enemies, axis=-1))]
            cos = moved[i] @ nearest / (np.linalg.norm(moved[i]) * np.linalg.norm(nearest))
            assert cos > np.cos(np.pi / 4), (key, i, moved[i], nearest)


@all_envs
@pytest.mark.parametrize("env_id, env_kwargs, preset, algo", SLOW_COLLECTS, ids=[c[0] for c in SLOW_COLLECTS])
def test_a_tiny_collect_of_the_slower_envs(tmp_path, env_id, env_kwargs, preset, algo):
    _collect_into_a_store(tmp_path, env_id, env_kwargs, preset, algo)


# (env id, env kwargs, preset, algorithm): a tiny collect and one train call each, on the
# PettingZoo families beyond mpe2 and butterfly (sisl's pursuit: 8 pursuers on a grid, 5
# discrete moves; classic's one parallel game, rock-paper-scissors), each learner that fits
# their discrete actions; the rest of the learners with MARL_ALL_ENVS=1 (10-20 s each)
PURSUIT = ("pz:pettingzoo.sisl.pursuit_v5", {"max_cycles": 5})
RPS = ("pz:pettingzoo.classic.rps_v2", {"max_cycles": 5})
TRAINS = [(*PURSUIT, "mappo-mpe-tiny", "mappo"), (*RPS, "qmix-smac-tiny", "qmix")]
SLOW_TRAINS = [(*PURSUIT, "qmix-smac-tiny", algo) for algo in ("qmix", "vdn", "iql")] + \
    [(*PURSUIT, "mappo-mpe-tiny", "ippo")] + [(*RPS, "qmix-smac-tiny", algo) for algo in ("vdn", "iql")] + \
    [(*RPS, "mappo-mpe-tiny", algo) for algo in ("mappo", "ippo")]
# small enough for one update of a region of 2 envs x 8 steps
TRAIN_SETTINGS = {"mappo-mpe-tiny": {"epochs": "1", "minibatches": "1"},
                  "qmix-smac-tiny": {"learning_starts": "0", "batch_size": "2", "seq_len": "4",
                                     "updates_per_region": "1", "mixer_embed": "4", "hypernet_embed": "8"}}


@pytest.mark.parametrize("env_id, env_kwargs, preset, algo", TRAINS, ids=[f"{c[0]}-{c[3]}" for c in TRAINS])
def test_a_tiny_collect_and_one_train_call_on_sisl_and_classic(tmp_path, env_id, env_kwargs, preset, algo):
    spec, data = _collect_into_a_store(tmp_path, env_id, env_kwargs, preset, algo, train=True)
    if "pursuit" in env_id:  # 8 pursuers, each seeing a 7x7 window of 3 layers
        assert (spec.n_agents, spec.obs_dim, spec.n_actions) == (8, 147, 5)
    else:  # 2 players, each seeing the other's last move (one of 4 values), 3 moves
        assert (spec.n_agents, spec.n_actions) == (2, 3) and set(np.unique(data["obs"])) <= {0, 1, 2, 3}


@all_envs
@pytest.mark.parametrize("env_id, env_kwargs, preset, algo", SLOW_TRAINS, ids=[f"{c[0]}-{c[3]}" for c in SLOW_TRAINS])
def test_a_tiny_collect_and_one_train_call_with_the_other_learners(tmp_path, env_id, env_kwargs, preset, algo):
    _collect_into_a_store(tmp_path, env_id, env_kwargs, preset, algo, train=True)


@pytest.mark.parametrize("name", ["storm", "storm_2p", "storm_np"])
def test_storm_agents_each_see_their_own_view_and_get_their_own_reward(name):
    """jaxmarl's STORM envs index agents 0..n-1 and answer arrays over agents (storm's
    inventory with agents last) or tuples (storm_2p): each agent_<i> gets its own part."""
    env = envs.make(f"jaxmarl:{name}")
    raw = env.env.env  # jaxmarl's own env under the by-agent view
    key = jax.random.PRNGKey(3)
    ts, state = env.reset(key)
    obs, _ = raw.reset(key)
    for i in range(env.spec.n_agents):
        own = obs[i] if name != "storm" else {"observation": obs["observations"][i], "inventory": obs["inventory"][:, i]}
        np.testing.assert_array_equal(ts.obs[i], envs._flat(own))
    actions = jnp.array([1, 2], jnp.int32)
    step_key = jax.random.PRNGKey(4)
    ts, _ = env.step(step_key, state, actions)
    _, _, reward, _, _ = raw.step_env(jax.random.split(step_key)[0], state, actions)
    np.testing.assert_array_equal(ts.reward, jnp.stack([jnp.asarray(r, jnp.float32) for r in reward]))


def test_agents_with_other_bounds_act_in_one_range_rescaled_to_their_own():
    env = envs.make("jaxmarl:jaxnav", lidar_num_beams=8)
    space = env.env.action_space(env.spec.agents[0])
    assert (env.spec.action_low, env.spec.action_high) == (-1.0, 1.0)
    n = env.spec.n_agents
    for value, want in ((-1.0, space.low), (1.0, space.high)):
        out = env.env_actions(jnp.full((n, env.spec.action_dim), value))
        np.testing.assert_allclose(out[env.spec.agents[0]], want, rtol=1e-6)
    # one range for all agents (MPE's [0, 1]): passed through, cut to each agent's own dims
    comm = envs.make("jaxmarl:MPE_simple_world_comm_v3")
    assert (comm.spec.action_low, comm.spec.action_high, comm.spec.action_dim) == (0.0, 1.0, 9)
    out = comm.env_actions(jnp.full((comm.spec.n_agents, 9), 0.25))
    assert {a: v.shape for a, v in out.items()} == {a: (s,) for a, s in zip(comm.spec.agents, comm.action_sizes)}


def test_env_kwargs_reach_the_env_and_bad_ones_are_one_line():
    assert envs.spec_of("jaxmarl:hanabi", num_agents=3).n_agents == 3
    assert envs.spec_of("jaxmarl:HeuristicEnemySMAX", scenario="2s3z").n_agents == 5
    assert envs.spec_of("jaxmarl:overcooked", layout="coord_ring").obs_dim != envs.spec_of("jaxmarl:overcooked").obs_dim
    for env_id, kwargs, words in [
        ("jaxmarl:hanabi", {"num_agentz": 3}, ["unknown env kwarg(s) num_agentz", "num_agents"]),
        ("jaxmarl:hanabi", {"num_agents": 9}, ["jaxmarl:hanabi: bad env kwarg ("]),
        ("jaxmarl:overcooked", {"layout": "no_room"}, ["unknown layout 'no_room'", "cramped_room"]),
        ("jaxmarl:SMAX", {"scenario": "4m"}, ["unknown scenario '4m'", "3m"]),
        ("smax:3m", {"scenario": "8m"}, ["the id names the scenario"]),
        ("jaxmarl:nope", {}, ["unknown env id 'jaxmarl:nope'", "marl envs"]),
    ]:
        with pytest.raises(envs.EnvError) as err:
            envs.make(env_id, **kwargs)
        assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


def test_runs_the_system_cannot_train_are_refused_in_one_line(tmp_path):
    # a learner for discrete actions on a continuous env: says which learners fit
    with pytest.raises(algos.ConfigError, match=r"qmix needs discrete actions .* use ippo, maddpg, mappo"):
        checks.check_env(_tiny_run(tmp_path, "jaxmarl:jaxnav", {}, "qmix-smac-tiny", "qmix"))
    # a missing optional package: says which extra installs it
    if envs.why_not("jaxmarl:ant_4x2"):
        with pytest.raises(envs.EnvError, match=r"needs brax.*mabrax extra"):
            checks.check_env(_tiny_run(tmp_path, "jaxmarl:ant_4x2", {}, "mappo-mpe-tiny", "mappo"))
    # a preset's own env kwargs on another env: says whose they are
    config = make_run_config("maddpg-mpe-tiny", env_id="jaxmarl:hanabi", run_dir=str(tmp_path / "r"))
    with pytest.raises(envs.EnvError, match=r"preset maddpg-mpe-tiny's for mpe:simple_spread.*env_kwargs='\{\}'"):
        checks.check_env(config)
    # through the CLI: one line on stderr, exit 2, nothing written
    run_dir = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "train", "qmix-smac-tiny", "--env", "jaxmarl:jaxnav",
                           "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line
             and not line.startswith("  warnings.warn")]
    assert proc.returncode == 2 and len(lines) == 1 and "use ippo, maddpg, mappo" in lines[0], proc.stderr
    assert not run_dir.exists()


def test_marl_envs_lists_ids_with_their_spaces(capsys):
    from flows.cli import main

    assert main(["envs", "speaker"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("mpe:", "jaxmarl:", "pz:"))}
    assert set(rows) == {i for i in ALL_IDS if "speaker" in i}
    assert "discrete 5 (own 3/5), masked" in rows["jaxmarl:MPE_simple_speaker_listener_v4"]
    assert " JAX " in rows["mpe:simple_speaker_listener"] and " CPU " in rows["pz:mpe2.simple_speaker_listener_v4"]
    assert main(["envs", "no-such-env"]) == 2
    assert "no env id contains 'no-such-env'" in capsys.readouterr().err


def test_marl_envs_lists_the_butterfly_envs_or_the_extra_they_need(capsys, monkeypatch):
    from flows.cli import main

    butterfly = [i for i in ALL_IDS if i.startswith("pz:pettingzoo.butterfly.")]
    assert {"pz:pettingzoo.butterfly.pistonball_v6", "pz:pettingzoo.butterfly.cooperative_pong_v6",
            "pz:pettingzoo.butterfly.knights_archers_zombies_v11"} <= set(butterfly)
    assert main(["envs", "butterfly"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("pz:")}
    assert set(rows) == set(butterfly) and all(" CPU " in row for row in rows.values())
    assert "continuous 1 in [-1, 1]" in rows["pz:pettingzoo.butterfly.pistonball_v6"]
    assert "discrete 6" in rows["pz:pettingzoo.butterfly.knights_archers_zombies_v11"]
    # without pygame (as without the butterfly extra): listed with the extra that installs it
    monkeypatch.setitem(sys.modules, "pygame", None)
    for name in [m for m in sys.modules if m.startswith("pettingzoo.butterfly.")]:
        monkeypatch.delitem(sys.modules, name)
    for env_id in butterfly:
        assert envs.why_not(env_id) == ("needs pygame, which is not installed; install the butterfly extra "
                                        "(pip install 'marl-dataflow[butterfly]')")
    assert main(["envs", "pistonball"]) == 0
    assert "not available here: needs pygame" in capsys.readouterr().out


def test_marl_envs_lists_sisl_atari_and_the_one_parallel_classic_game(capsys):
    from flows.cli import main

    sisl = {i for i in ALL_IDS if i.startswith("pz:pettingzoo.sisl.")}
    assert {"pz:pettingzoo.sisl.pursuit_v5", "pz:pettingzoo.sisl.multiwalker_v9"} <= sisl
    # classic's turn-based games (chess, go, tictactoe, ...) have no parallel env: not listed
    assert [i for i in ALL_IDS if i.startswith("pz:pettingzoo.classic.")] == ["pz:pettingzoo.classic.rps_v2"]
    assert "pz:pettingzoo.atari.pong_v3" in ALL_IDS
    assert main(["envs", "pettingzoo."]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("pz:")}
    assert "discrete 5" in rows["pz:pettingzoo.sisl.pursuit_v5"] and " CPU " in rows["pz:pettingzoo.sisl.pursuit_v5"]
    assert "discrete 3" in rows["pz:pettingzoo.classic.rps_v2"]
    # what is missing here says how to install it (Box2D for multiwalker, the emulator and ROMs for atari)
    if envs.why_not("pz:pettingzoo.sisl.multiwalker_v9"):
        assert "not available here: needs Box2D, which is not installed; install PettingZoo's sisl extra " \
               "(pip install 'pettingzoo[sisl]')" in rows["pz:pettingzoo.sisl.multiwalker_v9"]
    if envs.why_not("pz:pettingzoo.atari.pong_v3"):
        assert "AutoROM --accept-license" in rows["pz:pettingzoo.atari.pong_v3"]


def test_marl_envs_columns_fit_image_sizes(capsys):
    from flows.cli import main

    assert main(["envs", "butterfly"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("id ", "pz:"))]
    header, rows = lines[0], {line.split()[0]: line for line in lines[1:]}
    piston = rows["pz:pettingzoo.butterfly.pistonball_v6"]
    assert piston.split()[3:5] == ["457x120x3", "560x880x3"]  # a piston's crop, the screen of 20
    # every column's values end where its heading does
    for column, value in (("obs", "457x120x3"), ("state", "560x880x3"), ("limit", "125")):
        end = header.index(f" {column} ") + len(column) + 1
        assert piston[end - len(value): end] == value, (header, piston)
    knights = rows["pz:pettingzoo.butterfly.knights_archers_zombies_v11"]
    assert knights[header.index(" obs ") + 4 - 3: header.index(" obs ") + 4] == "135"  # vectors: their size
