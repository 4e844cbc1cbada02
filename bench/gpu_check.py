"""Parts of the device check (bench/gpu.sh) that no other benchmark covers, without Prefect
(the GPU machine has none): learner updates/s per preset, and the whole loop through the
stages on a Dask cluster (pipelines.dataflow, K = 0) against the plain fused loop of the
same learner in one process (bench/dataflow.py's plain_loop), same env-step budget.

    python bench/gpu_check.py learners --out DIR [--presets qmix-smac mappo-mpe maddpg-mpe] [--seconds 5]
    python bench/gpu_check.py loop --out DIR --algo mappo [--env-steps 1000000] [--lags 0 1] [--overrides k=v ...]

Each row is appended to DIR/rows.jsonl and DIR/tables.md as soon as it is measured, so a
run cut short by its time limit keeps what finished.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from profile_summary import ThreadSampler  # noqa: E402  (bench/profile_summary.py)


def emit(out: str, part: str, row: dict, columns: list[str]):
    """Appends one row to OUT/rows.jsonl (tagged with its part) and to a table of the part in
    OUT/tables.md (headed on the part's first row in this process)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "rows.jsonl"), "a") as f:
        f.write(json.dumps({"part": part, **row}) + "\n")
    with open(os.path.join(out, "tables.md"), "a") as f:
        if part not in _HEADED:
            _HEADED.add(part)
            f.write(f"\n### {part}\n\n| " + " | ".join(columns) + " |\n|"
                    + "|".join("---" for _ in columns) + "|\n")
        f.write("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |\n")
    print(json.dumps(row), flush=True)


_HEADED: set = set()


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.4g}"
    return str(v)


def learners(out: str, presets: list[str], seconds: float):
    """learner.train as stages.train calls it, on a ring of real regions: off-policy, the
    preset's updates_per_region per call on a ring with 8 filled slots; on-policy, one PPO
    update per region of N x T."""
    import jax
    import jax.numpy as jnp

    from marl import buffer, rollout
    from pipelines.config import make_run_config
    from pipelines.stages import RunParts, replay_fields

    for preset in presets:
        config = make_run_config(preset)
        parts = RunParts.build(config)
        learner, N, T = parts.learner, config.envs_per_region, config.steps_per_region
        init, collect = rollout.make_collector(parts.env, learner.act, learner.init_carry, N, T)
        state = learner.init(jax.random.PRNGKey(0))
        _, data, _ = collect(learner.policy_params(state), init(jax.random.PRNGKey(1)),
                             learner.exploration(jnp.float32(0)))
        fields = {n: (f.shape, f.dtype) for n, f in replay_fields(parts.env.spec, learner).items()}
        n_slots = config.n_collectors if learner.on_policy else config.n_slots
        arrays = buffer.empty(fields, n_slots, T, N)
        for slot in range(min(n_slots, 8)):
            arrays = buffer.insert(arrays, slot, data)
        ring = buffer.ring({slot: slot for slot in range(min(n_slots, 8))}, n_slots, 1)
        per_call = n_slots if learner.on_policy else learner.config.updates_per_region
        started = time.perf_counter()
        state, _ = learner.train(state, arrays, ring, per_call)
        jax.block_until_ready(state)
        compile_s = time.perf_counter() - started
        calls, started = 0, time.perf_counter()
        while calls < 3 or time.perf_counter() - started < seconds:
            state, metrics = learner.train(state, arrays, ring, per_call)
            jax.block_until_ready(state)
            calls += 1
        wall = time.perf_counter() - started
        updates_per_s = calls * per_call / wall
        # env steps the preset's schedule feeds per update: a region per PPO update on-policy,
        # a region per updates_per_region off-policy
        steps_per_update = N * T * config.n_seeds / (1 if learner.on_policy else per_call)
        emit(out, "learners", {"preset": preset, "device": str(jax.devices()[0]), "updates_per_call": per_call,
                               "compile_s": compile_s, "updates_per_s": updates_per_s,
                               "env_steps_consumed_per_s": updates_per_s * steps_per_update},
             ["preset", "device", "updates_per_call", "compile_s", "updates_per_s", "env_steps_consumed_per_s"])


def loop(out: str, algo: str, env_steps: int, overrides: dict, n_workers: int, lags: list[int]):
    """The plain fused loop, then the stages on a Dask cluster (dask-cuda where a GPU is
    visible, worker threads of this process where a TPU is) at each max_policy_lag in `lags`,
    same preset, seed and budget; steady-state env steps/s of each. With GPU_CHECK_PROFILE set,
    each stages run's threads are sampled to OUT/profile-loop-ALGO-KLAG.txt (profile_summary)."""
    from distributed import Client

    import dataflow as bench_dataflow  # bench/dataflow.py
    from pipelines import stages
    from pipelines.cluster import make_cluster
    from pipelines.config import make_run_config
    from pipelines.dataflow import Dataflow, Placement

    preset = bench_dataflow.PRESETS[algo]
    columns = ["algo", "setting", "env_steps", "env_steps_per_s", "updates_per_s", "x_plain",
               "test_return", "test_win_rate", "wall_s", "breakdown_s"]
    started = time.perf_counter()
    plain = bench_dataflow.steady(bench_dataflow.plain_loop(preset, env_steps, 0, overrides)["rows"])
    sized = " " + " ".join(f"{k}={v}" for k, v in overrides.items()) if overrides else ""
    emit(out, "loop", {"algo": algo, "setting": "plain" + sized, **plain, "x_plain": 1.0,
                       "total_wall_s": time.perf_counter() - started}, columns)

    for lag in lags:
        run_dir = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"gpu-check-{algo}")
        shutil.rmtree(run_dir, ignore_errors=True)
        config = make_run_config(preset, run_dir=run_dir, total_env_steps=env_steps, seed=0,
                                 overrides={**overrides, "max_policy_lag": lag})
        started = time.perf_counter()
        profile = (ThreadSampler(os.path.join(out, f"profile-loop-{algo}-K{lag}.txt"))
                   if os.environ.get("GPU_CHECK_PROFILE") else contextlib.nullcontext())
        with profile, make_cluster(n_workers=n_workers, kind="auto", dashboard_address="127.0.0.1:0") as cluster, \
                Client(cluster) as client:
            start = client.submit(stages.prepare_run, config.to_dict(), pure=False).result()
            flow = Dataflow(client, config, start, Placement.on(client, config))
            rows, began = [], time.perf_counter()
            flow.run(lambda row: rows.append({**row, "wall_s": time.perf_counter() - began}))
            summary = flow.summary()
        piped = bench_dataflow.steady(rows)
        emit(out, "loop", {"algo": algo, "setting": f"stages K={lag} ({len(flow.where.collectors)} collector){sized}",
                           **piped, "x_plain": piped["env_steps_per_s"] / max(plain["env_steps_per_s"], 1e-9),
                           "breakdown_s": {k: round(v, 2) for k, v in summary["breakdown_s"].items()},
                           "total_wall_s": time.perf_counter() - started}, columns)
        shutil.rmtree(run_dir, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    p = sub.add_parser("learners")
    p.add_argument("--out", required=True)
    p.add_argument("--presets", nargs="+", default=["qmix-smac", "mappo-mpe", "maddpg-mpe"])
    p.add_argument("--seconds", type=float, default=5.0)
    p = sub.add_parser("loop")
    p.add_argument("--out", required=True)
    p.add_argument("--algo", required=True, choices=["qmix", "mappo", "maddpg"])
    p.add_argument("--env-steps", type=int, default=None, help="default: bench/dataflow.py's budget")
    p.add_argument("--overrides", nargs="*", default=[], help="config key=value, e.g. eval_every=1000")
    p.add_argument("--workers", type=int, default=2, help="Dask workers where no GPU is visible")
    p.add_argument("--lags", type=int, nargs="+", default=[0], help="max_policy_lag of each stages run")
    args = parser.parse_args()
    if args.part == "learners":
        learners(args.out, args.presets, args.seconds)
    else:
        import dataflow as bench_dataflow

        overrides = dict(kv.split("=", 1) for kv in args.overrides)
        loop(args.out, args.algo, args.env_steps or bench_dataflow.BUDGET[args.algo], overrides, args.workers, args.lags)


if __name__ == "__main__":
    main()
