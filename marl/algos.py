"""Algorithm registry and config overrides (`--set key=value`)."""

from __future__ import annotations

import dataclasses
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


def config_for(algo: str, overrides: dict | None = None):
    module = module_for(algo)
    defaults = dataclasses.replace(module.Config(), **ALGORITHMS[algo][1])
    return apply_overrides(defaults, overrides or {}, where=algo)


def module_for(algo: str):
    if algo not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm {algo!r}; valid: {', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[algo][0]


def make_learner(algo: str, spec: EnvSpec, config):
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
