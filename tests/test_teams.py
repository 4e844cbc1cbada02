"""Competitive teams (marl/teams.py): teams from the agents' names or `--set teams=...`, and
one team trained against a fixed opponent played inside the env's step (random, noop, or a
policy written by `marl export`), on real jaxmarl and PettingZoo MPE envs, real stores, a
real flow run on the test cluster and a real export."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flows import checks
from flows.cli import main
from marl import envs, load_policy, teams
from marl.algos import ConfigError
from pipelines import stages
from pipelines.config import make_run_config
from storage import ReplayStore, open_replay

pytestmark = pytest.mark.filterwarnings("ignore")  # jaxmarl's deprecation and dtype notes

ADVERSARY = "mpe:simple_adversary"
TINY = "mappo-mpe-tiny"


def cli(capture, *args) -> tuple[int, str, str]:
    """`marl ARGS` in this process: (exit code, stdout, stderr)."""
    code = main([str(a) for a in args])
    out, err = capture.readouterr()
    return code, out, err


def test_teams_come_from_the_agents_names_or_a_spec_and_bad_specs_are_one_line(capfd):
    assert envs.make(ADVERSARY).teams == {"adversary": ("adversary_0",), "agent": ("agent_0", "agent_1")}
    assert teams.detect(("adversary_0", "adversary_1", "adversary_2", "agent_0")) == \
        {"adversary": ("adversary_0", "adversary_1", "adversary_2"), "agent": ("agent_0",)}  # simple_tag
    assert teams.detect(("leadadversary_0", "adversary_0", "agent_0")) == \
        {"adversary": ("leadadversary_0", "adversary_0"), "agent": ("agent_0",)}  # simple_world_comm
    assert teams.detect(("ally_0", "ally_1", "enemy_0")) == {"ally": ("ally_0", "ally_1"), "enemy": ("enemy_0",)}
    assert teams.detect(("eve_0", "bob_0", "alice_0")) == {"adversary": ("eve_0",), "agent": ("bob_0", "alice_0")}
    assert teams.detect(("speaker_0", "listener_0")) == {"all": ("speaker_0", "listener_0")}  # cooperative
    assert teams.detect(("agent_0", "agent_1")) == {"agent": ("agent_0", "agent_1")}
    agents = ("adversary_0", "agent_0", "agent_1")
    want = {"red": ("adversary_0", "agent_1"), "blue": ("agent_0",)}
    for spec in ("red:adversary_0,agent_1;blue:agent_0", '{"red": ["adversary_*", "agent_1"], "blue": ["agent_0"]}',
                 {"red": "adversary_0,agent_1", "blue": ["agent_*0"]}):
        assert teams.parse(spec, agents, ADVERSARY) == want, spec
    # the PettingZoo version has the same teams, its agents in its own order
    assert envs.make("pz:mpe2.simple_tag_v3").teams["agent"] == ("agent_0",)
    for kwargs, words in [
        ({"teams": "a:agent_9;b:adversary_0,agent_0,agent_1"}, ["names 'agent_9', which is no agent of this env",
                                                              "its agents: adversary_0, agent_0, agent_1"]),
        ({"teams": "a:agent_0"}, ["agent(s) adversary_0, agent_1 are in no team"]),
        ({"teams": "a:agent_*;b:agent_0,adversary_0"}, ["agent agent_0 is in teams 'a' and 'b'"]),
        ({"teams": "{oops"}, ["is not JSON"]),
        ({"teams": "agents"}, ["bad team 'agents'"]),
        ({"train_team": "red"}, ["train_team=red is not one of its teams (adversary, agent)"]),
        ({"opponent": "noop"}, ["opponent=noop needs train_team=<team>"]),
        ({"train_team": "agent", "opponent": "/no/such/dir"}, ["neither random nor noop nor a directory"]),
    ]:
        with pytest.raises(envs.EnvError) as err:
            envs.make(ADVERSARY, **kwargs)
        message = str(err.value)
        assert "\n" not in message and all(w in message for w in words), message
        assert "--set" in message or "pass" in message or "add" in message or "write" in message, message
    with pytest.raises(envs.EnvError, match="has one team .*split its agents"):
        envs.make("mpe:simple_spread", train_team="agent")
    # --set teams=... is a run setting, checked (with the env) before anything starts
    config = make_run_config(TINY, env_id=ADVERSARY, overrides={"teams": "a:agent_7"})
    with pytest.raises(envs.EnvError, match="names 'agent_7', which is no agent"):
        checks.check_env(config)
    with pytest.raises(ConfigError, match="train_team"):
        make_run_config(TINY, overrides={"train_teem": "agent"})
    # `marl envs` shows the teams
    assert main(["envs", "simple_adversary"]) == 0
    rows = {line.split()[0]: line for line in capfd.readouterr().out.splitlines()
            if line.strip() and ":" in line.split()[0]}
    assert rows[ADVERSARY].endswith("discrete 5, teams adversary(1)/agent(2)")
    assert rows["pz:mpe2.simple_adversary_v3"].endswith("teams adversary(1)/agent(2)")


def test_a_team_view_shows_its_agents_and_reward_and_steps_the_others_inside():
    full = envs.make(ADVERSARY)
    view = envs.make(ADVERSARY, train_team="agent", opponent="noop")
    assert view.spec.agents == ("agent_0", "agent_1") and view.opponent_agents == ("adversary_0",)
    assert (view.spec.obs_dim, view.spec.state_dim, view.spec.n_actions) == (10, full.spec.state_dim, 5)
    assert envs.make(ADVERSARY, train_team="adversary").spec.obs_dim == 8  # the adversary's own obs
    reset, step = jax.jit(view.reset), jax.jit(view.step)
    full_step = jax.jit(full.step)
    key = jax.random.PRNGKey(3)
    ts, state = reset(key)
    full_ts, full_state = jax.jit(full.reset)(key)
    start = state.env_state.p_pos[0]
    rng = np.random.default_rng(0)
    for t in range(6):
        key, k = jax.random.split(key)
        actions = jnp.asarray(rng.integers(0, 5, 2), jnp.int32)
        ts, state = step(k, state, actions)
        # the same step of the whole env, the adversary doing nothing (noop = action 0)
        full_ts, full_state = full_step(jax.random.split(k)[1], full_state, jnp.concatenate([jnp.zeros(1, jnp.int32), actions]))
        np.testing.assert_allclose(ts.reward, full_ts.reward[1:])  # the team's own reward
        np.testing.assert_allclose(state.rewards, full_ts.reward)  # every agent's, for scoring each team
        np.testing.assert_allclose(ts.obs, full_ts.obs[1:])
        assert ts.obs.shape == (2, 10) and ts.avail_actions.shape == (2, 5)
    np.testing.assert_allclose(state.env_state.p_pos[0], start)  # the noop adversary stayed put
    # a random adversary moves
    random_view = envs.make(ADVERSARY, train_team="agent")
    ts, state = random_view.reset(key)
    start, random_step = state.env_state.p_pos[0], jax.jit(random_view.step)
    for t in range(3):
        ts, state = random_step(jax.random.PRNGKey(t), state, jnp.zeros(2, jnp.int32))
    assert not np.allclose(state.env_state.p_pos[0], start)


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory, prefect_server, dask_cluster):
    """`marl train` (the flow, on the test cluster) of MAPPO's team `agent` on simple_adversary
    against a random adversary."""
    from flows.train import marl_train

    run_dir = str(tmp_path_factory.mktemp("teams") / "agent-run")
    result = marl_train(preset=TINY, env=ADVERSARY, run_dir=run_dir, env_steps=256,
                        overrides={"train_team": "agent", "opponent": "random"},
                        scheduler_address=dask_cluster.scheduler_address)
    return run_dir, result


def test_a_flow_trains_one_team_against_a_random_opponent(agent_run):
    run_dir, result = agent_run
    assert result["env_steps"] == 256 and np.isfinite(result["final_eval"]["return_mean"])
    # the training evaluation scores each team apart; the run's own return is the trained team's
    final, last = result["final_eval"], result["history"][-1]
    assert final["teams"] == ["adversary", "agent"] and final["return_mean"] == final["agent_return_mean"]
    assert last["test_return"] == final["agent_return_mean"] and np.isfinite(last["test_adversary_return"])
    store = ReplayStore.open(os.path.join(run_dir, "replay"))
    assert store.attrs["env_spec"]["agents"] == ["agent_0", "agent_1"]
    assert store.attrs["config"]["env_kwargs"] == {"train_team": "agent", "opponent": "random"}
    ds = open_replay(os.path.join(run_dir, "replay"))
    assert ds.sizes["agent"] == 2 and ds.sizes["obs_dim"] == 10
    reward = ds.reward.values
    # the agents share simple_adversary's good-team reward; the adversary's is not there
    np.testing.assert_allclose(reward[..., 0], reward[..., 1])
    assert np.isfinite(ds.obs.values).all() and ds.sizes["step"] == 32  # 2 regions of 16 steps


def test_eval_and_render_of_a_team_run_score_each_team(agent_run, tmp_path, capsys):
    """`marl eval` reports each team's own return and win rate (the fixed opponent's too);
    `--render` draws the whole env, the random adversary moving beside the trained agents."""
    from pipelines.render import play_episodes
    from pipelines.saved_run import load_run

    run_dir, _ = agent_run
    assert main(["eval", run_dir, "--episodes", "4", "--json"]) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    assert report["teams"] == {"adversary": "opponent=random", "agent": "trained"}
    assert report["metrics"] == ["adversary_win_rate", "adversary_return", "agent_win_rate", "agent_return", "length"]
    row = report["per_seed"][0]
    assert row["length"] == 26 and row["agent_win_rate"] == 0  # MPE: whole episodes, no win signal
    for team in ("adversary", "agent"):
        lo, hi = report["mean"][f"{team}_return_ci95"]
        assert lo <= row[f"{team}_return"] <= hi and lo < hi
    # simple_adversary: the agents gain what the adversary loses (its reward is -its distance to the
    # goal; theirs is the adversary's distance minus their nearest one's), so the two differ
    assert row["agent_return"] != row["adversary_return"]
    assert main(["eval", run_dir, "--episodes", "4"]) == 0
    table = capsys.readouterr().out
    assert "teams: adversary opponent=random, agent trained" in table and "agent return [95% CI]" in table
    run = load_run(run_dir)
    (episode,) = play_episodes(run, 1, max_steps=4)
    _, state, actions = episode.steps[0]
    assert actions.shape == (3,) and state.p_pos.shape == (5, 2)  # every agent's action, the whole world drawn
    assert np.abs(episode.steps[-1][1].p_pos[0] - state.p_pos[0]).max() > 0  # the random adversary moved
    assert set(episode.teams) == {"adversary", "agent"}
    out = tmp_path / "teams.gif"
    assert main(["eval", run_dir, "--render", str(out), "--render-episodes", "1", "--render-steps", "4"]) == 0
    line = capsys.readouterr().out
    assert "adversary (opponent=random) returns" in line and "agent (trained) returns" in line, line
    from PIL import Image

    with Image.open(out) as gif:
        assert gif.n_frames == 4


def test_a_team_trains_against_an_exported_policy(agent_run, tmp_path, capsys):
    run_dir, _ = agent_run
    out = tmp_path / "agents-policy"
    assert main(["export", run_dir, "--out", str(out)]) == 0, capsys.readouterr().err
    policy = load_policy(str(out))
    assert policy.spec.agents == ("agent_0", "agent_1")
    code, _, err = cli(capsys, "export", run_dir, "--out", tmp_path / "x", "--team", "adversary")
    assert code == 2 and err.count("\n") == 1 and "did not train in this run (it played the fixed " \
        "opponent=random); only team agent trained: pass --team agent or drop --team" in err, err
    # the adversary trains against the exported agents, which act greedily inside the step
    view = envs.make(ADVERSARY, train_team="adversary", opponent=str(out))
    ts, state = view.reset(jax.random.PRNGKey(0))
    step = jax.jit(view.step)
    for t in range(3):
        want, _ = policy.act(np.asarray(state.opponent_obs))  # greedy, feed-forward
        ts, state = step(jax.random.PRNGKey(t), state, jnp.zeros(1, jnp.int32))
        np.testing.assert_array_equal(np.asarray(state.opponent_action), want)
    config = make_run_config(TINY, env_id=ADVERSARY, run_dir=str(tmp_path / "adversary-run"), n_collectors=1,
                             total_env_steps=256, overrides={"train_team": "adversary", "opponent": str(out)})
    assert checks.check_env(config).agents == ("adversary_0",)
    cfg = config.to_dict()
    try:
        stages.prepare_run(cfg)
        params = stages.policy_params(cfg)
        stats = stages.collect(cfg, 0, 0, params, 0, 0)
        assert stages.train(cfg, 0, 128, True, [stats])["metrics"]["updates"] == 1
    finally:
        stages.clear_caches()
    ds = open_replay(config.store_path)
    assert ds.sizes["agent"] == 1 and ds.sizes["obs_dim"] == 8
    # the exported agents' policy cannot play the adversary
    with pytest.raises(envs.EnvError, match=r"plays agents agent_0, agent_1, not adversary_0; export a run"):
        envs.make(ADVERSARY, train_team="agent", opponent=str(out))


def test_a_pettingzoo_team_collects_against_a_fixed_opponent(tmp_path):
    env = envs.make("pz:mpe2.simple_adversary_v3", train_team="agent", opponent="noop")
    assert env.spec.agents == ("agent_0", "agent_1") and env.spec.backend == "numpy"
    ts = env.reset(seed=0)
    start = env.env.unwrapped.world.agents[0].state.p_pos.copy()  # the adversary
    for _ in range(3):
        ts = env.step(np.array([1, 2]))
    assert ts.obs.shape == (2, 10) and ts.reward.shape == (2,)
    np.testing.assert_allclose(env.env.unwrapped.world.agents[0].state.p_pos, start)  # noop: it stayed
    rewards = env.env.rewards  # every agent's, the opponent's too (for scoring each team)
    assert set(rewards) == {"adversary_0", "agent_0", "agent_1"} and ts.reward.tolist() == \
        pytest.approx([rewards["agent_0"], rewards["agent_1"]])
    config = make_run_config(TINY, env_id="pz:mpe2.simple_adversary_v3", run_dir=str(tmp_path / "run"),
                             n_collectors=1, overrides={"train_team": "adversary", "envs_per_collector": "2",
                                                        "steps_per_region": "30"})
    cfg = config.to_dict()
    try:
        stages.prepare_run(cfg)
        stages.collect(cfg, 0, 0, stages.policy_params(cfg), 0, 0)
    finally:
        stages.clear_caches()
    data = ReplayStore.open(config.store_path).read_region(0)
    assert data["obs"].shape == (30, 2, 1, 8) and data["action"].shape == (30, 2, 1)
    assert data["truncated"].any()  # through an episode end (25 steps) and its auto-reset
    # eval scores both teams, the random agents' return read off the wrapper
    from pipelines.saved_run import SavedRun, evaluate_run

    parts = stages.RunParts.build(config)
    params = parts.single_seed.policy_params(parts.single_seed.init(jax.random.PRNGKey(0)))
    report = evaluate_run(SavedRun(config, parts, 0, {"env_steps": 0}, params), episodes=2)
    row = report["per_seed"][0]
    assert report["teams"] == {"adversary": "trained", "agent": "opponent=random"} and row["length"] == 25
    assert row["adversary_return"] < 0 and row["agent_return"] != row["adversary_return"]  # -its goal distance


def test_every_team_learns_with_its_own_learner_and_replay_fields(tmp_path, capfd):
    config = make_run_config(TINY, env_id=ADVERSARY, run_dir=str(tmp_path / "run"), n_collectors=1,
                             total_env_steps=64, overrides={"train_team": "each", "envs_per_collector": "4",
                                                            "steps_per_region": "16", "hidden": "16"})
    spec = checks.check_env(config)
    assert spec.agents == ("adversary_0", "agent_0", "agent_1")  # every agent acts through the learner
    assert [t[:3] for t in spec.teams] == [("adversary", ("adversary_0",), 8), ("agent", ("agent_0", "agent_1"), 10)]
    cfg = config.to_dict()
    try:
        stages.prepare_run(cfg)
        before = stages.policy_params(cfg)
        stats = stages.collect(cfg, 0, 0, before, 0, 0)
        out = stages.train(cfg, 0, 64, True, [stats])
        evaluation = stages.evaluate(cfg, out["params"], 0)
        stages.clear_caches()
        restored = stages.policy_params(cfg)  # a fresh learner, from the checkpoint
    finally:
        stages.clear_caches()
    assert set(out["params"]) == {"adversary", "agent"}
    # each team scored on its own reward (the run's own score: the first team's)
    assert evaluation["teams"] == ["adversary", "agent"] and evaluation["episodes"] > 0
    assert evaluation["return_mean"] == evaluation["adversary_return_mean"] != evaluation["agent_return_mean"]
    # the run's loss (its metrics.csv column) is the mean of the teams' own
    m = out["metrics"]["learner"]
    assert out["metrics"]["teams"] == ["adversary", "agent"]
    assert m["loss"] == pytest.approx((m["adversary_loss"] + m["agent_loss"]) / 2)
    for team in ("adversary", "agent"):  # each team's learner updated its own actor
        assert f"{team}_actor_loss" in m and np.isfinite(m[f"{team}_value_loss"])
        moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), before[team], out["params"][team])
        assert max(jax.tree.leaves(moved)) > 0
        jax.tree.map(np.testing.assert_array_equal, restored[team], out["params"][team])
    ds = open_replay(config.store_path)
    assert ds.sizes["agent"] == 3 and ds.logp_adversary.dims == ("step", "env", "adversary_team")
    assert ds.sizes["adversary_team"] == 1 and ds.sizes["agent_team"] == 2
    # the behaviour log-probabilities are each team's own policy's: finite, and no agent's is the other team's
    assert np.isfinite(ds.logp_adversary.values).all() and np.isfinite(ds.logp_agent.values).all()
    # export: a team alone (--team), or every team as one policy (--team each); none names the teams
    code, _, err = cli(capfd, "export", config.run_dir, "--out", tmp_path / "x")
    assert code == 2 and err.count("\n") == 1, err
    assert "trains teams adversary, agent" in err and "--team adversary or --team agent" in err, err
    code, _, err = cli(capfd, "export", config.run_dir, "--out", tmp_path / "both", "--team", "each")
    assert code == 0, err
    policy = load_policy(str(tmp_path / "both"))
    obs, avail = ds.obs.values[:4, 0], ds.avail_actions.values[:4, 0]  # [step, agent, ...] as a batch of envs
    actions, _ = policy.act(obs, avail)
    assert actions.shape == (4, 3) and policy.spec.teams == spec.teams
    code, _, err = cli(capfd, "export", config.run_dir, "--out", tmp_path / "agents", "--team", "agent")
    assert code == 0, err
    agents = load_policy(str(tmp_path / "agents"))
    assert agents.spec.agents == ("agent_0", "agent_1") and agents.spec.obs_dim == 10 and not agents.spec.teams
    mine, _ = agents.act(obs[:, 1:, :10], avail[:, 1:])
    np.testing.assert_array_equal(mine, actions[:, 1:])  # the team's learner's own actions
    # and usable as the fixed opponent of a run that trains the adversary
    assert envs.make(ADVERSARY, train_team="adversary", opponent=str(tmp_path / "agents")).opponent_agents == \
        ("agent_0", "agent_1")
    # eval scores both teams, each trained
    code, out, err = cli(capfd, "eval", config.run_dir, "--episodes", 2, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["teams"] == {"adversary": "trained", "agent": "trained"}
    assert np.isfinite([report["mean"]["adversary_return"], report["mean"]["agent_return"]]).all()
    code, out, err = cli(capfd, "eval", config.run_dir, "--render", tmp_path / "each.gif", "--render-episodes", 1,
                         "--render-steps", 2)
    assert code == 0 and "adversary (trained) returns" in out and "agent (trained) returns" in out, err
    with pytest.raises(envs.EnvError, match="train_team=each .* has one team"):
        envs.make("mpe:simple_spread", train_team="each")


def test_a_training_smax_enemy_team_wins_when_the_allies_are_wiped_out():
    """jaxmarl's SMAX with both sides as agents: the enemy team's `won` is the enemies' win
    (allies all dead, some enemy alive); both wiped out at once is a draw, nobody's win."""
    view = envs.make("jaxmarl:SMAX", scenario="3m", train_team="enemy", opponent="noop")
    assert view.spec.agents == ("enemy_0", "enemy_1", "enemy_2")
    ts, state = view.reset(jax.random.PRNGKey(0))
    step = jax.jit(view.step)
    health = state.env_state.unit_health
    for dead, enemy_won, ally_won in [(slice(0, 3), True, False), (slice(3, 6), False, True),
                                      (slice(0, 6), False, False), (slice(0, 0), False, False)]:
        start = state._replace(env_state=state.env_state.replace(unit_health=health.at[dead].set(0.0)))
        ts, after = step(jax.random.PRNGKey(1), start, jnp.zeros(3, jnp.int32))
        assert bool(ts.first) == (dead.stop > dead.start)  # a side wiped out ends the episode
        assert bool(ts.won) == enemy_won and after.teams_won.tolist() == [ally_won, enemy_won], dead
    # train_team=each: evaluation reads both sides' wins off the whole env
    whole = envs.make("jaxmarl:SMAX", scenario="3m", train_team="each")
    env, names, score = teams.team_scores(whole)
    ts, state = env.reset(jax.random.PRNGKey(0))
    state = state.replace(unit_health=state.unit_health.at[:3].set(0.0))
    ts, state = jax.jit(env.step)(jax.random.PRNGKey(1), state, jnp.zeros(6, jnp.int32))
    reward, won = score(ts, state)
    assert names == ("ally", "enemy") and won.tolist() == [False, True] and reward.shape == (2,)


def test_a_smax_team_view_draws_both_sides_units():
    """A team run on jaxmarl's SMAX renders with jaxmarl's SMAX renderer: every unit of the
    whole env shoots and is drawn (the heuristic-enemy env names them `all_agents`, SMAX not)."""
    from pipelines.render import SMAX_SUBSTEP_STRIDE, Episode, _SmaxDrawer, _whole_step

    view = envs.make("jaxmarl:SMAX", scenario="3m", train_team="enemy", opponent="random")
    key = jax.random.PRNGKey(0)
    ts, state = view.reset(key)
    episode = Episode([])
    for t in range(2):
        step_key = jax.random.fold_in(key, t)
        ts, after = view.step(step_key, state, jnp.zeros(3, jnp.int32))
        episode.steps.append(_whole_step(view, step_key, state, jnp.zeros(3, jnp.int32), after))
        state = after
    _, whole, actions = episode.steps[0]
    assert actions.shape == (6,) and whole.unit_positions.shape == (6, 2)  # both sides' units
    drawer = _SmaxDrawer(view, [episode])
    frames = sum(1 for _ in drawer.frames())
    assert frames == 2 * view.env.world_steps_per_env_step // SMAX_SUBSTEP_STRIDE
    assert len(drawer.ax.collections) + len(drawer.ax.patches) > 0  # units were drawn


# pistonball (tests/test_image_obs.py's tiny one): every piston sees a (457, 120, 3) uint8 crop
PISTONBALL = "pz:pettingzoo.butterfly.pistonball_v6"
PISTONS = {"n_pistons": 3, "continuous": False, "max_cycles": 5}
CROP = (457, 120, 3)


def test_teams_of_an_image_env_keep_their_images_and_each_learns_with_its_own_encoder(tmp_path):
    split = "left:piston_0;right:piston_1,piston_2"
    # one team's view: its agents' images, the other team played inside the step
    view = envs.make(PISTONBALL, **PISTONS, teams=split, train_team="right", opponent="random")
    assert view.spec.agents == ("piston_1", "piston_2") and view.spec.obs_shape == CROP
    ts = view.reset(seed=0)
    ts = view.step(np.array([2, 0]))
    assert ts.obs.shape == (2, *CROP) and ts.obs.dtype == np.uint8 and ts.obs.any()
    assert set(view.env.rewards) == {"piston_0", "piston_1", "piston_2"}  # the opponent piston played too
    # every team learning: the store keeps every agent's images, each team's learner its own encoder
    config = make_run_config(TINY, env_id=PISTONBALL, run_dir=str(tmp_path / "run"), n_collectors=1, overrides={
        "env_kwargs": json.dumps({**PISTONS, "teams": split, "train_team": "each"}), "envs_per_collector": "2",
        "steps_per_region": "8", "hidden": "16", "epochs": "1", "minibatches": "1"})
    spec = checks.check_env(config)
    assert [t[:2] for t in spec.teams] == [("left", ("piston_0",)), ("right", ("piston_1", "piston_2"))]
    cfg = config.to_dict()
    try:
        stages.prepare_run(cfg)
        before = stages.policy_params(cfg)
        stats = stages.collect(cfg, 0, 0, before, 0, 0)
        out = stages.train(cfg, 0, 16, True, [stats])
    finally:
        stages.clear_caches()
    data = ReplayStore.open(config.store_path).read_region(0)
    assert data["obs"].shape == (8, 2, 3, *CROP) and data["obs"].dtype == np.uint8
    assert data["logp_left"].shape == (8, 2, 1) and data["logp_right"].shape == (8, 2, 2)
    for team in ("left", "right"):
        assert "encoder" in out["params"][team]["params"]  # the team's actor sees pixels through its own
        assert np.isfinite(out["metrics"]["learner"][f"{team}_value_loss"])
        moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), before[team], out["params"][team])
        assert max(jax.tree.leaves(moved)) > 0
    # a team exported alone plays the fixed opponent of a view on the images it sees
    assert main(["export", config.run_dir, "--out", str(tmp_path / "right"), "--team", "right"]) == 0
    left = envs.make(PISTONBALL, **PISTONS, teams=split, train_team="left", opponent=str(tmp_path / "right"))
    assert left.spec.agents == ("piston_0",) and left.spec.obs_shape == CROP
    left.reset(seed=0)
    assert left.step(np.array([1])).obs.shape == (1, *CROP)
    assert set(left.env.rewards) == {"piston_0", "piston_1", "piston_2"}
