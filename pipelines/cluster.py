"""The Dask cluster the stages run on.

- `LocalCluster` by default, every listener on 127.0.0.1, dashboard on;
- `dask_cuda.LocalCUDACluster` where GPUs are visible and dask-cuda is installed;
- workers as threads of this process (kind "threads", Dask's inproc transport) where a TPU is
  visible: one process at a time may hold a TPU chip, so the learner and the collectors share
  it as threads of one process, as Sebulba's actor and learner threads do;
- or any running scheduler, by address.

With TLS (`tls_security`), the scheduler, workers and clients talk tls:// with certificates
from `distributed.security.Security`, and a plain tcp:// client is refused.

Workers carry resources so stages land where they belong: GPU workers offer `gpu`, CPU
workers offer `cpu`. JAX collectors and the learner ask for `gpu` where any GPU worker
exists; PettingZoo collectors always ask for `cpu`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import socket
import sys
import tempfile
import threading

import dask
from distributed import Client, LocalCluster
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.security import Security
from distributed.system import MEMORY_LIMIT

HOST = "127.0.0.1"
# a running scheduler that connect() uses when given no address (set by `marl stack up`)
SCHEDULER_ENV = "MARL_DASK_SCHEDULER"
# the certificate directory for that scheduler when it speaks TLS (`marl stack up --tls`)
TLS_ENV = "MARL_DASK_TLS"


def gpu_count() -> int:
    """GPUs visible to this process (0 without NVML, or with CUDA_VISIBLE_DEVICES empty/-1)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in {"", "-1"}:
        return 0
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception:  # no NVML library, no driver: no GPU
        return 0
    if visible:
        count = min(count, len([v for v in visible.split(",") if v.strip()]))
    return int(count)


def tpu_count() -> int:
    """TPU chips this process could open: libtpu installed, JAX not pinned to other platforms,
    and /dev/accel* (or /dev/vfio, on newer hosts) present. Nothing is opened to find out."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms and "tpu" not in platforms.split(","):
        return 0
    if importlib.util.find_spec("libtpu") is None:
        return 0
    accel = [d for d in os.listdir("/dev") if d.startswith("accel")] if os.path.isdir("/dev") else []
    vfio = [d for d in os.listdir("/dev/vfio") if d.isdigit()] if os.path.isdir("/dev/vfio") else []
    return len(accel or vfio)


def can_listen() -> bool:
    """Whether this machine lets a process listen on the loopback (sandboxes that refuse
    internet sockets exist: the TPU machines this project was checked on refuse them all)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            s.listen()
        return True
    except OSError:
        return False


# the directory holding marl/, storage/, pipelines/ and flows/
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Dask's nanny sets MALLOC_TRIM_THRESHOLD_=65536 in every worker it spawns (config
# `distributed.nanny.pre-spawn-environ`). Setting glibc's trim threshold at all, to any value,
# also turns off its dynamic mmap threshold, so every buffer over 128 KiB that XLA:CPU
# allocates is a fresh mmap, page-faulted in and munmapped again on each call: ~50k minor page
# faults per SMAX 3m rollout at N=1024 (0 in the driver), a 2048^2 matmul 3.5x slower, and the
# collect stage at ~0.6x the driver's speed. OMP/MKL/OPENBLAS_NUM_THREADS=1 from the same config
# were measured to make no difference to XLA, so they stay. A None value makes the nanny drop
# the variable (distributed.nanny._get_env_variables).
NANNY_ENVIRON_DROP = {"MALLOC_TRIM_THRESHOLD_": None}


def worker_environment() -> dict[str, str]:
    """Set in every worker before it starts: a shared JAX compile cache (a worker's first
    jit drops from ~12 s to ~1 s when the function was compiled before), quiet Prefect, and,
    for nannies started as `dask worker` processes (`marl stack`), the config that keeps
    MALLOC_TRIM_THRESHOLD_ out of the workers they spawn (see NANNY_ENVIRON_DROP)."""
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), "marl-jax-cache")
    return {
        "JAX_COMPILATION_CACHE_DIR": cache,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # read by dask.config on import, merged into the nanny's pre-spawn-environ defaults
        "DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON": repr(NANNY_ENVIRON_DROP),
    }


# Work stealing would move a collect task from its busy collector worker to an idle one
# (the learner's), where the collector's envs are not: new episodes, and a lock-step run
# no longer reproducible. Stages are pinned with loose restrictions instead, so a task
# moves only when its worker is gone. (`marl stack` starts its scheduler with this too.)
SCHEDULER_CONFIG = {"distributed.scheduler.work-stealing": False}


TLS_FILES = ("ca.pem", "cert.pem", "key.pem")


def default_tls_dir() -> str:
    """Where TLS certificates live unless the user names a directory: the user's config dir."""
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(config, "marl", "tls")


def tls_security(directory: str | None = None) -> Security:
    """TLS for every role (scheduler, workers, clients), encryption required, from the
    directory's ca.pem, cert.pem and key.pem: the user's own, or, where the directory has none
    of them, a self-signed key and certificate that Security.temporary() makes, written there
    (the key readable by its owner only) so every process of a cluster can load the same ones."""
    directory = os.path.abspath(directory or default_tls_dir())
    ca, cert, key = (os.path.join(directory, name) for name in TLS_FILES)
    present = [os.path.exists(p) for p in (ca, cert, key)]
    if not any(present):
        made = Security.temporary()
        os.makedirs(directory, mode=0o700, exist_ok=True)
        for path, text in ((ca, made.tls_ca_file), (cert, made.tls_client_cert), (key, made.tls_client_key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
    elif not all(present):
        missing = [name for name, there in zip(TLS_FILES, present) if not there]
        raise ValueError(f"TLS directory {directory} lacks {', '.join(missing)}; put all of "
                         f"{', '.join(TLS_FILES)} there, or name an empty directory to make a self-signed set")
    return Security(require_encryption=True, tls_ca_file=ca,
                    tls_client_cert=cert, tls_client_key=key, tls_scheduler_cert=cert,
                    tls_scheduler_key=key, tls_worker_cert=cert, tls_worker_key=key)


def make_cluster(n_workers: int = 2, kind: str = "auto", dashboard_address: str = f"{HOST}:8787",
                 threads_per_worker: int = 1, memory_limit: str | None = None,
                 security: Security | None = None):
    """A local cluster of the requested kind: "auto" (CUDA where GPUs are visible; threads where
    a TPU is, or where the machine refuses TCP listeners, so processes could not talk), "cpu",
    "gpu", "threads"; with `security`, every connection is TLS."""
    if kind not in {"auto", "cpu", "gpu", "threads"}:
        raise ValueError(f"unknown cluster kind {kind!r}; use auto, cpu, gpu or threads")
    gpus = gpu_count() if kind != "cpu" else 0
    if kind == "threads" or (kind == "auto" and not gpus and (tpu_count() or not can_listen())):
        if security is not None:
            # inproc connections never leave this process, and nothing outside it can connect
            logging.getLogger(__name__).warning(
                "TLS does not apply to a threads cluster: its workers are threads of this process "
                "(Dask's inproc transport, no network connection to encrypt)")
        return _threads_cluster(n_workers, dashboard_address, threads_per_worker, memory_limit)
    tls = {"security": security, "protocol": "tls://"} if security is not None else {}
    env = worker_environment()
    # A Dask worker puts its local directory first on sys.path and keeps a spill folder named
    # `storage` there; under an editable install (an import hook, no path entry) that empty
    # folder would shadow our `storage` package. A real path entry wins over it, and spawned
    # workers inherit this process's sys.path.
    if PROJECT_ROOT not in sys.path:
        sys.path.append(PROJECT_ROOT)
    # the nanny applies these before spawning, so they reach workers even when the
    # parent process imported jax first (LocalCluster(env=...) comes too late for that);
    # without Dask's MALLOC_TRIM_THRESHOLD_ (see NANNY_ENVIRON_DROP)
    with dask.config.set({"distributed.nanny.pre-spawn-environ": {
            **dask.config.get("distributed.nanny.pre-spawn-environ", {}), **env, **NANNY_ENVIRON_DROP},
            **SCHEDULER_CONFIG}):
        if kind == "gpu" and gpus == 0:
            raise RuntimeError("cluster kind 'gpu' asked for but no GPU is visible; use kind='auto' or 'cpu'")
        if gpus:
            try:
                from dask_cuda import LocalCUDACluster
            except ImportError:
                if kind == "gpu":
                    raise RuntimeError("GPUs are visible but dask-cuda is missing; "
                                       "pip install 'marl-dataflow[cuda]'") from None
            else:
                return LocalCUDACluster(host=HOST, dashboard_address=dashboard_address,
                                        threads_per_worker=threads_per_worker,
                                        resources={"gpu": 1}, memory_limit=memory_limit, **tls)
        return LocalCluster(n_workers=n_workers, threads_per_worker=threads_per_worker,
                            host=HOST, dashboard_address=dashboard_address, processes=True,
                            resources={"cpu": 1}, memory_limit=memory_limit or "auto", **tls)


def _threads_cluster(n_workers, dashboard_address, threads_per_worker, memory_limit):
    """Workers as threads of this process over Dask's inproc transport: they share this
    process's JAX devices (a TPU's one holder), the learner gets regions without a copy
    between processes. Each worker offers `gpu` where this process has an accelerator, so the
    learner and JAX collectors land on them exactly as on a dask-cuda cluster."""
    if PROJECT_ROOT not in sys.path:
        sys.path.append(PROJECT_ROOT)
    accelerator = bool(gpu_count() or tpu_count())
    # Dask measures a worker's memory as its process's, here the one process all workers (and
    # an accelerator runtime, 9-15 GiB of host memory on a TPU) share: each worker's limit is
    # the machine's, not a share of it ("auto"), or every worker pauses at once
    kwargs = dict(n_workers=n_workers, threads_per_worker=threads_per_worker, processes=False,
                  resources={"gpu": 1} if accelerator else {"cpu": 1},
                  memory_limit=memory_limit or MEMORY_LIMIT)
    with dask.config.set(SCHEDULER_CONFIG):
        if can_listen():
            # inproc addresses carry this machine's outward IP, where Dask's HTTP servers would
            # bind by default: the scheduler's and the workers' go on the loopback
            return LocalCluster(dashboard_address=dashboard_address, worker_dashboard_address=f"{HOST}:0",
                                scheduler_kwargs=None if dashboard_address else {"dashboard_address": f"{HOST}:0"},
                                **kwargs)
        # Every Dask server (scheduler and workers alike) listens on TCP for its HTTP routes
        # (dashboard, /metrics, /health) whatever the transport; on a machine that refuses
        # internet sockets that aborts the start. inproc needs no socket, so the cluster
        # starts without them: no dashboard, the rest as usual.
        logging.getLogger(__name__).warning(
            "this machine refuses TCP listeners: the threads cluster starts without Dask's dashboard")
        from distributed.node import ServerNode

        original = ServerNode.start_http_server
        ServerNode.start_http_server = lambda self, *args, **kw: None
        try:
            return LocalCluster(dashboard_address=None, **kwargs)
        finally:
            ServerNode.start_http_server = original


class IgnoreGroupStops(WorkerPlugin):
    """A local cluster's worker processes ignore SIGINT and put SIGTERM off. A terminal's
    Ctrl-C, and the SIGTERM of `timeout`, Slurm or systemd, signal the run's whole process
    group, and these workers are the run's to stop (their nannies close them as it exits, by
    message, else by SIGKILL); else each dies first, with its own traceback or a nanny's
    restart above the run's one line. A SIGTERM still ends a worker TERM_GRACE_S later
    (SIGALRM's default action) should nothing close it first: multiprocessing's exit
    SIGTERMs and then waits on its workers. Once either signal came, the worker's heartbeat
    failing on a scheduler already closed is the stop, not a fault, and is not logged (it
    printed an ERROR traceback under the run's one line on a loaded machine). A plugin, so
    workers that restart later do the same; a worker that is a thread of this process (the
    threads cluster) leaves the process's handlers alone."""

    name = "marl-ignore-group-stops"

    def __init__(self):
        self.client_pid = os.getpid()

    def setup(self, worker):
        if os.getpid() != self.client_pid and threading.current_thread() is threading.main_thread():
            def stop_begun(signum, frame):
                GROUP_STOP.set()
                if signum == signal.SIGTERM:
                    signal.alarm(TERM_GRACE_S)

            signal.signal(signal.SIGINT, stop_begun)
            signal.signal(signal.SIGTERM, stop_begun)
            logging.getLogger("distributed.worker").addFilter(
                lambda record: not (GROUP_STOP.is_set() and str(record.msg).startswith(HEARTBEAT_LOST)))


TERM_GRACE_S = 60
GROUP_STOP = threading.Event()  # in a worker process: its run's group was signalled to stop
HEARTBEAT_LOST = "Failed to communicate with scheduler during heartbeat"


@contextlib.contextmanager
def connect(address: str | None = None, security: Security | None = None, **cluster_kwargs):
    """Yields a Client: to the scheduler at `address` (default: $MARL_DASK_SCHEDULER, which
    `marl stack up` sets for its flow runs), or to a new local cluster closed after; with
    `security`, over TLS ($MARL_DASK_TLS's certificates for $MARL_DASK_SCHEDULER)."""
    if not address and os.environ.get(SCHEDULER_ENV) and security is None and os.environ.get(TLS_ENV):
        security = tls_security(os.environ[TLS_ENV])
    address = address or os.environ.get(SCHEDULER_ENV) or None
    # generous: on a loaded 2-core machine the default 30 s connect timeout was seen to expire
    if address:
        with Client(address, timeout=CONNECT_TIMEOUT, security=security) as client:
            yield client
        return
    cluster = make_cluster(security=security, **cluster_kwargs)
    try:
        with Client(cluster, timeout=CONNECT_TIMEOUT, security=security) as client:
            client.register_plugin(IgnoreGroupStops())
            yield client
    finally:
        try:
            cluster.close()
        except TimeoutError as e:
            # a worker slow to exit on a loaded machine: the run's work is done and stored, and
            # its nanny kills the worker process; no reason to fail the run on its way out
            logging.getLogger(__name__).warning("the local Dask cluster was slow to close (%s)", e)


CONNECT_TIMEOUT = "120s"


def workers(client: Client) -> dict:
    """{address: info} of the scheduler's workers, asked of the scheduler now.

    Not `client.scheduler_info()["workers"]`: that returns an attribute which the client's
    own periodic refresh (every 2 s) overwrites with a summary holding no workers, so a
    caller racing it reads {} while every worker is up; on a loaded machine that stopped
    runs as "no worker is left"."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def placement(client: Client, env_backend: str = "jax") -> dict:
    """Which workers run what: the learner on a GPU worker where there is one; JAX-env
    collectors on GPU workers too, numpy (PettingZoo) collectors on CPU workers only.

    Returns {"learner": addr, "collectors": [addr, ...], "gpu": bool}.
    """
    info = workers(client)
    if not info:
        raise RuntimeError("the Dask cluster has no workers; start some or use a local cluster")
    resources = {a: w.get("resources", {}) for a, w in info.items()}
    gpu_workers = sorted(a for a, r in resources.items() if r.get("gpu"))
    cpu_workers = sorted(a for a, r in resources.items() if not r.get("gpu"))
    learner_pool = gpu_workers or sorted(info)
    if env_backend == "numpy":
        # numpy envs step in Python on a CPU; a GPU worker would idle its device meanwhile
        collectors = cpu_workers or sorted(info)
    else:
        collectors = learner_pool
    return {"learner": learner_pool[0], "collectors": collectors, "gpu": bool(gpu_workers)}
