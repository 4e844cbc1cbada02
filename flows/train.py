"""The `marl-train` flow: the collect -> train -> evaluate dataflow of `pipelines.dataflow`
on a Dask cluster, orchestrated by Prefect.

Prefect runs the flow (logs, retries of the flow, the per-iteration metrics and artifacts);
the stages themselves are Dask tasks, many per second, which the Dask dashboard's task
stream shows overlapping: a Prefect task run per region would cost more than the region.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from typing import Any, Callable

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows import checks
from flows import loggers as metric_loggers
from flows.renders import TrainingRenders
from pipelines import cluster as clusters
from pipelines import stages
from pipelines.config import RunConfig, accelerator_hint, make_run_config
from pipelines.dataflow import RunStopped, Watch, run_moving

# callables (iteration row) -> None; the CLI registers one to draw progress
ITERATION_HOOKS: list[Callable[[dict], Any]] = []


class StageError(RuntimeError):
    """A stage failed inside a Dask task: one line naming the stage and the cause, and the
    log file in the run dir that holds the full remote traceback."""


# the functions that run as Dask tasks (module of pipelines/, function) and their stage
STAGES = {("stages", "prepare_run"): "prepare", ("stages", "collect"): "collect",
          ("stages", "rollout"): "collect", ("stages", "write"): "collect", ("stages", "train"): "train",
          ("stages", "policy_params"): "train", ("stages", "save_checkpoint"): "train",
          ("stages", "evaluate"): "evaluate", ("reanalyze", "prepare"): "reanalyze",
          ("reanalyze", "score_region"): "reanalyze"}


def task_stage(error: BaseException) -> str | None:
    """The stage whose Dask task raised `error` (its remote frames travel with it), or None
    for an error raised here in the driver."""
    for frame in traceback.extract_tb(error.__traceback__):
        where, module = os.path.split(os.path.splitext(frame.filename)[0])
        if os.path.basename(where) == "pipelines" and (module, frame.name) in STAGES:
            return STAGES[module, frame.name]
    return None


def reported(error: BaseException) -> bool:
    """Errors whose message is already the one-line answer with its fix: bad input, a failed
    stage, a run that cannot go on."""
    from marl.algos import ConfigError
    from marl.envs import EnvError
    from storage import StoreError

    return isinstance(error, (ConfigError, EnvError, StoreError, checks.InputError, StageError, RunStopped))


@contextlib.contextmanager
def stage_errors(run_dir: str):
    """Turns an error raised inside a stage's task into a StageError: its full traceback goes
    to <run_dir>/logs/error-<time>.log, the user gets one line."""
    try:
        yield
    except Exception as e:
        stage = task_stage(e)
        if stage is None or reported(e):
            raise
        path = os.path.join(os.path.abspath(run_dir), "logs", f"error-{time.strftime('%Y%m%d-%H%M%S')}.log")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "a") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')}: the {stage} stage of {run_dir} failed\n")
                f.write("".join(traceback.format_exception(e)))
            where = f"full traceback in {path}"
        except OSError as log_error:
            where = f"its traceback could not be written to {path} ({log_error.strerror})"
        cause = checks.one_line(e)
        cause = cause if len(cause) <= 300 else cause[:297] + "..."  # the log has all of it
        raise StageError(f"the {stage} stage failed: {type(e).__name__}: {cause}; {where}") from None


def quiet_task_errors(client) -> None:
    """Drops the workers' own "Compute Failed" dump of each failed task (its arguments and
    traceback, a screenful per retry): the error reaches the user once, as a StageError
    whose log holds the traceback. Every other worker log line stays. A worker plugin, so
    workers that join later (restarts) get it too."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class QuietTaskErrors(WorkerPlugin):  # defined here: pickled by value, nothing to import
        name = "marl-quiet-task-errors"

        def setup(self, worker):
            import logging

            log = logging.getLogger("distributed.worker")
            if not any(getattr(f, "marl_quiet", False) for f in log.filters):
                def drop(record):
                    return not str(record.msg).startswith("Compute Failed")

                drop.marl_quiet = True
                log.addFilter(drop)

    client.register_plugin(QuietTaskErrors())


@task(name="prepare-run", cache_policy=NO_CACHE)
def prepare_task(client, worker: str, config: dict) -> dict:
    # the ring is fitted to the memory of the worker that will hold it
    memory_limit = clusters.workers(client)[worker].get("memory_limit")
    prepared = client.submit(stages.prepare_run, config, memory_limit, workers=[worker], pure=False)
    return Watch(client, worker, config["run_dir"]).result(prepared)


@flow(name="marl-train", log_prints=True)
def marl_train(preset: str = "qmix-smac", env: str | None = None, env_steps: int | None = None,
               collectors: int | None = None, seed: int | None = None, seeds: int | None = None,
               run_dir: str | None = None, overrides: dict[str, str] | None = None,
               scheduler_address: str | None = None, n_workers: int = 2,
               loggers: list[str] | str | None = None, tls: bool | str = False,
               cluster: str = "auto") -> dict:
    """Train `preset` (e.g. qmix-smac); resumes from the latest checkpoint in `run_dir`.
    `cluster`: the kind of local cluster (pipelines.cluster.make_cluster: auto, cpu, gpu, or
    threads, its workers threads of this process) when no scheduler is given.
    `loggers`: "csv" (the default), "tensorboard" or both (flows/loggers.py), one row per iteration.
    `tls`: True (certificates in the user's config dir, self-signed ones made there when
    absent) or a directory of ca.pem, cert.pem and key.pem: the cluster talks TLS only.

    Every parameter is checked before a cluster starts or anything is written (ConfigError,
    EnvError or InputError, one line); an error inside a stage's task is a StageError."""
    if overrides is not None and not isinstance(overrides, dict):
        raise checks.InputError(f"overrides={overrides!r} must be a dict of setting -> value, "
                                "e.g. overrides={'lr': '0.001'}")
    overrides = {**(overrides or {}), **({"n_seeds": seeds} if seeds is not None else {})}
    config = make_run_config(preset, env_id=env, total_env_steps=env_steps, n_collectors=collectors,
                             seed=seed, run_dir=run_dir, overrides=overrides)
    checks.check_cluster(cluster, scheduler_address, tls)
    checks.check_run(config, scheduler_address, n_workers)
    security = checks.tls_security(tls, scheduler_address or os.environ.get(clusters.SCHEDULER_ENV))
    logger_names = metric_loggers.parse_loggers(loggers)
    logger = get_run_logger()
    cfg = config.to_dict()
    with clusters.connect(scheduler_address, security=security, n_workers=n_workers, kind=cluster) as client, \
            stage_errors(config.run_dir):
        quiet_task_errors(client)
        local = not (scheduler_address or os.environ.get(clusters.SCHEDULER_ENV))
        if local and cluster != "cpu" and (clusters.gpu_count() or clusters.tpu_count()):
            if hint := accelerator_hint(config):
                logger.warning(hint)
        dashboard = client.dashboard_link
        logger.info("Dask dashboard: %s", dashboard)
        writers: list = []
        starts: list[dict] = []
        placed: list = []  # where the latest dataflow runs (its evaluator draws the GIFs)
        renders = TrainingRenders(client, config, logger)  # --set render_every=N; off by default

        def on_start(start, where):
            nonlocal config
            config = RunConfig(**start["config"])  # its ring as fitted to the learner's memory
            if starts:
                logger.warning("the learner's worker was lost; the learner moved to %s and resumes "
                               "%s from its checkpoint at iteration %d", where.learner, config.run_dir,
                               start["iteration"])
            else:
                if start["replay_note"]:
                    logger.warning(start["replay_note"])
                if start["iteration"]:
                    logger.info("resuming %s at iteration %d (%d env steps) from its checkpoint",
                                config.run_dir, start["iteration"], start["env_steps"])
                if start["forgotten_regions"]:
                    lost = start["forgotten_regions"]
                    logger.info("the replay's regions %d-%d, collected after the checkpoint, are "
                                "collected again", lost[0], lost[-1])
            starts.append(start)
            placed[:] = [where]
            for writer in writers:  # (re)opened at the start: they drop what came after it
                writer.close()
            writers[:] = metric_loggers.open_loggers(logger_names, config.run_dir, start["iteration"],
                                                     cfg, start["env_steps"])

        def on_row(row):
            logger.info(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in row.items()))
            for writer in writers:
                writer.log(row)
            for hook in ITERATION_HOOKS:
                hook({**row, "n_iterations": config.n_iterations})
            renders.on_row(row, placed[-1])

        began = time.perf_counter()
        try:
            history, dataflow = run_moving(client, config, lambda worker: prepare_task(client, worker, cfg),
                                           on_start, on_row)
        except BaseException:
            for writer in writers:
                writer.close()
            raise
        summary = dataflow.summary()
        render = renders.finish(history, placed[-1])
        if dataflow.stopped_early:
            logger.info("stopped after %.0f s (max_wall_s)", config.max_wall_s)
        # long-lived workers (a stack's) would otherwise keep every finished run in memory
        client.run(stages.forget_run, config.run_dir)
    env_steps_done = history[-1]["env_steps"] if history else starts[-1]["env_steps"]
    result = {"run_dir": config.run_dir, "store": config.store_path,
              "checkpoint_dir": config.checkpoint_dir, "iterations": len(history),
              "resumed_from": starts[0]["iteration"], "learner_moves": len(starts) - 1,
              "env_steps": env_steps_done, "history": history,
              "final_eval": dataflow.final_eval, "wall_s": time.perf_counter() - began,
              "dataflow": summary, "dashboard": dashboard, "render": render}
    from flows.artifacts import publish_run_artifacts  # matplotlib only once a run ends

    try:
        result["learning_curve"] = publish_run_artifacts(result, config)["learning_curve"]
        for writer in writers:  # the run's config and final evaluation, the curve where supported
            writer.finish(result)
    finally:
        for writer in writers:
            writer.close()
    return result

