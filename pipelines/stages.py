"""The stages: collect, train, evaluate. Plain functions of JSON-able arguments.

A test calls them directly; the flow submits the very same functions to Dask workers.
Each worker keeps what is expensive to rebuild between calls, in this module's caches:
a collector its compiled rollout and its envs' state (episodes continue across regions),
the learner its train state and a device mirror of the replay ring. The caches are only
an optimisation: the replay store and the checkpoints on disk are the truth, so a stage
that lands on a fresh worker (a retry, a restart, a resumed run) rebuilds from them.
"""

from __future__ import annotations

import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from marl import algos, buffer, envs, rollout, seeds
from pipelines.config import RunConfig
from storage import Checkpointer, Field, ReplayStore, StoreError

_CACHE: dict = {}
_LOCK = threading.Lock()


def as_config(config) -> RunConfig:
    if isinstance(config, RunConfig):
        return config
    return RunConfig(**config)


# ------------------------------------------------------------------------ the store


def replay_fields(spec: envs.EnvSpec, learner=None) -> dict[str, Field]:
    """The replay schema of DESIGN.md for one env spec, plus what the learner's policy
    records beside each transition (its `extra_fields`, e.g. a behaviour log-probability)."""
    a, agent = spec.n_agents, ("agent",)
    action = (Field((a,), "int32", agent) if spec.discrete
              else Field((a, spec.action_dim), "float32", ("agent", "act_dim")))
    fields = {
        "obs": Field((a, spec.obs_dim), "float32", ("agent", "obs_dim")),
        "state": Field((spec.state_dim,), "float32", ("state_dim",)),
        "action": action,
        "reward": Field((a,), "float32", agent),
        "done": Field((), "bool", ()),
        "won": Field((), "bool", ()),
        "avail_actions": Field((a, spec.mask_width), "bool", ("agent", "n_actions")),
    }
    for name, (shape, dtype, dims) in (learner.extra_fields if learner else {}).items():
        fields[name] = Field(tuple(shape), dtype, tuple(dims))
    return fields


def open_store(config: RunConfig, spec: envs.EnvSpec, create: bool = False,
               learner=None) -> ReplayStore:
    if not create:
        return ReplayStore.open(config.store_path, mode="r+")
    attrs = {"env_id": config.env_id, "env_spec": spec.to_dict(), "algorithm": config.algo,
             "seed": config.seed, "n_seeds": config.n_seeds, "config": config.to_dict(),
             "preset": config.preset}
    os.makedirs(config.run_dir, exist_ok=True)
    return ReplayStore.open_or_create(
        config.store_path, fields=replay_fields(spec, learner), n_envs=config.envs_per_region,
        steps_per_region=config.steps_per_region, n_slots=config.n_slots, attrs=attrs)


def prepare_run(config) -> dict:
    """Checks the env and algorithm, makes (or reopens) the store, and says where to resume.

    Returns {"iteration", "env_steps", "param_version"} of the latest checkpoint, or zeros.
    Everything is checked before anything is written, so bad input leaves a store as it was.
    """
    config = as_config(config)
    env = envs.make(config.env_id, **config.env_kwargs)
    learner = algos.make_learner(config.algo, env.spec, config.algo_config())
    open_store(config, env.spec, create=True, learner=learner)
    checkpoints = Checkpointer(config.checkpoint_dir)
    try:
        if checkpoints.latest_step() is None:
            return {"iteration": 0, "env_steps": 0, "param_version": 0}
        meta = checkpoints.metadata()
        return {k: int(meta[k]) for k in ("iteration", "env_steps", "param_version")}
    finally:
        checkpoints.close()


def _context(kind: str, config: RunConfig, *extra):
    """The per-worker cache entry for this run (rebuilt when the config changes)."""
    key = (kind, os.path.abspath(config.run_dir), *extra)
    with _LOCK:
        ctx = _CACHE.get(key)
        if ctx is None or ctx["config_json"] != config.to_json():
            env = envs.make(config.env_id, **config.env_kwargs)
            single = algos.make_learner(config.algo, env.spec, config.algo_config())
            ctx = {"config_json": config.to_json(), "env": env, "single_seed": single,
                   "learner": seeds.vmap_seeds(single, config.n_seeds)}
            _CACHE[key] = ctx
        return ctx


def env_backend(config) -> str:
    """"jax" or "numpy": where the run's collectors may go (numpy envs: CPU workers only)."""
    config = as_config(config)
    return "numpy" if config.env_id.startswith("pz:") else "jax"


def clear_caches():
    with _LOCK:
        _CACHE.clear()


def forget_run(run_dir: str) -> int:
    """Drops this worker's cache entries of one run (its envs, learner, compiled steps), so
    long-lived workers (`marl stack`) do not keep every finished run in memory; returns how
    many entries went. A later task of the same run just rebuilds them."""
    run_dir = os.path.abspath(run_dir)
    with _LOCK:
        keys = [k for k in _CACHE if k[1] == run_dir]
        for k in keys:
            del _CACHE[k]
    return len(keys)


def _to_numpy(tree):
    return jax.tree.map(np.asarray, tree)


def _scalars(tree) -> dict:
    """Metrics as floats; per-seed metrics ([S]) as their mean over seeds."""
    return {k: float(np.mean(v)) for k, v in tree.items()}


# ----------------------------------------------------------------------- collect


def collect(config, collector: int, iteration: int, params, param_version: int,
            env_steps: int) -> dict:
    """One region: T steps of N envs with the given policy params, written to the store.

    The region id is a function of (iteration, collector), so a retried task rewrites
    exactly its own region. The envs' state advances only once the region is committed.
    """
    config = as_config(config)
    ctx = _context("collect", config, collector)
    env, learner = ctx["env"], ctx["learner"]
    if "collect" not in ctx:
        make = rollout.make_collector if env.spec.backend == "jax" else rollout.make_numpy_collector
        ctx["init"], ctx["collect"] = make(env, learner.act, learner.init_carry,
                                           config.envs_per_region, config.steps_per_region)
    if "rollout_state" not in ctx:
        key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(config.seed), collector), iteration)
        ctx["rollout_state"] = ctx["init"](key)
    if "store" not in ctx:
        ctx["store"] = open_store(config, env.spec)
    region_id = iteration * config.n_collectors + collector
    started = time.perf_counter()
    rstate, data, stats = ctx["collect"](params, ctx["rollout_state"],
                                         learner.exploration(jnp.float32(env_steps)))
    data = _to_numpy(data)
    rollout_s = time.perf_counter() - started
    ctx["store"].write_region(region_id, data, iteration=iteration, collector=collector,
                              param_version=param_version)
    _maybe_fail(config, region_id)
    ctx["rollout_state"] = rstate
    return {**_scalars(stats), "region": region_id, "collector": collector,
            "steps": config.envs_per_region * config.steps_per_region,
            "rollout_s": rollout_s, "collect_s": time.perf_counter() - started}


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


def _learner_state(config: RunConfig, ctx: dict) -> dict:
    """The cached learner, or one rebuilt from the latest checkpoint, or a fresh one."""
    if "train_state" in ctx:
        return ctx
    learner, spec = ctx["learner"], ctx["env"].spec
    fresh = learner.init(jax.random.PRNGKey(config.seed))
    checkpoints = Checkpointer(config.checkpoint_dir)
    ctx["checkpoints"] = checkpoints
    ctx["meta"] = {"iteration": 0, "env_steps": 0, "param_version": 0}
    if checkpoints.latest_step() is not None:
        target = jax.tree.map(np.asarray, fresh)
        state, meta = checkpoints.restore(target=target)
        fresh = jax.tree.map(jnp.asarray, state)
        ctx["meta"] = meta
    ctx["train_state"] = fresh
    fields = {name: (f.shape, f.dtype) for name, f in replay_fields(spec, learner).items()}
    # an on-policy learner's mirror holds just one iteration's regions
    n_slots = config.n_collectors if learner.on_policy else config.n_slots
    ctx["arrays"], ctx["valid"] = buffer.empty(fields, n_slots, config.steps_per_region,
                                               config.envs_per_region)
    ctx["mirrored"] = {}  # slot -> region id held in the device mirror
    ctx["store"] = open_store(config, spec)
    return ctx


def _sync_mirror(ctx: dict, expected: list[int]) -> int:
    """Copies regions into the device mirror; returns how many.

    A fresh mirror scans the whole store once (a resumed run keeps its replay); after that
    only the `expected` regions, which this iteration's collect tasks committed, are read:
    listing every slot's commit each iteration costs ~1 s on a 64-slot ring.
    """
    store, new = ctx["store"], 0
    if not ctx["mirrored"]:
        candidates = store.committed()
    else:
        candidates = [(r, store.slot_of(r)) for r in expected]
    for region_id, slot in candidates:
        if ctx["mirrored"].get(slot) == region_id:
            continue
        try:
            region = store.read_region(region_id)
        except StoreError:  # overwritten by the ring between listing and reading
            continue
        ctx["arrays"], ctx["valid"] = buffer.insert(ctx["arrays"], ctx["valid"], slot, region)
        ctx["mirrored"][slot] = region_id
        new += 1
    return new


def train(config, iteration: int, env_steps: int, checkpoint: bool = False) -> dict:
    """Updates the learner on the replay ring; returns new policy params and metrics.

    Mirrors newly committed regions, runs `updates_per_region` updates per region that
    this iteration collected once `learning_starts` env steps are stored, and checkpoints
    when asked.
    """
    config = as_config(config)
    ctx = _context("train", config)
    if "train_state" in ctx and ctx["meta"]["iteration"] != iteration:
        # a flow restarted on this cluster resumes from its checkpoint, not from whatever
        # later state this worker still holds
        for key in ("train_state", "meta", "mirrored", "arrays", "valid"):
            ctx.pop(key, None)
    ctx = _learner_state(config, ctx)
    learner = ctx["learner"]
    started = time.perf_counter()
    if learner.on_policy:
        return _train_on_policy(config, ctx, iteration, env_steps, checkpoint, started)
    _sync_mirror(ctx, [iteration * config.n_collectors + c for c in range(config.n_collectors)])
    stored_env_steps = len(ctx["mirrored"]) * config.steps_per_region * config.envs_per_collector
    metrics = {}
    # updates follow the data this iteration collected: a learner rebuilt on resume mirrors
    # the whole store at once, but must not replay updates for regions already trained on
    this_iteration = sum(1 for r in ctx["mirrored"].values() if r // config.n_collectors == iteration)
    n_updates = this_iteration * learner.config.updates_per_region
    if n_updates and stored_env_steps >= learner.config.learning_starts:
        ctx["train_state"], m = learner.train(ctx["train_state"], ctx["arrays"], ctx["valid"], n_updates)
        metrics = _scalars(m)
    return _finish_train(ctx, iteration, env_steps, checkpoint, metrics, n_updates, started)


def _train_on_policy(config: RunConfig, ctx: dict, iteration: int, env_steps: int,
                     checkpoint: bool, started: float) -> dict:
    """Reads exactly the regions this iteration's collect tasks wrote and trains on them once."""
    store, learner = ctx["store"], ctx["learner"]
    for c in range(config.n_collectors):
        region = store.read_region(iteration * config.n_collectors + c)
        ctx["arrays"], ctx["valid"] = buffer.insert(ctx["arrays"], ctx["valid"], c, region)
    ctx["train_state"], m = learner.train(ctx["train_state"], ctx["arrays"], ctx["valid"],
                                          config.n_collectors)
    return _finish_train(ctx, iteration, env_steps, checkpoint, _scalars(m),
                         int(config.n_collectors), started)


def _finish_train(ctx: dict, iteration: int, env_steps: int, checkpoint: bool, metrics: dict,
                  n_updates: int, started: float) -> dict:
    learner = ctx["learner"]
    version = iteration + 1
    ctx["meta"] = {"iteration": iteration + 1, "env_steps": int(env_steps), "param_version": version,
                   "updates": int(np.max(ctx["train_state"]["updates"]))}  # per seed
    if checkpoint:
        ctx["checkpoints"].save(iteration + 1, _to_numpy(ctx["train_state"]), ctx["meta"])
    return {"params": _to_numpy(learner.policy_params(ctx["train_state"])),
            "param_version": version,
            "metrics": {**metrics, "updates": n_updates, "train_s": time.perf_counter() - started,
                        "total_updates": ctx["meta"]["updates"]}}


def initial_params(config) -> dict:
    """Policy params before any update: the latest checkpoint's, else a fresh init's."""
    config = as_config(config)
    ctx = _learner_state(config, _context("train", config))
    return _to_numpy(ctx["learner"].policy_params(ctx["train_state"]))


# ---------------------------------------------------------------------- evaluate


def evaluate(config, params, iteration: int) -> dict:
    """Greedy play of `eval_episodes` fresh episodes per seed: win rate, return and length
    (with several seeds: their mean, plus `<metric>_std` and `<metric>_per_seed`)."""
    config = as_config(config)
    ctx = _context("evaluate", config)
    if "evaluate" not in ctx:
        learner, env = ctx["single_seed"], ctx["env"]
        make = rollout.make_evaluator if env.spec.backend == "jax" else rollout.make_numpy_evaluator
        ctx["evaluate"] = make(env, learner.act, learner.init_carry, config.eval_episodes,
                               learner.greedy)
    key = jax.random.fold_in(jax.random.PRNGKey(config.seed + 10_000), iteration)
    if config.n_seeds == 1:
        return _scalars(ctx["evaluate"](params, key))
    runs = [_scalars(ctx["evaluate"](jax.tree.map(lambda p: p[s], params), jax.random.fold_in(key, s)))
            for s in range(config.n_seeds)]
    out = {}
    for name in runs[0]:
        values = np.array([r[name] for r in runs])
        out.update({name: float(values.mean()), f"{name}_std": float(values.std()),
                    f"{name}_per_seed": values.tolist()})
    return out
