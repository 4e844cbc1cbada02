"""`marl eval` and `marl export`: a trained run, after training, in this process (no Dask, no Prefect).

    marl eval RUN_DIR [--checkpoint N] [--episodes E] [--json]
    marl eval RUN_DIR --render team.gif [--render-episodes E] [--render-steps T] [--seed-index S]
    marl export RUN_DIR --out DIR [--checkpoint N] [--seed-index S] [--team T]
"""

from __future__ import annotations

import json
import sys


def _fail(message) -> int:
    from flows.checks import one_line

    print(f"marl: {one_line(message)}", file=sys.stderr)
    return 2


def _load(args):
    """The run restored, or the one-line error (bad input) as an int exit code."""
    from flows import checks

    try:
        checks.check_count("--episodes", getattr(args, "episodes", None), example=32)
        if getattr(args, "render", None):  # a bad path or a missing encoder before the run loads
            from pipelines.render import RenderError, check_output

            checks.check_count("--render-episodes", args.render_episodes, example=2)
            checks.check_count("--render-steps", args.render_steps, example=50)
            checks.check_writable_path(args.render, "--render", directory=False)
            try:
                check_output(args.render)
            except RenderError as e:
                raise checks.InputError(str(e)) from None
        if args.checkpoint is not None and args.checkpoint < 0:
            raise checks.InputError(f"--checkpoint {args.checkpoint} must be a checkpoint step >= 0, e.g. --checkpoint 20")
    except checks.InputError as e:
        return _fail(e)
    from marl.algos import ConfigError
    from marl.envs import EnvError
    from pipelines.saved_run import load_run
    from storage import StoreError

    try:
        return load_run(args.run_dir, args.checkpoint)
    except (StoreError, ConfigError, EnvError) as e:
        return _fail(e)


def _cell(mean: float, interval, spec: str) -> str:
    return f"{mean:{spec}} [{interval[0]:{spec}}, {interval[1]:{spec}}]"


def _format(metric: str) -> str:
    return ".1f" if metric == "length" else ".3f"


def eval_table(report: dict):
    """The rich table of an evaluate_run report: a row per seed, and mean +- std over seeds;
    for a team run a win rate and return column per team, headed by who played it."""
    from rich.table import Table

    metrics = report["metrics"]
    title = (f"{report['algo']} on {report['env_id']}: checkpoint {report['checkpoint']} "
             f"({report['env_steps']:,} env steps), {report['episodes_per_seed']} greedy episodes per seed")
    if report.get("teams"):
        title += "; teams: " + ", ".join(f"{team} {who}" for team, who in report["teams"].items())
    table = Table(title=title)
    table.add_column("seed", justify="right")
    for m in metrics:
        table.add_column(f"{m.replace('_', ' ')} [95% CI]", justify="right")
    for row in report["per_seed"]:
        table.add_row(str(row["seed"]), *(_cell(row[m], row[f"{m}_ci95"], _format(m)) for m in metrics))
    mean = report["mean"]
    if report["n_seeds"] > 1:
        table.add_row("mean +- std", *(f"{mean[m]:{_format(m)}} +- {mean[f'{m}_std']:{_format(m)}} "
                                       f"[{mean[f'{m}_ci95'][0]:{_format(m)}}, {mean[f'{m}_ci95'][1]:{_format(m)}}]"
                                       for m in metrics))
    return table


def cmd_eval(args) -> int:
    run = _load(args)
    if isinstance(run, int):
        return run
    if args.render:
        return _render(run, args)
    from pipelines.saved_run import evaluate_run

    report = evaluate_run(run, args.episodes or run.config.eval_episodes)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from rich.console import Console

    console = Console(markup=False) if sys.stdout.isatty() else Console(width=160, soft_wrap=True, markup=False)
    console.print(eval_table(report))
    return 0


def _render(run, args) -> int:
    import matplotlib

    matplotlib.use("Agg")  # jaxmarl's MPE visualiser draws with pyplot: never open a window
    from pipelines.render import RenderError, render_run

    try:
        done = render_run(run, args.render, args.render_episodes, args.seed_index, args.render_steps)
    except RenderError as e:
        return _fail(e)
    if args.json:
        print(json.dumps(done, indent=2))
        return 0
    episodes = done["episodes"]
    if episodes[0].get("teams"):  # each team's own returns and wins, the fixed opponent's too
        from pipelines.saved_run import players

        outcome = "; ".join(
            f"{team} ({who}) returns {', '.join(format(e['teams'][team]['return'], '.3f') for e in episodes)}, "
            f"won {sum(e['teams'][team]['won'] for e in episodes)}/{len(episodes)}"
            for team, who in players(run).items())
    else:
        outcome = (f"returns {', '.join(format(e['return'], '.3f') for e in episodes)}, "
                   f"won {sum(e['won'] for e in episodes)}/{len(episodes)}")
    print(f"wrote {args.render}: {len(episodes)} greedy episode(s) of {run.config.algo} on {run.config.env_id} "
          f"(checkpoint {run.checkpoint}, seed {args.seed_index}), {done['frames']} frames of "
          f"{done['width']}x{done['height']} at {done['fps']} fps; lengths "
          f"{', '.join(str(e['length']) for e in episodes)}; {outcome}")
    return 0


def cmd_export(args) -> int:
    run = _load(args)
    if isinstance(run, int):
        return run
    from flows import checks
    from storage import StoreError
    from pipelines.saved_run import export_run

    try:
        checks.check_writable_path(args.out, "--out", directory=True)
        paths = export_run(run, args.out, args.seed_index, args.team)
    except (checks.InputError, StoreError) as e:
        return _fail(e)
    team = f"team {args.team} of " if args.team else ""
    print(f"exported {team}{run.config.algo} on {run.config.env_id} (checkpoint {run.checkpoint}, seed {args.seed_index}) "
          f"to {args.out}: {', '.join(p.rsplit('/', 1)[-1] for p in paths)}; load it with marl.load_policy({args.out!r})")
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("eval", help="play a trained run's greedy policy and report win rate, return and length",
                       description="Restore a run's latest (or --checkpoint N) checkpoint, rebuild its env and "
                       "learner from the run's own config, play --episodes greedy episodes per seed on fresh "
                       "envs in this process, and print win rate, return and length per seed (95% intervals "
                       "over episodes) and across seeds (mean +- std, 95% interval over seeds); on a team run "
                       "(train_team=...) each team's own win rate and return, the fixed opponent's too. With "
                       "--render PATH it plays --render-episodes greedy episodes instead and writes them as a GIF "
                       "(or MP4) drawn by the env's own visualiser, every team playing its own policy.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a `marl train` run dir, e.g. runs/qmix-smac")
    p.add_argument("--checkpoint", type=int, help="checkpoint step (iteration) to restore (default: the latest)")
    p.add_argument("--episodes", type=int, help="greedy episodes per seed (default: the run's eval_episodes)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.add_argument("--render", metavar="PATH", help="instead of the table, play --render-episodes greedy "
                   "episodes and write them as a .gif (or .mp4 where ffmpeg is installed) drawn by the env's "
                   "own visualiser (SMAX, MPE, PettingZoo's rgb_array)")
    p.add_argument("--render-episodes", type=int, default=2, help="episodes to render (default 2)")
    p.add_argument("--render-steps", type=int, help="render at most this many env steps per episode "
                   "(default: whole episodes)")
    p.add_argument("--seed-index", type=int, default=0, help="which seed of a --seeds run to render (default 0)")
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("export", help="write a trained run's policy as plain files for marl.load_policy",
                       description="Write one seed's greedy policy of a run (latest or --checkpoint N) into "
                       "--out DIR: policy.json (algorithm and network config), env_spec.json, params.msgpack "
                       "(flax msgpack). marl.load_policy(DIR).act(obs, avail_actions, carry) plays it from "
                       "NumPy, with no Dask, Prefect or replay store.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a `marl train` run dir, e.g. runs/qmix-smac")
    p.add_argument("--out", required=True, help="directory to write the policy files into")
    p.add_argument("--checkpoint", type=int, help="checkpoint step (iteration) to export (default: the latest)")
    p.add_argument("--seed-index", type=int, default=0, help="which seed of a --seeds run (default 0)")
    p.add_argument("--team", help="a team run's team to export: its agents, sizes and params alone, usable as "
                   "--set opponent=DIR in another run. Needed for a train_team=each run (or --team each: one "
                   "policy of every team); a run with train_team=T exports team T")
    p.set_defaults(fn=cmd_export)
