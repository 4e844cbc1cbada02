"""Learning figures on more envs (issue 20): each trains through the whole pipeline (the
`marl-train` flow: embedded Prefect, a local Dask cluster, Zarr replay, checkpoints),
scores a uniform random policy the same way (same env, same evaluator, same episode
count), and draws the learning curve with the random line and the published figure.

    python bench/env_figures.py --figure speaker-listener|adversary|overcooked|overcooked-layouts|hanabi|all
                                [--env-steps N] [--max-wall-s S] [--eval-every K] [--seeds S]

Figures (env-step budgets are for a shared 2-core CPU; see BENCHMARKS.md):
  speaker-listener  MAPPO on mpe:simple_speaker_listener (jaxmarl, heterogeneous agents:
                    speaker 3 actions, listener 5, masked) and on
                    pz:mpe2.simple_speaker_listener_v4 (PettingZoo on CPU workers), same
                    settings (the mappo-pz-spread preset), equal env steps.
  adversary         MADDPG per team (`train_team=each`: one learner for the adversary, one
                    for the two good agents) on continuous-action mpe:simple_adversary,
                    the maddpg-mpe preset's settings.
  overcooked        IPPO on jaxmarl:overcooked, layout cramped_room, JaxMARL's
                    ippo_ff_overcooked settings where our learner has them, its shaped
                    reward too (reward_shaping_horizon 2.5M: trained on reward + coef x
                    the env's shaping term, coef 1 -> 0 over 2.5M env steps; evaluated
                    on the sparse reward).
  overcooked-layouts  the same on jaxmarl's four other layouts (asymm_advantages, coord_ring,
                    forced_coord, counter_circuit), one run each.
  hanabi            MAPPO on jaxmarl:hanabi (2 players), JaxMARL's MAPPO-Hanabi settings
                    scaled down to the budget.

Returns are the pipeline's greedy test returns: per episode, the mean reward of the
(team's) agents summed over the episode, on `eval_episodes` fresh episodes.

Writes bench/results/env_<figure>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402  (bench/report.py)

# --------------------------------------------------------------- the published figures
# Read off the published plots and tables; see BENCHMARKS.md for what each one measures.

PARL_FLUID = ("PaddlePaddle/PARL benchmark/fluid/MADDPG/.benchmark/MADDPG_{}.png "
              "(linked from benchmark/fluid/MADDPG/README.md; commit 3bb5fe36)")

PUBLISHED = {
    "speaker-listener": {
        # PARL's MADDPG on OpenAI's simple_speaker_listener, 25-step episodes; it logs the
        # sum over the 2 agents of their (identical) rewards: per agent, half of it
        "source": PARL_FLUID.format("simple_speaker_listener"),
        "what": "PARL MADDPG, 3 runs, 25k episodes (625k env steps): -28.61, -28.49, -30.51 "
                "(sum over both agents); per agent (our scale) -14.3, -14.2, -15.3",
        "value": -29.2 / 2, "env_steps": 25_000 * 25, "scale": "per agent (PARL's sum / 2)",
    },
    "adversary": {
        # PARL logs the sum over all 3 agents of their episode rewards:
        # adversary + 2 x good agent (the good agents share one reward)
        "source": PARL_FLUID.format("simple_adversary"),
        "what": "PARL MADDPG, 3 runs, 25k episodes (625k env steps): 1.915, 1.52, 1.814 "
                "(sum over all 3 agents' episode rewards)",
        "value": (1.915 + 1.52 + 1.814) / 3, "env_steps": 25_000 * 25,
        "scale": "sum over agents: adversary + 2 x good agent",
    },
    # no number found for these two (BENCHMARKS.md says where we looked): the row says so
    "overcooked": {
        "source": "FLAIROx/JaxMARL baselines/IPPO/config/ippo_ff_overcooked.yaml and ippo_ff_overcooked.py "
                  "(commit c793d095): 5M steps, shaped reward annealed 1 -> 0 over 2.5M",
        "what": "JaxMARL IPPO cramped_room return: no published number found in the sources searched",
        "value": None, "env_steps": 5_000_000, "scale": "sparse return (20 per soup)",
    },
    "overcooked-layouts": {
        "source": "FLAIROx/JaxMARL baselines/IPPO/config/ippo_ff_overcooked.yaml (commit c793d095)",
        "what": "JaxMARL IPPO returns on these layouts: no published number found in the sources searched",
        "value": None, "env_steps": 5_000_000, "scale": "sparse return (20 per soup)",
    },
    "hanabi": {
        "source": "FLAIROx/JaxMARL baselines/MAPPO/config/mappo_homogenous_ff_hanabi.yaml (commit c793d095): "
                  "1e10 steps, 1024 envs x 128 steps",
        "what": "MAPPO 2-player Hanabi score: no published number found in a readable source",
        "value": None, "env_steps": 10_000_000_000, "scale": "score 0-25",
    },
}


# ------------------------------------------------------------------------ the figures

# jaxmarl's Overcooked layouts beside cramped_room (jaxmarl.environments.overcooked.overcooked_layouts)
OTHER_LAYOUTS = ("asymm_advantages", "coord_ring", "forced_coord", "counter_circuit")


def _overcooked(layout: str, args) -> tuple:
    """IPPO on one Overcooked layout, the same settings on every layout."""
    # JaxMARL ippo_ff_overcooked.yaml: 16 envs x 128 steps, lr 2.5e-4 annealed, tanh, 4 epochs
    # x 4 minibatches, clip 0.2, ent 0.01, grad-norm 0.5, 5M steps, REW_SHAPING_HORIZON 2.5M
    # (ippo_ff_overcooked.py: reward + coef x info["shaped_reward"], coef linear 1 -> 0);
    # 32 envs here (fewer, larger updates: the pipeline pays per update); the lr anneals to 0
    # over the run's updates, one per region of 32 x 128 env steps, as JaxMARL's ANNEAL_LR
    env_steps, envs, steps = args.env_steps or 5_000_000, 32, 128
    return (f"IPPO, jaxmarl:overcooked {layout}", "ippo-mpe", "jaxmarl:overcooked", env_steps,
            {"env_kwargs": json.dumps({"layout": layout}), "envs_per_collector": str(envs),
             "steps_per_region": str(steps), "buffer_transitions": "8192", "hidden": "64",
             "activation": "tanh", "lr": "2.5e-4", "epochs": "4", "minibatches": "4",
             "anneal_lr_iterations": str(-(-env_steps // (envs * steps))), "eval_episodes": "32",
             "reward_shaping_horizon": "2500000"})


def _figures(args) -> dict:
    """figure -> list of runs (label, preset, env, env steps, overrides), the metric plotted."""
    return {
        "speaker-listener": {
            "runs": [
                # max_steps 24: jaxmarl's episodes run max_steps + 1 steps, so these are
                # PettingZoo's (and PARL's) 25
                ("MAPPO, jaxmarl mpe:simple_speaker_listener", "mappo-pz-spread",
                 "mpe:simple_speaker_listener", args.env_steps or 1_000_000,
                 {"env_kwargs": json.dumps({"max_steps": 24}), "eval_episodes": "128"}),
                ("MAPPO, PettingZoo pz:mpe2.simple_speaker_listener_v4", "mappo-pz-spread",
                 "pz:mpe2.simple_speaker_listener_v4", args.env_steps or 1_000_000, {"eval_episodes": "128"}),
            ],
            "metric": "test_return", "ylabel": "greedy test return (per agent, 25-step episode)",
        },
        "adversary": {
            "runs": [
                ("MADDPG per team, mpe:simple_adversary (continuous)", "maddpg-mpe",
                 "mpe:simple_adversary", args.env_steps or 640_000,
                 {"train_team": "each",
                  "env_kwargs": json.dumps({"action_type": "Continuous", "max_steps": 24})}),
            ],
            "metric": "parl_sum", "ylabel": "greedy test return, sum over agents (PARL's scale)",
        },
        "overcooked": {
            "runs": [_overcooked("cramped_room", args)],
            "metric": "test_return", "ylabel": "greedy test return (sparse: 20 per soup, 400 steps)",
        },
        "overcooked-layouts": {
            "runs": [_overcooked(layout, args) for layout in OTHER_LAYOUTS],
            "metric": "test_return", "ylabel": "greedy test return (sparse: 20 per soup, 400 steps)",
        },
        "hanabi": {
            "runs": [
                ("MAPPO, jaxmarl:hanabi 2 players", "mappo-smax", "jaxmarl:hanabi",
                 args.env_steps or 3_000_000,
                 # JaxMARL mappo_homogenous_ff_hanabi.yaml: lr 5e-4, relu, 128 units, 4 x 4,
                 # clip 0.2, ent 0.01, grad-norm 0.5 (1024 envs x 128 steps, 1e10 steps)
                 {"envs_per_collector": "64", "steps_per_region": "128", "buffer_transitions": "8192",
                  "hidden": "128", "activation": "relu", "lr": "5e-4", "epochs": "4", "minibatches": "4",
                  "clip_eps": "0.2", "max_grad_norm": "0.5", "anneal_lr_iterations": "0",
                  "eval_episodes": "128"}),
            ],
            "metric": "test_return", "ylabel": "greedy test score (return per game)",
        },
    }


# ------------------------------------------------------------------------ measuring

def machine() -> str:
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    return f"{os.cpu_count()} cores, {cpu}"


def load_average() -> float:
    return os.getloadavg()[0]


def train(label: str, preset: str, env: str, env_steps: int, overrides: dict, run_dir: str,
          eval_every: int, max_wall_s: float) -> dict:
    from flows import train as train_flow

    shutil.rmtree(run_dir, ignore_errors=True)
    commit = _commit()  # the code the run starts with (HEAD may move while it trains)
    rows, started, loads = [], time.perf_counter(), []
    started_utc = time.strftime("%Y-%m-%d %H:%M", time.gmtime())

    def record(row):
        rows.append({**row, "wall_s": time.perf_counter() - started})
        loads.append(load_average())
        if "test_return" in row:
            teams = " ".join(f"{k[5:]}={v:.3f}" for k, v in row.items()
                             if k.startswith("test_") and k.endswith("_return") and k != "test_return")
            print(f"[{label}] {row['env_steps']:>9,} steps {rows[-1]['wall_s']:6.0f} s  "
                  f"test return {row['test_return']:.3f} {teams}", flush=True)

    train_flow.ITERATION_HOOKS.append(record)
    try:
        result = train_flow.marl_train(preset=preset, env=env, env_steps=env_steps, run_dir=run_dir,
                                       overrides={"eval_every": str(eval_every), "max_wall_s": str(max_wall_s),
                                                  **overrides})
    finally:
        train_flow.ITERATION_HOOKS.remove(record)
    keep = lambda r: {k: v for k, v in r.items()  # noqa: E731
                      if k in ("env_steps", "wall_s", "return") or (k.startswith("test_") and not k.endswith("_std"))}
    curve = [keep(r) for r in rows if "test_return" in r]
    return {"label": label, "preset": preset, "env": env, "overrides": overrides, "commit": commit,
            "started_utc": started_utc, "ended_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "env_steps_budget": env_steps, "env_steps": result["env_steps"], "wall_s": result["wall_s"],
            "stopped_by_wall": result["env_steps"] < env_steps, "final_eval": _floats(result["final_eval"]),
            "load_average_mean": sum(loads) / max(len(loads), 1), "curve": curve}


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def _floats(d: dict) -> dict:
    return {k: v for k, v in (d or {}).items() if isinstance(v, (int, float, str, list))}


def random_baseline(preset: str, env: str, overrides: dict, run_dir: str) -> dict:
    """A uniform random policy (over each agent's available actions, or within the action
    bounds), through the same evaluator the flow uses (marl.rollout's, with marl.teams'
    per-team scoring), on the same env and episode count."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marl import envs, rollout, teams
    from pipelines.config import make_run_config

    config = make_run_config(preset, env_id=env, run_dir=run_dir, overrides=overrides)
    made = envs.make(config.env_id, **config.env_kwargs)
    scored, names, score = teams.scoring(made)
    spec = scored.spec

    def act(params, carry, obs, avail, first, key, explore):
        if spec.discrete:
            logits = jnp.where(avail, 0.0, -jnp.inf)
            return jax.random.categorical(key, logits).astype(jnp.int32), carry, {}
        shape = (*obs.shape[:2], spec.action_dim)
        return jax.random.uniform(key, shape, minval=spec.action_low, maxval=spec.action_high), carry, {}

    init_carry = lambda n: jnp.zeros((n, 0))  # noqa: E731
    make = rollout.make_evaluator if spec.backend == "jax" else rollout.make_numpy_evaluator
    evaluate = make(scored, act, init_carry, config.eval_episodes, None, score)
    started = time.perf_counter()
    stats = evaluate(None, jax.random.fold_in(jax.random.PRNGKey(config.seed + 10_000), 0))
    out = {k: np.asarray(v) for k, v in stats.items()}
    result = {"episodes": int(out["episodes"]), "length_mean": float(out["length_mean"]),
              "evaluate_s": time.perf_counter() - started}
    if names:
        for i, team in enumerate(names):
            result[f"{team}_return"] = float(out["return_mean"][i])
            result[f"{team}_win_rate"] = float(out["win_rate"][i])
        result["teams"] = {team: list(agents) for team, agents in made.teams.items()}
    else:
        result["return"] = float(out["return_mean"])
        result["win_rate"] = float(out["win_rate"])
    return result


# --------------------------------------------------------------------------- report

def parl_sum(entry: dict, team_sizes: dict) -> float:
    """PARL's scale for a team run: the sum over agents of their episode rewards."""
    return sum(n * entry[f"{team}_return"] for team, n in team_sizes.items())


def write(figure: str, spec: dict, runs: list[dict], randoms: list[dict], args):
    import numpy as np

    published = PUBLISHED.get(figure)
    metric = spec["metric"]
    commit = runs[0].get("commit") or _commit()  # the code the runs trained with
    ended = runs[-1].get("ended_utc", time.strftime("%Y-%m-%d %H:%M", time.gmtime()))
    date = f"{runs[0].get('started_utc', '')} - {ended}"
    payload = {"figure": figure, "commit": commit, "date_utc": date,
               "machine": machine(), "published": published, "runs": runs, "random": randoms}
    rows = []
    for run, rnd in zip(runs, randoms):
        if metric == "parl_sum":
            sizes = {team: len(agents) for team, agents in rnd["teams"].items()}
            for c in run["curve"]:
                c["parl_sum"] = parl_sum({f"{t}_return": c[f"test_{t}_return"] for t in sizes}, sizes)
            rnd["parl_sum"] = parl_sum(rnd, sizes)
            random_value = rnd["parl_sum"]
        else:
            random_value = rnd["return"]
        values = [c[metric] for c in run["curve"]]
        run["final"], run["best"] = values[-1], max(values)
        run["last3"] = float(np.mean(values[-3:]))
        run["random"] = random_value
        extra = ""
        if metric == "parl_sum":
            last = run["curve"][-1]
            extra = "; ".join(f"{t} {last[f'test_{t}_return']:.2f} (random {rnd[f'{t}_return']:.2f})"
                              for t in rnd["teams"])
        seeds = run["curve"][-1].get(f"{metric}_per_seed") if metric == "test_return" else None
        spread = f" ± {np.std(seeds):.2f} ({' / '.join(f'{v:.0f}' for v in seeds)})" if seeds else ""
        rows.append([run["label"], f"{run['env_steps']:,}" + (" (wall cap)" if run["stopped_by_wall"] else ""),
                     f"{run['final']:.2f}{spread}", f"{run['last3']:.2f}", f"{run['best']:.2f}", f"{random_value:.2f}",
                     extra or "", f"{run['wall_s']:.0f}", f"{run['load_average_mean']:.1f}"])
    if published and published.get("value") is not None:
        rows.append([f"published: {published['what']}", f"{published['env_steps']:,}",
                     f"{published['value']:.2f}", "", "", "", published["scale"], "", ""])
    elif published:
        rows.append([f"published: {published['what']}", f"{published['env_steps']:,}", "n/a", "", "", "",
                     published["scale"], "", ""])
    rows.append(["machine", "", "", "", "", "", payload["machine"], "", ""])
    plt = report.save(f"env_{figure.replace('-', '_')}", payload,
                      ["run", "env steps", "final", "mean of last 3", "best", "random policy", "notes",
                       "wall s", "load avg"],
                      ["---", "---:", "---:", "---:", "---:", "---:", "---", "---:", "---:"], rows)
    teams = metric == "parl_sum"
    fig, axes = plt.subplots(1, 2 if teams else 1, figsize=(13 if teams else 8, 4.5), squeeze=False)
    ax = axes[0][0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if teams:  # each team's own return (its agents' mean reward per episode), beside the sum
        for i, team in enumerate(randoms[0]["teams"]):
            curve = runs[0]["curve"]
            axes[0][1].plot([c["env_steps"] for c in curve], [c[f"test_{team}_return"] for c in curve],
                            color=colors[i + 1], marker=".", label=f"{team} (trained)")
            axes[0][1].axhline(randoms[0][f"{team}_return"], color=colors[i + 1], linestyle=":",
                               label=f"{team}, random policy ({randoms[0][f'{team}_return']:.2f})")
        axes[0][1].set_xlabel("env steps")
        axes[0][1].set_ylabel("greedy test return per team (its agents' mean)")
        axes[0][1].legend(fontsize=7)
    for i, (run, rnd) in enumerate(zip(runs, randoms)):
        ax.plot([c["env_steps"] for c in run["curve"]], [c[metric] for c in run["curve"]],
                color=colors[i], marker=".", label=run["label"])
        if metric == "test_return" and run["curve"][-1].get("test_return_per_seed"):  # the seeds' min-max band
            per_seed = np.array([c["test_return_per_seed"] for c in run["curve"]])
            ax.fill_between([c["env_steps"] for c in run["curve"]], per_seed.min(1), per_seed.max(1),
                            color=colors[i], alpha=0.2)
        ax.axhline(run["random"], color=colors[i], linestyle=":", label=f"random policy ({run['random']:.2f})")
        horizon = int(run["overrides"].get("reward_shaping_horizon", 0) or 0)
        if horizon:  # trained on reward + coef x the env's shaping term, coef 1 -> 0 by here
            ax.axvline(horizon, color=colors[i], linestyle="-.", alpha=0.6,
                       label=f"shaping coefficient 1 -> 0 reaches 0 ({horizon:,} steps)")
    if published and published.get("value") is not None:
        ax.axhline(published["value"], color="k", linestyle="--",
                   label=f"published: {published['value']:.2f} at {published['env_steps']:,} steps")
        if published["env_steps"] <= max(r["env_steps"] for r in runs) * 1.05:
            ax.plot([published["env_steps"]], [published["value"]], "k*", markersize=12)
    ax.set_xlabel("env steps")
    ax.set_ylabel(spec["ylabel"])
    ax.set_title(f"issue 20: {figure} (commit {commit}; shared 2-core CPU)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(report.figure_path(f"env_{figure.replace('-', '_')}"), dpi=110)


def run_figure(figure: str, args):
    spec = _figures(args)[figure]
    runs, randoms = [], []
    for label, preset, env, steps, overrides in spec["runs"]:
        # one run dir per run of the figure (several runs may share an env id: Overcooked's layouts)
        run_dir = os.path.join(args.run_root, figure, re.sub(r"[^\w.-]+", "-", label).strip("-"))
        randoms.append(random_baseline(preset, env, overrides, run_dir))
        print(f"[{label}] random policy: {randoms[-1]}", flush=True)
        if args.seeds > 1:  # vmapped seeds, each on its own envs; the curve is their mean
            label, overrides = f"{label} ({args.seeds} seeds)", {**overrides, "n_seeds": str(args.seeds)}
        runs.append(train(label, preset, env, steps, overrides, run_dir, args.eval_every, args.max_wall_s))
        with open(os.path.join(args.run_root, f"{figure}.json"), "w") as f:  # the raw numbers, for --report-only
            json.dump({"runs": runs, "random": randoms, "command": " ".join(sys.argv)}, f)
    write(figure, spec, runs, randoms, args)


FIGURES = ("speaker-listener", "adversary", "overcooked", "overcooked-layouts", "hanabi")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--figure", required=True, choices=[*FIGURES, "all"])
    parser.add_argument("--env-steps", type=int, default=0, help="per run; 0: the figure's default")
    parser.add_argument("--max-wall-s", type=float, default=450.0, help="per run: stop training after this")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=1, help="vmapped seeds per run (final: mean ± std)")
    parser.add_argument("--run-root", default="runs/bench-env-figures")
    parser.add_argument("--report-only", action="store_true",
                        help="redraw the figure's report from the numbers its last run kept under --run-root")
    args = parser.parse_args()
    report.embedded_prefect(".prefect/bench-env-figures", startup_timeout_s=300)
    figures = list(FIGURES) if args.figure == "all" else [args.figure]
    for figure in figures:
        if args.report_only:
            with open(os.path.join(args.run_root, f"{figure}.json")) as f:
                kept = json.load(f)
            sys.argv = kept["command"].split()
            write(figure, _figures(args)[figure], kept["runs"], kept["random"], args)
        else:
            run_figure(figure, args)


if __name__ == "__main__":
    main()
