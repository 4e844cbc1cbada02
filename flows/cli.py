"""`marl`: train presets on the embedded default, inspect replay stores.

    marl train qmix-smac [--env-steps N] [--collectors K] [--run-dir D] [--set key=value ...]
    marl replay info|episodes|reanalyze|export PATH ...   (see flows/replay_cli.py)
    marl stack up|down|status [--home DIR]
    marl presets
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import signal
import sys
import threading
import warnings


# modules that add subcommands: each has add_commands(subparsers)
COMMAND_MODULES = ("flows.replay_cli", "flows.stack", "flows.benchmark_cli", "flows.eval_cli",
                   "flows.envs_cli", "flows.runs_cli")


class Terminated(SystemExit):
    """SIGTERM, as an exit: 128 + 15."""


# set once a stop from outside (SIGTERM, Ctrl-C) has begun: what is lost in closing is expected
STOPPING = threading.Event()


def _exit(signum, frame):
    STOPPING.set()
    raise Terminated(128 + signum)


def _interrupt(signum, frame):
    STOPPING.set()
    raise KeyboardInterrupt


def stopped_by(stop: BaseException) -> tuple[str, int]:
    """(how, exit code) of a run stopped from outside: Terminated or KeyboardInterrupt."""
    return ("SIGTERM", stop.code) if isinstance(stop, Terminated) else ("Ctrl-C", 130)


def _embedded_defaults(verbose: bool = False):
    """Prefect without a server (a temporary one in-process), its state under .prefect/;
    Prefect's and Dask's log lines only from warnings up, unless `verbose`. SIGTERM then
    leaves through Python's exit, whose atexit hooks stop that server (a subprocess, else left
    running without a parent) and the local cluster; Prefect's flow engine, which holds SIGTERM
    while a run is on to mark it Crashed, hands the signal on to this handler."""
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _exit)  # Ctrl-C (KeyboardInterrupt) leaves the same way
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _interrupt)  # Python's own, and noting the stop
    os.environ.setdefault("PREFECT_HOME", os.path.abspath(".prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    if verbose:  # read by Prefect and Dask at import
        os.environ["PREFECT_LOGGING_LEVEL"], os.environ["DASK_LOGGING__DISTRIBUTED"] = "INFO", "info"
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
    logging.getLogger("distributed").setLevel(logging.INFO if verbose else logging.WARNING)
    if not verbose:  # Dask's note when another cluster holds the dashboard's port (it picks another)
        warnings.filterwarnings("ignore", message=r"Port \d+ is already in use", category=UserWarning)
        # and its nanny's note when a worker takes over 4 s to exit as the local cluster closes
        logging.getLogger("distributed.nanny").addFilter(
            lambda record: not str(record.msg).startswith("Worker process still alive after"))
        # and the scheduler's, as a stopped run's cluster closes, that its workers held results
        # still wanted (the run's stages in flight, which the resumed run does again)
        logging.getLogger("distributed.scheduler").addFilter(
            lambda record: not (STOPPING.is_set() and "caused the cluster to lose already computed" in str(record.msg)))


def migrate_embedded_home() -> None:
    """Creates the embedded Prefect home's database, once, under a file lock. Runs started
    together on a fresh home would otherwise each migrate it as their temporary servers start,
    and all but one server fail ("Application startup failed"). A home whose database exists,
    a server at PREFECT_API_URL or a database elsewhere is left alone."""
    if any(os.environ.get(name) for name in ("PREFECT_API_URL", "PREFECT_API_DATABASE_CONNECTION_URL",
                                             "PREFECT_SERVER_DATABASE_CONNECTION_URL")):
        return
    import asyncio
    import fcntl

    home = os.environ.get("PREFECT_HOME", os.path.expanduser("~/.prefect"))
    os.makedirs(home, exist_ok=True)
    with open(os.path.join(home, ".migrate.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if os.path.exists(os.path.join(home, "prefect.db")):
            return
        from prefect.server.database import provide_database_interface

        asyncio.run(provide_database_interface().create_db())


# argv: the parent's pid, then the command to exec. PR_SET_PDEATHSIG (1) outlives exec; a
# parent gone before it took hold is caught by the pid check. A launcher rather than a
# preexec_fn: Python code between fork and exec can deadlock in a process with JAX's threads.
DIE_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
                   "os.getppid() == int(sys.argv[1]) or sys.exit(0); os.execv(sys.argv[2], sys.argv[2:])")


def start_embedded_server() -> None:
    """Starts Prefect's temporary server now (else the flow starts it, in the run's process
    group), in a process group of its own. A terminal's Ctrl-C, and the SIGTERM of `timeout`,
    Slurm or systemd, signal the whole group: a server stopped with the run left the flow
    engine unable to record the stop (a connection error instead of the run's one line). The
    run still stops it at exit (Prefect's atexit), and on Linux the kernel sends it SIGTERM
    should the run die without exiting (SIGKILL). Nothing to start where PREFECT_API_URL
    names a server."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    import subprocess
    import types

    from prefect.server.api import server

    parent = os.getpid()

    def popen(args, **kwargs):  # Prefect's Popen of the server, in a group of its own
        if sys.platform == "linux":  # through a launcher that asks for SIGTERM at the run's death
            args = [sys.executable, "-c", DIE_WITH_PARENT, str(parent), *args]
        return subprocess.Popen(args, process_group=0, **kwargs)

    class OwnGroupServer(server.SubprocessASGIServer):
        def _run_uvicorn_command(self):
            # Prefect's module's name `subprocess` is swapped for this one call (the global
            # module stays as it is for other threads)
            server.subprocess = types.SimpleNamespace(Popen=popen)
            try:
                return super()._run_uvicorn_command()
            finally:
                server.subprocess = subprocess

    # the instance Prefect's clients find: one per port (a registry shared with subclasses),
    # and this is the no-port one
    OwnGroupServer().start()


class Parser(argparse.ArgumentParser):
    """argparse with its errors in one line (argparse prints the whole usage first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")


def fail(error, code: int = 2) -> int:
    """The one-line answer to bad input (exit 2) or a failed run (exit 1), on stderr."""
    from flows.checks import one_line

    print(f"marl: {one_line(error)}", file=sys.stderr)
    return code


def _parse_sets(pairs: list[str]) -> dict[str, str]:
    from flows.checks import InputError

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise InputError(f"bad --set {pair!r}; write --set key=value, e.g. --set lr=0.001")
        out[key.strip()] = value.strip()
    return out


class _DropReported(logging.Filter):
    """Keeps Prefect from logging, traceback and all, the errors this CLI answers in one line
    (bad input, a failed stage); its other warnings and errors still show."""

    def filter(self, record) -> bool:
        from flows import train as train_flow

        error = record.exc_info[1] if record.exc_info else None
        if error is not None:
            return not (train_flow.reported(error) or train_flow.task_stage(error))
        # a run stopped by Ctrl-C or SIGTERM: cmd_train says so in its one line
        return not str(record.msg).startswith(("Finished in state Failed", "Crash detected! Execution was aborted by"))


def quiet_reported_failures() -> None:
    """Installs _DropReported where Prefect logs a run's failure."""
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logging.getLogger(name).addFilter(_DropReported())


def cmd_train(args) -> int:
    _embedded_defaults(args.verbose)
    from flows import checks

    # the cheap checks first: a typo costs no JAX import, no cluster, no server
    try:
        overrides = _parse_sets(args.set or [])
        if args.seeds is not None:
            overrides["n_seeds"] = str(args.seeds)
        for flag, value, example in (("--env-steps", args.env_steps, 100_000), ("--collectors", args.collectors, 2),
                                     ("--seeds", args.seeds, 3), ("--workers", args.workers, 2)):
            checks.check_count(flag, value, example=example)
        if args.workers is not None and args.scheduler:
            raise checks.InputError("--workers sizes a new local cluster and --scheduler uses a running one; "
                                    "leave out one of them")
        checks.check_cluster(args.cluster, args.scheduler, args.tls)
        checks.check_scheduler(args.scheduler)
        if args.run_dir is not None:
            checks.check_run_dir(args.run_dir)
        from flows.loggers import parse_loggers

        parse_loggers(args.logger)  # an unknown logger or a missing package, before anything starts
    except checks.InputError as e:
        return fail(e)
    from marl.algos import ConfigError
    from marl.envs import EnvError
    from pipelines.config import make_run_config
    from storage import StoreError

    bad_input = (checks.InputError, ConfigError, EnvError, StoreError)
    n_workers = args.workers or 2
    try:  # everything else before any cluster or server starts
        config = make_run_config(args.preset, env_id=args.env, total_env_steps=args.env_steps,
                                 n_collectors=args.collectors, seed=args.seed,
                                 run_dir=args.run_dir, overrides=overrides)
        checks.check_run(config, args.scheduler, n_workers)
        checks.tls_security(args.tls, args.scheduler)
    except bad_input as e:
        return fail(e)

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from flows import train as train_flow

    migrate_embedded_home()
    start_embedded_server()
    quiet_reported_failures()
    console = Console(quiet=args.quiet)  # --quiet: only the final line below

    table = Table(title=f"{config.preset} on {config.env_id}")
    for col in ("iter", "env steps", "test win", "return", "loss", "env steps/s"):
        table.add_column(col, justify="right")
    fmt = lambda v, spec: "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,} env steps"),
                  TimeElapsedColumn(), console=console) as progress:
        bar = progress.add_task("training", total=config.n_iterations * config.steps_per_iteration)

        def on_iteration(row):
            progress.update(bar, completed=row["env_steps"])
            if "test_win_rate" in row:
                table.add_row(str(row["iteration"]), f"{row['env_steps']:,}", fmt(row["test_win_rate"], ".3f"),
                              fmt(row["return"], ".3f"), fmt(row["loss"], ".4f"), fmt(row["steps_per_s"], ",.0f"))
                progress.console.print(f"iter {row['iteration']:>5}  steps {row['env_steps']:>9,}  "
                                       f"test win {fmt(row['test_win_rate'], '.3f'):>5}  "
                                       f"return {fmt(row['return'], '.3f'):>6}  loss {fmt(row['loss'], '.4f'):>7}  "
                                       f"steps/s {fmt(row['steps_per_s'], ',.0f'):>6}",
                                       soft_wrap=True)  # one line in a log file too

        train_flow.ITERATION_HOOKS.append(on_iteration)
        try:
            result = train_flow.marl_train(
                preset=args.preset, env=args.env, env_steps=args.env_steps, collectors=args.collectors,
                seed=args.seed, seeds=args.seeds, run_dir=args.run_dir, overrides=overrides,
                scheduler_address=args.scheduler, n_workers=n_workers, loggers=args.logger, tls=args.tls,
                cluster=args.cluster)
        except bad_input as e:  # found only where the run starts (e.g. the memory of its workers)
            progress.stop()
            return fail(e)
        except (train_flow.StageError, train_flow.RunStopped) as e:  # a failed run: one line, exit 1
            progress.stop()
            return fail(e, code=1)
        except (KeyboardInterrupt, Terminated) as e:  # stopped from outside: one line, how to go on
            progress.stop()
            how, code = stopped_by(e)
            return fail(f"stopped by {how}; the same command resumes from {config.run_dir}'s last checkpoint", code)
        finally:
            train_flow.ITERATION_HOOKS.remove(on_iteration)
    console.print(table)
    if result["resumed_from"]:
        console.print(f"resumed from iteration {result['resumed_from']}")
    console.print(f"replay store: {os.path.abspath(result['store'])}")
    console.print(f"checkpoints:  {result['checkpoint_dir']}")
    if args.quiet:
        print(_final_line(config, result))
    return 0


def _final_line(config, result) -> str:
    """--quiet's one line: how far the run got, its last evaluation and where it is."""
    tested = [r for r in result["history"] if "test_win_rate" in r]
    last = f", test win {tested[-1]['test_win_rate']:.3f}, return {tested[-1]['return']:.3f}" if tested else ""
    return f"{config.preset} on {config.env_id}: {result['env_steps']:,} env steps{last}; run dir {config.run_dir}"


def cmd_presets(args) -> int:
    from pipelines.config import PRESETS

    for name, p in sorted(PRESETS.items()):
        print(f"{name:18s} {p['algo']:7s} {p['env_id']:28s} {p['total_env_steps']:>10,} env steps")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="marl", description="Multi-agent RL as a dataflow.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a preset on a local Dask cluster with Prefect (no server needed)",
                       description="Run the marl-train flow (collect -> train -> evaluate, iterated) for a "
                       "preset on a local 2-worker Dask cluster (or --scheduler), Prefect without a server; "
                       "prints a progress bar and a per-evaluation table, then the replay store and "
                       "checkpoint paths. An existing --run-dir resumes from its latest checkpoint.")
    p.add_argument("preset", help="e.g. qmix-smac (see `marl presets`)")
    p.add_argument("--env", help="env id, e.g. smax:3m, smax:2s3z (default: the preset's)")
    p.add_argument("--env-steps", type=int, help="total env steps (default: the preset's)")
    p.add_argument("--collectors", type=int, help="parallel collect tasks per iteration")
    p.add_argument("--seed", type=int, help="base random seed of network init, collection and evaluation (default 0)")
    p.add_argument("--seeds", type=int, help="train this many independent seeds in one learner (vmap); "
                   "evaluations report their mean and standard deviation")
    p.add_argument("--run-dir", help="where the replay store and checkpoints live (default runs/PRESET); "
                   "an existing run dir resumes")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a run or algorithm setting, e.g. --set lr=0.001 (repeatable)")
    p.add_argument("--scheduler", help="address of a running Dask scheduler (default: a new local cluster)")
    p.add_argument("--workers", type=int, help="local cluster workers (default 2)")
    p.add_argument("--cluster", default="auto", metavar="KIND",
                   help="the local cluster's kind: auto (default: CUDA workers where GPUs are visible, "
                   "threads where a TPU is), cpu, gpu, or threads (workers as threads of this process, "
                   "sharing its devices)")
    p.add_argument("--tls", nargs="?", const=True, default=False, metavar="DIR",
                   help="the cluster talks TLS only, with DIR's ca.pem, cert.pem and key.pem (default DIR: "
                   "~/.config/marl/tls, self-signed ones made there when it has none)")
    p.add_argument("--logger", metavar="NAMES", help="where per-iteration metrics go: csv (default, "
                   "RUN_DIR/metrics.csv), tensorboard (RUN_DIR/tensorboard, needs the tensorboard extra), "
                   "mlflow ($MLFLOW_TRACKING_URI, else RUN_DIR/mlflow.db; the mlflow extra), wandb "
                   "(offline in RUN_DIR/wandb unless WANDB_MODE says otherwise; the wandb extra), "
                   "comma-separated, e.g. --logger csv,tensorboard")
    talk = p.add_mutually_exclusive_group()
    talk.add_argument("--quiet", action="store_true", help="print only one final line (errors still one line)")
    talk.add_argument("--verbose", action="store_true", help="also print Prefect's and Dask's log lines")
    p.set_defaults(fn=cmd_train)

    for module in COMMAND_MODULES:  # each adds its own subcommands
        importlib.import_module(module).add_commands(sub)

    p = sub.add_parser("presets", help="list the training presets",
                       description="List every training preset: name, algorithm, env id and env-step budget.")
    p.set_defaults(fn=cmd_presets)

    _describe_from_help(parser)
    args = parser.parse_args(argv)
    return args.fn(args)


def _describe_from_help(parser: argparse.ArgumentParser) -> None:
    """Give every (sub-)command without a description its one-line help as one, so that
    `marl CMD --help` always says what CMD does."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                child = action.choices[choice.dest]
                if not child.description and choice.help:
                    child.description = choice.help[0].upper() + choice.help[1:] + "."
                _describe_from_help(child)


if __name__ == "__main__":
    sys.exit(main())
