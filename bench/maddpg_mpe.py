"""MADDPG on MPE simple spread (continuous actions, 3 agents, 25-step episodes) through the
whole pipeline (Prefect flow, local Dask cluster, Zarr replay, orbax checkpoints), against
PARL's published MADDPG figures, in both of their reward conventions. Measured in the same
script on this machine: a random policy, and the same MADDPG in a plain single-process
jitted loop (no Dask, Prefect or Zarr), for the wall-time ratio.

    python bench/maddpg_mpe.py [--env-steps 2500000] [--checkpoint-steps 625000]
                               [--reference-steps 625000] [--no-reference]

Writes bench/results/maddpg_mpe.{json,md,png}.

Reward conventions. Each greedy test episode is scored from the positions it visits: D_t,
the sum over landmarks of the distance to the nearest agent, and c_{i,t}, the number of
other agents that agent i touches. Then, per episode (t = 1..25):
  - jaxmarl (what we train on, local_ratio 0.5): r_i = -0.5 c_i - 0.5 D; reported as the
    per-agent mean episode return (the pipeline's test return) and as the sum over agents.
  - PARL 2022 (PettingZoo simple_spread_v2, local_ratio=0; examples/MADDPG, plot in
    benchmarking-rl/PARL-experiments MADDPG/paddle/result.png, about -200 -> -50 over 100k
    episodes): every agent gets -D; PARL logs the sum over agents: -3 sum_t D_t.
  - PARL 2021 (OpenAI's multiagent-particle-envs via parl.env.multiagent_simple_env;
    benchmark/fluid/MADDPG/.benchmark/MADDPG_simple_spread.png, about -850 -> -450 over 25k
    episodes): each agent's reward is -D - (collisions, counting itself), and the
    collaborative env gives every agent the sum over agents; PARL logs the sum over agents:
    sum_t 3 (-3 D_t - sum_i c_{i,t} - 3).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402  (bench/report.py)

PRESET = "maddpg-mpe"
EPISODE = 25
EVAL_EPISODES = 1000
# PARL's figures, read off its plots; x = episodes of 25 env steps
PARL = {
    "parl_2021_openai_sum": {"env_steps": 25_000 * EPISODE, "start": -850.0, "end": -460.0,
                             "what": "PARL 2021 plot: -850 -> -457/-466/-464 (3 runs) at 25k episodes"},
    "parl_2022_pz_sum": {"env_steps": 100_000 * EPISODE, "start": -200.0, "end": -50.0,
                         "what": "PARL 2022 plot: about -200 -> -50 (continuous and discrete) at 100k episodes"},
}
PARL_2022_AT_25K_EPISODES = -100.0  # the same plot at 25k episodes (about -110 to -95)


# ----------------------------------------------------------------------- scoring


def make_scorer(spec_env, act, n_episodes: int):
    """score(params, key) -> mean episode returns in every convention (see the docstring),
    over n_episodes fresh greedy episodes of exactly EPISODE steps."""
    import jax
    import jax.numpy as jnp

    env = spec_env.env  # the jaxmarl env under the adapter: its raw positions
    agents, n = spec_env.spec.agents, spec_env.spec.n_agents

    def positions_terms(state):
        p = state.p_pos
        agent_pos, land_pos = p[:n], p[n:]
        d = jnp.linalg.norm(agent_pos[None, :, :] - land_pos[:, None, :], axis=-1)  # [land, agent]
        dist_sum = d.min(axis=1).sum()
        gap = jnp.linalg.norm(agent_pos[:, None] - agent_pos[None, :], axis=-1)
        touch = (gap < env.rad[:n, None] + env.rad[None, :n]) & ~jnp.eye(n, dtype=bool)
        return dist_sum, touch.sum(axis=1).astype(jnp.float32)  # D, c_i [agent]

    def episode(params, key):
        key, reset_key = jax.random.split(key)
        obs, state = env.reset(reset_key)

        def step(carry, _):
            obs, state, key = carry
            key, act_key, step_key = jax.random.split(key, 3)
            obs_arr = jnp.stack([obs[a] for a in agents])[None]
            actions, _, _ = act(params, jnp.zeros((1, 0)), obs_arr, jnp.ones((1, n, 1), bool),
                                jnp.zeros((1,), bool), act_key, greedy)
            obs, state, reward, done, _ = env.step_env(step_key, state, {a: actions[0, i] for i, a in enumerate(agents)})
            dist_sum, touches = positions_terms(state)
            return (obs, state, key), (dist_sum, touches, jnp.stack([reward[a] for a in agents]), done["__all__"])

        _, (dist_sum, touches, reward, done) = jax.lax.scan(step, (obs, state, key), None, EPISODE)
        return dist_sum, touches, reward, done

    greedy = {"noise_std": jnp.float32(0.0), "sample": jnp.float32(0.0)}

    @jax.jit
    def score(params, key):
        dist_sum, touches, reward, done = jax.vmap(episode, (None, 0))(params, jax.random.split(key, n_episodes))
        local = -0.5 * touches - 0.5 * dist_sum[..., None]  # jaxmarl's default, local_ratio 0.5
        ratio = float(env.local_ratio)  # what this preset trains on (0 for maddpg-mpe-parl)
        per_agent = local.sum(axis=1)  # [episode, agent]
        parl_2022 = -float(n) * dist_sum.sum(axis=1)
        parl_2021 = (float(n) * (-float(n) * dist_sum - touches.sum(-1) - float(n))).sum(axis=1)
        return {"jaxmarl_per_agent": per_agent.mean(), "jaxmarl_sum": per_agent.sum(-1).mean(),
                "parl_2022_pz_sum": parl_2022.mean(), "parl_2021_openai_sum": parl_2021.mean(),
                "mean_landmark_dist_sum": dist_sum.mean(), "collisions_per_step": touches.sum(-1).mean() / 2,
                # D at each of the 25 steps: how fast the agents reach the landmarks
                "landmark_dist_by_step": dist_sum.mean(axis=0),
                # checks: our reconstruction of the reward trained on (local_ratio r:
                # -r c_i - (1 - r) D) is the env's own; episodes are 25 steps
                "reconstruction_error": jnp.abs(-ratio * touches - (1 - ratio) * dist_sum[..., None]
                                                - reward).max(),
                "done_at_25": done[:, -1].all() & ~done[:, :-1].any()}

    return score


def plain(scores: dict) -> dict:
    """A scorer's arrays -> floats (and lists of floats, for the per-step ones)."""
    import numpy as np

    return {k: np.asarray(v).round(4).tolist() if np.ndim(v) else float(v) for k, v in scores.items()}


def score_params(env, learner, params, seed: int = 123) -> dict:
    import jax

    out = make_scorer(env, learner.act, EVAL_EPISODES)(params, jax.random.PRNGKey(seed))
    return plain(out)


def random_policy_scores() -> dict:
    """A uniform random policy (actions in [0, 1]^5), scored the same way."""
    import jax
    import jax.numpy as jnp

    from marl import algos, envs
    from pipelines.config import make_run_config

    config = make_run_config(PRESET)
    env = envs.make(config.env_id, **config.env_kwargs)
    learner = algos.make_learner("maddpg", env.spec, config.algo_config())

    def act(params, carry, obs, avail, reset, key, explore):
        shape = (*obs.shape[:2], env.spec.action_dim)
        return jax.random.uniform(key, shape, minval=env.spec.action_low, maxval=env.spec.action_high), carry, {}

    score = make_scorer(env, act, EVAL_EPISODES)
    params = learner.policy_params(learner.init(jax.random.PRNGKey(0)))
    return plain(score(params, jax.random.PRNGKey(7)))


def hand_controller_scores(gain: float = 20.0, damping: float = 4.0) -> dict:
    """A hand-written controller on the same observations, scored the same way: what a good
    policy reaches. Every agent solves the same landmark assignment (the permutation with
    the least summed agent-landmark distance, from its own relative view of all agents and
    landmarks) and steers to its landmark with force gain * offset - damping * velocity.
    The gains are the best of a 4 x 5 grid (gain 5-40, damping 1-6)."""
    import itertools

    import jax
    import jax.numpy as jnp

    from marl import envs
    from pipelines.config import make_run_config

    config = make_run_config(PRESET)
    env = envs.make(config.env_id, **config.env_kwargs)
    perms = jnp.array(list(itertools.permutations(range(env.spec.n_agents))))
    assert env.spec.obs_dim == 18 and env.spec.n_agents == 3, "written for 3-agent simple spread"

    def act(params, carry, obs, avail, reset, key, explore):
        # obs: own velocity (0:2), own position (2:4), landmarks (4:10) and the other
        # agents (10:14) relative to this agent, communication (14:18)
        velocity = obs[..., 0:2]
        landmarks = obs[..., 4:10].reshape(*obs.shape[:-1], 3, 2)
        others = obs[..., 10:14].reshape(*obs.shape[:-1], 2, 2)
        agents = jnp.concatenate([jnp.zeros_like(others[..., :1, :]), others], axis=-2)  # self first
        dist = jnp.linalg.norm(agents[..., :, None, :] - landmarks[..., None, :, :], axis=-1)  # [.., agent, land]
        cost = dist[..., jnp.arange(3)[None, :], perms].sum(-1)  # [..., permutation]
        mine = perms[jnp.argmin(cost, axis=-1)][..., 0]  # this agent's landmark
        offset = jnp.take_along_axis(landmarks, mine[..., None, None], axis=-2)[..., 0, :]
        u = jnp.clip(gain * offset - damping * velocity, -1.0, 1.0)
        push = lambda x: jnp.clip(x, 0.0, 1.0)  # actions: no-op, -x, +x, -y, +y in [0, 1]
        actions = jnp.stack([jnp.zeros_like(u[..., 0]), push(-u[..., 0]), push(u[..., 0]),
                             push(-u[..., 1]), push(u[..., 1])], axis=-1)
        return actions, carry, {}

    return plain(make_scorer(env, act, EVAL_EPISODES)(None, jax.random.PRNGKey(7)))


# ------------------------------------------------------------- the pipeline run


def pipeline_run(env_steps: int, checkpoint_steps: int, run_dir: str, eval_every: int,
                 max_wall_s: float = 0.0, settings: dict | None = None) -> dict:
    """marl_train to checkpoint_steps, then resumed to env_steps (stopping early after
    max_wall_s of that second leg, if set); both end on a checkpoint that is scored in
    every convention."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from flows import train as train_flow
    from marl import algos, envs
    from pipelines.config import make_run_config
    from storage import Checkpointer

    shutil.rmtree(run_dir, ignore_errors=True)
    rows, started = [], time.perf_counter()

    def record(row):
        rows.append({**row, "wall_s": time.perf_counter() - started})
        if "test_return" in row:
            print(f"[pipeline] {row['env_steps']:>9,} steps {rows[-1]['wall_s']:7.1f} s  "
                  f"test return (per agent) {row['test_return']:.2f}", flush=True)

    config = make_run_config(PRESET, run_dir=run_dir, overrides=settings or {})
    env = envs.make(config.env_id, **config.env_kwargs)
    learner = algos.make_learner("maddpg", env.spec, config.algo_config())
    target = jax.tree.map(np.asarray, learner.init(jax.random.PRNGKey(0)))  # restore's shapes
    points = []
    train_flow.ITERATION_HOOKS.append(record)
    try:
        for leg, steps in enumerate(sorted({checkpoint_steps, env_steps})):
            overrides = {"eval_every": str(eval_every), **(settings or {})}
            if leg and max_wall_s:
                overrides["max_wall_s"] = str(max_wall_s)
            result = train_flow.marl_train(preset=PRESET, env_steps=steps, run_dir=run_dir,
                                           overrides=overrides)
            wall = time.perf_counter() - started
            with Checkpointer(config.checkpoint_dir) as checkpoints:
                state, meta = checkpoints.restore(target=target)
            params = learner.policy_params(jax.tree.map(jnp.asarray, state))
            points.append({"env_steps": result["env_steps"], "wall_s": wall,
                           "updates": int(meta.get("updates", 0)), **score_params(env, learner, params)})
            print(f"[pipeline] scored {points[-1]}", flush=True)
    finally:
        train_flow.ITERATION_HOOKS.remove(record)
    curve = [{k: r[k] for k in ("env_steps", "wall_s", "test_return")} for r in rows if "test_return" in r]
    return {"label": "pipeline (Prefect + Dask + Zarr)", "points": points, "curve": curve,
            "wall_s": time.perf_counter() - started, "env_steps": points[-1]["env_steps"]}


# ------------------------------------------------------- the plain-loop reference


def plain_loop(env_steps: int, eval_every: int, overrides: dict | None = None, seed: int = 0,
               label: str = "plain jitted loop (same MADDPG)") -> dict:
    """The same learner, collector and ring sampling in one process: collect a region,
    mirror it, train updates_per_region, repeat. No Dask, Prefect or Zarr."""
    import jax
    import jax.numpy as jnp

    from marl import algos, buffer, envs, rollout
    from pipelines.config import make_run_config
    from pipelines.stages import replay_fields

    started = time.perf_counter()
    config = make_run_config(PRESET, overrides=overrides or {})
    algo = config.algo_config()
    env = envs.make(config.env_id, **config.env_kwargs)
    learner = algos.make_learner("maddpg", env.spec, algo)
    n, t = config.envs_per_collector, config.steps_per_region
    init, collect = rollout.make_collector(env, learner.act, learner.init_carry, n, t)
    evaluate = rollout.make_evaluator(env, learner.act, learner.init_carry, config.eval_episodes, learner.greedy)
    fields = {k: (f.shape, f.dtype) for k, f in replay_fields(env.spec, learner).items()}
    arrays, mirrored = buffer.empty(fields, config.n_slots, t, n), {}
    train_state = learner.init(jax.random.PRNGKey(seed))
    rstate = init(jax.random.PRNGKey(seed + 1))
    curve, steps, region = [], 0, 0
    while steps < env_steps:
        rstate, data, _ = collect(learner.policy_params(train_state), rstate, learner.exploration(jnp.float32(steps)))
        arrays = buffer.insert(arrays, region % config.n_slots, data)
        mirrored[region % config.n_slots] = region
        region += 1
        steps += n * t
        if min(region, config.n_slots) * n * t >= algo.learning_starts:
            train_state, _ = learner.train(train_state, arrays, buffer.ring(mirrored, config.n_slots, 1),
                                           algo.updates_per_region)
        if region % eval_every == 0 or steps >= env_steps:
            ev = evaluate(learner.policy_params(train_state), jax.random.PRNGKey(10_000 + region))
            curve.append({"env_steps": steps, "wall_s": time.perf_counter() - started,
                          "test_return": float(ev["return_mean"])})
            print(f"[{label}] {steps:>9,} steps {curve[-1]['wall_s']:7.1f} s  "
                  f"test return (per agent) {curve[-1]['test_return']:.2f}", flush=True)
    jax.block_until_ready(train_state)
    wall = time.perf_counter() - started
    point = {"env_steps": steps, "wall_s": wall, "updates": int(train_state["updates"]),
             **score_params(env, learner, learner.policy_params(train_state))}
    print(f"[{label}] scored {point}", flush=True)
    return {"label": label, "overrides": overrides or {}, "points": [point], "curve": curve,
            "wall_s": wall, "env_steps": steps}


# ---------------------------------------------------------------------- report


def main():
    global PRESET  # the functions above read the preset chosen here
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-steps", type=int, default=2_500_000)
    parser.add_argument("--checkpoint-steps", type=int, default=625_000,
                        help="also score the run here (PARL 2021's 25k episodes)")
    parser.add_argument("--reference-steps", type=int, default=625_000)
    parser.add_argument("--max-wall-s", type=float, default=0.0,
                        help="stop the pipeline's second leg after this many seconds (0: no limit)")
    parser.add_argument("--eval-every", type=int, default=10, help="iterations between evaluations")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--no-pipeline", action="store_true", help="plain loop only (tuning)")
    parser.add_argument("--set", action="append", default=[], help="algorithm override key=value")
    parser.add_argument("--run-root", default="runs/bench-maddpg-mpe")
    parser.add_argument("--preset", default=PRESET,
                        help="maddpg-mpe (jaxmarl's reward, local_ratio 0.5) or maddpg-mpe-parl "
                             "(PARL 2022's reward, local_ratio 0)")
    args = parser.parse_args()
    PRESET = args.preset
    name = PRESET.replace("-", "_")  # maddpg_mpe, maddpg_mpe_parl

    report.embedded_prefect()

    random_scores = random_policy_scores()
    print(f"[random] {random_scores}", flush=True)
    controller_scores = hand_controller_scores()
    print(f"[hand-written controller] {controller_scores}", flush=True)
    results = []
    overrides = dict(kv.split("=", 1) for kv in args.set)
    if not args.no_pipeline:
        results.append(pipeline_run(args.env_steps, args.checkpoint_steps,
                                    os.path.join(args.run_root, "pipeline"), args.eval_every,
                                    args.max_wall_s, overrides))
    if not args.no_reference:
        results.append(plain_loop(args.reference_steps, args.eval_every, overrides))

    def score_cells(scores: dict) -> list[str]:  # the table's four return columns
        return [f"{scores['jaxmarl_per_agent']:.2f}", f"{scores['jaxmarl_sum']:.1f}",
                f"{scores['parl_2022_pz_sum']:.1f}", f"{scores['parl_2021_openai_sum']:.1f}"]

    rows = [["random policy", "-", "-", "-", *score_cells(random_scores)],
            ["hand-written controller (assignment + steering)", "-", "-", "-", *score_cells(controller_scores)]]
    for r in results:
        for p in r["points"]:
            rows.append([r["label"], f"{p['env_steps']:,} ({p['env_steps'] // EPISODE:,} ep.)",
                         f"{p['wall_s']:.0f}", f"{p['env_steps'] / p['wall_s']:,.0f}", *score_cells(p)])
    rows.append(["PARL 2021 plot (OpenAI MPE)", "625,000 (25k ep.)", "-", "-", "-", "-", "-",
                 "-456.8 / -465.9 / -464.1 (3 runs; start about -850)"])
    rows.append(["PARL 2022 plot (PettingZoo, local_ratio=0)", "625,000 (25k ep.)", "-", "-", "-", "-",
                 "about -100", "-"])
    rows.append(["PARL 2022 plot (PettingZoo, local_ratio=0)", "2,500,000 (100k ep.)", "-", "-", "-", "-",
                 "about -50 (start -200)", "-"])
    plt = report.save(
        name, {"preset": PRESET, "random": random_scores, "hand_controller": controller_scores, "parl": PARL,
               "results": results, "eval_episodes": EVAL_EPISODES, "episode_steps": EPISODE},
        ["run", "env steps", "wall s", "env steps/s", "per-agent return (jaxmarl)",
         "sum over agents (jaxmarl)", "PARL 2022 convention (sum)", "PARL 2021 convention (sum)"],
        ["---", "---:", "---:", "---:", "---:", "---:", "---:", "---:"], rows)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        axes[0].plot([c["env_steps"] for c in r["curve"]], [c["test_return"] for c in r["curve"]], label=r["label"])
        axes[1].plot([c["wall_s"] for c in r["curve"]], [c["test_return"] for c in r["curve"]], label=r["label"])
    for ax, xlabel in zip(axes, ("env steps", "wall time (s), 2-core CPU")):
        ax.axhline(random_scores["jaxmarl_per_agent"], color="gray", ls=":", lw=1, label="random policy")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("greedy test return per agent (jaxmarl reward)")
        ax.legend()
    fig.suptitle("MADDPG on MPE simple spread (continuous), 25-step episodes")
    fig.tight_layout()
    fig.savefig(report.figure_path(name), dpi=120)


if __name__ == "__main__":
    main()
