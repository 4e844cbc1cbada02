"""The transition: what one env step records, defined once.

Collectors (marl.rollout) emit a `Transition` per step; the replay store's fields
(`store_fields`) and the dict batches the learners read (`to_record`) are derived from its
field list, so a field's name is spelled here and nowhere else. Shapes below are per env;
stored and sampled arrays put (step, env) in front, [T, N, ...] (windows: [B, L, ...]).

Step t of a stream of one env: the agents see `obs[t]` and act `action[t]`; the env steps
and answers with `reward[t]` and whether that step ended the episode (`terminated[t]` or
`truncated[t]`). The envs auto-reset, so after an end the next obs, obs[t + 1], are the next
episode's first ones (`first[t + 1]`): no terminal obs is stored.

Fields (A = spec.n_agents):

    obs            [A, obs_dim] float32, dims (agent, obs_dim): what each agent sees at t
                   (zero-padded to the widest agent's observation); image observations
                   (spec.obs_shape): [A, H, W, C] uint8, dims (agent, obs_height, obs_width,
                   obs_channel), the pixels as the env gave them
    state          [state_dim] float32, dims (state_dim,): the global state at t, for mixers
                   and centralised critics (SMAX: jaxmarl's world state, scaled to about
                   [0, 1]; MPE and PettingZoo without state(): the agents' obs, concatenated);
                   an image (spec.state_shape): [H, W, C] uint8, dims (state_height,
                   state_width, state_channel) (the env's state() image, or without one the
                   agents' images stacked on channels)
    avail_actions  [A, mask_width] bool, dims (agent, n_actions): the actions each agent may
                   take at t (all True where the env does not restrict them; continuous
                   actions: one True column)
    action         discrete: [A] int32, dims (agent,); continuous: [A, action_dim] float32,
                   dims (agent, act_dim), within [action_low, action_high]: what was done at t
    reward         [A] float32, dims (agent,): each agent's reward for the step taken at t
    first          bool, dims (): obs[t] are the first of an episode: after a reset (including
                   a collector's very first step, and a collector that restarted and reset its
                   envs) or an auto-reset after an end at t - 1
    terminated     bool, dims (): the step taken at t ended the episode for real, in a state
                   with no future (SMAX: a side was wiped out; PettingZoo: the env's
                   terminations, with no agent still going cut off by a truncation)
    truncated      bool, dims (): the step taken at t ended the episode by a time limit, so the
                   state it led to had a future (MPE: always, at max_steps; SMAX: the step
                   limit with both sides alive; PettingZoo: its truncations). Never together
                   with `terminated`
    won            bool, dims (): the step taken at t won the episode (SMAX: the enemies are
                   all dead and an ally is alive); False elsewhere
    shaped_reward  [A] float32, dims (agent,), only where the env has a shaping term
                   (spec.shaped_reward: jaxmarl's Overcooked, its info["shaped_reward"]): each
                   agent's shaping term for the step taken at t, beside the env's own `reward`,
                   which it never changes (a learner adds it with reward_shaping_horizon);
                   None, and not stored, for every other env (OPTIONAL)
    extras         {name: array}: the learner's per-step extras, as its `act` returned them
                   (e.g. MAPPO's behaviour log-probability `logp` [A] float32), named, shaped
                   and typed by its `Learner.extra_fields`; stored flat beside the others

The episode ended at t where `done(x)` = terminated | truncated. Every learner bootstraps
through a time-limit end and not through a real one: `cut(x)` marks the steps whose next
state is not stored (a truncation, a collector's restart), which no target may start from.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from marl.envs import EnvSpec

# a field's schema: (shape per env, dtype, dim names after (step, env))
FieldSpec = tuple[tuple[int, ...], str, tuple[str, ...]]


class Transition(NamedTuple):
    """One step of N envs ([N, ...] leaves), or T steps of them ([T, N, ...]); see the
    module docstring for every field."""

    obs: Any
    state: Any
    avail_actions: Any
    action: Any
    reward: Any
    first: Any
    terminated: Any
    truncated: Any
    won: Any
    extras: Any  # dict name -> array, the learner's per-step extras
    shaped_reward: Any = None  # [A], where the env has it (OPTIONAL); None elsewhere


EXTRAS = "extras"
# fields that exist only for some envs: None in a Transition and left out of the store elsewhere
OPTIONAL = ("shaped_reward",)
# the fields every store holds under their own name (extras are stored under theirs)
FIELDS = tuple(f for f in Transition._fields if f != EXTRAS and f not in OPTIONAL)


def _dims(name: str, image_shape: tuple[int, ...]) -> tuple[str, ...]:
    """Dim names of obs or state: (name_dim,) for a vector, (name_height, name_width,
    name_channel) for an image (obs and state images differ in size, so their dims do too)."""
    return tuple(f"{name}_{d}" for d in ("height", "width", "channel")) if image_shape else (f"{name}_dim",)


def _schema(spec: EnvSpec) -> Transition:
    """Each field's (shape, dtype, dims) for one env spec, as a Transition (None: an
    OPTIONAL field this env does not have)."""
    a = spec.n_agents
    flag: FieldSpec = ((), "bool", ())
    if spec.discrete:
        action: FieldSpec = ((a,), "int32", ("agent",))
    else:
        action = ((a, spec.action_dim), "float32", ("agent", "act_dim"))
    (obs_shape, obs_dtype), (state_shape, state_dtype) = spec.agent_obs, spec.global_state
    return Transition(
        obs=((a, *obs_shape), obs_dtype, ("agent", *_dims("obs", spec.obs_shape))),
        state=(state_shape, state_dtype, _dims("state", spec.state_shape)),
        avail_actions=((a, spec.mask_width), "bool", ("agent", "n_actions")),
        action=action,
        reward=((a,), "float32", ("agent",)),
        first=flag,
        terminated=flag,
        truncated=flag,
        won=flag,
        extras={},
        shaped_reward=((a,), "float32", ("agent",)) if spec.shaped_reward else None,
    )


def store_fields(spec: EnvSpec, extra_fields: Mapping[str, FieldSpec]) -> dict[str, FieldSpec]:
    """The replay schema: name -> (shape per env, dtype, dims) of every Transition field for
    `spec`, then the learner's `extra_fields`, in the order the store lists them."""
    fields = {name: value for name, value in zip(Transition._fields, _schema(spec))
              if name != EXTRAS and value is not None}
    for name, (shape, dtype, dims) in extra_fields.items():
        if name in Transition._fields:
            raise ValueError(f"learner extra field {name!r} has the name of a transition field; "
                             f"rename it (transition fields: {', '.join(FIELDS + OPTIONAL)})")
        fields[name] = (tuple(shape), str(dtype), tuple(dims))
    return fields


def to_record(transition: Transition) -> dict:
    """A Transition -> the flat {name: array} dict the store writes and the learners read
    (extras flattened under their own names; an OPTIONAL field that is None left out)."""
    record = {k: v for k, v in transition._asdict().items() if not (k in OPTIONAL and v is None)}
    extras = record.pop(EXTRAS) or {}
    clash = sorted(set(extras) & set(Transition._fields))
    if clash:
        raise ValueError(f"extras {clash} have the names of transition fields; rename them")
    return {**record, **extras}


def from_record(record: Mapping) -> Transition:
    """The inverse of `to_record`: every key that is not a Transition field is an extra."""
    return Transition(**{name: record[name] for name in FIELDS},
                      **{name: record.get(name) for name in OPTIONAL},
                      extras={k: v for k, v in record.items() if k not in Transition._fields})


def done(batch):
    """terminated | truncated: where an episode ended, for whatever reason (of a flat dict
    batch, a Transition or an env's Timestep)."""
    if isinstance(batch, Mapping):
        return batch["terminated"] | batch["truncated"]
    return batch.terminated | batch.truncated


def real_end(windows, time_limit_bootstrap: bool = True):
    """[B, L] bool: where an episode ended with nothing after it to bootstrap on: a
    `terminated` end, and, without time_limit_bootstrap (a learner's setting), a time limit
    too."""
    return windows["terminated"] | (windows["truncated"] & (not time_limit_bootstrap))


def cut(windows, time_limit_bootstrap: bool = True):
    """[B, L] windows -> [B, L-1] bool: True where the state that step t led to is not the
    next stored step, so step t has no bootstrap and is left out of every TD or advantage
    loss (the transitions before it bootstrap on its obs as usual):

    - a time-limit end, `truncated[t]`: the envs auto-reset, so obs[t + 1] are the next
      episode's and the state the limit interrupted is not stored (without
      time_limit_bootstrap a time limit is a `real_end` instead, not a cut);
    - a stream cut, `first[t + 1]` with no end at t: a collector restarted its envs.

    A `terminated` end is not a cut: its target has no bootstrap by definition."""
    restart = windows["first"][:, 1:] & ~done(windows)[:, :-1]
    return windows["truncated"][:, :-1] | restart if time_limit_bootstrap else restart
