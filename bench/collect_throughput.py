"""Collect-stage throughput: the pipeline (Dask worker, jitted rollout, Zarr region write
and commit) against the same jitted rollout (marl.rollout.make_collector, what the stage
runs) called in a loop in this process with no Dask and no storage, side by side in one run,
at several env counts. The reference runs before and after the stage and the ratio takes
the mean of the two, so load that comes and goes on the machine hits both sides. A plain
jaxmarl dict-API rollout of the same policy is reported beside it, for scale.

The stage runs twice: "serial" submits each collect after the previous one returned (the
lock-step K = 0 schedule: nothing to overlap with), "streamed" submits them all at once (as
a dataflow with K >= 1 does), so a region is written while the next one rolls out.

    python bench/collect_throughput.py [--envs 256 1024 4096] [--steps 32] [--repeats 8]

Writes bench/results/collect_throughput.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402  (bench/report.py)


def plain_rollout(n_envs: int, n_steps: int, repeats: int, epsilon: float) -> dict:
    """jaxmarl's own dict API, vmapped and scanned, with the QMIX agent acting; no storage."""
    import jax
    import jax.numpy as jnp
    from jaxmarl.environments.smax import HeuristicEnemySMAX, map_name_to_scenario

    from marl import algos, envs

    spec = envs.spec_of("smax:3m")
    learner = algos.make_learner("qmix", spec, algos.config_for("qmix"))
    env = HeuristicEnemySMAX(scenario=map_name_to_scenario("3m"))
    agents = env.agents

    def run(params, key):
        key, reset_key = jax.random.split(key)
        obs, state = jax.vmap(env.reset)(jax.random.split(reset_key, n_envs))

        def step(carry, _):
            obs, state, hidden, done, key = carry
            key, act_key, step_key = jax.random.split(key, 3)
            stacked = jnp.stack([obs[a] for a in agents], axis=1)
            avail = jax.vmap(env.get_avail_actions)(state)
            avail = jnp.stack([avail[a] for a in agents], axis=1).astype(bool)
            actions, hidden, _ = learner.act(params, hidden, stacked, avail, done, act_key,
                                          {"epsilon": jnp.float32(epsilon)})
            obs, state, reward, dones, _ = jax.vmap(env.step)(
                jax.random.split(step_key, n_envs), state, {a: actions[:, i] for i, a in enumerate(agents)})
            record = (stacked, obs["world_state"], avail, actions, reward[agents[0]], dones["__all__"])
            return (obs, state, hidden, dones["__all__"], key), record

        init = (obs, state, learner.init_carry(n_envs), jnp.zeros(n_envs, bool), key)
        _, records = jax.lax.scan(step, init, None, n_steps)
        return records

    run = jax.jit(run)
    params = learner.policy_params(learner.init(jax.random.PRNGKey(0)))
    jax.block_until_ready(run(params, jax.random.PRNGKey(1)))  # compile
    started = time.perf_counter()
    for i in range(repeats):
        jax.block_until_ready(run(params, jax.random.PRNGKey(2 + i)))
    seconds = time.perf_counter() - started
    return {"steps_per_s": n_envs * n_steps * repeats / seconds, "seconds": seconds}


def plain_collector(n_envs: int, n_steps: int, repeats: int) -> dict:
    """The collect stage's own jitted rollout in this process: envs carried from region to
    region, the region waited for (block_until_ready); no Dask, no host copy, no Zarr."""
    import jax
    import jax.numpy as jnp

    from marl import algos, envs, rollout

    env = envs.make("smax:3m")
    learner = algos.make_learner("qmix", env.spec, algos.config_for("qmix"))
    init, collect = rollout.make_collector(env, learner.act, learner.init_carry, n_envs, n_steps)
    params = learner.policy_params(learner.init(jax.random.PRNGKey(0)))
    explore = learner.exploration(jnp.float32(10**6))  # as the stage's calls below
    state, data, _ = collect(params, init(jax.random.PRNGKey(1)), explore)  # compile
    jax.block_until_ready(data)
    started = time.perf_counter()
    for _ in range(repeats):
        state, data, _ = collect(params, state, explore)
        jax.block_until_ready(data)
    seconds = time.perf_counter() - started
    return {"steps_per_s": n_envs * n_steps * repeats / seconds, "seconds": seconds}


def _timings(rolled: dict, written: dict) -> dict:
    return {**{k: v for k, v in rolled.items() if k != "data"}, **written}


def pipeline_collect(client, worker: str, n_envs: int, n_steps: int, repeats: int, streamed: bool) -> dict:
    """The collect stage as the flow runs it: submitted to a Dask worker, params as a future;
    one at a time, or all at once (`streamed`)."""
    from pipelines import stages
    from pipelines.config import make_run_config

    run_dir = tempfile.mkdtemp(prefix=f"collect-bench-{n_envs}-")
    config = make_run_config("qmix-smac", run_dir=run_dir, overrides={
        "envs_per_collector": n_envs, "steps_per_region": n_steps, "buffer_transitions": n_envs * n_steps * (repeats + 1)})
    cfg = config.to_dict()
    client.submit(stages.prepare_run, cfg, workers=[worker], pure=False).result()
    params = client.submit(stages.policy_params, cfg, workers=[worker], pure=False)

    def submit(i):  # rollout and write as the dataflow submits them; the parts' times come back
        rolled = client.submit(stages.rollout, cfg, 0, i, params, 0, 10**6, workers=[worker], pure=False)
        written = client.submit(stages.write, cfg, rolled, workers=[worker], pure=False)
        return client.submit(_timings, rolled, written, workers=[worker], pure=False)

    # warm up: compile and open the store on the worker, as the first iteration of a run does
    submit(0).result()
    started = time.perf_counter()
    if streamed:
        parts = client.gather([submit(i) for i in range(1, repeats + 1)])
    else:
        parts = [submit(i).result() for i in range(1, repeats + 1)]
    seconds = time.perf_counter() - started
    total = lambda key: sum(p[key] for p in parts)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(config.store_path) for f in fs)
    shutil.rmtree(run_dir, ignore_errors=True)
    # rollout and write overlap when streamed: the parts add up to more than the wall time
    return {"steps_per_s": n_envs * n_steps * repeats / seconds, "seconds": seconds,
            "rollout_s": total("rollout_s") + total("host_copy_s") + total("host_wait_s"),
            "write_s": total("write_s"),
            "write_wait_s": total("write_wait_s"), "store_mib": size / 2**20}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--steps", type=int, default=32, help="steps per collect (region length T)")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--epsilon", type=float, default=0.1)
    parser.add_argument("--out", default=None, help="also append each row to OUT/rows.jsonl")
    args = parser.parse_args()

    from distributed import Client

    from pipelines.cluster import make_cluster, workers

    rows = []
    with make_cluster(n_workers=1, kind="auto", dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        worker = sorted(workers(client))[0]
        for n in args.envs:
            # the references run while the worker idles, and the other way round, so the
            # two never share the cores
            jaxmarl = plain_rollout(n, args.steps, args.repeats, args.epsilon)
            before = plain_collector(n, args.steps, args.repeats)
            piped = {mode: pipeline_collect(client, worker, n, args.steps, args.repeats, mode == "streamed")
                     for mode in ("serial", "streamed")}
            after = plain_collector(n, args.steps, args.repeats)
            plain = (before["steps_per_s"] + after["steps_per_s"]) / 2
            for mode, out in piped.items():
                row = {"n_envs": n, "mode": mode, "steps_per_region": args.steps, "repeats": args.repeats,
                       "plain_steps_per_s": plain, "plain_before_after": [before["steps_per_s"], after["steps_per_s"]],
                       "jaxmarl_steps_per_s": jaxmarl["steps_per_s"], "pipeline_steps_per_s": out["steps_per_s"],
                       "ratio": out["steps_per_s"] / plain,
                       **{f"pipeline_{k}": v for k, v in out.items() if k != "steps_per_s"}}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.out:  # each row as soon as it is measured (bench/gpu.sh)
                    with open(os.path.join(args.out, "rows.jsonl"), "a") as f:
                        f.write(json.dumps({"part": "collect_throughput", **row}) + "\n")

    plt = report.save(
        "collect_throughput", {"rows": rows},
        ["envs N", "stage submitted", "jaxmarl dict-API rollout (steps/s)",
         "the stage's rollout in-process, before / after (steps/s)", "collect stage via Dask + Zarr (steps/s)",
         "ratio to the in-process rollout", "rollout + copy s", "write+commit s", "waiting for the previous write s",
         "wall s", "store MiB"],
        ["---:", "---"] + ["---:"] * 9,
        [[str(r["n_envs"]), r["mode"], f"{r['jaxmarl_steps_per_s']:,.0f}",
          " / ".join(f"{v:,.0f}" for v in r["plain_before_after"]), f"{r['pipeline_steps_per_s']:,.0f}",
          f"{r['ratio']:.2f}", f"{r['pipeline_rollout_s']:.2f}", f"{r['pipeline_write_s']:.2f}",
          f"{r['pipeline_write_wait_s']:.2f}", f"{r['pipeline_seconds']:.2f}", f"{r['pipeline_store_mib']:.0f}"]
         for r in rows])
    fig, ax = plt.subplots(figsize=(6, 4))
    ns = sorted({r["n_envs"] for r in rows})
    ax.plot(ns, [next(r for r in rows if r["n_envs"] == n)["plain_steps_per_s"] for n in ns], "o-",
            label="the stage's rollout in one process (mean of before/after)")
    for mode, marker in (("serial", "s-"), ("streamed", "^-")):
        ax.plot(ns, [next(r for r in rows if r["n_envs"] == n and r["mode"] == mode)["pipeline_steps_per_s"]
                     for n in ns], marker, label=f"collect stage (Dask + Zarr), {mode}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("vmapped envs N")
    ax.set_ylabel("env steps / s")
    ax.set_title(f"SMAX 3m collect throughput, T={args.steps}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(report.figure_path("collect_throughput"), dpi=120)


if __name__ == "__main__":
    main()
