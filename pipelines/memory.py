"""How much of the learner's memory its replay takes, and fitting the ring to a budget.

The learner keeps a mirror of the replay ring in memory (marl/buffer.py) and samples from
it thousands of times per region, so the ring must fit beside everything else on the
learner's worker: Dask pauses a worker at 80% of its memory limit and restarts it at 95%.
Before anything is written, a run computes its mirror's bytes from the env spec, the
learner's extra fields, the dtypes and the seeds, and either fits the ring to the budget
(saying so in one line) or refuses in one line with the settings that would fit.

The budget is `replay_memory_fraction` of the learner worker's memory limit (of the
machine's memory where the worker has no limit).
"""

from __future__ import annotations

import dataclasses
import math

from marl.algos import ConfigError
from pipelines.config import RunConfig
from storage import Field

GiB = 2**30
# regions held beside the mirror while one is copied in (the host copy read from Zarr and
# its device copy)
_IN_FLIGHT_REGIONS = 2


@dataclasses.dataclass(frozen=True)
class ReplayMemory:
    """The learner's replay bytes for one run: the mirror, per region, and the budget."""

    region_bytes: int  # one region: T steps x N envs x seeds, every field
    mirror_slots: int  # regions the learner holds (the ring off-policy, one iteration on-policy)
    min_slots: int  # the fewest the run can work with
    budget: int
    memory_limit: int

    @property
    def bytes(self) -> int:
        return (self.mirror_slots + _IN_FLIGHT_REGIONS) * self.region_bytes

    def slots_within_budget(self) -> int:
        return self.budget // self.region_bytes - _IN_FLIGHT_REGIONS


def step_bytes(fields: dict[str, Field]) -> int:
    """Bytes of one env step of one env: every field, all agents."""
    return sum(f.nbytes for f in fields.values())


def replay_memory(config: RunConfig, fields: dict[str, Field], on_policy: bool,
                  learning_starts: int, memory_limit: int) -> ReplayMemory:
    region = step_bytes(fields) * config.steps_per_region * config.envs_per_region
    if on_policy:  # trains once on exactly one iteration's regions
        slots = least = config.n_collectors
    else:  # the whole ring, which must hold the regions in flight and learning_starts
        slots = config.n_slots
        least = max(config.n_collectors * (config.max_policy_lag + 1),
                    -(-learning_starts // config.transitions_per_region))
    return ReplayMemory(region, slots, least, int(config.replay_memory_fraction * memory_limit),
                        int(memory_limit))


def fit_replay(config: RunConfig, memory: ReplayMemory) -> tuple[RunConfig, str | None]:
    """The config with its ring fitted to the budget, and a line saying so (None where it
    fits as asked). Raises ConfigError where not even the smallest workable ring fits."""
    if memory.bytes <= memory.budget:
        return config, None
    least = dataclasses.replace(memory, mirror_slots=memory.min_slots)
    if least.bytes > memory.budget:
        raise ConfigError(_refusal(config, least))
    slots = memory.slots_within_budget()
    fitted = dataclasses.replace(config, buffer_transitions=slots * config.transitions_per_region)
    return fitted, (
        f"replay ring fitted to the learner's memory: {fitted.buffer_transitions:,} transitions per "
        f"seed ({_gib(dataclasses.replace(memory, mirror_slots=slots).bytes)}) instead of "
        f"{config.buffer_transitions:,} ({_gib(memory.bytes)}); {_budget(config, memory)}")


def check_fits(config: RunConfig, memory: ReplayMemory) -> None:
    """Raises ConfigError where the ring as it is (a resumed run's) exceeds the budget."""
    if memory.bytes > memory.budget:
        raise ConfigError(
            f"the replay ring of {config.run_dir} takes {_gib(memory.bytes)} on the learner but "
            f"{_budget(config, memory)}; run on workers with more memory (fewer --workers) or raise "
            f"replay_memory_fraction")


def _refusal(config: RunConfig, least: ReplayMemory) -> str:
    # the largest envs_per_collector whose smallest ring fits, all else equal
    per_env = least.bytes / config.envs_per_collector
    envs = math.floor(least.budget / per_env)
    fix = (f"lower envs_per_collector to {envs}" if envs >= 1 else
           f"lower steps_per_region or n_seeds={config.n_seeds}")
    return (f"the replay of {config.env_id} needs at least {_gib(least.bytes)} on the learner "
            f"({least.min_slots} regions of {config.envs_per_region} envs x {config.steps_per_region} "
            f"steps x {least.region_bytes // (config.envs_per_region * config.steps_per_region):,} B) but "
            f"{_budget(config, least)}; {fix}, or raise replay_memory_fraction")


def _budget(config: RunConfig, memory: ReplayMemory) -> str:
    return (f"its budget is {_gib(memory.budget)} (replay_memory_fraction={config.replay_memory_fraction:g} "
            f"of the worker's {_gib(memory.memory_limit)})")


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"
