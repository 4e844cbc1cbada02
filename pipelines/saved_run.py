"""A finished (or stopped) run, in this process: its learner restored from a checkpoint,
greedy evaluation, and export of its policy. No Dask, no Prefect.

    run = load_run("runs/qmix-smac", checkpoint=None)     # latest checkpoint
    report = evaluate_run(run, episodes=32)               # per seed and across seeds
    export_run(run, "exported/qmix-3m")                   # marl.load_policy(...) reads it

The env and learner are rebuilt from the run's own config (the replay store's "config"
attribute) exactly as the training stages build them (stages.RunParts).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from marl import algos
from marl import policy as policies
from marl import rollout, teams
from pipelines import stages
from pipelines.config import RunConfig
from storage import Checkpointer, ReplayStore, StoreError

METRICS = ("win_rate", "return", "length")


@dataclasses.dataclass
class SavedRun:
    config: RunConfig
    parts: stages.RunParts
    checkpoint: int  # the step (iteration) restored
    meta: dict  # the checkpoint's metadata (iteration, env_steps, ...)
    params: dict  # policy params of every seed, [S, ...] where n_seeds > 1
    train_state: dict | None = None  # the whole restored learner state (e.g. QMIX's mixer)


def _listing(path: str) -> str:
    entries = sorted(os.listdir(path)) if os.path.isdir(path) else []
    more = f" and {len(entries) - 8} more" if len(entries) > 8 else ""
    return ", ".join(entries[:8]) + more if entries else "nothing"


def load_run(run_dir: str, checkpoint: int | None = None) -> SavedRun:
    """The run in `run_dir` at `checkpoint` (latest if None); StoreError (one line, saying
    what exists) for a dir that is not a run or a checkpoint it does not have."""
    if not os.path.isdir(run_dir):
        raise StoreError(f"run dir {run_dir} does not exist; pass the --run-dir of a `marl train` run "
                         f"(default runs/PRESET)")
    store_path = os.path.join(run_dir, "replay")
    try:
        attrs = ReplayStore.open(store_path).attrs
        config = RunConfig(**{**attrs["config"], "run_dir": os.path.abspath(run_dir)})
    except (StoreError, KeyError, TypeError):
        raise StoreError(f"{run_dir} is not a run dir: no readable replay store with a run config at "
                         f"{store_path} (it holds: {_listing(run_dir)}); pass the --run-dir of a "
                         "`marl train` run") from None
    if not os.path.isdir(config.checkpoint_dir):  # (a Checkpointer would make the dir)
        raise StoreError(f"{run_dir} has no checkpoint yet (it holds: {_listing(run_dir)}); "
                         "train it longer (checkpoint_every)")
    with Checkpointer(config.checkpoint_dir) as checkpoints:
        checkpoint = checkpoints.step_to_restore(checkpoint)
        parts = stages.RunParts.build(config)
        target = stages._to_numpy(parts.learner.init(jax.random.PRNGKey(config.seed)))
        state, meta = checkpoints.restore(checkpoint, target=target)
    state = jax.tree.map(jnp.asarray, state)
    params = stages._to_numpy(parts.learner.policy_params(state))
    return SavedRun(config, parts, int(checkpoint), meta, params, state)


def seed_params(run: SavedRun, seed: int, tree=None):
    """One seed's policy params (or of `tree`, any of the run's trees with a leading seed axis
    where n_seeds > 1, e.g. its train state's)."""
    tree = run.params if tree is None else tree
    if run.config.n_seeds == 1:
        return tree
    return jax.tree.map(lambda p: p[seed], tree)


def metrics_of(run: SavedRun) -> tuple[str, ...]:
    """What evaluate_run reports: win rate, return and length; for a team run each team's
    own win rate and return (`<team>_win_rate`, `<team>_return`, the fixed opponent's too) and
    the length."""
    scores = teams.team_scores(run.parts.env)
    if scores is None:
        return METRICS
    return (*(f"{team}_{m}" for team in scores[1] for m in ("win_rate", "return")), "length")


def _episode_player(run: SavedRun):
    """(params, key, episodes) -> {metric: [episode]} of greedy episodes on fresh envs (see
    metrics_of): the stages' evaluator for one env, vmapped over episodes (JAX envs) or
    looped (PettingZoo envs, stepped in NumPy). Made once per run: one compile for every seed."""
    learner = run.parts.single_seed
    env, names, score = teams.scoring(run.parts.env)
    if env.spec.backend == "jax":
        evaluate = jax.jit(jax.vmap(rollout.make_evaluator(env, learner.act, learner.init_carry, 1, learner.greedy,
                                                           score), in_axes=(None, 0)))
        play = lambda params, keys: {k: np.asarray(v) for k, v in evaluate(params, keys).items()}
    else:
        evaluate = rollout.make_numpy_evaluator(env, learner.act, learner.init_carry, 1, learner.greedy, score)

        def play(params, keys):
            runs = [evaluate(params, k) for k in keys]
            return {k: np.array([np.asarray(r[k], float) for r in runs]) for k in runs[0]}

    def episodes(params, key, n: int) -> dict[str, np.ndarray]:
        stats = play(params, jax.random.split(key, n))
        out = {"length": stats["length_mean"].astype(float)}
        if not names:
            return {"win_rate": stats["win_rate"].astype(float), "return": stats["return_mean"].astype(float), **out}
        for i, team in enumerate(names):  # [episode, team]
            out[f"{team}_win_rate"] = stats["win_rate"][:, i].astype(float)
            out[f"{team}_return"] = stats["return_mean"][:, i].astype(float)
        return out

    return episodes


def _interval(values: np.ndarray) -> tuple[float, float]:
    """The 95% t-interval of the mean of `values` (a point where there is one value)."""
    from scipy import stats

    mean = float(values.mean())
    if len(values) < 2:
        return mean, mean
    half = float(stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values)))
    return mean - half, mean + half


def evaluate_run(run: SavedRun, episodes: int, seed: int = 0) -> dict:
    """Greedy play of `episodes` fresh episodes per trained seed.

    Per seed: the mean of each metric (metrics_of) over its episodes with a 95% interval
    over episodes. Across seeds: the mean and std of the seed means, with a 95% interval over
    seeds (over all episodes where the run has one seed). A team run's report also says
    who played each team ("teams")."""
    metrics = metrics_of(run)
    key = jax.random.PRNGKey(run.config.seed + 20_000 + seed)
    per_seed, pooled = [], {m: [] for m in metrics}
    play = _episode_player(run)
    for s in range(run.config.n_seeds):
        values = play(seed_params(run, s), jax.random.fold_in(key, s), episodes)
        row = {"seed": s}
        for m in metrics:
            row[m] = float(values[m].mean())
            row[f"{m}_ci95"] = list(_interval(values[m]))
            pooled[m].append(values[m])
        per_seed.append(row)
    means = {m: np.array([r[m] for r in per_seed]) for m in metrics}
    overall = {}
    for m in metrics:
        overall[m] = float(means[m].mean())
        overall[f"{m}_std"] = float(means[m].std())
        spread = means[m] if len(per_seed) > 1 else np.concatenate(pooled[m])
        overall[f"{m}_ci95"] = list(_interval(spread))
    c = run.config
    return {"run_dir": c.run_dir, "preset": c.preset, "env_id": c.env_id, "algo": c.algo,
            "checkpoint": run.checkpoint, "env_steps": int(run.meta.get("env_steps", 0)),
            "episodes_per_seed": episodes, "n_seeds": c.n_seeds, "metrics": list(metrics),
            **({"teams": players(run)} if metrics != METRICS else {}), "per_seed": per_seed, "mean": overall}


def players(run: SavedRun) -> dict[str, str]:
    """{team: who played it}: "trained" or the fixed opponent (random, noop or a policy dir)."""
    kwargs = run.config.env_kwargs
    trained = kwargs.get("train_team")
    return {team: "trained" if trained in (teams.EACH, team) else f"opponent={kwargs.get('opponent') or 'random'}"
            for team in run.parts.env.teams}


def _team_policy(run: SavedRun, team: str | None, seed: int):
    """(learner, seed `seed`'s params) of what `marl export --team` writes: the run's learner,
    or one team's of a train_team=each run; StoreError (one line, naming the teams) otherwise."""
    learner, env = run.parts.single_seed, run.parts.env
    trained = run.config.env_kwargs.get("train_team")
    names = ", ".join(env.teams)
    if learner.spec.teams:  # train_team=each: one learner per team
        if team == teams.EACH:
            return learner, seed_params(run, seed)
        entry = next((t for t in learner.spec.teams if t[0] == team), None)
        if entry is None:
            either = " or ".join(f"--team {t[0]}" for t in learner.spec.teams)
            said = "" if team is None else f"has no team {team!r}: it "
            raise StoreError(f"this run {said}trains teams {names} (train_team={teams.EACH}); pass {either} for one "
                             f"team's policy (usable as opponent=DIR), or --team {teams.EACH} for one policy of them all")
        one = algos.make_learner(run.config.algo, teams.team_spec(learner.spec, entry), learner.config)
        return one, seed_params(run, seed)[team]
    if team is None or team == trained or (not trained and [team] == list(env.teams)):
        return learner, seed_params(run, seed)
    if team not in env.teams:
        raise StoreError(f"--team {team}: the run's env has no such team (its teams: {names}); drop --team "
                         "to export what trained")
    if trained:
        raise StoreError(f"--team {team}: that team did not train in this run (it played the fixed "
                         f"{players(run)[team]}); only team {trained} trained: pass --team {trained} or drop --team")
    raise StoreError(f"--team {team}: this run trained its teams {names} as one (no train_team), so no team's "
                     "policy stands apart; drop --team")


def export_run(run: SavedRun, out: str, seed: int = 0, team: str | None = None) -> list[str]:
    """Writes seed `seed`'s policy as marl.policy files into `out`; returns their paths. On a
    team run: the trained team's (`team` may name it), or of a train_team=each run the team
    `team` (its agents, sizes and params alone) or every team (`team="each"`)."""
    if not 0 <= seed < run.config.n_seeds:
        raise StoreError(f"the run has seeds 0..{run.config.n_seeds - 1}, not {seed}; pass one of those")
    learner, params = _team_policy(run, team, seed)
    c = run.config
    source = {"run_dir": c.run_dir, "checkpoint": run.checkpoint, "seed": seed, "env_id": c.env_id,
              "env_kwargs": c.env_kwargs, "env_steps": int(run.meta.get("env_steps", 0)), "preset": c.preset,
              **({"team": team} if team else {})}
    return policies.save_policy(out, c.algo, learner.config, learner.spec, params, source)
