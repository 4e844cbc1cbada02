"""MAPPO on MPE simple_spread (jaxmarl's MPE_simple_spread_v3): the whole pipeline (Prefect
flow, local Dask cluster, Zarr replay, orbax checkpoints) against a single-process
reference, at the same env-step budget, in one script.

The reference is one jitted train loop written here after JaxMARL's MAPPO for MPE
(baselines/MAPPO/mappo_rnn_mpe.py with config/mappo_homogenous_rnn_mpe.yaml): an actor
and a critic on the world state (all agents' observations), 128 envs x 128 steps per
update, 4 epochs x 4 minibatches over actors, lr 2e-3 annealed to 0, clip 0.2, entropy
0.01, value coefficient 0.5, grad-norm 0.5, gamma 0.99, GAE lambda 0.95. JaxMARL ships
MAPPO for MPE only with GRU networks (Dense 128 -> GRU 128 -> Dense 128); on 2 CPU cores
that costs ~7 s of CPU per update, so by default the reference is feed-forward (the GRU
left out: Dense 128 -> Dense 128), and `--reference-recurrent` runs it with the GRUs.

The metric for both is JaxMARL's: the mean episode return of the episodes that ended in
each update's rollout (per agent: the sum over the episode of the agents' mean reward).

    python bench/mappo_mpe.py [--env-steps 1000000] [--seed 0] [--seeds 1] [--reference-recurrent]

Writes bench/results/mappo_mpe.{json,md,png}.
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

# config/mappo_homogenous_rnn_mpe.yaml
REFERENCE = dict(LR=2e-3, NUM_ENVS=128, NUM_STEPS=128, FC_DIM_SIZE=128, GRU_HIDDEN_DIM=128,
                 UPDATE_EPOCHS=4, NUM_MINIBATCHES=4, GAMMA=0.99, GAE_LAMBDA=0.95, CLIP_EPS=0.2,
                 ENT_COEF=0.01, VF_COEF=0.5, MAX_GRAD_NORM=0.5, ANNEAL_LR=True,
                 ENV_NAME="MPE_simple_spread_v3")
LAST = 10  # the final figure is the mean over the last LAST updates (one update is noisy)


# ------------------------------------------------------------------ the reference


def make_reference(cfg: dict, total_env_steps: int, recurrent: bool = False):
    """Returns jitted train(key) -> per-update metrics, one scan over all updates."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import jaxmarl
    import numpy as np
    import optax
    from flax.linen.initializers import constant, orthogonal

    env = jaxmarl.make(cfg["ENV_NAME"])
    agents = env.agents
    n_agents, n_envs, n_steps = len(agents), cfg["NUM_ENVS"], cfg["NUM_STEPS"]
    n_actors = n_agents * n_envs  # agent-major: actor i * n_envs + e
    n_actions = env.action_space(agents[0]).n
    obs_dim = env.observation_space(agents[0]).shape[0]
    n_updates = total_env_steps // (n_envs * n_steps)
    hidden = cfg["GRU_HIDDEN_DIM"]
    per_update = cfg["UPDATE_EPOCHS"] * cfg["NUM_MINIBATCHES"]

    class Net(nn.Module):
        """Dense -> relu -> (GRU) -> Dense -> relu -> head; memory zeroed where `reset`."""
        n_out: int
        head_scale: float

        @nn.compact
        def __call__(self, h, x, reset):
            e = nn.relu(nn.Dense(cfg["FC_DIM_SIZE"], kernel_init=orthogonal(np.sqrt(2)),
                                 bias_init=constant(0.0))(x))
            y = e
            if recurrent:
                h = jnp.where(reset[:, None], 0.0, h)
                h, y = nn.GRUCell(hidden)(h, e)
            y = nn.relu(nn.Dense(hidden, kernel_init=orthogonal(2), bias_init=constant(0.0))(y))
            return h, nn.Dense(self.n_out, kernel_init=orthogonal(self.head_scale),
                               bias_init=constant(0.0))(y)

    actor, critic = Net(n_actions, 0.01), Net(1, 1.0)

    def schedule(count):
        frac = 1.0 - (count // per_update) / n_updates
        return cfg["LR"] * frac if cfg["ANNEAL_LR"] else cfg["LR"]

    tx = optax.chain(optax.clip_by_global_norm(cfg["MAX_GRAD_NORM"]), optax.adam(schedule, eps=1e-5))

    def stack(d):  # {agent: [E, ...]} -> [A * E, ...]
        return jnp.concatenate([d[a] for a in agents], axis=0)

    def world_state(obs_stacked):  # every actor sees all agents' observations of its env
        per_env = obs_stacked.reshape(n_agents, n_envs, obs_dim).swapaxes(0, 1).reshape(n_envs, -1)
        return jnp.tile(per_env, (n_agents, 1))

    def unroll(net, params, h0, x, reset):  # x [T, B, ...], reset [T, B]
        if not recurrent:
            return net.apply(params, h0, x, reset)[1]

        def step(h, inp):
            return net.apply(params, h, *inp)
        _, out = jax.lax.scan(step, h0, (x, reset))
        return out

    def train(key):
        k_a, k_c, k_env, key = jax.random.split(key, 4)
        h0 = jnp.zeros((n_actors, hidden))
        params = (actor.init(k_a, h0, jnp.zeros((n_actors, obs_dim)), jnp.zeros(n_actors, bool)),
                  critic.init(k_c, h0, jnp.zeros((n_actors, n_agents * obs_dim)), jnp.zeros(n_actors, bool)))
        opt = (tx.init(params[0]), tx.init(params[1]))
        obs, env_state = jax.vmap(env.reset)(jax.random.split(k_env, n_envs))
        runner = (params, opt, env_state, stack(obs), jnp.zeros(n_actors, bool), (h0, h0),
                  jnp.zeros(n_envs), key)

        def update(runner, _):
            params, opt, env_state, obs, last_done, hs, ep_ret, key = runner
            start_hs = hs

            def env_step(carry, _):
                env_state, obs, last_done, (ha, hc), ep_ret, key = carry
                key, k_act, k_step = jax.random.split(key, 3)
                ws = world_state(obs)
                ha, logits = actor.apply(params[0], ha, obs, last_done)
                hc, value = critic.apply(params[1], hc, ws, last_done)
                action = jax.random.categorical(k_act, logits)
                logp = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], -1)[:, 0]
                env_act = {a: action[i * n_envs:(i + 1) * n_envs] for i, a in enumerate(agents)}
                next_obs, env_state, reward, done, _ = jax.vmap(env.step)(
                    jax.random.split(k_step, n_envs), env_state, env_act)
                reward = stack(reward)
                all_done = done["__all__"]
                ep_ret = ep_ret + reward.reshape(n_agents, n_envs).mean(0)
                record = dict(obs=obs, ws=ws, last_done=last_done, action=action, logp=logp,
                              value=value[:, 0], reward=reward, done=jnp.tile(all_done, n_agents),
                              ended=all_done, ended_return=ep_ret)
                ep_ret = jnp.where(all_done, 0.0, ep_ret)
                return (env_state, stack(next_obs), jnp.tile(all_done, n_agents), (ha, hc), ep_ret, key), record

            (env_state, obs, last_done, hs, ep_ret, key), traj = jax.lax.scan(
                env_step, (env_state, obs, last_done, hs, ep_ret, key), None, n_steps)
            _, last_value = critic.apply(params[1], hs[1], world_state(obs), last_done)

            def gae_step(carry, t):
                adv, next_value = carry
                delta = t["reward"] + cfg["GAMMA"] * next_value * (1 - t["done"]) - t["value"]
                adv = delta + cfg["GAMMA"] * cfg["GAE_LAMBDA"] * (1 - t["done"]) * adv
                return (adv, t["value"]), adv

            _, advantages = jax.lax.scan(gae_step, (jnp.zeros(n_actors), last_value[:, 0]), traj, reverse=True)
            targets = advantages + traj["value"]

            def actor_loss(p, h0, t, adv):
                logits = unroll(actor, p, h0, t["obs"], t["last_done"])
                logp_all = jax.nn.log_softmax(logits)
                logp = jnp.take_along_axis(logp_all, t["action"][..., None], -1)[..., 0]
                ratio = jnp.exp(logp - t["logp"])
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                clipped = jnp.clip(ratio, 1 - cfg["CLIP_EPS"], 1 + cfg["CLIP_EPS"])
                entropy = -(jnp.exp(logp_all) * logp_all).sum(-1).mean()
                return -jnp.minimum(ratio * adv, clipped * adv).mean() - cfg["ENT_COEF"] * entropy

            def critic_loss(p, h0, t, target):
                value = unroll(critic, p, h0, t["ws"], t["last_done"])[..., 0]
                clipped = t["value"] + jnp.clip(value - t["value"], -cfg["CLIP_EPS"], cfg["CLIP_EPS"])
                loss = 0.5 * jnp.maximum((value - target) ** 2, (clipped - target) ** 2).mean()
                return cfg["VF_COEF"] * loss

            def epoch(state, _):
                params, opt, key = state
                key, k_perm = jax.random.split(key)
                order = jax.random.permutation(k_perm, n_actors)
                size = n_actors // cfg["NUM_MINIBATCHES"]
                split_t = lambda x: x[:, order].reshape(x.shape[0], cfg["NUM_MINIBATCHES"], size, *x.shape[2:]).swapaxes(0, 1)
                split_h = lambda x: x[order].reshape(cfg["NUM_MINIBATCHES"], size, *x.shape[1:])
                batches = (jax.tree.map(split_t, traj), split_t(advantages), split_t(targets),
                           split_h(start_hs[0]), split_h(start_hs[1]))

                def minibatch(carry, mb):
                    params, opt = carry
                    t, adv, target, ha0, hc0 = mb
                    ga = jax.grad(actor_loss)(params[0], ha0, t, adv)
                    gc = jax.grad(critic_loss)(params[1], hc0, t, target)
                    ua, oa = tx.update(ga, opt[0], params[0])
                    uc, oc = tx.update(gc, opt[1], params[1])
                    return ((optax.apply_updates(params[0], ua), optax.apply_updates(params[1], uc)),
                            (oa, oc)), None

                (params, opt), _ = jax.lax.scan(minibatch, (params, opt), batches)
                return (params, opt, key), None

            (params, opt, key), _ = jax.lax.scan(epoch, (params, opt, key), None, cfg["UPDATE_EPOCHS"])
            ended = traj["ended"]
            n_ended = ended.sum()
            metric = {"return": jnp.where(n_ended > 0, (traj["ended_return"] * ended).sum() / jnp.maximum(n_ended, 1), jnp.nan),
                      "episodes": n_ended}
            return (params, opt, env_state, obs, last_done, hs, ep_ret, key), metric

        _, metrics = jax.lax.scan(update, runner, None, n_updates)
        return metrics

    return jax.jit(train), n_updates


def run_reference(env_steps: int, seed: int, recurrent: bool = False, n_seeds: int = 1) -> dict:
    """Seeds seed .. seed+n_seeds-1 side by side with vmap, as JaxMARL's NUM_SEEDS."""
    import jax
    import numpy as np

    train, n_updates = make_reference(REFERENCE, env_steps, recurrent)
    train_seeds = jax.jit(jax.vmap(train))
    keys = jax.vmap(jax.random.PRNGKey)(np.arange(seed, seed + n_seeds))
    started = time.perf_counter()
    compiled = train_seeds.lower(keys).compile()
    compile_s = time.perf_counter() - started
    metrics = jax.block_until_ready(compiled(keys))
    wall = time.perf_counter() - started
    per_seed = np.asarray(metrics["return"])  # [seeds, updates]
    returns = per_seed.mean(0)
    per_update = REFERENCE["NUM_ENVS"] * REFERENCE["NUM_STEPS"]
    curve = [{"env_steps": (i + 1) * per_update, "return": float(r)} for i, r in enumerate(returns)]
    print(f"[reference] {n_seeds} seed(s) x {n_updates} updates, {wall:.1f} s (compile {compile_s:.1f} s), "
          f"final return {np.nanmean(returns[-LAST:]):.3f}", flush=True)
    kind = "GRU" if recurrent else "feed-forward"
    return summary(f"reference: JaxMARL MAPPO-MPE config, {kind}, single process", curve, wall,
                   n_updates * per_update, compile_s=compile_s,
                   final_return_per_seed=[float(np.nanmean(r[-LAST:])) for r in per_seed])


# ------------------------------------------------------------------- the pipeline


def run_pipeline(env_steps: int, seed: int, run_dir: str, preset: str = "mappo-mpe",
                 n_seeds: int = 1) -> dict:
    from flows import train as train_flow
    from pipelines.config import make_run_config

    shutil.rmtree(run_dir, ignore_errors=True)
    n_iterations = make_run_config(preset, total_env_steps=env_steps).n_iterations
    rows, started = [], time.perf_counter()

    def record(row):
        rows.append({**row, "wall_s": time.perf_counter() - started})
        if row["iteration"] % 10 == 0:
            # (print inside the flow goes to Prefect's logger)
            sys.stdout.write(f"[pipeline] {row['env_steps']:>9,} steps {rows[-1]['wall_s']:7.1f} s  "
                             f"return {row['return']:.3f}\n")
            sys.stdout.flush()

    train_flow.ITERATION_HOOKS.append(record)
    try:
        result = train_flow.marl_train(preset=preset, env_steps=env_steps, run_dir=run_dir, seed=seed,
                                       seeds=n_seeds, overrides={"anneal_lr_iterations": str(n_iterations)})
    finally:
        train_flow.ITERATION_HOOKS.remove(record)
    wall = time.perf_counter() - started
    curve = [{"env_steps": r["env_steps"], "return": r["return"], "wall_s": r["wall_s"]} for r in rows]
    out = summary(f"ours: {preset} through the pipeline", curve, wall, result["env_steps"])
    out["final_test_return_greedy"] = result["final_eval"].get("return_mean")
    out["final_eval"] = result["final_eval"]  # with n_seeds > 1: *_std and *_per_seed too
    return out


def summary(label: str, curve: list[dict], wall: float, env_steps: int, **extra) -> dict:
    import numpy as np

    last = [c["return"] for c in curve[-LAST:]]
    return {"label": label, "env_steps": env_steps, "wall_s": wall,
            "final_return": float(np.nanmean(last)), "last_update_return": curve[-1]["return"],
            "env_steps_per_s": env_steps / wall, "curve": curve, **extra}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-steps", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1,
                        help="independent seeds trained side by side (vmap) in both runs; curves are their mean")
    parser.add_argument("--run-root", default="runs/bench-mappo-mpe")
    parser.add_argument("--reference-recurrent", action="store_true",
                        help="GRU actor and critic, as JaxMARL's mappo_rnn_mpe (slow on CPU)")
    parser.add_argument("--preset", default="mappo-mpe")
    args = parser.parse_args()

    report.embedded_prefect()

    ref = run_reference(args.env_steps, args.seed, args.reference_recurrent, args.seeds)
    # the same env steps for both: whole reference updates of 128 x 128
    ours = run_pipeline(ref["env_steps"], args.seed, os.path.join(args.run_root, "ours"), args.preset,
                        args.seeds)
    results = [ours, ref]
    ratio = ours["wall_s"] / ref["wall_s"]
    rows = [[r["label"], f"{r['env_steps']:,}", f"{r['wall_s']:.0f}", f"{r['env_steps_per_s']:,.0f}",
             f"{r['final_return']:.2f}", f"{r['last_update_return']:.2f}"] for r in results]
    plt = report.save(
        "mappo_mpe", {"reference_config": REFERENCE, "last_updates_averaged": LAST,
                      "seeds": args.seeds,
                      "wall_time_ratio_pipeline_over_reference": ratio,
                      "pipeline_at_least_reference": ours["final_return"] >= ref["final_return"],
                      "results": results},
        ["run", "env steps", "wall s", "env steps/s", f"mean return, last {LAST} updates",
         "return, last update"],
        ["---", "---:", "---:", "---:", "---:", "---:"], rows)
    print(f"wall-time ratio pipeline / reference: {ratio:.2f}")

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot([c["env_steps"] for c in r["curve"]], [c["return"] for c in r["curve"]], label=r["label"])
    ax.set_xlabel("env steps")
    ax.set_ylabel("mean episode return (training episodes)")
    ax.set_title("MAPPO on MPE simple_spread: pipeline vs single-process reference")
    ax.legend()
    fig.tight_layout()
    fig.savefig(report.figure_path("mappo_mpe"), dpi=120)


if __name__ == "__main__":
    main()
