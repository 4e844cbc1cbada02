"""The `marl-train` flow: collect -> train -> evaluate, iterated, on a Dask cluster.

Each stage is a Prefect task (retried, logged, visible in the UI) that submits the plain
stage function from `pipelines.stages` to a chosen Dask worker and waits for it. Policy
params travel as a Dask future from the learner worker straight to the collectors, so
each worker receives each parameter version once; the flow process never holds them.
"""

from __future__ import annotations

import operator
import time
from typing import Any, Callable

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pipelines import cluster as clusters
from pipelines import stages
from pipelines.config import make_run_config

# callables (iteration row) -> None; the CLI registers one to draw progress
ITERATION_HOOKS: list[Callable[[dict], Any]] = []


@task(name="collect", retries=2, retry_delay_seconds=0, cache_policy=NO_CACHE)
def collect_task(client, worker: str, config: dict, collector: int, iteration: int,
                 params, param_version: int, env_steps: int) -> dict:
    future = client.submit(stages.collect, config, collector, iteration, params, param_version,
                           env_steps, workers=[worker], allow_other_workers=True, pure=False)
    return future.result()


@task(name="train", retries=2, retry_delay_seconds=0, cache_policy=NO_CACHE)
def train_task(client, worker: str, config: dict, iteration: int, env_steps: int,
               checkpoint: bool):
    """Returns (metrics, a future of the new params left on the learner worker)."""
    future = client.submit(stages.train, config, iteration, env_steps, checkpoint,
                           workers=[worker], pure=False)
    result = client.submit(operator.itemgetter("metrics"), future, workers=[worker], pure=False)
    params = client.submit(operator.itemgetter("params"), future, workers=[worker], pure=False)
    return result.result(), params


@task(name="evaluate", retries=2, retry_delay_seconds=0, cache_policy=NO_CACHE)
def evaluate_task(client, worker: str, config: dict, params, iteration: int) -> dict:
    return client.submit(stages.evaluate, config, params, iteration, workers=[worker],
                         pure=False).result()


@task(name="prepare-run", cache_policy=NO_CACHE)
def prepare_task(client, worker: str, config: dict) -> dict:
    return client.submit(stages.prepare_run, config, workers=[worker], pure=False).result()


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
        where = clusters.placement(client, env_backend=stages.env_backend(cfg))
        dashboard = client.dashboard_link
        logger.info("Dask dashboard: %s", dashboard)
        learner = where["learner"]
        others = [w for w in where["collectors"] if w != learner] or [learner]
        collector_workers = [others[c % len(others)] for c in range(config.n_collectors)]

        start = prepare_task(client, learner, cfg)
        if start["iteration"]:
            logger.info("resuming %s at iteration %d (%d env steps) from its checkpoint",
                        config.run_dir, start["iteration"], start["env_steps"])
        params = client.submit(stages.initial_params, cfg, workers=[learner], pure=False)
        version, env_steps_done = start["param_version"], start["env_steps"]
        history, last_eval = [], {}
        began = time.perf_counter()
        for iteration in range(start["iteration"], config.n_iterations):
            tick = time.perf_counter()
            collected = [collect_task.submit(client, collector_workers[c], cfg, c, iteration, params,
                                             version, env_steps_done)
                         for c in range(config.n_collectors)]
            collected = [c.result() for c in collected]
            env_steps_done += config.steps_per_iteration
            out_of_time = bool(config.max_wall_s) and time.perf_counter() - began >= config.max_wall_s
            last = iteration == config.n_iterations - 1 or out_of_time
            checkpoint = last or (iteration + 1) % config.checkpoint_every == 0
            metrics, params = train_task(client, learner, cfg, iteration, env_steps_done, checkpoint)
            version = iteration + 1
            row = {"iteration": iteration + 1, "env_steps": env_steps_done,
                   "return": _mean(c["return_mean"] for c in collected),
                   "win_rate": _mean(c["win_rate"] for c in collected),
                   "loss": metrics.get("loss", float("nan")),
                   "total_updates": metrics["total_updates"],
                   "steps_per_s": config.steps_per_iteration / (time.perf_counter() - tick)}
            if last or (iteration + 1) % config.eval_every == 0:
                last_eval = evaluate_task(client, collector_workers[0], cfg, params, iteration)
                row.update(test_win_rate=last_eval["win_rate"], test_return=last_eval["return_mean"])
                if config.n_seeds > 1:  # the spread across seeds
                    row.update(test_win_rate_std=last_eval["win_rate_std"],
                               test_return_std=last_eval["return_mean_std"])
            history.append(row)
            logger.info(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in row.items()))
            for hook in ITERATION_HOOKS:
                hook({**row, "n_iterations": config.n_iterations})
            if out_of_time:
                logger.info("stopping after %.0f s (max_wall_s)", config.max_wall_s)
                break
        if not history:  # the run dir's checkpoint is already at the end: just score it
            last_eval = evaluate_task(client, collector_workers[0], cfg, params, start["iteration"])
        params.release()
        # long-lived workers (a stack's) would otherwise keep every finished run in memory
        client.run(stages.forget_run, config.run_dir)
    result = {"run_dir": config.run_dir, "store": config.store_path,
              "checkpoint_dir": config.checkpoint_dir, "iterations": len(history),
              "resumed_from": start["iteration"], "env_steps": env_steps_done, "history": history,
              "final_eval": last_eval, "wall_s": time.perf_counter() - began,
              "dashboard": dashboard}
    from flows.artifacts import publish_run_artifacts  # matplotlib only once a run ends

    result["learning_curve"] = publish_run_artifacts(result, config)["learning_curve"]
    return result


def _mean(values) -> float:
    values = [v for v in values if v == v]  # drop NaN (a region with no finished episode)
    return sum(values) / len(values) if values else float("nan")
