"""The `marl-train` flow: the collect -> train -> evaluate dataflow of `pipelines.dataflow`
on a Dask cluster, orchestrated by Prefect.

Prefect runs the flow (logs, retries of the flow, the per-iteration metrics and artifacts);
the stages themselves are Dask tasks, many per second, which the Dask dashboard's task
stream shows overlapping: a Prefect task run per region would cost more than the region.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pipelines import cluster as clusters
from pipelines import stages
from pipelines.config import RunConfig, make_run_config
from pipelines.dataflow import Dataflow, Placement, Watch

# callables (iteration row) -> None; the CLI registers one to draw progress
ITERATION_HOOKS: list[Callable[[dict], Any]] = []


@task(name="prepare-run", cache_policy=NO_CACHE)
def prepare_task(client, worker: str, config: dict) -> dict:
    # the ring is fitted to the memory of the worker that will hold it
    memory_limit = client.scheduler_info()["workers"][worker].get("memory_limit")
    prepared = client.submit(stages.prepare_run, config, memory_limit, workers=[worker], pure=False)
    return Watch(client, worker, config["run_dir"]).result(prepared)


@flow(name="marl-train", log_prints=True)
def marl_train(preset: str = "qmix-smac", env: str | None = None, env_steps: int | None = None,
               collectors: int | None = None, seed: int | None = None, seeds: int | None = None,
               run_dir: str | None = None, overrides: dict[str, str] | None = None,
               scheduler_address: str | None = None, n_workers: int = 2) -> dict:
    """Train `preset` (e.g. qmix-smac); resumes from the latest checkpoint in `run_dir`."""
    logger = get_run_logger()
    overrides = {**(overrides or {}), **({"n_seeds": seeds} if seeds else {})}
    config = make_run_config(preset, env_id=env, total_env_steps=env_steps, n_collectors=collectors,
                             seed=seed, run_dir=run_dir, overrides=overrides)
    cfg = config.to_dict()
    with clusters.connect(scheduler_address, n_workers=n_workers) as client:
        where = Placement.on(client, config)
        dashboard = client.dashboard_link
        logger.info("Dask dashboard: %s", dashboard)
        start = prepare_task(client, where.learner, cfg)
        config = RunConfig(**start["config"])  # its ring as fitted to the learner's memory
        if start["replay_note"]:
            logger.warning(start["replay_note"])
        if start["iteration"]:
            logger.info("resuming %s at iteration %d (%d env steps) from its checkpoint",
                        config.run_dir, start["iteration"], start["env_steps"])
        began = time.perf_counter()

        def on_row(row):
            logger.info(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in row.items()))
            for hook in ITERATION_HOOKS:
                hook({**row, "n_iterations": config.n_iterations})

        dataflow = Dataflow(client, config, start, where)
        history = dataflow.run(on_row)
        summary = dataflow.summary()
        if dataflow.stopped_early:
            logger.info("stopped after %.0f s (max_wall_s)", config.max_wall_s)
        # long-lived workers (a stack's) would otherwise keep every finished run in memory
        client.run(stages.forget_run, config.run_dir)
    env_steps_done = history[-1]["env_steps"] if history else start["env_steps"]
    result = {"run_dir": config.run_dir, "store": config.store_path,
              "checkpoint_dir": config.checkpoint_dir, "iterations": len(history),
              "resumed_from": start["iteration"], "env_steps": env_steps_done, "history": history,
              "final_eval": dataflow.final_eval, "wall_s": time.perf_counter() - began,
              "dataflow": summary, "dashboard": dashboard}
    from flows.artifacts import publish_run_artifacts  # matplotlib only once a run ends

    result["learning_curve"] = publish_run_artifacts(result, config)["learning_curve"]
    return result

