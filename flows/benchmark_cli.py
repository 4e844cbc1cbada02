"""`marl benchmark`: run the benchmark suites on the embedded default (Prefect without a server)."""

from __future__ import annotations

import os


def cmd_benchmark(args) -> int:
    import math

    from flows import checks
    from flows.cli import (Terminated, _embedded_defaults, fail, migrate_embedded_home, quiet_reported_failures,
                           start_embedded_server, stopped_by)

    try:  # the cheap checks first: no import of JAX or Prefect for a typo
        checks.check_count("--env-steps", args.env_steps, example=100_000)
        checks.check_count("--workers", args.workers)
        if args.max_wall_s is not None and not (0 < args.max_wall_s < math.inf):
            raise checks.InputError(f"--max-wall-s {args.max_wall_s} must be > 0 seconds; e.g. --max-wall-s 600")
        checks.check_scheduler(args.scheduler)
        if not args.list:
            checks.check_writable_path(args.results_dir, "--results-dir", directory=True)
    except checks.InputError as e:
        return fail(e)
    _embedded_defaults()  # before prefect is imported
    from rich.console import Console
    from rich.table import Table

    from flows import benchmark
    from marl.algos import ConfigError

    console = Console()
    names = [n for item in args.suites or [] for n in item.split(",") if n] or None
    if args.list:
        from pipelines.config import PRESETS

        for s in benchmark.SUITES.values():
            notes = ("" if s.nightly else "  (not nightly)") + ("" if s.preset in PRESETS else "  (no such preset yet)")
            print(f"{s.name:18s} {s.preset:16s} {s.env_id:18s} {s.metric:14s} {s.env_steps:>9,} env steps{notes}")
        return 0
    try:  # fail fast, before any cluster or server starts
        benchmark.select_suites(names)
    except ConfigError as e:
        return fail(e)
    migrate_embedded_home()
    start_embedded_server()
    quiet_reported_failures()  # its crash lines too: a stop is said in the one line below
    try:
        out = benchmark.marl_benchmark(suites=names, env_steps=args.env_steps, max_wall_s=args.max_wall_s,
                                       results_dir=args.results_dir, scheduler_address=args.scheduler,
                                       n_workers=args.workers)
    except (ConfigError, RuntimeError, ValueError) as e:
        return fail(e, code=1)
    except (KeyboardInterrupt, Terminated) as e:  # stopped from outside: one line, what was kept
        how, code = stopped_by(e)
        results = os.path.join(args.results_dir, "results.csv")
        return fail(f"benchmark stopped by {how}; {results} has a row for each entry finished before it, and "
                    "the entry it was training is not in it (run the command again: each entry trains from scratch)",
                    code)
    table = Table(title="marl-benchmark")
    for col in ("suite", "metric", "env steps", "previous", "score", "delta", "wall s", "status"):
        table.add_column(col, justify="right")
    fmt = lambda v, spec=".3f": "" if v is None else format(v, spec)
    for row, c in zip(out["rows"], out["comparisons"]):
        style = {"OK": "green", "NEW": "cyan"}.get(c["status"], "red")
        table.add_row(c["suite"], c["metric"], f"{row.get('env_steps') or 0:,}", fmt(c["previous"]),
                      fmt(c["current"]), fmt(c["delta"], "+.3f"), fmt(c["wall_s"], ".0f"),
                      f"[{style}]{c['status']}[/{style}] {c['reasons']}")
    console.print(table)
    console.print(f"results: {out['results']}")
    console.print(f"trends:  {out['trends']}")
    return 0


def add_commands(sub):
    p = sub.add_parser("benchmark", help="run the benchmark suites, append to the results table, flag regressions",
                       description="Run the marl-benchmark flow (Prefect without a server): train each suite "
                       "entry from scratch, append one row per entry to <results-dir>/results.csv, draw "
                       "<results-dir>/trends.png and mark each entry OK or REGRESSION against the previous "
                       "run of the same suite at the same budget.")
    p.add_argument("--suites", nargs="+", metavar="SUITE",
                   help="suite entries to run, e.g. qmix-3m (default: every nightly entry; see --list)")
    p.add_argument("--env-steps", type=int, help="env steps per suite entry (default: each entry's budget)")
    p.add_argument("--max-wall-s", type=float, help="stop each entry's training after this many seconds")
    p.add_argument("--results-dir", default="runs/benchmarks",
                   help="results.csv, trends.png and the run dirs live here (default runs/benchmarks)")
    p.add_argument("--scheduler", help="address of a running Dask scheduler (default: a new local cluster per entry)")
    p.add_argument("--workers", type=int, default=2, help="local cluster workers (default 2)")
    p.add_argument("--list", action="store_true", help="list the suite entries and exit")
    p.set_defaults(fn=cmd_benchmark)
