"""Teams: which agents play together, and an env that shows the learner one team while the
other teams play a fixed policy inside the env's step.

    teams.detect(agents)                    the default teams, from the agents' names
    teams.parse(value, agents, env_id)      a team spec -> {team: (agent, ...)}
    envs.make(env_id, train_team="agent", opponent="random")    the view of one team

A team spec (`--set teams=...`) is `name:agent,agent;name:agent` (agent names may be
fnmatch patterns, e.g. `adversary:adversary_*;agent:agent_*`) or the same as a JSON object
(`{"adversary": ["adversary_0"], "agent": ["agent_0", "agent_1"]}`); every agent in
exactly one team. By default agents named `adversary*`/`leadadversary*` (and simple_crypto's
`eve`) form the team `adversary`, SMAX's `ally_*` and `enemy_*` the teams `ally` and
`enemy`, and the rest one team named by their common name (`agent` for `agent_0`,
`agent_1`; `all` where the names differ): simple_adversary and simple_tag have the teams
`adversary` and `agent`, simple_spread and simple_speaker_listener one team.

With `train_team=<team>` the env is that team's view (`TeamJaxEnv` for JAX envs, a
wrapped ParallelEnv for PettingZoo ones): its spec, obs, avail masks, actions and reward
are the team's agents' only (obs and action widths the widest of the team's own; the
global state stays the env's), so collectors, the store and the learners see a smaller
cooperative env and need no change. The other agents act inside the step with the fixed
`opponent`: `random` (uniform over their available actions, or within the action bounds),
`noop` (action 0 where available, else the first available; zeros for continuous actions)
or the directory of a policy written by `marl export` (played greedily with its learner's
own pure-JAX act, jitted inside the env step of JAX envs). The reward is the training
team's own, and so is `won` on SMAX: a side wins when the other side's units are all dead and
some of its own live (both wiped out at once is a draw, nobody's win), so a training enemy
team's `won` is the enemies' win (a team that mixes allies and enemies never wins).

With `train_team=each` every team learns: the env stays whole (all agents act through the
learner) and its spec lists the teams (`EnvSpec.teams`), for which marl.algos.make_learner
builds one learner per team (`team_learners`) that the stages drive as one.

Image observations (a PettingZoo env whose agents see (H, W, C) uint8 images) stay images
either way: a team's view keeps its agents' images (and an exported opponent policy gets its
agents' images), and with `train_team=each` the store keeps every agent's while each team's
learner takes its agents' and puts them through its own conv encoder (marl.encoders).

`team_scores(env)` scores every team of either kind of run apart (its own mean reward and
win), for evaluating a trained run team by team.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from marl.envs import EnvError, EnvSpec, JaxEnv, Timestep
from marl.rollout import mean_reward_score

TEAM_SETTINGS = ("teams", "train_team", "opponent")
EACH = "each"  # train_team=each: every team learns, one learner each (team_learners)
FIXED_OPPONENTS = ("random", "noop")


# ------------------------------------------------------------------------- the teams


def _base(agent) -> str:
    return re.sub(r"_\d+$", "", str(agent))


def _role(agent) -> str | None:
    base = _base(agent)
    if base in ("ally", "enemy"):  # SMAX with both sides as agents
        return base
    if "adversary" in base or base == "eve":  # MPE's adversaries, simple_crypto's eavesdropper
        return "adversary"
    return None


def detect(agents) -> dict[str, tuple[str, ...]]:
    """The default teams of agents with these names (see the module docstring), in the
    order their first agents come."""
    roles = {a: _role(a) for a in agents}
    rest = [a for a in agents if roles[a] is None]
    bases = {_base(a) for a in rest}
    rest_name = bases.pop() if len(bases) == 1 else ("agent" if len(rest) < len(agents) else "all")
    teams: dict[str, list[str]] = {}
    for a in agents:
        teams.setdefault(roles[a] or rest_name, []).append(a)
    return {name: tuple(members) for name, members in teams.items()}


def format_teams(teams: dict) -> str:
    """{team: agents} as the spec string `--set teams=...` takes."""
    return ";".join(f"{name}:{','.join(members)}" for name, members in teams.items())


def _example(agents) -> str:
    return f"--set teams='{format_teams(detect(agents))}'"


def parse(value, agents, env_id: str = "the env") -> dict[str, tuple[str, ...]]:
    """A team spec (None or "" for the default, a `name:a,b;name:c` string, a JSON object
    string or a dict of name -> agents, a comma string or a list) -> {team: agents in env
    order}; EnvError (one line, with an example) for anything else."""
    agents = tuple(agents)
    if value is None or value == "" or value == {}:
        return detect(agents)
    fix = f"write e.g. {_example(agents)}"
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                raise EnvError(f"{env_id}: teams={value!r} is not JSON; {fix}") from None
        else:
            spec = {}
            for part in filter(None, (p.strip() for p in text.split(";"))):
                name, sep, members = part.partition(":")
                if not sep or not name.strip():
                    raise EnvError(f"{env_id}: bad team {part!r} in teams={value!r}; each team is "
                                   f"name:agent,agent, teams separated by ';'; {fix}")
                spec[name.strip()] = members
            value = spec
    if not isinstance(value, dict) or not value:
        raise EnvError(f"{env_id}: teams={value!r} names no team; {fix}")
    owner: dict[str, str] = {}
    for name, members in value.items():
        if isinstance(members, str):
            members = [m.strip() for m in members.split(",") if m.strip()]
        if not isinstance(members, (list, tuple)) or not members:
            raise EnvError(f"{env_id}: team {name!r} has no agents; {fix}")
        for pattern in members:
            matched = [a for a in agents if fnmatch.fnmatchcase(a, str(pattern))]
            if not matched:
                raise EnvError(f"{env_id}: team {name!r} names {pattern!r}, which is no agent of this env "
                               f"(its agents: {', '.join(agents)}); {fix}")
            for a in matched:
                if owner.setdefault(a, str(name)) != str(name):
                    raise EnvError(f"{env_id}: agent {a} is in teams {owner[a]!r} and {name!r}; put each "
                                   f"agent in one team, e.g. {_example(agents)}")
    left = [a for a in agents if a not in owner]
    if left:
        raise EnvError(f"{env_id}: agent(s) {', '.join(left)} are in no team; add them to one, "
                       f"e.g. {_example(agents)}")
    return {str(name): tuple(a for a in agents if owner[a] == str(name)) for name in value}


def resolve(env_id: str, agents, teams=None, train_team=None, opponent=None):
    """The checked team settings: ({team: agents}, train_team or None, opponent or None)."""
    parsed = parse(teams, agents, env_id)
    if not train_team:
        if opponent:
            raise EnvError(f"{env_id}: opponent={opponent} needs train_team=<team> (teams: "
                           f"{', '.join(parsed)}); e.g. --set train_team={list(parsed)[-1]} opponent={opponent}")
        return parsed, None, None
    train_team = str(train_team)
    if train_team == EACH:
        if len(parsed) == 1 or opponent:
            why = "has one team" if len(parsed) == 1 else f"has no fixed opponent (opponent={opponent})"
            raise EnvError(f"{env_id}: train_team={EACH} (a learner per team) {why}; "
                           + ("split its agents with --set teams=..." if len(parsed) == 1 else "drop opponent"))
        return parsed, EACH, None
    if train_team not in parsed:
        raise EnvError(f"{env_id}: train_team={train_team} is not one of its teams ({', '.join(parsed)}); "
                       f"pass one of those, or name the teams with {_example(agents)}")
    if len(parsed) == 1:
        raise EnvError(f"{env_id}: train_team={train_team} leaves no agent to play the opponent: the env "
                       f"has one team ({', '.join(parsed[train_team])}); split its agents with "
                       "--set teams='name:agent,...;name:agent,...' or drop train_team")
    return parsed, train_team, str(opponent or "random")


# ----------------------------------------------------------------------- opponents


def _load_policy(env_id: str, path: str, agents, spec_like: dict):
    """The exported policy at `path`, checked to play exactly these agents with these sizes."""
    from marl.policy import PolicyError, load_policy

    if not os.path.isdir(path):
        raise EnvError(f"{env_id}: opponent={path} is neither {' nor '.join(FIXED_OPPONENTS)} nor a directory "
                       "written by `marl export`; pass one of those")
    try:
        policy = load_policy(path)
    except PolicyError as e:
        raise EnvError(f"{env_id}: opponent {e}") from None
    spec = policy.spec
    if tuple(spec.agents) != tuple(agents):
        raise EnvError(f"{env_id}: the opponent policy at {path} plays agents {', '.join(spec.agents)}, not "
                       f"{', '.join(agents)}; export a run of this env trained with train_team set to their team")
    have = {k: getattr(spec, k) for k in spec_like}
    if have != spec_like:
        diff = ", ".join(f"{k} {have[k]} (this env: {spec_like[k]})" for k in spec_like if have[k] != spec_like[k])
        raise EnvError(f"{env_id}: the opponent policy at {path} was made for other sizes: {diff}; export "
                       "a run of this env and team")
    return policy


class _JaxOpponent:
    """A fixed policy for the opponents of one env, pure JAX (unbatched: the collectors vmap
    the env's step): act(key, carry, obs [agent, obs_dim], avail [agent, mask], first)."""

    def __init__(self, kind: str, discrete: bool, low: float, high: float, action_dim: int, policy=None):
        self.kind, self.discrete, self.low, self.high, self.action_dim = kind, discrete, low, high, action_dim
        self.policy = policy

    def init_carry(self):
        if self.policy is None:
            return jnp.zeros((), jnp.float32)
        return self.policy.learner.init_carry(1)

    def act(self, key, carry, obs, avail, first):
        if self.policy is not None:
            learner = self.policy.learner
            actions, carry, _ = learner.act(self.policy.params, carry, obs[None], avail[None],
                                            jnp.reshape(first, (1,)), key, learner.greedy)
            return actions[0], carry
        n = obs.shape[0]
        if self.discrete:
            if self.kind == "noop":
                return jnp.argmax(avail, axis=-1).astype(jnp.int32), carry
            return jax.random.categorical(key, jnp.where(avail, 0.0, -jnp.inf)).astype(jnp.int32), carry
        if self.kind == "noop":
            return jnp.clip(jnp.zeros((n, self.action_dim)), self.low, self.high), carry
        return jax.random.uniform(key, (n, self.action_dim), minval=self.low, maxval=self.high), carry


class _NumpyOpponent:
    """The same for PettingZoo envs, in numpy: act(obs [agent, obs_dim], avail, first)."""

    def __init__(self, kind: str, discrete: bool, low: float, high: float, action_dim: int, policy=None):
        self.kind, self.discrete, self.low, self.high, self.action_dim = kind, discrete, low, high, action_dim
        self.policy, self.carry = policy, None
        self.rng = np.random.default_rng(0)

    def reset(self, seed):
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        self.carry = None

    def act(self, obs, avail, first: bool):
        if self.policy is not None:
            actions, self.carry = self.policy.act(obs[None], avail[None], self.carry, first=np.array([first]))
            return np.asarray(actions[0])
        n = obs.shape[0]
        if self.discrete:
            if self.kind == "noop":
                return np.argmax(avail, axis=-1)
            return np.array([self.rng.choice(np.flatnonzero(m)) for m in avail])
        if self.kind == "noop":
            return np.clip(np.zeros((n, self.action_dim), np.float32), self.low, self.high)
        return self.rng.uniform(self.low, self.high, (n, self.action_dim)).astype(np.float32)


# ---------------------------------------------------------------- JAX envs: a view


SMAX_SIDES = ("ally", "enemy")  # the order of _SmaxSides' won


class _SmaxSides(JaxEnv):
    """A SMAX JaxEnv whose `won` is [allies won, enemies won]: SMAX's own outcome seen from
    each side (a side wins when the other is wiped out and it is not; jaxmarl counts both
    wiped out in one step as a draw)."""

    def reset(self, key):
        ts, state = super().reset(key)
        return ts._replace(won=jnp.zeros(len(SMAX_SIDES), bool)), state

    def _ended(self, env_state, actions, reward, info):
        allies, enemies = self._alive(env_state)
        return ~allies | ~enemies, jnp.stack([allies & ~enemies, enemies & ~allies])


def _with_sides(env: JaxEnv) -> JaxEnv:
    """`env` itself, or for SMAX a copy of it whose `won` gives both sides' (_SmaxSides)."""
    if env.family != "smax":
        return env
    sided = copy.copy(env)
    sided.__class__ = _SmaxSides  # the same env, only its outcome read from both sides
    return sided


def _sides(env: JaxEnv, teams: dict) -> tuple | None:
    """Each team's SMAX side (an index into SMAX_SIDES; None for a team of both sides), or
    None for other envs."""
    if env.family != "smax":
        return None
    return tuple(next((i for i, side in enumerate(SMAX_SIDES) if all(_base(a) == side for a in members)), None)
                 for members in teams.values())


def _teams_won(won, sides: tuple | None, n_teams: int):
    """[team] bools: each team's own win from a _SmaxSides `won` (`sides` as _sides gives),
    or else the env's one `won` for every team."""
    if sides is None:
        return jnp.broadcast_to(won, (n_teams,))
    won = jnp.broadcast_to(won, (len(SMAX_SIDES),))
    return jnp.stack([won[s] if s is not None else jnp.array(False) for s in sides])


class TeamState(NamedTuple):
    env_state: Any  # the whole env's state
    opponent_obs: Any  # [opponent agent, obs_dim]: what the opponents see now
    opponent_avail: Any  # [opponent agent, mask]
    first: Any  # the opponents' obs start an episode
    carry: Any  # the opponent policy's recurrent state
    opponent_action: Any  # what the opponents did in the step that led here (zeros after a reset)
    rewards: Any  # [agent of the whole env]: every agent's reward of that step
    teams_won: Any  # [team]: each team's win at that step (see _teams_won)


def _team_sizes(agents, own_obs: dict, action_sizes: dict, spec: EnvSpec, members) -> dict:
    """The EnvSpec fields of `members` alone: the widest of their own obs and actions."""
    sizes = [action_sizes[a] for a in members]
    return dict(obs_dim=max(own_obs[a] for a in members),
                n_actions=max(sizes) if spec.discrete else 0,
                action_dim=0 if spec.discrete else max(sizes))


class TeamJaxEnv:
    """One team's view of a JaxEnv, the other agents played by a fixed opponent inside
    `step` (see the module docstring). Same contract as JaxEnv: reset(key), step(key,
    state, actions) -> (Timestep, state), pure and vmappable."""

    def __init__(self, inner: JaxEnv, teams: dict, train_team: str, opponent: str):
        self.inner, self.env, self.family = _with_sides(inner), inner.env, inner.family
        self.kind = inner.kind  # the whole env's visualiser draws it (whole_step)
        self.teams, self.train_team, self.opponent_name = teams, train_team, opponent
        spec = inner.spec
        own_obs, _ = jax.eval_shape(inner.env.reset, jax.random.PRNGKey(0))
        own_obs = {a: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(own_obs[a])) for a in spec.agents}
        action_sizes = dict(zip(spec.agents, inner.action_sizes))
        team = teams[train_team]
        others = tuple(a for a in spec.agents if a not in team)
        self._idx = np.array([spec.agents.index(a) for a in team])
        self._opp_idx = np.array([spec.agents.index(a) for a in others])
        mine = _team_sizes(spec.agents, own_obs, action_sizes, spec, team)
        theirs = _team_sizes(spec.agents, own_obs, action_sizes, spec, others)
        self._mask_width = mine["n_actions"] if spec.discrete else 1
        self._opp_mask_width = theirs["n_actions"] if spec.discrete else 1
        self._opp_obs_dim = theirs["obs_dim"]
        own_masks = np.asarray(inner._mask)[self._idx, : self._mask_width]
        self.spec = EnvSpec(
            env_id=spec.env_id, agents=team, obs_dim=mine["obs_dim"], state_dim=spec.state_dim,
            discrete=spec.discrete, n_actions=mine["n_actions"], action_dim=mine["action_dim"],
            action_low=spec.action_low, action_high=spec.action_high,
            has_avail_actions=bool(inner.family in ("smax", "hanabi") or not own_masks.all()),
            episode_limit=spec.episode_limit, backend="jax")
        self.action_sizes = tuple(action_sizes[a] for a in team)
        self.opponent_agents = others
        policy = None
        if opponent not in FIXED_OPPONENTS:
            policy = _load_policy(spec.env_id, opponent, others, dict(
                obs_dim=theirs["obs_dim"], discrete=spec.discrete, n_actions=theirs["n_actions"],
                action_dim=theirs["action_dim"], action_low=spec.action_low, action_high=spec.action_high))
        self.opponent = _JaxOpponent(opponent if policy is None else "policy", spec.discrete, spec.action_low,
                                     spec.action_high, theirs["action_dim"], policy)
        self._opp_action_shape = (len(others),) if spec.discrete else (len(others), theirs["action_dim"])
        self._sides = _sides(inner, teams)
        self._train_index = list(teams).index(train_team)

    def _view(self, ts: Timestep, env_state, carry, opp_action) -> tuple[Timestep, TeamState]:
        i, o = self._idx, self._opp_idx
        won = _teams_won(ts.won, self._sides, len(self.teams))
        mine = Timestep(ts.obs[i, : self.spec.obs_dim], ts.state, ts.avail_actions[i, : self._mask_width],
                        ts.reward[i], ts.first, ts.terminated, ts.truncated, won[self._train_index])
        state = TeamState(env_state, ts.obs[o, : self._opp_obs_dim], ts.avail_actions[o, : self._opp_mask_width],
                          ts.first, carry, opp_action, ts.reward, won)
        return mine, state

    def reset(self, key) -> tuple[Timestep, TeamState]:
        ts, env_state = self.inner.reset(key)
        dtype = jnp.int32 if self.spec.discrete else jnp.float32
        return self._view(ts, env_state, self.opponent.init_carry(), jnp.zeros(self._opp_action_shape, dtype))

    def _merge(self, actions, opp_actions):
        spec = self.inner.spec
        if spec.discrete:
            full = jnp.zeros((spec.n_agents,), jnp.int32)
            return full.at[self._idx].set(actions.astype(jnp.int32)).at[self._opp_idx].set(opp_actions.astype(jnp.int32))
        pad = lambda x: jnp.pad(x.astype(jnp.float32), ((0, 0), (0, spec.action_dim - x.shape[-1])))
        full = jnp.zeros((spec.n_agents, spec.action_dim), jnp.float32)
        return full.at[self._idx].set(pad(actions)).at[self._opp_idx].set(pad(opp_actions))

    def step(self, key, state: TeamState, actions) -> tuple[Timestep, TeamState]:
        key_opp, key_env = jax.random.split(key)
        opp_actions, carry = self.opponent.act(key_opp, state.carry, state.opponent_obs, state.opponent_avail,
                                               state.first)
        ts, env_state = self.inner.step(key_env, state.env_state, self._merge(actions, opp_actions))
        return self._view(ts, env_state, carry, opp_actions)

    def whole_step(self, key, state: TeamState, actions, next_state: TeamState):
        """(the key jaxmarl's step_env got, the whole env's state, every agent's actions) of
        the step(key, state, actions) that gave next_state: what a drawing replays."""
        key_env = jax.random.split(key)[1]
        return jax.random.split(key_env)[0], state.env_state, self._merge(actions, next_state.opponent_action)


# ------------------------------------------------------- PettingZoo envs: a wrapper


class TeamParallelEnv:
    """A PettingZoo ParallelEnv whose agents are one team's; the other agents act inside
    `step` with a fixed numpy opponent. Everything else (state(), render(), max_cycles,
    spaces) is the wrapped env's."""

    def __init__(self, inner, team, others, opponent: _NumpyOpponent, layout: dict, obs_dim: int, env_id: str,
                 image_shape: tuple = ()):
        self._inner, self._team, self._others = inner, tuple(team), tuple(others)
        self._opponent, self._layout, self._obs_dim, self._env_id = opponent, layout, obs_dim, env_id
        self._image_shape = tuple(image_shape)  # the opponents see uint8 images of this shape; () = vectors
        self.possible_agents = list(team)
        self._obs, self._first = {}, True
        self.rewards = {}  # every agent's reward of the last step (the opponents' too)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    @property
    def agents(self):
        return [a for a in self._inner.agents if a in self._team]

    def _mine(self, d: dict) -> dict:
        return {a: d[a] for a in self._team if a in d}

    def reset(self, seed=None, options=None):
        obs, infos = self._inner.reset(seed=seed, options=options)
        self._obs, self._first = obs, True
        self._opponent.reset(seed)
        return self._mine(obs), self._mine(infos)

    def step(self, actions):
        from marl.envs import _flat_np, numpy_action

        live = set(self._inner.agents)
        if self._image_shape:  # images stay whole uint8, as an exported image policy takes them
            obs = np.zeros((len(self._others), *self._image_shape), np.uint8)
        else:
            obs = np.zeros((len(self._others), self._obs_dim), np.float32)
        for j, a in enumerate(self._others):
            if a not in self._obs:
                continue  # gone: zeros
            if self._image_shape:
                obs[j] = self._obs[a]
            else:
                flat = _flat_np(self._obs[a])
                obs[j, : flat.size] = flat
        opp = self._opponent.act(obs, self._layout["mask"], self._first)
        self._first = False
        full = dict(actions)
        discrete = self._layout["discrete"]
        full.update({a: numpy_action(self._layout, discrete, j, opp[j]) for j, a in enumerate(self._others)
                     if a in live})
        obs, rew, term, trunc, infos = self._inner.step(full)
        self._obs, self.rewards = obs, rew
        return self._mine(obs), self._mine(rew), self._mine(term), self._mine(trunc), self._mine(infos)

    def state(self):
        return self._inner.state()


def team_pettingzoo_factory(env_id: str, factory, agents, teams: dict, train_team: str, opponent: str):
    """A factory of TeamParallelEnv around `factory`'s envs (checked once, here)."""
    from marl.envs import _flat_np, _image_shapes, action_layout

    others = tuple(a for a in agents if a not in teams[train_team])
    probe = factory()
    first_obs, _ = probe.reset(seed=0)
    layout = action_layout(env_id, [probe.action_space(a) for a in others])
    obs_dim = max(_flat_np(first_obs[a]).size for a in others if a in first_obs)
    image_shape, _ = _image_shapes(probe, first_obs, agents)  # () where the env's obs are vectors
    probe.close()
    policy = None
    if opponent not in FIXED_OPPONENTS:
        policy = _load_policy(env_id, opponent, others, dict(
            obs_dim=obs_dim, obs_shape=image_shape, discrete=layout["discrete"], n_actions=layout["n_actions"],
            action_dim=layout["action_dim"], action_low=layout["action_low"], action_high=layout["action_high"]))

    def team_factory():
        fixed = _NumpyOpponent(opponent if policy is None else "policy", layout["discrete"], layout["action_low"],
                               layout["action_high"], layout["action_dim"], policy)
        return TeamParallelEnv(factory(), teams[train_team], others, fixed, layout, obs_dim, env_id, image_shape)

    return team_factory


# ------------------------------------------------------------ scoring each team apart


def scoring(env):
    """(the env to evaluate, team names, score) for marl.rollout's evaluators: team_scores'
    for a team run, else the env itself, no names and the agents' mean reward and win."""
    return team_scores(env) or (env, (), mean_reward_score)


def team_scores(env):
    """For a team run's env (a team's view, or train_team=each): (the env to evaluate, the
    team names, score) for marl.rollout's evaluators, with score(timestep, env state, or the
    numpy env instance) -> ([team] mean reward of each team's agents, [team] wins); the
    opponents' scores too, which a view keeps beside the training team's. None for other envs."""
    groups = getattr(env, "teams", None) or {}
    names = tuple(groups)
    if env.spec.backend == "jax":
        view = isinstance(env, TeamJaxEnv)
        if not (view or env.spec.teams):
            return None
        whole = env.inner if view else env
        members = [np.array([whole.spec.agents.index(a) for a in agents]) for agents in groups.values()]

        def means(rewards):
            return jnp.stack([rewards[idx].mean() for idx in members])

        if view:
            return env, names, lambda ts, state: (means(state.rewards), state.teams_won)
        sides = _sides(env, groups)
        return _with_sides(env), names, lambda ts, state: (means(ts.reward), _teams_won(ts.won, sides, len(names)))
    view = isinstance(env.env, TeamParallelEnv)
    if not (view or env.spec.teams):
        return None

    def score(ts, instance):
        rewards = instance.env.rewards if view else dict(zip(env.spec.agents, ts.reward))
        return (np.array([np.mean([rewards.get(a, 0.0) for a in agents]) for agents in groups.values()]),
                np.full(len(names), bool(ts.won)))

    return env, names, score


# ------------------------------------------------- every team learning: one learner each


def own_sizes(env) -> tuple[dict, dict]:
    """({agent: its own flat obs size}, {agent: its own action count or dims}) of a JaxEnv
    or PettingZooEnv (before any padding)."""
    from marl.envs import _flat_np

    agents = env.spec.agents
    if env.spec.backend == "jax":
        obs, _ = jax.eval_shape(env.env.reset, jax.random.PRNGKey(0))
        obs = {a: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(obs[a])) for a in agents}
    else:
        probe = env.factory()
        first, _ = probe.reset(seed=0)
        obs = {a: _flat_np(first[a]).size for a in agents}
        probe.close()
    return obs, dict(zip(agents, env.action_sizes))


def learning_teams(env, groups: dict) -> tuple:
    """EnvSpec.teams for `train_team=each`: (name, agents, obs_dim, n_actions, action_dim)
    per team, its widths the widest of its own agents' (as the team's view has them)."""
    obs, actions = own_sizes(env)
    spec = env.spec
    out = []
    for name, members in groups.items():
        sizes = _team_sizes(spec.agents, obs, actions, spec, members)
        out.append((name, tuple(members), sizes["obs_dim"], sizes["n_actions"], sizes["action_dim"]))
    return tuple(out)


def team_spec(spec: EnvSpec, team) -> EnvSpec:
    """The spec one team's learner sees (its agents and widths; the env's global state)."""
    import dataclasses

    name, members, obs_dim, n_actions, action_dim = team
    return dataclasses.replace(spec, agents=tuple(members), obs_dim=obs_dim, n_actions=n_actions,
                               action_dim=action_dim, teams=())


# where each transition field keeps its agent axis (counted from the end) and the width after it
_AGENT_FIELDS = {"obs": (2, "obs_dim"), "avail_actions": (2, "mask"), "reward": (1, None),
                 "shaped_reward": (1, None)}


def team_learners(make_one, algo: str, spec: EnvSpec, config):
    """One learner per team of `spec.teams` (each `make_one(team spec, config)`, the same
    algorithm and settings), as one Learner the stages drive unchanged: its train state,
    policy params, recurrent carry and explore settings are {team: ...}; `act` splits the
    obs by team and joins the actions; each team's extras are stored as `<name>_<team>`
    (their `agent` dim renamed `<team>_team`); `train` and `update` give each team's
    learner its agents' obs, masks, actions and rewards (and the shared state and flags)
    and report its metrics as `<team>_<metric>`. The checkpoint holds every team's train
    state under its name (train_state["teams"][team])."""
    from marl.learner import Learner

    teams = spec.teams
    subs = {t[0]: make_one(team_spec(spec, t), config) for t in teams}
    # image observations [.., agent, H, W, C] are every agent's same shape: only the agent
    # axis (further back) is cut, never a width
    agent_fields = dict(_AGENT_FIELDS, obs=(1 + len(spec.obs_shape), None)) if spec.obs_shape else _AGENT_FIELDS
    index = {t[0]: np.array([spec.agents.index(a) for a in t[1]]) for t in teams}
    widths = {t[0]: dict(obs_dim=t[2], mask=t[3] if spec.discrete else 1, act=t[4]) for t in teams}
    on_policy = {s.on_policy for s in subs.values()}

    def extra_name(name, team):
        return f"{name}_{team}"

    extra_fields = {}
    for team, sub in subs.items():
        for name, (shape, dtype, dims) in sub.extra_fields.items():
            extra_fields[extra_name(name, team)] = (
                tuple(shape), dtype, tuple(f"{team}_team" if d == "agent" else d for d in dims))

    def team_batch(batch: dict, team: str) -> dict:
        """The fields of `team` (any leading layout: ring [slot, T, N], windows [B, L])."""
        idx, w = index[team], widths[team]
        out = {}
        for key, value in batch.items():
            if key in agent_fields:
                back, width = agent_fields[key]
                axis = value.ndim - back
                value = jnp.take(value, idx, axis=axis)
                if width is not None:
                    value = value[..., : w[width]]
                out[key] = value
            elif key == "action":
                back = 1 if spec.discrete else 2
                value = jnp.take(value, idx, axis=value.ndim - back)
                out[key] = value if spec.discrete else value[..., : w["act"]]
            else:
                out[key] = value
        for name in list(out):  # the other teams' extras out, this team's under their own names
            for other in subs:
                suffix = f"_{other}"
                if name.endswith(suffix) and name[: -len(suffix)] in subs[other].extra_fields:
                    value = out.pop(name)
                    if other == team:
                        out[name[: -len(suffix)]] = value
                    break
        return out

    def init(key):
        keys = jax.random.split(key, len(subs))
        states = {team: sub.init(k) for (team, sub), k in zip(subs.items(), keys)}
        return {"teams": states, "updates": _updates(states)}

    def _updates(states):
        return jnp.max(jnp.stack([jnp.asarray(s["updates"]) for s in states.values()]))

    def init_carry(n_envs):
        return {team: sub.init_carry(n_envs) for team, sub in subs.items()}

    def act(params, carry, obs, avail, reset, key, explore):
        n = obs.shape[0]
        if spec.discrete:
            actions = jnp.zeros((n, spec.n_agents), jnp.int32)
        else:
            actions = jnp.zeros((n, spec.n_agents, spec.action_dim), jnp.float32)
        carries, extras = {}, {}
        for (team, sub), k in zip(subs.items(), jax.random.split(key, len(subs))):
            idx, w = index[team], widths[team]
            mine = obs[:, idx] if spec.obs_shape else obs[:, idx, : w["obs_dim"]]
            a, carries[team], e = sub.act(params[team], carry[team], mine,
                                          avail[:, idx, : w["mask"]], reset, k, explore[team])
            if spec.discrete:
                actions = actions.at[:, idx].set(a.astype(jnp.int32))
            else:
                actions = actions.at[:, idx, : a.shape[-1]].set(a.astype(jnp.float32))
            extras.update({extra_name(name, team): v for name, v in e.items()})
        return actions, carries, extras

    def policy_params(train_state):
        return {team: sub.policy_params(train_state["teams"][team]) for team, sub in subs.items()}

    def exploration(env_steps):
        return {team: sub.exploration(env_steps) for team, sub in subs.items()}

    def _metrics(per_team: dict) -> dict:
        return {f"{team}_{name}": value for team, m in per_team.items() for name, value in m.items()}

    def update(train_state, batch):
        states, metrics = {}, {}
        for team, sub in subs.items():
            states[team], metrics[team] = sub.update(train_state["teams"][team], team_batch(batch, team))
        return {"teams": states, "updates": _updates(states)}, _metrics(metrics)

    def train(train_state, arrays, ring, n_updates: int):
        states, metrics = {}, {}
        for team, sub in subs.items():
            states[team], metrics[team] = sub.train(train_state["teams"][team], team_batch(arrays, team),
                                                    ring, n_updates)
        return {"teams": states, "updates": _updates(states)}, _metrics(metrics)

    first = next(iter(subs.values()))
    return Learner(
        name=f"{algo} per team ({', '.join(subs)})", config=config, spec=spec, init=init, act=act,
        init_carry=init_carry, policy_params=policy_params, exploration=exploration,
        greedy={team: sub.greedy for team, sub in subs.items()}, update=update, train=train,
        on_policy=on_policy.pop() if len(on_policy) == 1 else first.on_policy, extra_fields=extra_fields)
