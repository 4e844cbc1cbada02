"""Run configuration and presets: what a run is, as plain JSON-able data.

A preset names an algorithm, an env and the run's shape (envs per collector, steps per
region, ring size, evaluation) plus algorithm settings; `--set key=value` overrides either
kind of setting: run settings by their field name, algorithm settings by theirs. The team
settings (`teams`, `train_team`, `opponent`; marl/teams.py) go into `env_kwargs`.
"""

from __future__ import annotations

import dataclasses
import json
import os

from marl import algos
from marl.algos import ConfigError
from marl.teams import FIXED_OPPONENTS, TEAM_SETTINGS


@dataclasses.dataclass(frozen=True)
class RunConfig:
    preset: str
    algo: str
    env_id: str
    env_kwargs: dict = dataclasses.field(default_factory=dict)
    total_env_steps: int = 1_000_000
    n_collectors: int = 1
    envs_per_collector: int = 32  # N, one env chunk per collector region
    steps_per_region: int = 32  # T, the step chunk; one collect call fills one region
    # replay ring capacity in transitions (env steps) per seed, rounded down to whole regions;
    # fitted to the learner's memory budget when the run starts (pipelines/memory.py)
    buffer_transitions: int = 1_000_000
    # the learner's replay mirror may take this fraction of its worker's memory limit
    replay_memory_fraction: float = 0.5
    eval_every: int = 20  # iterations between greedy evaluations (and at the end)
    eval_episodes: int = 128
    # every this many evaluations the flow draws one short greedy episode of the checkpoint
    # at that iteration as a GIF artifact (pipelines/render.py; 0: never; the last evaluation's too)
    render_every: int = 0
    checkpoint_every: int = 20  # iterations between checkpoints (and at the end)
    seed: int = 0
    # independent seeds trained side by side (vmap): seed s gets envs [s*N, (s+1)*N) of
    # every region, and env steps count per seed
    n_seeds: int = 1
    # K: collectors act with params at most K learner versions old (collect(i) uses version
    # i - K); 0 is the lock-step schedule (collect, then train), reproducible bit for bit
    max_policy_lag: int = 0
    max_wall_s: float = 0.0  # stop iterating after this many seconds (0: no limit)
    # fault injection, to exercise retries: collect tasks of these region ids ("3,5") raise
    # once, right after their region is committed
    fail_regions_once: str = ""
    run_dir: str = "runs/qmix-smac"
    algo_overrides: dict = dataclasses.field(default_factory=dict)

    @property
    def steps_per_iteration(self) -> int:
        return self.n_collectors * self.envs_per_collector * self.steps_per_region

    @property
    def envs_per_region(self) -> int:
        return self.envs_per_collector * self.n_seeds

    @property
    def n_iterations(self) -> int:
        return max(1, -(-self.total_env_steps // self.steps_per_iteration))

    @property
    def n_slots(self) -> int:
        # room for every region written before the learner reads it: those of the iteration
        # it trains on and of the K after it, which may be collected meanwhile
        return max(self.n_collectors * (self.max_policy_lag + 1),
                   self.buffer_transitions // self.transitions_per_region)

    @property
    def transitions_per_region(self) -> int:
        """Env steps of one seed in one region."""
        return self.envs_per_collector * self.steps_per_region

    @property
    def store_path(self) -> str:
        return os.path.join(self.run_dir, "replay")

    @property
    def checkpoint_dir(self) -> str:
        return os.path.abspath(os.path.join(self.run_dir, "checkpoints"))

    def algo_config(self):
        return algos.config_for(self.algo, self.algo_overrides)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


# QMIX's ring: 1M transitions per seed (PyMARL and PARL keep 5,000 episodes, ~300k transitions
# on these maps), so a 1M-step 3m run overwrites nothing (a 131k ring measured 0.03-0.06 better
# mid-run, inside the seeds' spread); larger maps get the ring fitted to the learner's memory
# (memory.py). 32 updates of 32 windows x 16 steps per 1,024 env steps sample each env step
# 16 times; at 64 (pymarl's 32 samples) 3m met its target (0.911 +- 0.012 by 1M) but no 2s3z
# seed won by 0.9M, so the preset stays at 32 until 8m and 2s3z decide (BENCHMARKS.md).
# The mixer starts small (its kernels at 0.1x Flax's init): at Flax's own init its state terms
# grew to several times the returns, and QMIX never won 3s5z (0.02 at 6M, 3 seeds) and lost
# one 2s3z seed of three; started small, 0.9 on both by 0.45M and ahead on 3m (BENCHMARKS.md)
_QMIX_SMAC = dict(
    algo="qmix", env_id="smax:3m", total_env_steps=2_500_000, n_collectors=1,
    envs_per_collector=32, steps_per_region=32, buffer_transitions=1_000_000,
    eval_every=10, checkpoint_every=20,
    algo_overrides=dict(updates_per_region=32, seq_len=16, eps_end=0.01, eps_decay_steps=50_000,
                        td_lambda=0.6, last_action=True, mixer_init_scale=0.1),
)

_MAPPO_MPE = dict(
    algo="mappo", env_id="mpe:simple_spread", total_env_steps=2_000_000, n_collectors=1,
    envs_per_collector=128, steps_per_region=128, buffer_transitions=131_072,
    eval_every=10, checkpoint_every=20,
    # 8 epochs where JaxMARL's MAPPO-MPE has 4: more return per env step (BENCHMARKS.md)
    algo_overrides=dict(hidden=128, activation="relu", lr=2e-3, anneal_lr_iterations=123,
                        epochs=8, minibatches=4, clip_eps=0.2, ent_coef=0.01,
                        max_grad_norm=0.5),
)

_MADDPG_MPE = dict(
    algo="maddpg", env_id="mpe:simple_spread",
    env_kwargs={"action_type": "Continuous", "max_steps": 24}, total_env_steps=2_500_000,
    envs_per_collector=64, steps_per_region=50, buffer_transitions=102_400,
    eval_every=10, eval_episodes=128, checkpoint_every=20,
    algo_overrides=dict(updates_per_region=32, learning_starts=25_600, time_limit_bootstrap=True,
                        twin_critics=True, actor_every=2, actor_lr=3e-3, critic_lr=3e-3,
                        gamma=0.8, n_step=5),
)

PRESETS: dict[str, dict] = {
    # tuned on a 2-core CPU (BENCHMARKS.md): greedy test win rate 0.84 +- 0.04 on 3m at 1M env
    # steps over 3 seeds (0.75-0.83 without last_action, which learns slower early: 0.31 against
    # 0.48 at 98k). Env steps are nearly free here, so one update per 32 collected steps, short
    # windows and a low final epsilon buy the most.
    "qmix-smac": _QMIX_SMAC,
    # qmix-smac sized for an accelerator: 4,096 envs a region (131k env steps) and 4,096
    # updates a region, the preset's replay ratio (one update per 32 env steps). On a TPU v5e
    # its plain loop is learner-bound (86k env steps/s) and the stages ran at 0.90x (K = 0)
    # and 1.32x (K = 1) of it, greedy test win 0.75-0.81 at 1M env steps, seed 0
    # (BENCHMARKS.md, the device check's seventh sitting)
    "qmix-smac-accel": {**_QMIX_SMAC, "envs_per_collector": 4_096,
                        "algo_overrides": {**_QMIX_SMAC["algo_overrides"], "updates_per_region": 4_096}},
    # QMIX's relatives on the same settings: only the mixer differs
    "vdn-smax": {**_QMIX_SMAC, "algo": "vdn"},
    "iql-smax": {**_QMIX_SMAC, "algo": "iql"},
    # a few thousand steps end to end, for tests and smoke runs
    "qmix-smac-tiny": dict(
        algo="qmix", env_id="smax:3m", total_env_steps=4_096, n_collectors=2,
        envs_per_collector=8, steps_per_region=32, buffer_transitions=16_384,
        eval_every=2, eval_episodes=16, checkpoint_every=2,
        algo_overrides=dict(hidden=16, mixer_embed=8, hypernet_embed=16, batch_size=8,
                            seq_len=8, updates_per_region=2, learning_starts=256,
                            eps_decay_steps=2_000),
    ),
    # MAPPO/IPPO (marl/mappo.py): one PPO update (epochs x minibatches over envs) per
    # collect of N envs x T steps, JaxMARL's MAPPO-MPE shape (128 x 128, 2M steps, lr 2e-3
    # annealed over the run); BENCHMARKS.md compares it with a single-process reference
    "mappo-mpe": _MAPPO_MPE,
    # IPPO: the same settings with per-agent critics on local observations
    "ippo-mpe": {**_MAPPO_MPE, "algo": "ippo"},
    # JaxMARL's SMAX PPO network and step (relu, 128 units, grad-norm 0.25, lr 2e-3 annealed
    # to 0 over the run: with a constant lr the greedy win rate kept swinging), 64 envs x 128
    # steps per update, with MAPPO's (Yu et al.) passes over each batch for SMAC: 15 epochs of
    # one full-batch step, clip 0.2, entropy 0.001. Against JaxMARL's 4 x 4, clip 0.05,
    # entropy 0.01, over 3 seeds (BENCHMARKS.md, "smax_maps on the device"): 3m 0.865 against
    # 0.836 at 1M, 8m the same 0.82 at 2M, 0.9 on 2s3z at 0.29M against 0.74M, 0.8 on 3s5z at
    # 0.44M against 1.03M
    "mappo-smax": dict(
        algo="mappo", env_id="smax:3m", total_env_steps=3_000_000, n_collectors=1,
        envs_per_collector=64, steps_per_region=128, buffer_transitions=65_536,
        eval_every=10, checkpoint_every=20,
        algo_overrides=dict(hidden=128, activation="relu", lr=2e-3, anneal_lr_iterations=367,
                            epochs=15, minibatches=1, clip_eps=0.2, ent_coef=0.001,
                            max_grad_norm=0.25),
    ),
    # PettingZoo's simple_spread stepped in numpy on CPU workers, same learner as mappo-mpe
    "mappo-pz-spread": dict(
        algo="mappo", env_id="pz:mpe2.simple_spread_v3", total_env_steps=500_000, n_collectors=2,
        envs_per_collector=32, steps_per_region=128, buffer_transitions=32_768,
        eval_every=10, eval_episodes=32, checkpoint_every=20,
        algo_overrides=dict(hidden=128, activation="relu", lr=2e-3, epochs=4, minibatches=4,
                            clip_eps=0.2, ent_coef=0.01, max_grad_norm=0.5),
    ),
    # mappo-mpe sized for an accelerator: 4,096 envs a region (524k env steps), 20 iterations;
    # the shape the TPU v5e measured (BENCHMARKS.md, the device check's fourth sitting): plain
    # loop 1.4M env steps/s, the stages 0.64-0.82x of it, greedy test return -12.6 to -13.2
    # at the end (the lr anneals over mappo-mpe's 123 iterations, so it ends at 84%)
    "mappo-mpe-accel": {**_MAPPO_MPE, "envs_per_collector": 4_096, "total_env_steps": 10_485_760,
                        "buffer_transitions": 524_288},
    # a few thousand steps end to end, for tests and smoke runs
    "mappo-mpe-tiny": dict(
        algo="mappo", env_id="mpe:simple_spread", total_env_steps=1_024, n_collectors=2,
        envs_per_collector=8, steps_per_region=16, buffer_transitions=512,
        eval_every=2, eval_episodes=8, checkpoint_every=2,
        algo_overrides=dict(hidden=16, epochs=2, minibatches=2),
    ),
    # MADDPG (marl/maddpg.py) on continuous-action simple spread, PARL's MADDPG MPE setup
    # (tau 0.01, batch 1024, 64-unit MLPs, ~1e5-transition replay, learning after 25.6k
    # steps, one update per 100 env steps: 32 per 64 x 50 region) but with TD3's twin
    # critics and delayed actor steps (as MATD3), lr 3e-3 where PARL has 1e-2, and gamma 0.8
    # with 5-step returns where PARL has gamma 0.95 and one-step targets (the agents then
    # travel to the landmarks faster): -43.5 +- 1.9 over 5 seeds against -58.4 +- 2.0 with
    # PARL's settings and PARL's own -50 (PARL 2022 convention, 2.5M env steps,
    # BENCHMARKS.md). MPE episodes end only at the time limit, so the critic bootstraps
    # through it.
    # max_steps=24: jaxmarl's episodes run max_steps + 1 steps, so these are PARL's 25
    "maddpg-mpe": _MADDPG_MPE,
    # the same on PARL 2022's task (PettingZoo simple_spread with local_ratio=0): every
    # agent is rewarded -(sum of landmark-to-nearest-agent distances), no collision term
    "maddpg-mpe-parl": {**_MADDPG_MPE, "env_kwargs": {**_MADDPG_MPE["env_kwargs"], "local_ratio": 0.0}},
    # maddpg-mpe sized for an accelerator: 4,096 envs a region (205k env steps) and 2,048
    # updates a region, the preset's replay ratio (one update per 100 env steps), in a ring of
    # 4 regions. On a TPU v5e its plain loop is learner-bound (~900 updates/s) and the stages
    # ran at 0.96x (K = 0) and 1.10x (K = 1) of it, against 0.20x at maddpg-mpe's 64 envs
    # (BENCHMARKS.md, the device check's seventh sitting); its learning against maddpg-mpe at
    # equal env steps is not measured
    "maddpg-mpe-accel": {**_MADDPG_MPE, "envs_per_collector": 4_096, "buffer_transitions": 819_200,
                         "algo_overrides": {**_MADDPG_MPE["algo_overrides"], "updates_per_region": 2_048}},
    # a few thousand steps end to end, for tests and smoke runs
    "maddpg-mpe-tiny": dict(
        algo="maddpg", env_id="mpe:simple_spread",
        env_kwargs={"action_type": "Continuous", "max_steps": 24}, total_env_steps=1_600,
        n_collectors=2, envs_per_collector=8, steps_per_region=25, buffer_transitions=1_600,
        eval_every=2, eval_episodes=8, checkpoint_every=2,
        algo_overrides=dict(hidden=16, batch_size=64, updates_per_region=2, learning_starts=200,
                            time_limit_bootstrap=True, twin_critics=True, actor_every=2,
                            gamma=0.8, n_step=3),
    ),
}


# Regions smaller than this leave an accelerator idle between the stages' Dask round trips:
# on a TPU v5e (BENCHMARKS.md, the device check on a TPU v5e) MAPPO's 128 x 128 regions (16k
# env steps) ran the stages at 0.10x the plain fused loop and MADDPG's 64 x 50 at 0.20x, while
# QMIX's 4,096 x 32 (131k) ran at 0.88-0.89x, MADDPG's 4,096 x 50 (205k) at 0.96-1.10x and
# MAPPO's 4,096 x 128 (524k) at 0.84x (K = 1).
ACCELERATOR_REGION_STEPS = 131_072


def accelerator_hint(config: RunConfig) -> str | None:
    """What to change when a run whose regions are sized for a CPU meets an accelerator, in
    one line; None where its regions are already large enough."""
    if config.transitions_per_region >= ACCELERATOR_REGION_STEPS:
        return None
    envs = 1 << (-(-ACCELERATOR_REGION_STEPS // config.steps_per_region) - 1).bit_length()
    sized = sorted(name for name, p in PRESETS.items() if name.startswith(config.preset + "-accel"))
    off_policy = hasattr(config.algo_config(), "updates_per_region")
    return (f"an accelerator is visible and preset {config.preset}'s regions are {config.envs_per_collector} envs "
            f"x {config.steps_per_region} steps, sized for a CPU (the stages then run at about 0.1x a plain loop "
            f"there); use {''.join(name + ' or ' for name in sized)}--set envs_per_collector={envs}"
            + (" with updates_per_region or batch_size scaled to keep the replay ratio" if off_policy else ""))


def make_run_config(preset: str, *, env_id: str | None = None, total_env_steps: int | None = None,
                    n_collectors: int | None = None, seed: int | None = None,
                    run_dir: str | None = None, overrides: dict | None = None) -> RunConfig:
    """Preset + explicit arguments + `key=value` overrides -> a checked RunConfig."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; valid: {', '.join(sorted(PRESETS))}")
    base = dict(PRESETS[preset])
    run_fields = {f.name for f in dataclasses.fields(RunConfig)} - {"preset", "algo_overrides"}
    algo_overrides = dict(base.pop("algo_overrides", {}))
    run_values = dict(base)
    algo_fields = {f.name for f in dataclasses.fields(algos.module_for(base["algo"]).Config)}
    team = {}  # marl.teams' settings travel in env_kwargs: every maker of the run's env gets them
    for key, value in (overrides or {}).items():
        if key in algo_fields:
            algo_overrides[key] = value
        elif key in run_fields:
            run_values[key] = value
        elif key in TEAM_SETTINGS:
            team[key] = value
        else:
            raise ConfigError(f"unknown setting {key!r} for preset {preset}; valid: "
                              f"{', '.join(sorted(run_fields | algo_fields | set(TEAM_SETTINGS)))}")
    explicit = dict(env_id=env_id, total_env_steps=total_env_steps, n_collectors=n_collectors,
                    seed=seed, run_dir=run_dir)
    run_values.update({k: v for k, v in explicit.items() if v is not None})
    run_values.setdefault("run_dir", os.path.join("runs", preset))
    hints = {f.name: f.type for f in dataclasses.fields(RunConfig)}
    for key, value in list(run_values.items()):
        kind = {"int": int, "float": float, "str": str, "dict": dict}.get(hints[key], str)
        if kind is dict:
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError:
                    raise ConfigError(f"setting {key}={value!r} is not JSON; write e.g. "
                                      f"--set {key}='{{\"max_steps\": 50}}'") from None
            run_values[key] = value
        else:
            run_values[key] = algos.coerce(value, kind, key)
    if team and isinstance(run_values.get("env_kwargs", {}), dict):
        if team.get("opponent") and str(team["opponent"]) not in FIXED_OPPONENTS:
            team["opponent"] = os.path.abspath(str(team["opponent"]))  # the workers' cwd may differ
        run_values["env_kwargs"] = {**run_values.get("env_kwargs", {}), **team}
    if "decoupled_clip" in algo_fields and "decoupled_clip" not in algo_overrides:
        # PPO on regions that older params acted on clips around the policy at each update's
        # start (at max_policy_lag 1-2 it kept MAPPO's return at K = 0's, BENCHMARKS.md); at
        # K = 0 the acting policy is that policy, and the update stays exactly plain PPO
        algo_overrides["decoupled_clip"] = int(run_values.get("max_policy_lag", 0)) > 0
    config = RunConfig(preset=preset, algo_overrides=algo_overrides, **run_values)
    for key in ("total_env_steps", "n_collectors", "envs_per_collector", "steps_per_region", "n_seeds",
                "buffer_transitions", "eval_every", "eval_episodes", "checkpoint_every"):
        if getattr(config, key) < 1:
            example = PRESETS[preset].get(key, getattr(RunConfig, key))
            raise ConfigError(f"setting {key}={getattr(config, key)} must be >= 1; e.g. --set {key}={example}")
    if not 0 < config.replay_memory_fraction <= 1:
        raise ConfigError(f"setting replay_memory_fraction={config.replay_memory_fraction} must be in "
                          "(0, 1]: the share of the learner worker's memory its replay may take")
    if config.render_every < 0:
        raise ConfigError(f"setting render_every={config.render_every} must be >= 0 (0: no GIFs; N: every "
                          "N-th evaluation's policy drawn as a GIF artifact); e.g. --set render_every=5")
    if config.max_policy_lag < 0:
        raise ConfigError(f"setting max_policy_lag={config.max_policy_lag} must be >= 0 "
                          "(0: lock-step; K: collectors act with params up to K versions old)")
    algo_config = config.algo_config()  # checks the algorithm overrides
    seq_len = getattr(algo_config, "seq_len", None)
    window = (seq_len or 0) + getattr(algo_config, "burn_in", 0)
    if seq_len is not None and window > config.steps_per_region:
        raise ConfigError(f"burn_in + seq_len = {window} exceeds steps_per_region={config.steps_per_region}; "
                          "a window crosses at most one region boundary, so raise steps_per_region "
                          "or lower seq_len / burn_in")
    n_step = getattr(algo_config, "n_step", None)
    if n_step is not None and not 1 <= n_step < config.steps_per_region:
        raise ConfigError(f"n_step={n_step} must be at least 1 and below steps_per_region="
                          f"{config.steps_per_region}: a window crosses at most one region boundary")
    # the rest would only fail inside a task, after the cluster started, or train nonsense
    if not 0 <= config.seed <= SEED_MAX:
        raise ConfigError(f"setting seed={config.seed} must be in 0..{SEED_MAX}; e.g. --seed 0")
    if not 0 <= config.max_wall_s < float("inf"):
        raise ConfigError(f"setting max_wall_s={config.max_wall_s} must be >= 0 seconds (0: no limit); "
                          "e.g. --set max_wall_s=3600")
    if not all(r.strip().isdigit() for r in config.fail_regions_once.split(",") if r.strip()):
        raise ConfigError(f"setting fail_regions_once={config.fail_regions_once!r} must list region "
                          "ids, e.g. --set fail_regions_once=3,5")
    if not isinstance(config.env_kwargs, dict):
        raise ConfigError(f"setting env_kwargs={config.env_kwargs!r} must be a JSON object; "
                          "e.g. --set env_kwargs='{\"max_steps\": 50}'")
    minibatches = getattr(algo_config, "minibatches", None)
    envs_per_update = config.n_collectors * config.envs_per_collector
    if minibatches is not None and envs_per_update % minibatches:
        raise ConfigError(f"minibatches={minibatches} does not divide the {envs_per_update} envs of one "
                          f"update (n_collectors={config.n_collectors} x envs_per_collector="
                          f"{config.envs_per_collector}); pick a divisor, e.g. --set minibatches=1")
    return config


SEED_MAX = 2_000_000_000  # within jax's 32-bit seeds, with room for the evaluation offset
