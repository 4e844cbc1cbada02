"""The stages of the dataflow: collect, train, evaluate. Plain functions of JSON-able arguments.

    collect(config, collector, iteration, params, ...)   a region: T steps of N envs with the
                                                         given policy params, written to the
                                                         Zarr store and committed
    train(config, iteration, ..., collected)             the learner picks up exactly the
                                                         regions `collected` names, updates,
                                                         and returns the next policy params
    evaluate(config, params, iteration)                  greedy episodes on fresh envs

A test calls them directly; `pipelines.dataflow` submits the very same functions to Dask
workers and decides when each may run (the policy lag, the replay ratio). Each worker keeps
what is expensive to rebuild between calls in one typed state object per role (a
collector's compiled rollout and its envs mid-episode, the learner's train state and device
mirror of the replay ring, an evaluator's compiled evaluation). The states are only an
optimisation: the replay store and the checkpoints on disk are the truth, so a stage that
lands on a fresh worker (a retry, a restart, a resumed run) rebuilds from them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from marl import algos, buffer, envs, rollout, seeds, teams
from marl.transition import store_fields
from marl.learner import Learner
from pipelines.config import RunConfig
from pipelines.memory import check_fits, fit_replay, replay_memory
from storage import Checkpointer, Field, ReplayDamaged, ReplayStore, StoreError


def as_config(config) -> RunConfig:
    if isinstance(config, RunConfig):
        return config
    return RunConfig(**config)


# ------------------------------------------------------------------------ the store


def replay_fields(spec: envs.EnvSpec, learner=None) -> dict[str, Field]:
    """The replay schema for one env spec: the fields of marl.transition.Transition plus what
    the learner's policy records beside each transition (its `extra_fields`, e.g. a
    behaviour log-probability), as storage Fields."""
    extra = learner.extra_fields if learner else {}
    return {name: Field(shape, dtype, dims)
            for name, (shape, dtype, dims) in store_fields(spec, extra).items()}


def open_store(config: RunConfig, spec: envs.EnvSpec, create: bool = False,
               learner=None, requested_transitions: int | None = None) -> ReplayStore:
    if not create:
        return ReplayStore.open(config.store_path, mode="r+")
    attrs = {"env_id": config.env_id, "env_spec": spec.to_dict(), "algorithm": config.algo,
             "seed": config.seed, "n_seeds": config.n_seeds, "config": config.to_dict(),
             "preset": config.preset,
             # what the run asked for before its ring was fitted to memory: the same request
             # resumes the same ring (prepare_run)
             "requested_buffer_transitions": requested_transitions or config.buffer_transitions}
    os.makedirs(config.run_dir, exist_ok=True)
    return ReplayStore.open_or_create(
        config.store_path, fields=replay_fields(spec, learner), n_envs=config.envs_per_region,
        steps_per_region=config.steps_per_region, n_slots=config.n_slots, attrs=attrs)


def prepare_run(config, memory_limit: int | None = None) -> dict:
    """Checks the env and algorithm, fits the replay ring to the learner's memory, makes (or
    reopens) the store, and says where to resume. Runs on the learner's worker, whose
    `memory_limit` (bytes; default: this machine's memory) bounds the ring.

    Returns {"iteration", "env_steps", "param_version"} of the latest checkpoint (or zeros),
    "config": the run's config with its ring as fitted, "replay_note": a line saying how
    the ring was fitted (None where it fits as asked), "forgotten_regions": the regions
    collected after the checkpoint, forgotten by the store to be collected again.
    Everything is checked before anything is written, so bad input leaves a store as it was.
    """
    config = as_config(config)
    env = envs.make(config.env_id, **config.env_kwargs)
    learner = algos.make_learner(config.algo, env.spec, config.algo_config())
    memory = lambda c: learner_memory(c, env.spec, learner, memory_limit)
    requested, ring = config.buffer_transitions, _stored_ring(config)
    if ring is not None:  # a resumed run keeps the ring it was fitted to
        config = dataclasses.replace(config, buffer_transitions=ring)
        check_fits(config, memory(config))
        note = None
    else:
        config, note = fit_replay(config, memory(config))
    store = open_store(config, env.spec, create=True, learner=learner, requested_transitions=requested)
    checkpoints = Checkpointer(config.checkpoint_dir)
    try:
        start = {"iteration": 0, "env_steps": 0, "param_version": 0}
        if checkpoints.latest_step() is not None:
            meta = checkpoints.metadata()
            start = {k: int(meta[k]) for k in start}
    finally:
        checkpoints.close()
    # regions collected after the checkpoint (a killed run, a lost learner) are collected again
    forgotten = store.rewind(start["iteration"] * config.n_collectors)
    return {**start, "config": config.to_dict(), "replay_note": note, "forgotten_regions": forgotten}


def learner_memory(config: RunConfig, spec: envs.EnvSpec, learner, memory_limit: int | None = None):
    """The learner's replay bytes for `config` against its budget (pipelines.memory); the
    worker's `memory_limit` in bytes, default this machine's memory."""
    limit = memory_limit or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return replay_memory(config, replay_fields(spec, learner), learner.on_policy,
                         getattr(learner.config, "learning_starts", 0), limit)


def _stored_ring(config: RunConfig) -> int | None:
    """The ring (transitions per seed) of this run dir's store where it was made for the
    same request, else None."""
    try:
        attrs = ReplayStore.open(config.store_path).attrs
    except StoreError:
        return None  # no store yet (a broken one gets its error from open_store)
    if attrs.get("requested_buffer_transitions") != config.buffer_transitions:
        return None
    return int(attrs["config"]["buffer_transitions"])


def env_backend(config) -> str:
    """"jax" or "numpy": where the run's collectors may go (numpy envs: CPU workers only)."""
    config = as_config(config)
    return "numpy" if config.env_id.startswith("pz:") else "jax"


# ------------------------------------------------------------- per-worker state


@dataclasses.dataclass
class RunParts:
    """What every role builds from the config: the env, the learner, its seeds wrapper."""

    config: RunConfig
    env: Any
    single_seed: Learner  # one seed's learner (evaluation plays each seed on its own)
    learner: Learner  # all seeds, vmapped

    @classmethod
    def build(cls, config: RunConfig) -> "RunParts":
        env = envs.make(config.env_id, **config.env_kwargs)
        single = algos.make_learner(config.algo, env.spec, config.algo_config())
        return cls(config, env, single, seeds.vmap_seeds(single, config.n_seeds))


# Regions of one collector being written while its next region rolls out: host memory stays
# at most (1 + this) regions per collector, and writes of one collector land in order.
PENDING_WRITES = 1


@dataclasses.dataclass
class CollectorState:
    """One collector's compiled rollout and its envs mid-episode (episodes run on across
    regions); `next_iteration` is the iteration its envs' state is ready for.

    `rollout_lock` is held for a rollout and its host copy only; `retry_from` keeps the envs'
    state before each iteration whose task has not finished, so a retry rolls out the same
    bytes again even after the next iteration's rollout has moved the envs on; `writes` bounds
    the regions being written (PENDING_WRITES)."""

    parts: RunParts
    store: ReplayStore
    init: Any
    collect: Any
    rollout_state: Any = None
    next_iteration: int = -1
    retry_from: dict = dataclasses.field(default_factory=dict)
    rollout_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    writes: threading.BoundedSemaphore = dataclasses.field(
        default_factory=lambda: threading.BoundedSemaphore(PENDING_WRITES))


@dataclasses.dataclass
class LearnerState:
    """The learner's train state and the device mirror of the replay ring it samples from."""

    parts: RunParts
    store: ReplayStore
    checkpoints: Checkpointer
    train_state: Any
    meta: dict  # iteration, env_steps, param_version, updates of `train_state`
    arrays: dict  # the ring mirror, [slot, T, N, ...] per field
    mirrored: dict  # mirror slot -> region id it holds
    n_slots: int

    def ring(self, n_collectors: int) -> buffer.Ring:
        # a collector's next region (the same envs, continued) is n_collectors regions later
        return buffer.ring(self.mirrored, self.n_slots, n_collectors)


@dataclasses.dataclass
class EvaluatorState:
    parts: RunParts
    evaluate: Any
    teams: tuple[str, ...] = ()  # a team run's teams, whose scores the evaluation keeps apart
    primary: int = 0  # the team whose win rate and return are the run's own (the trained one)


_STATES: dict = {}  # (role, abs run dir, *id) -> one of the states above
_LOCK = threading.Lock()


def _state(role: str, config: RunConfig, build, *ident):
    """This worker's state for one role of one run, built on first use and again whenever
    the run's config changes."""
    key = (role, os.path.abspath(config.run_dir), *ident)
    with _LOCK:
        state = _STATES.get(key)
        if state is None or state.parts.config != config:
            state = build(RunParts.build(config))
            _STATES[key] = state
        return state


def _drop_state(role: str, config: RunConfig, *ident):
    with _LOCK:
        _STATES.pop((role, os.path.abspath(config.run_dir), *ident), None)


def clear_caches():
    with _LOCK:
        _STATES.clear()


def forget_run(run_dir: str) -> int:
    """Drops this worker's states of one run (its envs, learner, compiled steps), so
    long-lived workers (`marl stack`) do not keep every finished run in memory; returns how
    many went. A later task of the same run just rebuilds them."""
    run_dir = os.path.abspath(run_dir)
    with _LOCK:
        keys = [k for k in _STATES if k[1] == run_dir]
        for k in keys:
            del _STATES[k]
    return len(keys)


def _to_numpy(tree):
    return jax.tree.map(np.asarray, tree)


def _scalars(tree) -> dict:
    """Metrics as floats; per-seed metrics ([S]) as their mean over seeds."""
    return {k: float(np.mean(v)) for k, v in tree.items()}


# ----------------------------------------------------------------------- collect


def _new_collector(config: RunConfig, parts: RunParts) -> CollectorState:
    env, learner = parts.env, parts.learner
    make = rollout.make_collector if env.spec.backend == "jax" else rollout.make_numpy_collector
    init, collect_fn = make(env, learner.act, learner.init_carry, config.envs_per_region,
                            config.steps_per_region)
    return CollectorState(parts, open_store(config, env.spec), init, collect_fn)


_RUNNING: dict = {}  # abs run dir -> collect calls running in this worker (rollout or write)


def collects_running(run_dir: str) -> int:
    """How many collect calls of one run this worker is running, their writes included (a
    Dask task that has seceded to write still writes after its future is dropped)."""
    with _LOCK:
        return _RUNNING.get(os.path.abspath(run_dir), 0)


def collect(config, collector: int, iteration: int, params, param_version: int,
            env_steps: int) -> dict:
    """Region `iteration * n_collectors + collector`: T steps of N envs acting with the
    policy `params` (of learner version `param_version`), written to its ring slot and
    committed; returns once it is committed.

    Off the critical path: the envs move on as soon as the rollout is copied to the host,
    and inside a Dask worker the task then leaves the worker's thread pool (`secede`) to
    write, so the worker starts the next task (the next region's rollout) meanwhile; at most
    PENDING_WRITES regions of a collector wait for the disk. A retried task rewrites exactly
    its own region, with the same bytes (it rolls out again from `retry_from`).

    Returns the region's episode stats and where the time went (rollout, host copy, waiting
    for an earlier region's write, Zarr write and commit).
    """
    config = as_config(config)
    run = os.path.abspath(config.run_dir)
    with _LOCK:
        _RUNNING[run] = _RUNNING.get(run, 0) + 1
    try:
        return _collect(config, collector, iteration, params, param_version, env_steps)
    finally:
        with _LOCK:
            _RUNNING[run] -= 1


def _collect(config: RunConfig, collector: int, iteration: int, params, param_version: int,
             env_steps: int) -> dict:
    state = _state("collect", config, lambda parts: _new_collector(config, parts), collector)
    region_id = iteration * config.n_collectors + collector
    started = time.perf_counter()
    with state.rollout_lock:
        retry = state.retry_from.get(iteration)
        if retry is not None:
            before = retry
        elif state.next_iteration == iteration:
            before = state.rollout_state
        else:
            # a fresh worker or a resumed run: start new episodes (the store marks them `first`) from a key of this iteration
            key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(config.seed), collector), iteration)
            before = state.init(key)
        explore = state.parts.learner.exploration(jnp.float32(env_steps))
        rstate, data, stats = state.collect(params, before, explore)
        jax.block_until_ready(data)
        rolled = time.perf_counter()
        data, stats = _to_numpy(data), _scalars(stats)
        copied = time.perf_counter()
        if retry is None:
            state.retry_from[iteration] = before
            state.rollout_state, state.next_iteration = rstate, iteration + 1
    with state.writes:
        waited = time.perf_counter()
        _leave_worker_thread_pool()
        state.store.write_region(region_id, data, iteration=iteration, collector=collector,
                                 param_version=param_version)
    written = time.perf_counter()
    _maybe_fail(config, region_id)
    with state.rollout_lock:
        state.retry_from.pop(iteration, None)
    return {**stats, "region": region_id, "collector": collector, "iteration": iteration,
            "param_version": param_version,
            "steps": config.envs_per_collector * config.steps_per_region,
            "rollout_s": rolled - started, "host_copy_s": copied - rolled,
            "write_wait_s": waited - copied, "write_s": written - waited,
            "collect_s": written - started}


def _leave_worker_thread_pool():
    """Inside a Dask task: give this task's slot in the worker's thread pool back, so the
    worker starts its next task while this one writes (distributed.secede); a no-op when
    the stage is called as a plain function."""
    dask_distributed = sys.modules.get("distributed")  # never imported: not a Dask worker
    if dask_distributed is None:
        return
    try:
        dask_distributed.get_worker()
    except ValueError:  # not inside a Dask task
        return
    dask_distributed.secede()


def _maybe_fail(config: RunConfig, region_id: int):
    wanted = {int(r) for r in config.fail_regions_once.split(",") if r.strip()}
    if region_id not in wanted:
        return
    marker = os.path.join(config.run_dir, "faults", f"region-{region_id}")
    if os.path.exists(marker):
        return
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    open(marker, "w").close()
    raise RuntimeError(f"injected fault after committing region {region_id} (fail_regions_once)")


# ------------------------------------------------------------------------- train


def _new_learner(config: RunConfig, parts: RunParts) -> LearnerState:
    """A learner from the latest checkpoint, or a fresh one, with an empty ring mirror."""
    learner, spec = parts.learner, parts.env.spec
    train_state = learner.init(jax.random.PRNGKey(config.seed))
    checkpoints = Checkpointer(config.checkpoint_dir)
    meta = {"iteration": 0, "env_steps": 0, "param_version": 0, "updates": 0}
    if checkpoints.latest_step() is not None:
        restored, meta = checkpoints.restore(target=_to_numpy(train_state))
        train_state = jax.tree.map(jnp.asarray, restored)
    fields = {name: (f.shape, f.dtype) for name, f in replay_fields(spec, learner).items()}
    # an on-policy learner's mirror holds just one iteration's regions
    n_slots = config.n_collectors if learner.on_policy else config.n_slots
    arrays = buffer.empty(fields, n_slots, config.steps_per_region, config.envs_per_region,
                          config.n_seeds)
    return LearnerState(parts, open_store(config, spec), checkpoints, train_state, dict(meta),
                        arrays, {}, n_slots)


def _learner(config: RunConfig, iteration: int | None = None) -> LearnerState:
    """This worker's learner; rebuilt from the checkpoint when it is not at `iteration`
    (a flow restarted on this cluster resumes from its checkpoint, not from whatever later
    state this worker still holds)."""
    build = lambda parts: _new_learner(config, parts)
    state = _state("train", config, build)
    if iteration is not None and state.meta["iteration"] != iteration:
        _drop_state("train", config)
        state = _state("train", config, build)
    return state


def _mirror(state: LearnerState, config: RunConfig, iteration: int, region_ids: list[int]) -> int:
    """Copies regions from the store into the device mirror; returns how many it copied.

    An empty mirror first takes every committed region up to this iteration's (a resumed
    run keeps its replay; later regions belong to later train calls), then only the regions
    the collect tasks of each iteration committed.
    """
    store, new = state.store, 0
    if not state.mirrored and not state.parts.learner.on_policy:
        limit = (iteration + 1) * config.n_collectors
        candidates = [(r, s) for r, s in store.committed() if r < limit]
    else:
        candidates = [(r, store.slot_of(r)) for r in region_ids]
    for region_id, store_slot in candidates:
        slot = region_ids.index(region_id) if state.parts.learner.on_policy else store_slot
        if state.mirrored.get(slot) == region_id:
            continue
        try:
            region = store.read_region(region_id)
        except ReplayDamaged:
            raise  # never skipped: the run stops with its one line (marl replay verify)
        except StoreError:
            if region_id in region_ids:
                raise  # a region this call must train on is gone: the ring is too small
            continue  # an old region overwritten by the ring between listing and reading
        state.arrays = buffer.insert(state.arrays, slot, region, n_seeds=config.n_seeds)
        state.mirrored[slot] = region_id
        new += 1
    return new


def train(config, iteration: int, env_steps: int, checkpoint: bool, collected: list[dict],
          previous: dict | None = None) -> dict:
    """The learner's step of the dataflow: picks up the regions that `collected` (the
    iteration's collect results) name, updates, and returns the next policy params.
    `previous` (the last train call's metrics) is unused here: passing it makes Dask run the
    calls of one learner in order.

    Off-policy learners add the regions to their ring mirror and run `updates_per_region`
    updates per region (once `learning_starts` env steps are stored), sampling windows from
    the whole ring; on-policy learners train once on exactly these regions. Each region's
    policy lag (the learner's version now minus the version that collected it) is returned
    and recorded in the store. Checkpoints when asked.
    """
    config = as_config(config)
    state = _learner(config, iteration)
    learner = state.parts.learner
    started = time.perf_counter()
    version = state.meta["param_version"]
    region_ids = [int(c["region"]) for c in collected]
    _mirror(state, config, iteration, region_ids)
    read = time.perf_counter()
    metrics = {}
    if learner.on_policy:
        n_updates = len(region_ids)
    else:
        stored_env_steps = len(state.mirrored) * config.steps_per_region * config.envs_per_collector
        n_updates = len(region_ids) * learner.config.updates_per_region
        if stored_env_steps < learner.config.learning_starts:
            n_updates = 0
    if n_updates:
        state.train_state, m = learner.train(state.train_state, state.arrays,
                                             state.ring(config.n_collectors), n_updates)
        metrics = _scalars(m)
    jax.block_until_ready(state.train_state)
    updated = time.perf_counter()
    lags = [version - int(c["param_version"]) for c in collected]
    for region_id in region_ids:
        state.store.mark_trained(region_id, version)
    state.meta = {"iteration": iteration + 1, "env_steps": int(env_steps), "param_version": version + 1,
                  "updates": int(np.max(state.train_state["updates"]))}  # per seed
    params = _to_numpy(learner.policy_params(state.train_state))
    published = time.perf_counter()
    if checkpoint:
        state.checkpoints.save(iteration + 1, _to_numpy(state.train_state), state.meta)
    return {"params": params, "param_version": version + 1,
            "metrics": {**metrics, "updates": n_updates, "total_updates": state.meta["updates"],
                        "collected": collected, "lags": lags, "read_s": read - started, "update_s": updated - read,
                        "publish_s": published - updated, "checkpoint_s": time.perf_counter() - published,
                        "train_s": time.perf_counter() - started}}


def policy_params(config) -> dict:
    """The learner's policy params as they stand (on a fresh worker: the latest
    checkpoint's, else a new init's)."""
    config = as_config(config)
    state = _learner(config)
    return _to_numpy(state.parts.learner.policy_params(state.train_state))


def save_checkpoint(config) -> int:
    """Checkpoints the learner as it stands (a run stopped by its wall-time limit); returns
    the iteration saved."""
    config = as_config(config)
    state = _learner(config)
    step = state.meta["iteration"]
    if step and state.checkpoints.latest_step() != step:
        state.checkpoints.save(step, _to_numpy(state.train_state), state.meta)
    return step


# ---------------------------------------------------------------------- evaluate


def _new_evaluator(config: RunConfig, parts: RunParts) -> EvaluatorState:
    learner = parts.single_seed
    # a team run scores each team on its own reward and win (marl.teams), not the mean of all
    env, names, score = teams.scoring(parts.env)
    make = rollout.make_evaluator if env.spec.backend == "jax" else rollout.make_numpy_evaluator
    trained = config.env_kwargs.get("train_team")
    return EvaluatorState(parts, make(env, learner.act, learner.init_carry, config.eval_episodes,
                                      learner.greedy, score),
                          names, names.index(trained) if trained in names else 0)


def _evaluation(state: EvaluatorState, stats) -> dict:
    """One seed's evaluation as floats: a team run's per-team [team] scores become
    `<team>_win_rate` and `<team>_return_mean`, and the trained team's (the first of
    train_team=each) are the run's own `win_rate` and `return_mean`."""
    out = {k: np.asarray(v) for k, v in stats.items()}
    for i, team in enumerate(state.teams):
        out[f"{team}_win_rate"], out[f"{team}_return_mean"] = out["win_rate"][i], out["return_mean"][i]
    if state.teams:
        out["win_rate"], out["return_mean"] = out["win_rate"][state.primary], out["return_mean"][state.primary]
    return _scalars(out)


def evaluate(config, params, iteration: int) -> dict:
    """Greedy play of `eval_episodes` fresh episodes per seed: win rate, return and length
    (with several seeds: their mean, plus `<metric>_std` and `<metric>_per_seed`); for a
    team run each team's too, and "teams" names them."""
    config = as_config(config)
    state = _state("evaluate", config, lambda parts: _new_evaluator(config, parts))
    started = time.perf_counter()
    key = jax.random.fold_in(jax.random.PRNGKey(config.seed + 10_000), iteration)
    if config.n_seeds == 1:
        out = _evaluation(state, state.evaluate(params, key))
    else:
        runs = [_evaluation(state, state.evaluate(jax.tree.map(lambda p: p[s], params), jax.random.fold_in(key, s)))
                for s in range(config.n_seeds)]
        out = {}
        for name in runs[0]:
            values = np.array([r[name] for r in runs])
            out.update({name: float(values.mean()), f"{name}_std": float(values.std()),
                        f"{name}_per_seed": values.tolist()})
    return {**out, "teams": list(state.teams), "evaluate_s": time.perf_counter() - started}
