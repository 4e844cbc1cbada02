"""`marl stack up | down | status`: the local Prefect + Dask stack, every listener on 127.0.0.1.

`up` starts, in order: a Prefect server (its own SQLite database under the stack home), a Dask
scheduler, Dask workers, the process work pool `marl-process` with every deployment of
prefect.yaml, and a Prefect worker on that pool. The worker passes MARL_DASK_SCHEDULER down
to its flow runs, so `pipelines.cluster.connect()` in a deployment run uses the stack's
scheduler instead of starting a cluster of its own.

Each process runs in its own process group and is recorded (pid, start time, port, URL) in
<home>/stack.json. `up` again reuses every recorded process that is alive and answering and
starts only what is missing; `down` stops exactly the recorded process groups (and flow-run
processes that left them); `status` says what runs and exits 1 when something does not.

`up --tls [DIR]`: the scheduler and workers speak tls:// only (encryption required), with
DIR's ca.pem, cert.pem and key.pem, the same set as `marl train --tls DIR` (default
~/.config/marl/tls, a self-signed set made there when it has none); the dashboard stays
http on 127.0.0.1. The Prefect worker passes the directory to its flow runs
(MARL_DASK_TLS), and `marl train PRESET --scheduler tls://... --tls DIR` connects; a
client without the certificates is refused.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil

HOST = "127.0.0.1"
POOL = "marl-process"
WORKER_NAME = "marl-stack"
# the repository root (holds prefect.yaml, flows/, pipelines/ ...)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_HOME = os.path.join(ROOT, ".marl-stack")
COMPONENTS = ("prefect-server", "dask-scheduler", "dask-workers", "prefect-worker")  # start order
# seconds until a component must answer; a Prefect server takes 10-30 s on 2 busy cores
READY_TIMEOUT = {"prefect-server": 180, "dask-scheduler": 60, "dask-workers": 120, "prefect-worker": 90}
STOP_TIMEOUT = 20  # seconds between SIGTERM and SIGKILL
# settings that would point our Prefect processes at another server or database
FOREIGN_PREFECT_SETTINGS = ("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_PROFILE",
                            "PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL")


class StackError(Exception):
    """A one-line reason the stack cannot come up, with the fix."""


# --- state file -------------------------------------------------------------------------

def _state_path(home: str) -> str:
    return os.path.join(home, "stack.json")


def _load_state(home: str) -> dict | None:
    try:
        with open(_state_path(home)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise StackError(f"--home {home} is not a directory; pass the stack's directory "
                         f"(default {DEFAULT_HOME})") from None
    except json.JSONDecodeError as e:
        raise StackError(f"{_state_path(home)} is not valid JSON ({e}); stop the processes it "
                         "listed by hand and delete it") from None


def _save_state(home: str, state: dict) -> None:
    tmp = _state_path(home) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=2)
    os.replace(tmp, _state_path(home))  # never a half-written state file


# --- processes --------------------------------------------------------------------------

def _process(entry: dict | None) -> psutil.Process | None:
    """The live process an entry records, or None: gone, a zombie, or its pid reused since."""
    if not entry:
        return None
    try:
        proc = psutil.Process(entry["pid"])
        if proc.status() == psutil.STATUS_ZOMBIE or abs(proc.create_time() - entry["started"]) > 1:
            return None
        return proc
    except psutil.Error:
        return None


def _spawn(home: str, name: str, cmd: list[str], env: dict[str, str]) -> dict:
    """Start `cmd` in a new session (its own process group) logging to <home>/logs/NAME.log."""
    log_path = os.path.join(home, "logs", f"{name}.log")
    with open(log_path, "ab") as log:
        log.write(f"\n--- {datetime.datetime.now().isoformat(timespec='seconds')} {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return {"pid": proc.pid, "started": psutil.Process(proc.pid).create_time(), "log": log_path,
            "cmd": cmd}


def _stop(entry: dict) -> bool:
    """SIGTERM the entry's process group and its descendants, SIGKILL what is left after
    STOP_TIMEOUT. False when nothing of it was running."""
    proc = _process(entry)
    if proc is None:
        return False
    pgid = entry["pid"]  # start_new_session: the group id is the leader's pid
    procs = [proc]
    with contextlib.suppress(psutil.Error):
        procs += proc.children(recursive=True)
    for p in procs:  # flow-run processes start their own sessions: signal them one by one
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(p.pid) != pgid:
                p.terminate()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=STOP_TIMEOUT)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(ProcessLookupError):  # any group member that outlived its parent
        os.killpg(pgid, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=5)
    return True


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT port is free
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _port_owner(port: int) -> str:
    """' (pid N, NAME)' for the process listening on `port`, where we may see it."""
    with contextlib.suppress(psutil.Error, OSError):
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
                return f" (pid {c.pid}, {psutil.Process(c.pid).name()})"
    return ""


# --- readiness probes -------------------------------------------------------------------

def _http_json(url: str, body: dict | None = None, timeout: float = 10):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def _answers(name: str, entry: dict, state: dict) -> bool:
    """Whether the component answers on its port (or, for workers, is registered)."""
    try:
        if name == "prefect-server":
            return _http_json(f"{entry['api_url']}/health") is True
        if name == "dask-scheduler":
            with socket.create_connection((HOST, entry["port"]), timeout=2):
                pass
            return _dask_counts(entry) is not None
        if name == "dask-workers":
            counts = _dask_counts(state["components"]["dask-scheduler"])
            return counts is not None and counts["workers"] >= entry["n_workers"]
        if name == "prefect-worker":
            api = state["components"]["prefect-server"]["api_url"]
            for w in _http_json(f"{api}/work_pools/{POOL}/workers/filter", {}):
                beat = w.get("last_heartbeat_time")
                if w["name"] == entry["name"] and w.get("status") == "ONLINE" and beat and \
                        datetime.datetime.fromisoformat(beat).timestamp() >= entry["started"] - 1:
                    return True
            return False
    except (OSError, ValueError, KeyError, urllib.error.URLError):
        return False
    raise ValueError(name)


def _dask_counts(scheduler_entry: dict) -> dict | None:
    try:
        return _http_json(f"http://{HOST}:{scheduler_entry['dashboard_port']}/json/counts.json")
    except (OSError, ValueError, urllib.error.URLError):
        return None


def _wait_ready(name: str, entry: dict, state: dict) -> None:
    deadline = time.monotonic() + READY_TIMEOUT[name]
    while not _answers(name, entry, state):
        proc = _process(entry)
        if proc is None:
            raise StackError(f"{name} exited during start-up; see {entry['log']}")
        if time.monotonic() > deadline:
            raise StackError(f"{name} (pid {entry['pid']}) did not become ready within "
                             f"{READY_TIMEOUT[name]} s; see {entry['log']}")
        time.sleep(0.5)


# --- up ---------------------------------------------------------------------------------

def _base_env(home: str, api_url: str) -> dict[str, str]:
    """The environment of every stack process: our Prefect home and server, project on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_PREFECT_SETTINGS}
    env.update(PREFECT_HOME=os.path.join(home, "prefect"), PREFECT_API_URL=api_url,
               PREFECT_SERVER_ANALYTICS_ENABLED="false",
               # Dask workers put their local directory (with a spill folder named `storage`)
               # first on sys.path; a real path entry for the project wins over that folder
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               PWD=ROOT)  # prefect.yaml's pull step reads {{ $PWD }}
    return env


def _deployments() -> list[str]:
    """Names of the deployments in prefect.yaml (all of them get deployed)."""
    import yaml

    path = os.path.join(ROOT, "prefect.yaml")
    try:
        with open(path) as f:
            spec = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise StackError(f"no prefect.yaml at {path}; the stack deploys what it lists") from None
    except yaml.YAMLError as e:
        raise StackError(f"prefect.yaml is not valid YAML: {str(e).splitlines()[0]}") from None
    names = [d.get("name") for d in spec.get("deployments") or []]
    if not names or not all(names):
        raise StackError(f"{path} lists no deployments (or one without a name); add them under `deployments:`")
    return names


def _prefect_cli(args: list[str], env: dict[str, str], log_path: str, what: str, timeout: float = 300) -> None:
    try:
        out = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=ROOT, env=env,
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise StackError(f"{what} took over {timeout:.0f} s; see {log_path}") from None
    with open(log_path, "a") as log:
        log.write(f"\n--- prefect {' '.join(args)} (exit {out.returncode})\n{out.stdout}{out.stderr}")
    if out.returncode:
        last = next((ln.strip() for ln in reversed((out.stdout + out.stderr).splitlines()) if ln.strip()), "")
        raise StackError(f"{what} failed (exit {out.returncode}): {last}; see {log_path}")


def _api(api_url: str, path: str, body: dict | None = None):
    """A Prefect API call during `up`: its JSON, None for 404, else a StackError."""
    try:
        return _http_json(f"{api_url}{path}", body, timeout=60)  # a busy 2-core machine is slow
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise StackError(f"the Prefect server answered {e.code} to {path}") from None
    except (OSError, urllib.error.URLError) as e:
        raise StackError(f"the Prefect server at {api_url} did not answer {path} ({e})") from None


def _deploy_all(home: str, env: dict[str, str], api_url: str) -> list[str]:
    """Create the work pool if missing and deploy every deployment of prefect.yaml."""
    names = _deployments()
    log_path = os.path.join(home, "logs", "deploy.log")
    if _api(api_url, f"/work_pools/{POOL}") is None:
        _prefect_cli(["work-pool", "create", POOL, "--type", "process"], env, log_path,
                     f"creating work pool {POOL}")
    _prefect_cli(["--no-prompt", "deploy", "--all"], env, log_path, "prefect deploy --all")
    deployed = {d["name"] for d in _api(api_url, "/deployments/filter", {})}
    missing = [n for n in names if n not in deployed]
    if missing:
        raise StackError(f"prefect deploy --all did not create {', '.join(missing)}; see {log_path}")
    return names


def _tls_flags(state: dict) -> list[str]:
    """`dask scheduler/worker` flags for the stack's certificates ([] without --tls)."""
    if not state.get("tls"):
        return []
    from pipelines.cluster import TLS_FILES

    ca, cert, key = (os.path.join(state["tls"], name) for name in TLS_FILES)
    return ["--tls-ca-file", ca, "--tls-cert", cert, "--tls-key", key]


def _commands(name: str, home: str, state: dict, args, gpus: int) -> tuple[list[str], dict]:
    """The command line of a component and what its entry records besides pid and log."""
    py = sys.executable
    comps = state["components"]
    tls = _tls_flags(state)
    protocol = "tls" if tls else "tcp"
    if name == "prefect-server":
        url = f"http://{HOST}:{args.prefect_port}"
        return ([py, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(args.prefect_port),
                 "--analytics-off"], {"port": args.prefect_port, "url": url, "api_url": f"{url}/api"})
    if name == "dask-scheduler":
        return ([py, "-m", "dask", "scheduler", "--host", HOST, "--port", str(args.scheduler_port),
                 "--protocol", protocol, *tls, "--dashboard-address", f"{HOST}:{args.dashboard_port}"],
                {"port": args.scheduler_port, "url": f"{protocol}://{HOST}:{args.scheduler_port}",
                 "dashboard_port": args.dashboard_port,
                 "dashboard": f"http://{HOST}:{args.dashboard_port}/status"})
    if name == "dask-workers":
        # --dashboard-address: a worker serves /health and /metrics even without its dashboard,
        # by default on all interfaces
        common = [comps["dask-scheduler"]["url"], "--host", HOST, "--nthreads", "1", "--no-dashboard",
                  "--dashboard-address", f"{HOST}:0", "--local-directory", os.path.join(home, "dask-workers"),
                  *tls]  # with TLS: the protocol follows the scheduler's tls:// address
        if gpus:  # one worker per GPU, as pipelines.cluster.make_cluster gives local clusters
            return [py, "-m", "dask", "cuda", "worker", *common, "--resources", "gpu=1"], \
                {"n_workers": gpus, "kind": "gpu", "url": f"{gpus} gpu workers"}
        return [py, "-m", "dask", "worker", *common, "--nworkers", str(args.workers), "--resources", "cpu=1"], \
            {"n_workers": args.workers, "kind": "cpu", "url": f"{args.workers} cpu workers"}
    if name == "prefect-worker":
        return ([py, "-m", "prefect", "--no-prompt", "worker", "start", "--pool", POOL, "--type", "process",
                 "--name", WORKER_NAME],
                {"name": WORKER_NAME, "url": f"pool {POOL}", "scheduler": comps["dask-scheduler"]["url"],
                 "tls": state.get("tls")})
    raise ValueError(name)


def _component_env(name: str, base: dict[str, str], state: dict) -> dict[str, str]:
    from pipelines.cluster import SCHEDULER_CONFIG, SCHEDULER_ENV, TLS_ENV, worker_environment

    env = dict(base)
    if state.get("tls") and name in ("dask-scheduler", "dask-workers"):  # no plain comm at all
        env["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"] = "True"
    if name == "dask-scheduler":
        env.update({"DASK_" + key.upper().replace(".", "__").replace("-", "_"): str(value)
                    for key, value in SCHEDULER_CONFIG.items()})
    if name == "dask-workers":
        env.update(worker_environment())  # JAX compile cache, quiet Prefect
    if name == "prefect-worker":  # inherited by every flow run this worker starts
        env[SCHEDULER_ENV] = state["components"]["dask-scheduler"]["url"]
        env.pop(TLS_ENV, None)
        if state.get("tls"):  # connect() in a flow run loads these certificates
            env[TLS_ENV] = state["tls"]
    return env


def _gpu_workers() -> int:
    """GPUs to give a `dask cuda worker`, 0 for CPU workers (also without dask-cuda)."""
    from pipelines.cluster import gpu_count

    gpus = gpu_count()
    if gpus:
        try:
            import dask_cuda  # noqa: F401
        except ImportError:
            print(f"marl stack: {gpus} GPU(s) visible but dask-cuda is missing; starting CPU workers "
                  "(pip install 'marl-dataflow[cuda]' for GPU workers)")
            return 0
    return gpus


def cmd_up(args) -> int:
    home = os.path.abspath(args.home)
    try:
        _check_args(args)  # before anything is written or started
        state = _load_state(home) or {}
        comps = state.setdefault("components", {})
        for name in COMPONENTS:  # every port that a start will need
            if _process(comps.get(name)) is None:
                _check_ports_free(name, args)
        tls = _check_tls(args, state, home)
        os.makedirs(os.path.join(home, "logs"), exist_ok=True)
        with open(os.path.join(home, ".gitignore"), "w") as f:  # a database and logs, not code
            f.write("*\n")
        state.update(home=home, root=ROOT, tls=tls)
        # a shell without job control hands background jobs SIGINT=ignored, and exec keeps
        # that: Prefect (which turns SIGTERM into SIGINT) would then never stop
        if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        gpus = None
        for name in COMPONENTS:
            if name == "prefect-worker":  # pool and deployments exist before a worker polls
                api_url = comps["prefect-server"]["api_url"]
                names = _deploy_all(home, _base_env(home, api_url), api_url)
                print(f"{'deployments':15s} {', '.join(names)} on work pool {POOL}")
            entry = comps.get(name)
            # a Prefect worker hands its flow runs the scheduler address it was started with
            stale = name == "prefect-worker" and entry and (entry.get("scheduler"), entry.get("tls")) != \
                (comps["dask-scheduler"]["url"], tls)
            if _process(entry) and not stale and _answers(name, entry, state):
                print(f"{name:15s} running   pid {entry['pid']:<7d} {entry.get('url', '')}  (reused)")
                continue
            if _process(entry):
                print(f"{name:15s} pid {entry['pid']} {'knows an old scheduler' if stale else 'does not answer'}; "
                      "restarting it")
                _stop(entry)
            if name == "dask-workers" and gpus is None:
                gpus = _gpu_workers()
            cmd, info = _commands(name, home, state, args, gpus or 0)
            _check_ports_free(name, args)
            api_url = comps["prefect-server"]["api_url"] if name != "prefect-server" else info["api_url"]
            entry = comps[name] = {**_spawn(home, name, cmd, _component_env(name, _base_env(home, api_url), state)),
                                   **info}
            _save_state(home, state)  # recorded before the wait, so `down` finds it either way
            _wait_ready(name, entry, state)
            print(f"{name:15s} started   pid {entry['pid']:<7d} {entry.get('url', '')}")
        state["urls"] = _urls(state)
        _save_state(home, state)
    except StackError as e:
        print(f"marl stack: {e}", file=sys.stderr)
        if os.path.exists(_state_path(home)):
            print(f"marl stack: what did start is recorded; `marl stack down --home {home}` stops it",
                  file=sys.stderr)
        return 2
    _print_urls(state)
    return 0


def _check_tls(args, state: dict, home: str) -> str | None:
    """The certificate directory of `--tls [DIR]` (its set made if it has none), or None; a
    running stack whose Dask processes were started otherwise is refused in one line."""
    from flows.checks import InputError, tls_security

    try:
        security = tls_security(args.tls, None)
    except InputError as e:
        raise StackError(str(e)) from None
    tls = os.path.dirname(security.tls_ca_file) if security else None
    running = [n for n in ("dask-scheduler", "dask-workers") if _process(state.get("components", {}).get(n))]
    if running and state.get("tls") != tls:
        have = f"with --tls {state['tls']}" if state.get("tls") else "without TLS"
        raise StackError(f"the stack in {home} runs its {' and '.join(running)} {have}; run "
                         f"`marl stack down --home {home}` first, then `up` with the TLS you want")
    return tls


def _check_ports_free(name: str, args) -> None:
    for port, flag in _ports(name, args):
        if not _port_free(port):
            raise StackError(f"port {port} for the {name} is in use by another process"
                             f"{_port_owner(port)}; stop it or choose another with {flag}")


def _check_args(args) -> None:
    from flows.checks import InputError, check_writable_path

    try:
        check_writable_path(args.home, "--home", directory=True)
    except InputError as e:
        raise StackError(str(e)) from None
    ports = {"--prefect-port": args.prefect_port, "--scheduler-port": args.scheduler_port,
             "--dashboard-port": args.dashboard_port}
    for flag, port in ports.items():
        if not 1 <= port <= 65535:
            raise StackError(f"{flag} {port} is not a port; give one in 1..65535")
    if len(set(ports.values())) < len(ports):
        raise StackError(f"the ports must differ; got {', '.join(f'{f} {p}' for f, p in ports.items())}")
    if args.workers < 1:
        raise StackError(f"--workers {args.workers}: give at least 1")


def _ports(name: str, args) -> list[tuple[int, str]]:
    return {"prefect-server": [(args.prefect_port, "--prefect-port")],
            "dask-scheduler": [(args.scheduler_port, "--scheduler-port"),
                               (args.dashboard_port, "--dashboard-port")]}.get(name, [])


def _urls(state: dict) -> dict:
    comps = state["components"]
    return {"prefect_ui": comps["prefect-server"]["url"], "prefect_api": comps["prefect-server"]["api_url"],
            "dask_scheduler": comps["dask-scheduler"]["url"], "dask_dashboard": comps["dask-scheduler"]["dashboard"]}


def _print_urls(state: dict) -> None:
    urls = state.get("urls") or _urls(state)
    print(f"Prefect UI:      {urls['prefect_ui']}")
    print(f"Dask dashboard:  {urls['dask_dashboard']}")
    print(f"Dask scheduler:  {urls['dask_scheduler']}")
    if state.get("tls"):
        print(f"TLS:             certificates in {state['tls']}; marl train PRESET --scheduler "
              f"{urls['dask_scheduler']} --tls {state['tls']}")
    print(f"state:           {_state_path(state['home'])}")
    print(f"use it:          export PREFECT_API_URL={urls['prefect_api']}; "
          "prefect deployment run marl-train/qmix-smac --watch")


# --- down / status ----------------------------------------------------------------------

def cmd_down(args) -> int:
    home = os.path.abspath(args.home)
    try:
        state = _load_state(home)
    except StackError as e:
        print(f"marl stack: {e}", file=sys.stderr)
        return 2
    if not state or not state.get("components"):
        print(f"marl stack: nothing to stop (no stack recorded in {home})")
        return 0
    comps = state["components"]
    for name in reversed(COMPONENTS):  # the Prefect worker (and its flow runs) first
        if name in comps:
            entry = comps.pop(name)
            print(f"{name:15s} {'stopped' if _stop(entry) else 'was not running'}  pid {entry['pid']}")
            _save_state(home, state)
    os.remove(_state_path(home))
    print(f"stack in {home} is down")
    return 0


def cmd_status(args) -> int:
    home = os.path.abspath(args.home)
    try:
        state = _load_state(home)
    except StackError as e:
        print(f"marl stack: {e}", file=sys.stderr)
        return 2
    if not state or not state.get("components"):
        print(f"marl stack: down (no stack recorded in {home}); start it with `marl stack up`")
        return 1
    comps = state["components"]
    running = 0
    print(f"stack in {home}")
    for name in COMPONENTS:
        entry = comps.get(name)
        if entry is None:
            print(f"  {name:15s} not started")
            continue
        alive = _process(entry) is not None
        answers = alive and _answers(name, entry, state)
        where = entry.get("url", "")
        if name == "dask-workers":
            counts = _dask_counts(comps.get("dask-scheduler", {})) if alive else None
            where = f"{counts['workers'] if counts else 0}/{entry['n_workers']} {entry['kind']} workers"
        word = "running" if answers else ("not answering" if alive else "dead")
        running += answers
        print(f"  {name:15s} {word:13s} pid {entry['pid']:<7d} {where}")
    if running == len(COMPONENTS):
        _print_urls(state)
        return 0
    print(f"marl stack: {len(COMPONENTS) - running} of {len(COMPONENTS)} components not running; "
          "`marl stack up` starts what is missing")
    return 1


def add_commands(sub) -> None:
    p = sub.add_parser("stack", help="the local Prefect server, work pool, worker, deployments and Dask cluster",
                       description="The local stack on 127.0.0.1: Prefect server + work pool "
                       f"{POOL} + worker + every prefect.yaml deployment, Dask scheduler + workers.")
    ssub = p.add_subparsers(dest="stack_command", required=True)

    def with_home(q):
        q.add_argument("--home", default=DEFAULT_HOME,
                       help=f"where the stack keeps its Prefect database, logs and state (default {DEFAULT_HOME})")
        return q

    up = with_home(ssub.add_parser(
        "up", help="start what is not running yet; print the UI and dashboard URLs",
        description="Start, on 127.0.0.1, whatever of the stack is not running yet (Prefect server, "
        "Dask scheduler and workers, work pool and deployments, Prefect worker) and print the "
        "Prefect UI and Dask dashboard URLs. Running it again reuses what runs."))
    up.add_argument("--prefect-port", type=int, default=4200, help="Prefect server and UI port (default 4200)")
    up.add_argument("--scheduler-port", type=int, default=8786, help="Dask scheduler port (default 8786)")
    up.add_argument("--dashboard-port", type=int, default=8787, help="Dask dashboard port (default 8787)")
    up.add_argument("--workers", type=int, default=2,
                    help="Dask CPU worker processes (default 2; with GPUs: one worker per GPU)")
    up.add_argument("--tls", nargs="?", const=True, default=False, metavar="DIR",
                    help="Dask scheduler and workers speak TLS only, with DIR's ca.pem, cert.pem, key.pem "
                    "(default ~/.config/marl/tls, self-signed ones made there when it has none); "
                    "connect with marl train --scheduler tls://... --tls DIR")
    up.set_defaults(fn=cmd_up)
    down = with_home(ssub.add_parser(
        "down", help="stop every process the stack started",
        description="Stop exactly the process groups recorded in <home>/stack.json (flow runs "
        f"included): SIGTERM, then SIGKILL after {STOP_TIMEOUT} s."))
    down.set_defaults(fn=cmd_down)
    status = with_home(ssub.add_parser(
        "status", help="what runs (pid, URL, alive); exit 1 if not all of it",
        description="Print each component of the stack (running / not answering / dead, pid, URL); "
        "exit 1 unless all of them run."))
    status.set_defaults(fn=cmd_status)
