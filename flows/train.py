"""The `marl-train` flow: the collect -> train -> evaluate dataflow of `pipelines.dataflow`
on a Dask cluster, orchestrated by Prefect.

Prefect runs the flow (logs, retries of the flow, the per-iteration metrics and artifacts);
the stages themselves are Dask tasks, many per second, which the Dask dashboard's task
stream shows overlapping: a Prefect task run per region would cost more than the region.
The loop itself is flows/training.py's, which runs without Prefect too.
"""

from __future__ import annotations

import os

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows import checks
from flows import loggers as metric_loggers
# the loop's hooks and errors, as the CLI and benchmarks know them
from flows.training import ITERATION_HOOKS, RunStopped, StageError, prepare, reported, run_training, task_stage  # noqa: F401
from pipelines import cluster as clusters
from pipelines.config import make_run_config

prepare_task = task(name="prepare-run", cache_policy=NO_CACHE)(prepare)


def publish_artifacts(result: dict, config) -> dict:
    from flows.artifacts import publish_run_artifacts  # matplotlib only once a run ends

    return {"learning_curve": publish_run_artifacts(result, config)["learning_curve"]}


# no log_prints: nothing here prints, and the iteration hooks are the caller's code, whose
# prints (a benchmark's progress lines) belong on its stdout, not in a Prefect log
@flow(name="marl-train")
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
    return run_training(config, scheduler_address=scheduler_address, security=security,
                        n_workers=n_workers, cluster=cluster,
                        logger_names=metric_loggers.parse_loggers(loggers), logger=get_run_logger(),
                        prepare_run=prepare_task, publish=publish_artifacts)
