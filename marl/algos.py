"""Algorithm registry and config overrides (`--set key=value`)."""

from __future__ import annotations

import dataclasses
import math
import typing

from marl import maddpg, mappo, qmix
from marl.envs import EnvSpec

# name -> (module with Config and make_learner, that Config's defaults for this name)
ALGORITHMS = {
    "qmix": (qmix, {}),
    "vdn": (qmix, {"mixer": "vdn"}),
    "iql": (qmix, {"mixer": "none"}),
    "mappo": (mappo, {"critic": "central"}),
    "ippo": (mappo, {"critic": "local"}),
    "maddpg": (maddpg, {}),
}


class ConfigError(ValueError):
    """A bad algorithm name or override; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric setting may take: low..high, each end included unless open."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is not allowed (a rate of 0 learns nothing)

    def admits(self, value) -> bool:
        return (math.isfinite(value)
                and (self.low is None or value > self.low or (value == self.low and not self.low_open))
                and (self.high is None or value <= self.high))

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return "a finite number"


AT_LEAST_1, AT_LEAST_0, POSITIVE = Range(1), Range(0), Range(0, low_open=True)
FRACTION = Range(0, 1)  # discounts, lambdas, probabilities
# Every numeric setting of every algorithm's Config, by name (a name means the same thing in
# each algorithm); tests/test_bad_input.py checks that a new setting gets a line here.
RANGES = {
    **dict.fromkeys(("hidden", "mixer_embed", "hypernet_embed", "batch_size", "seq_len",
                     "updates_per_region", "target_update_interval", "eps_decay_steps", "epochs",
                     "minibatches", "n_step", "actor_every", "noise_decay_steps"), AT_LEAST_1),
    **dict.fromkeys(("learning_starts", "anneal_lr_iterations", "ent_coef", "vf_coef", "actor_reg",
                     "noise_start", "noise_end", "burn_in", "reward_shaping_horizon"), AT_LEAST_0),
    **dict.fromkeys(("lr", "actor_lr", "critic_lr", "max_grad_norm", "clip_eps", "value_clip_eps",
                     "gumbel_temperature", "mixer_init_scale"), POSITIVE),
    **dict.fromkeys(("gamma", "td_lambda", "gae_lambda", "eps_start", "eps_end"), FRACTION),
    "tau": Range(0, 1, low_open=True),
    "log_std_init": Range(),
}
# the string settings, and the values each may take
CHOICES = {"mixer": tuple(qmix.MIXERS), "critic": tuple(mappo.CRITICS), "activation": tuple(mappo.ACTIVATIONS)}
# settings that shape the networks: a checkpoint restores only into the same shapes
NETWORK = ("mixer", "hidden", "mixer_embed", "hypernet_embed", "critic", "recurrent", "activation",
           "twin_critics", "share_params", "learned_std")


def config_for(algo: str, overrides: dict | None = None):
    """The algorithm's Config with `overrides` applied, every value checked against RANGES
    and CHOICES (ConfigError naming the setting and a valid value)."""
    module = module_for(algo)
    defaults = dataclasses.replace(module.Config(), **ALGORITHMS[algo][1])
    config = apply_overrides(defaults, overrides or {}, where=algo)
    for field in dataclasses.fields(config):
        key, value = field.name, getattr(config, field.name)
        example = getattr(defaults, key)
        if key in CHOICES and value not in CHOICES[key]:
            raise ConfigError(f"setting {key}={value!r} is not one of {', '.join(CHOICES[key])}; "
                              f"e.g. --set {key}={example}")
        if key in RANGES and not isinstance(value, bool) and not RANGES[key].admits(value):
            raise ConfigError(f"setting {key}={value!r} must be {RANGES[key].describe()}; "
                              f"e.g. --set {key}={example}")
    return config


def check_env(algo: str, spec: EnvSpec, config=None) -> None:
    """ConfigError where `algo` cannot act in the env's action space (QMIX and its relatives
    pick discrete actions only), or where its `config` asks for reward shaping on an env
    without a shaping term, or for the previous action as an input beside image observations."""
    horizon = getattr(config, "reward_shaping_horizon", 0)
    if horizon and not spec.shaped_reward:
        raise ConfigError(mappo.SHAPING_NEEDS.format(horizon=horizon, env=spec.env_id))
    if getattr(config, "last_action", False) and spec.obs_shape:
        raise ConfigError(qmix.LAST_ACTION_NEEDS.format(env=spec.env_id))
    space = "discrete" if spec.discrete else "continuous"
    if space not in module_for(algo).ACTION_SPACES:
        fits = sorted(name for name, (module, _) in ALGORITHMS.items() if space in module.ACTION_SPACES)
        raise ConfigError(f"{algo} needs {' or '.join(module_for(algo).ACTION_SPACES)} actions and "
                          f"{spec.env_id} has {space} ones; use {', '.join(fits)} for this env, "
                          "or another env")


def module_for(algo: str):
    if algo not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm {algo!r}; valid: {', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[algo][0]


def make_learner(algo: str, spec: EnvSpec, config):
    if spec.teams:  # train_team=each: one learner per team (marl/teams.py)
        from marl.teams import team_learners

        return team_learners(module_for(algo).make_learner, algo, spec, config)
    return module_for(algo).make_learner(spec, config)


def apply_overrides(config, overrides: dict, where: str):
    """Returns config with overrides applied; values may be strings ("1e-3") and are coerced."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    hints = typing.get_type_hints(type(config))
    changes = {}
    for key, value in overrides.items():
        if key not in fields:
            raise ConfigError(f"unknown {where} setting {key!r}; valid: {', '.join(sorted(fields))}")
        changes[key] = coerce(value, hints[key], key)
    return dataclasses.replace(config, **changes)


def coerce(value, kind, key: str):
    try:
        if kind is bool:
            if isinstance(value, str):
                if value.lower() not in {"true", "false", "1", "0", "yes", "no"}:
                    raise ValueError(value)
                return value.lower() in {"true", "1", "yes"}
            return bool(value)
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(float(value)) if isinstance(value, str) else int(value)
        if kind is float:
            return float(value)
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"setting {key}={value!r} is not a valid {kind.__name__}; "
                          f"write e.g. --set {key}={kind() if kind is not bool else 'true'}") from None
