"""The `marl-reanalyze` flow: re-score a replay store with a checkpoint, on a Dask cluster.

prepare (one worker: restore the checkpoint, score one region to learn the output
variables, make the output group) -> score every committed region (one Dask task per
region via `client.map`, each writing its own block, as collectors do) -> a summary
artifact. The output is a Zarr group beside the run, `<run_dir>/reanalysis/step-<k>` by
default, that `storage.open_derived` opens with the store's step coordinates.
"""

from __future__ import annotations

import hashlib
import time

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows.training import quiet_task_errors
from pipelines import cluster as clusters
from pipelines import reanalyze


@task(name="prepare-reanalysis", retries=1, retry_delay_seconds=0, cache_policy=NO_CACHE)
def prepare_task(client, worker: str, job: dict) -> dict:
    return client.submit(reanalyze.prepare, job, workers=[worker], pure=False).result()


@task(name="score-regions", retries=2, retry_delay_seconds=0, cache_policy=NO_CACHE)
def score_task(client, job: dict) -> list[dict]:
    """All regions as plain Dask tasks (high fan-out: no Prefect state per region); a retry
    rewrites the same blocks."""
    futures = client.map(reanalyze.score_region, [job] * len(job["regions"]), job["regions"],
                         pure=False)
    return client.gather(futures)


@flow(name="marl-reanalyze", log_prints=True)
def marl_reanalyze(run_dir: str | None = None, store: str | None = None,
                   checkpoint_dir: str | None = None, checkpoint: int | None = None,
                   out: str | None = None, scheduler_address: str | None = None,
                   n_workers: int = 2) -> dict:
    """Scores every committed region of `run_dir`'s replay store (or `store`) with checkpoint
    step `checkpoint` (default: the latest) and writes the result to `out`."""
    logger = get_run_logger()
    began = time.perf_counter()
    job = reanalyze.plan(run_dir=run_dir, store=store, checkpoint_dir=checkpoint_dir,
                         checkpoint=checkpoint, out=out)  # bad paths fail before a cluster starts
    with clusters.connect(scheduler_address, n_workers=n_workers) as client:
        quiet_task_errors(client)  # a failed region reaches the user once, not as worker dumps
        worker = clusters.placement(client)["learner"]
        job = prepare_task(client, worker, job)
        logger.info("scoring %d regions of %s with checkpoint %d into %s",
                    len(job["regions"]), job["store"], job["checkpoint_step"], job["out"])
        results = score_task(client, job)
        client.run(reanalyze.forget_job, job)  # free the restored state on long-lived workers
    skipped = [r for r in results if not r["written"]]
    for r in skipped:
        logger.warning("region %d skipped: %s", r["region"], r["reason"])
    result = {**job, "written": len(results) - len(skipped),
              "skipped": [r["region"] for r in skipped], "wall_s": time.perf_counter() - began}
    create_markdown_artifact(  # one artifact history per output group
        key=f"reanalysis-{hashlib.sha1(job['out'].encode()).hexdigest()[:12]}",
        markdown=(f"# Reanalysis\n\n| | |\n|---|---|\n| store | `{job['store']}` |\n"
                  f"| checkpoint | step {job['checkpoint_step']} in `{job['checkpoint_dir']}` |\n"
                  f"| output | `{job['out']}` |\n| variables | {', '.join(job['variables'])} |\n"
                  f"| regions written | {result['written']} of {len(results)} |\n"
                  f"| wall time | {result['wall_s']:.1f} s |\n\n"
                  f"```python\nimport storage, xarray as xr\n"
                  f"ds = xr.merge([storage.open_replay({job['store']!r}),\n"
                  f"               storage.open_derived({job['out']!r})], compat='no_conflicts')\n```\n"),
        description=f"reanalysis of {job['store']} with checkpoint {job['checkpoint_step']}")
    return result
