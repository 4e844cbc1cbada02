"""Env registry: one id resolves to an env and its spec.

    smax:<scenario>         jaxmarl SMAX with its heuristic enemy (e.g. smax:3m)
    mpe:<scenario>          jaxmarl MPE (e.g. mpe:simple_spread)
    pz:<module>.<env>       any PettingZoo ParallelEnv (e.g. pz:mpe2.simple_spread_v3)

JAX envs are adapted to arrays: every step returns a `Timestep` whose leaves are stacked
over agents ([agent, ...]), so they vmap over envs and scan over time without dicts.
PettingZoo envs step in numpy through the same `Timestep`, never inside `jit`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class EnvError(ValueError):
    """A bad env id or env kwarg; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    env_id: str
    agents: tuple[str, ...]
    obs_dim: int
    state_dim: int
    discrete: bool
    n_actions: int  # discrete: number of actions (avail mask width); continuous: 0
    action_dim: int  # continuous: action vector size; discrete: 0
    action_low: float
    action_high: float
    has_avail_actions: bool  # the env restricts actions (SMAX); otherwise masks are all ones
    episode_limit: int
    backend: str  # "jax" (jit/vmap) or "numpy" (PettingZoo on CPU workers)

    @property
    def n_agents(self) -> int:
        return len(self.agents)

    @property
    def mask_width(self) -> int:
        return self.n_actions if self.discrete else 1

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EnvSpec":
        return cls(**{**d, "agents": tuple(d["agents"])})


class Timestep(NamedTuple):
    """What an env answers to reset() and step(). After an episode end the env has already
    reset: obs/state/avail_actions are the next episode's first ones (`first`), while
    reward/terminated/truncated/won describe the step that ended the old one."""

    obs: Any  # [agent, obs_dim] float32, what each agent sees before acting
    state: Any  # [state_dim] float32, global state for mixers and centralised critics
    avail_actions: Any  # [agent, mask_width] bool
    reward: Any  # [agent] float32, reward of the step that led here
    first: Any  # bool, obs are the first of an episode (a reset, or an auto-reset after an end)
    terminated: Any  # bool, the step that led here ended the episode for real (SMAX: a side wiped out)
    truncated: Any  # bool, the step that led here ended it by a time limit (never with terminated)
    won: Any  # bool, that episode was won (SMAX); False elsewhere


# --------------------------------------------------------------------------- JAX envs


class JaxEnv:
    """A jaxmarl env as arrays, with auto-reset. Pure functions of (key, state)."""

    def __init__(self, env, spec: EnvSpec, kind: str):
        self.env = env
        self.spec = spec
        self.kind = kind  # "smax" or "mpe"

    def _timestep(self, obs: dict, env_state, reward, first, terminated, truncated, won) -> Timestep:
        agents = self.spec.agents
        obs_arr = jnp.stack([_pad(obs[a], self.spec.obs_dim) for a in agents])
        if self.kind == "smax":
            # cooldowns count down below zero without bound while a unit holds fire
            state = jnp.where(self._smax_cooldown, jnp.maximum(obs["world_state"], 0.0),
                              obs["world_state"]) * self._smax_state_scale
            avail = self.env.get_avail_actions(env_state)
            avail = jnp.stack([avail[a] for a in agents]).astype(bool)
        else:
            state = obs_arr.reshape(-1)
            avail = jnp.asarray(self._mpe_mask)
        return Timestep(obs_arr.astype(jnp.float32), state.astype(jnp.float32), avail,
                        reward, first, terminated, truncated, won)

    def reset(self, key) -> tuple[Timestep, Any]:
        obs, env_state = self.env.reset(key)
        # some jaxmarl states hold weakly typed leaves that step() returns strongly typed;
        # fix the types here so a jitted rollout compiles once, not again on its 2nd call
        env_state = jax.tree.map(lambda x: jnp.asarray(x, dtype=jnp.asarray(x).dtype), env_state)
        n = self.spec.n_agents
        no = jnp.array(False)
        ts = self._timestep(obs, env_state, jnp.zeros((n,), jnp.float32), jnp.array(True), no, no, no)
        return ts, env_state

    def step(self, key, env_state, actions) -> tuple[Timestep, Any]:
        """One step; when the episode ends the returned obs/state are already the next reset's."""
        key_step, key_reset = jax.random.split(key)
        act = {a: actions[i] for i, a in enumerate(self.spec.agents)}
        obs, next_state, reward, dones, _ = self.env.step_env(key_step, env_state, act)
        done = dones["__all__"]
        terminated = done & self._eliminated(next_state)
        won = self._won(next_state) & done
        obs_re, state_re = self.env.reset(key_reset)
        next_state = jax.tree.map(lambda r, s: jnp.where(done, r, s), state_re, next_state)
        obs = jax.tree.map(lambda r, s: jnp.where(done, r, s), obs_re, obs)
        reward = jnp.stack([reward[a] for a in self.spec.agents]).astype(jnp.float32)
        return self._timestep(obs, next_state, reward, done, terminated, done & ~terminated,
                              won), next_state

    def _alive(self, env_state):
        """SMAX: (any ally alive, any enemy alive) in the env's own state."""
        alive = env_state.state.unit_alive
        n = self.env.num_allies
        return jnp.any(alive[:n]), jnp.any(alive[n:])

    def _eliminated(self, env_state):
        """Whether an episode that ended here ended for real. SMAX ends an episode when a side
        is wiped out or at its step limit (jaxmarl's is_terminal: all allies dead | all
        enemies dead | step >= max_steps): it is terminated where a side is gone (even on
        the limit's step) and truncated by the limit with both sides alive. MPE episodes
        end only at max_steps: always truncated."""
        if self.kind != "smax":
            return jnp.array(False)
        allies, enemies = self._alive(env_state)
        return ~allies | ~enemies

    def _won(self, env_state):
        if self.kind != "smax":
            return jnp.array(False)
        allies, enemies = self._alive(env_state)
        return allies & ~enemies


def _pad(x, size):
    x = jnp.asarray(x).reshape(-1)
    return jnp.pad(x, (0, size - x.shape[0]))


def _quiet_import(name: str):
    """jaxmarl prints two lines about optional submodules on import; keep them off the
    terminal and the worker logs. Silenced at file descriptor 1: a module jaxmarl imports
    resets sys.stdout to the real one first, so contextlib.redirect_stdout misses them."""
    if name in sys.modules:
        return sys.modules[name]
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        return importlib.import_module(name)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def smax_scenarios() -> list[str]:
    smax_env = _quiet_import("jaxmarl.environments.smax.smax_env")

    return sorted(smax_env.MAP_NAME_TO_SCENARIO)


def mpe_scenarios() -> dict[str, str]:
    """mpe:<name> -> jaxmarl registry name, e.g. simple_spread -> MPE_simple_spread_v3."""
    registration = _quiet_import("jaxmarl.registration")
    return {re.sub(r"^MPE_|_v\d+$", "", name): name
            for name in registration.registered_envs if name.startswith("MPE_")}


def _make_smax(env_id: str, scenario: str, kwargs: dict) -> JaxEnv:
    from jaxmarl.environments.smax import HeuristicEnemySMAX, SMAX, map_name_to_scenario

    _check_kwargs(env_id, SMAX.__init__, kwargs, reserved={"scenario"})
    try:
        env = HeuristicEnemySMAX(scenario=map_name_to_scenario(scenario), **kwargs)
    except (TypeError, ValueError) as e:
        raise EnvError(f"{env_id}: bad env kwarg ({e}); see jaxmarl's SMAX arguments") from None
    if env.action_type != "discrete":
        raise EnvError(f"{env_id}: only discrete SMAX actions are supported; drop action_type")
    agents = tuple(env.agents)
    spec = EnvSpec(
        env_id=env_id, agents=agents, obs_dim=int(env.obs_size), state_dim=int(env.state_size),
        discrete=True, n_actions=int(env.action_space(agents[0]).n), action_dim=0,
        action_low=0.0, action_high=0.0, has_avail_actions=True,
        episode_limit=int(env.max_steps), backend="jax")
    adapted = JaxEnv(env, spec, "smax")
    # jaxmarl's world state has raw map positions (0..32), unit type ids and weapon cooldowns
    # that fall without bound; scale and clip them to about [0, 1] so mixers and critics see
    # inputs on the same scale as the observations
    n_units, n_feat = env.num_allies + env.num_enemies, len(env.own_features)
    scale = np.ones((n_units, n_feat), np.float32)
    scale[:, 1], scale[:, 2] = 1.0 / env.map_width, 1.0 / env.map_height
    tail = np.concatenate([np.ones(n_units), np.full(n_units, 1.0 / len(env.unit_type_names))])
    adapted._smax_state_scale = jnp.asarray(np.concatenate([scale.reshape(-1), tail]), jnp.float32)
    cooldown = np.zeros((n_units, n_feat), bool)
    cooldown[:, 3] = True
    adapted._smax_cooldown = jnp.asarray(np.concatenate([cooldown.reshape(-1), np.zeros(2 * n_units, bool)]))
    return adapted


def _make_mpe(env_id: str, registry_name: str, kwargs: dict) -> JaxEnv:
    import jaxmarl

    try:
        env = jaxmarl.make(registry_name, **kwargs)
    except (TypeError, ValueError) as e:
        raise EnvError(f"{env_id}: bad env kwarg ({e}); see jaxmarl's {registry_name} arguments") from None
    # MPE envs pass **kwargs up their base classes, the last of which drops what it does not
    # know: a misspelt kwarg would be ignored without a word
    valid = {name for cls in type(env).__mro__ if "__init__" in vars(cls)
             for name in inspect.signature(cls.__init__).parameters} - {"self", "args", "kwargs"}
    unknown = sorted(set(kwargs) - valid)
    if unknown:
        raise EnvError(f"{env_id}: unknown env kwarg(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}")
    agents = tuple(env.agents)
    obs_dim = max(int(np.prod(env.observation_space(a).shape)) for a in agents)
    space = env.action_space(agents[0])
    discrete = hasattr(space, "n")
    if discrete:
        sizes = [int(env.action_space(a).n) for a in agents]
        n_actions = max(sizes)
        mask = np.array([[i < s for i in range(n_actions)] for s in sizes], bool)
        action_dim, low, high = 0, 0.0, 0.0
    else:
        n_actions, action_dim = 0, int(np.prod(space.shape))
        mask = np.ones((len(agents), 1), bool)
        low, high = float(np.min(space.low)), float(np.max(space.high))
    spec = EnvSpec(
        env_id=env_id, agents=agents, obs_dim=obs_dim, state_dim=obs_dim * len(agents),
        discrete=discrete, n_actions=n_actions, action_dim=action_dim, action_low=low,
        action_high=high, has_avail_actions=bool(discrete and not mask.all()),
        episode_limit=int(env.max_steps), backend="jax")
    adapted = JaxEnv(env, spec, "mpe")
    adapted._mpe_mask = mask
    return adapted


# ------------------------------------------------------------------- PettingZoo envs


class PettingZooEnv:
    """A PettingZoo ParallelEnv as numpy Timesteps, with auto-reset (one env instance)."""

    def __init__(self, factory, spec: EnvSpec):
        self.factory = factory
        self.env = factory()
        self.spec = spec
        self._episode_steps = 0

    def _timestep(self, obs, reward, first, terminated, truncated) -> Timestep:
        agents, s = self.spec.agents, self.spec
        obs_arr = np.zeros((s.n_agents, s.obs_dim), np.float32)
        for i, a in enumerate(agents):
            if a in obs:
                flat = np.asarray(obs[a], np.float32).reshape(-1)
                obs_arr[i, : flat.size] = flat
        if hasattr(self.env, "state"):
            try:
                state = np.asarray(self.env.state(), np.float32).reshape(-1)
            except NotImplementedError:
                state = obs_arr.reshape(-1)
        else:
            state = obs_arr.reshape(-1)
        avail = np.ones((s.n_agents, s.mask_width), bool)
        return Timestep(obs_arr, state, avail, reward, np.bool_(first), np.bool_(terminated),
                        np.bool_(truncated), np.bool_(False))

    def reset(self, seed: int | None = None) -> Timestep:
        obs, _ = self.env.reset(seed=seed)
        self._episode_steps = 0
        return self._timestep(obs, np.zeros(self.spec.n_agents, np.float32), True, False, False)

    def step(self, actions: np.ndarray) -> Timestep:
        agents = self.spec.agents
        live = self.env.agents
        act = {a: (int(actions[i]) if self.spec.discrete else np.asarray(actions[i], np.float32))
               for i, a in enumerate(agents) if a in live}
        acting = list(live)  # PettingZoo envs may empty env.agents in place when it ends
        obs, rew, term, trunc, _ = self.env.step(act)
        self._episode_steps += 1
        reward = np.array([float(rew.get(a, 0.0)) for a in agents], np.float32)
        done = (not self.env.agents) or all(term.get(a, True) or trunc.get(a, True) for a in live)
        # a time-limit end if the limit cut off an agent that was still going; otherwise the
        # agents' terminations ended it (an agent both terminated and truncated is terminated)
        truncated = bool(done) and any(trunc.get(a, False) and not term.get(a, False) for a in acting)
        if done:
            obs, _ = self.env.reset()
            self._episode_steps = 0
        return self._timestep(obs, reward, done, done and not truncated, truncated)


def _make_pettingzoo(env_id: str, target: str, kwargs: dict) -> PettingZooEnv:
    module_name, _, attr = target.rpartition(".")
    if not module_name:
        raise EnvError(f"bad env id {env_id!r}: write pz:<module>.<env>, e.g. pz:mpe2.simple_spread_v3")
    try:
        module = importlib.import_module(f"{module_name}.{attr}")
        factory_fn = module.parallel_env
    except (ImportError, AttributeError):
        try:
            module = importlib.import_module(module_name)
            factory_fn = getattr(module, attr)
            factory_fn = getattr(factory_fn, "parallel_env", factory_fn)
        except (ImportError, AttributeError):
            raise EnvError(f"unknown PettingZoo env {env_id!r}: no importable parallel_env at "
                           f"{target}; install its package or fix the id (e.g. pz:mpe2.simple_spread_v3)") from None
    _check_kwargs(env_id, factory_fn, kwargs)

    def factory():
        return factory_fn(**kwargs)

    probe = factory()
    probe.reset(seed=0)
    agents = tuple(probe.possible_agents)
    obs_dim = max(int(np.prod(probe.observation_space(a).shape)) for a in agents)
    space = probe.action_space(agents[0])
    discrete = hasattr(space, "n")
    try:
        state_dim = int(np.prod(probe.state().shape))
    except (AttributeError, NotImplementedError):
        state_dim = obs_dim * len(agents)
    limit = int(getattr(probe, "max_cycles", 0) or getattr(getattr(probe, "unwrapped", probe), "max_cycles", 0) or 0)
    spec = EnvSpec(
        env_id=env_id, agents=agents, obs_dim=obs_dim, state_dim=state_dim, discrete=discrete,
        n_actions=int(max(probe.action_space(a).n for a in agents)) if discrete else 0,
        action_dim=0 if discrete else int(np.prod(space.shape)),
        action_low=0.0 if discrete else float(np.min(space.low)),
        action_high=0.0 if discrete else float(np.max(space.high)),
        has_avail_actions=False, episode_limit=limit, backend="numpy")
    probe.close()
    return PettingZooEnv(factory, spec)


# ------------------------------------------------------------------------- registry


def _check_kwargs(env_id: str, fn, kwargs: dict, reserved: frozenset | set = frozenset()):
    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    valid = sorted(set(params) - {"self"} - set(reserved))
    bad = sorted(set(kwargs) - set(valid))
    if bad:
        raise EnvError(f"{env_id}: unknown env kwarg(s) {', '.join(bad)}; valid: {', '.join(valid)}")


def env_ids() -> list[str]:
    """Every concrete id the registry knows (pz: takes any importable PettingZoo env)."""
    return ([f"smax:{s}" for s in smax_scenarios()] + [f"mpe:{s}" for s in sorted(mpe_scenarios())])


def make(env_id: str, **kwargs) -> JaxEnv | PettingZooEnv:
    """Resolve an id to an env with `.spec`; a bad id or kwarg raises a one-line EnvError."""
    kind, _, name = str(env_id).partition(":")
    if kind == "smax" and name in smax_scenarios():
        return _make_smax(env_id, name, kwargs)
    if kind == "mpe" and name in mpe_scenarios():
        return _make_mpe(env_id, mpe_scenarios()[name], kwargs)
    if kind == "pz" and name:
        return _make_pettingzoo(env_id, name, kwargs)
    raise EnvError(f"unknown env id {env_id!r}; valid ids: {', '.join(env_ids())}, "
                   "or pz:<module>.<env> (e.g. pz:mpe2.simple_spread_v3)")


def spec_of(env_id: str, **kwargs) -> EnvSpec:
    return make(env_id, **kwargs).spec
