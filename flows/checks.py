"""Bad input refused before anything runs or is written: one shared set of checks for the
CLI commands and the flows' parameters.

Each check raises InputError (or the ConfigError / EnvError of the layer that knows the
rule) with one line that names the problem and the fix. The cheap checks import nothing
heavy, so a typo costs a fraction of a second, not a JAX import, a cluster or a server.
"""

from __future__ import annotations

import json
import os
import re
import socket

# how long a scheduler address may take to accept a TCP connection before it counts as
# unreachable (the Dask client itself would wait CONNECT_TIMEOUT, two minutes)
CONNECT_S = 3.0
# what a run dir may hold (pipelines/stages.py, flows/artifacts.py, this module's error logs)
RUN_DIR_ENTRIES = {"replay", "checkpoints", "logs", "faults", "reanalysis", "learning_curve.png",
                   "metrics.csv", "tensorboard"}  # (flows/loggers.py)
# run settings a resumed run must share with the run that made its store: they fix the
# store's shape, the region ids, the learner's seeds or what the checkpoint holds
RESUME_KEYS = ("preset", "algo", "env_id", "env_kwargs", "seed", "n_seeds", "n_collectors",
               "envs_per_collector", "steps_per_region")


class InputError(ValueError):
    """Bad input; the message is one line naming the problem and the fix."""


def one_line(message) -> str:
    """The message on one line (some libraries' messages span several)."""
    return " ".join(str(message).split())


def check_count(flag: str, value, low: int = 1, example: int = 2) -> None:
    """An int option (e.g. --workers) that must be >= low."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{flag} {value!r} is not a whole number; pass e.g. {flag} {example}")
    if value < low:
        raise InputError(f"{flag} {value} must be >= {low}; pass e.g. {flag} {example}")


def check_scheduler(address, flag: str = "--scheduler") -> None:
    """A Dask scheduler address: its form, then that something accepts a TCP connection
    there within CONNECT_S (inproc:// lives in this process and is not probed)."""
    if address is None or str(address).startswith("inproc://"):
        return
    fix = "start one (e.g. `marl stack up`) or leave out --scheduler for a local cluster"
    m = isinstance(address, str) and \
        re.fullmatch(r"(?:(tcp|tls|ws|wss)://)?(\[[0-9a-fA-F:.]+\]|[\w.-]+):(\d{1,5})/?", address.strip())
    if not m or not 1 <= int(m.group(3)) <= 65535:
        raise InputError(f"{flag} {address!r} is not a Dask scheduler address; write tcp://HOST:PORT, "
                         "e.g. tcp://127.0.0.1:8786")
    host, port = m.group(2).strip("[]"), int(m.group(3))
    try:
        with socket.create_connection((host, port), timeout=CONNECT_S):
            pass
    except socket.gaierror:
        raise InputError(f"{flag} {address}: no such host {host!r}; check the address, or {fix}") from None
    except OSError as e:
        why = "no answer" if isinstance(e, (TimeoutError, socket.timeout)) else (e.strerror or type(e).__name__).lower()
        raise InputError(f"{flag} {address}: no scheduler reachable ({why} within {CONNECT_S:.0f} s); "
                         f"check the address, or {fix}") from None


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_writable_path(path: str, flag: str, *, directory: bool) -> None:
    """`path` can be made (or is already) a directory (`directory`) or a file we may write."""
    if not path or not str(path).strip():
        raise InputError(f"{flag} is empty; pass a path")
    if os.path.exists(path):
        if directory and not os.path.isdir(path):
            raise InputError(f"{flag} {path} is a file; pass a directory")
        if not directory and os.path.isdir(path):
            raise InputError(f"{flag} {path} is a directory; pass a file name")
        if not os.access(path, os.W_OK):
            raise InputError(f"{flag} {path} is not writable; pass a path you can write")
        return
    parent = _nearest_existing(path)
    if not os.path.isdir(parent):
        raise InputError(f"{flag} {path} lies under {parent}, which is a file; pass a path under a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path} cannot be made: {parent} is not writable; pass a path you can write")


def check_outside(path: str, flag: str, protected: dict[str, str]) -> None:
    """`path` does not lie inside any of `protected` (what -> dir): output never overwrites
    a store or checkpoints."""
    target = os.path.realpath(path)
    for what, where in protected.items():
        where = os.path.realpath(where)
        if os.path.isdir(where) and os.path.commonpath([target, where]) == where:
            raise InputError(f"{flag} {path} lies inside the {what} at {where}; pass a path outside it")


def check_run_dir(path, flag: str = "--run-dir") -> None:
    """A run dir: new (its parent writable), or an existing directory we may write that
    is empty or holds a run, never a file or a directory of other things."""
    check_writable_path(path, flag, directory=True)
    if os.path.isdir(path):
        entries = set(os.listdir(path))
        if entries and not entries & RUN_DIR_ENTRIES:
            raise InputError(f"{flag} {path} holds other files and no run (no replay/ or checkpoints/); "
                             "pass a new or empty directory")


def stored_run_config(run_dir: str) -> dict | None:
    """The config of the run that made `run_dir`'s replay store, None without one. Read from
    the store's zarr.json as JSON: no Zarr, nothing written."""
    try:
        with open(os.path.join(run_dir, "replay", "zarr.json")) as f:
            stored = json.load(f).get("attributes", {}).get("config")
    except (OSError, ValueError, AttributeError):
        return None  # no store yet; a damaged one gets its own error where it is opened
    return stored if isinstance(stored, dict) else None


def check_resume(config) -> None:
    """Resuming a run dir: the preset, env, algorithm, seeds, store shape and network shape
    must be those of the run that made it. One line names the keys that differ."""
    from marl import algos

    stored = stored_run_config(config.run_dir)
    if stored is None:
        return
    want = config.to_dict()
    diffs = [(k, stored.get(k), want[k]) for k in RESUME_KEYS if stored.get(k) != want[k]]
    try:
        had = algos.config_for(stored.get("algo"), stored.get("algo_overrides") or {})
    except (ValueError, TypeError):
        had = None  # a run of another code version: its algo key already differs or says so
    wants = config.algo_config()
    for key in algos.NETWORK:
        if had is not None and hasattr(had, key) and hasattr(wants, key) and getattr(had, key) != getattr(wants, key):
            diffs.append((key, getattr(had, key), getattr(wants, key)))
    if diffs:
        show = lambda v: json.dumps(v, separators=(",", ":")) if isinstance(v, (dict, list)) else str(v)
        have = " ".join(f"{k}={show(h)}" for k, h, _ in diffs)
        new = " ".join(f"{k}={show(w)}" for k, _, w in diffs)
        raise InputError(f"run dir {config.run_dir} holds a run with other settings (have {have}; want {new}); "
                         "resume it with its own settings, or start a new run with --run-dir NEW")


def check_env(config):
    """The env exists with these kwargs (and its optional packages are installed) and the
    algorithm can act in it; returns its spec."""
    from marl import algos, envs
    from pipelines.config import PRESETS

    preset = PRESETS.get(config.preset, {})
    try:
        spec = envs.make(config.env_id, **config.env_kwargs).spec
    except envs.EnvError as e:
        # a preset's env kwargs are for its own env: say where they came from
        if config.env_kwargs and config.env_kwargs == preset.get("env_kwargs") and config.env_id != preset.get("env_id"):
            raise envs.EnvError(f"{e} (these env kwargs are preset {config.preset}'s for {preset['env_id']}; "
                                "pass --set env_kwargs='{}' or kwargs for this env)") from None
        raise
    algos.check_env(config.algo, spec, config.algo_config())
    return spec


def tls_security(tls, address: str | None):
    """The TLS security of `--tls [DIR]` (True: the user's config dir), or None without it;
    a TLS scheduler without --tls, or --tls with a plain one, is refused in one line."""
    from pipelines import cluster

    scheme = str(address).split("://")[0] if address and "://" in str(address) else "tcp"
    if not tls and address and address == os.environ.get(cluster.SCHEDULER_ENV) and os.environ.get(cluster.TLS_ENV):
        tls = os.environ[cluster.TLS_ENV]  # a flow run of `marl stack up --tls`: the stack's certificates
    if not tls:
        if scheme == "tls":
            raise InputError(f"scheduler {address} speaks TLS; add --tls [DIR] with the directory of its "
                             f"certificates (ca.pem, cert.pem, key.pem; default {cluster.default_tls_dir()})")
        return None
    if address and scheme != "tls":
        raise InputError(f"--tls needs a tls:// scheduler and {address} is {scheme}://; start the scheduler "
                         "with TLS (dask scheduler --protocol tls --tls-ca-file ... --tls-cert ... --tls-key ...) "
                         "or leave out --scheduler for a local TLS cluster")
    directory = None if tls is True else str(tls)
    if directory is not None:
        check_writable_path(directory, "--tls", directory=True)
    try:
        return cluster.tls_security(directory)
    except (ValueError, OSError) as e:
        raise InputError(one_line(e)) from None


CLUSTER_KINDS = ("auto", "cpu", "gpu", "threads")


def check_cluster(kind: str, scheduler_address: str | None = None, tls=False) -> None:
    """--cluster names a kind of new local cluster: one of CLUSTER_KINDS, without --scheduler
    (a running cluster is what it is), and not threads with --tls (inproc has no connection
    to secure)."""
    if kind not in CLUSTER_KINDS:
        raise InputError(f"--cluster {kind!r} is not a cluster kind; use one of {', '.join(CLUSTER_KINDS)}")
    if kind != "auto" and scheduler_address:
        raise InputError("--cluster picks a new local cluster and --scheduler uses a running one; "
                         "leave out one of them")
    if kind == "threads" and tls:
        raise InputError("--tls secures connections between processes and a threads cluster has none; "
                         "leave out one of them")


def check_run(config, scheduler_address=None, n_workers=2) -> None:
    """Everything about a training run that can be checked before a cluster starts or
    anything is written: the cheap checks first."""
    check_count("--workers", n_workers)
    from pipelines.cluster import SCHEDULER_ENV

    check_scheduler(scheduler_address)
    if scheduler_address is None and os.environ.get(SCHEDULER_ENV):  # what connect() would use
        check_scheduler(os.environ[SCHEDULER_ENV], flag=f"${SCHEDULER_ENV}")
    check_run_dir(config.run_dir)
    check_env(config)  # before the resume check: an env that does not exist says so
    check_resume(config)
