"""The stages of the dataflow: collect, train, evaluate. Plain functions of JSON-able arguments.

    rollout(config, collector, iteration, params, ...)   a region: T steps of N envs with the
                                                         given policy params, in host memory
    write(config, rolled)                                that region written to its slot of
                                                         the Zarr store and committed
    train(config, iteration, ..., collected, committed)  the learner trains on the regions
                                                         `collected` hands it (in memory, while
                                                         they are written) and returns the
                                                         next policy params
    evaluate(config, params, iteration)                  greedy episodes on fresh envs

    collect(...) = rollout then write, in one call.

A test calls them directly; `pipelines.dataflow` submits the very same functions to Dask
workers and decides when each may run (the policy lag, the replay ratio). Each worker keeps
what is expensive to rebuild between calls in one typed state object per role (a
collector's compiled rollout and its envs mid-episode, the learner's train state and device
mirror of the replay ring, an evaluator's compiled evaluation). The states are only an
optimisation: the replay store and the checkpoints on disk are the truth, so a stage that
lands on a fresh worker (a retry, a restart, a resumed run) rebuilds from them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from marl import algos, buffer, envs, seeds, teams
from marl import rollout as rollouts  # (`rollout` is the stage below)
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


# Regions of one collector being written while its next region rolls out: writes of one
# collector land in order, and a disk slower than the rollouts holds the collector back.
PENDING_WRITES = 1


@dataclasses.dataclass
class CollectorState:
    """One collector's compiled rollout and its envs mid-episode (episodes run on across
    regions); `next_iteration` is the iteration its envs' state is ready for.

    `rollout_lock` is held for a rollout and its host copy only."""

    parts: RunParts
    store: ReplayStore  # (for its schema: a region leaves the rollout as the store holds it)
    init: Any
    collect: Any
    rollout_state: Any = None
    next_iteration: int = -1
    rollout_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


@dataclasses.dataclass
class WriterState:
    """One collector's regions' writer: the store, and `writes`, which bounds the regions
    being written (PENDING_WRITES). Nothing compiled: it writes wherever the region is."""

    config: RunConfig
    store: ReplayStore
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
    # region id -> the version that first trained on it, for regions whose commit the learner
    # has not seen yet (it trains on a region while the region is written)
    unmarked: dict = dataclasses.field(default_factory=dict)

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


def _writer(config: RunConfig, collector: int) -> WriterState:
    key = ("write", os.path.abspath(config.run_dir), collector)
    with _LOCK:
        state = _STATES.get(key)
        if state is None or state.config != config:  # as _state: a new config, a new store handle
            state = _STATES[key] = WriterState(config, ReplayStore.open(config.store_path, mode="r+"))
        return state


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
    make = rollouts.make_collector if env.spec.backend == "jax" else rollouts.make_numpy_collector
    init, collect_fn = make(env, learner.act, learner.init_carry, config.envs_per_region,
                            config.steps_per_region)
    return CollectorState(parts, open_store(config, env.spec), init, collect_fn)


_RUNNING: dict = {}  # abs run dir -> collect calls running in this worker (rollout or write)


def collects_running(run_dir: str) -> int:
    """How many rollout and write calls of one run this worker is running (a Dask task that
    has seceded to write still writes after its future is dropped)."""
    with _LOCK:
        return _RUNNING.get(os.path.abspath(run_dir), 0)


@contextlib.contextmanager
def _running(config: RunConfig):
    """Counts a rollout or write call of one run while it runs (collects_running)."""
    run = os.path.abspath(config.run_dir)
    with _LOCK:
        _RUNNING[run] = _RUNNING.get(run, 0) + 1
    try:
        yield
    finally:
        with _LOCK:
            _RUNNING[run] -= 1


def rollout(config, collector: int, iteration: int, params, param_version: int, env_steps: int) -> dict:
    """Region `iteration * n_collectors + collector`: T steps of N envs acting with the
    policy `params` (of learner version `param_version`), in host memory as the store will
    hold it (on a worker thread of the learner's process, on the device, in the store's
    dtypes: `write` copies it to the host). The envs move on to the next region at once.

    Returns {"data": the region's fields, "host_data": on the device, their (raveled) copies
    already on their way to the host (else None), "region", ..., the region's episode stats,
    and where the time went (rollout, host copy)}. `write` then stores it, while the learner
    (`train`) already trains on the very same arrays: the disk is off the learner's path.
    """
    config = as_config(config)
    with _running(config):
        state = _state("collect", config, lambda parts: _new_collector(config, parts), collector)
        region_id = iteration * config.n_collectors + collector
        started = time.perf_counter()
        with state.rollout_lock:
            if state.next_iteration == iteration:
                before = state.rollout_state
            else:
                # a fresh worker or a resumed run: start new episodes (the store marks them `first`) from a key of this iteration
                key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(config.seed), collector), iteration)
                before = state.init(key)
            explore = state.parts.learner.exploration(jnp.float32(env_steps))
            rstate, data, stats = state.collect(params, before, explore)
            jax.block_until_ready(data)
            rolled = time.perf_counter()
            host = None
            if _beside_the_learner():
                # the learner takes the region as the device holds it; `write` copies it to the
                # host off the learner's path (a TPU's host copy was as long as its rollouts)
                data = {name: data[name].astype(field.dtype) for name, field in state.store.fields.items()}
                host = _start_host_copy(data)
            else:
                data = state.store.conform(region_id, _to_numpy(data))
            stats = _scalars(stats)
            copied = time.perf_counter()
            # only now: a rollout that raised is retried from the same envs, the same bytes
            state.rollout_state, state.next_iteration = rstate, iteration + 1
    return {"data": data, "host_data": host, **stats, "region": region_id, "collector": collector,
            "iteration": iteration, "param_version": param_version,
            "steps": config.envs_per_collector * config.steps_per_region,
            "rollout_s": rolled - started, "host_copy_s": copied - rolled}


def write(config, rolled: dict) -> dict:
    """Writes a region that `rollout` made to its ring slot and commits it; returns once it
    is committed: {"region", "committed": True, "write_wait_s", "host_wait_s" (for a region
    still on its way off the device), "write_s"}.

    Inside a Dask worker the task first leaves the worker's thread pool (`secede`), so the
    worker rolls out its next region meanwhile; at most PENDING_WRITES regions of a collector
    wait for the disk. A retry rewrites exactly its own region, with the same bytes. (A
    collector's worker lost before its write committed: Dask makes the region again on
    another worker, whose envs start new episodes, so the store keeps other steps than the
    learner trained on for that one region; it is still stored exactly once.)
    """
    config = as_config(config)
    region_id = rolled["region"]
    with _running(config):
        state = _writer(config, rolled["collector"])
        started = time.perf_counter()
        with state.writes:
            waited = time.perf_counter()
            _leave_worker_thread_pool()
            data = _on_host(rolled)
            on_host = time.perf_counter()
            state.store.write_region(region_id, data, iteration=rolled["iteration"],
                                     collector=rolled["collector"], param_version=rolled["param_version"])
        written = time.perf_counter()
        _maybe_fail(config, region_id)
    return {"region": region_id, "committed": True, "write_wait_s": waited - started,
            "host_wait_s": on_host - waited, "write_s": written - on_host}


def collect(config, collector: int, iteration: int, params, param_version: int,
            env_steps: int) -> dict:
    """`rollout` then `write`, in this process: the region made, stored and committed (what
    a test or a notebook calls; the dataflow submits the two apart). Returns the rollout's
    dict with the write's beside it, which `train` takes as it is."""
    rolled = rollout(config, collector, iteration, params, param_version, env_steps)
    return {**rolled, **write(config, rolled)}


# Each field as dense rows on the device before its host copy: a TPU keeps an array's two
# minor dims in (8, 128) tiles, so fields such as obs [T, N, 3, 18] are padded there and
# de-tiled on their way out; raveled first, MAPPO's loop on a TPU v5e went from 0.43-0.47x to
# 0.64-0.82x its plain loop (BENCHMARKS.md, the TPU's fourth sitting). Each step is raveled in
# a loop over T ([T, N * ...] leaves): XLA compiled a whole QMIX region's ravel in minutes on
# that chip (avail_actions [32, 4096, 3, 8] alone 69 s), the per-step one in 6 s, once a run
# (sixth sitting); [T, N] fields are dense rows already.
def ravel_steps(array):
    """[T, N, ...] -> [T, N * ...], each step raveled in a loop over T ([T, N] as it is)."""
    return jax.lax.map(lambda step: step.reshape(-1), array) if array.ndim > 2 else array


_raveled = jax.jit(lambda region: {name: ravel_steps(array) for name, array in region.items()})


def _start_host_copy(region: dict) -> dict:
    """Starts copying a region's fields (on the device) to the host, each raveled per step;
    returns the arrays being copied."""
    host = _raveled(region)
    for array in host.values():  # the copies start now, beside the learner's updates
        array.copy_to_host_async()
    return host


def _on_host(rolled: dict) -> dict:
    """The region of a `rollout` in host memory, as the store will hold it (a region left on
    the device reaches the host here, from its raveled copy)."""
    if rolled.get("host_data") is None:
        return rolled["data"]
    return {name: np.asarray(flat).reshape(rolled["data"][name].shape)
            for name, flat in rolled["host_data"].items()}


def _dask_worker():
    """The Dask worker running this task, or None when the stage is called as a plain
    function (distributed never imported, or not inside a task)."""
    dask_distributed = sys.modules.get("distributed")
    if dask_distributed is None:
        return None
    try:
        return dask_distributed.get_worker()
    except ValueError:  # not inside a Dask task
        return None


def _beside_the_learner() -> bool:
    """On a worker that is a thread of the learner's process (a "threads" cluster, whose
    inproc transport hands results over by reference): a region can reach the learner
    without leaving the device."""
    worker = _dask_worker()
    return worker is not None and worker.address.startswith("inproc://")


def _leave_worker_thread_pool():
    """Inside a Dask task: give this task's slot in the worker's thread pool back, so the
    worker starts its next task while this one writes (distributed.secede); a no-op when
    the stage is called as a plain function."""
    if _dask_worker() is not None:
        sys.modules["distributed"].secede()


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


class LearnerOutOfStep(RuntimeError):
    """A train call for an iteration the learner's state is not at."""


def _learner(config: RunConfig, iteration: int | None = None, continuing: bool = False) -> LearnerState:
    """This worker's learner, at `iteration` where one is given.

    A dataflow's first train call (`continuing` False) rebuilds it from the checkpoint when
    it is elsewhere: a flow restarted on this cluster resumes from its checkpoint, not from
    whatever later state this worker still holds. A later call finds it where the previous
    call left it, or raises: a train call run again (a lost result recomputed, a retry after
    the state moved on) must not silently swap the learner for its checkpoint mid-run, which
    drops every update since."""
    build = lambda parts: _new_learner(config, parts)
    state = _state("train", config, build)
    if iteration is None or state.meta["iteration"] == iteration:
        return state
    if continuing:
        raise LearnerOutOfStep(
            f"the learner is at iteration {state.meta['iteration']}, asked to train iteration "
            f"{iteration} (a train call ran twice); run the same command again to resume "
            f"{config.run_dir} from its last checkpoint")
    _drop_state("train", config)
    state = _state("train", config, build)
    if state.meta["iteration"] != iteration:
        raise LearnerOutOfStep(
            f"the learner's checkpoint in {config.checkpoint_dir} is at iteration "
            f"{state.meta['iteration']}, asked to train iteration {iteration}; "
            f"run the same command again to resume from the checkpoint")
    return state


def _mirror(state: LearnerState, config: RunConfig, iteration: int, collected: list[dict]):
    """Copies the iteration's regions (in memory, as their rollouts made them) into the device
    mirror.

    An empty off-policy mirror (a fresh or moved learner, a resumed run) first reads every
    region committed before this iteration from the store, so the replay survives the learner.
    """
    learner, store = state.parts.learner, state.store
    if not state.mirrored and not learner.on_policy:
        for region_id, slot in store.committed():
            if region_id >= iteration * config.n_collectors:
                continue  # a later iteration's, forgotten by prepare_run's rewind, or this one's
            try:
                region = store.read_region(region_id)
            except ReplayDamaged:
                raise  # never skipped: the run stops with its one line (marl replay verify)
            except StoreError:
                continue  # overwritten by the ring between listing and reading
            _insert(state, config, slot, region_id, region)
    for index, c in enumerate(collected):
        # an on-policy mirror holds just this iteration's regions, in collector order
        slot = index if learner.on_policy else store.slot_of(c["region"])
        _insert(state, config, slot, c["region"], c["data"])


def _insert(state: LearnerState, config: RunConfig, slot: int, region_id: int, region: dict):
    state.arrays = buffer.insert(state.arrays, slot, region, n_seeds=config.n_seeds)
    state.mirrored[slot] = region_id


def _mark_trained(state: LearnerState, committed: list[dict]):
    """Records in the store the version that first trained on each region of `committed`
    (write results: those regions are committed now)."""
    for c in committed:
        version = state.unmarked.pop(c["region"], None)
        if version is not None:
            state.store.mark_trained(c["region"], version)


def train(config, iteration: int, env_steps: int, checkpoint: bool, collected: list[dict],
          committed: list[dict] = (), previous: dict | None = None) -> dict:
    """The learner's step of the dataflow: trains on the regions `collected` (the
    iteration's rollouts, their arrays in memory) and returns the next policy params.

    `committed` are write results (`write`), regions now in the store: the learner records
    the version that first trained on each, and a checkpoint needs every region it covers
    among them (a resumed run finds them in the store). `collect`'s results carry their own.
    `previous` (the last train call's metrics) makes Dask run the calls of one learner in
    order; a call with it must find the learner where the previous call left it.

    Off-policy learners add the regions to their ring mirror and run `updates_per_region`
    updates per region (once `learning_starts` env steps are stored), sampling windows from
    the whole ring; on-policy learners train once on exactly these regions. Each region's
    policy lag (the learner's version now minus the version that collected it) is returned.
    Checkpoints when asked.
    """
    config = as_config(config)
    state = _learner(config, iteration, continuing=previous is not None)
    learner = state.parts.learner
    started = time.perf_counter()
    version = state.meta["param_version"]
    _mirror(state, config, iteration, collected)
    read = time.perf_counter()
    metrics, team_names = {}, [team[0] for team in learner.spec.teams]
    if learner.on_policy:
        n_updates = len(collected)
    else:
        stored_env_steps = len(state.mirrored) * config.steps_per_region * config.envs_per_collector
        n_updates = len(collected) * learner.config.updates_per_region
        if stored_env_steps < learner.config.learning_starts:
            n_updates = 0
    if n_updates:
        # JAX dispatches the updates and returns: they run on XLA's threads while this one
        # records the regions that earlier calls trained on, committed since (store I/O)
        state.train_state, m = learner.train(state.train_state, state.arrays,
                                             state.ring(config.n_collectors), n_updates)
    _mark_trained(state, committed)
    jax.block_until_ready(state.train_state)
    if n_updates:
        metrics = _scalars(m)
        if team_names:  # one learner per team, each its own <team>_loss: the row's loss is their mean
            metrics["loss"] = float(np.mean([metrics[f"{t}_loss"] for t in team_names]))
    updated = time.perf_counter()
    lags = [version - int(c["param_version"]) for c in collected]
    state.unmarked.update({c["region"]: version for c in collected})
    # this call's own regions, where already committed (a checkpointing call, `collect` results)
    _mark_trained(state, [*committed, *(c for c in collected if c.get("committed"))])
    state.meta = {"iteration": iteration + 1, "env_steps": int(env_steps), "param_version": version + 1,
                  "updates": int(np.max(state.train_state["updates"]))}  # per seed
    params = _to_numpy(learner.policy_params(state.train_state))
    published = time.perf_counter()
    if checkpoint:
        if state.unmarked:  # the dataflow makes a checkpointing train call wait for its writes
            raise RuntimeError(f"checkpoint of iteration {iteration + 1} before regions "
                               f"{sorted(state.unmarked)} were committed; pass their write results")
        state.checkpoints.save(iteration + 1, _to_numpy(state.train_state), state.meta)
    stats = [{k: v for k, v in c.items() if k != "data"} for c in collected]
    return {"params": params, "param_version": version + 1,
            # `learner`: what the learner reported of its updates (losses, entropy, ...), for the
            # metrics rows; `teams`: the team learners whose <team>_loss it holds (none: one learner)
            "metrics": {"learner": metrics, "teams": team_names,
                        "updates": n_updates, "total_updates": state.meta["updates"], "collected": stats,
                        "lags": lags, "read_s": read - started, "update_s": updated - read,
                        "publish_s": published - updated, "checkpoint_s": time.perf_counter() - published,
                        "train_s": time.perf_counter() - started}}


def policy_params(config) -> dict:
    """The learner's policy params as they stand (on a fresh worker: the latest
    checkpoint's, else a new init's)."""
    config = as_config(config)
    state = _learner(config)
    return _to_numpy(state.parts.learner.policy_params(state.train_state))


def save_checkpoint(config, committed: list[dict] = ()) -> int:
    """Checkpoints the learner as it stands (a run stopped by its wall-time limit), once the
    regions it trained on are committed (`committed`: their write results); returns the
    iteration saved."""
    config = as_config(config)
    state = _learner(config)
    _mark_trained(state, committed)
    step = state.meta["iteration"]
    if step and state.checkpoints.latest_step() != step:
        state.checkpoints.save(step, _to_numpy(state.train_state), state.meta)
    return step


# ---------------------------------------------------------------------- evaluate


def _new_evaluator(config: RunConfig, parts: RunParts) -> EvaluatorState:
    learner = parts.single_seed
    # a team run scores each team on its own reward and win (marl.teams), not the mean of all
    env, names, score = teams.scoring(parts.env)
    make = rollouts.make_evaluator if env.spec.backend == "jax" else rollouts.make_numpy_evaluator
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
