"""The reanalyse stage: re-score the stored transitions of a replay store with a checkpoint.

Plain functions of JSON-able arguments, like pipelines.stages: a test calls them directly,
the `marl-reanalyze` flow maps `score_region` over the store's regions on Dask workers.

    job = plan(run_dir="runs/qmix-smac")            # paths, checkpoint step (latest)
    job = prepare(job)                              # makes the output group
    [score_region(job, r) for r in job["regions"]]  # one block per region, any order
    ds = storage.open_derived(job["out"])

The learner is rebuilt from the store's attributes (its RunConfig and env spec), its
state restored from the checkpoint, and `learner.score` runs on each region as one batch
of windows: the region's envs are the batch and its T steps the window (a recurrent
learner's memory starts at zero at the region's first step).
"""

from __future__ import annotations

import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from marl import algos, envs, seeds
from pipelines.config import RunConfig
from storage import Checkpointer, Field, ReplayDamaged, ReplayStore, StoreError
from storage.derived import DerivedGroup

_CACHE: dict = {}  # (store, checkpoint dir, step) -> (learner, train state), per worker
_LOCK = threading.Lock()


def plan(run_dir: str | None = None, store: str | None = None, checkpoint_dir: str | None = None,
         checkpoint: int | None = None, out: str | None = None) -> dict:
    """Resolves the paths and the checkpoint step; checks them before anything is written."""
    if run_dir is None and (store is None or checkpoint_dir is None):
        raise StoreError("give a run dir, or both a store path and a checkpoint dir")
    store = os.path.abspath(store or os.path.join(run_dir, "replay"))
    checkpoint_dir = os.path.abspath(checkpoint_dir or os.path.join(run_dir, "checkpoints"))
    ReplayStore.open(store)  # a clear error for a path that is not a store
    if not os.path.isdir(checkpoint_dir):
        raise StoreError(f"no checkpoint directory at {checkpoint_dir}; train first or pass "
                         f"--checkpoints DIR")
    with Checkpointer(checkpoint_dir) as checkpoints:
        checkpoint = checkpoints.step_to_restore(None if checkpoint is None else int(checkpoint))
    base = run_dir or os.path.dirname(store)
    out = os.path.abspath(out or os.path.join(base, "reanalysis", f"step-{checkpoint}"))
    return {"store": store, "checkpoint_dir": checkpoint_dir, "checkpoint_step": checkpoint,
            "out": out}


def run_config(attrs: dict) -> RunConfig:
    try:
        return RunConfig(**attrs["config"])
    except (KeyError, TypeError) as e:
        raise StoreError(f"the store's 'config' attribute does not describe a run this code "
                         f"knows ({e}); reanalyse it with the code version that trained it") from None


def _learner_and_state(job: dict):
    """The learner of the run that wrote the store, restored from the job's checkpoint."""
    key = (job["store"], job["checkpoint_dir"], job["checkpoint_step"])
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
        attrs = ReplayStore.open(job["store"]).attrs
        config = run_config(attrs)
        spec = (envs.EnvSpec.from_dict(attrs["env_spec"]) if "env_spec" in attrs
                else envs.spec_of(config.env_id, **config.env_kwargs))
        learner = seeds.vmap_seeds(algos.make_learner(config.algo, spec, config.algo_config()),
                                   getattr(config, "n_seeds", 1))
        if learner.score is None:
            raise StoreError(f"algorithm {config.algo!r} has no score(); reanalysis needs a "
                             f"learner that implements Learner.score")
        target = jax.tree.map(np.asarray, learner.init(jax.random.PRNGKey(config.seed)))
        with Checkpointer(job["checkpoint_dir"]) as checkpoints:
            state, _ = checkpoints.restore(job["checkpoint_step"], target=target)
        _CACHE[key] = learner, jax.tree.map(jnp.asarray, state)
        return _CACHE[key]


def _score(job: dict, region: dict[str, np.ndarray]) -> dict:
    """{name: ([T, N, ...] numpy, dims)} for one region's [T, N, ...] fields."""
    learner, state = _learner_and_state(job)
    windows = {k: jnp.asarray(np.swapaxes(v, 0, 1)) for k, v in region.items()}  # [N, T, ...]
    out = learner.score(state, windows)
    return {k: (np.swapaxes(np.asarray(v), 0, 1), tuple(dims)) for k, (v, dims) in out.items()}


def prepare(job: dict) -> dict:
    """Makes (or reuses) the output group; returns the job with its regions and variables."""
    store = ReplayStore.open(job["store"])
    committed = store.committed()
    if not committed:
        raise StoreError(f"replay store at {store.path} has no committed regions; nothing to reanalyse")
    first = _score(job, store.read_region(committed[0][0]))
    sizes = {d: n for f in store.fields.values() for d, n in zip(f.dims, f.shape)}
    variables = {}
    for name, (arr, dims) in first.items():
        if name in store.fields:
            raise StoreError(f"score output {name!r} has the name of a store field; rename it in "
                             f"the learner's score() so both can be merged")
        shape = arr.shape[2:]
        for dim, n in zip(dims, shape):
            if sizes.get(dim, n) != n:
                raise StoreError(f"score output {name!r} has {dim}={n} but the store has "
                                 f"{dim}={sizes[dim]}; give the learner's dim another name")
        dtype = "float32" if arr.dtype.kind == "f" else arr.dtype.name
        variables[name] = Field(shape, dtype, dims)
    attrs = {"checkpoint_step": job["checkpoint_step"], "checkpoint_dir": job["checkpoint_dir"],
             "env_id": store.attrs.get("env_id"), "algorithm": store.attrs.get("algorithm")}
    group = DerivedGroup.create(job["out"], store, variables, attrs, kind="reanalysis")
    return {**job, "regions": group.regions, "variables": sorted(variables)}


def score_region(job: dict, region_id: int) -> dict:
    """Scores one stored region and writes its block; a region the ring overwrote since
    `prepare` is skipped (written: False)."""
    started = time.perf_counter()
    store = ReplayStore.open(job["store"])
    try:
        region = store.read_region(region_id)
    except ReplayDamaged:
        raise  # never skipped: reanalysis stops with its one line (marl replay verify)
    except StoreError as e:
        return {"region": int(region_id), "written": False, "reason": str(e)}
    out = _score(job, region)
    DerivedGroup.open(job["out"]).write_block(region_id, {k: v for k, (v, _) in out.items()})
    return {"region": int(region_id), "written": True, "score_s": time.perf_counter() - started}


def reanalyze(**plan_kwargs) -> dict:
    """The whole stage in this process (no Dask): plan, prepare, score every region."""
    job = prepare(plan(**plan_kwargs))
    results = [score_region(job, r) for r in job["regions"]]
    return {**job, "written": sum(r["written"] for r in results)}


def clear_caches():
    with _LOCK:
        _CACHE.clear()


def forget_job(job: dict) -> int:
    """Drops this worker's restored learner and state of one reanalysis job."""
    with _LOCK:
        return int(_CACHE.pop((job["store"], job["checkpoint_dir"], job["checkpoint_step"]), None)
                   is not None)
