"""Env registry: one id resolves to an env and its spec.

    smax:<scenario>         jaxmarl SMAX with its heuristic enemy (e.g. smax:3m)
    mpe:<scenario>          jaxmarl MPE (e.g. mpe:simple_spread)
    jaxmarl:<name>          any env jaxmarl registers (e.g. jaxmarl:hanabi, jaxmarl:overcooked,
                            jaxmarl:MPE_simple_speaker_listener_v4), env kwargs as jaxmarl
                            takes them (a SMAX scenario or Overcooked layout by name)
    pz:<module>.<env>       any PettingZoo ParallelEnv (e.g. pz:mpe2.simple_spread_v3); `marl envs`
                            lists mpe2's, butterfly's (pz:pettingzoo.butterfly.pistonball_v6, ...;
                            the butterfly extra), sisl's (pz:pettingzoo.sisl.pursuit_v5, ...),
                            atari's (PettingZoo's atari extra and ROMs) and classic's one
                            parallel game (pz:pettingzoo.classic.rps_v2); see PETTINGZOO_LISTED

`marl envs` lists every id. Each spec is derived from the env's own spaces: discrete,
multi-discrete (one index over the product) or continuous actions; observations of any
shape flattened, except a PettingZoo env's image observations ((H, W, C) uint8, e.g.
pz:pettingzoo.butterfly.pistonball_v6), kept whole as uint8 for a conv encoder
(EnvSpec.obs_shape, marl.encoders); the env's global state where it has one, else the
agents' observations concatenated (images: stacked on the channel axis); avail-action masks
where the env gives them (SMAX, Hanabi's legal moves); the env's shaping term beside its own
reward where it has one (Overcooked's info["shaped_reward"]: `Timestep.shaped_reward`,
`EnvSpec.shaped_reward`), which only a learner asked to (reward_shaping_horizon) trains on.
Agents with different observation or action sizes are padded to the largest (JaxEnv).

JAX envs are adapted to arrays: every step returns a `Timestep` whose leaves are stacked
over agents ([agent, ...]), so they vmap over envs and scan over time without dicts.
PettingZoo envs step in numpy through the same `Timestep`, never inside `jit`.

Teams (marl/teams.py): every env has `.teams`, from its agents' names (adversary_* vs
agent_*) or the `teams` kwarg; with `train_team=<team>` make() returns that team's view, the
other agents played inside the step by a fixed `opponent` (random, noop, or an export dir).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
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
    # train_team=each: one learner per team, (name, agents, obs_dim, n_actions, action_dim)
    # each (marl.teams.team_learners); () trains every agent as one team
    teams: tuple = ()
    # image observations (PettingZoo envs whose agents see (H, W, C) uint8 pixels) are kept
    # whole, not flattened: obs_shape is one agent's image (obs_dim its size) and
    # state_shape the state's where it is an image too; () = a flat float32 vector
    obs_shape: tuple[int, ...] = ()
    state_shape: tuple[int, ...] = ()
    # the env reports a per-agent shaping term beside its reward (jaxmarl's Overcooked:
    # info["shaped_reward"], SHAPED_REWARD): each Timestep has it, the replay stores it as
    # `shaped_reward`, and MAPPO/IPPO train on reward + coef * it with reward_shaping_horizon
    shaped_reward: bool = False

    @property
    def n_agents(self) -> int:
        return len(self.agents)

    @property
    def agent_obs(self) -> tuple[tuple[int, ...], str]:
        """(shape, dtype) of one agent's observation as envs give it and learners take it."""
        return (self.obs_shape, IMAGE_DTYPE) if self.obs_shape else ((self.obs_dim,), "float32")

    @property
    def global_state(self) -> tuple[tuple[int, ...], str]:
        """(shape, dtype) of the global state as envs give it and learners take it."""
        return (self.state_shape, IMAGE_DTYPE) if self.state_shape else ((self.state_dim,), "float32")

    @property
    def mask_width(self) -> int:
        return self.n_actions if self.discrete else 1

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EnvSpec":
        teams = tuple((t[0], tuple(t[1]), *t[2:]) for t in d.get("teams", ()))
        shapes = {k: tuple(d.get(k, ())) for k in ("obs_shape", "state_shape")}
        return cls(**{**d, "agents": tuple(d["agents"]), "teams": teams, **shapes})


IMAGE_DTYPE = "uint8"  # image observations and states: pixels as the env gives them


class Timestep(NamedTuple):
    """What an env answers to reset() and step(). After an episode end the env has already
    reset: obs/state/avail_actions are the next episode's first ones (`first`), while
    reward/terminated/truncated/won describe the step that ended the old one."""

    obs: Any  # [agent, obs_dim] float32, what each agent sees before acting (images: [agent, H, W, C] uint8)
    state: Any  # [state_dim] float32, global state for mixers and centralised critics (an image: [H, W, C] uint8)
    avail_actions: Any  # [agent, mask_width] bool
    reward: Any  # [agent] float32, reward of the step that led here
    first: Any  # bool, obs are the first of an episode (a reset, or an auto-reset after an end)
    terminated: Any  # bool, the step that led here ended the episode for real (SMAX: a side wiped out)
    truncated: Any  # bool, the step that led here ended it by a time limit (never with terminated)
    won: Any  # bool, that episode was won (SMAX); False elsewhere
    # [agent] float32, the env's shaping term for the step that led here (zeros after a
    # reset), where the env has one (spec.shaped_reward: Overcooked); None elsewhere. Apart
    # from `reward`, which stays the env's own (sparse) reward: evaluation never sees it
    shaped_reward: Any = None


# --------------------------------------------------------------------------- JAX envs

# how each jaxmarl env ends an episode for real (terminated) rather than by its time limit
# (truncated), and what counts as a win; families not listed end only at their time limit
TIME_LIMIT_ONLY = ("mpe", "overcooked", "overcooked_v2", "coin_game", "storm")
# the jaxmarl envs whose step reports a shaping term beside the reward, {agent: float} in
# info["shaped_reward"] (Overcooked: 3 per onion put in a pot, 3 per plate picked up, 5 per
# soup picked up; the reward itself is 20 per delivered soup)
SHAPED_REWARD = ("overcooked", "overcooked_v2")
# SMAX pays for enemy health taken and the win, nothing for own health kept; this env kwarg
# (opt-in, so SMAX's replay stays as it is by default) adds the team's own health lost as
# the shaping term, -(sum of the allies' health lost, each over its type's full health) /
# allies, so reward + 1 * it is SMAC's reward with reward_only_positive=False
SMAX_HEALTH_SHAPING = "health_lost_shaping"
# the same term split by who lost the health: each ally's own health lost over its full
# health, over the number of allies, so the allies' terms sum to the team form's one; an
# ally's term then differs from its teammates' and a critic that knows the agent credits it
# alone. (Unsplit, each ally's own loss outweighed the shared reward on 8m: the marines fled
# and won no test episode in 200k env steps.)
SMAX_OWN_HEALTH_SHAPING = "own_health_lost_shaping"


class JaxEnv:
    """A jaxmarl env as arrays, with auto-reset. Pure functions of (key, state).

    Agents with different observation or action sizes are padded to the largest: zeros
    after a short observation; discrete actions beyond an agent's own count are ruled out by
    its avail mask; continuous action dims beyond an agent's own are dropped before the env
    sees them, and where the agents' bounds differ the learner acts in [-1, 1], rescaled
    here to each agent's own bounds."""

    def __init__(self, env, spec: EnvSpec, family: str, *, act_sizes, mask, nvec=None,
                 low=None, high=None, state_key=None):
        self.env = env
        self.spec = spec
        self.family = family  # "smax", "mpe", "hanabi", ... (see family_of)
        self.own_health_shaping = False  # SMAX: each ally's own health lost as its shaping term
        self.kind = family  # older name
        self.action_sizes = tuple(act_sizes)  # each agent's own action count (discrete) or dims
        self._mask = np.asarray(mask, bool)  # [agent, mask_width]: the padding's mask
        self._nvec = nvec  # multi-discrete action digits per agent, or None
        self._low, self._high = low, high  # [agent, action_dim] bounds to rescale into, or None
        self._state_key = state_key  # the obs entry holding the global state, or None

    def _timestep(self, obs: dict, env_state, reward, first, terminated, truncated, won,
                  shaped=None) -> Timestep:
        agents = self.spec.agents
        obs_arr = jnp.stack([_pad(_flat(obs[a]), self.spec.obs_dim) for a in agents])
        if self._state_key is None:
            state = obs_arr.reshape(-1)
        elif self.family == "smax":
            # cooldowns count down below zero without bound while a unit holds fire
            state = jnp.where(self._smax_cooldown, jnp.maximum(obs["world_state"], 0.0),
                              obs["world_state"]) * self._smax_state_scale
        else:
            state = _flat(obs[self._state_key])
        avail = jnp.asarray(self._mask)
        rule = {"smax": "get_avail_actions", "hanabi": "get_legal_moves"}.get(self.family)
        if rule is not None:
            given = getattr(self.env, rule)(env_state)
            avail = avail & jnp.stack([given[a] for a in agents]).astype(bool)
        return Timestep(obs_arr.astype(jnp.float32), state.astype(jnp.float32), avail,
                        reward, first, terminated, truncated, won, shaped)

    def reset(self, key) -> tuple[Timestep, Any]:
        obs, env_state = self.env.reset(key)
        # some jaxmarl states hold weakly typed leaves that step() returns strongly typed;
        # fix the types here so a jitted rollout compiles once, not again on its 2nd call
        env_state = jax.tree.map(lambda x: jnp.asarray(x, dtype=jnp.asarray(x).dtype), env_state)
        n = self.spec.n_agents
        no = jnp.array(False)
        shaped = jnp.zeros((n,), jnp.float32) if self.spec.shaped_reward else None
        ts = self._timestep(obs, env_state, jnp.zeros((n,), jnp.float32), jnp.array(True), no, no, no, shaped)
        return ts, env_state

    def env_actions(self, actions) -> dict:
        """The learner's padded [agent, ...] actions -> each agent's own, as the env takes them."""
        out = {}
        for i, a in enumerate(self.spec.agents):
            act = actions[i]
            if self._nvec is not None:  # one index over the product of the digits
                act = jnp.stack(jnp.unravel_index(act, self._nvec[i])).astype(jnp.int32)
            elif not self.spec.discrete:
                act = act[: self.action_sizes[i]]
                if self._low is not None:
                    lo, hi = self._low[i, : self.action_sizes[i]], self._high[i, : self.action_sizes[i]]
                    act = lo + (jnp.clip(act, -1.0, 1.0) + 1.0) * 0.5 * (hi - lo)
            out[a] = act
        return out

    def step(self, key, env_state, actions) -> tuple[Timestep, Any]:
        """One step; when the episode ends the returned obs/state are already the next reset's."""
        key_step, key_reset = jax.random.split(key)
        obs, next_state, reward, dones, info = self.env.step_env(key_step, env_state, self.env_actions(actions))
        done = jnp.asarray(dones["__all__"], bool)
        reward = jnp.stack([jnp.asarray(reward[a], jnp.float32) for a in self.spec.agents])
        shaped = None
        if self.spec.shaped_reward and self.family == "smax":
            shaped = self._smax_health_lost(env_state, next_state)
        elif self.spec.shaped_reward:
            shaped = jnp.stack([jnp.asarray(info["shaped_reward"][a], jnp.float32) for a in self.spec.agents])
        real, won = self._ended(next_state, actions, reward, info)
        terminated = done & real
        obs_re, state_re = self.env.reset(key_reset)
        next_state = jax.tree.map(lambda r, s: jnp.where(done, r, s), state_re, next_state)
        obs = jax.tree.map(lambda r, s: jnp.where(done, r, s), obs_re, obs)
        return self._timestep(obs, next_state, reward, done, terminated, done & ~terminated,
                              done & won, shaped), next_state

    def _ended(self, env_state, actions, reward, info):
        """(whether an episode that ended here ended for real, whether it was won), by the
        env's own rules; an end that is not real is its time limit (truncated)."""
        no = jnp.array(False)
        if self.family == "smax":
            # SMAX ends an episode when a side is wiped out or at its step limit (jaxmarl's
            # is_terminal: all allies dead | all enemies dead | step >= max_steps): terminated
            # where a side is gone (even on the limit's step), truncated by the limit with
            # both sides alive
            allies, enemies = self._alive(env_state)
            return ~allies | ~enemies, allies & ~enemies
        if self.family == "hanabi":  # no time limit: the game ends by its rules; won = all fireworks
            fireworks = jnp.sum(env_state.fireworks)
            return jnp.array(True), fireworks == self.env.num_colors * self.env.num_ranks
        if self.family == "switch_riddle":  # an agent said "tell" (else the step limit); +1 if right
            told = jnp.any(actions == self.env.game_actions["TELL"])
            return told, told & (reward[0] > 0)
        if self.family == "jaxnav":  # every agent at its goal or crashed (else the step limit)
            s = env_state
            return jnp.all(s.goal_reached | s.move_term), jnp.all(s.goal_reached)
        if self.family == "mabrax":  # brax marks its own episode-length ends as truncation
            return ~jnp.asarray(info.get("truncation", 0.0), bool), no
        return no, no  # TIME_LIMIT_ONLY: every end is the time limit

    def _smax_health_lost(self, before, after):
        """[agent] shaping terms from the health lost this step, each ally's over its type's
        full health: SMAX_HEALTH_SHAPING gives every ally minus their mean, and
        SMAX_OWN_HEALTH_SHAPING each ally minus its own over the number of allies."""
        before, after = getattr(before, "state", before), getattr(after, "state", after)
        n = self.env.num_allies
        full = self.env.unit_type_health[before.unit_types[:n]]
        lost = (jnp.maximum(before.unit_health[:n] - after.unit_health[:n], 0.0) / full).astype(jnp.float32)
        return -lost / n if self.own_health_shaping else jnp.full((n,), -jnp.mean(lost))

    def _alive(self, env_state):
        """SMAX: (any ally alive, any enemy alive) in the env's own state."""
        alive = getattr(env_state, "state", env_state).unit_alive
        n = self.env.num_allies
        return jnp.any(alive[:n]), jnp.any(alive[n:])


def _flat(x):
    """An agent's observation (an array, an image or a dict of them) as one flat vector."""
    return jnp.concatenate([jnp.asarray(leaf).reshape(-1).astype(jnp.float32) for leaf in jax.tree.leaves(x)])


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
    # that module sets sys.stdout/stderr to the interpreter's originals, dropping whatever
    # was there (pytest's capture, whose closed file later breaks logging): put them back
    streams = sys.stdout, sys.stderr
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        return importlib.import_module(name)
    finally:
        sys.stdout, sys.stderr = streams
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def smax_scenarios() -> list[str]:
    smax_env = _quiet_import("jaxmarl.environments.smax.smax_env")

    return sorted(smax_env.MAP_NAME_TO_SCENARIO)


def jaxmarl_names() -> list[str]:
    """Every env jaxmarl registers (jaxmarl:<name>), those needing a missing package too."""
    return list(_quiet_import("jaxmarl.registration").registered_envs)


def mpe_scenarios() -> dict[str, str]:
    """mpe:<name> -> jaxmarl registry name, e.g. simple_spread -> MPE_simple_spread_v3."""
    return {re.sub(r"^MPE_|_v\d+$", "", name): name for name in jaxmarl_names() if name.startswith("MPE_")}


MABRAX = ("ant_4x2", "halfcheetah_6x1", "hopper_3x1", "humanoid_9|8", "walker2d_2x3")


def family_of(name: str) -> str:
    """The family of a jaxmarl registered name: mpe, smax, mabrax, storm, robotarium or the
    name itself (hanabi, overcooked, overcooked_v2, coin_game, jaxnav, switch_riddle)."""
    if name.startswith("MPE_"):
        return "mpe"
    if name.endswith("SMAX"):
        return "smax"
    if name in MABRAX:
        return "mabrax"
    if name.startswith("storm"):
        return "storm"
    if name.startswith("JaxRobotarium_"):
        return "robotarium"
    return name


def unavailable(name: str) -> str | None:
    """Why jaxmarl:<name> cannot be made here (a missing package, an env this registry does
    not adapt), with what would work; None where it can."""
    family = family_of(name)
    if family == "mabrax" and not _quiet_import("jaxmarl.environments").MABRAX_AVAILABLE:
        return ("needs brax, which is not installed; install the mabrax extra "
                "(pip install 'marl-dataflow[mabrax]')")
    if family == "robotarium" and not _quiet_import("jaxmarl.environments").SUBMODULE_ENVIRONMENTS:
        return ("needs the jaxrobotarium package, a git submodule of jaxmarl that is not on PyPI; "
                "install it from its repository, or use another jaxmarl: env")
    if name == "LearnedPolicyEnemySMAX":
        return ("needs a policy function and its params, which an env id and JSON env kwargs cannot "
                "carry; use jaxmarl:HeuristicEnemySMAX or smax:<map> (e.g. smax:3m)")
    return None


def _valid_kwargs(env) -> set[str]:
    """Every keyword the env's classes take: jaxmarl envs pass **kwargs up their base classes,
    the last of which drops what it does not know, so a misspelt kwarg would be ignored."""
    classes = [*type(env).__mro__, *type(getattr(env, "_env", env)).__mro__]  # SMAX wrappers hold one
    return {name for cls in classes if "__init__" in vars(cls)
            for name, p in inspect.signature(cls.__init__).parameters.items()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {"self"}


def _named_kwargs(env_id: str, name: str, kwargs: dict) -> dict:
    """JSON env kwargs that name a jaxmarl object (a SMAX scenario, an Overcooked layout) ->
    the object."""
    kwargs = dict(kwargs)
    family = family_of(name)
    if family == "smax" and isinstance(kwargs.get("scenario"), str):
        if kwargs["scenario"] not in smax_scenarios():
            raise EnvError(f"{env_id}: unknown scenario {kwargs['scenario']!r}; valid: {', '.join(smax_scenarios())}")
        from jaxmarl.environments.smax import map_name_to_scenario

        kwargs["scenario"] = map_name_to_scenario(kwargs["scenario"])
    if name == "overcooked" and isinstance(kwargs.get("layout"), str):
        from flax.core import FrozenDict
        from jaxmarl.environments.overcooked import overcooked_layouts

        if kwargs["layout"] not in overcooked_layouts:
            raise EnvError(f"{env_id}: unknown layout {kwargs['layout']!r}; valid: {', '.join(sorted(overcooked_layouts))}")
        kwargs["layout"] = FrozenDict(overcooked_layouts[kwargs["layout"]])
    return kwargs


def _make_jaxmarl(env_id: str, name: str, kwargs: dict) -> JaxEnv:
    """Any jaxmarl registered env, its spec derived from its own spaces and a traced reset
    (some declared observation spaces differ from what the env returns)."""
    why = unavailable(name)
    if why:
        raise EnvError(f"{env_id} {why}")
    registration = _quiet_import("jaxmarl.registration")
    family = family_of(name)
    try:
        env = registration.make(name, **_named_kwargs(env_id, name, kwargs))
        error = None
    except EnvError:
        raise
    except Exception as e:  # jaxmarl answers a bad value with whatever its code raises
        env, error = None, e
    valid = _valid_kwargs(env if env is not None else registration.make(name))
    unknown = sorted(set(kwargs) - valid)
    if unknown:
        raise EnvError(f"{env_id}: unknown env kwarg(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}")
    if error is not None:
        why = " ".join(str(error).split()) or type(error).__name__
        raise EnvError(f"{env_id}: bad env kwarg ({why}); see jaxmarl's {name} arguments")
    if family == "smax" and getattr(env, "action_type", "discrete") != "discrete":
        raise EnvError(f"{env_id}: only discrete SMAX actions are supported; drop action_type")
    if family == "storm":
        env = StormByAgent(env)
    return _adapt(env, env_id, family)


class StormByAgent:
    """jaxmarl's STORM envs (storm, storm_2p, storm_np) as the dict-per-agent API every other
    jaxmarl env has: their agents are the indices 0..n-1 and their observations and rewards
    come as arrays over agents (storm's inventory with agents on its last axis) or as
    tuples (storm_2p). Here agents are agent_<i>, each with its own observation and reward."""

    def __init__(self, env):
        self.env = env
        self.agents = [f"agent_{i}" for i in env.agents]
        self.max_steps = int(env.num_inner_steps * env.num_outer_steps)

    def __getattr__(self, name):  # everything else is the wrapped env's
        return getattr(self.env, name)

    def _own(self, obs, i: int):
        if isinstance(obs, (tuple, list)):  # storm_2p: one dict per agent
            return obs[i]
        if isinstance(obs, dict):  # storm: every agent's view, and inventories [item, agent]
            return {"observation": obs["observations"][i], "inventory": obs["inventory"][:, i]}
        return obs[i]  # storm_np: [agent, H, W, C]

    def _by_agent(self, obs):
        return {a: self._own(obs, i) for i, a in enumerate(self.agents)}

    def action_space(self, agent):
        return self.env.action_space(self.agents.index(agent))

    def reset(self, key):
        obs, state = self.env.reset(key)
        return self._by_agent(obs), state

    def step_env(self, key, state, actions: dict):
        obs, state, reward, dones, info = self.env.step_env(key, state, jnp.stack([actions[a] for a in self.agents]))
        reward = jnp.stack([jnp.asarray(r, jnp.float32) for r in reward]) if isinstance(reward, (tuple, list)) else reward
        done = dones["__all__"]
        return (self._by_agent(obs), state, {a: reward[i] for i, a in enumerate(self.agents)},
                {**{a: done for a in self.agents}, "__all__": done}, info)


def _space_of(space, env_id: str, agent) -> tuple[str, int, Any]:
    """("discrete", n, digits or None) or ("continuous", dims, (low, high)) of one agent's
    action space (a multi-discrete one is one index over the product of its digits)."""
    if hasattr(space, "n"):
        return "discrete", int(space.n), None
    nvec = getattr(space, "nvec", getattr(space, "num_categories", None))
    if nvec is not None:
        nvec = tuple(int(v) for v in np.asarray(nvec).reshape(-1))
        return "discrete", int(np.prod(nvec)), nvec
    if hasattr(space, "low") and hasattr(space, "shape"):
        dims = int(np.prod(space.shape))
        low = np.broadcast_to(np.asarray(space.low, np.float32), (dims,))
        high = np.broadcast_to(np.asarray(space.high, np.float32), (dims,))
        return "continuous", dims, (low, high)
    raise EnvError(f"{env_id}: agent {agent}'s action space {type(space).__name__} is neither "
                   "discrete, multi-discrete nor a box; pick another env")


def action_layout(env_id: str, spaces: list) -> dict:
    """The padded action layout of agents with these action spaces: EnvSpec's action fields
    plus the mask of each agent's own actions and what the adapter needs to map the padded
    actions back (digits of multi-discrete spaces, per-agent bounds to rescale into)."""
    described = [_space_of(s, env_id, i) for i, s in enumerate(spaces)]
    kinds = {d[0] for d in described}
    if len(kinds) > 1:
        raise EnvError(f"{env_id}: some agents act in discrete and some in continuous spaces, which one "
                       "learner cannot drive; pick another env or an env kwarg that makes them alike")
    discrete = kinds == {"discrete"}
    sizes = [d[1] for d in described]
    width = max(sizes)
    if discrete:
        nvecs = [d[2] for d in described]
        return dict(discrete=True, n_actions=width, action_dim=0, action_low=0.0, action_high=0.0,
                    sizes=sizes, mask=np.arange(width)[None, :] < np.array(sizes)[:, None],
                    nvec=nvecs if any(nvecs) else None, low=None, high=None)
    low = np.zeros((len(sizes), width), np.float32)
    high = np.ones((len(sizes), width), np.float32)
    for i, (_, dims, (lo, hi)) in enumerate(described):
        low[i, :dims], high[i, :dims] = lo, hi
    bounds = {(float(l), float(h)) for (_, dims, (lo, hi)) in described for l, h in zip(lo, hi)}
    if len(bounds) == 1:  # one range for all: the learner acts in it, nothing to rescale
        (lo, hi), low, high = bounds.pop(), None, None
    else:
        lo, hi = -1.0, 1.0
    if not (np.isfinite(lo) and np.isfinite(hi)):
        raise EnvError(f"{env_id}: continuous actions without finite bounds are not supported; pick another env")
    return dict(discrete=False, n_actions=0, action_dim=width, action_low=lo, action_high=hi, sizes=sizes,
                mask=np.ones((len(sizes), 1), bool), nvec=None, low=low, high=high)


def _episode_limit(env, family: str) -> int:
    """The most steps an episode runs (the evaluator plays that many + 1)."""
    if family == "hanabi":
        # no step limit: each play or discard draws a card until the deck is empty, then every
        # player has one more turn; a hint spends an info token, which only the start, a
        # discard or a completed firework gives
        plays_discards = env.deck_size - env.num_agents * env.hand_size + env.num_agents
        return int(2 * plays_discards + env.max_info_tokens + env.num_colors)
    if family == "coin_game":
        return int(env.num_inner_steps * env.num_outer_steps)
    if family == "mabrax":
        return int(env.episode_length)
    return int(env.max_steps)


def _adapt(env, env_id: str, family: str) -> JaxEnv:
    agents = tuple(env.agents)
    obs, _ = jax.eval_shape(env.reset, jax.random.PRNGKey(0))
    size = lambda tree: sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))
    obs_dim = max(size(obs[a]) for a in agents)
    state_key = "world_state" if isinstance(obs, dict) and "world_state" in obs else None
    layout = action_layout(env_id, [env.action_space(a) for a in agents])
    spec = EnvSpec(
        env_id=env_id, agents=agents, obs_dim=obs_dim,
        state_dim=size(obs[state_key]) if state_key else obs_dim * len(agents),
        discrete=layout["discrete"], n_actions=layout["n_actions"], action_dim=layout["action_dim"],
        action_low=layout["action_low"], action_high=layout["action_high"],
        has_avail_actions=bool(family in ("smax", "hanabi") or not layout["mask"].all()),
        episode_limit=_episode_limit(env, family), backend="jax", shaped_reward=family in SHAPED_REWARD)
    adapted = JaxEnv(env, spec, family, act_sizes=layout["sizes"], mask=layout["mask"],
                     nvec=layout["nvec"], low=layout["low"], high=layout["high"], state_key=state_key)
    if family == "smax":
        _scale_smax_state(adapted)
    return adapted


def _scale_smax_state(adapted: JaxEnv) -> None:
    """jaxmarl's world state has raw map positions (0..32), unit type ids and weapon cooldowns
    that fall without bound; scale and clip them to about [0, 1] so mixers and critics see
    inputs on the same scale as the observations."""
    env = adapted.env
    n_units, n_feat = env.num_allies + env.num_enemies, len(env.own_features)
    scale = np.ones((n_units, n_feat), np.float32)
    scale[:, 1], scale[:, 2] = 1.0 / env.map_width, 1.0 / env.map_height
    tail = np.concatenate([np.ones(n_units), np.full(n_units, 1.0 / len(env.unit_type_names))])
    adapted._smax_state_scale = jnp.asarray(np.concatenate([scale.reshape(-1), tail]), jnp.float32)
    cooldown = np.zeros((n_units, n_feat), bool)
    cooldown[:, 3] = True
    adapted._smax_cooldown = jnp.asarray(np.concatenate([cooldown.reshape(-1), np.zeros(2 * n_units, bool)]))


def _make_smax(env_id: str, scenario: str, kwargs: dict) -> JaxEnv:
    if "scenario" in kwargs:
        raise EnvError(f"{env_id}: the id names the scenario; drop the scenario env kwarg "
                       "(or use jaxmarl:HeuristicEnemySMAX with it)")
    team, own = (bool(kwargs.pop(name, False)) for name in (SMAX_HEALTH_SHAPING, SMAX_OWN_HEALTH_SHAPING))
    if team and own:
        raise EnvError(f"{env_id}: {SMAX_HEALTH_SHAPING} and {SMAX_OWN_HEALTH_SHAPING} are two forms of one "
                       "shaping term; pass one of them")
    env = _make_jaxmarl(env_id, "HeuristicEnemySMAX", {**kwargs, "scenario": scenario})
    env.own_health_shaping = own
    if team or own:
        env.spec = dataclasses.replace(env.spec, shaped_reward=True)
    return env


# ------------------------------------------------------------------- PettingZoo envs


class PettingZooEnv:
    """A PettingZoo ParallelEnv as numpy Timesteps, with auto-reset (one env instance).
    Agents with different spaces are padded as in JaxEnv."""

    def __init__(self, factory, spec: EnvSpec):
        self.factory = factory
        self.env = factory()
        self.spec = spec
        self._episode_steps = 0
        spaces = getattr(self.env, "action_space", None)
        self._layout = action_layout(spec.env_id, [spaces(a) for a in spec.agents]) if spaces else None
        # each agent's own action count (discrete) or dims
        self.action_sizes = tuple(self._layout["sizes"]) if self._layout else ()

    def _timestep(self, obs, reward, first, terminated, truncated) -> Timestep:
        agents, s = self.spec.agents, self.spec
        if s.obs_shape:
            return self._image_timestep(obs, reward, first, terminated, truncated)
        obs_arr = np.zeros((s.n_agents, s.obs_dim), np.float32)
        for i, a in enumerate(agents):
            if a in obs:
                flat = _flat_np(obs[a])
                obs_arr[i, : flat.size] = flat
        given = _state_of(self.env)
        state = obs_arr.reshape(-1) if given is None else given.astype(np.float32).reshape(-1)
        if self._layout is None:
            avail = np.ones((s.n_agents, s.mask_width), bool)
        else:
            avail = self._layout["mask"].copy()
        return Timestep(obs_arr, state, avail, reward, np.bool_(first), np.bool_(terminated),
                        np.bool_(truncated), np.bool_(False))

    def _image_timestep(self, obs, reward, first, terminated, truncated) -> Timestep:
        """The Timestep of an env whose agents see images: kept whole as uint8, an agent
        that is gone sees zeros; the state is the env's state() image, or else the agents'
        images stacked on the channel axis (see pettingzoo_env)."""
        s = self.spec
        obs_arr = np.zeros((s.n_agents, *s.obs_shape), np.uint8)
        for i, a in enumerate(s.agents):
            if a in obs:
                obs_arr[i] = obs[a]
        given = _state_of(self.env)
        if given is None:
            state = np.concatenate(list(obs_arr), axis=-1)
        elif s.state_shape:
            state = np.asarray(given, np.uint8)
        else:  # an image env whose state() is a vector
            state = np.asarray(given, np.float32).reshape(-1)
        avail = np.ones((s.n_agents, s.mask_width), bool) if self._layout is None else self._layout["mask"].copy()
        return Timestep(obs_arr, state, avail, reward, np.bool_(first), np.bool_(terminated),
                        np.bool_(truncated), np.bool_(False))

    def reset(self, seed: int | None = None) -> Timestep:
        obs, _ = self.env.reset(seed=seed)
        self._episode_steps = 0
        return self._timestep(obs, np.zeros(self.spec.n_agents, np.float32), True, False, False)

    def _env_action(self, i: int, action):
        """Agent i's padded action -> its own, as its space takes it."""
        return numpy_action(self._layout, self.spec.discrete, i, action)

    def step(self, actions: np.ndarray) -> Timestep:
        agents = self.spec.agents
        live = self.env.agents
        act = {a: self._env_action(i, actions[i]) for i, a in enumerate(agents) if a in live}
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


def numpy_action(layout: dict | None, discrete: bool, i: int, action):
    """Agent i's padded action -> its own, as its space takes it (`layout`: action_layout's)."""
    if discrete:
        if layout is not None and layout["nvec"] is not None:
            return np.asarray(np.unravel_index(int(action), layout["nvec"][i]), np.int64)
        return int(action)
    action = np.asarray(action, np.float32)
    if layout is None:
        return action
    size = layout["sizes"][i]
    action = action[:size]
    if layout["low"] is not None:
        lo, hi = layout["low"][i, :size], layout["high"][i, :size]
        action = lo + (np.clip(action, -1.0, 1.0) + 1.0) * 0.5 * (hi - lo)
    return action


def _flat_np(x) -> np.ndarray:
    """An observation (an array, an image or a dict of them) as one flat float32 vector."""
    leaves = jax.tree.leaves(x)
    return np.concatenate([np.asarray(leaf, np.float32).reshape(-1) for leaf in leaves]) if leaves \
        else np.zeros(0, np.float32)


def _state_of(env) -> np.ndarray | None:
    """A PettingZoo env's global state() as an array, None where it has none: not implemented,
    or wrappers whose state() reaches an env without one (sisl's pursuit: AttributeError) or
    whose `state` is not the method (classic's rps keeps its moves there: TypeError)."""
    try:
        return np.asarray(env.state())
    except (AttributeError, NotImplementedError, TypeError):
        return None


def _is_image(x) -> bool:
    """An (H, W, C) uint8 array: an observation kept as an image rather than flattened."""
    return isinstance(x, np.ndarray) and x.ndim == 3 and x.dtype == np.uint8


def _stacked_shape(image_shape: tuple[int, ...], n_agents: int) -> tuple[int, ...]:
    """The state of an image env without an image state(): the agents' images on channels."""
    h, w, c = image_shape
    return (h, w, c * n_agents)


def _image_shapes(probe, first_obs: dict, agents) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(obs_shape, state_shape) of a PettingZoo env whose agents all see images of one
    shape (the state: the env's state() where it is an image, () where it is a vector, the
    agents' images stacked on channels where there is none); ((), ()) for any other env,
    whose observations are flattened."""
    seen = [first_obs[a] for a in agents if a in first_obs]
    if not seen or not all(_is_image(o) and o.shape == seen[0].shape for o in seen):
        return (), ()
    obs_shape = tuple(int(n) for n in seen[0].shape)
    state = _state_of(probe)
    if state is None:
        return obs_shape, _stacked_shape(obs_shape, len(agents))
    return obs_shape, (tuple(int(n) for n in state.shape) if _is_image(state) else ())


def _make_pettingzoo(env_id: str, target: str, kwargs: dict) -> PettingZooEnv:
    module_name, _, attr = target.rpartition(".")
    if not module_name:
        raise EnvError(f"bad env id {env_id!r}: write pz:<module>.<env>, e.g. pz:mpe2.simple_spread_v3")
    try:
        module = importlib.import_module(f"{module_name}.{attr}")
        factory_fn = module.parallel_env
    except ModuleNotFoundError as e:
        if e.name and not f"{target}.".startswith(f"{e.name}."):  # a package the env's module needs
            raise EnvError(f"{env_id} needs {e.name}, which is not installed; {_install_hint(module_name, e.name)}") from None
        module = None
    except (ImportError, AttributeError):
        module = None
    if module is None:
        try:
            module = importlib.import_module(module_name)
            factory_fn = getattr(module, attr)
            factory_fn = getattr(factory_fn, "parallel_env", factory_fn)
        except (ImportError, AttributeError):
            raise EnvError(f"unknown PettingZoo env {env_id!r}: no importable parallel_env at "
                           f"{target}; install its package or fix the id (e.g. pz:mpe2.simple_spread_v3)") from None
    # a ParallelEnv made by parallel_wrapper_fn takes **kwargs: check them against its raw env's
    wrapped = factory_fn is getattr(module, "parallel_env", None) and hasattr(module, "raw_env")
    _check_kwargs(env_id, module.raw_env if wrapped else factory_fn, kwargs)

    def factory():
        return factory_fn(**kwargs)

    return pettingzoo_env(env_id, factory)


# PettingZoo families whose packages are extras: how to install what an env of theirs needs
# (this project's own extra where it has one, else PettingZoo's)
PETTINGZOO_EXTRAS = {
    "pettingzoo.butterfly": "install the butterfly extra (pip install 'marl-dataflow[butterfly]')",
    "pettingzoo.sisl": "install PettingZoo's sisl extra (pip install 'pettingzoo[sisl]')",
    # the emulator alone does not run a game: AutoROM fetches the ROMs it needs
    "pettingzoo.atari": ("install PettingZoo's atari extra and the Atari ROMs (pip install "
                         "'pettingzoo[atari]' autorom, then AutoROM --accept-license)"),
}


def _install_hint(module_name: str, missing: str) -> str:
    hint = next((h for prefix, h in PETTINGZOO_EXTRAS.items() if module_name.startswith(prefix)), None)
    return hint or f"install it (pip install {missing})"


def _max_cycles(env) -> int:
    """The env's max_cycles, wherever its wrappers keep it (cooperative pong: on the game
    object that its raw env wraps); 0 if none says."""
    for _ in range(8):
        limit = getattr(env, "max_cycles", 0) or getattr(getattr(env, "unwrapped", None), "max_cycles", 0)
        if limit or env is None:
            return int(limit or 0)
        env = getattr(env, "aec_env", None) or getattr(env, "env", None)
    return 0


def pettingzoo_env(env_id: str, factory) -> PettingZooEnv:
    """The PettingZooEnv of the ParallelEnvs that `factory()` makes, its spec read off one."""
    probe = factory()
    first_obs, _ = probe.reset(seed=0)
    agents = tuple(probe.possible_agents)
    # the observations as they come (a dict or image space has no flat shape to read)
    obs_dim = max(_flat_np(first_obs[a]).size for a in agents if a in first_obs)
    layout = action_layout(env_id, [probe.action_space(a) for a in agents])
    obs_shape, state_shape = _image_shapes(probe, first_obs, agents)
    state = _state_of(probe)
    if state is not None:
        state_dim = int(state.size)
    else:
        state_dim = int(np.prod(state_shape)) if state_shape else obs_dim * len(agents)
    limit = _max_cycles(probe)
    spec = EnvSpec(
        env_id=env_id, agents=agents, obs_dim=obs_dim, state_dim=state_dim, discrete=layout["discrete"],
        n_actions=layout["n_actions"], action_dim=layout["action_dim"], action_low=layout["action_low"],
        action_high=layout["action_high"], has_avail_actions=bool(not layout["mask"].all()),
        episode_limit=limit, backend="numpy", obs_shape=obs_shape, state_shape=state_shape)
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


# PettingZoo families beyond mpe2 that `marl envs` lists, each with the envs it lists (None:
# every one). butterfly's pistonball (images), cooperative pong (images) and knights-archers-
# zombies (vectors, agents that die), sisl's pursuit (8 pursuers on a grid) and classic's
# rock-paper-scissors each collect into a store and train (tests/test_env_registry.py,
# tests/test_image_obs.py); sisl's multiwalker needs Box2D and atari's games their emulator
# and ROMs, which the test env lacks, so they are listed with the install line where those
# are missing. classic's other games are turn-based AEC envs, which have no parallel_env:
# not listed (a learner that acts every step for every agent does not fit them).
PETTINGZOO_LISTED = {
    "pettingzoo.butterfly": None,
    "pettingzoo.sisl": None,
    "pettingzoo.atari": None,
    "pettingzoo.classic": ("rps_v2",),
}


def pz_ids() -> list[str]:
    """The PettingZoo envs the project installs (mpe2's) or lists with their extra
    (PETTINGZOO_LISTED); pz: takes any other importable one."""
    import pkgutil

    import mpe2

    packages = [("mpe2", mpe2.__path__, None)]
    for name, only in PETTINGZOO_LISTED.items():
        found = importlib.util.find_spec(name)
        if found is not None:  # pettingzoo ships every family; their own packages are extras
            packages.append((name, found.submodule_search_locations, only))
    return [f"pz:{package}.{m.name}" for package, path, only in packages
            for m in sorted(pkgutil.iter_modules(path), key=lambda m: m.name)
            if re.search(r"_v\d+$", m.name) and (only is None or m.name in only)]


def _pz_missing(target: str) -> str | None:
    """Why pz:<target> cannot be imported here (a package it needs is missing), else None."""
    try:
        importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name and not f"{target}.".startswith(f"{e.name}."):
            return f"needs {e.name}, which is not installed; {_install_hint(target, e.name)}"
    return None


def env_ids() -> list[str]:
    """Every concrete id the registry knows, those that need a missing package too (see
    `why_not`); pz: takes any importable PettingZoo env beside the installed ones listed."""
    return ([f"smax:{s}" for s in smax_scenarios()] + [f"mpe:{s}" for s in sorted(mpe_scenarios())]
            + [f"jaxmarl:{name}" for name in jaxmarl_names()] + pz_ids())


def why_not(env_id: str) -> str | None:
    """Why a listed id cannot be made here (with what would work), None where it can."""
    kind, _, name = str(env_id).partition(":")
    if kind == "pz" and name.startswith(tuple(PETTINGZOO_LISTED)):
        return _pz_missing(name)
    return unavailable(name) if kind == "jaxmarl" else None


def make(env_id: str, **kwargs):
    """Resolve an id to an env with `.spec`; a bad id or kwarg raises a one-line EnvError.

    The team settings `teams`, `train_team` and `opponent` (marl.teams) are taken here, not
    passed to the env: with `train_team` the env is that team's view, its other agents
    played by the fixed `opponent` inside the step (teams.TeamJaxEnv, or a wrapped
    ParallelEnv); every env has `.teams` ({team: agents}, from the names by default)."""
    from marl import teams as team_settings

    settings = {k: kwargs.pop(k) for k in team_settings.TEAM_SETTINGS if k in kwargs}
    env = _make(env_id, **kwargs)
    groups, train_team, opponent = team_settings.resolve(env_id, env.spec.agents, **settings)
    if train_team is None:
        env.teams = groups
        return env
    if train_team == team_settings.EACH:  # every agent acts through the learner, one per team
        env.spec = dataclasses.replace(env.spec, teams=team_settings.learning_teams(env, groups))
        env.teams = groups
        return env
    if isinstance(env, PettingZooEnv):
        team_env = pettingzoo_env(env_id, team_settings.team_pettingzoo_factory(
            env_id, env.factory, env.spec.agents, groups, train_team, opponent))
    else:
        team_env = team_settings.TeamJaxEnv(env, groups, train_team, opponent)
    team_env.teams = groups
    return team_env


def _make(env_id: str, **kwargs) -> JaxEnv | PettingZooEnv:
    kind, _, name = str(env_id).partition(":")
    if kind == "smax" and name in smax_scenarios():
        return _make_smax(env_id, name, kwargs)
    if kind == "mpe" and name in mpe_scenarios():
        return _make_jaxmarl(env_id, mpe_scenarios()[name], kwargs)
    if kind == "jaxmarl" and name in jaxmarl_names():
        return _make_jaxmarl(env_id, name, kwargs)
    if kind == "pz" and name:
        return _make_pettingzoo(env_id, name, kwargs)
    raise EnvError(f"unknown env id {env_id!r}; `marl envs` lists them all, e.g. smax:3m, mpe:simple_spread, "
                   "jaxmarl:hanabi, jaxmarl:overcooked, or pz:<module>.<env> (e.g. pz:mpe2.simple_spread_v3)")


def spec_of(env_id: str, **kwargs) -> EnvSpec:
    return make(env_id, **kwargs).spec
