"""The training loop of a run on a Dask cluster, without Prefect: `pipelines.dataflow`'s
collect -> train -> evaluate dataflow, its metric loggers and renders, and a failed stage's
one-line error. The `marl-train` flow (flows/train.py) runs it under Prefect; a machine that
has no Prefect (the device machine: bench/gpu.sh's `maps` part) runs the same loop directly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from typing import Any, Callable

from flows import checks
from flows import loggers as metric_loggers
from flows.renders import TrainingRenders
from pipelines import cluster as clusters
from pipelines import stages
from pipelines.config import RunConfig, accelerator_hint
from pipelines.dataflow import RunStopped, Watch, run_moving

__all__ = ["ITERATION_HOOKS", "RunStopped", "StageError", "prepare", "quiet_task_errors", "reported",
           "run_training", "stage_errors", "task_stage"]

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
    whose log holds the traceback; and their note of a task cut short as the worker closes
    (a stopped run's, above its one line). Every other worker log line stays. A worker
    plugin, so workers that join later (restarts) get it too."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class QuietTaskErrors(WorkerPlugin):  # defined here: pickled by value, nothing to import
        name = "marl-quiet-task-errors"

        def setup(self, worker):
            import logging

            for name, dropped in (("distributed.worker", lambda m: m.startswith("Compute Failed")),
                                  ("distributed.worker.state_machine",
                                   lambda m: m.startswith("Async instruction for") and m.endswith("CancelledError"))):
                log = logging.getLogger(name)
                if not any(getattr(f, "marl_quiet", False) for f in log.filters):
                    def drop(record, dropped=dropped):
                        return not dropped(str(record.msg))

                    drop.marl_quiet = True
                    log.addFilter(drop)

    client.register_plugin(QuietTaskErrors())


def prepare(client, worker: str, config: dict) -> dict:
    """Opens the run on `worker` (its store, ring and checkpoint); the ring is fitted to the
    memory of the worker that will hold it."""
    memory_limit = clusters.workers(client)[worker].get("memory_limit")
    prepared = client.submit(stages.prepare_run, config, memory_limit, workers=[worker], pure=False)
    return Watch(client, worker, config["run_dir"]).result(prepared)


def run_training(config: RunConfig, *, scheduler_address: str | None = None, security=None,
                 n_workers: int = 2, cluster: str = "auto", logger_names=("csv",),
                 logger: logging.Logger | None = None, prepare_run: Callable = prepare,
                 publish: Callable[[dict, RunConfig], dict] | None = None) -> dict:
    """Trains `config` (checked by the caller) on the cluster `scheduler_address` names, or on a
    local one of `cluster`'s kind; resumes from the latest checkpoint in its run dir.
    `prepare_run(client, worker, config dict)` opens the run (the flow's is a Prefect task);
    `publish(result, config)` returns what the finished run adds to its result (the flow's
    artifacts), before the loggers finish."""
    logger = logger or logging.getLogger("marl.train")
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
            history, dataflow = run_moving(client, config, lambda worker: prepare_run(client, worker, cfg),
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
    try:
        if publish is not None:
            result.update(publish(result, config))
        for writer in writers:  # the run's config and final evaluation, the curve where supported
            writer.finish(result)
    finally:
        for writer in writers:
            writer.close()
    return result
